//! Source stage, the only one that needs root: find the libraries, load the kernel
//! programs, attach them, drain the ring buffer, detach.

pub mod baseline;
pub mod discover;
pub mod pmu;
pub mod python;
pub mod rings;
pub mod tracefs;
mod traps;

use std::collections::BTreeMap;
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
use aya::programs::uprobe::{UProbeAttachLocation, UProbeAttachPoint, UProbeScope};
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

/// The compiled kernel programs, embedded at build time.
static PROGRAMS: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/nccltrace"));

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

fn is_eperm(err: &(dyn std::error::Error + 'static)) -> bool {
    crate::causes(err).any(|e| {
        e.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.raw_os_error() == Some(libc::EPERM))
    })
}

fn program_error(program: &str, target: &str, e: ProgramError) -> SourceError {
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

fn map_error(name: &'static str) -> impl Fn(aya::maps::MapError) -> SourceError {
    move |e| SourceError::Map {
        name,
        source: Box::new(e),
    }
}

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
}

/// The kernel function whose entry and return time a user page fault.
const FAULT_FUNCTION: &str = "handle_mm_fault";

/// The innermost cause of an error, as text (the errno behind a refused load).
fn root_cause(e: &(dyn std::error::Error + 'static)) -> String {
    crate::causes(e)
        .last()
        .map_or_else(String::new, ToString::to_string)
}

/// Times user page faults with fentry/fexit on the fault handler. Many kernels refuse
/// these programs (no BPF trampoline, or a policy): then why, and faults are measured by
/// sampling instead. Both links or neither.
fn time_faults(ebpf: &mut Ebpf, btf: Result<Btf, String>) -> Result<(String, [Link; 2]), String> {
    let btf = btf?;
    let refused = |e: ProgramError| {
        format!(
            "the kernel refused fentry/fexit on {FAULT_FUNCTION} ({})",
            root_cause(&e)
        )
    };
    let missing = |e: SourceError| e.to_string();
    let entry: &mut FEntry = typed_program(ebpf, names::FENTRY_HANDLE_MM_FAULT).map_err(missing)?;
    entry.load(FAULT_FUNCTION, &btf).map_err(refused)?;
    let id = entry.attach().map_err(refused)?;
    let entry_link = entry.take_link(id).map_err(refused)?;
    let exit: &mut FExit = typed_program(ebpf, names::FEXIT_HANDLE_MM_FAULT).map_err(missing)?;
    exit.load(FAULT_FUNCTION, &btf).map_err(refused)?;
    let id = exit.attach().map_err(refused)?;
    let exit_link = exit.take_link(id).map_err(refused)?;
    Ok((
        format!("fentry/fexit on {FAULT_FUNCTION}"),
        [Link::FEntry(entry_link), Link::FExit(exit_link)],
    ))
}

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

/// The kernel function NUMA balancing calls for each hinting fault, in the faulting
/// thread's context (kernel/sched/fair.c; no tracepoint reports these faults).
const NUMA_HINT_FUNCTION: &str = "task_numa_fault";

/// Why kprobes cannot be attached here, found before loading a program for one (the
/// verifier's work on a program with stacks is ~30 ms): a kernel without kprobes
/// (`CONFIG_KPROBES` unset) has neither the perf PMU nor tracefs's `kprobe_events`.
fn kprobes_missing(tracefs_root: &Path) -> Option<String> {
    let pmu = Path::new("/sys/bus/event_source/devices/kprobe");
    (!pmu.exists() && !tracefs_root.join("kprobe_events").exists()).then(|| {
        format!(
            "this kernel has no kprobes (no {}, no kprobe_events in {})",
            pmu.display(),
            tracefs_root.display()
        )
    })
}

/// Traces NUMA hinting faults with a kprobe on [`NUMA_HINT_FUNCTION`]; why not, when the
/// kernel has no kprobes, no such function, or refuses the probe.
fn trace_numa_hints(ebpf: &mut Ebpf, tracefs_root: &Path) -> Result<Link, String> {
    if let Some(why) = kprobes_missing(tracefs_root) {
        return Err(format!("no kprobe on {NUMA_HINT_FUNCTION}: {why}"));
    }
    attach_kprobe(ebpf, names::KPROBE_TASK_NUMA_FAULT, NUMA_HINT_FUNCTION)
}

/// Loads the kprobe `program` (unless loaded ahead) and attaches it to `function`; the
/// kernel's refusal, said.
fn attach_kprobe(ebpf: &mut Ebpf, program: &str, function: &str) -> Result<Link, String> {
    let prog: &mut KProbe = typed_program(ebpf, program).map_err(|e| e.to_string())?;
    let refused = |e: ProgramError| {
        format!(
            "the kernel refused a kprobe on {function} ({})",
            root_cause(&e)
        )
    };
    if !prog.loaded() {
        prog.load().map_err(refused)?;
    }
    let id = prog.attach(function, 0).map_err(refused)?;
    prog.take_link(id).map(Link::KProbe).map_err(refused)
}

/// The kernel function a task runs first after a switch (kernel/sched/core.c), in its own
/// context: where off-CPU stacks of long stretches are taken. Compilers often rename it
/// (`finish_task_switch.isra.0`).
const SWITCH_IN_FUNCTION: &str = "finish_task_switch";

/// The name `/proc/kallsyms` gives [`SWITCH_IN_FUNCTION`] (a compiler clone's suffix
/// included), if any.
fn switch_in_symbol(kallsyms: &str) -> Option<String> {
    kallsyms.lines().find_map(|line| {
        let name = line.split_whitespace().nth(2)?;
        let rest = name.strip_prefix(SWITCH_IN_FUNCTION)?;
        (rest.is_empty() || rest.starts_with('.')).then(|| name.to_owned())
    })
}

/// Takes off-CPU stacks only for stretches of at least `min_ns`, as threads come back to
/// the CPU: attaches the switch-in program, then tells the switch-out program. The
/// description of how they are taken with the program's link, or why they stay at every
/// switch-out.
fn offcpu_stacks_on_return(
    ebpf: &mut Ebpf,
    tracefs_root: &Path,
    symbol: Option<String>,
    min_ns: u64,
) -> Result<(String, Link), String> {
    let every = "taken at every switch-out";
    if let Some(why) = kprobes_missing(tracefs_root) {
        return Err(format!("{every}: {why}"));
    }
    let Some(symbol) = symbol else {
        return Err(format!(
            "{every}: no {SWITCH_IN_FUNCTION} in /proc/kallsyms to take them as threads come back"
        ));
    };
    let link = attach_kprobe(ebpf, names::KPROBE_FINISH_TASK_SWITCH, &symbol)
        .map_err(|why| format!("{every}: {why}"))?;
    let mut min: aya::maps::Array<&mut MapData, u64> = aya::maps::Array::try_from(
        ebpf.map_mut(names::OFFCPU_MIN)
            .ok_or_else(|| format!("{every}: the programs have no {} map", names::OFFCPU_MIN))?,
    )
    .map_err(|e| format!("{every}: {e}"))?;
    min.set(0, min_ns, 0).map_err(|e| format!("{every}: {e}"))?;
    let how = format!(
        "taken as threads come back to the CPU (kprobe on {symbol}), for stretches of {} µs \
         or more",
        min_ns / 1000
    );
    Ok((how, link))
}

/// Kernel functions on the user page-fault path: a sample whose kernel stack passes
/// through one of them was taken while handling a fault.
pub const FAULT_HANDLERS: [&str; 5] = [
    "asm_exc_page_fault",
    "exc_page_fault",
    "do_user_addr_fault",
    "handle_mm_fault",
    "__handle_mm_fault",
];

/// Loaded and attached programs, with the maps user space reads.
pub struct Attached {
    ebpf: Option<Ebpf>,
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
    /// Files already probed (device, inode).
    probed: Vec<(u64, u64)>,
    /// `--follow`: also attach to processes that map NCCL later, until stopped.
    pub follow: Option<Follow>,
    /// Python targets whose frames are walked (profile `python_frames`).
    python: python::PyTargets,
    /// The PMU's memory sampler on the targets' threads, where the host has one.
    mem: Option<pmu::Sampling>,
    /// Held open while the kernel is to account the programs' run time.
    bpf_stats: Option<std::os::fd::OwnedFd>,
    /// The timed programs' runs and nanoseconds for traced threads (`timed`).
    target_costs: PerCpuArray<MapData, u64>,
    /// What a traced call's traps cost here (ns), measured at the first tick, or why not.
    traps: Option<Result<traps::Traps, String>>,
    /// The programs' run time before any probe was attached (the first window's start).
    baseline: Option<crate::record::ProgramReading>,
    /// The runs the trap calibration caused, left out of every reading.
    calibration_runs: BTreeMap<String, (u64, u64)>,
    /// Read the targets' numa_maps (NUMA balancing off or untraced on a multi-node host),
    /// and when it was last read.
    resident: bool,
    resident_read: Option<Instant>,
}

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

/// Ring buffers for this host (one per group of CPUs, see `rings`).
fn ring_shards() -> u32 {
    // SAFETY: sysconf has no preconditions.
    let cpus = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_CONF) };
    rings::shards_for(usize::try_from(cpus).unwrap_or(1))
}

/// Loads the programs with this kernel's tracepoint offsets, the profile's switches and `shards`
/// ring buffers in use.
fn load(
    offsets: &nccltrace_common::TpOffsets,
    profile: &Profile,
    shards: u32,
) -> Result<Ebpf, SourceError> {
    let mut loader = EbpfLoader::new();
    loader.override_global(names::OFFSETS, offsets, true);
    let config = nccltrace_common::Config {
        offcpu_stacks: match (
            profile.probes.offcpu_on(),
            profile.probes.offcpu_kernel_stacks,
        ) {
            (false, _) => nccltrace_common::offcpu::OFF,
            (true, false) => nccltrace_common::offcpu::USER,
            (true, true) => nccltrace_common::offcpu::KERNEL,
        },
        call_stacks: profile.probes.call_stacks.setting(),
        streams: u32::from(profile.probes.streams),
        shards,
        // Woken early at an eighth full; otherwise drained every `DRAIN_EVERY`.
        wakeup_bytes: u64::from(profile.ring_buffer_bytes() / shards / 8),
    };
    loader.override_global(names::CONFIG, &config, true);
    rings::size(&mut loader, shards, profile.ring_buffer_bytes());
    loader.load(PROGRAMS).map_err(|e| {
        if is_eperm(&e) {
            SourceError::Permission {
                source: Box::new(e),
            }
        } else {
            SourceError::Load(Box::new(e))
        }
    })
}

/// The libraries to probe in `t` under `profile`, and the probes as the recording lists them.
fn target_libs<'t>(t: &'t Target, profile: &Profile) -> (Vec<&'t FoundLibrary>, Vec<ProbeInfo>) {
    let mut libs: Vec<&FoundLibrary> = Vec::new();
    if profile.probes.nccl {
        libs.push(&t.nccl);
    }
    if profile.probes.cuda_sync {
        libs.extend(t.cuda.iter());
    }
    libs.extend(t.marker.iter());
    libs.extend(t.nvtx.iter());
    let probes = libs
        .iter()
        .flat_map(|lib| {
            lib.sites.iter().map(|site| ProbeInfo {
                func: site.func.name().to_owned(),
                symbol: site.symbol.clone(),
                library: lib.path.clone(),
                file_offset: site.file_offset,
                past_endbr64: site.past_endbr64,
            })
        })
        .collect();
    (libs, probes)
}

/// A file's identity: probes are per file, whatever the number of processes mapping it.
fn inode(path: &Path) -> (u64, u64) {
    std::fs::metadata(path).map_or((0, 0), |m| (m.dev(), m.ino()))
}

/// Attaches the entry and return programs (loaded) to every site of `lib`, the return
/// program only where `returns` wants it (the entry program then writes the record, told
/// by its cookie), unless a file in `probed` (device, inode) is the same: probes fire for
/// every process mapping it.
fn probe_library(
    ebpf: &mut Ebpf,
    lib: &FoundLibrary,
    returns: CallReturns,
    probed: &mut Vec<(u64, u64)>,
    links: &mut Vec<Link>,
) -> Result<(), SourceError> {
    let id = inode(&lib.host_path);
    if id != (0, 0) && probed.contains(&id) {
        return Ok(());
    }
    probed.push(id);
    for program in [names::UPROBE_LIB_CALL, names::URETPROBE_LIB_CALL] {
        let prog: &mut UProbe = typed_program(ebpf, program)?;
        for site in &lib.sites {
            let func = site.func.id();
            let returned = returns.traced(func);
            if program == names::URETPROBE_LIB_CALL && !returned {
                continue;
            }
            let entry_only = if returned {
                0
            } else {
                nccltrace_common::func::ENTRY_ONLY
            };
            let point = UProbeAttachPoint {
                location: UProbeAttachLocation::AbsoluteOffset(site.file_offset),
                cookie: Some(u64::from(func | entry_only)),
            };
            let place = format!("{}:{}", lib.path, site.symbol);
            let id = prog
                .attach(point, &lib.host_path, UProbeScope::AllProcesses)
                .map_err(|e| program_error(program, &place, e))?;
            let link = prog
                .take_link(id)
                .map_err(|e| program_error(program, &place, e))?;
            links.push(Link::Uprobe(link));
        }
    }
    Ok(())
}

/// One software cpu-clock event per online CPU (`SampleScope::Cpu`); the program keeps the
/// samples of target threads only.
fn sample_cpus(ebpf: &mut Ebpf, period_ns: u64, links: &mut Vec<Link>) -> Result<(), SourceError> {
    let name = names::PERF_EVENT_CPU_CLOCK;
    let prog: &mut PerfEvent = typed_program(ebpf, name)?;
    let cpus = aya::util::online_cpus().map_err(|(path, source)| SourceError::OnlineCpus {
        path: path.to_owned(),
        source,
    })?;
    for cpu in cpus {
        let scope = PerfEventScope::AllProcessesOneCpu { cpu };
        attach_clock(prog, scope, period_ns, false, links)
            .map_err(|e| program_error(name, &format!("CPU {cpu}"), e))?;
    }
    Ok(())
}

/// Attaches the sampling program to one software cpu-clock event of `scope`.
fn attach_clock(
    prog: &mut PerfEvent,
    scope: PerfEventScope,
    period_ns: u64,
    inherit: bool,
    links: &mut Vec<Link>,
) -> Result<(), ProgramError> {
    let config = PerfEventConfig::Software(SoftwareEvent::CpuClock);
    let id = prog.attach(config, scope, SamplePolicy::Period(period_ns), inherit)?;
    links.push(Link::Perf(prog.take_link(id)?));
    Ok(())
}

/// One software cpu-clock event per thread of `pid`, inherited by threads it creates
/// (`SampleScope::Thread`).
fn sample_threads(
    ebpf: &mut Ebpf,
    host: &Host,
    pid: u32,
    period_ns: u64,
    links: &mut Vec<Link>,
) -> Result<(), SourceError> {
    let name = names::PERF_EVENT_CPU_CLOCK;
    let prog: &mut PerfEvent = typed_program(ebpf, name)?;
    for tid in host.threads(pid) {
        let scope = PerfEventScope::OneProcess {
            pid: tid,
            cpu: None,
        };
        match attach_clock(prog, scope, period_ns, true, links) {
            Ok(()) => {}
            // The thread exited between listing and attaching.
            Err(_) if !host.path(&format!("proc/{pid}/task/{tid}")).exists() => {}
            Err(e) => {
                return Err(program_error(
                    name,
                    &format!("thread {tid} of pid {pid}"),
                    e,
                ));
            }
        }
    }
    Ok(())
}

/// What the recording keeps about a target.
fn target_info(
    host: &Host,
    t: &Target,
    probes: Vec<ProbeInfo>,
    python: Option<crate::python::PythonInfo>,
) -> TargetInfo {
    TargetInfo {
        python,
        pid: t.pid,
        comm: t.comm.clone(),
        cmdline: host.cmdline(t.pid),
        nccl_library: Some(t.nccl.path.clone()),
        cuda_library: t.cuda.as_ref().map(|c| c.path.clone()),
        probes,
        maps: t.maps.clone(),
        threads: host.thread_names(t.pid),
        env_rank: host.env_rank(t.pid),
        job: host.env_job(t.pid),
        maps_text: std::fs::read_to_string(host.path(&format!("proc/{}/maps", t.pid)))
            .unwrap_or_default(),
    }
}

/// Adds `t`'s threads to `THREADS`.
fn register_threads(ebpf: &mut Ebpf, host: &Host, t: &Target) -> Result<(), SourceError> {
    let mut threads: BpfHashMap<_, u32, u32> = BpfHashMap::try_from(
        ebpf.map_mut(names::THREADS)
            .ok_or_else(|| missing_map(names::THREADS))?,
    )
    .map_err(map_error(names::THREADS))?;
    for tid in host.threads(t.pid) {
        threads
            .insert(tid, t.pid, 0)
            .map_err(map_error(names::THREADS))?;
    }
    Ok(())
}

/// Loads the programs and attaches everything `profile` asks for to `targets`.
/// Must run inside a tokio runtime (the ring buffer is registered with it). A target that
/// exits meanwhile makes whatever failed (its files vanish from /proc/PID/root) a
/// [`SourceError::ExitedDuringAttach`].
pub fn attach(targets: &[Target], profile: &Profile) -> Result<Attached, SourceError> {
    attach_all(targets, profile).map_err(|e| {
        let host = Host::live();
        match targets.iter().find(|t| !host.process_alive(t.pid)) {
            Some(t) => SourceError::ExitedDuringAttach { pid: t.pid },
            None => e,
        }
    })
}

#[allow(clippy::too_many_lines)] // one straight sequence: load, fill maps, attach, take maps
fn attach_all(targets: &[Target], profile: &Profile) -> Result<Attached, SourceError> {
    let started = Instant::now();
    let host = Host::live();
    let tracefs_root = tracefs::ensure_mounted()?;
    let (offsets, available) = tracefs::offsets(&tracefs_root)?;

    let shards = ring_shards();
    let mut phases = Phases::new(started);
    // Read and parsed beside the loading (tens of ms each): /proc/kallsyms (~10 MB) for the
    // fault handlers' ranges and the switch-in kprobe's symbol, the kernel BTF for fentry.
    let kallsyms = std::thread::spawn(|| {
        let text = std::fs::read_to_string("/proc/kallsyms").unwrap_or_default();
        (
            host::kallsyms_ranges(&text, &FAULT_HANDLERS),
            switch_in_symbol(&text),
        )
    });
    let btf = profile.probes.page_faults.then(|| {
        std::thread::spawn(|| {
            Btf::from_sys_fs().map_err(|e| format!("no kernel BTF ({})", root_cause(&e)))
        })
    });
    phases.mark("tracefs");
    let mut ebpf = load(&offsets, profile, shards)?;
    phases.mark("maps and object");
    // The kernel accounts each program's run time while this descriptor is open (the
    // programs' own cost, `summary.json` agent.bpf).
    let (bpf_stats, bpf_stats_refused) = match aya::sys::enable_stats(aya::sys::Stats::RunTime) {
        Ok(fd) => (Some(fd), None),
        Err(e) => (
            None,
            Some(format!(
                "the kernel refused to account the programs' run time (BPF_ENABLE_STATS: {e}; \
                 it needs Linux 5.8 and CAP_SYS_ADMIN)"
            )),
        ),
    };
    // The programs are loaded and not attached yet: every count starts from zero here.
    let baseline = bpf_stats.as_ref().map(|_| crate::record::ProgramReading {
        at_ns: host::clock_ns(libc::CLOCK_MONOTONIC),
        ..crate::record::ProgramReading::default()
    });

    let logger = match aya_log::EbpfLogger::init(&mut ebpf) {
        Ok(logger) => Some(logger),
        Err(e) => {
            log::warn!("eBPF diagnostics unavailable: {e}");
            None
        }
    };
    let mut map_targets: BpfHashMap<MapData, u32, u32> = BpfHashMap::try_from(
        ebpf.take_map(names::TARGETS)
            .ok_or_else(|| missing_map(names::TARGETS))?,
    )
    .map_err(map_error(names::TARGETS))?;
    for t in targets {
        map_targets
            .insert(t.pid, 1, 0)
            .map_err(map_error(names::TARGETS))?;
    }
    for t in targets {
        register_threads(&mut ebpf, &host, t)?;
    }
    phases.mark("targets and threads");
    let mut py_targets = python::PyTargets::new();
    let mut py_infos = BTreeMap::new();
    if profile.probes.python_frames {
        for t in targets {
            if let Some(info) = python::start(&mut ebpf, &host, t.pid, &mut py_targets)? {
                py_infos.insert(t.pid, info);
            }
        }
    }

    phases.mark("python");
    preload(
        &mut ebpf,
        &wanted_programs(profile, &available, &tracefs_root),
    );
    phases.mark("programs verified (in parallel)");
    let mut links = Vec::new();
    let infos: Vec<(&Target, Vec<&FoundLibrary>, Vec<ProbeInfo>)> = targets
        .iter()
        .map(|t| {
            let (libs, probes) = target_libs(t, profile);
            (t, libs, probes)
        })
        .collect();
    for program in [names::UPROBE_LIB_CALL, names::URETPROBE_LIB_CALL] {
        load_program::<UProbe>(&mut ebpf, program)?;
    }
    // One probe per file, whatever the number of targets: ranks share their libraries,
    // the kernel filters by TARGETS, and every uprobe costs a grace period to detach.
    let mut probed: Vec<(u64, u64)> = Vec::new();
    for (_, libs, _) in &infos {
        for lib in libs {
            probe_library(
                &mut ebpf,
                lib,
                profile.probes.call_returns,
                &mut probed,
                &mut links,
            )?;
        }
    }

    phases.mark("uprobes");
    for tp in names::TRACEPOINTS {
        if !tracepoint_wanted(&tp, profile) || !available.contains(&tp.event) {
            continue;
        }
        let place = format!("{}:{}", tp.category, tp.event);
        let name = tp.program;
        if tp.raw {
            let prog: &mut RawTracePoint = load_program(&mut ebpf, name)?;
            let id = prog
                .attach(tp.event)
                .map_err(|e| program_error(name, &place, e))?;
            let link = prog
                .take_link(id)
                .map_err(|e| program_error(name, &place, e))?;
            links.push(Link::RawTracepoint(link));
            continue;
        }
        let prog: &mut TracePoint = load_program(&mut ebpf, name)?;
        let id = prog
            .attach(tp.category, tp.event)
            .map_err(|e| program_error(name, &place, e))?;
        let link = prog
            .take_link(id)
            .map_err(|e| program_error(name, &place, e))?;
        links.push(Link::Tracepoint(link));
    }

    phases.mark("tracepoints");
    let (fault_timing, fault_timing_refused) = if profile.probes.page_faults {
        let btf = btf.map_or_else(
            || Err("the kernel BTF was not read".to_owned()),
            |t| {
                t.join()
                    .unwrap_or_else(|_| Err("reading the kernel BTF panicked".to_owned()))
            },
        );
        match time_faults(&mut ebpf, btf) {
            Ok((how, pair)) => {
                links.extend(pair);
                (Some(how), None)
            }
            Err(why) => (None, Some(why)),
        }
    } else {
        (None, Some("page faults are off in this profile".to_owned()))
    };

    phases.mark("fault timing");
    let (fault_handler_ranges, switch_in) = kallsyms.join().unwrap_or_default();
    phases.mark("kallsyms (the rest of its reading)");
    // Off-CPU stacks: which frames, and when they are taken.
    let min_ns = profile.probes.offcpu_min_us.saturating_mul(1000);
    let offcpu_on = profile.probes.offcpu_on();
    let (when, offcpu_min_ns) = if offcpu_on && min_ns > 0 {
        match offcpu_stacks_on_return(&mut ebpf, &tracefs_root, switch_in, min_ns) {
            Ok((how, link)) => {
                links.push(link);
                (how, min_ns)
            }
            Err(why) => (why, 0),
        }
    } else {
        ("taken at every switch-out".to_owned(), 0)
    };
    let frames = if profile.probes.offcpu_kernel_stacks {
        "kernel, user and Python frames"
    } else {
        "user and Python frames, no kernel frames (profile offcpu_kernel_stacks = false)"
    };
    let offcpu_stacks = offcpu_on.then(|| format!("{frames}, {when}"));

    phases.mark("off-CPU kprobe");
    let numa_hints_refused = if profile.probes.numa {
        match trace_numa_hints(&mut ebpf, &tracefs_root) {
            Ok(link) => {
                links.push(link);
                None
            }
            Err(why) => Some(why),
        }
    } else {
        Some("the profile has numa off".to_owned())
    };

    phases.mark("NUMA kprobe");
    // The PMU's memory sampler on every thread of the targets, where the host has one.
    let (mem, mem_sampling_refused) = if profile.probes.numa {
        let tids: Vec<u32> = targets.iter().flat_map(|t| host.threads(t.pid)).collect();
        match crate::pmu::detect(std::path::Path::new(crate::pmu::DEVICES))
            .and_then(|s| pmu::Sampling::open(s, &tids))
        {
            Ok(s) => (Some(s), None),
            Err(why) => (None, Some(why)),
        }
    } else {
        (None, Some("the profile has numa off".to_owned()))
    };

    phases.mark("PMU sampler");
    let mut sample_period_ns = 0;
    if profile.sampling.hz > 0 {
        sample_period_ns = 1_000_000_000 / u64::from(profile.sampling.hz);
        let name = names::PERF_EVENT_CPU_CLOCK;
        load_program::<PerfEvent>(&mut ebpf, name)?;
        match profile.sampling.scope {
            SampleScope::Cpu => sample_cpus(&mut ebpf, sample_period_ns, &mut links)?,
            SampleScope::Thread => {
                for t in targets {
                    sample_threads(&mut ebpf, &host, t.pid, sample_period_ns, &mut links)?;
                }
            }
        }
    }
    phases.mark("sampling clocks");

    let rings = rings::Rings::take(&mut ebpf, shards)?;
    let counters = PerCpuArray::try_from(
        ebpf.take_map(names::COUNTERS)
            .ok_or_else(|| missing_map(names::COUNTERS))?,
    )
    .map_err(map_error(names::COUNTERS))?;
    let target_costs = PerCpuArray::try_from(
        ebpf.take_map(names::TARGET_COSTS)
            .ok_or_else(|| missing_map(names::TARGET_COSTS))?,
    )
    .map_err(map_error(names::TARGET_COSTS))?;

    // Without hinting faults, where the targets' memory is tells the remote share.
    let node_distances = host.node_distances();
    let numa_balancing: Option<u32> = host
        .read("proc/sys/kernel/numa_balancing")
        .and_then(|v| v.trim().parse().ok());
    let resident = profile.probes.numa
        && node_distances.len() > 1
        && (numa_balancing == Some(0) || numa_hints_refused.is_some());
    let (kernel_release, hostname) = host::uname();
    let mut header = Header {
        format_version: FORMAT_VERSION,
        agent_version: env!("CARGO_PKG_VERSION").to_owned(),
        kernel_release,
        hostname,
        clock: ClockRef {
            monotonic_ns: host::clock_ns(libc::CLOCK_MONOTONIC),
            realtime_ns: host::clock_ns(libc::CLOCK_REALTIME),
        },
        cpu_nodes: host.cpu_nodes(),
        profile: profile.name.clone(),
        targets: infos
            .into_iter()
            .map(|(t, _, probes)| {
                let py = py_infos.remove(&t.pid);
                target_info(&host, t, probes, py)
            })
            .collect(),
        sample_period_ns,
        fault_handler_ranges,
        step_nvtx: None,
        fault_timing,
        fault_timing_refused,
        node_distances,
        numa_balancing,
        numa_maps_every_s: resident.then_some(host::NUMA_MAPS_EVERY.as_secs()),
        numa_hints_refused,
        mem_sampler: mem.as_ref().map(|m| m.sampler.describe()),
        mem_sampling_refused,
        cpu_khz: mem.as_ref().and_then(|_| crate::pmu::cpu_khz()),
        bpf_stats_refused,
        offcpu_stacks,
        offcpu_min_ns,
        attach_phases_us: Vec::new(),
    };
    phases.mark("maps and header");
    header.attach_phases_us = phases.done;
    Ok(Attached {
        bpf_stats,
        target_costs,
        traps: None,
        baseline,
        calibration_runs: BTreeMap::new(),
        mem,
        resident,
        resident_read: None,
        ebpf: Some(ebpf),
        links,
        logger,
        targets: map_targets,
        stopped_ns: None,
        rings,
        counters,
        header,
        pids: targets.iter().map(|t| t.pid).collect(),
        attach_time: started.elapsed(),
        profile: profile.clone(),
        probed,
        follow: None,
        python: py_targets,
    })
}

/// Where attaching went: each phase's name and microseconds, in order.
struct Phases {
    last: Instant,
    done: Vec<(String, u64)>,
}

impl Phases {
    fn new(started: Instant) -> Phases {
        Phases {
            last: started,
            done: Vec::new(),
        }
    }

    /// Ends the phase that began at the previous mark.
    fn mark(&mut self, name: &str) {
        let now = Instant::now();
        let us = u64::try_from(now.duration_since(self.last).as_micros()).unwrap_or(u64::MAX);
        self.done.push((name.to_owned(), us));
        self.last = now;
    }
}

/// Whether `profile` attaches the tracepoint `tp`.
fn tracepoint_wanted(tp: &names::Tracepoint, profile: &Profile) -> bool {
    match tp.switch {
        names::Switch::PageFaults => profile.probes.page_faults,
        names::Switch::Numa => profile.probes.numa,
        names::Switch::Always => true,
        names::Switch::Sched => profile.probes.sched,
    }
}

/// A program type that loads with no arguments.
pub trait Loadable {
    fn load_into_kernel(&mut self) -> Result<(), ProgramError>;
    /// Already loaded (by `preload`).
    fn loaded(&self) -> bool;
}

macro_rules! loadable {
    ($($t:ty),*) => {$(
        impl Loadable for $t {
            fn load_into_kernel(&mut self) -> Result<(), ProgramError> {
                self.load()
            }
            fn loaded(&self) -> bool {
                self.fd().is_ok()
            }
        }
    )*};
}
loadable!(UProbe, TracePoint, RawTracePoint, PerfEvent, KProbe);

/// Loads the program `name` of `ebpf` into the kernel. A rejection by the verifier names
/// the program and the kernel release, with the verifier's output.
pub fn load_program<'e, P: Loadable>(
    ebpf: &'e mut Ebpf,
    name: &str,
) -> Result<&'e mut P, SourceError>
where
    &'e mut P: TryFrom<&'e mut aya::programs::Program, Error = ProgramError>,
{
    let prog: &mut P = typed_program(ebpf, name)?;
    if !prog.loaded() {
        prog.load_into_kernel()
            .map_err(|e| program_error(name, "-", e))?;
    }
    Ok(prog)
}

/// The programs `attach_all` will load under `profile` on this kernel (`available`: its
/// tracepoints).
fn wanted_programs(
    profile: &Profile,
    available: &[&str],
    tracefs_root: &Path,
) -> Vec<&'static str> {
    let mut wanted = vec![names::UPROBE_LIB_CALL, names::URETPROBE_LIB_CALL];
    wanted.extend(
        names::TRACEPOINTS
            .iter()
            .filter(|tp| tracepoint_wanted(tp, profile) && available.contains(&tp.event))
            .map(|tp| tp.program),
    );
    if profile.sampling.hz > 0 {
        wanted.push(names::PERF_EVENT_CPU_CLOCK);
    }
    if kprobes_missing(tracefs_root).is_none() {
        if profile.probes.numa {
            wanted.push(names::KPROBE_TASK_NUMA_FAULT);
        }
        if profile.probes.offcpu_on() && profile.probes.offcpu_min_us > 0 {
            wanted.push(names::KPROBE_FINISH_TASK_SWITCH);
        }
    }
    wanted
}

/// Loads the `wanted` programs into the kernel at once, a thread each: the kernel verifies
/// them side by side (on the H200 those with stacks and the Python walk took 20–30 ms each,
/// one after another). A program that fails here is loaded again where it is attached,
/// which reports the verifier's refusal by name.
fn preload(ebpf: &mut Ebpf, wanted: &[&str]) {
    use aya::programs::Program;
    std::thread::scope(|scope| {
        for (name, program) in ebpf.programs_mut() {
            if !wanted.contains(&name) || program.fd().is_ok() {
                continue;
            }
            scope.spawn(move || {
                let loaded = match program {
                    Program::UProbe(p) => p.load(),
                    Program::TracePoint(p) => p.load(),
                    Program::RawTracePoint(p) => p.load(),
                    Program::PerfEvent(p) => p.load(),
                    Program::KProbe(p) => p.load(),
                    _ => Ok(()),
                };
                if let Err(e) = loaded {
                    log::debug!("{name} not loaded ahead: {e}");
                }
            });
        }
    });
}

/// Each loaded program's runs and run time as the kernel counts them.
fn raw_program_runs(ebpf: &Ebpf) -> BTreeMap<String, (u64, u64)> {
    ebpf.programs()
        .filter_map(|(name, p)| {
            let info = p.info().ok()?;
            let ns = u64::try_from(info.run_time().as_nanos()).unwrap_or(u64::MAX);
            Some((name.to_owned(), (info.run_count(), ns)))
        })
        .collect()
}

/// The program `name` of the object, as its type.
fn typed_program<'e, P>(ebpf: &'e mut Ebpf, name: &str) -> Result<&'e mut P, SourceError>
where
    &'e mut P: TryFrom<&'e mut aya::programs::Program, Error = ProgramError>,
{
    ebpf.program_mut(name)
        .ok_or_else(|| missing_program(name))?
        .try_into()
        .map_err(|e| program_error(name, "-", e))
}

fn missing_program(name: &str) -> SourceError {
    SourceError::MissingProgram {
        name: name.to_owned(),
    }
}

fn missing_map(name: &'static str) -> SourceError {
    SourceError::Map {
        name,
        source: Box::new(aya::maps::MapError::InvalidName { name: name.into() }),
    }
}

/// Why draining stopped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StopReason {
    TargetsExited,
    Duration,
    Signal(&'static str),
    /// The sink asked for a new output window (`--rotate`): tracing goes on.
    Rotate,
}

impl std::fmt::Display for StopReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StopReason::TargetsExited => write!(f, "every target exited"),
            StopReason::Duration => write!(f, "--duration elapsed"),
            StopReason::Signal(name) => write!(f, "{name} received"),
            StopReason::Rotate => write!(f, "--rotate: the next window began"),
        }
    }
}

/// Receives every raw record as it is drained.
pub trait Sink {
    /// One raw kernel record. An error stops the run (the outputs already written stay).
    fn record(&mut self, bytes: &[u8]) -> Result<(), crate::Error>;
    /// A target attached during the run (`--follow`).
    fn target_added(&mut self, target: &TargetInfo);
    /// Called about once a second with the records lost so far, by kind, and the number
    /// of targets still running.
    fn tick(&mut self, lost: &BTreeMap<String, u64>, alive: usize);
    /// Checked about ten times a second: true ends [`Attached::run`] with
    /// [`StopReason::Rotate`], the programs still armed.
    fn rotate_due(&self) -> bool {
        false
    }
    /// Names of Python code objects seen for the first time in this sink's records (the
    /// record that shows them comes next).
    fn python_codes(&mut self, _pid: u32, _codes: Vec<(u64, crate::python::CodeInfo)>) {}
    /// The programs' run time so far, as the kernel accounts it: when tracing starts,
    /// about once a second, and when it stops.
    fn program_stats(&mut self, _reading: crate::record::ProgramReading) {}
}

impl Attached {
    /// Attaches to a target found after the start (`--follow`): its threads and pid join
    /// the maps, its libraries are probed unless an earlier target maps the same files, its
    /// threads get sampling events when they are sampled per thread. Returns what the
    /// recording keeps about it.
    pub fn add_target(&mut self, t: &Target) -> Result<TargetInfo, SourceError> {
        let host = Host::live();
        let ebpf = self.ebpf.as_mut().ok_or(SourceError::Detached)?;
        register_threads(ebpf, &host, t)?;
        let (libs, probes) = target_libs(t, &self.profile);
        for lib in libs {
            let returns = self.profile.probes.call_returns;
            probe_library(ebpf, lib, returns, &mut self.probed, &mut self.links)?;
        }
        if self.header.sample_period_ns > 0 && self.profile.sampling.scope == SampleScope::Thread {
            let period = self.header.sample_period_ns;
            sample_threads(ebpf, &host, t.pid, period, &mut self.links)?;
        }
        self.targets
            .insert(t.pid, 1, 0)
            .map_err(map_error(names::TARGETS))?;
        self.pids.push(t.pid);
        let py = if self.profile.probes.python_frames {
            python::start(ebpf, &host, t.pid, &mut self.python)?
        } else {
            None
        };
        let info = target_info(&host, t, probes, py);
        self.header.targets.push(info.clone());
        Ok(info)
    }

    /// The records go to a new sink (a new recording window) from now on: Python code
    /// objects are named to it again as they are seen.
    pub fn new_window(&mut self) {
        python::new_window(&mut self.python);
    }

    /// `--follow`: attaches to every process that maps NCCL and is not traced yet.
    fn follow_new(&mut self, sink: &mut impl Sink) {
        let Some(mut follow) = self.follow.take() else {
            return;
        };
        let host = Host::live();
        for pid in processes_with_nccl_cached(&host, &mut follow.verdicts) {
            if self.pids.contains(&pid) || follow.refused.contains(&pid) {
                continue;
            }
            let attached = discover(&host, pid, follow.step_symbol.as_deref(), follow.nvtx)
                .and_then(|t| self.add_target(&t));
            match attached {
                Ok(info) => {
                    crate::note!(
                        "nccltrace: --follow: attached to pid {pid} ({}): {} probes",
                        info.comm,
                        info.probes.len()
                    );
                    sink.target_added(&info);
                }
                Err(e) => {
                    crate::note!("nccltrace: --follow: warning: pid {pid} not traced: {e}");
                    follow.refused.push(pid);
                }
            }
        }
        self.follow = Some(follow);
    }

    /// Lost records by kind name, and the other counters by name, summed over CPUs.
    #[must_use]
    pub fn counters(&self) -> (BTreeMap<String, u64>, BTreeMap<String, u64>) {
        let mut lost = BTreeMap::new();
        let mut other = BTreeMap::new();
        for index in 0..counter::COUNT {
            let Ok(values) = self.counters.get(&index, 0) else {
                continue;
            };
            let total: u64 = values.iter().sum();
            if index < kind::COUNT as u32 {
                if index > 0 {
                    lost.insert(Event::kind_name(index as u16).to_owned(), total);
                }
                continue;
            }
            let Some(name) = counter::name(index) else {
                continue;
            };
            other.insert(name.to_owned(), total);
        }
        // The PMU sampler's own losses (its ring full), and damaged rings.
        if let Some(mem) = &self.mem {
            lost.insert(Event::kind_name(kind::MEM_SAMPLE).to_owned(), mem.lost);
            if mem.damaged > 0 {
                other.insert("mem_sample_rings_damaged".to_owned(), mem.damaged);
            }
        }
        (lost, other)
    }

    /// Drains until every target has exited, `duration` passes, or `stop` is signalled;
    /// then disarms every program and drains what is left.
    pub async fn run(
        &mut self,
        duration: Option<Duration>,
        sink: &mut impl Sink,
        stop: &mut crate::stop::Stop,
    ) -> Result<StopReason, crate::Error> {
        // Records handled between checks of the stop conditions: a producer faster than
        // the drain must not keep the loop from seeing Ctrl-C or the deadline.
        const BUDGET: usize = 16_384;
        let deadline = duration.map(|d| tokio::time::Instant::now() + d);
        // The programs wake the reader only when the buffer fills (see `wake_flags` in the
        // kernel programs); otherwise it is drained on this timer.
        let mut poll = tokio::time::interval(DRAIN_EVERY);
        poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut ticks = 0u32;
        let host = Host::live();
        let mut last_tick = Instant::now();
        let mut last_follow = Instant::now();
        let mut more = true;
        // The first window counts from the reading taken before any probe was attached:
        // the calls made while attaching are in its recording too.
        match self.baseline.take() {
            Some(reading) => sink.program_stats(reading),
            None => self.read_program_stats(sink),
        }
        let reason = loop {
            if more {
                let mut naming = python::Naming {
                    inner: &mut *sink,
                    targets: &mut self.python,
                };
                more = self.rings.drain(&mut naming, BUDGET)?;
            }
            // The PMU's samples with the programs' records: ones older than attribution's
            // reorder margin when they arrive are counted as late events.
            self.drain_mem(sink)?;
            tokio::select! {
                biased;
                name = stop.requested() => break StopReason::Signal(name),
                () = async {
                    match deadline {
                        Some(d) => tokio::time::sleep_until(d).await,
                        None => std::future::pending().await,
                    }
                } => break StopReason::Duration,
                _ = poll.tick() => {
                    more = true;
                    ticks = ticks.wrapping_add(1);
                    if !ticks.is_multiple_of(10) {
                        continue;
                    }
                    if sink.rotate_due() {
                        break StopReason::Rotate;
                    }
                    if let Some(logger) = self.logger.as_mut() {
                        logger.flush();
                    }
                    if self.follow.is_some() {
                        if last_follow.elapsed() >= Duration::from_secs(1) {
                            last_follow = Instant::now();
                            self.follow_new(sink);
                        }
                    } else if self.pids.iter().all(|p| !host.process_alive(*p)) {
                        break StopReason::TargetsExited;
                    }
                    if last_tick.elapsed() >= Duration::from_secs(1) {
                        last_tick = Instant::now();
                        if let Some(ebpf) = self.ebpf.as_mut() {
                            python::refresh(ebpf, &mut self.python);
                        }
                        self.read_resident(sink, &host)?;
                        // Threads the targets started since: their loads sampled too.
                        if let Some(mem) = self.mem.as_mut() {
                            mem.follow(self.pids.iter().flat_map(|p| host.threads(*p)));
                        }
                        self.measure_traps();
                        self.read_program_stats(sink);
                        let lost = self.counters().0;
                        let alive = self.pids.iter().filter(|p| host.process_alive(**p)).count();
                        sink.tick(&lost, alive);
                    }
                }
                // The kernel only signals readiness once the consumer has caught up, so
                // with records left over the loop goes round again without waiting.
                () = tokio::task::yield_now(), if more => {}
                ready = self.rings.readable(), if !more => {
                    ready?;
                    more = true;
                }
            }
        };
        if !matches!(reason, StopReason::Rotate) {
            self.disarm();
        }
        // Everything drained so far goes to this sink (a window's last records included).
        let mut naming = python::Naming {
            inner: sink,
            targets: &mut self.python,
        };
        self.rings.drain(&mut naming, usize::MAX)?;
        self.drain_mem(sink)?;
        // A run shorter than a second has its traps measured now.
        self.measure_traps();
        self.read_program_stats(sink);
        Ok(reason)
    }

    /// Once, where the programs' run time is accounted: what a traced call's traps cost
    /// here (a few milliseconds of calls of the agent's own, a second into the run).
    fn measure_traps(&mut self) {
        if self.traps.is_none()
            && self.bpf_stats.is_some()
            && let Some(ebpf) = self.ebpf.as_mut()
        {
            let before = raw_program_runs(ebpf);
            self.traps = Some(traps::calibrate(ebpf, &mut self.links));
            // The calibration's own runs of the call programs (rejected at once: the agent is
            // no target) are not the job's: exactly `traps::CALLS_MADE` each, and their share
            // of the time the program ran meanwhile (the job's calls ran it too).
            let after = raw_program_runs(ebpf);
            for name in [names::UPROBE_LIB_CALL, names::URETPROBE_LIB_CALL] {
                let (r0, t0) = before.get(name).copied().unwrap_or((0, 0));
                let (r1, t1) = after.get(name).copied().unwrap_or((0, 0));
                let (runs, ns) = (r1.saturating_sub(r0), t1.saturating_sub(t0));
                // The entry program ran in both sets of calls, the return program in one.
                let made = if name == names::UPROBE_LIB_CALL {
                    2 * traps::CALLS_MADE
                } else {
                    traps::CALLS_MADE
                };
                let own_runs = made.min(runs);
                let own_ns = ns.checked_div(runs).map_or(0, |per_run| per_run * own_runs);
                self.calibration_runs
                    .insert(name.to_owned(), (own_runs, own_ns));
            }
        }
    }

    /// Each loaded program's runs and run time so far, where the kernel accounts them.
    fn program_reading(&self) -> Option<crate::record::ProgramReading> {
        let (Some(ebpf), Some(_)) = (self.ebpf.as_ref(), self.bpf_stats.as_ref()) else {
            return None;
        };
        let programs = raw_program_runs(ebpf)
            .into_iter()
            .map(|(name, (runs, ns))| {
                let (r, t) = self.calibration_runs.get(&name).copied().unwrap_or((0, 0));
                (name, runs.saturating_sub(r), ns.saturating_sub(t))
            })
            .collect();
        let sum = |index: u32| -> u64 {
            self.target_costs
                .get(&index, 0)
                .map_or(0, |values| values.iter().sum())
        };
        let traced = (0..timed::COUNT)
            .map(|id| {
                let name = timed::PROGRAMS[id as usize].to_owned();
                (name, sum(2 * id), sum(2 * id + 1))
            })
            .filter(|(_, runs, _)| *runs > 0)
            .collect();
        let (trap_ns, entry_trap_ns, trap_refused) = match &self.traps {
            Some(Ok(t)) => (Some(t.pair_ns), Some(t.entry_ns), None),
            Some(Err(why)) => (None, None, Some(why.clone())),
            None => (
                None,
                None,
                Some("tracing stopped before it was measured".to_owned()),
            ),
        };
        Some(crate::record::ProgramReading {
            at_ns: host::clock_ns(libc::CLOCK_MONOTONIC),
            programs,
            traced,
            trap_ns,
            entry_trap_ns,
            trap_refused,
        })
    }

    /// Hands `sink` the programs' run time so far.
    fn read_program_stats(&self, sink: &mut impl Sink) {
        if let Some(reading) = self.program_reading() {
            sink.program_stats(reading);
        }
    }

    /// Every [`host::NUMA_MAPS_EVERY`], where enabled: each target's resident memory per
    /// node as a `NUMA_PAGES` record.
    fn read_resident(&mut self, sink: &mut impl Sink, host: &Host) -> Result<(), crate::Error> {
        if !self.resident
            || self
                .resident_read
                .is_some_and(|t| t.elapsed() < host::NUMA_MAPS_EVERY)
        {
            return Ok(());
        }
        self.resident_read = Some(Instant::now());
        for &pid in &self.pids {
            let Some(kib) = host.numa_maps_kib(pid) else {
                continue;
            };
            let mut record = nccltrace_common::NumaPagesEvent {
                hdr: agent_record(
                    host::clock_ns(libc::CLOCK_MONOTONIC),
                    pid,
                    pid,
                    kind::NUMA_PAGES,
                ),
                ..Default::default()
            };
            let room = record.kib.len();
            for (node, k) in kib.iter().enumerate() {
                record.kib[node.min(room - 1)] += k;
            }
            record.nodes = u32::try_from(kib.len().min(room)).unwrap_or(0);
            sink.record(&crate::decode::as_bytes(&record))?;
        }
        Ok(())
    }

    /// Hands on the loads the PMU sampled since the last call, as `MEM_SAMPLE` records.
    fn drain_mem(&mut self, sink: &mut impl Sink) -> Result<(), crate::Error> {
        let Some(mem) = self.mem.as_mut() else {
            return Ok(());
        };
        let mut samples = Vec::new();
        mem.drain(&mut samples);
        samples.sort_unstable_by_key(|s| s.time_ns);
        for s in samples {
            let record = nccltrace_common::MemSampleEvent {
                hdr: agent_record(s.time_ns, s.pid, s.tid, kind::MEM_SAMPLE),
                weight: s.weight,
                _pad: 0,
                data_src: s.data_src,
            };
            sink.record(&crate::decode::as_bytes(&record))?;
        }
        Ok(())
    }

    /// Stops tracing at once: the programs stay attached but, with no target left in
    /// `TARGETS`, emit nothing. Detaching takes seconds (see `detach`), so outputs are
    /// written between the two.
    pub fn disarm(&mut self) {
        if self.stopped_ns.is_some() {
            return;
        }
        for pid in &self.pids {
            // A target added by --follow and already gone is not an error; anything else
            // leaves the programs emitting until they are detached: said.
            if let Err(e) = self.targets.remove(pid)
                && !matches!(e, aya::maps::MapError::KeyNotFound)
            {
                crate::note!(
                    "nccltrace: warning: pid {pid} could not be disarmed ({e}): what its \
                     probes emit after the stop is not recorded"
                );
            }
        }
        self.stopped_ns = Some(host::clock_ns(libc::CLOCK_MONOTONIC));
    }

    /// Detaches and unloads every program (the maps user space holds stay readable), on
    /// a thread of its own: each detach waits for an RCU grace period under a kernel-wide
    /// mutex (~70-130 ms each here; closing from many threads did not overlap them), so
    /// the outputs are made meanwhile. Returns the thread (`None`: detached here, no thread
    /// to be had) and how many attachments it releases.
    pub fn detach_in_background(&mut self) -> (Option<std::thread::JoinHandle<()>>, usize) {
        let links = std::mem::take(&mut self.links);
        let count = links.len();
        let owned = (links, self.ebpf.take());
        // When no thread can be had, the closure (and what it owns) is dropped here.
        let thread = std::thread::Builder::new()
            .name("nccltrace-detach".into())
            .spawn(move || drop(owned))
            .ok();
        (thread, count)
    }
}

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
            names::TARGETS,
            names::THREADS,
            names::PY_THREADS,
            names::PY_LAYOUTS,
            names::CONFIG,
            names::OFFSETS,
        ];
        wanted.extend(names::EVENTS);
        wanted.extend(names::TRACEPOINTS.iter().map(|t| t.program));
        wanted.extend(nccltrace_common::timed::PROGRAMS);
        for name in wanted {
            assert!(defined.contains(name), "the object defines no {name}");
        }
        for symbol in defined.iter().filter(|s| s.starts_with("tracepoint_")) {
            assert!(
                names::TRACEPOINTS.iter().any(|t| t.program == *symbol),
                "{symbol} is in the object but in no tracepoint entry"
            );
        }
    }
}
