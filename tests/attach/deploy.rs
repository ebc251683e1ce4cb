//! The Slurm recipe run for real: `deploy/slurm/nccltrace-srun.sh` as the node's first
//! task wraps the demo trainer (see docs/deploy.md).

use super::*;

/// The wrapper starts an agent beside the command (`--all --follow`, which finds the
/// trainer whenever it loads NCCL), stops it with SIGINT once the command ends, and
/// exits with the command's code; the agent's outputs, in `<out>/<job>.<step>/<host>`,
/// count every AllReduce the trainer made after the agent attached.
#[test]
#[ignore = "needs root, loads eBPF programs: run `cargo xtask test`"]
fn slurm_wrapper_traces_the_node() {
    let _guard = privileged();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("traces");
    let run = |steps: &str| {
        Command::new(workspace().join("deploy/slurm/nccltrace-srun.sh"))
            .arg(fixtures().join("trainer"))
            .args(["--steps", steps, "--compute-us", "2000"])
            .env("SLURM_LOCALID", "0")
            .env("SLURM_JOB_ID", "4242")
            .env("SLURM_STEP_ID", "1")
            .env("NCCLTRACE", env!("CARGO_BIN_EXE_nccltrace"))
            .env("NCCLTRACE_OUT", &out)
            .env("FAKE_NCCL_US", "300")
            .output()
            .unwrap()
    };
    let done = run("3000");
    let stderr = String::from_utf8_lossy(&done.stderr);
    assert!(done.status.success(), "{stderr}");
    assert!(!stderr.contains("the agent exited"), "{stderr}");
    let host =
        String::from_utf8(Command::new("hostname").arg("-s").output().unwrap().stdout).unwrap();
    let node = out.join("4242.1").join(host.trim());
    let log = std::fs::read_to_string(node.with_extension("log")).unwrap_or_default();
    let summary: Value = serde_json::from_str(
        &std::fs::read_to_string(node.join("summary.json"))
            .unwrap_or_else(|e| panic!("no summary ({e}): {log}")),
    )
    .unwrap();
    assert_eq!(summary["stop_reason"], "SIGINT received", "{log}");
    // The trainer's last line: its totals.
    let stdout = String::from_utf8_lossy(&done.stdout);
    let truth: Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    let ours = summary["nccl"]["by_op"]["AllReduce"]["calls"]
        .as_u64()
        .unwrap();
    let theirs = truth["total"]["calls"]["AllReduce"].as_u64().unwrap();
    // The agent attaches while the trainer runs (a second or two of its ~8 s): at least
    // half of the calls were seen.
    assert!(
        ours <= theirs && ours * 2 >= theirs,
        "{ours} of {theirs}: {log}"
    );
    // The command's exit code is the wrapper's, and a task that is not the node's first
    // runs the command alone.
    let refused = Command::new(workspace().join("deploy/slurm/nccltrace-srun.sh"))
        .args(["sh", "-c", "exit 3"])
        .env("SLURM_LOCALID", "1")
        .env("NCCLTRACE", "/nonexistent")
        .status()
        .unwrap();
    assert_eq!(refused.code(), Some(3));
}
