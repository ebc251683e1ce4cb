//! The target's environment: containers (mount namespaces), tracefs not mounted, no kernel BTF.

use super::*;

/// A job in a container: the libraries exist only in the target's own mount namespace
/// (a tmpfs the host does not see). They are found and probed through /proc/PID/root and
/// every collective is counted.
#[test]
#[ignore = "needs root, loads eBPF programs: run `cargo xtask test`"]
fn library_only_inside_the_targets_mount_namespace() {
    let _guard = privileged();
    let dir = tempfile::tempdir().unwrap();
    let go = dir.path().join("go");
    let fx = fixtures();
    let inside = dir.path().join("ctr");
    std::fs::create_dir(&inside).unwrap();
    let script = format!(
        "mount -t tmpfs none {i} && cp {f}/trainer {f}/libnccl.so.2 {f}/libcuda.so.1 {i}/ && \
         exec {i}/trainer --steps 20 --compute-us 500 --go-file {g}",
        i = inside.display(),
        f = fx.display(),
        g = go.display()
    );
    let trainer = Target::spawn(
        Path::new("unshare"),
        &["--mount", "--propagation", "private", "sh", "-c", &script],
        &[],
        dir.path(),
    );
    assert!(
        !inside.join("libnccl.so.2").exists(),
        "the host sees the container's tmpfs"
    );
    let out = dir.path().join("out");
    let agent = Agent::attach(trainer.child.id(), &out, &["--profile", "minimal"]);
    trainer.release();
    let truth = trainer.finish();
    let (code, summary, stderr) = agent.wait(Duration::from_secs(60));
    assert_eq!(code, 0, "{stderr}");
    for (op, calls) in truth["total"]["calls"].as_object().unwrap() {
        assert_eq!(summary["nccl"]["by_op"][op]["calls"], *calls, "{op} calls");
    }
    assert_eq!(
        summary["targets"][0]["nccl_library"],
        format!("{}/libnccl.so.2", inside.display())
    );
}

/// tracefs not mounted (a private mount namespace where it was unmounted): the agent mounts
/// it itself, attaches, and counts every collective.
#[test]
#[ignore = "needs root, loads eBPF programs: run `cargo xtask test`"]
fn mounts_tracefs_when_missing() {
    let _guard = privileged();
    let dir = tempfile::tempdir().unwrap();
    attach_in_private_mounts(
        dir.path(),
        "umount /sys/kernel/tracing 2>/dev/null; umount /sys/kernel/debug/tracing 2>/dev/null; \
         if [ -d /sys/kernel/tracing/events ]; then echo 'tracefs still mounted' >&2; exit 3; fi",
        "minimal",
    );
    assert!(
        Path::new("/sys/kernel/tracing/events").is_dir(),
        "the host's tracefs is untouched"
    );
}

/// No kernel BTF (/sys/kernel/btf hidden under an empty tmpfs, in the agent's own mount
/// namespace): the programs need none and load; fault timing by fentry/fexit, which does,
/// is not tried and steps.json says why; every collective counted.
#[test]
#[ignore = "needs root, loads eBPF programs: run `cargo xtask test`"]
fn works_without_kernel_btf() {
    let _guard = privileged();
    let dir = tempfile::tempdir().unwrap();
    attach_in_private_mounts(
        dir.path(),
        "mount -t tmpfs none /sys/kernel/btf; \
         if [ -e /sys/kernel/btf/vmlinux ]; then echo 'BTF still visible' >&2; exit 3; fi",
        "default",
    );
    let steps: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("out/steps.json")).unwrap())
            .unwrap();
    let method = steps["methods"]["page_fault"].as_str().unwrap();
    assert!(method.contains("no kernel BTF"), "{method}");
    assert!(
        Path::new("/sys/kernel/btf/vmlinux").exists(),
        "the host's BTF is untouched"
    );
}

/// Runs the agent (profile `profile`) on a waiting trainer from a private mount namespace
/// prepared by the shell commands `prepare`, and requires every collective counted.
fn attach_in_private_mounts(dir: &Path, prepare: &str, profile: &str) {
    let trainer = waiting_trainer(dir, 10, 500);
    let out = dir.join("out");
    let script = format!(
        "{prepare}; exec {agent} attach --profile {profile} --pid {pid} --out {out}",
        agent = env!("CARGO_BIN_EXE_nccltrace"),
        pid = trainer.child.id(),
        out = out.display()
    );
    let mut child = Command::new("unshare")
        .args(["--mount", "--propagation", "private", "sh", "-c", &script])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = BufReader::new(child.stderr.take().unwrap()).lines();
    let mut said = Vec::new();
    for line in stderr.by_ref() {
        let line = line.unwrap();
        let attached = line.contains("attached to pid");
        said.push(line);
        if attached {
            break;
        }
    }
    assert!(
        said.iter().any(|l| l.contains("attached to pid")),
        "never attached: {said:?}"
    );
    trainer.release();
    let truth = trainer.finish();
    said.extend(stderr.map_while(Result::ok));
    assert!(child.wait().unwrap().success(), "{said:?}");
    let summary: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    for (op, calls) in truth["total"]["calls"].as_object().unwrap() {
        assert_eq!(
            summary["nccl"]["by_op"][op]["calls"], *calls,
            "{op} calls: {said:?}"
        );
    }
}
