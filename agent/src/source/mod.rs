//! Source stage, the only one that needs root: find the libraries, load the kernel
//! programs, attach them, drain the ring buffer, detach.

mod accounting;
pub mod baseline;
mod comms;
pub mod counting;
pub mod discover;
mod ktypes;
pub mod pmu;
pub mod python;
pub mod rings;
pub mod tracefs;
mod traps;

mod error;
mod gpu;
mod kernel;
mod load;
mod multi;
mod probes;
mod readings;
mod session;
mod start;

pub use error::*;
pub use kernel::*;
pub use load::*;
use probes::{
    probe_library, register_threads, sample_cpus, sample_threads, target_info, target_libs,
};
pub use session::*;
pub use start::*;

use std::collections::BTreeMap;
use std::num::NonZeroU32;
use std::os::unix::fs::MetadataExt as _;
use std::path::Path;
use std::time::{Duration, Instant};

use aya::maps::{HashMap as BpfHashMap, MapData, PerCpuArray};
use aya::programs::fentry::FEntryLink;
use aya::programs::fexit::FExitLink;
use aya::programs::kprobe::KProbeLink;
use aya::programs::perf_event::{
    PerfEventConfig, PerfEventLink, PerfEventScope, SamplePolicy, SoftwareEvent,
};
use aya::programs::raw_trace_point::RawTracePointLink;
use aya::programs::trace_point::TracePointLink;
use aya::programs::uprobe::UProbeLink;
use aya::programs::{
    FEntry, FExit, KProbe, PerfEvent, ProgramError, RawTracePoint, TracePoint, UProbe,
};
use aya::{Btf, Ebpf, EbpfLoader};
use nccltrace_common::{counter, kind, names, timed};

use crate::event::{Event, Library};
use crate::host::{self, Host};
use crate::profile::{CallReturns, Profile, SampleScope};
use crate::record::{ClockRef, FORMAT_VERSION, Header, ProbeInfo, TargetInfo};
use discover::FoundLibrary;
use multi::{Site, UprobePrograms};

/// The compiled kernel programs, embedded at build time.
static PROGRAMS: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/nccltrace"));

/// A target as discovered, before attaching.
#[derive(Clone, Debug)]
pub struct Target {
    pub pid: u32,
    pub comm: String,
    pub nccl: FoundLibrary,
    pub cuda: Option<FoundLibrary>,
    /// The `--step-symbol` function.
    pub marker: Option<FoundLibrary>,
    /// The NVTX library (`--step-nvtx`).
    pub nvtx: Option<FoundLibrary>,
    pub maps: Vec<String>,
}

/// Every process (but this one) with a mapped object that defines ncclAllReduce in its
/// dynamic symbols. Each file is checked once, whatever the number of processes mapping it.
#[must_use]
pub fn processes_with_nccl(host: &Host) -> Vec<u32> {
    processes_with_nccl_cached(host, &mut std::collections::HashMap::new())
}

/// As [`processes_with_nccl`], keeping each file's verdict (by device and inode) in
/// `verdicts` across calls (`--follow` scans every second).
fn processes_with_nccl_cached(
    host: &Host,
    verdicts: &mut std::collections::HashMap<(u64, u64), bool>,
) -> Vec<u32> {
    let me = std::process::id();
    let mut found = Vec::new();
    let Ok(dir) = std::fs::read_dir(host.path("proc")) else {
        return found;
    };
    for entry in dir.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        if pid == me {
            continue;
        }
        let Ok(maps) = std::fs::read_to_string(host.path(&format!("proc/{pid}/maps"))) else {
            continue;
        };
        let root = host.path(&format!("proc/{pid}/root"));
        let maps = discover::parse_maps(&maps);
        let has_nccl = discover::mapped_files(&maps).iter().any(|path| {
            let host_path = root.join(path.trim_start_matches('/'));
            let Ok(meta) = std::fs::metadata(&host_path) else {
                return false;
            };
            *verdicts.entry((meta.dev(), meta.ino())).or_insert_with(|| {
                discover::resolve(
                    &host_path,
                    &["ncclAllReduce", "pncclAllReduce"],
                    discover::Tables::Dynamic,
                )
                .is_ok_and(|found| !found.is_empty())
            })
        });
        if has_nccl {
            found.push(pid);
        }
    }
    found.sort_unstable();
    found
}

/// Finds NCCL (and the CUDA driver, the `SYMBOL[@LIBRARY]` step marker and an NVTX library
/// when asked) in `pid`, through `/proc/PID/root`.
pub fn discover(
    host: &Host,
    pid: u32,
    step_symbol: Option<&str>,
    nvtx: bool,
) -> Result<Target, SourceError> {
    let maps_text =
        std::fs::read_to_string(host.path(&format!("proc/{pid}/maps"))).map_err(|source| {
            if host.path(&format!("proc/{pid}")).exists() {
                SourceError::UnreadableProcess {
                    pid,
                    comm: host.comm(pid),
                    source,
                }
            } else {
                SourceError::NoSuchProcess { pid }
            }
        })?;
    let maps = discover::parse_maps(&maps_text);
    let files = discover::mapped_files(&maps);
    let root = host.path(&format!("proc/{pid}/root"));
    let comm = host.comm(pid);
    let nccl = discover::find_library(&root, &files, Library::Nccl).ok_or_else(|| {
        SourceError::NoNccl {
            pid,
            comm: comm.clone(),
        }
    })?;
    let cuda = discover::find_library(&root, &files, Library::Cuda);
    let marker = match step_symbol {
        None => None,
        Some(spec) => {
            let (symbol, library) = match spec.split_once('@') {
                Some((s, l)) => (s, Some(l)),
                None => (spec, None),
            };
            let found = discover::find_marker(&root, &files, symbol, library);
            Some(
                found.ok_or_else(|| SourceError::NoStepSymbol {
                    symbol: symbol.to_owned(),
                    where_: library
                        .map_or_else(|| format!("any object mapped by pid {pid}"), str::to_owned),
                })?,
            )
        }
    };
    let nvtx = if nvtx {
        Some(
            discover::find_library(&root, &files, Library::Nvtx)
                .ok_or(SourceError::NoNvtx { pid })?,
        )
    } else {
        None
    };
    Ok(Target {
        pid,
        comm,
        nccl,
        cuda,
        marker,
        nvtx,
        maps: files,
    })
}

/// An attachment we own, so detaching can be done in parallel.
enum Link {
    // Held only to be dropped: dropping detaches.
    #[allow(dead_code)]
    Uprobe(UProbeLink),
    #[allow(dead_code)]
    Tracepoint(TracePointLink),
    #[allow(dead_code)]
    RawTracepoint(RawTracePointLink),
    #[allow(dead_code)]
    Perf(PerfEventLink),
    #[allow(dead_code)]
    FEntry(FEntryLink),
    #[allow(dead_code)]
    FExit(FExitLink),
    #[allow(dead_code)]
    KProbe(KProbeLink),
    /// A uprobe-multi link (`multi`).
    #[allow(dead_code)]
    Multi(std::os::fd::OwnedFd),
}

/// Every how long the InfiniBand ports' data and packet counters are read, and all of
/// their counters.
pub const IB_FAST_EVERY: Duration = Duration::from_millis(100);
pub const IB_FULL_EVERY: Duration = Duration::from_secs(1);

/// The header of a record the agent makes itself (PMU samples, resident pages) in the
/// programs' layout: no CPU ran a program for it.
fn agent_record(ts_ns: u64, pid: u32, thread: u32, kind: u16) -> nccltrace_common::Header {
    nccltrace_common::Header {
        ts_ns,
        tgid: pid,
        tid: thread,
        kind,
        cpu: u16::MAX,
        _pad: 0,
    }
}

/// Loaded and attached programs, with the maps user space reads.
pub struct Attached {
    ebpf: Option<Ebpf>,
    /// The entry and return programs of the uprobes, and how they attach.
    uprobes: UprobePrograms,
    links: Vec<Link>,
    /// Rare diagnostics from the programs (aya-log), flushed to the `log` crate.
    logger: Option<aya_log::EbpfLogger<&'static dyn log::Log>>,
    targets: BpfHashMap<MapData, u32, u32>,
    /// CLOCK_MONOTONIC when tracing stopped (the programs were disarmed).
    pub stopped_ns: Option<u64>,
    rings: rings::Rings,
    counters: PerCpuArray<MapData, u64>,
    pub header: Header,
    pub pids: Vec<u32>,
    /// How long loading and attaching took.
    pub attach_time: Duration,
    profile: Profile,
    /// Files already probed: device, inode, and the process (0: every process).
    probed: Vec<(u64, u64, u32)>,
    /// `--follow`: also attach to processes that map NCCL later, until stopped.
    pub follow: Option<Follow>,
    /// Python targets whose frames are walked (profile `python_frames`).
    python: python::PyTargets,
    /// Communicators made before attach, read as collectives name them.
    comms: comms::CommSizes,
    /// The PMU's memory sampler on the targets' threads, where the host has one.
    mem: Option<pmu::Sampling>,
    /// The PMU's node-load counters on the targets' threads, where it has no sampler.
    counting: Option<counting::Counting>,
    /// The programs' accounting of their own run time, on in windows.
    accounting: accounting::Accounting,
    /// The timed programs' runs and nanoseconds for traced threads (`timed`).
    target_costs: PerCpuArray<MapData, u64>,
    /// What a traced call's traps cost here (ns), measured at the first tick, or why not.
    traps: Option<Result<traps::Traps, String>>,
    /// What a sampling clock's interrupt costs here (ns), measured with the traps where
    /// the profile samples, or why not.
    sampling_cost: Option<Result<u64, String>>,
    /// Whether the scheduler's tracepoints run raw (`load::sched_tracepoints`).
    raw_sched: bool,
    /// Set from attach to the stop (`names::ARMED`).
    armed: aya::maps::Array<MapData, u32>,
    /// The calibration under way, a round between two drains, with the programs' runs
    /// before it.
    calibration: Option<(traps::Calibration, ProgramRuns)>,
    /// The programs' run time before any probe was attached (the first window's start).
    baseline: Option<crate::record::ProgramReading>,
    /// The runs the trap calibration caused, left out of every reading.
    calibration_runs: ProgramRuns,
    /// Read the targets' numa_maps (NUMA balancing off or untraced on a multi-node host),
    /// and when it was last read.
    resident: bool,
    resident_read: Option<Instant>,
    /// Per InfiniBand port of the header, the files of its counters (index, path).
    ib_files: Vec<Vec<(u8, String)>>,
    /// The ports' reading taken before any probe was attached, written first.
    ib_early: Vec<readings::IbRecord>,
    /// Per port, the time of the newest reading written.
    ib_written: readings::IbWritten,
    /// The ports read while tracing (started by the first drain).
    ib_reader: Option<readings::IbReader>,
    /// The GPUs read while tracing (started before the probes were attached).
    gpu_reader: Option<gpu::GpuReader>,
}

/// Each program's runs and run time (ns) as the kernel counts them, by name.
pub(super) type ProgramRuns = BTreeMap<String, (u64, u64)>;

/// What `--follow` needs to discover and attach a process that appears later.
#[derive(Clone, Debug, Default)]
pub struct Follow {
    pub step_symbol: Option<String>,
    pub nvtx: bool,
    /// Files already judged (device, inode → maps NCCL), and pids that failed to attach.
    verdicts: std::collections::HashMap<(u64, u64), bool>,
    refused: Vec<u32>,
}

impl Follow {
    #[must_use]
    pub fn new(step_symbol: Option<String>, nvtx: bool) -> Follow {
        Follow {
            step_symbol,
            nvtx,
            ..Follow::default()
        }
    }
}

/// How often the ring buffer is drained when the programs have not woken the reader.
const DRAIN_EVERY: Duration = Duration::from_millis(10);

#[cfg(test)]
mod tests {
    use super::*;

    /// Regression (issue 17): `--pid 1` (a process that exists, its maps unreadable: another
    /// user namespace here) said "no process with pid 1". A process that is there but
    /// whose maps cannot be read is named as such, with the reason; one that is not there
    /// still says so. (The maps file is a folder here: root reads any file.)
    #[test]
    fn unreadable_maps_are_not_a_missing_process() {
        let root = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(root.path().join("proc/77/maps")).unwrap();
        std::fs::write(root.path().join("proc/77/comm"), "process_api\n").unwrap();
        let host = Host::at(root.path());
        let err = discover(&host, 77, None, false).unwrap_err();
        assert!(
            matches!(&err, SourceError::UnreadableProcess { pid: 77, comm, .. } if comm == "process_api"),
            "{err}"
        );
        assert!(err.is_bad_input());
        assert!(err.to_string().contains("exists but"), "{err}");
        let err = discover(&host, 78, None, false).unwrap_err();
        assert!(
            matches!(err, SourceError::NoSuchProcess { pid: 78 }),
            "{err}"
        );
    }

    /// The kernel contract (issue 18): every program, map and global that user space names
    /// is defined by the embedded object, and every tracepoint program the object defines
    /// is in the table user space attaches from. No root needed: the object is only read.
    #[test]
    fn embedded_object_defines_every_name() {
        use object::{Object as _, ObjectSymbol as _};
        let file = object::File::parse(PROGRAMS).expect("the embedded eBPF object is ELF");
        let defined: std::collections::BTreeSet<&str> =
            file.symbols().filter_map(|s| s.name().ok()).collect();
        let mut wanted = vec![
            names::UPROBE_LIB_CALL,
            names::URETPROBE_LIB_CALL,
            names::PERF_EVENT_CPU_CLOCK,
            names::FENTRY_HANDLE_MM_FAULT,
            names::FEXIT_HANDLE_MM_FAULT,
            names::KPROBE_TASK_NUMA_FAULT,
            names::KPROBE_FINISH_TASK_SWITCH,
            names::OFF_SINCE,
            names::COUNTERS,
            names::TARGET_COSTS,
            names::PROGRAM_COSTS,
            names::TIMING,
            names::TARGETS,
            names::ARMED,
            names::THREADS,
            names::MAYBE,
            names::PY_THREADS,
            names::PY_LAYOUTS,
            names::PY_WINDOW,
            names::CONFIG,
            names::OFFSETS,
        ];
        wanted.extend(names::EVENTS);
        wanted.extend(names::TRACEPOINTS.iter().map(|t| t.program));
        wanted.extend(names::RAW_SCHED.iter().map(|(_, program)| *program));
        wanted.extend(nccltrace_common::timed::PROGRAMS);
        wanted.extend(nccltrace_common::run::PROGRAMS);
        for name in wanted {
            assert!(defined.contains(name), "the object defines no {name}");
        }
        for (event, _) in names::RAW_SCHED {
            assert!(
                names::TRACEPOINTS
                    .iter()
                    .any(|t| t.event == event && !t.raw),
                "{event}: a raw program for a tracepoint not traced"
            );
        }
        for symbol in defined.iter().filter(|s| s.starts_with("tracepoint_")) {
            assert!(
                names::TRACEPOINTS.iter().any(|t| t.program == *symbol),
                "{symbol} is in the object but in no tracepoint entry"
            );
        }
    }
}
