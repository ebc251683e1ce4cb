//! The `nccltrace` binary: parse, run, map errors to exit codes.

use std::process::ExitCode;

use clap::Parser as _;

fn main() -> ExitCode {
    keep_freed_memory();
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn"))
        .format_timestamp_micros()
        .init();
    let cli = nccltrace::cli::Cli::parse();
    match cli.run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            let message = err.to_string();
            nccltrace::note!("nccltrace: error: {message}");
            // Causes not already quoted in the message (verifier logs, syscall errors).
            let mut source = std::error::Error::source(&err);
            while let Some(cause) = source {
                let text = cause.to_string();
                if !message.contains(&text) {
                    nccltrace::note!("  caused by: {text}");
                }
                source = cause.source();
            }
            ExitCode::from(err.exit_code())
        }
    }
}

/// Large blocks from the heap, and freed memory kept for reuse up to 64 MiB, instead of
/// glibc's defaults (blocks from 128 KiB on mapped and unmapped one by one, the limit
/// moving with what is freed). Each attributed epoch hands its steps and calls, megabytes
/// on a run of short steps, to the writing threads, which free them; with the defaults
/// the next epoch's buffers came back from the kernel as fresh pages, zeroed and faulted
/// in: a fifth of the attribution thread's time on a recording of 300,000 one-call steps
/// (docs/benchmarks.md, session 34). `GLIBC_TUNABLES` set by the user still applies
/// where it names these.
fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        const LIMIT: libc::c_int = 64 << 20;
        let tuned = std::env::var("GLIBC_TUNABLES").unwrap_or_default();
        // SAFETY: mallopt only sets allocator parameters; called first thing in main,
        // before any other thread exists.
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
