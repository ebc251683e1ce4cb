//! Developer tasks: `cargo xtask setup | test | demo`. Every task runs `setup` first, so
//! each works on a fresh machine.

mod demo;
mod setup;
mod test;

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context as _, bail};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "xtask", about = "nccltrace developer tasks")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Install what building and testing need (idempotent; says what it does).
    Setup,
    /// Set up, build, and run every test (the eBPF ones for real: needs root).
    Test {
        /// Extra arguments for `cargo test` (a test name filter, for example).
        #[arg(trailing_var_arg = true)]
        args: Vec<String>,
    },
    /// Set up, build, run the demo trainer, attach to it and print the summary.
    Demo,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let root = workspace_root();
    setup::run(&root).context("setup")?;
    match cli.task {
        Task::Setup => Ok(()),
        Task::Test { args } => test::run(&root, &args),
        Task::Demo => demo::run(&root),
    }
}

/// The workspace root (the parent of this crate).
fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map_or_else(|| PathBuf::from("."), Path::to_path_buf)
}

/// Runs a command, failing with its command line when it fails.
fn run(cmd: &mut Command) -> anyhow::Result<()> {
    let status = cmd
        .status()
        .with_context(|| format!("cannot start {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed: {status}");
    }
    Ok(())
}

/// Builds the C fixtures into `target/fixtures` and returns that folder.
fn build_fixtures(root: &Path) -> anyhow::Result<PathBuf> {
    let out = root.join("target/fixtures");
    run(Command::new("make")
        .arg("-s")
        .arg("-C")
        .arg(root.join("tests/fixtures"))
        .arg(format!("OUT={}", out.display())))?;
    Ok(out)
}
