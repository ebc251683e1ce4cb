//! Replays, without root, recordings made on a real H200 (PyTorch 2.11, NCCL 2.28.9,
//! world size 1; see docs/validation.md): `nccltrace report` must find what the training
//! scripts said they did. These are regression tests for what the stand-in libraries did
//! not show: DDP all-reduces from the autograd thread while the main thread syncs, and a
//! step whose collectives repeat with a shorter period than the step.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

fn data(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/data/h200")
        .join(name)
}

/// Runs `nccltrace report REC --out OUT EXTRA…`, which must succeed; returns what it
/// printed.
fn report(rec: &Path, out: &Path, extra: &[&str]) -> String {
    let run = Command::new(env!("CARGO_BIN_EXE_nccltrace"))
        .arg("report")
        .arg(rec)
        .arg("--out")
        .arg(out)
        .args(extra)
        .output()
        .unwrap();
    assert!(run.status.success(), "{run:?}");
    String::from_utf8(run.stdout).unwrap()
}

/// Decompresses a stored recording and runs `report` on it; returns summary and steps.
fn replay(name: &str) -> (Value, Value) {
    let dir = tempfile::tempdir().unwrap();
    let rec = unpacked(name, dir.path());
    let out = dir.path().join("out");
    report(&rec, &out, &[]);
    let read = |f: &str| -> Value {
        serde_json::from_str(&std::fs::read_to_string(out.join(f)).unwrap()).unwrap()
    };
    (read("summary.json"), read("steps.json"))
}

fn script(name: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(data(&format!("{name}-script.json"))).unwrap())
        .unwrap()
}

/// DDP: every bucketed all-reduce the comm hook counted; one step per iteration, cut at
/// the main thread's `.item()` sync; the main thread is the rank thread, and its waits
/// for the autograd thread are compute, not `other_offcpu`.
#[test]
fn h200_ddp_recording() {
    let (summary, steps) = replay("ddp");
    let truth = script("ddp");
    assert_eq!(
        summary["nccl"]["by_op"]["AllReduce"]["calls"],
        truth["allreduce_calls"]
    );
    assert_eq!(summary["lost_events"], 0);
    let found = steps["steps"].as_array().unwrap().len() as i64;
    assert!(
        (found - truth["steps"].as_i64().unwrap()).abs() <= 1,
        "{found} steps"
    );
    assert_eq!(steps["period"], 4);
    assert_eq!(steps["rank_tid"], steps["rank_pid"]);
    let (mut other, mut wall) = (0, 0);
    for s in steps["steps"].as_array().unwrap() {
        other += s["categories_ns"]["other_offcpu"].as_u64().unwrap();
        wall += s["wall_ns"].as_u64().unwrap();
    }
    assert!(other * 20 < wall, "other_offcpu is {other} of {wall} ns");
}

/// Gradients all-reduced by hand: 12 calls a step alternating two sizes (the key
/// sequence repeats every 2), found as 12-collective steps thanks to the sync.
#[test]
fn h200_allreduce_recording() {
    let (summary, steps) = replay("allreduce");
    let truth = script("allreduce");
    assert_eq!(
        summary["nccl"]["by_op"]["AllReduce"]["calls"],
        truth["allreduce_calls"]
    );
    let found = steps["steps"].as_array().unwrap().len() as i64;
    assert!(
        (found - truth["steps"].as_i64().unwrap()).abs() <= 1,
        "{found} steps"
    );
    assert_eq!(steps["period"], 12);
    for s in steps["steps"].as_array().unwrap() {
        assert_eq!(s["nccl"]["collectives"], 12, "step {}", s["index"]);
    }
}

/// Decompresses a stored recording into `dir`; returns its path.
fn unpacked(name: &str, dir: &Path) -> PathBuf {
    let rec = dir.join(format!("{name}.nctr"));
    let xz = Command::new("xz")
        .arg("-dc")
        .arg(data(&format!("{name}.nctr.xz")))
        .output()
        .expect("xz (Debian's xz-utils)");
    assert!(xz.status.success());
    std::fs::write(&rec, xz.stdout).unwrap();
    rec
}

/// Regression (issue 17): `report … | head -1` exited 1 ("Broken pipe") and `report … 2>&1
/// | head -4` sometimes 101 (a panic written to the closed pipe). With stdout and stderr
/// both closed pipes, the report ends quietly with every file written in full.
#[test]
fn closed_stdout_and_stderr_end_quietly() {
    let dir = tempfile::tempdir().unwrap();
    let rec = unpacked("allreduce", dir.path());
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let out = dir.path().join("out");
    let status = Command::new(env!("CARGO_BIN_EXE_nccltrace"))
        .arg("report")
        .arg(&rec)
        .arg("--out")
        .arg(&out)
        .stdout(writer.try_clone().unwrap())
        .stderr(writer)
        .status()
        .unwrap();
    assert_eq!(status.code(), Some(0));
    let summary: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    assert!(summary["nccl"]["calls"].as_u64().unwrap() > 0);
    let trace: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("trace.json")).unwrap()).unwrap();
    assert!(
        trace["traceEvents"]
            .as_array()
            .is_some_and(|e| !e.is_empty())
    );
    assert!(out.join("flamegraph-attributed.svg").exists());
}

/// Regression (issue 17): a damaged byte in the middle of a recording dropped every record
/// after it (half the run). Now the report resumes at the next whole record: the summary
/// names the skipped stretch, and nearly every NCCL call is still counted.
#[test]
fn damage_in_the_middle_loses_only_its_record() {
    let dir = tempfile::tempdir().unwrap();
    let rec = unpacked("allreduce", dir.path());
    let summary_of = |rec: &Path, out: &Path| -> Value {
        report(rec, out, &[]);
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap()
    };
    let clean = summary_of(&rec, &dir.path().join("clean"));
    let mut bytes = std::fs::read(&rec).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0xff;
    let damaged_rec = dir.path().join("damaged.nctr");
    std::fs::write(&damaged_rec, &bytes).unwrap();
    let damaged = summary_of(&damaged_rec, &dir.path().join("damaged"));
    assert!(clean["damaged"].is_null());
    let what = damaged["damaged"].as_str().expect("damage named");
    assert!(what.contains("1 damaged stretch"), "{what}");
    assert!(
        damaged["incomplete"].is_null(),
        "the closing record is read: {damaged}"
    );
    let calls = |s: &Value| s["nccl"]["calls"].as_u64().unwrap();
    assert!(
        calls(&damaged) + 1 >= calls(&clean) && calls(&damaged) <= calls(&clean),
        "{} of {}",
        calls(&damaged),
        calls(&clean)
    );
    assert!(damaged["events"].as_u64().unwrap() + 1 >= clean["events"].as_u64().unwrap());
}

/// The run attributed in epochs as it is read, each epoch's outputs written as it closes
/// (issue 18), gives what the whole run at once gives: every output file the same but the
/// epoch count (and trace.json's order), on both H200 recordings, with epochs small enough
/// that each recording takes several.
#[test]
fn epochs_give_the_outputs_of_one_epoch() {
    for name in ["ddp", "allreduce"] {
        let dir = tempfile::tempdir().unwrap();
        let rec = unpacked(name, dir.path());
        let report = |epoch_events: u64| -> PathBuf {
            let out = dir.path().join(format!("out-{epoch_events}"));
            report(&rec, &out, &["--epoch-events", &epoch_events.to_string()]);
            out
        };
        let (whole, epochs) = (report(0), report(2000));
        let mut files: Vec<String> = std::fs::read_dir(&whole)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        files.sort();
        assert!(files.len() >= 12, "{files:?}");
        for file in files {
            let (a, b) = (whole.join(&file), epochs.join(&file));
            let read = |p: &Path| -> Value {
                serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
            };
            if file == "trace.json" {
                // Written an epoch at a time: the same events, in another order.
                let events = |p: &Path| -> Vec<String> {
                    let mut e: Vec<String> = read(p)["traceEvents"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(Value::to_string)
                        .collect();
                    e.sort();
                    e
                };
                assert!(events(&a) == events(&b), "{name}: trace.json differs");
            } else if file == "steps.json" {
                let (mut a, mut b) = (read(&a), read(&b));
                assert_eq!(a["epochs"], 1, "{name}");
                assert!(
                    b["epochs"].as_u64().unwrap() >= 3,
                    "{name}: {}",
                    b["epochs"]
                );
                a["epochs"] = Value::Null;
                b["epochs"] = Value::Null;
                assert!(a == b, "{name}: steps.json differs");
            } else {
                assert!(
                    std::fs::read(&a).unwrap() == std::fs::read(&b).unwrap(),
                    "{name}: {file} differs"
                );
            }
        }
    }
}

/// The value of the one series in an exposition whose name is `name` and whose labels
/// include every `key="value"` of `labels`; None when there is no such series.
fn sample(text: &str, name: &str, labels: &[&str]) -> Option<f64> {
    let mut found = text
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let (n, rest) = series.split_once('{').unwrap_or((series, "}"));
            (n == name && labels.iter().all(|kv| rest.contains(kv))).then(|| value.parse().unwrap())
        });
    let first = found.next();
    assert!(found.next().is_none(), "several {name} {labels:?} series");
    first
}

/// `--metrics` follows the attribution: replaying the DDP recording with the metrics fed,
/// the step histogram counts the steps of steps.json, its sum is their wall time, each
/// category's seconds are the steps' sum, and the NCCL calls by operation are the
/// summary's. The rank is numbered as the summary numbers it; the environment's labels
/// (none here: this host has no such process) are read from the live process.
#[test]
fn metrics_follow_the_attribution() {
    use nccltrace::attribute::StepRule;
    use nccltrace::metrics::{Feed, Metrics};
    let dir = tempfile::tempdir().unwrap();
    let rec = unpacked("ddp", dir.path());
    let out = dir.path().join("out");
    std::fs::create_dir(&out).unwrap();
    let empty = dir.path().join("empty-host");
    std::fs::create_dir(&empty).unwrap();
    let host = nccltrace::host::Host::at(&empty);
    let metrics = std::sync::Arc::new(Metrics::new(host.clone()));
    let mut reader = nccltrace::record::Reader::open(&rec).unwrap();
    let mut agg = nccltrace::pipeline::Aggregator::new(reader.header.clone());
    agg.stream(StepRule::Auto, nccltrace::pipeline::EPOCH_EVENTS);
    agg.stream_into(&out).unwrap();
    let mut header = reader.header.clone();
    header.hostname = "node7".into();
    agg.add_sink(Box::new(Feed::new(metrics.clone(), host, &header)));
    agg.feed(&mut reader);
    let mut outputs = agg.finish(StepRule::Auto);
    nccltrace::pipeline::write_outputs(&out, &mut outputs, &mut std::io::sink()).unwrap();
    nccltrace::pipeline::write_summary(&out, &outputs.summary).unwrap();
    let text = metrics.encode();
    let read = |f: &str| -> Value {
        serde_json::from_str(&std::fs::read_to_string(out.join(f)).unwrap()).unwrap()
    };
    let (steps, summary) = (read("steps.json"), read("summary.json"));
    let steps = steps["steps"].as_array().unwrap();
    assert!(steps.len() > 100, "{} steps", steps.len());
    // Numbered as the summary numbers it: one process, rank 0 by pid order.
    assert_eq!(summary["ranks"][0]["rank"], 0);
    let rank = ["host=\"node7\"", "rank=\"0\"", "job_id=\"\""];
    let count = sample(&text, "nccltrace_step_seconds_count", &rank).unwrap();
    assert_eq!(count as usize, steps.len());
    let wall: u64 = steps.iter().map(|s| s["wall_ns"].as_u64().unwrap()).sum();
    let sum = sample(&text, "nccltrace_step_seconds_sum", &rank).unwrap();
    assert!(
        (sum - wall as f64 / 1e9).abs() < 1e-6,
        "{sum} s vs {wall} ns"
    );
    for (name, _) in steps[0]["categories_ns"].as_object().unwrap() {
        let label = format!("category=\"{name}\"");
        let ours = sample(&text, "nccltrace_step_category_seconds_total", &[&label]);
        let theirs: Option<u64> = steps
            .iter()
            .map(|s| s["categories_ns"][name].as_u64())
            .sum();
        match theirs {
            // Counters only get series for what was measured.
            Some(ns) => assert!((ours.unwrap() - ns as f64 / 1e9).abs() < 1e-6, "{name}"),
            None => assert_eq!(ours, None, "{name} is not measured: no series"),
        }
    }
    for (op, stats) in summary["nccl"]["by_op"].as_object().unwrap() {
        let label = format!("op=\"{op}\"");
        let calls = sample(&text, "nccltrace_nccl_calls_total", &[&label]);
        assert_eq!(calls, stats["calls"].as_f64(), "{op}");
    }
    // Nothing of a host this replay does not run on: no NUMA or InfiniBand series.
    assert!(!text.contains("nccltrace_numa_pages"), "{text}");
    assert!(!text.contains("nccltrace_infiniband"), "{text}");
    assert!(text.ends_with("# EOF\n"));
}

/// The outputs of the stored H200 recordings, byte for byte, against golden files
/// (`tests/data/golden/h200-NAME-FILE`; `NCCLTRACE_BLESS=1` rewrites them): a change in
/// what `report` finds, or in how it writes it, shows here as a diff to review (issue 18:
/// the streaming attribution must keep today's outputs).
#[test]
fn outputs_match_the_golden_files() {
    let golden = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data/golden");
    let bless = std::env::var_os("NCCLTRACE_BLESS").is_some();
    for name in ["ddp", "allreduce"] {
        let dir = tempfile::tempdir().unwrap();
        let rec = unpacked(name, dir.path());
        let out = dir.path().join("out");
        let words = report(&rec, &out, &[]);
        for file in ["summary.json", "steps.json", "steps.csv", "summary.txt"] {
            let actual = if file == "summary.txt" {
                words.clone()
            } else {
                std::fs::read_to_string(out.join(file)).unwrap()
            };
            let path = golden.join(format!("h200-{name}-{file}"));
            if bless {
                std::fs::write(&path, &actual).unwrap();
                continue;
            }
            let expected = std::fs::read_to_string(&path).unwrap_or_else(|e| {
                panic!("{}: {e} (NCCLTRACE_BLESS=1 writes it)", path.display())
            });
            if actual != expected {
                let line = actual
                    .lines()
                    .zip(expected.lines())
                    .position(|(a, b)| a != b)
                    .unwrap_or(0);
                panic!(
                    "{} differs from its golden file at line {} (NCCLTRACE_BLESS=1 to update):\n  \
                     now:    {}\n  golden: {}",
                    path.display(),
                    line + 1,
                    actual.lines().nth(line).unwrap_or(""),
                    expected.lines().nth(line).unwrap_or("")
                );
            }
        }
    }
}

/// One InfiniBand reading of two ports at `at` (ns after `t0`), all counters or the data
/// and packet ones: port 0 sends one 4-byte word a microsecond and receives one every two,
/// with a symbol error a second; port 1 moves nothing.
fn ib_reading(writer: &mut nccltrace::record::Writer, t0: u64, at: u64, full: bool) {
    use nccltrace_common::{IB_COUNTER_NAMES, IB_FAST};
    let read = |i: usize| full || IB_FAST & (1 << i) != 0;
    for port in 0..2u32 {
        let counters: Vec<(u8, u64)> = (0..IB_COUNTER_NAMES.len())
            .filter(|&i| read(i))
            .map(|i| {
                let value = match (port, i) {
                    (0, 0) => (at - t0) / 1000,
                    (0, 1) => (at - t0) / 2000,
                    (0, 7) => (at - t0) / 1_000_000_000,
                    (1, 0) => 5,
                    _ => 0,
                };
                (i as u8, value)
            })
            .collect();
        let record = nccltrace::decode::ib_reading(at, port, &counters);
        writer.kernel(&record).unwrap();
    }
}

/// `rec` with InfiniBand readings added as the session writes them, but five times as
/// often (data counters every 20 ms, all every 100 ms, one more at the end); returns the
/// new recording, when tracing started and the last record's time.
fn with_ib_readings(rec: &Path, dir: &Path) -> (PathBuf, u64, u64) {
    use nccltrace::record::{Reader, Record, Writer};
    let mut reader = Reader::open(rec).unwrap();
    let mut header = reader.header.clone();
    header.infiniband_ports = vec!["mlx5_0/1".into(), "mlx5_1/1".into()];
    header.infiniband_every_ms = Some(20);
    header.infiniband_refused = None;
    let t0 = header.clock.monotonic_ns;
    let with_ib = dir.join("ib.nctr");
    let mut writer = Writer::create(&with_ib, &header).unwrap();
    ib_reading(&mut writer, t0, t0, true);
    let (mut next, mut readings, mut end) = (t0 + 20_000_000, 1u64, t0);
    while let Some(record) = reader.next_record().unwrap() {
        match record {
            Record::Kernel(bytes) => {
                let ts = u64::from_le_bytes(bytes[..8].try_into().unwrap());
                while ts > next {
                    ib_reading(&mut writer, t0, next, readings % 5 == 0);
                    (next, readings) = (next + 20_000_000, readings + 1);
                }
                end = end.max(ts);
                writer.kernel(&bytes).unwrap();
            }
            Record::Meta(meta) => writer.meta(&meta).unwrap(),
        }
    }
    ib_reading(&mut writer, t0, end, true);
    writer.finish().unwrap();
    assert!(readings > 50, "{readings} readings: the run is long enough");
    (with_ib, t0, end)
}

/// Issue 19: each step's InfiniBand traffic, from the ports' counters the agent reads
/// while tracing: the H200 all-reduce recording (2 s) with readings added
/// ([`with_ib_readings`]). Each step must get its own wall time's worth, whether the run
/// is attributed whole or in epochs (which then wait for the next full reading), and
/// summary.json and stdout the run's totals.
#[test]
fn infiniband_counters_give_each_step_its_traffic() {
    let dir = tempfile::tempdir().unwrap();
    let rec = unpacked("allreduce", dir.path());
    let (with_ib, t0, end) = with_ib_readings(&rec, dir.path());

    let read = |out: &Path, f: &str| -> Value {
        serde_json::from_str(&std::fs::read_to_string(out.join(f)).unwrap()).unwrap()
    };
    let mut all = Vec::new();
    for epoch_events in ["0", "2000"] {
        let out = dir.path().join(format!("out-{epoch_events}"));
        let said = report(&with_ib, &out, &["--epoch-events", epoch_events]);
        // The run's totals on stdout, with the errors the ports counted.
        let line = said
            .lines()
            .find(|l| l.starts_with("InfiniBand mlx5_0/1: "))
            .unwrap_or_else(|| panic!("{said}"));
        assert!(line.ends_with(" received, symbol_error 1"), "{line}");
        assert!(
            said.contains("InfiniBand mlx5_1/1: 0.0 MB sent, "),
            "{said}"
        );
        let steps = read(&out, "steps.json");
        let method = steps["methods"]["infiniband"].as_str().unwrap();
        assert!(
            method.starts_with("estimated") && method.contains("mlx5_0/1, mlx5_1/1"),
            "{method}"
        );
        let list = steps["steps"].as_array().unwrap();
        assert!(list.len() > 100, "{}", list.len());
        for s in list {
            let wall = s["wall_ns"].as_u64().unwrap();
            let ib = &s["infiniband"];
            let port = &ib["mlx5_0/1"];
            let near = |v: &Value, bytes: u64| v.as_u64().is_some_and(|v| v.abs_diff(bytes) <= 8);
            assert!(near(&port["transmit_bytes"], wall / 1000 * 4), "{s}");
            assert!(near(&port["receive_bytes"], wall / 2000 * 4), "{s}");
            assert!(port["symbol_error"].as_u64().unwrap() <= 1, "{s}");
            assert_eq!(ib["mlx5_1/1"]["transmit_bytes"], 0, "{s}");
        }
        let summary = read(&out, "summary.json");
        let total = &summary["infiniband"]["mlx5_0/1"];
        assert_eq!(total["transmit_bytes"], (end - t0) / 1000 * 4, "{summary}");
        assert_eq!(total["symbol_error"], (end - t0) / 1_000_000_000);
        all.push(list.clone());
    }
    assert!(
        all[0] == all[1],
        "epochs attribute the counters as the whole run does"
    );

    // A recording made without InfiniBand ports says why, and has no per-step field.
    let out = dir.path().join("plain");
    report(&rec, &out, &[]);
    let steps = read(&out, "steps.json");
    assert!(steps["steps"][0].get("infiniband").is_none());
    assert!(read(&out, "summary.json").get("infiniband").is_none());
    let method = steps["methods"]["infiniband"].as_str().unwrap();
    assert!(method.starts_with("not read: "), "{method}");
}

/// An output that cannot be written (here a full disk: the file is a link to /dev/full)
/// is named in the error, and the outputs written on the other threads are complete:
/// steps.json and steps.csv on one, trace.json on another, the rest on the main thread.
#[test]
fn a_full_output_is_named_and_the_others_are_complete() {
    let dir = tempfile::tempdir().unwrap();
    let rec = unpacked("allreduce", dir.path());
    let complete = |out: &Path, name: &str| -> Value {
        serde_json::from_str(&std::fs::read_to_string(out.join(name)).unwrap())
            .unwrap_or_else(|e| panic!("{name}: {e}"))
    };
    for full in ["trace.json", "steps.json"] {
        let out = dir.path().join(format!("out-{full}"));
        std::fs::create_dir(&out).unwrap();
        std::os::unix::fs::symlink("/dev/full", out.join(full)).unwrap();
        let run = Command::new(env!("CARGO_BIN_EXE_nccltrace"))
            .arg("report")
            .arg(&rec)
            .arg("--out")
            .arg(&out)
            .arg("--force")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&run.stderr);
        assert_eq!(run.status.code(), Some(1), "{stderr}");
        assert!(
            stderr.contains(&format!("cannot write output {}", out.join(full).display()))
                && stderr.contains("No space left on device"),
            "{stderr}"
        );
        let summary = complete(&out, "summary.json");
        assert!(summary["nccl"]["calls"].as_u64().unwrap() > 0);
        // steps.csv is written beside steps.json: one failing does not stop the other.
        let csv = std::fs::read_to_string(out.join("steps.csv")).unwrap();
        let steps = csv.lines().count() as u64 - 1;
        assert!(steps > 100, "{steps} steps");
        if full == "trace.json" {
            let rows = complete(&out, "steps.json")["steps"]
                .as_array()
                .unwrap()
                .len();
            assert_eq!(rows as u64, steps);
        } else {
            let trace = complete(&out, "trace.json");
            let step_slices = trace["traceEvents"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|e| e["cat"] == "step")
                .count();
            assert_eq!(step_slices as u64, steps);
        }
    }
}
