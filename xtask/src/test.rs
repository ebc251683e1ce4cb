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
    super::run(
        Command::new("cargo")
            .current_dir(root)
            .args(["test", "--workspace", "--exclude", "nccltrace-ebpf"])
            .args(&test_args)
            .env("NCCLTRACE_FIXTURES", &fixtures)
            .env("NCCLTRACE_REAL_NCCL", &real_nccl)
            .env("NCCLTRACE_SPEEDSCOPE", &speedscope),
    )?;
    // The fuzz targets, briefly, and the man pages and completions, on a full run (a
    // filtered run is someone iterating).
    if args.is_empty() {
        super::man::run(root)?;
        super::fuzz::run(root, 20)?;
    }
    Ok(())
}
