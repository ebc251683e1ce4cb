//! Counting: every call of the stand-in and the real libnccl, scheduler tracepoints,
//! entry-only collectives, several ranks, nested calls.

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

/// Regression (issue 51): eight one-rank jobs sharing a GPU, no launcher variables, read
/// as one job of eight ranks, one "the straggler". Three trainers, each its own one-rank
/// communicator made before attach, the second 3 ms late a step: none is named, each is a
/// job of its own, and every rank's collectives are still counted exactly.
#[test]
#[ignore = "needs root, loads eBPF programs: run `cargo xtask test`"]
fn independent_one_rank_jobs_have_no_straggler() {
    let _serial = privileged();
    let dir = tempfile::tempdir().unwrap();
    let go = dir.path().join("go");
    let trainers: Vec<Target> = (0..3)
        .map(|i| {
            let mut args = vec!["--steps", "30", "--compute-us", "1000", "--no-migrate"];
            args.extend(["--go-file", go.to_str().unwrap()]);
            if i == 1 {
                args.extend(["--step-sleep-us", "3000"]);
            }
            Target::spawn(
                &fixtures().join("trainer"),
                &args,
                &[("FAKE_NCCL_US", "100")],
                dir.path(),
            )
        })
        .collect();
    let pids: Vec<u32> = trainers.iter().map(|t| t.child.id()).collect();
    let out = dir.path().join("out");
    let agent = Agent::attach_many(&pids, &out, &[]);
    std::fs::write(&go, b"").unwrap();
    let truths: Vec<Value> = trainers.into_iter().map(Target::finish).collect();
    let (code, stdout, stderr) = agent.wait_for_exit(Duration::from_secs(60));
    assert_eq!(code, 0, "{stderr}");
    let summary: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    let steps: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("steps.json")).unwrap()).unwrap();
    assert!(summary["straggler"].is_null(), "{}", summary["straggler"]);
    assert!(steps["straggler"].is_null(), "{}", steps["straggler"]);
    let mut alone: Vec<u64> = steps["one_rank_jobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p.as_u64().unwrap())
        .collect();
    alone.sort_unstable();
    let mut expected: Vec<u64> = pids.iter().map(|p| u64::from(*p)).collect();
    expected.sort_unstable();
    assert_eq!(alone, expected);
    assert!(
        stdout.contains("straggler: none (3 independent jobs of one rank"),
        "{stdout}"
    );
    for (pid, truth) in pids.iter().zip(&truths) {
        let r = summary["ranks"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["pid"] == *pid)
            .unwrap();
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
        .map(|op| truth["total"]["calls"][op].as_u64().unwrap())
        .sum();
        assert_eq!(r["nccl"]["collectives"], calls, "pid {pid}");
        // Each is rank 0 of its own job, as its communicator says: not numbered by pid.
        assert_eq!(
            (r["rank"].as_i64(), r["rank_source"].as_str()),
            (Some(0), Some("communicator memory")),
            "pid {pid}"
        );
    }
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
    // Each rank's communicator, made before attach, read from its memory (issue 51): three
    // ranks, each its own rank in it, so their syncs' waits may be NCCL's.
    let comms = steps["communicators"].as_array().unwrap();
    assert_eq!(comms.len(), 3, "{comms:?}");
    for (rank, pid) in pids.iter().enumerate() {
        let c = comms.iter().find(|c| c["pid"] == *pid).unwrap();
        assert_eq!(
            (&c["nranks"], &c["rank"], &c["nranks_from"]),
            (&Value::from(3), &Value::from(rank), &Value::from("memory")),
            "{comms:?}"
        );
    }
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
