//! The agent's own cost as the kernel accounts it: the programs' run time, traced runs,
//! the sampling clock's interrupts, accounting in windows (issue 22).

use super::*;

/// The programs' own run time, as the kernel accounts it (issue 22): the entry and the
/// return program ran for each traced call, the total is the programs' sum, and it is
/// spread over the steps found.
pub(crate) fn programs_accounted(summary: &Value) {
    // Where attaching went: the phases in order, adding up to the attach time.
    let phases = summary["agent"]["attach_phases_ms"].as_array().unwrap();
    let names: Vec<&str> = phases
        .iter()
        .map(|p| p["phase"].as_str().unwrap())
        .collect();
    assert_eq!(names.first(), Some(&"tracefs"), "{names:?}");
    assert_eq!(names.last(), Some(&"maps and header"), "{names:?}");
    for phase in [
        "maps and object",
        "uprobes",
        "tracepoints",
        "sampling clocks",
    ] {
        assert!(names.contains(&phase), "{phase} not in {names:?}");
    }
    let sum: f64 = phases.iter().map(|p| p["ms"].as_f64().unwrap()).sum();
    let attach = summary["agent"]["attach_ms"].as_f64().unwrap();
    assert!(
        sum <= attach + 0.01 && sum >= attach * 0.95,
        "phases {sum} ms, attach {attach} ms"
    );
    let bpf = &summary["agent"]["bpf"];
    assert!(bpf.is_object(), "agent.bpf: {}", summary["agent"]);
    let programs = bpf["programs"].as_array().unwrap();
    let runs = |name: &str| {
        programs
            .iter()
            .find(|p| p["name"] == name)
            .map_or(0, |p| p["runs"].as_u64().unwrap())
    };
    let calls = summary["nccl"]["calls"].as_u64().unwrap()
        + summary["cuda_sync"]["calls"].as_u64().unwrap();
    let (entries, returns) = (runs("uprobe_lib_call"), runs("uretprobe_lib_call"));
    assert!(
        entries >= calls,
        "{entries} entry runs for {calls} traced calls"
    );
    // Calls traced at entry only (`call_returns = "needed"`) have no return run.
    let entry_only = summary["nccl"]["entry_only"].as_u64().unwrap_or(0);
    assert!(
        entries.abs_diff(returns + entry_only) <= 2,
        "{entries} entries, {returns} returns, {entry_only} calls traced at entry only"
    );
    let sum: u64 = programs
        .iter()
        .map(|p| p["run_time_ns"].as_u64().unwrap())
        .sum();
    assert_eq!(bpf["cpu_ns"].as_u64(), Some(sum));
    assert!(sum > 0);
    let share = bpf["step_share"].as_f64().unwrap();
    // Under emulation (the QEMU guests) the programs weigh far more against the steps.
    assert!(
        share > 0.0 && (share < 0.5 || in_a_guest()),
        "step share {share}"
    );
    assert!(bpf["per_step_ns"].as_u64().unwrap() > 0);
    // The entry program runs only for traced processes: all its runs are the traced
    // threads'. On probes made per target it runs for nothing else and does not time
    // itself (counted whole); on probes for every process it times each traced run.
    let entry = programs
        .iter()
        .find(|p| p["name"] == "uprobe_lib_call")
        .unwrap();
    if summary["agent"]["uprobes"]
        .as_str()
        .is_some_and(|u| u.ends_with("for every process"))
    {
        assert_eq!(entry["traced_runs"], entry["runs"]);
    } else {
        assert_eq!(entry["traced_runs"], Value::Null, "{entry}");
        assert_eq!(entries, calls, "entry runs beyond the traced calls");
    }
    let traced = bpf["traced_ns"].as_u64().unwrap();
    assert!(traced > 0 && traced <= sum, "traced {traced} of {sum} ns");
    assert!(bpf["traced_per_step_ns"].as_u64().unwrap() <= bpf["per_step_ns"].as_u64().unwrap());
    // The traps, measured on the agent's own function, for every call entered: both traps
    // for the calls the return program ran for, the entry trap alone for the others.
    let trap = bpf["trap_ns_per_call"].as_u64().unwrap_or(0);
    let entry_trap = bpf["entry_trap_ns"].as_u64().unwrap_or(0);
    assert!(trap > 0 && trap < 1_000_000, "trap {trap} ns a call: {bpf}");
    assert!(
        entry_trap > 0 && entry_trap <= trap,
        "entry trap {entry_trap}: {bpf}"
    );
    let traced_runs = |name: &str| {
        programs.iter().find(|p| p["name"] == name).map_or(0, |p| {
            p["traced_runs"]
                .as_u64()
                .unwrap_or_else(|| p["runs"].as_u64().unwrap())
        })
    };
    let paired = traced_runs("uretprobe_lib_call");
    assert_eq!(
        bpf["traps_ns"].as_u64(),
        Some(trap * paired + entry_trap * (entries - paired))
    );
    sampling_accounted(bpf, traced_runs("perf_event_cpu_clock"));
    runs_are_records(summary, programs);
}

/// Traced runs are counted at every run, not only in the accounting's windows (they are
/// timed only there): each fault and wake-up of a traced thread wrote one record.
fn runs_are_records(summary: &Value, programs: &[Value]) {
    if summary["lost_events"] != 0 {
        return;
    }
    let wakeups = &summary["sched"]["wakeups"];
    for (program, records) in [
        ("raw_page_fault_user", &summary["memory"]["page_faults"]),
        ("tracepoint_sched_waking", wakeups),
        ("raw_sched_waking", wakeups),
    ] {
        if let Some(p) = programs.iter().find(|p| p["name"] == program) {
            assert_eq!(p["traced_runs"], *records, "{program}: {p}");
        }
    }
}

/// The sampling clock's interrupts (issue 22): where the traced threads were sampled,
/// what one costs, measured on the agent's own thread, × their samples.
fn sampling_accounted(bpf: &Value, samples: u64) {
    if samples == 0 {
        assert_eq!(bpf["sampling_ns"], 0, "{bpf}");
        return;
    }
    if bpf["sample_interrupt_ns"].is_null() && in_a_guest() {
        // Under emulation the busy rounds' noise can hide the interrupts: not counted,
        // and said why.
        assert!(bpf["sampling_unmeasured"].is_string(), "{bpf}");
        return;
    }
    let per = bpf["sample_interrupt_ns"].as_u64().unwrap_or(0);
    assert!(
        (100..200_000).contains(&per),
        "{per} ns an interrupt: {bpf}"
    );
    assert_eq!(bpf["sampling_ns"].as_u64(), Some(per * samples));
    assert!(bpf.get("sampling_unmeasured").is_none(), "{bpf}");
}

/// The kernel's accounting of the programs' run time, on only in windows (profile `[cost]
/// bpf_stats_ms`, issue 22): while it is on, every program run on the host pays two more
/// clock reads. After the first second the kernel's switch is seen off and on; the figures
/// are scaled and say over what share of the run they were counted; the call programs'
/// runs are still exact (the recording's calls). A run shorter than a second is counted
/// whole. With `bpf_stats_ms = 0` it is never on and `agent.bpf` is null with the reason.
#[test]
#[ignore = "needs root, loads eBPF programs: run `cargo xtask test`"]
fn program_costs_counted_in_windows() {
    let _serial = privileged();
    let dir = tempfile::tempdir().unwrap();
    // The default's windows (checked by the helper), and none.
    let never = default_profile_with(
        dir.path(),
        "never.toml",
        &[("bpf_stats_ms = 100", "bpf_stats_ms = 0")],
    );
    // The entry program's runs as the kernel counts them, read every 50 ms from `from` to
    // `to` after the agent loaded it: (readings where they grew, readings where they did
    // not). The trainer calls it ~16 times in 50 ms: flat means not counting. Timed from
    // the load, not from this thread's start: under a loaded suite the attach took long
    // enough for the first second (counted whole) to fall in the window.
    let watch = |from: Duration, to: Duration| {
        std::thread::spawn(move || {
            let started = Instant::now();
            let mut loaded: Option<Instant> = None;
            let (mut grew, mut flat, mut last) = (0u32, 0u32, None);
            while loaded.map_or(started.elapsed() < Duration::from_secs(30), |t| {
                t.elapsed() < to
            }) {
                let runs: Option<u64> = aya::programs::loaded_programs()
                    .filter_map(Result::ok)
                    .filter(|p| p.name_as_str() == Some("uprobe_lib_call"))
                    .map(|p| p.run_count())
                    .reduce(u64::max);
                if runs.is_some() && loaded.is_none() {
                    loaded = Some(Instant::now());
                }
                if loaded.is_some_and(|t| t.elapsed() >= from)
                    && let (Some(now), Some(before)) = (runs, last)
                {
                    if now > before {
                        grew += 1;
                    } else {
                        flat += 1;
                    }
                }
                last = runs.or(last);
                std::thread::sleep(Duration::from_millis(50));
            }
            (grew, flat)
        })
    };
    // 120 steps of 40 ms: about five seconds traced, the readings from 1.8 to 3.8 s after
    // the load (attach takes up to a few hundred ms after it).
    let trainer_args = ["--compute-us", "40000"];
    let seen = watch(Duration::from_millis(1800), Duration::from_millis(3800));
    let (_, summary, _, _, _) = traced_trainer_with(120, &[], &trainer_args, &[]);
    let (grew, flat) = seen.join().unwrap();
    assert!(
        grew > 0 && flat > 2 * grew,
        "counted in {grew} readings, not in {flat}"
    );
    let bpf = &summary["agent"]["bpf"];
    let share = bpf["accounted_share"].as_f64().unwrap();
    assert!(
        (0.2..0.8).contains(&share),
        "accounted {share} of the run: {bpf}"
    );
    assert!(bpf["method"].as_str().unwrap().contains("accounted_share"));
    programs_accounted(&summary);

    // A run shorter than the first window is counted whole: the trap calibration at its
    // end (the window closed) is not in the span the figures are scaled over.
    let (_, short, _, _, _) = traced_trainer_with(5, &[], &[], &[]);
    let lasted = short["duration_ns"].as_u64().unwrap();
    assert!(lasted < 900_000_000, "the short run lasted {lasted} ns");
    let share = short["agent"]["bpf"]["accounted_share"].as_f64().unwrap();
    assert!(share > 0.999, "a short run counted {share} of its time");
    assert!(short["agent"]["bpf"]["trap_ns_per_call"].is_u64());

    let seen = watch(Duration::ZERO, Duration::from_millis(2000));
    let (_, summary, _, _, _) = traced_trainer_with(
        40,
        &[],
        &trainer_args,
        &["--profile", never.to_str().unwrap()],
    );
    let (grew, flat) = seen.join().unwrap();
    assert!(
        grew == 0 && flat > 10,
        "counted in {grew} readings with bpf_stats_ms = 0 (not in {flat})"
    );
    assert!(summary["agent"]["bpf"].is_null(), "{}", summary["agent"]);
    let why = summary["agent"]["bpf_unmeasured"].as_str().unwrap();
    assert!(why.contains("bpf_stats_ms = 0"), "{why}");
}
