//! `--metrics`: a real Prometheus scrapes the agent traced on the demo trainer, and what
//! it stored matches the trainer's own numbers.

use std::io::{Read as _, Write as _};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::{Agent, Target, fixtures, median, privileged, steps_and_totals};

/// `GET path` on `addr` with the given Accept header; the status code and body.
fn get(addr: &str, path: &str, accept: &str) -> (u32, String) {
    let Ok(mut stream) = std::net::TcpStream::connect(addr) else {
        return (0, String::new());
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
    let _ = write!(
        stream,
        "GET {path} HTTP/1.0\r\nHost: {addr}\r\nAccept: {accept}\r\n\r\n"
    );
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer);
    let status = answer
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = answer
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}

/// Percent-encodes a query for a URL.
fn encode(query: &str) -> String {
    query
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A Prometheus server of the test's own, killed when dropped.
struct Prometheus {
    child: Child,
    addr: String,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Prometheus {
    /// Starts Debian's `prometheus` scraping `target` every second; waits until it is
    /// ready.
    fn start(dir: &std::path::Path, target: &str) -> Prometheus {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let config = dir.join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\nscrape_configs:\n  - \
                 job_name: nccltrace\n    static_configs:\n      - targets: ['{target}']\n"
            ),
        )
        .unwrap();
        let addr = format!("127.0.0.1:{port}");
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("tsdb").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("prometheus (Debian's package, installed by `cargo xtask setup`)");
        let server = Prometheus { child, addr };
        let started = Instant::now();
        while get(&server.addr, "/-/ready", "*/*").0 != 200 {
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "prometheus not ready in 60 s"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        server
    }

    /// Waits until the agent was scraped at least `n` times (at most 30 s): Prometheus
    /// starts its scrape loops up to a few seconds after it is ready.
    fn scrapes(&self, n: f64) -> f64 {
        let started = Instant::now();
        loop {
            let seen = self
                .value(r#"count_over_time(up{job="nccltrace"}[10m])"#)
                .unwrap_or(0.0);
            if seen >= n {
                return seen;
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "{seen} scrapes of {n} in 30 s"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// An instant query's one value (None when it has no result).
    fn value(&self, query: &str) -> Option<f64> {
        let (status, body) = get(
            &self.addr,
            &format!("/api/v1/query?query={}", encode(query)),
            "application/json",
        );
        assert_eq!(status, 200, "{query}: {body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        let result = v["data"]["result"].as_array()?;
        assert!(result.len() <= 1, "{query}: {body}");
        result.first()?["value"][1].as_str()?.parse().ok()
    }
}

impl Prometheus {
    /// An instant query's series: each one's `job_id` and value.
    fn series(&self, query: &str) -> Vec<(String, f64)> {
        let (status, body) = get(
            &self.addr,
            &format!("/api/v1/query?query={}", encode(query)),
            "application/json",
        );
        assert_eq!(status, 200, "{query}: {body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        v["data"]["result"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|r| {
                let job = r["metric"]["job_id"].as_str().unwrap_or("").to_owned();
                Some((job, r["value"][1].as_str()?.parse().ok()?))
            })
            .collect()
    }
}

/// The address the agent said it serves its metrics on.
fn metrics_addr(agent: &Agent) -> String {
    agent
        .before
        .iter()
        .find_map(|l| Some(l.split("http://").nth(1)?.split('/').next()?.to_owned()))
        .unwrap_or_else(|| panic!("no metrics address said: {:?}", agent.before))
}

/// `promtool check metrics` (Prometheus's own parser and linter) finds nothing wrong.
fn promtool_accepts(text: &str) {
    let mut promtool = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool (Debian's prometheus package)");
    promtool
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let linted = promtool.wait_with_output().unwrap();
    assert!(
        linted.status.success(),
        "promtool check metrics: {}{}\n{text}",
        String::from_utf8_lossy(&linted.stdout),
        String::from_utf8_lossy(&linted.stderr)
    );
}

/// The trainer runs 600 steps and lingers; Prometheus scrapes the agent every second.
/// Through Prometheus's query API: the target was up for at least two scrapes, the step
/// histogram counts the trainer's steps, and the mean step, the compute and NCCL-wait
/// shares and the AllReduce calls match what the trainer says it did, within 15%. The
/// labels carry the rank's environment. Also: the 0.0.4 text format passes `promtool
/// check metrics`, and a scrape after the agent stopped is refused, not left hanging.
#[test]
#[ignore = "needs root, loads eBPF programs: run `cargo xtask test`"]
fn prometheus_scrapes_the_run() {
    let _guard = privileged();
    let dir = tempfile::tempdir().unwrap();
    let go = dir.path().join("go");
    let busy = dir.path().join("busy.log");
    let steps = 600;
    let trainer = Target::spawn(
        &fixtures().join("trainer"),
        &[
            "--steps",
            &steps.to_string(),
            "--compute-us",
            "2000",
            "--go-file",
            go.to_str().unwrap(),
            "--linger-ms",
            "6000",
        ],
        &[
            ("FAKE_NCCL_US", "300"),
            ("RANK", "5"),
            ("LOCAL_RANK", "1"),
            ("SLURM_JOB_ID", "4242"),
            ("FAKE_CUDA_BUSY", busy.to_str().unwrap()),
        ],
        dir.path(),
    );
    let out = dir.path().join("out");
    let metrics = ["--metrics", "127.0.0.1:0"];
    let agent = super::gpu::attach_with_nvml(trainer.child.id(), &out, &metrics, &busy, &[]);
    let addr = metrics_addr(&agent);
    let prometheus = Prometheus::start(dir.path(), &addr);
    prometheus.scrapes(1.0);
    trainer.release();
    let mut truth = Vec::new();
    let mut stdout = trainer.stdout;
    let totals: Value = loop {
        let line = stdout.next().expect("trainer output").unwrap();
        let v: Value = serde_json::from_str(&line).unwrap();
        if v.get("total").is_some() {
            break v["total"].clone();
        }
        truth.push(v);
    };
    // Two scrapes after the last step (the trainer lingers meanwhile).
    let before = prometheus.scrapes(0.0);
    prometheus.scrapes(before + 2.0);
    let (status, text) = get(&addr, "/metrics", "text/plain");
    assert_eq!(status, 200);
    promtool_accepts(&text);
    let rank = r#"{job="nccltrace",rank="5",local_rank="1",job_id="4242"}"#;
    let value = |q: &str| {
        prometheus
            .value(q)
            .unwrap_or_else(|| panic!("no result for {q}"))
    };
    assert!(value(r#"up{job="nccltrace"}"#) > 0.5, "target down");
    let count = value(&format!("nccltrace_step_seconds_count{rank}"));
    let within = |what: &str, ours: f64, theirs: f64| {
        assert!(
            (ours - theirs).abs() <= 0.15 * theirs,
            "{what}: {ours} vs the trainer's {theirs}"
        );
    };
    within("steps", count, f64::from(steps));
    let sum = value(&format!("nccltrace_step_seconds_sum{rank}"));
    let n = truth.len() as f64;
    let field = |k: &str| truth.iter().map(|s| s[k].as_f64().unwrap()).sum::<f64>() / n / 1e9;
    within("mean step (s)", sum / count, field("wall_ns"));
    let share = |category: &str| {
        let selector = rank.replace('}', &format!(",category=\"{category}\"}}"));
        value(&format!("nccltrace_step_category_seconds_total{selector}")) / sum
    };
    // The trainer's compute is its step less its faults and waits: ours with the time
    // the scheduler and migrations took from it (a busy 2-CPU host preempts it).
    let on_cpu: f64 = ["compute", "runqueue", "cpu_migration", "other_offcpu"]
        .iter()
        .map(|c| share(c))
        .sum();
    within(
        "compute share (with runqueue, migrations, other off-CPU)",
        on_cpu,
        field("compute_ns") / field("wall_ns"),
    );
    // The trainer's communicator has one rank: its waits are the GPU's.
    within(
        "gpu_wait share",
        share("gpu_wait"),
        field("wait_ns") / field("wall_ns"),
    );
    let selector = rank.replace('}', ",op=\"AllReduce\"}");
    within(
        "AllReduce calls",
        value(&format!("nccltrace_nccl_calls_total{selector}")),
        totals["calls"]["AllReduce"].as_f64().unwrap(),
    );
    gpu_series_scraped(&prometheus, &busy);
    let code = agent.wait(Duration::from_secs(60)).0;
    assert_eq!(code, 0);
    // The agent is gone: a scrape is refused at once, never left waiting.
    let started = Instant::now();
    assert_eq!(get(&addr, "/metrics", "*/*").0, 0);
    assert!(started.elapsed() < Duration::from_secs(2));
}

/// Issue 53: the GPU's series, scraped by Prometheus: its busy time as the stand-in
/// libcuda's log of its GPU work has it (every step's work sampled by the stand-in NVML,
/// within 15%), power and the clock-event reasons as NVML said.
fn gpu_series_scraped(prometheus: &Prometheus, busy: &std::path::Path) {
    let value = |q: &str| {
        prometheus
            .value(q)
            .unwrap_or_else(|| panic!("no result for {q}"))
    };
    let gpu = r#"{job="nccltrace",gpu="0"}"#;
    let logged = super::gpu::busy_log(busy)
        .iter()
        .map(|(s, e)| (e - s) as f64 / 1e9)
        .sum::<f64>();
    let ours = value(&format!("nccltrace_gpu_busy_seconds_total{gpu}"));
    assert!(
        (ours - logged).abs() <= 0.15 * logged,
        "GPU busy {ours} s against {logged} s in the log"
    );
    assert!(value(&format!("nccltrace_gpu_sampled_seconds_total{gpu}")) > ours);
    let power = value(&format!("nccltrace_gpu_power_watts{gpu}"));
    assert!((power - 312.0).abs() < 1e-9, "{power} W");
    let reason = gpu.replace('}', ",reason=\"sw_power_cap\"}");
    let capped = value(&format!("nccltrace_gpu_clock_event_reason{reason}"));
    assert!(capped.abs() < 1e-9, "{capped}");
}

/// On a terminal, the status line says the steps attributed so far, the last one's time
/// and its largest category (the agent runs under `script`, which gives it a terminal).
#[test]
#[ignore = "needs root, loads eBPF programs: run `cargo xtask test`"]
fn status_line_shows_the_steps() {
    let _guard = privileged();
    let dir = tempfile::tempdir().unwrap();
    let steps = 800;
    let trainer = super::waiting_trainer(dir.path(), steps, 2000);
    let out = dir.path().join("out");
    let typescript = dir.path().join("typescript");
    let command = format!(
        "{} attach --pid {} --out {}",
        env!("CARGO_BIN_EXE_nccltrace"),
        trainer.child.id(),
        out.display()
    );
    let mut script = Command::new("script")
        .args(["-qec", &command])
        .arg(&typescript)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .expect("script (util-linux)");
    // The agent has attached when it wrote its doctor's report.
    let started = Instant::now();
    while !out.join("doctor.json").exists() {
        assert!(started.elapsed() < Duration::from_secs(60), "no attach");
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(500));
    trainer.release();
    let truth = trainer.finish();
    assert!(script.wait().unwrap().success());
    let text = String::from_utf8_lossy(&std::fs::read(&typescript).unwrap()).into_owned();
    let last = text
        .split(['\r', '\n'])
        .rfind(|l| l.contains("steps, last"))
        .unwrap_or_else(|| panic!("no step status: {text}"));
    let shown: u64 = last
        .split("lost")
        .nth(1)
        .and_then(|r| r.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("{last}"));
    assert!(
        shown > 0 && shown <= truth["total"]["steps"].as_u64().unwrap(),
        "{last}"
    );
    assert!(last.contains(" ms (") && last.contains("%)"), "{last}");
}

/// The value of the one series named `name` whose labels include each of `labels`.
fn sample(text: &str, name: &str, labels: &[&str]) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (series, value) = l.rsplit_once(' ')?;
        let (n, rest) = series.split_once('{').unwrap_or((series, "}"));
        (n == name && labels.iter().all(|kv| rest.contains(kv))).then(|| value.parse().ok())?
    })
}

/// The metrics of the recording in `out`, as `--metrics` would have served them at its end.
fn replayed_metrics(out: &std::path::Path) -> String {
    use nccltrace::attribute::StepRule;
    let rec = out.join("recording.nctr");
    let empty = tempfile::tempdir().unwrap();
    let host = nccltrace::host::Host::at(empty.path());
    let metrics = std::sync::Arc::new(nccltrace::metrics::Metrics::new(host.clone()));
    let mut reader = nccltrace::record::Reader::open(&rec).unwrap();
    let mut agg = nccltrace::pipeline::Aggregator::new(reader.header.clone());
    agg.stream(StepRule::Auto, nccltrace::pipeline::EPOCH_EVENTS);
    agg.add_sink(Box::new(nccltrace::metrics::Feed::new(
        metrics.clone(),
        host,
        &reader.header,
    )));
    agg.feed(&mut reader);
    drop(agg.finish(StepRule::Auto));
    metrics.encode()
}

/// The three-rank run of `counts::three_ranks_one_straggler` (rank 1 slowed) as metrics:
/// one series per rank, numbered as the summary numbers them, and rank 1 caused most of
/// the others' waiting and arrived latest on average.
pub(super) fn straggler_in_metrics(out: &std::path::Path, summary: &Value) {
    let text = replayed_metrics(out);
    let per_rank = |name: &str, rank: u32| {
        sample(&text, name, &[&format!("rank=\"{rank}\"")])
            .unwrap_or_else(|| panic!("no {name} for rank {rank}: {text}"))
    };
    let caused: Vec<f64> = (0..3)
        .map(|r| per_rank("nccltrace_collective_wait_caused_seconds_total", r))
        .collect();
    let total: f64 = caused.iter().sum();
    let share = summary["straggler"]["share_of_waits"].as_f64().unwrap();
    assert!(
        (caused[1] / total - share).abs() < 0.01,
        "{caused:?} vs the summary's share {share}"
    );
    let mean_late = |r| {
        per_rank("nccltrace_collective_lateness_seconds_total", r)
            / per_rank("nccltrace_collectives_matched_total", r)
    };
    assert!(
        mean_late(1) > mean_late(0) && mean_late(1) > mean_late(2),
        "{text}"
    );
}

/// With `--all --follow`, a rank whose process exits keeps its series for the grace
/// period (the last scrapes see its final counts), then they are removed while the agent
/// goes on serving the others.
#[test]
#[ignore = "needs root, loads eBPF programs: run `cargo xtask test`"]
fn series_of_a_gone_rank_are_removed_after_the_grace() {
    let _guard = privileged();
    let dir = tempfile::tempdir().unwrap();
    let go = dir.path().join("go");
    let trainer = Target::spawn(
        &fixtures().join("trainer"),
        &[
            "--steps",
            "300",
            "--compute-us",
            "500",
            "--go-file",
            go.to_str().unwrap(),
        ],
        &[("RANK", "7")],
        dir.path(),
    );
    let out = dir.path().join("out");
    let agent = Agent::attach_many(
        &[],
        &out,
        &[
            "--all",
            "--follow",
            "--duration",
            "60s",
            "--profile",
            "minimal",
            "--metrics",
            "127.0.0.1:0",
            "--metrics-grace",
            "8s",
        ],
    );
    let addr = metrics_addr(&agent);
    trainer.release();
    trainer.finish();
    let exited = Instant::now();
    let steps = || {
        let (status, text) = get(&addr, "/metrics", "text/plain");
        assert_eq!(status, 200, "{text}");
        sample(&text, "nccltrace_step_seconds_count", &["rank=\"7\""])
    };
    // Within the grace: there, with the run's steps (the attribution follows the
    // recording a second or so behind).
    let seen = loop {
        if let Some(n) = steps().filter(|n| *n > 100.0) {
            break n;
        }
        assert!(
            exited.elapsed() < Duration::from_secs(7),
            "rank 7's steps not served within the grace period: {:?}",
            steps()
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(seen <= 300.0, "{seen} steps");
    // After it (ticks are a second apart): gone, and the agent still serves.
    let started = Instant::now();
    while steps().is_some() {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "rank 7's series still served 20 s after its process exited"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(exited.elapsed() >= Duration::from_secs(8));
    let mut child = agent.child;
    // SAFETY: a plain kill of our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    assert!(child.wait().unwrap().success());
}

/// A trainer of its own job (`FAKE_NCCL_UID` `name`, no launcher variables), waiting for
/// its go file in `dir/name` before it makes its communicator.
fn job_of(dir: &std::path::Path, name: &str, steps: &str, extra: &[&str]) -> Target {
    let sub = dir.join(name);
    std::fs::create_dir(&sub).unwrap();
    let go = sub.join("go");
    // Its communicator made once released: the agent sees the init, and its unique id.
    let mut args = vec![
        "--steps",
        steps,
        "--go-file",
        go.to_str().unwrap(),
        "--init-after-go",
    ];
    args.extend_from_slice(extra);
    Target::spawn(
        &fixtures().join("trainer"),
        &args,
        &[("FAKE_NCCL_UID", name)],
        &sub,
    )
}

/// The `job_id` whose AllReduce calls (`series[2]`) are the trainer's `totals`; its step
/// count (`series[0]`) is the trainer's `steps` less at most three held back or cut at
/// its exit, their mean (`series[1]` over the count) within 15% of the trainer's.
fn job_in_metrics(
    name: &str,
    steps: &[Value],
    totals: &Value,
    series: &[Vec<(String, f64)>; 3],
) -> String {
    let [counts, sums, calls] = series;
    let want = totals["calls"]["AllReduce"].as_f64().unwrap();
    let (label, _) = calls
        .iter()
        .find(|(_, v)| (*v - want).abs() < 0.5)
        .unwrap_or_else(|| panic!("{name}: no series of {want} AllReduce calls: {calls:?}"));
    assert!(label.starts_with("nccl-"), "{name}: job_id {label}");
    let of = |series: &[(String, f64)]| match series.iter().find(|(l, _)| l == label) {
        Some(s) => s.1,
        None => panic!("{name}: no step series of job_id {label}: {series:?}"),
    };
    let (count, sum) = (of(counts), of(sums));
    let n = steps.len() as f64;
    assert!(
        count <= n + 1.0 && count >= n - 3.0,
        "{name}: {count} steps in /metrics, its trainer's {n}"
    );
    let mean = steps
        .iter()
        .map(|s| s["wall_ns"].as_f64().unwrap())
        .sum::<f64>()
        / n
        / 1e9;
    assert!(
        (sum / count - mean).abs() <= 0.15 * mean,
        "{name}: mean step {} s, its trainer's {mean}",
        sum / count
    );
    label.clone()
}

/// Regression (issue 52): a daemon (`--all --follow --metrics`) left on a node followed the
/// first job's rank for the whole run: a second job's steps never reached /metrics or
/// steps.json. Three stand-in jobs, none with a launcher's variables: A (1,500 steps); B,
/// started while A runs and outlasting it; C, started after B exited. Prometheus,
/// scraping every second, ends with a step histogram per job under a `job_id` of its own
/// (its communicator's unique id): A's and C's counts are their trainers' steps (less at
/// most three held back or cut at the exit), B's the steps its trainer began after A's
/// process exited (steps.json `jobs`); each job's mean step within 15% of its trainer's
/// own, its AllReduce calls exactly its trainer's.
#[test]
#[ignore = "needs root, loads eBPF programs: run `cargo xtask test`"]
fn a_daemon_follows_job_after_job() {
    let _guard = privileged();
    let dir = tempfile::tempdir().unwrap();
    // A's 1,500 steps take at least 6 s (2 ms compute, 2 ms of stand-in GPU wait): B
    // starts about 3.5 s into them, and its 3,000 steps of at least 3 ms outlast A. Each
    // is released once the agent has found it (at attach; later, it looks every second).
    let a = job_of(dir.path(), "job-a", "1500", &["--compute-us", "2000"]);
    let out = dir.path().join("out");
    let agent = Agent::attach_many(
        &[],
        &out,
        &[
            "--all",
            "--follow",
            "--duration",
            "90s",
            "--profile",
            "minimal",
            "--metrics",
            "127.0.0.1:0",
            "--metrics-grace",
            "120s",
        ],
    );
    let addr = metrics_addr(&agent);
    let prometheus = Prometheus::start(dir.path(), &addr);
    a.release();
    std::thread::sleep(Duration::from_millis(1000));
    let b = job_of(dir.path(), "job-b", "3000", &["--compute-us", "1000"]);
    std::thread::sleep(Duration::from_millis(2500));
    b.release();
    let a = steps_and_totals(a);
    let b = steps_and_totals(b);
    let c = job_of(dir.path(), "job-c", "300", &["--compute-us", "1000"]);
    std::thread::sleep(Duration::from_millis(2500));
    c.release();
    let c = steps_and_totals(c);
    // Three scrapes after C exited: its steps are final once its exit is read.
    let before = prometheus.scrapes(0.0);
    prometheus.scrapes(before + 3.0);
    let counts = prometheus.series("nccltrace_step_seconds_count");
    let sums = prometheus.series("nccltrace_step_seconds_sum");
    let calls = prometheus.series(r#"nccltrace_nccl_calls_total{op="AllReduce"}"#);
    // SAFETY: a plain kill of our own child.
    unsafe { libc::kill(agent.child.id() as i32, libc::SIGINT) };
    let (code, stdout, stderr) = agent.wait_for_exit(Duration::from_secs(60));
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("3 jobs followed"), "{stdout}");
    let steps_json: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("steps.json")).unwrap()).unwrap();
    let jobs = steps_json["jobs"].as_array().unwrap();
    eprintln!("{jobs:#?}");
    assert_eq!(jobs.len(), 3, "{jobs:#?}");
    let a_exit = jobs[0]["exited_ns"].as_u64().unwrap();
    // B's steps after A's exit: its steps that began then (by its own clock).
    let b_after: Vec<Value> =
        b.0.iter()
            .filter(|s| s["start_ns"].as_u64().unwrap() >= a_exit)
            .cloned()
            .collect();
    assert!(
        b_after.len() + 100 < b.0.len(),
        "B did not run beside A: {} of its {} steps after A's exit",
        b_after.len(),
        b.0.len()
    );
    let series = [counts, sums, calls];
    let mut labels = vec![
        job_in_metrics("A", &a.0, &a.1, &series),
        job_in_metrics("B", &b_after, &b.1, &series),
        job_in_metrics("C", &c.0, &c.1, &series),
    ];
    labels.dedup();
    assert_eq!(labels.len(), 3, "{labels:?}");
    // Stdout's line a job, its median step within 15% of its trainer's.
    for (i, (job, steps)) in jobs.iter().zip([&a.0, &b_after, &c.0]).enumerate() {
        let head = format!("job {}: pid {} ", i + 1, job["rank_pid"]);
        let line = stdout
            .lines()
            .find(|l| l.trim_start().starts_with(&head))
            .unwrap_or_else(|| panic!("no {head:?} in {stdout}"));
        let said: f64 = line
            .split("median ")
            .nth(1)
            .and_then(|m| m.split(' ').next()?.parse().ok())
            .unwrap_or_else(|| panic!("no median in {line:?}"));
        let theirs = median(
            steps
                .iter()
                .map(|s| s["wall_ns"].as_f64().unwrap() / 1e6)
                .collect(),
        );
        assert!(
            (said - theirs).abs() <= 0.15 * theirs,
            "{line}: the trainer's median {theirs} ms"
        );
    }
}
