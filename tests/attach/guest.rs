//! What needs a machine this one is not: two NUMA nodes, other kernels. These tests run
//! inside the QEMU guests of `cargo xtask vm-test` (two nodes of one CPU each, Debian's
//! 6.1 and 6.12 kernels, emulated ~17× slower than the host: functional checks with
//! bounds for an emulated CPU, not timing).

use super::*;

mod rdma;

/// Fails unless this is the two-node guest (`cargo xtask vm-test` sets NCCLTRACE_GUEST).
fn in_guest() {
    let nodes = std::fs::read_dir("/sys/devices/system/node").map_or(0, |d| {
        d.flatten()
            .filter(|e| {
                let name = e.file_name();
                let name = name.to_string_lossy();
                name.strip_prefix("node")
                    .is_some_and(|n| n.parse::<u32>().is_ok())
            })
            .count()
    });
    assert!(
        in_a_guest() && nodes >= 2,
        "this test needs the two-node guest: run `cargo xtask vm-test` ({nodes} NUMA node(s) here)"
    );
}

/// In an emulated guest a step is 20 ms of compute, ~300 faults and 10 collectives of
/// 400 µs; the agent samples at 999 Hz. Faults are timed by fentry/fexit (both guest
/// kernels allow it) from the exception's entry to the handler's return; the return to
/// user mode and the retried access, emulated and untraced, from the stretches between
/// back-to-back faults and the samples there. They were 15-17% of the trainer's fault
/// time on 6.12 and 23-31% on 6.1 before either counted; 0.5-4.4% in four runs since
/// (docs/attribution.md, 2026-12-06), so page_fault is held to the compute's 15%.
const IN_THE_GUEST: Accuracy = Accuracy {
    steps: 15,
    compute_us: "20000",
    fault_pages: "300",
    sample_hz: "999",
    bound: 0.15,
    page_fault: 0.15,
};

/// The per-step breakdown holds on this kernel: waits inside a sleeping sync, fault time
/// and compute, each against the trainer's own figures.
#[test]
#[ignore = "runs in a two-node QEMU guest: cargo xtask vm-test"]
fn breakdown_in_the_guest() {
    let _serial = privileged();
    in_guest();
    breakdown_within(&[("FAKE_NCCL_US", "400")], &[], &IN_THE_GUEST);
}

/// Sets a NUMA-balancing knob of the guest's kernel (debugfs since 5.13, else absent),
/// putting the old value back when dropped.
struct Knob {
    path: PathBuf,
    old: String,
}

impl Knob {
    fn set(path: &str, value: &str) -> Option<Knob> {
        let path = PathBuf::from(path);
        let old = std::fs::read_to_string(&path).ok()?;
        std::fs::write(&path, value).ok()?;
        Some(Knob { path, old })
    }
}

impl Drop for Knob {
    fn drop(&mut self) {
        let _ = std::fs::write(&self.path, self.old.trim());
    }
}

/// Balancing on, scanning every 100 ms instead of every second: enough hinting faults in
/// a run of seconds.
fn fast_numa_balancing() -> Vec<Knob> {
    let dir = "/sys/kernel/debug/sched/numa_balancing";
    [
        ("/proc/sys/kernel/numa_balancing", "1"),
        (&format!("{dir}/scan_delay_ms") as &str, "100"),
        (&format!("{dir}/scan_period_min_ms"), "100"),
        (&format!("{dir}/scan_period_max_ms"), "400"),
    ]
    .iter()
    .filter_map(|(p, v)| Knob::set(p, v))
    .collect()
}

/// A trainer whose loop thread runs on CPU 0 (node 0) and writes a 16 MiB working set
/// bound to `node` each step, traced; its steps.json and the trainer's own lines. Two
/// threads (`--comm-thread`): the kernel does not scan a single-threaded process's pages
/// that are already on its node, so only a process of several threads, as a training
/// rank is, has local hinting faults to compare with.
fn trainer_with_memory_on(node: &str) -> (Value, Vec<Value>) {
    pinned_trainer("--mem-node", node, 30, "10000")
}

/// The trainer of [`trainer_with_memory_on`], `steps` steps of `compute_us` each.
fn pinned_trainer(bind: &str, node: &str, steps: u32, compute_us: &str) -> (Value, Vec<Value>) {
    let (_, summary, out, _dir, truth) = traced_trainer_with(
        steps,
        &[("FAKE_NCCL_US", "200")],
        &[
            "--cpu",
            "0",
            "--touch-mib",
            "16",
            bind,
            node,
            "--compute-us",
            compute_us,
            "--fault-pages",
            "32",
            "--comm-thread",
        ],
        &[],
    );
    assert_eq!(summary["lost_events"], 0);
    offcpu_stacks_as_taken(&out, &summary);
    let steps: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("steps.json")).unwrap()).unwrap();
    (steps, truth)
}

/// The shares of the steps that have one, and Σ remote_memory and Σ compute (ns); each
/// step's categories still sum to its wall time.
fn remote_shares(steps: &Value) -> (Vec<f64>, u64, u64) {
    let mut shares = Vec::new();
    let (mut remote, mut compute) = (0, 0);
    for s in steps["steps"].as_array().unwrap() {
        let sum = category_sum(s);
        let wall = s["wall_ns"].as_u64().unwrap();
        assert!(
            sum.abs_diff(wall) <= wall / 100,
            "categories {sum} vs wall {wall}: {s}"
        );
        if let Some(share) = s["remote_access"]["share"].as_f64() {
            shares.push(share);
        }
        remote += s["categories_ns"]["remote_memory"].as_u64().unwrap_or(0);
        compute += s["categories_ns"]["compute"].as_u64().unwrap();
    }
    (shares, remote, compute)
}

/// The median share of the steps that have one within `share`, and Σ remote_memory over
/// Σ compute within `remote`: `what` names the run in the message. The shares.
fn shares_within(
    steps: &Value,
    what: &str,
    share: std::ops::RangeInclusive<f64>,
    remote: std::ops::RangeInclusive<f64>,
) -> Vec<f64> {
    let (shares, remote_ns, compute_ns) = remote_shares(steps);
    assert!(!shares.is_empty(), "{what}: no step had a remote share");
    let median = median(shares.clone());
    assert!(
        share.contains(&median),
        "{what}: median remote share {median} not in {share:?} ({shares:?})"
    );
    let ratio = remote_ns as f64 / compute_ns.max(1) as f64;
    assert!(
        remote.contains(&ratio),
        "{what}: remote_memory {remote_ns} ns is {ratio:.3} of compute {compute_ns} ns, not in {remote:?}"
    );
    shares
}

/// The trainer's buffer on the far node while it runs on node 0: nearly every hinting
/// fault is remote and `remote_memory` is estimated, carved out of compute; the same
/// buffer on the near node: nearly none is, and `remote_memory` is about zero.
#[test]
#[ignore = "runs in a two-node QEMU guest: cargo xtask vm-test"]
fn remote_memory_far_and_near() {
    let _serial = privileged();
    in_guest();
    let _knobs = fast_numa_balancing();

    let (far, truth) = trainer_with_memory_on("1");
    // The trainer's own account: its working set stayed on node 1.
    let last = &truth.last().unwrap()["pages_per_node"];
    assert!(last[1].as_u64().unwrap() >= 4000, "{last}");
    let method = far["methods"]["remote_memory"].as_str().unwrap();
    assert!(
        method.starts_with("estimated from NUMA hinting faults"),
        "{method}"
    );
    assert_eq!(far["methods"]["remote_memory_estimated"], true);
    // No PMU in a TCG guest: the estimate, and the reason it is not measured.
    assert!(method.contains("no PMU memory sampling"), "{method}");
    // SLIT 10 vs 20: about half the on-CPU compute, were it all memory-bound.
    let shares = shares_within(&far, "far memory", 0.9..=1.0, 0.25..=1.0);
    assert!(
        shares.len() * 2 >= far["steps"].as_array().unwrap().len(),
        "only {} steps had hinting faults to go by",
        shares.len()
    );

    let (near, _) = trainer_with_memory_on("0");
    shares_within(&near, "near memory", 0.0..=0.1, 0.0..=0.05);
}

/// `migrate_pages()` moving the trainer's pages to the other node shows up as page
/// migrations in the step where it happened, and not before. With balancing off (the
/// doctor's advice) there are no hinting faults: `remote_memory` comes from resident pages
/// where a numa_maps reading fell in the short run, else it is null and says why.
/// The call took 0.3 to 3 s under emulation: one of a second or more is a pause between
/// steps (idle, not a step), and its pages are counted in that idle stretch instead.
#[test]
#[ignore = "runs in a two-node QEMU guest: cargo xtask vm-test"]
fn migrate_pages_in_their_step() {
    let _serial = privileged();
    in_guest();
    let _off = Knob::set("/proc/sys/kernel/numa_balancing", "0");
    let (_, _, out, _dir, truth) = traced_trainer_with(
        12,
        &[("FAKE_NCCL_US", "200")],
        &[
            "--cpu",
            "0",
            "--touch-mib",
            "8",
            "--migrate-at",
            "6",
            "--migrate-to",
            "1",
            "--compute-us",
            "5000",
            "--fault-pages",
            "16",
        ],
        &[],
    );
    let steps: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("steps.json")).unwrap()).unwrap();
    assert_eq!(truth[6]["migrated"], true);
    let moved = truth[6]["pages_per_node"][1].as_u64().unwrap();
    assert!(moved >= 2000, "the trainer's pages on node 1: {}", truth[6]);
    // Ours[k] is the trainer's step k + 1.
    let found = steps["steps"].as_array().unwrap();
    let migrations: Vec<u64> = found
        .iter()
        .map(|s| s["numa_page_migrations"].as_u64().unwrap())
        .collect();
    // The pause the call made, if it made one: between our steps 4 and 5.
    let at = |s: &Value, k: &str| s[k].as_u64().unwrap();
    let paused: u64 = steps["idle"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|i| at(i, "start_ns") >= at(&found[4], "end_ns"))
        .filter(|i| at(i, "end_ns") <= at(&found[5], "start_ns"))
        .map(|i| at(i, "numa_page_migrations"))
        .sum();
    eprintln!(
        "the trainer's step 6: {} ms; pages moved in our step 5 {}, in a pause before it {paused}",
        at(&truth[6], "wall_ns") / 1_000_000,
        migrations[5]
    );
    assert!(
        migrations[5] + paused >= moved,
        "{migrations:?}, {paused} in a pause: {moved} pages moved in step 5; idle: {}",
        steps["idle"]
    );
    assert!(
        migrations[..5].iter().all(|m| *m < 64),
        "migrations before the call: {migrations:?}"
    );
    // Balancing off: no hinting faults; the share, where a numa_maps reading came in the
    // short run, from the resident pages (`remote_memory_from_resident_pages` checks it).
    let method = steps["methods"]["remote_memory"].as_str().unwrap();
    assert!(
        method.starts_with("estimated from the target's resident pages")
            || method.contains("numa_balancing = 0"),
        "{method}"
    );
}

/// With NUMA balancing off (the doctor's advice for pinned jobs) the kernel samples no
/// access: the share comes from where the process's memory is (numa_maps, every 2 s)
/// seen from the rank thread's node — most of it remote when the working set is bound to
/// the far node, almost none when to the near one.
#[test]
#[ignore = "runs in a two-node QEMU guest: cargo xtask vm-test"]
fn remote_memory_from_resident_pages() {
    let _serial = privileged();
    in_guest();
    let _off = Knob::set("/proc/sys/kernel/numa_balancing", "0");
    let (far, _) = pinned_trainer("--mem-node", "1", 60, "30000");
    let method = far["methods"]["remote_memory"].as_str().unwrap();
    assert!(
        method.starts_with("estimated from the target's resident pages"),
        "{method}"
    );
    assert_eq!(far["methods"]["remote_memory_estimated"], true);
    let shares = shares_within(&far, "far memory", 0.8..=1.0, 0.2..=1.0);
    assert!(shares.len() >= 10, "{} steps with a share", shares.len());
    let (near, _) = pinned_trainer("--mem-node", "0", 60, "30000");
    shares_within(&near, "near memory", 0.0..=0.15, 0.0..=0.1);
}

/// Issue 52: with balancing on, memory bound the way `numactl --membind` binds it (the
/// process's own policy, no `MPOL_F_NUMA_BALANCING`) is never scanned, and read
/// `remote_memory` null every step. The agent sees the policy in numa_maps at attach and
/// reads the resident pages instead, saying why.
#[test]
#[ignore = "runs in a two-node QEMU guest: cargo xtask vm-test"]
fn remote_memory_of_memory_balancing_does_not_scan() {
    let _serial = privileged();
    in_guest();
    let _knobs = fast_numa_balancing();
    let (far, _) = pinned_trainer("--bind-node", "1", 40, "30000");
    let method = far["methods"]["remote_memory"].as_str().unwrap();
    assert!(
        method.starts_with("estimated from the target's resident pages")
            && method.contains("under the policy bind:1 (")
            && method.contains("which NUMA balancing does not scan"),
        "{method}"
    );
    let shares = shares_within(&far, "far-bound memory", 0.8..=1.0, 0.2..=1.0);
    assert!(shares.len() >= 10, "{} steps with a share", shares.len());
    let (near, _) = pinned_trainer("--bind-node", "0", 40, "30000");
    let method = near["methods"]["remote_memory"].as_str().unwrap();
    assert!(method.contains("under the policy bind:0 ("), "{method}");
    shares_within(&near, "near-bound memory", 0.0..=0.15, 0.0..=0.1);
}

/// Issue 23: counted loads on a real two-node kernel, with its SLIT and the rank thread's
/// node from its switches. A TCG guest has no PMU, so the software stand-in counts (page
/// faults for DRAM loads, minor faults for remote ones: all of them are): every step's
/// share is 1, and at the guest's distances (10 vs 20) `remote_memory` is half the on-CPU
/// time left after faults, carved out of compute.
#[test]
#[ignore = "runs in a two-node QEMU guest: cargo xtask vm-test"]
fn remote_memory_from_counted_loads() {
    let _serial = privileged();
    in_guest();
    let (summary, steps, _out, _dir) = trainer_counting_loads(
        &[
            "--steps",
            "15",
            "--cpu",
            "0",
            "--compute-us",
            "20000",
            "--fault-pages",
            "64",
        ],
        &[("FAKE_NCCL_US", "200")],
    );
    assert!(
        summary["memory"]["node_load_readings"]
            .as_u64()
            .unwrap_or(0)
            > 0
    );
    let method = steps["methods"]["remote_memory"].as_str().unwrap();
    assert!(
        method.starts_with("estimated from the rank thread's loads counted by a software"),
        "{method}"
    );
    assert_eq!(steps["methods"]["remote_memory_estimated"], true);
    let shares = shares_within(&steps, "counted loads", 0.99..=1.0, 0.9..=1.1);
    // Every step from counted loads: the counters count from their open, before the
    // first steps (in one run the first 7 steps, begun in the ~400 ms between the open
    // and the first reading, came from hinting faults before the open was a reading).
    for s in steps["steps"].as_array().unwrap() {
        assert_eq!(
            s["remote_access"]["from"],
            "the thread's loads counted by the PMU (node-loads, node-load-misses)",
            "{s}"
        );
    }
    assert!(shares.len() >= 12, "{} steps with a share", shares.len());
}

/// The doctor, on the guest's real two-node /proc and /sys: a rank bound to node 0 whose
/// memory is on node 1 is told so, with the fix; the same rank with its memory at home
/// is not.
#[test]
#[ignore = "runs in a two-node QEMU guest: cargo xtask vm-test"]
fn doctor_names_far_memory() {
    let _serial = privileged();
    in_guest();
    let doctor_on = |node: &str| -> Value {
        let dir = tempfile::tempdir().unwrap();
        let go = dir.path().join("go");
        let args = [
            "--cpu",
            "0",
            "--touch-mib",
            "64",
            "--mem-node",
            node,
            "--go-file",
            go.to_str().unwrap(),
        ];
        let trainer = Target::spawn(&fixtures().join("trainer"), &args, &[], dir.path());
        let pid = trainer.child.id().to_string();
        let out = agent()
            .args(["doctor", "--pid", &pid, "--json"])
            .output()
            .unwrap();
        trainer.release();
        trainer.finish();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let finding = |doctor: &Value| -> Option<Value> {
        doctor["findings"]
            .as_array()
            .unwrap()
            .iter()
            .find(|f| f["id"] == "memory_remote")
            .cloned()
    };
    let far = doctor_on("1");
    let f = finding(&far).unwrap_or_else(|| panic!("no memory_remote finding: {far}"));
    assert_eq!(f["severity"], "error", "{f}");
    let summary = f["summary"].as_str().unwrap();
    assert!(
        summary.contains("node its threads run on, node 0"),
        "{summary}"
    );
    let fix = f["fix"].as_str().unwrap();
    assert!(
        fix.contains("--membind=0") && fix.contains("all 0"),
        "{fix}"
    );
    let near = doctor_on("0");
    assert_eq!(finding(&near), None, "{near}");
}

/// Issue 22: the Python frames walked by the `bpf_loop` callback, and by the unrolled loop
/// that kernels before 5.17 get, on this kernel's verifier (Debian's CPython 3.11, which
/// the guest shares with the host), naming the lines that waited as on the host.
#[test]
#[ignore = "runs in a two-node QEMU guest: cargo xtask vm-test"]
fn python_frames_in_the_guest() {
    let _serial = privileged();
    in_guest();
    let python = Path::new("/usr/bin/python3.11");
    let dir = tempfile::tempdir().unwrap();
    let unrolled = default_profile_with(
        dir.path(),
        "unrolled.toml",
        &[("python_loop = true", "python_loop = false")],
    );
    for (args, walk) in [
        (vec![], "bpf_loop callback"),
        (
            vec!["--profile", unrolled.to_str().unwrap()],
            "unrolled loop (profile python_loop = false)",
        ),
    ] {
        let run = tempfile::tempdir().unwrap();
        let (code, summary, stderr, out) =
            crate::python::traced_rank_with(&[], python, run.path(), &args, &[]);
        assert_eq!(code, 0, "{stderr}");
        assert_eq!(
            summary["agent"]["python_walk"], walk,
            "{}",
            summary["agent"]
        );
        crate::python::check_python_frames(&out, python);
    }
}

/// The workload of issue 59 under the profile `profile`: a rank bound to node 0 with its
/// memory on node 1 (`--cpu 0 --mem-node 1`), writing a 64 MiB working set and faulting
/// 1 MiB of fresh memory (256 pages) a step, NUMA balancing on; traced to its
/// end. Under the default profile this panicked the 6.12 guest within ten seconds, when
/// the agent turned the kernel's run-time accounting on and off under its fentry program
/// on the fault handler. The run completes with every step and fault seen, faults timed by
/// fentry/fexit where the profile times them, and the kernel never counts a run of the
/// agent's programs (its accounting never on). A guest that panics fails the run with the
/// console's oops (`cargo xtask vm-test`).
fn fault_heavy_bound(profile: &str, steps: u32) {
    let _serial = privileged();
    in_guest();
    cost::kernel_stats_off_before();
    // Balancing on at its own pace: scanning every 100 ms (`fast_numa_balancing`), 6.1
    // took a hinting fault on most of the working set's pages every step (2 million faults
    // in 150 steps, 146 s traced).
    let _knobs: Vec<Knob> = Knob::set("/proc/sys/kernel/numa_balancing", "1")
        .into_iter()
        .collect();
    let seen = cost::watch_programs(
        Duration::from_millis(50),
        Duration::ZERO,
        Duration::from_secs(600),
    );
    let (truth, summary, out, _dir, lines) = traced_trainer_with(
        steps,
        &[("FAKE_NCCL_US", "200")],
        &[
            "--cpu",
            "0",
            "--mem-node",
            "1",
            "--touch-mib",
            "64",
            "--fault-pages",
            "256",
            "--compute-us",
            "10000",
            "--comm-thread",
        ],
        &["--profile", profile],
    );
    let (_, kernel_runs) = seen.join().unwrap();
    // For the log: how long the fault handler's trampoline ran under the job.
    eprintln!(
        "{profile}: traced {:.1} s, {} faults, {} readings of the kernel's counts",
        summary["duration_ns"].as_f64().unwrap_or(0.0) / 1e9,
        summary["memory"]["page_faults"],
        kernel_runs.len()
    );
    cost::never_accounted(&kernel_runs, profile);
    assert_eq!(truth["steps"], u64::from(steps), "{truth}");
    // Bound far: none of the working set on the rank's node.
    let last = &lines.last().unwrap()["pages_per_node"];
    assert!(
        last[0] == 0 && last[1].as_u64().unwrap() > 0,
        "{profile}: {last}"
    );
    let found: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("steps.json")).unwrap()).unwrap();
    // Steps, not their exact count, are what this test is about: the emulated faults and
    // the attach (its partial steps left out) cost a few (139 and 146 of 150 seen).
    let count = found["steps"].as_array().unwrap().len();
    assert!(
        count * 10 >= steps as usize * 9,
        "{profile}: {count} steps found of {steps}"
    );
    let agent = &summary["agent"];
    let text =
        std::fs::read_to_string(workspace().join(format!("profiles/{profile}.toml"))).unwrap();
    if text.contains("\npage_faults = true") {
        let faults = summary["memory"]["page_faults"].as_u64().unwrap();
        assert!(
            faults >= u64::from(steps) * 256,
            "{profile}: {faults} faults for {steps} steps of 256"
        );
        let method = found["methods"]["page_fault"].as_str().unwrap_or("");
        assert!(method.starts_with("fentry/fexit"), "{profile}: {method}");
    }
    assert!(agent["bpf"].is_object(), "{profile}: {agent}");
    assert_eq!(summary["lost_events"], 0, "{profile}");
}

/// Issue 59's workload under the default profile (the guest smoke of `cargo xtask test`).
#[test]
#[ignore = "runs in a two-node QEMU guest: cargo xtask vm-test"]
fn fault_heavy_bound_default_profile() {
    // About 15 s traced in the 6.12 guest: the panics came 1-10 s after the attach.
    fault_heavy_bound("default", 150);
}

/// Issue 59's workload under the minimal profile (no fault probes: sched and calls).
#[test]
#[ignore = "runs in a two-node QEMU guest: cargo xtask vm-test"]
fn fault_heavy_bound_minimal_profile() {
    fault_heavy_bound("minimal", 150);
}

/// Issue 59's workload under the full profile (every probe, fault stacks, 4999 Hz): fewer
/// steps, each several times slower traced under emulation (150 took 182 s in the 6.12
/// guest, past a guest test's bound).
#[test]
#[ignore = "runs in a two-node QEMU guest: cargo xtask vm-test"]
fn fault_heavy_bound_full_profile() {
    fault_heavy_bound("full", 50);
}
