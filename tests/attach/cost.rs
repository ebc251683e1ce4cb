//! The agent's own cost as its programs account it: the programs' run time, traced runs,
//! the sampling clock's interrupts, accounting in windows (issues 22 and 59).

use super::*;

/// The programs' own run time, as they account it (issues 22 and 59): the entry and the
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

/// Fails unless the kernel's accounting is off by its sysctl before a test that checks
/// the agent never turns it on: on there, it is someone else's, and the check would prove
/// nothing. (The sysctl says only what was written to it, not whether a process holds a
/// `BPF_ENABLE_STATS` descriptor: the watch below looks at the kernel's counts instead.)
pub(crate) fn kernel_stats_off_before() {
    let sysctl = std::fs::read_to_string("/proc/sys/kernel/bpf_stats_enabled").unwrap_or_default();
    assert_eq!(
        sysctl.trim(),
        "0",
        "kernel.bpf_stats_enabled is on before the agent started (someone else's): turn it \
         off (sysctl kernel.bpf_stats_enabled=0) to run this test"
    );
}

/// The names the kernel gives the agent's programs (`BPF_OBJ_NAME_LEN`: 15 bytes kept).
fn kernel_names() -> Vec<&'static str> {
    nccltrace_common::run::PROGRAMS
        .iter()
        .map(|n| &n[..n.len().min(15)])
        .collect()
}

/// One reading of the agent's programs from outside: the entry program's runs as it
/// counted them itself (`PROGRAM_COSTS`, every CPU), the kernel's run count and run time
/// of the programs of that name, and the kernel's run count of all the agent's programs.
/// The kernel counts runs only while its accounting is on (`bpf_stats_enabled_key`, held
/// by the sysctl or by any `BPF_ENABLE_STATS` descriptor): `kernel_runs` above 0 means it
/// was on while the agent's programs ran.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Reading {
    pub(crate) own: Option<(u64, u64)>,
    pub(crate) kernel: Option<(u64, u64)>,
    pub(crate) kernel_runs: u64,
}

/// The id of the newest `PROGRAM_COSTS` map on the host (the agent's, tests running one
/// at a time).
fn newest_costs_map() -> Option<u32> {
    aya::maps::loaded_maps()
        .filter_map(Result::ok)
        .filter(|m| m.name_as_str() == Some(nccltrace_common::names::PROGRAM_COSTS))
        .map(|m| m.id())
        .max()
}

/// The entry program's (runs, ns) in the newest `PROGRAM_COSTS` map, if it is newer than
/// map `after` (an earlier agent's, which the kernel may free a little after it exits).
fn own_entry_runs(after: Option<u32>) -> Option<(u64, u64)> {
    let id = newest_costs_map().filter(|id| after.is_none_or(|a| *id > a))?;
    let data = aya::maps::MapData::from_id(id).ok()?;
    let costs =
        aya::maps::PerCpuArray::<_, u64>::try_from(aya::maps::Map::PerCpuArray(data)).ok()?;
    let slot = |i: u32| -> Option<u64> { costs.get(&i, 0).ok().map(|v| v.iter().sum()) };
    let at = nccltrace_common::run::SLOTS * nccltrace_common::run::UPROBE_LIB_CALL;
    Some((slot(at)?, slot(at + 1)?))
}

fn read_programs(after: Option<u32>) -> Reading {
    let names = kernel_names();
    let (mut kernel, mut kernel_runs) = (None::<(u64, u64)>, 0);
    for p in aya::programs::loaded_programs().filter_map(Result::ok) {
        let Some(name) = p.name_as_str() else {
            continue;
        };
        if names.contains(&name) {
            kernel_runs += p.run_count();
        }
        if name == nccltrace_common::names::UPROBE_LIB_CALL {
            let ns = u64::try_from(p.run_time().as_nanos()).unwrap_or(u64::MAX);
            let (runs, time) = kernel.unwrap_or_default();
            kernel = Some((runs + p.run_count(), time + ns));
        }
    }
    Reading {
        own: own_entry_runs(after),
        kernel,
        kernel_runs,
    }
}

/// Reads the agent's programs every `every` from `from` to `to` after its map appeared
/// (its programs loaded; at most 30 s waited for that), then until it is gone: the
/// readings taken in that span, and every reading's `kernel_runs` (from the start to the
/// agent's end).
pub(crate) fn watch_programs(
    every: Duration,
    from: Duration,
    to: Duration,
) -> std::thread::JoinHandle<(Vec<Reading>, Vec<u64>)> {
    // An earlier agent's map, if the kernel has not freed it yet.
    let earlier = newest_costs_map();
    std::thread::spawn(move || {
        let started = Instant::now();
        let mut loaded: Option<Instant> = None;
        let (mut readings, mut stats) = (Vec::new(), Vec::new());
        loop {
            let reading = read_programs(earlier);
            stats.push(reading.kernel_runs);
            match (loaded, reading.own) {
                (None, Some(_)) => loaded = Some(Instant::now()),
                (None, None) if started.elapsed() > Duration::from_secs(30) => break,
                // The agent is gone.
                (Some(_), None) => break,
                _ => {}
            }
            if loaded.is_some_and(|t| (from..to).contains(&t.elapsed())) {
                readings.push(reading);
            }
            std::thread::sleep(every);
        }
        (readings, stats)
    })
}

/// The programs' own accounting of their runs, on only in windows (profile `[cost]
/// timing_ms`, issues 22 and 59): while it is on, each run of one pays two more clock
/// reads. After the first second the programs' counts are seen to grow and stand still;
/// the figures are scaled and say over what share of the run they were counted; the call
/// programs' runs are still exact (the recording's calls). A run shorter than a second is
/// counted whole. With `timing_ms = 0` they never count and `agent.bpf` is null with the
/// reason. In none of these runs does the kernel count a run of the agent's programs: its
/// host-wide accounting (`kernel.bpf_stats_enabled`) is never on (issue 59: the agent
/// turned it on and off ten times a second, which rewrites kernel text under every BPF
/// program of the host, and panicked the 6.12 guest).
#[test]
#[ignore = "needs root, loads eBPF programs: run `cargo xtask test`"]
fn program_costs_counted_in_windows() {
    let _serial = privileged();
    kernel_stats_off_before();
    let dir = tempfile::tempdir().unwrap();
    // The default's windows (checked by the helper), and none.
    let never = default_profile_with(
        dir.path(),
        "never.toml",
        &[("timing_ms = 100", "timing_ms = 0")],
    );
    // The entry program's own count, read every 50 ms from 1.8 to 3.8 s after the agent
    // loaded it. The trainer calls it ~16 times in 50 ms: flat means not counting. Timed
    // from the load, not from this thread's start: under a loaded suite the attach took
    // long enough for the first second (counted whole) to fall in the window.
    let grew_and_flat = |readings: &[Reading]| {
        let counts: Vec<u64> = readings.iter().filter_map(|r| r.own).map(|o| o.0).collect();
        let grew = counts.windows(2).filter(|w| w[1] > w[0]).count();
        (grew, counts.len().saturating_sub(1) - grew)
    };
    // 120 steps of 40 ms: about five seconds traced.
    let trainer_args = ["--compute-us", "40000"];
    let every = Duration::from_millis(50);
    let seen = watch_programs(
        every,
        Duration::from_millis(1800),
        Duration::from_millis(3800),
    );
    let (_, summary, _, _, _) = traced_trainer_with(120, &[], &trainer_args, &[]);
    let (readings, stats) = seen.join().unwrap();
    let (grew, flat) = grew_and_flat(&readings);
    assert!(
        grew > 0 && flat > 2 * grew,
        "counted in {grew} readings, not in {flat}"
    );
    never_accounted(&stats, "windows of 100 ms");
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

    let seen = watch_programs(every, Duration::ZERO, Duration::from_millis(2000));
    let (_, summary, _, _, _) = traced_trainer_with(
        40,
        &[],
        &trainer_args,
        &["--profile", never.to_str().unwrap()],
    );
    let (readings, stats) = seen.join().unwrap();
    let (grew, flat) = grew_and_flat(&readings);
    assert!(
        grew == 0 && flat > 10,
        "counted in {grew} readings with timing_ms = 0 (not in {flat})"
    );
    never_accounted(&stats, "timing_ms = 0");
    assert!(summary["agent"]["bpf"].is_null(), "{}", summary["agent"]);
    let why = summary["agent"]["bpf_unmeasured"].as_str().unwrap();
    assert!(why.contains("timing_ms = 0"), "{why}");
}

/// Fails if the kernel counted any run of the agent's programs in `kernel_runs` (the
/// readings of [`watch_programs`]): its accounting was on under them.
pub(crate) fn never_accounted(kernel_runs: &[u64], what: &str) {
    assert!(
        kernel_runs.len() > 20,
        "{what}: {} readings",
        kernel_runs.len()
    );
    let counted = kernel_runs.iter().filter(|runs| **runs > 0).count();
    assert_eq!(
        counted,
        0,
        "{what}: the kernel accounted the agent's programs in {counted} of {} readings (up \
         to {} runs): its run-time accounting (kernel.bpf_stats_enabled, BPF_ENABLE_STATS) \
         was on",
        kernel_runs.len(),
        kernel_runs.iter().max().unwrap_or(&0)
    );
}

/// At most what the two accountings add to a run on the CPU machines: three clock reads
/// (~50 ns each on a KVM guest's paravirtual clock), two per-CPU adds and a map load.
const ACCOUNTING_NS: u64 = 300;

/// The programs' own accounting against the kernel's, over the same runs (issue 59): with
/// the kernel's accounting turned on by this test for the whole run (never by the agent)
/// and the agent's always on (`timing_ms = 1000`), the entry program counted the same runs
/// as the kernel did, and its own time a run is the kernel's less at most what the
/// accountings themselves add ([`ACCOUNTING_NS`]).
#[test]
#[ignore = "needs root, loads eBPF programs: run `cargo xtask test`"]
fn own_accounting_agrees_with_the_kernels() {
    let _serial = privileged();
    kernel_stats_off_before();
    let dir = tempfile::tempdir().unwrap();
    let always = default_profile_with(
        dir.path(),
        "always.toml",
        &[("timing_ms = 100", "timing_ms = 1000")],
    );
    let stats = aya::sys::enable_stats(aya::sys::Stats::RunTime).expect("BPF_ENABLE_STATS");
    let seen = watch_programs(
        Duration::from_millis(20),
        Duration::ZERO,
        Duration::from_secs(60),
    );
    let (_, summary, _, _, _) = traced_trainer_with(
        60,
        &[],
        &["--compute-us", "20000"],
        &["--profile", always.to_str().unwrap()],
    );
    let (readings, kernel_runs) = seen.join().unwrap();
    drop(stats);
    // The detector the other tests rely on sees the kernel's accounting when it is on.
    assert!(
        kernel_runs.iter().any(|runs| *runs > 0),
        "the kernel's counts never moved with its accounting on: {kernel_runs:?}"
    );
    // The last reading with both, the trainer's calls well under way.
    let (own, kernel) = readings
        .iter()
        .rev()
        .find_map(|r| Some((r.own?, r.kernel?)))
        .expect("a reading of both accountings");
    assert!(kernel.0 > 300, "the kernel counted {} runs", kernel.0);
    // Read one after the other: a few calls may fall between.
    assert!(
        own.0.abs_diff(kernel.0) <= 4,
        "own count {} runs, the kernel's {}",
        own.0,
        kernel.0
    );
    // The kernel times the call of each program, so its figure holds what the program's
    // own figure leaves out: the accounting itself (the switch's load, the program's two
    // clock reads and two adds, the kernel's own clock read around the call). Seen here:
    // 97 ns a run against the kernel's 236 ns on the 2-vCPU KVM machine.
    let (own_per_run, kernel_per_run) = (own.1 / own.0, kernel.1 / kernel.0);
    assert!(
        own_per_run > 0
            && own_per_run <= kernel_per_run + kernel_per_run / 50
            && kernel_per_run - own_per_run.min(kernel_per_run) <= ACCOUNTING_NS,
        "own {own_per_run} ns a run, the kernel's {kernel_per_run} ns"
    );
    // Accounted throughout: nothing scaled.
    let bpf = &summary["agent"]["bpf"];
    assert!(
        bpf["accounted_share"].as_f64().is_none_or(|s| s > 0.999),
        "{bpf}"
    );
    programs_accounted(&summary);
}

/// Regression (issue 52): `agent cost` read 12% of step time on the H200 because the
/// processes' start-up (CUDA's initialisation faults) was spread over the steps. The same
/// 300 steps, with and without two seconds of start-up faulting before them: with it,
/// the whole run's cost a step grows severalfold (the start-up's faults each ran the fault
/// program), while the cost inside the steps stays within 2× of the plain run's, and the
/// start-up's lies outside them.
#[test]
#[ignore = "needs root, loads eBPF programs: run `cargo xtask test`"]
fn start_up_cost_is_not_the_steps() {
    let _guard = privileged();
    let run = |startup: &str| {
        let args = ["--compute-us", "1000", "--startup-faults-ms", startup];
        let (truth, summary, _out, _dir, _) = traced_trainer_with(300, &[], &args, &[]);
        let bpf = summary["agent"]["bpf"].clone();
        assert!(bpf.is_object(), "{}", summary["agent"]);
        let field = |k: &str| {
            bpf[k]
                .as_f64()
                .unwrap_or_else(|| panic!("{k} not a number: {bpf:#}"))
        };
        let (inside, outside) = (field("in_steps_ns"), field("outside_steps_ns"));
        let whole = field("traced_total_per_step_ns");
        eprintln!(
            "start-up {startup} ms ({} faults): whole run {whole} ns a step, inside {} ns a \
             step, {inside} ns in steps, {outside} ns outside",
            truth["startup_faults"],
            field("in_steps_per_step_ns")
        );
        (whole, field("in_steps_per_step_ns"), inside, outside)
    };
    let plain = run("0");
    let started = run("2000");
    assert!(
        started.0 > 3.0 * plain.0,
        "the start-up did not weigh on the whole run's cost: {started:?} vs {plain:?}"
    );
    assert!(
        started.1 < 2.0 * plain.1 && started.1 > 0.5 * plain.1,
        "cost inside the steps {} ns a step with the start-up, {} without",
        started.1,
        plain.1
    );
    assert!(
        started.3 > 2.0 * started.2,
        "the start-up's cost not outside the steps: {started:?}"
    );
}
