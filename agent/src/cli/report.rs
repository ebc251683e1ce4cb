//! `nccltrace report REC --out DIR`: every output again, from a recording, without root.

use std::path::PathBuf;

use crate::Error;

#[derive(Debug, clap::Args)]
pub struct ReportArgs {
    /// A recording.nctr written by `nccltrace attach`.
    recording: PathBuf,
    /// Folder for the outputs (refused if it exists, unless --force).
    #[arg(long, short, default_value = "nccltrace-report")]
    out: PathBuf,
    /// Write into --out even if it exists.
    #[arg(long)]
    force: bool,
    /// Cut steps into fixed windows (100ms, 1s) instead of finding them.
    #[arg(long)]
    step_window: Option<String>,
    /// Steps start at each NVTX range pushed with a matching name (a recording made with
    /// --step-nvtx uses its pattern unless this or --step-window is given).
    #[arg(long, conflicts_with = "step_window")]
    step_nvtx: Option<String>,
    /// Attribute in epochs of at least this many events (0: the whole run at once). For
    /// tests and for checking that epochs do not change the outputs.
    #[arg(long, hide = true, default_value_t = crate::pipeline::EPOCH_EVENTS)]
    epoch_events: u64,
}

#[allow(clippy::needless_pass_by_value)] // the parsed arguments end here
pub fn run(args: ReportArgs) -> Result<(), Error> {
    keep_freed_memory();
    let rule = super::step_rule(args.step_window.as_deref(), args.step_nvtx.as_deref())?;
    // The outputs are written as the recording is attributed: the folder first (removed
    // again if the recording cannot be read).
    let mut out = super::OutDir::create(&args.out, args.force)?;
    let mut outputs =
        crate::pipeline::replay_into(&args.recording, rule, args.epoch_events, &out.path)?;
    if outputs.doctor.is_none() {
        crate::note!(
            "nccltrace: doctor.json not rebuilt: the recording does not keep the placement \
             report (made by an earlier nccltrace, or with no target); `nccltrace doctor --pid \
             PID` checks a live rank"
        );
    }
    out.keep();
    let written =
        crate::pipeline::write_outputs(&out.path, &mut outputs, &mut std::io::stdout().lock())
            .and(crate::pipeline::write_summary(&out.path, &outputs.summary))
            .map_err(|(path, source)| Error::Output { path, source });
    log::debug!("outputs written");
    nccltrace_core::procfs::log_thread_cpu();
    drop(outputs);
    log::debug!("memory freed");
    written
}

/// Large blocks from the heap, and freed memory kept for reuse up to 64 MiB, instead of
/// glibc's defaults (blocks from 128 KiB on mapped and unmapped one by one, the limit
/// moving with what is freed). Each attributed epoch hands its steps and calls, megabytes
/// on a run of short steps, to the writing threads, which free them; with the defaults
/// the next epoch's buffers came back from the kernel as fresh pages, zeroed and faulted
/// in: a fifth of the attribution thread's time on a recording of 300,000 one-call steps
/// (docs/benchmarks.md, session 34). For `report` only: it runs for seconds, while
/// `attach` keeps running and gives memory back (with this, its peak tracing 300,000
/// calls rose from 63.6 to 68.0 MB). `GLIBC_TUNABLES` naming these still applies.
fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        const LIMIT: libc::c_int = 64 << 20;
        let tuned = std::env::var("GLIBC_TUNABLES").unwrap_or_default();
        // SAFETY: mallopt only sets allocator parameters; called before `report` starts
        // any thread.
        unsafe {
            if !tuned.contains("mmap_threshold") {
                libc::mallopt(libc::M_MMAP_THRESHOLD, LIMIT);
            }
            if !tuned.contains("trim_threshold") {
                libc::mallopt(libc::M_TRIM_THRESHOLD, LIMIT);
            }
        }
    }
}
