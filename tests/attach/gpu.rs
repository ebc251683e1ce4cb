//! Issue 53: the GPUs the targets use, read through NVML while tracing. The stand-in
//! libnvidia-ml.so.1 answers utilization from the stand-in libcuda's own log of the
//! "GPU work" it ran (`FAKE_CUDA_BUSY`), as the driver answers from the GPU's: the log is
//! the truth each step's busy share is held to.

use super::{Agent, Target, fixtures, privileged, steps_and_totals};
use serde_json::Value;
use std::path::Path;
use std::time::Duration;

/// NVML's sampling period the stand-in is given (ms).
const PERIOD_MS: u64 = 5;

/// The log's intervals of GPU work, `(start, end)` CLOCK_MONOTONIC ns.
fn busy_log(path: &Path) -> Vec<(u64, u64)> {
    let bytes = std::fs::read(path).unwrap();
    let word = |i: usize| u64::from_ne_bytes(bytes[i * 8..i * 8 + 8].try_into().unwrap());
    (0..word(0) as usize)
        .map(|i| (word(1 + 2 * i), word(2 + 2 * i)))
        .collect()
}

fn json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The share of `[a, b)` the log has work in.
fn busy_share(log: &[(u64, u64)], a: u64, b: u64) -> f64 {
    let covered: u64 = log
        .iter()
        .map(|&(s, e)| e.min(b).saturating_sub(s.max(a)))
        .sum();
    covered as f64 / (b - a) as f64
}

/// A trainer whose steps compute 30 ms on the CPU and queue 50 ms of GPU work (the stand-in
/// NVML sampling every 5 ms, clocks held down by a software power cap): each step's GPU
/// busy share within what two samples at its edges can move it of the log's own share, the
/// clocks, power and reason read, and said on stdout.
#[test]
#[ignore = "needs root, loads eBPF programs: run `cargo xtask test`"]
fn steps_get_the_gpus_busy_share() {
    let _serial = privileged();
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("busy.log");
    let log_s = log.to_str().unwrap();
    let trainer = Target::spawn(
        &fixtures().join("trainer"),
        &[
            "--steps",
            "30",
            "--compute-us",
            "30000",
            "--launches",
            "50",
            "--no-migrate",
        ],
        &[
            ("FAKE_CUDA_BUSY", log_s),
            ("FAKE_CUDA_KERNEL_US", "1000"),
            ("FAKE_CUDA_QUEUE_US", "200000"),
        ],
        dir.path(),
    );
    let nvml = fixtures().join("nvml/libnvidia-ml.so.1");
    let out = dir.path().join("out");
    let period = PERIOD_MS.to_string();
    let agent = Agent::attach_env(
        &[trainer.child.id()],
        &out,
        &[],
        &[
            ("NCCLTRACE_NVML", nvml.to_str().unwrap()),
            ("FAKE_NVML_BUSY", log_s),
            ("FAKE_NVML_PERIOD_MS", &period),
            ("FAKE_NVML_THROTTLE", "0x4"),
        ],
    );
    trainer.release();
    let (said, _) = steps_and_totals(trainer);
    assert_eq!(said.len(), 30);
    let (code, stdout, stderr) = agent.wait_for_exit(Duration::from_secs(60));
    assert_eq!(code, 0, "{stderr}");
    let summary = json(&out.join("summary.json"));
    let truth = busy_log(&log);
    assert!(!truth.is_empty());
    let steps = json(&out.join("steps.json"));
    let steps = steps["steps"].as_array().unwrap();
    assert!(steps.len() >= 20, "{} steps", steps.len());
    for s in steps {
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
        assert!(gpu["from_ns"].as_u64().unwrap() <= a && gpu["to_ns"].as_u64().unwrap() >= b);
        assert!(gpu["samples"].as_u64().unwrap() >= 15, "{gpu}");
    }
    let g = &summary["gpus"];
    assert!(g["refused"].is_null(), "{g:#}");
    let read = &g["read"][0];
    assert!(read["name"].as_str().unwrap().contains("stand-in"), "{g:#}");
    let sampled = read["sampled_ns"].as_u64().unwrap();
    assert!(sampled > 2_000_000_000, "{g:#}");
    assert_eq!(read["power_w_mean"].as_f64(), Some(312.0), "{g:#}");
    assert_eq!(read["sm_clock_mhz_max"].as_u64(), Some(1980), "{g:#}");
    assert_eq!(
        read["clock_event_reasons"],
        serde_json::json!(["sw_power_cap"])
    );
    assert!(
        stdout.contains("GPU 0 NVIDIA H100 80GB HBM3 (stand-in): busy ")
            && stdout.contains("clocks held down: sw_power_cap"),
        "{stdout}"
    );
}
