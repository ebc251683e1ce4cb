//! Counting: every call of the stand-in and the real libnccl, several ranks, processes found later, stacks, samples and symbols.

use super::*;

/// Every collective counted exactly (calls and bytes per op), every sync call counted,
/// no events lost, and the agent exits by itself when the trainer does. Asynchronous
/// collectives: the host waits in cuStreamSynchronize.
#[test]
#[ignore = "needs root, loads eBPF programs: run `cargo xtask test`"]
fn counts_every_call_of_the_trainer() {
    let _serial = privileged();
    // 999 Hz (the default is 99): enough samples that some land in the faults.
    let (truth, summary, out, _dir, _) = traced_trainer_with(
        25,
        &[("FAKE_NCCL_US", "300")],
        &["--compute-us", "500", "--fault-pages", "512"],
        &["--sample-hz", "999"],
    );
    for (op, calls) in truth["calls"].as_object().unwrap() {
        assert_eq!(summary["nccl"]["by_op"][op]["calls"], *calls, "{op} calls");
        assert_eq!(
            summary["nccl"]["by_op"][op]["bytes"], truth["bytes"][op],
            "{op} bytes"
        );
    }
    let syncs = &summary["cuda_sync"]["by_func"];
    assert_eq!(
        syncs["cuStreamSynchronize"]["calls"],
        truth["syncs"]["cuStreamSynchronize"]
    );
    assert_eq!(
        syncs["cuCtxSynchronize"]["calls"],
        truth["syncs"]["cuCtxSynchronize"]
    );
    // 10 collectives × 300 µs enqueued per step, waited for in the stream sync.
    let waited = syncs["cuStreamSynchronize"]["wait_ns"].as_u64().unwrap();
    assert!(
        waited >= 25 * 10 * 300_000 * 8 / 10,
        "sync waited only {waited} ns"
    );
    assert_eq!(summary["lost_events"], 0);
    assert_eq!(summary["stop_reason"], "every target exited");
    assert_eq!(summary["nccl"]["errors"], 0);
    uprobes_attached_as(&summary, true);
    programs_accounted(&summary);
    // 512 fresh pages a step, each a fault (enough fault time, over 10 ms, that the
    // 999 Hz sampling surely lands in some: the attributed graph's page_fault).
    assert!(summary["memory"]["page_faults"].as_u64().unwrap() >= 25 * 512);
    if std::thread::available_parallelism().map_or(1, usize::from) > 1 {
        assert!(summary["sched"]["migrations"].as_u64().unwrap() >= 1);
    }
    assert!(out.join("recording.nctr").is_file());
    recording_in_time_order(&out);
    flamegraphs_and_trace_are_valid(&out, &summary);
    // The health report written at attach.
    let doctor: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("doctor.json")).unwrap()).unwrap();
    assert!(doctor["findings"].is_array());
    assert!(
        doctor["target"]["threads"]
            .as_array()
            .is_some_and(|t| !t.is_empty())
    );
    no_programs_left();
}

/// The programs' own run time, as the kernel accounts it (issue 22): the entry and the
/// return program ran for each traced call, the total is the programs' sum, and it is
/// spread over the steps found.
fn programs_accounted(summary: &Value) {
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

/// The scheduler's switch, wake-up and migration tracepoints, raw (task pointers, read at
/// `task_struct` offsets found in the kernel BTF; Linux 5.18+) and formatted (the
/// profile's `raw_tracepoints = false`), see the same: the rank thread's switches and
/// wake-ups, every step, and its migrations chained CPU to CPU (each from the CPU the
/// previous one went to: a wrong offset of the task's CPU breaks the chain).
#[test]
#[ignore = "needs root, loads eBPF programs: run `cargo xtask test`"]
fn scheduler_tracepoints_raw_and_formatted() {
    let _serial = privileged();
    let dir = tempfile::tempdir().unwrap();
    let formatted = default_profile_with(
        dir.path(),
        "formatted.toml",
        &[("raw_tracepoints = true", "raw_tracepoints = false")],
    );
    let raw_here = Path::new("/sys/kernel/btf/vmlinux").exists();
    let steps = 30;
    for profile in ["default", formatted.to_str().unwrap()] {
        let (_, summary, out, _dir, _) = traced_trainer_with(
            steps,
            &[("FAKE_NCCL_US", "300")],
            &["--compute-us", "500"],
            &["--profile", profile],
        );
        let how = summary["agent"]["sched_tracepoints"].as_str().unwrap();
        let raw = profile == "default" && raw_here;
        let switch_program = if raw {
            assert!(
                how.starts_with("raw tracepoints (struct task_struct: pid at byte "),
                "{how}"
            );
            "raw_sched_switch"
        } else {
            assert!(how.starts_with("formatted tracepoints ("), "{how}");
            "tracepoint_sched_switch"
        };
        if profile != "default" {
            assert_eq!(
                how,
                "formatted tracepoints (profile raw_tracepoints = false)"
            );
        }
        let programs = summary["agent"]["bpf"]["programs"].as_array().unwrap();
        assert!(
            programs.iter().any(|p| p["name"] == switch_program),
            "{switch_program} did not run: {programs:?}"
        );
        let sched = &summary["sched"];
        for field in ["switches_out", "wakeups"] {
            assert!(
                sched[field].as_u64().unwrap() >= u64::from(steps),
                "{how}: {sched}"
            );
        }
        assert_eq!(summary["lost_events"], 0);
        migrations_chained(&out);
    }
}

/// Each thread's migrations in trace.json go from the CPU the previous one went to, to
/// another CPU of this host.
fn migrations_chained(out: &Path) {
    let trace: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("trace.json")).unwrap()).unwrap();
    let cpus = std::thread::available_parallelism().map_or(1, usize::from) as u64;
    let mut last_to: std::collections::HashMap<u64, u64> = std::collections::HashMap::new();
    for e in trace["traceEvents"].as_array().unwrap() {
        if e["name"] != "migration" {
            continue;
        }
        let (tid, from, to) = (
            e["tid"].as_u64().unwrap(),
            e["args"]["from_cpu"].as_u64().unwrap(),
            e["args"]["to_cpu"].as_u64().unwrap(),
        );
        assert!(from < cpus && to < cpus && from != to, "{e}");
        if let Some(previous) = last_to.insert(tid, to) {
            assert_eq!(from, previous, "thread {tid}: {e}");
        }
    }
}

/// The default profile with `call_returns = "needed"`, and InfiniBand off.
fn entries_profile(dir: &Path) -> PathBuf {
    default_profile_with(
        dir,
        "entries.toml",
        &[
            ("call_returns = \"all\"", "call_returns = \"needed\""),
            ("uprobe_multi = true", "uprobe_multi = false"),
            ("infiniband = true", "infiniband = false"),
        ],
    )
}

/// The default profile with each (line, replacement) of `changes` made, written to
/// `dir/name`; each line must be in it (a renamed key fails here, not silently).
pub(crate) fn default_profile_with(dir: &Path, name: &str, changes: &[(&str, &str)]) -> PathBuf {
    let mut text = std::fs::read_to_string(workspace().join("profiles/default.toml")).unwrap();
    for (line, replacement) in changes {
        assert!(text.contains(line), "the default profile has no {line:?}");
        text = text.replace(line, replacement);
    }
    let profile = dir.join(name);
    std::fs::write(&profile, text).unwrap();
    profile
}

/// `call_returns = "needed"` (issue 22): collectives, group starts and markers are traced
/// at entry only, one trap a call. With one perf-event uprobe per function
/// (`uprobe_multi = false`), as on kernels before 6.6. Every call is still counted with its bytes, the CUDA
/// syncs still measure the wait, steps are still found; what is not seen (the calls' time
/// and result) is null and said, and the return program runs only for the calls that
/// need it.
#[test]
#[ignore = "needs root, loads eBPF programs: run `cargo xtask test`"]
fn collectives_traced_at_entry_only() {
    let _serial = privileged();
    let dir = tempfile::tempdir().unwrap();
    let profile = entries_profile(dir.path());
    let steps = 20;
    let (truth, summary, out, _dir, _) = traced_trainer_with(
        steps,
        &[("FAKE_NCCL_US", "300")],
        &["--compute-us", "500"],
        &["--profile", profile.to_str().unwrap()],
    );
    uprobes_attached_as(&summary, false);
    let nccl = &summary["nccl"];
    for (op, calls) in truth["calls"].as_object().unwrap() {
        assert_eq!(nccl["by_op"][op]["calls"], *calls, "{op} calls");
        assert_eq!(nccl["by_op"][op]["bytes"], truth["bytes"][op], "{op} bytes");
    }
    // Time and result unknown for the calls traced at entry only; known for the others.
    let ar = &nccl["by_op"]["AllReduce"];
    assert!(ar["enqueue_ns"].is_null() && ar["errors"].is_null(), "{ar}");
    assert_eq!(ar["entry_only"], ar["calls"]);
    let group_end = &nccl["by_op"]["GroupEnd"];
    assert!(
        group_end["enqueue_ns"].is_u64() && group_end["entry_only"].is_null(),
        "{group_end}"
    );
    let needed: u64 = [
        "CommInitRank",
        "CommInitRankConfig",
        "CommInitAll",
        "CommSplit",
    ]
    .iter()
    .chain(&["GroupEnd", "CommDestroy", "CommAbort"])
    .map(|op| nccl["by_op"][op]["calls"].as_u64().unwrap_or(0))
    .sum();
    let entry_only = nccl["entry_only"].as_u64().unwrap();
    assert_eq!(
        entry_only + needed,
        nccl["calls"].as_u64().unwrap(),
        "{nccl:#}"
    );
    // The syncs keep their returns: the waits are measured.
    let syncs = summary["cuda_sync"]["calls"].as_u64().unwrap();
    let waited = summary["cuda_sync"]["by_func"]["cuStreamSynchronize"]["wait_ns"]
        .as_u64()
        .unwrap();
    assert!(
        waited >= u64::from(steps) * 10 * 300_000 * 8 / 10,
        "sync waited only {waited} ns"
    );
    // The return program ran only for the calls that need it.
    let bpf = &summary["agent"]["bpf"];
    let runs = |name: &str| {
        bpf["programs"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["name"] == name)
            .map_or(0, |p| p["runs"].as_u64().unwrap())
    };
    let (entries, returns) = (runs("uprobe_lib_call"), runs("uretprobe_lib_call"));
    assert!(
        returns.abs_diff(syncs + needed) <= 2 && entries >= returns + entry_only,
        "{entries} entries, {returns} returns for {syncs} syncs and {needed} other calls"
    );
    programs_accounted(&summary);
    assert_eq!(summary["lost_events"], 0);
    // Steps are still found from the collectives' entries, and what is lost is said.
    let steps_json: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("steps.json")).unwrap()).unwrap();
    let found = steps_json["steps"].as_array().unwrap().len() as u32;
    assert!(
        found + 2 >= steps && found <= steps,
        "{found} steps of {steps}"
    );
    let method = steps_json["methods"]["nccl_wait"].as_str().unwrap();
    assert!(method.contains("entry only"), "{method}");
    // The profile's other switch taken too: no InfiniBand counters, and why.
    assert_eq!(
        steps_json["methods"]["infiniband"],
        "not read: the profile has infiniband off"
    );
    // trace.json: the collectives without a return value, the syncs with theirs.
    let trace: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("trace.json")).unwrap()).unwrap();
    let slices = |name: &str| -> Vec<Value> {
        trace["traceEvents"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["name"] == name)
            .cloned()
            .collect()
    };
    let all_reduce = slices("ncclAllReduce");
    assert!(!all_reduce.is_empty());
    assert!(all_reduce.iter().all(|e| e["args"]["ret"].is_null()));
    let sync = slices("cuStreamSynchronize");
    assert!(!sync.is_empty() && sync.iter().all(|e| e["args"]["ret"] == 0));
    no_programs_left();
}

/// `report` on the recording rebuilds the same summary, without the target, and the same
/// doctor.json (regression, issue 17: it did not rebuild doctor.json at all).
#[test]
#[ignore = "needs root, loads eBPF programs: run `cargo xtask test`"]
fn report_rebuilds_the_summary() {
    let _serial = privileged();
    let (_, live, out, dir) = traced_trainer(5, &[]);
    let again = report(&out, dir.path());
    let read =
        |p: &Path| -> Value { serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap() };
    assert_eq!(live, read(&again.join("summary.json")));
    let doctor = read(&out.join("doctor.json"));
    assert!(doctor["findings"].is_array(), "{doctor}");
    assert_eq!(doctor, read(&again.join("doctor.json")));
}

/// Host-blocking collectives: the time is inside the NCCL call itself (enqueue_ns), and
/// a spinning sync (FAKE_CUDA_SPIN) is still measured as sync wait.
#[test]
#[ignore = "needs root, loads eBPF programs: run `cargo xtask test`"]
fn blocking_collectives_and_spinning_syncs() {
    let _serial = privileged();
    let (truth, summary, _, _dir) = traced_trainer(
        5,
        &[
            ("FAKE_NCCL_BLOCKING", "1"),
            ("FAKE_NCCL_US", "1000"),
            ("FAKE_CUDA_SPIN", "1"),
        ],
    );
    let ar = &summary["nccl"]["by_op"]["AllReduce"];
    assert_eq!(ar["calls"], truth["calls"]["AllReduce"]);
    let enqueue = ar["enqueue_ns"].as_u64().unwrap();
    assert!(
        enqueue >= 20 * 1_000_000,
        "AllReduce blocked only {enqueue} ns in 20 calls"
    );
}

/// The real libnccl.so.2 of the nvidia-nccl-cu12 wheel (~473 MB, symbols resolved by
/// mapping it): exactly N ncclAllReduce calls counted, each returning ncclInvalidArgument.
#[test]
#[ignore = "needs root, loads eBPF programs: run `cargo xtask test`"]
fn counts_calls_into_the_real_libnccl() {
    let _serial = privileged();
    let dir = tempfile::tempdir().unwrap();
    let n = 2000;
    let caller = nccl_caller(&real_nccl(), n, dir.path());
    let out = dir.path().join("out");
    let agent = Agent::attach(caller.child.id(), &out, &["--profile", "minimal"]);
    caller.release();
    let truth = caller.finish();
    assert_eq!(truth["invalid_argument"], n);
    let (code, summary, stderr) = agent.wait(Duration::from_secs(60));
    assert_eq!(code, 0, "{stderr}");
    let ar = &summary["nccl"]["by_op"]["AllReduce"];
    assert_eq!(ar["calls"], n, "{summary:#}");
    assert_eq!(ar["errors"], n);
    assert_eq!(summary["nccl"]["calls"], n);
    assert_eq!(summary["lost_events"], 0);
    no_programs_left();
}

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

/// Three ranks whose stand-in collectives complete only when all have arrived (shared
/// memory), rank 1 slowed by 3 ms a step: one agent for all (found by `--all`), exact per-rank counts, ranks
/// read from the environment, rank 1 named the straggler and the slowest rank of most
/// steps, and the others' NCCL wait grown by about the delay.
#[test]
#[ignore = "needs root, loads eBPF programs: run `cargo xtask test`"]
#[allow(clippy::too_many_lines)] // one scenario: three ranks, one agent, every check
fn three_ranks_one_straggler() {
    let _serial = privileged();
    let dir = tempfile::tempdir().unwrap();
    let go = dir.path().join("go");
    let (trainers, shm) = straggler_job(dir.path(), "20", &[]);
    let pids: Vec<u32> = trainers.iter().map(|t| t.child.id()).collect();
    let out = dir.path().join("out");
    // `--all` finds them: every process mapping NCCL (the tests run one at a time).
    let mut child = agent()
        .args(["attach", "--all", "--profile", "minimal", "--out"])
        .arg(&out)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = BufReader::new(child.stderr.take().unwrap()).lines();
    let found = stderr.next().unwrap().unwrap();
    assert!(found.contains("found 3 process(es)"), "{found}");
    let mut attached = 0;
    while attached < 3 {
        let line = stderr
            .next()
            .expect("nccltrace exited before attaching")
            .unwrap();
        assert!(!line.contains("error"), "{line}");
        attached += usize::from(line.contains("attached to pid"));
    }
    let agent = Agent {
        child,
        stderr,
        stdout: std::thread::spawn(String::new),
        out: out.clone(),
        attached: String::new(),
        before: Vec::new(),
    };
    std::fs::write(&go, b"").unwrap();
    let truths: Vec<Value> = trainers.into_iter().map(Target::finish).collect();
    let (code, summary, stderr) = agent.wait(Duration::from_secs(60));
    let _ = std::fs::remove_file(format!("/dev/shm{shm}"));
    assert_eq!(code, 0, "{stderr}");
    let ranks = summary["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 3);
    for (rank, pid) in pids.iter().enumerate() {
        let r = ranks.iter().find(|r| r["pid"] == *pid).unwrap();
        assert_eq!(r["rank"], rank);
        assert_eq!(r["rank_source"], "environment RANK");
        let calls: u64 = [
            "AllReduce",
            "Broadcast",
            "AllGather",
            "ReduceScatter",
            "Reduce",
            "Send",
            "Recv",
        ]
        .iter()
        .map(|op| truths[rank]["total"]["calls"][op].as_u64().unwrap())
        .sum();
        assert_eq!(r["nccl"]["collectives"], calls, "rank {rank}");
    }
    // Regression (issue 17): nccl.calls 5228 beside ranks[0].nccl.calls 4358 (group
    // calls left out of one). Collectives are counted one way in both places.
    let per_rank: u64 = ranks
        .iter()
        .map(|r| r["nccl"]["collectives"].as_u64().unwrap())
        .sum();
    assert_eq!(
        summary["nccl"]["collectives"], per_rank,
        "{:#}",
        summary["nccl"]
    );
    assert_eq!(
        summary["straggler"]["rank"], 1,
        "{:#}",
        summary["straggler"]
    );
    assert!(summary["straggler"]["share_of_waits"].as_f64().unwrap() > 0.5);
    let steps: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("steps.json")).unwrap()).unwrap();
    // The minimal profile probes no CUDA sync: the waits seen are those inside the
    // host-blocking collectives, a lower bound, and said so.
    let method = steps["methods"]["nccl_wait"].as_str().unwrap();
    assert!(method.starts_with("a lower bound"), "{method}");
    let steps = steps["steps"].as_array().unwrap();
    let slow = steps.iter().filter(|s| s["slowest_rank"] == 1).count();
    assert!(
        slow * 2 > steps.len(),
        "rank 1 slowest in {slow} of {} steps",
        steps.len()
    );
    // Ranks 0 and 2 wait about the 3 ms rank 1 sleeps, each step.
    let wait0 = steps
        .iter()
        .map(|s| {
            s["ranks"][0]["categories_ns"]["nccl_wait"]
                .as_u64()
                .unwrap()
        })
        .sum::<u64>()
        / steps.len() as u64;
    assert!(wait0 > 2_000_000, "rank 0 waited {wait0} ns a step");
    recording_in_time_order(&out);
    super::metrics::straggler_in_metrics(&out, &summary);
}

/// Tracing one process (`--pid`) does not probe the others that map the same libraries
/// (the untraced ranks of a node): the uprobes are made for the target (uprobe-multi
/// links with its pid, Linux 6.6+; per-function uprobes for the one target otherwise),
/// so the entry program runs exactly once per call of the target, while an untraced
/// trainer beside it makes as many calls. Before, every process mapping libnccl trapped
/// on each call (~0.8 µs here) and the program checked whether it was a target.
#[test]
#[ignore = "needs root, loads eBPF programs: run `cargo xtask test`"]
fn other_processes_of_the_library_are_not_probed() {
    let _serial = privileged();
    let dir = tempfile::tempdir().unwrap();
    let per_function = dir.path().join("per-function.toml");
    let minimal = std::fs::read_to_string(workspace().join("profiles/minimal.toml")).unwrap();
    std::fs::write(
        &per_function,
        minimal.replace(
            "call_returns = \"all\"",
            "call_returns = \"all\"\nuprobe_multi = false",
        ),
    )
    .unwrap();
    for (profile, multi) in [(Path::new("minimal"), true), (&*per_function, false)] {
        let run = dir.path().join(format!("run-{multi}"));
        let other_dir = run.join("other");
        std::fs::create_dir_all(&other_dir).unwrap();
        let traced = waiting_trainer(&run, 20, 300);
        let other = waiting_trainer(&other_dir, 20, 300);
        let out = run.join("out");
        let agent = Agent::attach(
            traced.child.id(),
            &out,
            &["--profile", profile.to_str().unwrap()],
        );
        other.release();
        traced.release();
        let (other_truth, truth) = (other.finish(), traced.finish());
        let (code, summary, stderr) = agent.wait(Duration::from_secs(60));
        assert_eq!(code, 0, "{stderr}");
        uprobes_attached_as(&summary, multi);
        let made = |truth: &Value| -> u64 {
            truth["total"]["calls"]
                .as_object()
                .unwrap()
                .values()
                .map(|v| v.as_u64().unwrap())
                .sum()
        };
        let calls = summary["nccl"]["calls"].as_u64().unwrap()
            + summary["cuda_sync"]["calls"].as_u64().unwrap();
        assert!(
            calls >= made(&truth),
            "{calls} calls traced: {}",
            summary["nccl"]
        );
        let others = made(&other_truth);
        assert!(
            others >= made(&truth),
            "the untraced trainer made {others} calls"
        );
        let entry = summary["agent"]["bpf"]["programs"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["name"] == "uprobe_lib_call")
            .cloned()
            .unwrap();
        assert_eq!(
            entry["runs"].as_u64(),
            Some(calls),
            "the untraced trainer's calls ran the program ({multi}): {entry}"
        );
        // Made for the target, the program does not time itself: counted whole.
        assert_eq!(entry["traced_runs"], Value::Null, "{entry}");
    }
}

/// `--all --follow`: a trainer that starts after the agent is attached too, its calls all
/// counted, its pid in the summary's targets; the run ends at --duration, not when the
/// first trainer exits.
#[test]
#[ignore = "needs root, loads eBPF programs: run `cargo xtask test`"]
fn follow_attaches_to_later_processes() {
    let _guard = privileged();
    let dir = tempfile::tempdir().unwrap();
    let first = waiting_trainer(dir.path(), 5, 500);
    let out = dir.path().join("out");
    let traced = Agent::attach_many(
        &[],
        &out,
        &[
            "--all",
            "--follow",
            "--duration",
            "8s",
            "--profile",
            "minimal",
        ],
    );
    first.release();
    first.finish();
    // The second one starts after the first has exited: an elastic restart.
    let later_dir = dir.path().join("later");
    std::fs::create_dir(&later_dir).unwrap();
    let later = waiting_trainer(&later_dir, 20, 500);
    let later_pid = later.child.id();
    // Released once the agent has had time to find it (it scans every second).
    std::thread::sleep(Duration::from_millis(2500));
    later.release();
    let truth = later.finish();
    let (code, summary, stderr) = traced.wait(Duration::from_secs(60));
    assert_eq!(code, 0, "{stderr}");
    assert!(
        stderr.contains(&format!("--follow: attached to pid {later_pid}")),
        "{stderr}"
    );
    assert_eq!(summary["stop_reason"], "--duration elapsed", "{summary}");
    let pids: Vec<u64> = summary["targets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["pid"].as_u64().unwrap())
        .collect();
    assert!(pids.contains(&u64::from(later_pid)), "{pids:?}");
    let rank = summary["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["pid"] == later_pid)
        .unwrap_or_else(|| panic!("no rank for pid {later_pid}: {summary}"))
        .clone();
    // Every collective and point-to-point call it made (a rank's `nccl` counts those, not
    // the group calls).
    let expected: u64 = truth["total"]["calls"]
        .as_object()
        .unwrap()
        .iter()
        .filter(|(op, _)| !op.starts_with("Group"))
        .map(|(_, v)| v.as_u64().unwrap())
        .sum();
    assert_eq!(
        rank["nccl"]["collectives"].as_u64().unwrap(),
        expected,
        "{rank}"
    );
    no_programs_left();
}

/// A traced call inside another (the stand-in's ncclCommSplit calls ncclCommInitRank): both
/// paired, the outer one through the hash map while the inner one holds the thread's slot,
/// nothing unpaired.
#[test]
#[ignore = "needs root, loads eBPF programs: run `cargo xtask test`"]
fn nested_calls_are_paired() {
    let _serial = privileged();
    let (_, summary, out, _dir, _) = traced_trainer_with(
        3,
        &[],
        &["--compute-us", "200", "--split-at-end"],
        &["--profile", "full"],
    );
    let by_op = &summary["nccl"]["by_op"];
    assert_eq!(by_op["CommSplit"]["calls"], 1, "{by_op}");
    assert_eq!(by_op["CommInitRank"]["calls"], 1, "{by_op}");
    assert_eq!(by_op["CommDestroy"]["calls"], 2, "{by_op}");
    let outer = by_op["CommSplit"]["enqueue_ns"].as_u64().unwrap();
    let inner = by_op["CommInitRank"]["enqueue_ns"].as_u64().unwrap();
    assert!(
        outer >= inner,
        "the split ({outer} ns) contains the init ({inner} ns)"
    );
    assert_eq!(
        summary["counters"]["unpaired_returns"], 0,
        "{}",
        summary["counters"]
    );
    // The full profile reads each collective's stream off the user stack (ncclReduce's
    // eighth argument, the others' seventh); the trainer passes 0x5000 to all of them.
    let collectives = calls_of(&summary, &[REGISTER_STREAM, STACK_STREAM].concat());
    assert_eq!(
        slices_with_stream(&out),
        (collectives, collectives),
        "{by_op}"
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
    // `to` after the start: (readings where they grew, readings where they did not). The
    // trainer calls it ~16 times in 50 ms: flat means not counting.
    let watch = |from: Duration, to: Duration| {
        std::thread::spawn(move || {
            let started = Instant::now();
            let (mut grew, mut flat, mut last) = (0u32, 0u32, None);
            while started.elapsed() < to {
                let runs: Option<u64> = aya::programs::loaded_programs()
                    .filter_map(Result::ok)
                    .filter(|p| p.name_as_str() == Some("uprobe_lib_call"))
                    .map(|p| p.run_count())
                    .reduce(u64::max);
                if started.elapsed() >= from
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
    // 100 steps of 40 ms: four seconds traced.
    let trainer_args = ["--compute-us", "40000"];
    let seen = watch(Duration::from_millis(1300), Duration::from_millis(3300));
    let (_, summary, _, _, _) = traced_trainer_with(100, &[], &trainer_args, &[]);
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
