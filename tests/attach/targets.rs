//! Which processes are traced: only the one asked for, and later ones with `--follow`.

use super::*;

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

/// Two jobs of three ranks each side by side ([`straggler_job_named`], 20 steps, rank 1
/// of each late), each with its own `env`, all six traced by one agent (`minimal`
/// profile) until it exits: their pids (job a's three, then b's), the output folder and
/// what it printed.
fn two_jobs_traced(
    dir: &Path,
    extra: &[&str],
    env: [&[(&str, &str)]; 2],
) -> (Vec<u32>, PathBuf, String) {
    let (mut trainers, shm_a) = straggler_job_named(dir, "20", extra, "a", env[0]);
    let (job_b, shm_b) = straggler_job_named(dir, "20", extra, "b", env[1]);
    trainers.extend(job_b);
    let pids: Vec<u32> = trainers.iter().map(|t| t.child.id()).collect();
    let out = dir.join("out");
    let agent = Agent::attach_many(&pids, &out, &["--profile", "minimal"]);
    std::fs::write(dir.join("go"), b"").unwrap();
    for t in trainers {
        t.finish();
    }
    let (code, stdout, stderr) = agent.wait_for_exit(Duration::from_secs(60));
    for shm in [shm_a, shm_b] {
        let _ = std::fs::remove_file(format!("/dev/shm{shm}"));
    }
    assert_eq!(code, 0, "{stderr}");
    (pids, out, stdout)
}

/// Two jobs of three ranks each, started side by side on one host (their launchers' rendezvous
/// differ: `MASTER_PORT` 29500 and 29501), rank 1 of each slowed by 3 ms a step, all six
/// traced by one agent: each job's ranks are matched among themselves only, so each job
/// names its own rank 1 the straggler, about 3 ms late, and neither is charged the other's
/// pace. Matched as one job (as before), the six gave one straggler for both.
#[test]
#[ignore = "needs root, loads eBPF programs: run `cargo xtask test`"]
fn ranks_of_two_jobs_are_matched_apart() {
    let _serial = privileged();
    let dir = tempfile::tempdir().unwrap();
    let rendezvous = |port| [("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", port)];
    let (pids, out, stdout) = two_jobs_traced(
        dir.path(),
        &[],
        [&rendezvous("29500"), &rendezvous("29501")],
    );
    let summary: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    assert!(summary["straggler"].is_null(), "{:#}", summary["straggler"]);
    let by_job = summary["stragglers_by_job"]
        .as_array()
        .unwrap_or_else(|| panic!("no stragglers_by_job: {summary:#}"));
    assert_eq!(by_job.len(), 2, "{by_job:#?}");
    for (s, (pid, port)) in by_job.iter().zip([(pids[1], "29500"), (pids[4], "29501")]) {
        assert_eq!(s["pid"], pid, "{s:#}");
        assert_eq!(s["rank"], 1, "{s:#}");
        assert_eq!(
            s["job"],
            format!("MASTER_ADDR:MASTER_PORT=127.0.0.1:{port}"),
            "{s:#}"
        );
        assert!(s["share_of_waits"].as_f64().unwrap() > 0.5, "{s:#}");
        // About the 3 ms it sleeps a step, spread over the step's collectives: well under
        // a step, where matching across jobs drifts by whole steps.
        let late = s["mean_lateness_ns"].as_u64().unwrap();
        assert!(late > 100_000 && late < 10_000_000, "{s:#}");
    }
    let steps: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("steps.json")).unwrap()).unwrap();
    assert_eq!(steps["stragglers_by_job"], summary["stragglers_by_job"]);
    // On stdout: the six ranks, and a straggler line per job.
    assert!(stdout.contains("Ranks: 6"), "{stdout}");
    for (pid, port) in [(pids[1], "29500"), (pids[4], "29501")] {
        let line = format!(
            "  straggler of MASTER_ADDR:MASTER_PORT=127.0.0.1:{port}: rank 1 (pid {pid}): "
        );
        assert!(stdout.contains(&line), "{line} not in {stdout}");
    }
}

/// Issue 51: two jobs of three ranks side by side with nothing in their environment to tell
/// them apart (no launcher's job id or rendezvous), each rank making its communicator
/// after the agent attached: the unique id its `ncclCommInitRank` names groups the ranks
/// into jobs, each matched on its own with its own straggler. Without it the six were
/// one job and one straggler for both.
#[test]
#[ignore = "needs root, loads eBPF programs: run `cargo xtask test`"]
fn jobs_told_apart_by_their_unique_ids() {
    let _serial = privileged();
    let dir = tempfile::tempdir().unwrap();
    let (pids, out, stdout) = two_jobs_traced(
        dir.path(),
        &["--init-after-go"],
        [&[("FAKE_NCCL_UID", "job a")], &[("FAKE_NCCL_UID", "job b")]],
    );
    let summary: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    assert!(summary["straggler"].is_null(), "{:#}", summary["straggler"]);
    let by_job = summary["stragglers_by_job"]
        .as_array()
        .unwrap_or_else(|| panic!("no stragglers_by_job: {summary:#}"));
    let got: Vec<(u64, &str)> = by_job
        .iter()
        .map(|s| (s["pid"].as_u64().unwrap(), s["job"].as_str().unwrap_or("")))
        .collect();
    assert_eq!(got.len(), 2, "{by_job:#?}");
    let mut late_ranks: Vec<u64> = got.iter().map(|g| g.0).collect();
    late_ranks.sort_unstable();
    assert_eq!(late_ranks, [pids[1], pids[4]].map(u64::from), "{by_job:#?}");
    assert!(
        got.iter().all(|g| g.1.starts_with("ncclUniqueId 0x")),
        "{by_job:#?}"
    );
    assert_ne!(got[0].1, got[1].1);
    for s in by_job {
        let late = s["mean_lateness_ns"].as_u64().unwrap();
        assert!(late > 100_000 && late < 10_000_000, "{s:#}");
        let line = format!(
            "  straggler of {}: rank 1 (pid {}): ",
            s["job"].as_str().unwrap(),
            s["pid"]
        );
        assert!(stdout.contains(&line), "{line} not in {stdout}");
    }
}

/// Three ranks already running, rank 1 sleeping 20 ms before each step's collectives while
/// the others wait for it inside the first (the stand-in's collectives return once all
/// three arrived): the agent arms the probes at some instant of that wait nearly every
/// time, so ranks 0 and 2 are first traced one collective after rank 1. Lined up by
/// causality, rank 1 is the straggler, about 20 ms late once a step; matched by position
/// (before), every pair was one off and rank 0 or 2 was named.
#[test]
#[ignore = "needs root, loads eBPF programs: run `cargo xtask test`"]
fn ranks_attached_mid_collective_are_lined_up() {
    let _serial = privileged();
    let dir = tempfile::tempdir().unwrap();
    let (trainers, shm) = straggler_job_late(dir.path(), "100000", &[], "mid", &[], "20000");
    std::fs::write(dir.path().join("go"), b"").unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let pids: Vec<u32> = trainers.iter().map(|t| t.child.id()).collect();
    let out = dir.path().join("out");
    let agent = Agent::attach_many(&pids, &out, &["--duration", "3s"]);
    let (code, summary, stderr) = agent.wait(Duration::from_secs(60));
    for mut t in trainers {
        let _ = t.child.kill();
        let _ = t.child.wait();
    }
    let _ = std::fs::remove_file(format!("/dev/shm{shm}"));
    assert_eq!(code, 0, "{stderr}");
    let s = &summary["straggler"];
    assert_eq!(s["pid"], pids[1], "{summary:#}");
    assert_eq!(s["rank"], 1, "{s:#}");
    // 20 ms at the step's first collective, none at the others.
    let late = s["mean_lateness_ns"].as_u64().unwrap();
    assert!(late > 1_000_000 && late < 20_000_000, "{s:#}");
    let ranks = summary["ranks"].as_array().unwrap();
    let how: Vec<&str> = ranks
        .iter()
        .map(|r| r["matched"].as_str().unwrap())
        .collect();
    eprintln!("{how:#?}");
    assert!(how[0].starts_with("the reference"), "{how:?}");
    assert!(
        how[1..].iter().all(|h| h.contains("the only pairing")),
        "{how:?}"
    );
}

/// An elastic restart under `--all --follow`: a three-rank job (rank 1 sleeping 3 ms a
/// step) runs and exits, then its next generation (same rendezvous, rank 1 now sleeping
/// 9 ms) starts. The new ranks are matched among themselves, so the run's straggler is the
/// new rank 1, which made the others wait the most. While the exited ranks stayed in the
/// match, nothing of the second generation was matched and the first one's rank 1 was
/// named.
#[test]
#[ignore = "needs root, loads eBPF programs: run `cargo xtask test`"]
fn ranks_after_a_restart_are_matched_again() {
    let _serial = privileged();
    let dir = tempfile::tempdir().unwrap();
    let env = [("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29600")];
    let (first, shm_1) = straggler_job_late(dir.path(), "30", &[], "g1", &env, "3000");
    let out = dir.path().join("out");
    let agent = Agent::attach_many(&[], &out, &["--all", "--follow", "--duration", "9s"]);
    std::fs::write(dir.path().join("go"), b"").unwrap();
    for t in first {
        t.finish();
    }
    let later = dir.path().join("later");
    std::fs::create_dir(&later).unwrap();
    let (second, shm_2) = straggler_job_late(&later, "30", &[], "g2", &env, "9000");
    let late_pid = second[1].child.id();
    // Released once the agent has found them (it scans every second).
    std::thread::sleep(Duration::from_millis(2500));
    std::fs::write(later.join("go"), b"").unwrap();
    for t in second {
        t.finish();
    }
    let (code, summary, stderr) = agent.wait(Duration::from_secs(60));
    for shm in [shm_1, shm_2] {
        let _ = std::fs::remove_file(format!("/dev/shm{shm}"));
    }
    assert_eq!(code, 0, "{stderr}");
    let s = &summary["straggler"];
    assert_eq!(s["pid"], late_pid, "{summary:#}");
    // Late by a few ms (9 ms at one collective of the step's ten): matched with the last
    // collectives of the exited ranks instead, by the seconds between the generations.
    let late = s["mean_lateness_ns"].as_u64().unwrap();
    assert!(late > 100_000 && late < 9_000_000, "{s:#}");
    assert!(
        stderr.contains(&format!("--follow: attached to pid {late_pid}")),
        "{stderr}"
    );
    // The new ranks were lined up afresh, not matched in order as latecomers.
    let ranks = summary["ranks"].as_array().unwrap();
    let late_rank = ranks.iter().find(|r| r["pid"] == late_pid).unwrap();
    let how = late_rank["matched"].as_str().unwrap();
    assert!(how.contains("the only pairing"), "{how}");
}
