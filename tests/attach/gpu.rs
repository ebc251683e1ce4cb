//! Issue 53: the GPUs the targets use, read through NVML while tracing. The stand-in
//! libnvidia-ml.so.1 answers utilization from the stand-in libcuda's own log of the
//! "GPU work" it ran (`FAKE_CUDA_BUSY`), as the driver answers from the GPU's: the log is
//! the truth each step's busy share is held to.

use super::{Agent, Target, fixtures, json, privileged, steps_and_totals};
use serde_json::Value;
use std::path::Path;
use std::time::Duration;

/// NVML's sampling period the stand-in is given (ms).
const PERIOD_MS: u64 = 5;

/// `attach --pid pid` with `extra` arguments, the stand-in NVML answering from the log at
/// `busy`, with `more` of its settings.
pub(super) fn attach_with_nvml(
    pid: u32,
    out: &Path,
    extra: &[&str],
    busy: &Path,
    more: &[(&str, &str)],
) -> Agent {
    let lib = fixtures().join("nvml/libnvidia-ml.so.1");
    let mut env = vec![
        ("NCCLTRACE_NVML", lib.to_str().unwrap()),
        ("FAKE_NVML_BUSY", busy.to_str().unwrap()),
    ];
    env.extend(more);
    Agent::attach_env(&[pid], out, extra, &env)
}

/// The log's intervals of GPU work, `(start, end)` CLOCK_MONOTONIC ns.
pub(super) fn busy_log(path: &Path) -> Vec<(u64, u64)> {
    let bytes = std::fs::read(path).unwrap();
    let word = |i: usize| u64::from_ne_bytes(bytes[i * 8..i * 8 + 8].try_into().unwrap());
    (0..word(0) as usize)
        .map(|i| (word(1 + 2 * i), word(2 + 2 * i)))
        .collect()
}

/// The share of `[a, b)` the log has work in.
fn busy_share(log: &[(u64, u64)], a: u64, b: u64) -> f64 {
    let covered: u64 = log
        .iter()
        .map(|&(s, e)| e.min(b).saturating_sub(s.max(a)))
        .sum();
    covered as f64 / (b - a) as f64
}

/// What one traced trainer left: summary.json, stdout, trace.json.
struct Traced {
    summary: Value,
    stdout: String,
    trace: Value,
}

/// A trainer of 30 steps that compute `compute_us` on the CPU and queue `launches` kernels
/// of 1 ms of GPU work, traced with the stand-in NVML sampling every [`PERIOD_MS`] and
/// reporting clock-event reasons `throttle`: what the agent wrote, each step's busy share
/// checked against the stand-in libcuda's log (within what two samples at its ends can
/// move it).
fn traced(compute_us: &str, launches: &str, throttle: &str, procs: &str) -> Traced {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("busy.log");
    let log_s = log.to_str().unwrap();
    let trainer = Target::spawn(
        &fixtures().join("trainer"),
        &[
            "--steps",
            "30",
            "--compute-us",
            compute_us,
            "--launches",
            launches,
            "--no-migrate",
        ],
        &[
            ("FAKE_CUDA_BUSY", log_s),
            ("FAKE_CUDA_KERNEL_US", "1000"),
            ("FAKE_CUDA_QUEUE_US", "200000"),
        ],
        dir.path(),
    );
    let out = dir.path().join("out");
    let period = PERIOD_MS.to_string();
    let more = [
        ("FAKE_NVML_PERIOD_MS", period.as_str()),
        ("FAKE_NVML_THROTTLE", throttle),
        ("FAKE_NVML_PROCS", procs),
    ];
    let agent = attach_with_nvml(trainer.child.id(), &out, &[], &log, &more);
    trainer.release();
    let (said, _) = steps_and_totals(trainer);
    assert_eq!(said.len(), 30);
    let (code, stdout, stderr) = agent.wait_for_exit(Duration::from_secs(60));
    assert_eq!(code, 0, "{stderr}");
    let truth = busy_log(&log);
    assert!(!truth.is_empty());
    let report = json(&out.join("steps.json"));
    let method = report["methods"]["gpu"].as_str().unwrap();
    assert!(
        method.starts_with("NVML's GPU utilization samples of 1 GPU (every GPU: no target had")
            && method.contains("read every 100 ms"),
        "{method}"
    );
    let steps = report["steps"].as_array().unwrap().clone();
    assert!(steps.len() >= 20, "{} steps", steps.len());
    for (i, s) in steps.iter().enumerate() {
        let (a, b) = (
            s["start_ns"].as_u64().unwrap(),
            s["end_ns"].as_u64().unwrap(),
        );
        let gpu = &s["gpu"][0];
        let busy = gpu["busy"].as_f64().unwrap_or_else(|| panic!("{s:#}"));
        let own = busy_share(&truth, a, b);
        // Two samples straddle the step's ends: each may hold a period of other time.
        let bound = 2.0 * PERIOD_MS as f64 * 1e6 / (b - a) as f64 + 0.01;
        assert!(
            (busy - own).abs() <= bound,
            "step {}: {busy} busy against {own:.3} in the log (± {bound:.3}): {gpu}",
            s["index"]
        );
        // Every step within the samples read; the last one's end may lie past the last.
        let to = gpu["to_ns"].as_u64().unwrap();
        assert!(
            gpu["from_ns"].as_u64().unwrap() <= a && (to >= b || i + 1 == steps.len() && to > a),
            "{gpu}"
        );
        assert!(gpu["samples"].as_u64().unwrap() >= 7, "{gpu}");
    }
    Traced {
        summary: json(&out.join("summary.json")),
        stdout,
        trace: json(&out.join("trace.json")),
    }
}

/// Steps of 5 ms on the CPU and 50 ms of GPU work, clocks held down by a software power
/// cap, three processes on the GPU: each step's busy share as the log's, the run's GPU,
/// clocks, power, reason and processes read, and the verdict GPU-bound.
#[test]
#[ignore = "needs root, loads eBPF programs: run `cargo xtask test`"]
fn steps_get_the_gpus_busy_share() {
    let _serial = privileged();
    let t = traced("5000", "50", "0x4", "101,102,103");
    let g = &t.summary["gpus"];
    assert!(g["refused"].is_null(), "{g:#}");
    let read = &g["read"][0];
    assert_eq!(read["processes_max"].as_u64(), Some(3), "{g:#}");
    assert!(read["name"].as_str().unwrap().contains("stand-in"), "{g:#}");
    assert!(
        read["sampled_ns"].as_u64().unwrap() > 1_000_000_000,
        "{g:#}"
    );
    assert_eq!(read["power_w_mean"].as_f64(), Some(312.0), "{g:#}");
    assert_eq!(read["sm_clock_mhz_max"].as_u64(), Some(1980), "{g:#}");
    assert_eq!(
        read["clock_event_reasons"],
        serde_json::json!(["sw_power_cap"])
    );
    assert!(
        t.stdout
            .contains("GPU 0 NVIDIA H100 80GB HBM3 (stand-in): busy ")
            && t.stdout.contains("clocks held down: sw_power_cap")
            && t.stdout.contains("shared by up to 3 processes")
            && t.stdout.contains("; GPU-bound: the GPU was busy "),
        "{}",
        t.stdout
    );
    // trace.json: the GPU's own track, its busy percent at each sample.
    let events = t.trace["traceEvents"].as_array().unwrap();
    let gpu_pid = events
        .iter()
        .find(|e| {
            e["name"] == "process_name"
                && e["args"]["name"]
                    .as_str()
                    .is_some_and(|n| n.starts_with("GPU 0: NVIDIA H100 80GB HBM3 (stand-in)"))
        })
        .map(|e| e["pid"].clone())
        .expect("the GPU's track");
    let busy: Vec<f64> = events
        .iter()
        .filter(|e| e["ph"] == "C" && e["pid"] == gpu_pid && e["name"] == "GPU busy %")
        .map(|e| e["args"]["busy"].as_f64().unwrap())
        .collect();
    assert!(busy.len() > 100, "{} counter events", busy.len());
    assert!(busy.iter().any(|b| *b >= 90.0) && busy.iter().all(|b| (0.0..=100.0).contains(b)));
}

/// Steps of 40 ms on the CPU and 5 ms of GPU work: the verdict host-bound, no clock held
/// down.
#[test]
#[ignore = "needs root, loads eBPF programs: run `cargo xtask test`"]
fn a_host_bound_step_is_said_so() {
    let _serial = privileged();
    let t = traced("40000", "5", "0", "");
    assert_eq!(
        t.summary["gpus"]["read"][0]["clock_event_reasons"],
        serde_json::json!([])
    );
    assert!(
        t.stdout.contains("; host-bound: the GPU idled 8") && !t.stdout.contains("held down"),
        "{}",
        t.stdout
    );
}
