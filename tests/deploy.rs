//! The deployment recipes in deploy/ (docs/deploy.md), checked without root: the
//! Kubernetes manifests and the container image run this agent with arguments it accepts
//! and the access it needs; the alert rules and the Grafana dashboard are valid PromQL
//! (Prometheus's own `promtool`) over series the agent serves; the alert rules fire as
//! their unit tests say.

use nccltrace::pipeline::Sink as _;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use clap::Parser as _;
use serde_json::Value;

fn deploy(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy")
        .join(rel)
}

fn yaml(rel: &str) -> serde_yaml::Value {
    serde_yaml::from_str(&std::fs::read_to_string(deploy(rel)).unwrap())
        .unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// The agent's own parser accepts `args` (a recipe written for another version fails).
fn accepted(args: &[String]) {
    let mut line = vec!["nccltrace".to_owned()];
    line.extend_from_slice(args);
    if let Err(e) = nccltrace::cli::Cli::try_parse_from(&line) {
        panic!("nccltrace refuses {line:?}: {e}");
    }
}

fn strings(v: &serde_yaml::Value) -> Vec<String> {
    v.as_sequence()
        .unwrap_or_else(|| panic!("not a list: {v:?}"))
        .iter()
        .map(|s| s.as_str().unwrap().to_owned())
        .collect()
}

fn promtool(args: &[&str], dir: &Path) {
    let out = Command::new("promtool")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("promtool (Debian's prometheus package, installed by `cargo xtask setup`)");
    assert!(
        out.status.success(),
        "promtool {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The DaemonSet: one agent per node on the host's pids, not privileged but with the
/// capabilities attach needs, the host's BTF and tracefs, arguments this binary accepts
/// (`--all --follow --metrics`), and the metrics port it binds declared and annotated for
/// scraping.
#[test]
fn kubernetes_daemonset() {
    let ds = yaml("kubernetes/daemonset.yaml");
    assert_eq!(ds["apiVersion"], "apps/v1");
    assert_eq!(ds["kind"], "DaemonSet");
    let labels = &ds["spec"]["template"]["metadata"]["labels"];
    assert_eq!(&ds["spec"]["selector"]["matchLabels"], labels);
    let pod = &ds["spec"]["template"]["spec"];
    assert_eq!(pod["hostPID"], true);
    let container = &pod["containers"][0];
    let args = strings(&container["args"]);
    accepted(&args);
    for flag in ["attach", "--all", "--follow", "--metrics"] {
        assert!(args.iter().any(|a| a == flag), "{flag} in {args:?}");
    }
    let metrics = &args[args.iter().position(|a| a == "--metrics").unwrap() + 1];
    let port: u64 = metrics.rsplit(':').next().unwrap().parse().unwrap();
    assert_eq!(container["ports"][0]["containerPort"].as_u64(), Some(port));
    let annotations = &ds["spec"]["template"]["metadata"]["annotations"];
    assert_eq!(annotations["prometheus.io/port"], port.to_string().as_str());
    let security = &container["securityContext"];
    assert_eq!(security["privileged"], false);
    let added = strings(&security["capabilities"]["add"]);
    for cap in ["BPF", "PERFMON", "SYS_PTRACE"] {
        assert!(added.iter().any(|c| c == cap), "{cap} in {added:?}");
    }
    let mounts: Vec<&str> = container["volumeMounts"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|m| m["mountPath"].as_str().unwrap())
        .collect();
    for path in ["/sys/kernel/btf", "/sys/kernel/tracing"] {
        assert!(mounts.contains(&path), "{path} in {mounts:?}");
    }
    // Every mount has its volume.
    let volumes: Vec<&str> = pod["volumes"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|v| v["name"].as_str().unwrap())
        .collect();
    for m in container["volumeMounts"].as_sequence().unwrap() {
        assert!(volumes.contains(&m["name"].as_str().unwrap()), "{m:?}");
    }
    let monitor = yaml("kubernetes/podmonitor.yaml");
    assert_eq!(monitor["kind"], "PodMonitor");
    assert_eq!(&monitor["spec"]["selector"]["matchLabels"], labels);
    assert_eq!(
        monitor["spec"]["podMetricsEndpoints"][0]["port"],
        container["ports"][0]["name"]
    );
}

/// The image: it copies the binary `cargo build --release` makes, and its default
/// command is one this binary accepts.
#[test]
fn container_image() {
    let text = std::fs::read_to_string(deploy("container/Containerfile")).unwrap();
    let line = |word: &str| {
        text.lines()
            .find(|l| l.starts_with(word))
            .unwrap_or_else(|| panic!("no {word} in the Containerfile"))
    };
    assert!(line("COPY ").contains("target/release/nccltrace "));
    let json =
        |l: &str| -> Vec<String> { serde_json::from_str(l.split_once(' ').unwrap().1).unwrap() };
    assert_eq!(json(line("ENTRYPOINT ")), ["/usr/local/bin/nccltrace"]);
    accepted(&json(line("CMD ")));
}

/// The alert rules are valid, and fire (and stay quiet) as their unit tests say.
#[test]
fn prometheus_alert_rules() {
    let dir = deploy("prometheus");
    promtool(&["check", "rules", "alerts.yml"], &dir);
    promtool(&["test", "rules", "alerts.test.yml"], &dir);
}

/// Every series a recipe queries, as `nccltrace_…` names.
fn series_names(expr: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = expr;
    while let Some(at) = rest.find("nccltrace_") {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        names.push(tail[..end].to_owned());
        rest = &tail[end..];
    }
    names
}

/// Feeds one step, one collective and one CUDA sync of a rank, with its cross-rank
/// tallies: every per-rank family gets a series.
fn one_step_of_every_kind(
    metrics: &std::sync::Arc<nccltrace::metrics::Metrics>,
    host: nccltrace::host::Host,
) {
    use nccltrace::event::{Call, Event, Func, GpuReading, Task};
    let header = nccltrace::record::Header {
        gpus: vec![nccltrace::record::GpuInfo {
            name: "NVIDIA H100 80GB HBM3".to_owned(),
            uuid: "GPU-0".to_owned(),
            minor: Some(0),
        }],
        ..Default::default()
    };
    let mut feed = nccltrace::metrics::Feed::new(metrics.clone(), host, &header);
    // A GPU read through NVML: every figure.
    feed.event(&Event::Gpu {
        ts_ns: 2_000,
        task: Task::default(),
        reading: GpuReading {
            gpu: 0,
            busy: Some((1_000, 90)),
            sm_clock_mhz: Some(1980),
            mem_clock_mhz: Some(2619),
            temperature_c: Some(40),
            power_mw: Some(300_000),
            throttle: Some(4),
            memory_used: Some(1 << 30),
            processes: Some(2),
        },
    });
    let call = |func: Func| {
        Event::Call(Call {
            count: Some(4),
            datatype: Some(7),
            bytes: Some(16),
            comm: Some(1),
            ..Call::new(
                Task {
                    tgid: 1,
                    tid: 1,
                    cpu: 0,
                },
                func,
                1_000,
                2_000,
            )
        })
    };
    feed.event(&call(Func::AllReduce));
    feed.event(&call(Func::CuStreamSynchronize));
    let compute = nccltrace::attribute::Categories {
        compute: 5_000,
        ..Default::default()
    };
    let step = nccltrace::attribute::Step::new(0, 0, 5_000, compute);
    feed.epoch(&nccltrace::attribute::Epoch {
        steps: vec![step],
        detail: nccltrace::attribute::Detail {
            rank_pid: Some(1),
            ..Default::default()
        },
        lateness: vec![nccltrace::attribute::ranks::Lateness {
            pid: 1,
            caused_ns: 1,
            behind_ns: 1,
            matched: 1,
        }],
    });
}

fn write(root: &Path, rel: &str, text: &str) {
    let path = root.join(rel);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, text).unwrap();
}

/// Every sample name the agent serves: from the exposition of a host with NUMA nodes and
/// an InfiniBand port, lost events and a doctor's finding (per-rank families are
/// declared before their first step).
fn served() -> Vec<String> {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    write(
        root,
        "sys/devices/system/node/node0/numastat",
        "numa_hit 1\nnuma_miss 0\n",
    );
    let port = "sys/class/infiniband/mlx5_0/ports/1";
    write(root, &format!("{port}/state"), "4: ACTIVE\n");
    write(root, &format!("{port}/rate"), "400 Gb/sec (4X NDR)\n");
    write(root, &format!("{port}/counters/port_xmit_data"), "8\n");
    write(root, &format!("{port}/counters/symbol_error"), "0\n");
    write(root, &format!("{port}/hw_counters/np_cnp_sent"), "0\n");
    let pid = std::process::id();
    let own = |f: &str| std::fs::read_to_string(format!("/proc/{pid}/{f}")).unwrap();
    write(root, &format!("proc/{pid}/stat"), &own("stat"));
    write(root, &format!("proc/{pid}/status"), &own("status"));
    let host = nccltrace::host::Host::at(root);
    let metrics = std::sync::Arc::new(nccltrace::metrics::Metrics::new(host.clone()));
    one_step_of_every_kind(&metrics, host);
    metrics.set_lost(&[("call".to_owned(), 0)].into());
    metrics.set_findings(
        &serde_json::json!({"findings": [{"id": "memory_remote", "severity": "Warn"}]}),
    );
    let mut names = Vec::new();
    for line in metrics.encode().lines() {
        let Some(rest) = line.strip_prefix("# TYPE ") else {
            continue;
        };
        let (name, kind) = rest.split_once(' ').unwrap();
        let suffixes: &[&str] = match kind {
            "counter" => &["_total"],
            "histogram" => &["_bucket", "_sum", "_count"],
            _ => &[""],
        };
        names.extend(suffixes.iter().map(|s| format!("{name}{s}")));
    }
    names
}

/// The dashboard: valid JSON, every panel's queries valid PromQL (checked by promtool as
/// recording rules, Grafana's variables given values), over series the agent serves.
#[test]
fn grafana_dashboard() {
    let dashboard: Value = serde_json::from_str(
        &std::fs::read_to_string(deploy("grafana/nccltrace-dashboard.json")).unwrap(),
    )
    .unwrap();
    assert!(dashboard["schemaVersion"].as_u64().unwrap() >= 36);
    let mut exprs = Vec::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        assert!(panel["gridPos"]["w"].as_u64().unwrap() <= 24, "{panel}");
        for target in panel["targets"].as_array().unwrap() {
            exprs.push(target["expr"].as_str().unwrap().to_owned());
        }
    }
    assert!(exprs.len() >= 10);
    let known = served();
    for expr in &exprs {
        for name in series_names(expr) {
            assert!(
                known.contains(&name),
                "{name} (in {expr}) is not served: {known:?}"
            );
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let mut rules = String::from("groups:\n  - name: dashboard\n    rules:\n");
    for (i, expr) in exprs.iter().enumerate() {
        let concrete = expr
            .replace("$__rate_interval", "5m")
            .replace("$host", ".*")
            .replace("$job_id", ".*");
        let quoted = serde_json::to_string(&concrete).unwrap();
        let _ = writeln!(
            rules,
            "      - record: dashboard:panel_{i}\n        expr: {quoted}"
        );
    }
    std::fs::write(dir.path().join("dashboard.yml"), rules).unwrap();
    promtool(&["check", "rules", "dashboard.yml"], dir.path());
    // The alert rules query only served series too.
    let alerts = std::fs::read_to_string(deploy("prometheus/alerts.yml")).unwrap();
    for name in series_names(&alerts) {
        assert!(
            known.contains(&name),
            "{name} (in alerts.yml) is not served"
        );
    }
}
