//! `cargo xtask test`: every test, the privileged ones for real.

use std::path::Path;
use std::process::Command;

use anyhow::bail;

/// The guest tests of a full run, in one 6.12 guest with the debug agent: the remote-memory
/// estimate (hinting faults, counted loads, and memory bound where balancing cannot see
/// it), page migrations in their step, the doctor on a real two-node /sys, a live
/// soft-RoCE port's counters per step, and issue 59's fault-heavy bound rank under the
/// default profile (a kernel oops fails the guest). `cargo xtask vm-test` runs every
/// guest test on 6.1 and 6.12 with the release agent.
const GUEST_SMOKE: [&str; 7] = [
    "guest::remote_memory_far_and_near",
    "guest::remote_memory_of_memory_balancing_does_not_scan",
    "guest::remote_memory_from_counted_loads",
    "guest::migrate_pages_in_their_step",
    "guest::doctor_names_far_memory",
    "guest::rdma::infiniband_counters_of_a_live_port",
    "guest::fault_heavy_bound_default_profile",
];

pub fn run(root: &Path, args: &[String]) -> anyhow::Result<()> {
    if !super::setup::is_root() {
        bail!(
            "the eBPF tests load and attach programs for real and need root: \
             run `sudo -E cargo xtask test`"
        );
    }
    super::run(
        Command::new("cargo")
            .current_dir(root)
            .args(["fmt", "--all", "--check"]),
    )?;
    super::run(Command::new("cargo").current_dir(root).args([
        "clippy",
        "--workspace",
        "--exclude",
        "nccltrace-ebpf",
        "--all-targets",
        "--quiet",
        "--",
        "-D",
        "warnings",
    ]))?;
    let real_nccl = super::setup::real_nccl()?;
    let speedscope = super::setup::speedscope()?;
    let fixtures = super::build_fixtures(root)?;
    // The privileged tests are `#[ignore]`d for a plain `cargo test` as a normal user;
    // here (root) every test runs.
    let mut test_args = args.to_vec();
    if !test_args.iter().any(|a| a == "--") {
        test_args.push("--".into());
    }
    test_args.push("--include-ignored".into());
    // The guest tests need two NUMA nodes: they run in QEMU guests below.
    test_args.extend(["--skip".into(), "guest::".into()]);
    super::run(
        Command::new("cargo")
            .current_dir(root)
            .args(["test", "--workspace", "--exclude", "nccltrace-ebpf"])
            .args(&test_args)
            .env("NCCLTRACE_FIXTURES", &fixtures)
            .env("NCCLTRACE_REAL_NCCL", &real_nccl)
            .env("NCCLTRACE_SPEEDSCOPE", &speedscope),
    )?;
    // On a full run (a filtered run is someone iterating): the guest smoke tests in one
    // QEMU guest, the fuzz targets briefly, the man pages and completions.
    if args.is_empty() {
        let verdicts = super::vm::run(
            root,
            &["6.12"],
            &GUEST_SMOKE.map(str::to_owned),
            super::vm::Build::Debug,
            super::vm::Tcg::Single,
        )?;
        super::vm::report(&verdicts)?;
        super::man::run(root)?;
        super::fuzz::run(root, 20)?;
    }
    Ok(())
}
