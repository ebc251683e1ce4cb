//! Stacks and their names: stripped and CET libraries, kernel and JIT frames, on-CPU
//! samples with per-CPU and per-thread clocks.

use super::*;

/// A stripped libnccl.so.2 (no .symtab, only the dynamic symbols a shared library keeps):
/// NCCL is still found and every call counted.
#[test]
#[ignore = "needs root, loads eBPF programs: run `cargo xtask test`"]
fn stripped_library() {
    let _serial = privileged();
    let dir = tempfile::tempdir().unwrap();
    let fx = fixtures();
    for f in ["trainer", "libcuda.so.1"] {
        std::fs::copy(fx.join(f), dir.path().join(f)).unwrap();
    }
    let status = Command::new("strip")
        .arg("--strip-all")
        .arg(fx.join("libnccl.so.2"))
        .arg("-o")
        .arg(dir.path().join("libnccl.so.2"))
        .status()
        .expect("strip (binutils)");
    assert!(status.success());
    let go = dir.path().join("go");
    let trainer = Target::spawn(
        &dir.path().join("trainer"),
        &[
            "--steps",
            "5",
            "--compute-us",
            "200",
            "--go-file",
            go.to_str().unwrap(),
        ],
        &[],
        dir.path(),
    );
    let out = dir.path().join("out");
    let agent = Agent::attach(trainer.child.id(), &out, &["--profile", "minimal"]);
    trainer.release();
    let truth = trainer.finish();
    let (code, summary, stderr) = agent.wait(Duration::from_secs(60));
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(
        summary["nccl"]["by_op"]["AllReduce"]["calls"],
        truth["total"]["calls"]["AllReduce"]
    );
    assert!(
        summary["targets"][0]["nccl_library"]
            .as_str()
            .unwrap()
            .starts_with(dir.path().to_str().unwrap())
    );
}

/// Kernel frames (the full profile's off-CPU stacks have them) are named from
/// /proc/kallsyms, read a line at a time and twice (every function's address, then the
/// names wanted) as the run ends; the names go into the recording, so `report` draws the
/// same graph.
#[test]
#[ignore = "needs root, loads eBPF programs: run `cargo xtask test`"]
fn kernel_frames_named_from_kallsyms() {
    let _serial = privileged();
    let (_, summary, out, dir, _) =
        traced_trainer_with(10, &[], &["--compute-us", "300"], &["--profile", "full"]);
    let offcpu = std::fs::read_to_string(out.join("flamegraph-offcpu.folded")).unwrap();
    let kernel_frames: Vec<&str> = offcpu
        .lines()
        .filter_map(|l| l.rsplit_once(' '))
        .flat_map(|(frames, _)| frames.split(';'))
        .filter(|f| f.ends_with("_[k]"))
        .collect();
    let unnamed = kernel_frames
        .iter()
        .filter(|f| f.starts_with("[kernel] 0x"))
        .count();
    // Every stack that blocked went through the scheduler.
    assert!(
        kernel_frames.iter().any(|f| f.contains("schedule")),
        "{} off-CPU stacks: {offcpu}",
        summary["offcpu_stacks"]
    );
    assert!(
        unnamed * 10 <= kernel_frames.len(),
        "{unnamed} of {} kernel frames unnamed: {offcpu}",
        kernel_frames.len()
    );
    let again = report(&out, dir.path());
    let replayed = std::fs::read_to_string(again.join("flamegraph-offcpu.folded")).unwrap();
    assert_eq!(replayed, offcpu);
}

/// JIT-compiled code (the trainer's `--jit` trampoline, named in /tmp/perf-PID.map the way
/// Python 3.12's perf trampolines name Python functions): the on-CPU flamegraph names it
/// between `main` and `compute`; the names are kept in the recording, so `report` gives
/// them after the map file is gone.
#[test]
#[ignore = "needs root, loads eBPF programs: run `cargo xtask test`"]
fn jit_frames_named_from_perf_map() {
    let _serial = privileged();
    let (_, summary, out, dir, _) =
        traced_trainer_with(20, &[("FAKE_NCCL_US", "300")], &["--jit"], &[]);
    let pid = summary["targets"][0]["pid"].as_u64().unwrap();
    let oncpu = std::fs::read_to_string(out.join("flamegraph-oncpu.folded")).unwrap();
    std::fs::remove_file(format!("/tmp/perf-{pid}.map")).unwrap();
    let frame = ";main;py::train_step:/app/train.py;compute";
    assert!(oncpu.lines().any(|l| l.contains(frame)), "{oncpu}");
    let again = dir.path().join("again");
    let report = agent()
        .args(["report", "--out"])
        .arg(&again)
        .arg(out.join("recording.nctr"))
        .output()
        .unwrap();
    assert_eq!(report.status.code(), Some(0));
    let replayed = std::fs::read_to_string(again.join("flamegraph-oncpu.folded")).unwrap();
    assert!(replayed.lines().any(|l| l.contains(frame)), "{replayed}");
}

/// On-CPU samples with the sampling clocks per CPU (the default) and per target thread
/// (`scope = "thread"` in a profile file): about `hz` samples a second of the trainer's CPU
/// time either way, every one of them the trainer's (per-CPU clocks also fire while other
/// processes run, or none: the program must drop those).
#[test]
#[ignore = "needs root, loads eBPF programs: run `cargo xtask test`"]
fn samples_with_clocks_per_cpu_and_per_thread() {
    let _serial = privileged();
    let dir = tempfile::tempdir().unwrap();
    // The default profile names its scope (checked by the helper).
    let thread = default_profile_with(
        dir.path(),
        "thread.toml",
        &[("scope = \"cpu\"", "scope = \"thread\"")],
    );
    let hz = 2000.0;
    for profile in ["default", thread.to_str().unwrap()] {
        let (_, summary, out, _dir, steps) = traced_trainer_with(
            50,
            &[],
            &["--compute-us", "2000", "--fault-pages", "16"],
            &["--profile", profile, "--sample-hz", "2000"],
        );
        // The trainer's CPU time, from its thread's CPU clock: its compute residual (wall
        // less faults and waits) also held the scheduler's share, and the test failed once
        // (0.64x) on a busy host.
        let cpu_s: f64 = steps
            .iter()
            .map(|s| s["cpu_ns"].as_f64().unwrap())
            .sum::<f64>()
            / 1e9;
        let samples = summary["cpu_samples"].as_f64().unwrap();
        let expected = cpu_s * hz;
        assert!(
            (0.65 * expected..=1.35 * expected).contains(&samples),
            "{profile}: {samples} samples for {cpu_s:.3} s of CPU at {hz} Hz"
        );
        let folded = std::fs::read_to_string(out.join("flamegraph-oncpu.folded")).unwrap();
        assert!(!folded.is_empty(), "{profile}: no on-CPU stacks");
        for line in folded.lines() {
            assert!(
                line.starts_with("trainer "),
                "{profile}: a sample of another process: {line}"
            );
        }
    }
}

/// A stand-in libnccl built with -fcf-protection (CET), every function opening with
/// endbr64, which the kernel would single-step under a uprobe: the agent says its probes sit
/// past it, and still counts every call and byte, reads the arguments and pairs each return.
#[test]
#[ignore = "needs root, loads eBPF programs: run `cargo xtask test`"]
fn cet_library_probed_past_endbr64() {
    let _serial = privileged();
    let cet = fixtures().join("cet");
    let dir = tempfile::tempdir().unwrap();
    let go = dir.path().join("go");
    let trainer = Target::spawn(
        &fixtures().join("trainer"),
        &[
            "--steps",
            "20",
            "--compute-us",
            "300",
            "--go-file",
            go.to_str().unwrap(),
        ],
        &[("LD_LIBRARY_PATH", cet.to_str().unwrap())],
        dir.path(),
    );
    let pid = trainer.child.id();
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    assert!(
        maps.contains("/cet/libnccl.so.2"),
        "the trainer runs on the CET build"
    );
    let out = dir.path().join("out");
    let agent = Agent::attach(pid, &out, &["--profile", "full"]);
    let agent_line = agent.attached.clone();
    trainer.release();
    let truth = trainer.finish()["total"].clone();
    let (code, summary, stderr) = agent.wait(Duration::from_secs(60));
    assert_eq!(code, 0, "{stderr}");
    for (op, calls) in truth["calls"].as_object().unwrap() {
        assert_eq!(summary["nccl"]["by_op"][op]["calls"], *calls, "{op} calls");
        assert_eq!(
            summary["nccl"]["by_op"][op]["bytes"], truth["bytes"][op],
            "{op} bytes"
        );
    }
    assert_eq!(summary["lost_events"], 0);
    // Each collective's stream (an argument read at the entry probe) is the trainer's.
    let (with_stream, trainers) = slices_with_stream(&out);
    assert_eq!(with_stream, trainers, "streams read past endbr64");
    assert!(
        trainers >= 20 * 10,
        "{trainers} collectives with the trainer's stream"
    );
    // The probes on the CET build sit past endbr64 (at least the trainer's 11 NCCL
    // functions); those on the stand-in libcuda, built without CET, do not.
    let number_before = |marker: &str| -> usize {
        let head = &agent_line[..agent_line.find(marker).expect(marker)];
        head.rsplit(|c: char| !c.is_ascii_digit())
            .find(|w| !w.is_empty())
            .unwrap()
            .parse()
            .unwrap()
    };
    let (probes, past) = (
        number_before(" probes ("),
        number_before(" past the endbr64 their function opens with"),
    );
    assert!(past >= 11 && past < probes, "{agent_line}");
}
