//! What can go wrong in the source stage, and the helpers that make those errors.

use super::{ProgramError, host, tracefs};

/// What can go wrong in the source stage.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error("no process with pid {pid}: check the pid with `ps`")]
    NoSuchProcess { pid: u32 },
    #[error(
        "cannot read /proc/{pid}/maps of pid {pid} ({comm}): {source}. The process exists but \
         the kernel refuses its memory map to nccltrace (it runs in another user namespace, or \
         is not dumpable): trace the training ranks, as root in their PID namespace"
    )]
    UnreadableProcess {
        pid: u32,
        comm: String,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "pid {pid} ({comm}) has not loaded NCCL: no mapped object defines ncclAllReduce. \
         Attach once the job has initialised NCCL, or pass --wait-for-nccl to attach as soon as \
         it does"
    )]
    NoNccl { pid: u32, comm: String },
    #[error(
        "not permitted to load eBPF programs ({source}): run nccltrace as root, or grant it \
         CAP_BPF, CAP_PERFMON and CAP_SYS_ADMIN"
    )]
    Permission {
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("loading the eBPF object failed: {0}")]
    Load(#[source] Box<aya::EbpfError>),
    #[error(
        "the kernel ({kernel}) rejected program {program}: {source}\nIf the verifier output above \
         names a helper or map type, this kernel is too old for nccltrace"
    )]
    Verifier {
        program: String,
        kernel: String,
        #[source]
        source: Box<ProgramError>,
    },
    #[error("attaching {program} to {target} failed: {source}")]
    Attach {
        program: String,
        target: String,
        #[source]
        source: Box<ProgramError>,
    },
    #[error("eBPF map {name}: {source}")]
    Map {
        name: &'static str,
        #[source]
        source: Box<aya::maps::MapError>,
    },
    #[error(
        "--step-symbol: no function {symbol} in {where_}: check the name (nm -D / nm) or name \
         the library as SYMBOL@LIBRARY"
    )]
    NoStepSymbol { symbol: String, where_: String },
    #[error(
        "--step-nvtx: pid {pid} maps no library exporting nvtxRangePushA. NVTX 3 (what recent \
         PyTorch and CUDA libraries compile in) is header-only: with no NVTX tool injected at \
         launch its ranges never leave the process. Use the automatic steps or --step-symbol"
    )]
    NoNvtx { pid: u32 },
    #[error(
        "pid {pid} exited after {waited_s:.1} s without loading NCCL (--wait-for-nccl): nothing \
         was traced; pass the pid of a rank that initialises NCCL"
    )]
    ExitedBeforeNccl { pid: u32, waited_s: f64 },
    #[error(
        "pid {pid} did not load NCCL within --duration {duration:?} (--wait-for-nccl): nothing \
         was traced; pass a longer --duration, or none to wait until it does"
    )]
    NcclNotLoadedInTime {
        pid: u32,
        duration: std::time::Duration,
    },
    #[error("pid {pid} exited while nccltrace was attaching to it: nothing to trace")]
    ExitedDuringAttach { pid: u32 },
    #[error("tracing has stopped and the programs are detached: no target can be added")]
    Detached,
    #[error("the embedded eBPF object has no program {name}: rebuild nccltrace")]
    MissingProgram { name: String },
    #[error(transparent)]
    Tracefs(#[from] tracefs::TracefsError),
    #[error("reading the ring buffer failed: {0}")]
    Drain(#[source] std::io::Error),
    #[error(
        "cannot read the online CPUs from {path} ({source}) to sample each of them: sample each \
         target thread instead with `scope = \"thread\"` under [sampling] in a profile file"
    )]
    OnlineCpus {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

impl SourceError {
    /// Whether the user can fix it by changing the command (exit code 2).
    #[must_use]
    pub fn is_bad_input(&self) -> bool {
        matches!(
            self,
            SourceError::NoSuchProcess { .. }
                | SourceError::UnreadableProcess { .. }
                | SourceError::NoNccl { .. }
                | SourceError::NoStepSymbol { .. }
                | SourceError::NoNvtx { .. }
                | SourceError::ExitedDuringAttach { .. }
                | SourceError::ExitedBeforeNccl { .. }
                | SourceError::NcclNotLoadedInTime { .. }
        )
    }
}

pub(super) fn is_eperm(err: &(dyn std::error::Error + 'static)) -> bool {
    crate::causes(err).any(|e| {
        e.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.raw_os_error() == Some(libc::EPERM))
    })
}

pub(super) fn program_error(program: &str, target: &str, e: ProgramError) -> SourceError {
    if is_eperm(&e) {
        return SourceError::Permission {
            source: Box::new(e),
        };
    }
    match e {
        ProgramError::LoadError { .. } => SourceError::Verifier {
            program: program.to_owned(),
            kernel: host::uname().0,
            source: Box::new(e),
        },
        e => SourceError::Attach {
            program: program.to_owned(),
            target: target.to_owned(),
            source: Box::new(e),
        },
    }
}

pub(super) fn map_error(name: &'static str) -> impl Fn(aya::maps::MapError) -> SourceError {
    move |e| SourceError::Map {
        name,
        source: Box::new(e),
    }
}

/// The innermost cause of an error, as text (the errno behind a refused load).
pub(super) fn root_cause(e: &(dyn std::error::Error + 'static)) -> String {
    crate::causes(e)
        .last()
        .map_or_else(String::new, ToString::to_string)
}

pub(super) fn missing_program(name: &str) -> SourceError {
    SourceError::MissingProgram {
        name: name.to_owned(),
    }
}

pub(super) fn missing_map(name: &'static str) -> SourceError {
    SourceError::Map {
        name,
        source: Box::new(aya::maps::MapError::InvalidName { name: name.into() }),
    }
}
