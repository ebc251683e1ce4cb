//! nccltrace: an eBPF tracing and profiling agent for distributed training.
//!
//! Pipeline: `source` (kernel, root) → `decode` → `record` → `pipeline` (aggregate) →
//! `render`. Everything after `source` is pure and lives in `nccltrace-core` (re-exported
//! here under the same names); this crate keeps the command line, the kernel side
//! (`source`), the doctor and the host readings.

pub mod cli;
pub mod doctor;
pub mod host;
pub mod merge;
pub mod metrics;
pub mod profile;
pub mod python;
pub mod source;
pub mod stop;

pub use nccltrace_core::{
    attribute, decode, event, note, pipeline, pmu, procfs, record, render, summary, symbolize,
};

use std::path::PathBuf;

/// Every error the binary can report, by layer.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Source(#[from] source::SourceError),
    #[error(transparent)]
    Record(#[from] record::RecordError),
    #[error(transparent)]
    Profile(#[from] profile::ProfileError),
    #[error(transparent)]
    Merge(#[from] merge::MergeError),
    #[error("output folder {path} already exists: choose another --out or pass --force")]
    OutputExists { path: PathBuf },
    #[error("--out {path} is a file, not a folder: choose a folder for the outputs")]
    OutputNotFolder { path: PathBuf },
    #[error(
        "cannot make the output folder {path}: {source}: choose an --out folder this user can \
         create and write (for example under the current folder)"
    )]
    OutputFolder {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "{count} file(s) that {command} reads are there but this user may not read them (e.g. \
         {example}: permission denied): {consequence}. Run it as root (or with \
         CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH)"
    )]
    Unreadable {
        command: &'static str,
        count: usize,
        example: String,
        consequence: String,
    },
    #[error("{signal} received while {during}: nothing was traced")]
    Interrupted {
        signal: &'static str,
        during: String,
    },
    #[error("cannot write output {path}: {source}{}", output_fix(source))]
    Output {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid {what} {value:?}: {expected}")]
    InvalidArgument {
        what: &'static str,
        value: String,
        expected: &'static str,
    },
    #[error(
        "nccltrace attach loads eBPF programs and reads other processes: it needs root, or \
         CAP_BPF, CAP_PERFMON and CAP_SYS_PTRACE; this process lacks {missing}. Run it with sudo"
    )]
    NotPrivileged { missing: String },
    #[error(
        "cannot serve metrics on {addr}: {source}: choose a free port (another agent or \
         exporter may hold this one) or another address, e.g. --metrics 127.0.0.1:9465"
    )]
    MetricsAddress {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot start the async runtime: {0}")]
    Runtime(#[source] std::io::Error),
}

impl From<pipeline::ReplayError> for Error {
    fn from(e: pipeline::ReplayError) -> Error {
        match e {
            pipeline::ReplayError::Record(e) => Error::Record(e),
            pipeline::ReplayError::Output { path, source } => Error::Output { path, source },
        }
    }
}

/// An error and its sources, outermost first.
pub(crate) fn causes<'e>(
    err: &'e (dyn std::error::Error + 'static),
) -> impl Iterator<Item = &'e (dyn std::error::Error + 'static)> {
    std::iter::successors(Some(err), |e| e.source())
}

/// The system error code of `e`, or of an `io::Error` it wraps (a writer library's own
/// `io::Error` around the one the write returned; `io::Error::source` skips the wrapped
/// error itself, so it is reached through `get_ref`).
fn os_error(e: &std::io::Error) -> Option<i32> {
    e.raw_os_error().or_else(|| {
        causes(e.get_ref()?).find_map(|c| c.downcast_ref::<std::io::Error>().and_then(os_error))
    })
}

/// What to do about an output that cannot be written.
fn output_fix(e: &std::io::Error) -> &'static str {
    match os_error(e) {
        Some(libc::ENOSPC | libc::EDQUOT) => {
            ": free space there or choose another --out (the summary above is complete; \
             `nccltrace report` reads what the recording holds)"
        }
        Some(libc::EACCES | libc::EPERM | libc::EROFS) => {
            ": choose an --out folder this user can write"
        }
        _ => "",
    }
}

impl Error {
    /// The process exit code: 2 for bad input the user can fix, 1 for runtime failures.
    #[must_use]
    pub fn exit_code(&self) -> u8 {
        let bad_input = match self {
            Error::Source(e) => e.is_bad_input(),
            Error::Record(e) => e.is_bad_input(),
            Error::Merge(e) => e.is_bad_input(),
            Error::Interrupted { signal, .. } => return stop::exit_code(signal),
            Error::Profile(_)
            | Error::OutputExists { .. }
            | Error::OutputNotFolder { .. }
            | Error::Unreadable { .. }
            | Error::OutputFolder { .. }
            | Error::InvalidArgument { .. }
            | Error::MetricsAddress { .. }
            | Error::NotPrivileged { .. } => true,
            Error::Output { .. } | Error::Runtime(_) => false,
        };
        if bad_input { 2 } else { 1 }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A full disk is named with its fix even when the system error arrives wrapped in
    /// another `io::Error` (as a flamegraph writer's failure did: CI once printed the
    /// bare "No space left on device" for an SVG).
    #[test]
    fn full_disk_fix_through_a_wrapped_error() {
        for source in [
            std::io::Error::from_raw_os_error(libc::ENOSPC),
            std::io::Error::other(std::io::Error::from_raw_os_error(libc::ENOSPC)),
        ] {
            let text = Error::Output {
                path: PathBuf::from("out/flamegraph-oncpu.svg"),
                source,
            }
            .to_string();
            assert!(text.contains("choose another --out"), "{text}");
        }
    }
}
