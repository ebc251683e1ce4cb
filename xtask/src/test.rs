//! `cargo xtask test`: every test, the privileged ones for real.

use std::path::Path;
use std::process::Command;

use anyhow::bail;

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
    // On a full run (a filtered run is someone iterating): the guest tests in one QEMU
    // guest (two NUMA nodes, Debian's 6.12; `cargo xtask vm-test` runs 6.1 too, and the
    // counting test in each), the fuzz targets briefly, the man pages and completions.
    if args.is_empty() {
        let verdicts = super::vm::run(root, &["6.12"], &["guest::".to_owned()])?;
        super::vm::report(&verdicts)?;
        super::man::run(root)?;
        super::fuzz::run(root, 20)?;
    }
    Ok(())
}
