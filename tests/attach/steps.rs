//! Steps and their breakdown: found automatically, by marker or NVTX, compared with the trainer's own truth, and what a profile cannot measure.

use super::*;

/// Regression (issue 17): attached to a trainer already running, the steps that began
/// while the probes were being attached came out with every category 0 (11-18 steps a
/// run) and their events were drawn at ts 0 in trace.json. Now every reported step is
/// traced whole (its categories add up to its wall time), the steps left out are counted,
/// and nothing but the 0th counter bins sits at ts 0.
#[test]
#[ignore = "needs root, loads eBPF programs: run `cargo xtask test`"]
fn steps_begun_before_attach_are_left_out() {
    let _serial = privileged();
    let dir = tempfile::tempdir().unwrap();
    let (mut child, drain) = released_and_drained(waiting_trainer(dir.path(), 100_000, 1000));
    std::thread::sleep(Duration::from_millis(300));
    let out = dir.path().join("out");
    let agent = Agent::attach(child.id(), &out, &["--duration", "2s"]);
    let (code, _, stderr) = agent.wait(Duration::from_secs(60));
    let _ = child.kill();
    let _ = child.wait();
    let _ = drain.join();
    assert_eq!(code, 0, "{stderr}");
    let read = |name: &str| -> Value {
        serde_json::from_str(&std::fs::read_to_string(out.join(name)).unwrap()).unwrap()
    };
    let steps = read("steps.json");
    let found = steps["steps"].as_array().unwrap();
    // 2 s of 100-µs steps: thousands on the host; in an emulated guest (its attach takes
    // seconds and its CPU is ~17× slower) one run found 75, others over 100.
    let enough = if in_a_guest() { 20 } else { 100 };
    assert!(found.len() > enough, "{} steps", found.len());
    for s in found {
        let sum = category_sum(s);
        let wall = s["wall_ns"].as_u64().unwrap();
        assert!(
            sum.abs_diff(wall) <= 1000,
            "step {} adds to {sum} of {wall}",
            s["index"]
        );
    }
    assert_eq!(found[0]["index"], 0);
    assert!(steps["partial_steps_left_out"].is_u64());
    let trace = read("trace.json");
    let at_zero: Vec<&Value> = trace["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["ph"] != "M" && e["ts"].as_f64() == Some(0.0) && e["ph"] != "C")
        .collect();
    assert!(
        at_zero.len() <= 1,
        "{} events at ts 0: {:?}",
        at_zero.len(),
        &at_zero[..at_zero.len().min(3)]
    );
}

/// Regression (issue 17): `--profile minimal` (no CUDA sync probes, no sampling) printed
/// nccl_wait 0.000 / 0.0% and page_fault 0, and blamed "blocked off-CPU (I/O, locks)" for
/// what was GPU and NCCL waiting. Those categories are null with the reason, the table
/// says "not measured", its shares add up to 100%, and the verdict does not name a cause
/// the profile could not see.
#[test]
#[ignore = "needs root, loads eBPF programs: run `cargo xtask test`"]
fn minimal_profile_says_what_it_cannot_measure() {
    let _serial = privileged();
    let (_, _, out, dir, _) =
        traced_trainer_with(20, &[], &["--compute-us", "500"], &["--profile", "minimal"]);
    let steps: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("steps.json")).unwrap()).unwrap();
    let found = steps["steps"].as_array().unwrap();
    assert!(!found.is_empty());
    for s in found {
        let c = &s["categories_ns"];
        assert!(c["nccl_wait"].is_null() && c["page_fault"].is_null(), "{c}");
        assert!(c["compute"].is_u64(), "{c}");
    }
    for method in ["nccl_wait", "page_fault"] {
        let why = steps["methods"][method].as_str().unwrap();
        assert!(why.starts_with("not measured"), "{method}: {why}");
    }
    // No fault was traced: their count is null, not 0.
    let summary: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    assert!(summary["memory"]["page_faults"].is_null(), "{summary}");
    let again = dir.path().join("again");
    let text = agent()
        .arg("report")
        .arg(out.join("recording.nctr"))
        .arg("--out")
        .arg(&again)
        .output()
        .unwrap();
    assert!(text.status.success());
    let text = String::from_utf8_lossy(&text.stdout);
    let row = |name: &str| {
        text.lines()
            .find(|l| l.trim_start().starts_with(name))
            .unwrap_or_else(|| panic!("no {name} row: {text}"))
            .to_owned()
    };
    for name in ["nccl_wait", "page_fault"] {
        assert!(row(name).contains("not measured"), "{text}");
    }
    assert!(
        text.contains("Memory: page faults not traced (the profile has them off)"),
        "{text}"
    );
    let share = |line: &str| -> f64 {
        line.split_whitespace()
            .find_map(|w| w.strip_suffix('%').and_then(|v| v.parse().ok()))
            .unwrap_or(0.0)
    };
    let shares: f64 = ["compute", "cpu_migration", "runqueue", "other_offcpu"]
        .iter()
        .map(|n| share(&row(n)))
        .sum::<f64>()
        + text
            .lines()
            .find(|l| l.trim_start().starts_with("unattributed"))
            .map_or(0.0, share);
    assert!(
        (shares - 100.0).abs() < 0.5,
        "shares add to {shares}: {text}"
    );
    let verdict = text.lines().last().unwrap_or_default();
    assert!(
        !verdict.contains("blocked off-CPU (I/O, locks)"),
        "the verdict names what the profile cannot tell: {verdict}"
    );
    assert!(
        verdict.contains("cannot see (no CUDA sync probes)"),
        "{verdict}"
    );
}

/// `--step-symbol`: steps start at each entry into the trainer's `train_step_begin`;
/// `report` finds the same steps from the recording alone.
#[test]
#[ignore = "needs root, loads eBPF programs: run `cargo xtask test`"]
fn steps_from_a_marker_function() {
    let _serial = privileged();
    let (_, _, out, dir, truth) = traced_trainer_with(
        12,
        &[],
        &["--compute-us", "500"],
        &["--step-symbol", "train_step_begin"],
    );
    let read = |path: &Path| -> Value {
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
    };
    let steps = read(&out.join("steps.json"));
    assert_eq!(steps["method"], "symbol");
    let found = steps["steps"].as_array().unwrap();
    assert_eq!(
        found.len(),
        truth.len() - 1,
        "a step between each two entries"
    );
    for s in found {
        assert_eq!(s["nccl"]["collectives"], 10, "{s}");
    }
    let again = report(&out, dir.path());
    assert_eq!(read(&again.join("steps.json"))["steps"], steps["steps"]);
}

/// `--step-nvtx REGEX`: the trainer pushes "train_step N" and, inside it, "forward" through
/// a stand-in libnvToolsExt.so.1. Steps start at the matching pushes only; the names reach
/// trace.json; `report` cuts the same steps from the recording, and another pattern
/// re-cuts them. A target without an NVTX library is bad input.
#[test]
#[ignore = "needs root, loads eBPF programs: run `cargo xtask test`"]
fn steps_from_nvtx_ranges() {
    let _serial = privileged();
    let (_, _, out, dir, truth) = traced_trainer_with(
        12,
        &[],
        &["--compute-us", "500", "--nvtx"],
        &["--step-nvtx", "^train_step"],
    );
    let read = |path: &Path| -> Value {
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
    };
    let steps = read(&out.join("steps.json"));
    assert_eq!(steps["method"], "nvtx", "{}", steps["reason"]);
    let found = steps["steps"].as_array().unwrap();
    assert_eq!(
        found.len(),
        truth.len() - 1,
        "a step between each two pushes"
    );
    for s in found {
        assert_eq!(s["nccl"]["collectives"], 10, "{s}");
    }
    let trace = std::fs::read_to_string(out.join("trace.json")).unwrap();
    assert!(
        trace.contains("\"NVTX train_step 7\""),
        "range names in trace.json"
    );
    assert!(trace.contains("\"NVTX forward\""));
    let again = report(&out, dir.path());
    let replayed = read(&again.join("steps.json"));
    assert_eq!(replayed["method"], "nvtx");
    assert_eq!(replayed["steps"], steps["steps"]);
    let other = dir.path().join("other");
    let status = agent()
        .args(["report", "--step-nvtx", "^nothing$", "--out"])
        .arg(&other)
        .arg(out.join("recording.nctr"))
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert!(status.success());
    let none = read(&other.join("steps.json"));
    assert_eq!(none["method"], "window");
    assert!(
        none["reason"]
            .as_str()
            .unwrap()
            .contains("fewer than two NVTX ranges matched"),
        "{}",
        none["reason"]
    );
    // Without an NVTX library in the target: exit 2 and why.
    let refused = refused_attach(&dir.path().join("plain"), &["--step-nvtx", "x"]);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("NVTX 3") && stderr.contains("header-only"),
        "{stderr}"
    );
}

/// Regression (issue 51): a communicator of one rank made before attach (as `attach --pid`
/// finds real jobs) read "waits on NCCL" for what were waits for the GPU (13% of a DDP
/// job's steps on the H100, whose NCCL kernels took 0.0 ms). Its size is read from its
/// memory where the stand-in's ncclCommCount loads it: steps.json lists it with one rank,
/// no step has `nccl_wait`, the sync waits the trainer timed are `gpu_wait`, and stdout
/// never says NCCL was waited on.
#[test]
#[ignore = "needs root, loads eBPF programs: run `cargo xtask test`"]
fn a_one_rank_communicator_waits_for_the_gpu() {
    let _serial = privileged();
    let dir = tempfile::tempdir().unwrap();
    let go = dir.path().join("go");
    let args = [
        "--steps",
        "40",
        "--compute-us",
        "1000",
        "--go-file",
        go.to_str().unwrap(),
    ];
    let mut trainer = Target::spawn(
        &fixtures().join("trainer"),
        &args,
        &[("FAKE_NCCL_US", "2000")],
        dir.path(),
    );
    let out = dir.path().join("out");
    let agent = Agent::attach(trainer.child.id(), &out, &[]);
    trainer.release();
    let lines: Vec<Value> = trainer
        .stdout
        .by_ref()
        .map_while(Result::ok)
        .filter_map(|l| serde_json::from_str(&l).ok())
        .filter(|l: &Value| l.get("step").is_some())
        .collect();
    assert!(trainer.child.wait().unwrap().success());
    let (code, stdout, stderr) = agent.wait_for_exit(Duration::from_secs(60));
    assert_eq!(code, 0, "{stderr}");
    let steps: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("steps.json")).unwrap()).unwrap();
    let comms = steps["communicators"].as_array().unwrap();
    assert_eq!(comms.len(), 1, "{comms:?}");
    assert_eq!(
        (
            &comms[0]["nranks"],
            &comms[0]["rank"],
            &comms[0]["nranks_from"],
            &comms[0]["used"]
        ),
        (
            &Value::from(1),
            &Value::from(0),
            &Value::from("memory"),
            &Value::from(true)
        ),
        "{comms:?}"
    );
    let found = steps["steps"].as_array().unwrap();
    assert!(found.len() > 30, "{} steps", found.len());
    let of = |s: &Value, k: &str| s["categories_ns"][k].as_u64().unwrap();
    assert!(found.iter().all(|s| of(s, "nccl_wait") == 0), "{found:?}");
    // The trainer's own sync waits (about its 2 ms collective), step by step.
    let ours = median(found.iter().map(|s| of(s, "gpu_wait") as f64).collect());
    let theirs = median(
        lines
            .iter()
            .map(|l| l["wait_ns"].as_f64().unwrap())
            .collect(),
    );
    assert!(
        (ours - theirs).abs() < 0.1 * theirs,
        "gpu_wait {ours} vs the trainer's {theirs}"
    );
    assert!(!stdout.contains("waits on NCCL"), "{stdout}");
    assert!(stdout.contains("gpu_wait"), "{stdout}");
    assert!(
        steps["methods"]["nccl_wait"]
            .as_str()
            .unwrap()
            .contains("1 communicator(s) carried collectives: 1 of one rank"),
        "{}",
        steps["methods"]["nccl_wait"]
    );
}

/// Regression (issue 51): a script that slept before its loop had its first "steps" made
/// of 1-s windows of the sleep (0 collectives, p99 1000 ms). The trainer sleeps 1.5 s in
/// `pause_before_loop` after its go file: steps.json `idle` holds one stretch before the
/// first step that covers the trainer's own pause (by its clock) and little more, asleep
/// for about the pause, stdout says so, and no step is longer than a few of the trainer's
/// steps.
#[test]
#[ignore = "needs root, loads eBPF programs: run `cargo xtask test`"]
fn a_pause_before_the_loop_is_idle_not_steps() {
    pause_is_idle(&[], "before the first step");
}

/// Regression (issue 51): a pause between steps (an evaluation, a checkpoint) was one
/// long step. The trainer sleeps 1.5 s before its 20th step: idle `between steps`, as
/// [`a_pause_before_the_loop_is_idle_not_steps`] checks it.
#[test]
#[ignore = "needs root, loads eBPF programs: run `cargo xtask test`"]
fn a_pause_between_steps_is_idle_not_a_step() {
    pause_is_idle(&["--pause-at", "20"], "between steps");
}

/// The trainer pauses 1.5 s (`extra` says where): one idle stretch `when` covers the pause
/// by the trainer's clock (two median steps' slack at its end, where the next step's
/// compute varies) and at most 0.5 s more, asleep for about the pause; no step is longer
/// than 50 ms.
fn pause_is_idle(extra: &[&str], when: &str) {
    let _serial = privileged();
    let dir = tempfile::tempdir().unwrap();
    let go = dir.path().join("go");
    let mut args = vec![
        "--steps",
        "40",
        "--compute-us",
        "2000",
        "--pause-ms",
        "1500",
        "--go-file",
        go.to_str().unwrap(),
    ];
    args.extend(extra);
    let trainer = Target::spawn(&fixtures().join("trainer"), &args, &[], dir.path());
    let out = dir.path().join("out");
    let agent = Agent::attach(trainer.child.id(), &out, &[]);
    trainer.release();
    let truth = trainer.finish();
    let (code, stdout, stderr) = agent.wait_for_exit(Duration::from_secs(60));
    assert_eq!(code, 0, "{stderr}");
    let steps: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("steps.json")).unwrap()).unwrap();
    let found = steps["steps"].as_array().unwrap();
    assert!(found.len() >= 39, "{} steps", found.len());
    let longest = found
        .iter()
        .map(|s| s["wall_ns"].as_u64().unwrap())
        .max()
        .unwrap();
    assert!(longest < 50_000_000, "a step of {longest} ns");
    let idle = steps["idle"].as_array().unwrap();
    let paused: Vec<&Value> = idle.iter().filter(|i| i["when"] == when).collect();
    assert_eq!(paused.len(), 1, "{idle:?}");
    let (start, end) = (
        paused[0]["start_ns"].as_u64().unwrap(),
        paused[0]["end_ns"].as_u64().unwrap(),
    );
    let pause = &truth["total"]["pause"];
    let (p0, p1) = (
        pause["start_ns"].as_u64().unwrap(),
        pause["end_ns"].as_u64().unwrap(),
    );
    // The step after a pause between steps is taken to start its usual lead before its
    // first collective: its end may fall short of the pause's by up to about a step.
    let mut walls: Vec<u64> = found
        .iter()
        .map(|s| s["wall_ns"].as_u64().unwrap())
        .collect();
    walls.sort_unstable();
    let slack = 2 * walls[walls.len() / 2];
    assert!(
        start <= p0 && end + slack >= p1,
        "idle {start}..{end}, pause {p0}..{p1}, slack {slack}"
    );
    assert!(
        end - start < (p1 - p0) + 500_000_000,
        "idle {} ns for a pause of {} ns",
        end - start,
        p1 - p0
    );
    // Asleep (off-CPU, blocked) for about the pause. Where it slept is checked on the
    // attribution alone (`idle_is_not_a_step`): one full run of the suite saw this
    // stretch without its off-CPU stack.
    let slept = paused[0]["categories_ns"]["other_offcpu"].as_u64().unwrap();
    assert!(
        slept >= (p1 - p0) * 9 / 10 && slept <= end - start,
        "{slept} ns asleep of a {} ns pause",
        p1 - p0
    );
    assert!(
        stdout.contains(&format!("{when} (no collectives; mostly other_offcpu")),
        "{stdout}"
    );
}

/// Breakdown accuracy with host-blocking collectives (the wait is inside ncclAllReduce).
#[test]
#[ignore = "needs root, loads eBPF programs: run `cargo xtask test`"]
fn breakdown_blocking_collectives() {
    let _serial = privileged();
    breakdown_within(
        &[("FAKE_NCCL_BLOCKING", "1"), ("FAKE_NCCL_US", "300")],
        &[],
        &checks::BLOCKING,
    );
}

/// Breakdown accuracy with asynchronous collectives and a sleeping cuStreamSynchronize.
#[test]
#[ignore = "needs root, loads eBPF programs: run `cargo xtask test`"]
fn breakdown_async_sleeping_sync() {
    let _serial = privileged();
    breakdown_matches_truth(&[("FAKE_NCCL_US", "300")], &[]);
}

/// Breakdown accuracy with asynchronous collectives and a sync that spins on the CPU:
/// the spin is NCCL wait, not compute.
#[test]
#[ignore = "needs root, loads eBPF programs: run `cargo xtask test`"]
fn breakdown_async_spinning_sync() {
    let _serial = privileged();
    breakdown_matches_truth(&[("FAKE_NCCL_US", "300"), ("FAKE_CUDA_SPIN", "1")], &[]);
}

/// Regression (found on the H200 with DDP, where the autograd thread issues the
/// all-reduces): collectives from another thread while the main thread waits for it.
/// Steps and categories still follow the main thread; its wait for its own worker thread
/// is the step's work (`compute`), not `other_offcpu`.
#[test]
#[ignore = "needs root, loads eBPF programs: run `cargo xtask test`"]
fn breakdown_collectives_from_another_thread() {
    let _serial = privileged();
    breakdown_matches_truth(&[("FAKE_NCCL_US", "300")], &["--comm-thread"]);
}

/// Issue 51: host-blocking collectives from another thread while the main thread waits
/// for it. The main thread's wait is what the other thread did: inside NCCL for most of
/// it (`nccl_wait`, as the trainer's clock counts its calls), not `compute`.
#[test]
#[ignore = "needs root, loads eBPF programs: run `cargo xtask test`"]
fn breakdown_blocking_collectives_from_another_thread() {
    let _serial = privileged();
    breakdown_within(
        &[("FAKE_NCCL_BLOCKING", "1"), ("FAKE_NCCL_US", "300")],
        &["--comm-thread"],
        &checks::BLOCKING,
    );
}

/// `--max-attributed-events`: when the run ends, only the last N events are attributed
/// (bounded memory); the totals still count every call, the summary and steps.json say
/// what was covered, and `report` on the recording attributes the whole run.
#[test]
#[ignore = "needs root, loads eBPF programs: run `cargo xtask test`"]
fn attribution_bounded_to_the_last_events() {
    let _serial = privileged();
    let (truth, summary, out, dir, _, stderr) = traced_trainer_said(
        40,
        &[("FAKE_NCCL_US", "300")],
        &["--compute-us", "500"],
        &["--max-attributed-events", "2000"],
    );
    // Regression (issue 17): the hint printed a `report` command that failed (no --out).
    let hint = stderr
        .lines()
        .find_map(|l| l.split("the whole run: ").nth(1))
        .unwrap_or_else(|| panic!("no command for the whole run: {stderr}"));
    let words: Vec<&str> = hint.split_whitespace().collect();
    let whole = agent().args(&words[1..]).output().unwrap();
    assert!(whole.status.success(), "{hint}: {whole:?}");
    for (op, calls) in truth["calls"].as_object().unwrap() {
        assert_eq!(summary["nccl"]["by_op"][op]["calls"], *calls, "{op} calls");
    }
    let covered = summary["attributed"].as_str().unwrap();
    assert!(covered.contains("the last 2000 of"), "{covered}");
    let read_steps = |dir: &Path| -> Value {
        serde_json::from_str(&std::fs::read_to_string(dir.join("steps.json")).unwrap()).unwrap()
    };
    let limited = read_steps(&out);
    assert!(
        limited["reason"]
            .as_str()
            .unwrap()
            .contains("--max-attributed-events"),
        "{}",
        limited["reason"]
    );
    let full = read_steps(&report(&out, dir.path()));
    let (n_limited, n_full) = (
        limited["steps"].as_array().unwrap().len(),
        full["steps"].as_array().unwrap().len(),
    );
    assert!(n_full.abs_diff(40) <= 1, "{n_full} steps in the whole run");
    assert!(
        n_limited > 0 && n_limited < n_full,
        "{n_limited} steps attributed at the end, {n_full} in the whole run"
    );
}

/// Attribution in epochs on a live run (issue 18): a trainer of 1,000 steps attributed in
/// epochs of 2,000 events finds every step once, in order, back to back, each adding up
/// to its wall time, as one epoch over the whole run finds them.
#[test]
#[ignore = "needs root, loads eBPF programs: run `cargo xtask test`"]
fn steps_attributed_in_epochs_as_the_run_goes() {
    let _serial = privileged();
    let steps = 1000;
    let (_, summary, out, _dir, _) = traced_trainer_with(
        steps,
        &[],
        &["--compute-us", "2000"],
        &["--epoch-events", "2000"],
    );
    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("steps.json")).unwrap()).unwrap();
    let epochs = report["epochs"].as_u64().unwrap();
    assert!(epochs >= 3, "{epochs} epochs");
    let found = report["steps"].as_array().unwrap();
    assert!(
        found.len().abs_diff(steps as usize) <= 2,
        "{} steps found for {steps}",
        found.len()
    );
    for (i, s) in found.iter().enumerate() {
        assert_eq!(s["index"], i);
        assert_eq!(s["nccl"]["collectives"], 10, "step {i}");
        assert_eq!(category_sum(s), s["wall_ns"].as_u64().unwrap(), "step {i}");
        if i > 0 {
            assert_eq!(s["start_ns"], found[i - 1]["end_ns"], "step {i}");
        }
    }
    assert_eq!(summary["nccl"]["collectives"], u64::from(steps) * 10);
}

/// Issue 23: where the PMU counts loads by the node that served them but samples none,
/// each target thread's `node-loads` and `node-load-misses` are counted and read at every
/// drain, and each step gets its share from its own counts. No machine here has a PMU: the
/// software stand-in (the thread's page faults for its DRAM loads, its minor faults for
/// its remote ones) runs the same path, so the steps' counted loads must add up to the
/// page faults the fault tracepoint saw in them, all minor.
#[test]
#[ignore = "needs root, loads eBPF programs: run `cargo xtask test`"]
fn node_loads_counted_per_step() {
    let _serial = privileged();
    let (summary, steps, out, dir) = trainer_counting_loads(
        &[
            "--steps",
            "40",
            "--compute-us",
            "2000",
            "--fault-pages",
            "512",
        ],
        &[],
    );
    let readings = summary["memory"]["node_load_readings"]
        .as_u64()
        .unwrap_or(0);
    assert!(readings > 10, "{}", summary["memory"]);
    let method = steps["methods"]["remote_memory"].as_str().unwrap();
    assert!(method.contains("software stand-in"), "{method}");
    let found = steps["steps"].as_array().unwrap();
    assert!(found.len() >= 30, "{} steps", found.len());
    let (mut loads, mut remote, mut faults) = (0, 0, 0);
    for s in found {
        let r = &s["remote_access"];
        assert_eq!(
            r["from"], "the thread's loads counted by the PMU (node-loads, node-load-misses)",
            "{s}"
        );
        loads += r["dram_loads"].as_u64().unwrap();
        remote += r["remote_loads"].as_u64().unwrap();
        faults += s["faults"].as_u64().unwrap();
    }
    // Interpolated between readings 10 ms apart: a step's count is smoothed over its
    // neighbours', the steps' sum is not.
    let ratio = loads as f64 / faults as f64;
    assert!(
        (0.9..1.1).contains(&ratio),
        "{loads} counted, {faults} traced"
    );
    assert!(
        remote as f64 >= 0.95 * loads as f64,
        "{remote} minor of {loads}"
    );
    // `report` finds the same from the recording's readings.
    let again: Value = serde_json::from_str(
        &std::fs::read_to_string(report(&out, dir.path()).join("steps.json")).unwrap(),
    )
    .unwrap();
    let access = |v: &Value| -> Vec<Value> {
        v["steps"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["remote_access"].clone())
            .collect()
    };
    assert_eq!(access(&again), access(&steps));
}

/// Issue 52: a trainer whose steps each touch 16 MB of fresh memory (4,096 faults) read,
/// per step at the default 99 Hz, `page_fault` 0 or 10.1 ms — one sample or none — where
/// its own clock said 6.9–7.2 ms. Its faults are back to back (a loop over the pages), so
/// their cost is measured between them, step by step: every step's figure within 5% of
/// the trainer's own or its stated error past that, the median error under 5%, the
/// median within 5% (2–4% under on 2026-12-07).
#[test]
#[ignore = "needs root, loads eBPF programs: run `cargo xtask test`"]
fn page_faults_right_per_step_at_the_default_rate() {
    let _serial = privileged();
    let (_, _, out, _dir, truth) = traced_trainer_with(
        40,
        &[],
        &[
            "--compute-us",
            "2000",
            "--fault-pages",
            "4096",
            "--no-migrate",
        ],
        &[],
    );
    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("steps.json")).unwrap()).unwrap();
    let method = report["methods"]["page_fault"].as_str().unwrap();
    let found = report["steps"].as_array().unwrap();
    // Our first step starts at the return of the trainer's first sync: ours[k] is the
    // trainer's step k + 1.
    // A step the scheduler's records put off the CPU while the trainer faulted through
    // it (compute and page_fault under its fault time, other_offcpu holding the rest: a
    // switch-in not seen, about one run in ten here, which the breakdown checks' three
    // tries hide) says nothing of the fault estimate: at most one, shown, left out.
    let (read, misread): (Vec<_>, Vec<_>) = found.iter().zip(&truth[1..]).partition(|(s, t)| {
        let c = &s["categories_ns"];
        let on_cpu = c["compute"].as_f64().unwrap() + c["page_fault"].as_f64().unwrap();
        on_cpu >= 0.9 * t["fault_ns"].as_f64().unwrap()
    });
    assert!(
        misread.len() <= 1,
        "off the CPU while faulting: {misread:?}"
    );
    if let Some((s, t)) = misread.first() {
        eprintln!("a step read off the CPU while faulting: {s} against {t}");
    }
    let pairs: Vec<(f64, f64, f64)> = read
        .iter()
        .map(|(s, t)| {
            (
                s["categories_ns"]["page_fault"].as_f64().unwrap(),
                s["page_fault_error_ns"].as_f64().unwrap_or(f64::NAN),
                t["fault_ns"].as_f64().unwrap(),
            )
        })
        .collect();
    let ms = |v: f64| (v / 1e4).round() / 100.0;
    let shown: Vec<(f64, f64, f64)> = pairs.iter().map(|p| (ms(p.0), ms(p.1), ms(p.2))).collect();
    eprintln!("page_fault per step, ms (ours, error, the trainer's): {shown:?}; {method}");
    assert!(found.len() >= 38, "{} steps", found.len());
    if method.starts_with("fentry/fexit") {
        // Timed where the kernel permits: nothing estimated.
        assert!(pairs.iter().all(|p| p.1.is_nan()), "{shown:?}");
    } else {
        assert!(
            method.contains("measured between their entries"),
            "{method}"
        );
    }
    // Each step within 5% of the trainer's clock or its stated error past that: a gap of
    // over 50 µs between two faults of the loop (a sample's handler, a stall of the VM)
    // may have been all fault; its fault is charged the mean and the rest is the error.
    for &(ours, error, theirs) in &pairs {
        let error = if error.is_nan() { 0.0 } else { error };
        assert!((ours - theirs).abs() <= 0.05 * theirs + error, "{shown:?}");
    }
    let errors = median(pairs.iter().map(|p| p.1).collect());
    let theirs = median(pairs.iter().map(|p| p.2).collect());
    assert!(errors.is_nan() || errors < 0.05 * theirs, "{shown:?}");
    let ours = median(pairs.iter().map(|p| p.0).collect());
    assert!(
        (ours - theirs).abs() <= 0.05 * theirs,
        "median {ours} vs {theirs}: {shown:?}"
    );
}

/// Issue 51: a GPU-bound step spends its host time in kernel launches waiting for room in
/// a full launch queue (on the H100, GPT-2 at batch 64: 12.8 ms a step in the main
/// thread's launches against 2.4 at batch 16, the driver in `sched_yield`). The stand-in
/// driver's launches wait so, yielding; samples of `sched_yield` called from libcuda are
/// `gpu_wait`. A lower bound: the loop around the system call stays `compute`. Over the
/// run, `gpu_wait` + `nccl_wait` must hold the trainer's syncs and at least half of its
/// launches' time, and not exceed its waits.
#[test]
#[ignore = "needs root, loads eBPF programs: run `cargo xtask test`"]
fn launch_queue_waits_are_the_gpus() {
    let _serial = privileged();
    let (_, _, out, _dir, truth) = traced_trainer_with(
        40,
        &[("FAKE_NCCL_US", "200"), ("FAKE_CUDA_KERNEL_US", "300")],
        &["--launches", "10", "--no-migrate", "--fault-pages", "8"],
        &["--sample-hz", "4999"],
    );
    let steps: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("steps.json")).unwrap()).unwrap();
    let found = steps["steps"].as_array().unwrap();
    // Ours[k] is the trainer's step k + 1 (ours start at its first sync's return).
    let truth = &truth[1..];
    let n = found.len().min(truth.len());
    assert!(n >= 35, "{n} steps");
    let sum = |f: &dyn Fn(usize) -> f64| (0..n).map(f).sum::<f64>();
    let ours = sum(&|i| {
        let c = &found[i]["categories_ns"];
        c["gpu_wait"].as_f64().unwrap() + c["nccl_wait"].as_f64().unwrap()
    });
    let launch = sum(&|i| truth[i]["launch_ns"].as_f64().unwrap());
    let waits = sum(&|i| truth[i]["wait_ns"].as_f64().unwrap());
    let syncs = waits - launch;
    eprintln!(
        "waits: ours {:.1} ms, the trainer's {:.1} ms ({:.1} ms of it in launches)",
        ours / 1e6,
        waits / 1e6,
        launch / 1e6
    );
    assert!(launch > 0.3 * waits, "launches {launch} of waits {waits}");
    let method = steps["methods"]["gpu_wait"].as_str().unwrap();
    assert!(
        method.contains("sched_yield called from libcuda"),
        "{method}"
    );
    assert!(
        found.iter().all(|s| s["gpu_wait_error_ns"].is_u64()),
        "{}",
        found[0]
    );
    assert!(
        ours >= syncs + 0.5 * launch && ours <= 1.05 * waits,
        "ours {ours} vs syncs {syncs} + launches {launch}"
    );
}
