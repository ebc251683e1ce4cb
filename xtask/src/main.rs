//! Developer tasks: `cargo xtask setup | test | vm-test | demo | bench | man | fuzz | soak`. Every
//! task runs `setup` first, so each works on a fresh machine.

mod bench;
mod demo;
mod fuzz;
mod man;
mod setup;
mod soak;
mod test;
mod vm;

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
    /// The agent's cost beside its baselines (docs/benchmarks.md).
    Bench {
        /// Only the cost model against the wall clock: interleaved untraced / traced runs
        /// of the demo trainer, the measured cost a step beside the one summary.json's
        /// agent.bpf predicts.
        #[arg(long)]
        cost: bool,
        /// Pairs of runs for --cost.
        #[arg(long, default_value_t = 30)]
        pairs: usize,
        /// The profile the traced runs of --cost use (a shipped name or a TOML file).
        #[arg(long, default_value = "default")]
        profile: String,
    },
    /// Man pages and shell completions into target/man/ and target/completions/.
    Man,
    /// Run the cargo fuzz targets (fuzz/) for a while each.
    Fuzz {
        #[arg(long, default_value_t = 60)]
        seconds: u32,
    },
    /// Minutes of tracing at a high event rate (RSS, loss), then longer fuzzing.
    Soak {
        #[arg(long, default_value_t = 10)]
        minutes: u32,
        /// Seconds per fuzz target.
        #[arg(long, default_value_t = 300)]
        fuzz_seconds: u32,
        /// As an agent left running on a node: with `--metrics` (scraped every 10 s) and
        /// `--rotate 1m --keep 3`.
        #[arg(long)]
        daemon: bool,
    },
    /// The guest tests (two NUMA nodes, older kernels) in QEMU guests: Debian's kernels
    /// booted by virtme-ng, the release agent and the test binary built here.
    VmTest {
        /// Which kernel: 6.1, 6.12 or all.
        #[arg(long, default_value = "all")]
        kernel: String,
        /// The debug agent instead of the release one (no release build; too slow for
        /// the counting test under emulation).
        #[arg(long)]
        debug: bool,
        /// This agent binary instead of one built here (an earlier release, to reproduce
        /// what it did).
        #[arg(long, conflicts_with = "debug")]
        agent: Option<std::path::PathBuf>,
        /// QEMU's multi-threaded TCG (one host thread per vCPU, its default) instead of
        /// one thread for both: kernel text patched while the other vCPU runs it is then
        /// seen half-done (issue 59), so the guests oops where real CPUs do not.
        #[arg(long)]
        mttcg: bool,
        /// Test name filters instead of the guest set (`guest::` and the counting test).
        filters: Vec<String>,
    },
    /// Validation on a GPU machine with PyTorch and NCCL (see docs/validation.md).
    GpuCheck {
        /// Print the steps to run instead of running them (this machine has no GPU).
        #[arg(long)]
        print: bool,
    },
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let root = workspace_root();
    if let Task::GpuCheck { print } = cli.task {
        return gpu_check(&root, print);
    }
    setup::run(&root).context("setup")?;
    match cli.task {
        Task::Setup | Task::GpuCheck { .. } => Ok(()),
        Task::Test { args } => test::run(&root, &args),
        Task::Demo => demo::run(&root),
        Task::Bench { cost: false, .. } => bench::run(&root),
        Task::Bench {
            cost: true,
            pairs,
            profile,
        } => bench::cost(&root, pairs, &profile),
        Task::Man => man::run(&root),
        Task::VmTest {
            kernel,
            debug,
            agent,
            mttcg,
            filters,
        } => {
            let build = match (agent, debug) {
                (Some(path), _) => vm::Build::Given(path),
                (None, true) => vm::Build::Debug,
                (None, false) => vm::Build::Release,
            };
            let tcg = if mttcg {
                vm::Tcg::Multi
            } else {
                vm::Tcg::Single
            };
            vm::task(&root, &kernel, &filters, build, tcg)
        }
        Task::Fuzz { seconds } => fuzz::run(&root, seconds),
        Task::Soak {
            minutes,
            fuzz_seconds,
            daemon,
        } => soak::run(&root, minutes, fuzz_seconds, daemon),
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

/// Builds the release agent; returns it and a fresh `target/<task>` folder to work in.
fn release_agent(root: &Path, task: &str) -> anyhow::Result<(PathBuf, PathBuf)> {
    run(Command::new("cargo").current_dir(root).args([
        "build",
        "--release",
        "-q",
        "-p",
        "nccltrace",
    ]))?;
    Ok((
        root.join("target/release/nccltrace"),
        fresh_work(root, task)?,
    ))
}

/// `target/<task>`, made empty: the folder a task's files go to.
fn fresh_work(root: &Path, task: &str) -> anyhow::Result<PathBuf> {
    let work = root.join("target").join(task);
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).with_context(|| format!("creating {}", work.display()))?;
    Ok(work)
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

/// How to validate on a GPU machine: build here, carry the binary and the scripts, run there.
fn gpu_check(root: &Path, print: bool) -> anyhow::Result<()> {
    let steps = format!(
        "GPU validation (docs/validation.md):\n\
         1. here:  cargo build --release -p nccltrace && mkdir -p .carry && \\\n\
         \x20         strip -o .carry/nccltrace target/release/nccltrace\n\
         2. copy the repository (tests/gpu/) and .carry/ to the GPU machine (PyTorch with the\n\
         \x20  NCCL backend, root for eBPF)\n\
         3. there: OUT=/tmp/gpu-out bash tests/gpu/run.sh \"$PWD/.carry/nccltrace\" 300\n\
         \x20  runs tests/gpu/train.py in DDP and hand-all-reduce modes, each traced by\n\
         \x20  `nccltrace attach --pid` and untraced; prints each script's own counts and step\n\
         \x20  times beside nccltrace's summary and step table; outputs under $OUT/<mode>/\n\
         4. compare: AllReduce calls = the script's allreduce_calls; steps found = steps ± 1;\n\
         \x20  record the numbers and the date in docs/validation.md\n\
         5. drain rate on a many-core host (carry target/fixtures/ too, built by\n\
         \x20  `make -C tests/fixtures OUT=$PWD/target/fixtures`):\n\
         \x20  bash tests/gpu/drain.sh \"$PWD/.carry/nccltrace\" \"$PWD/target/fixtures\" LIBNCCL 14 2000000\n\
         (workspace: {})",
        root.display()
    );
    if print {
        println!("{steps}");
        return Ok(());
    }
    anyhow::bail!(
        "this machine has no GPU: run `cargo xtask gpu-check --print` and follow the steps"
    )
}
