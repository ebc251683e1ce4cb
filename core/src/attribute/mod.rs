//! Attribute stage: per step and per thread, where the wall time went. Pure: works the
//! same on live events and on a replayed recording.
//!
//! A thread's time is cut at every event that changes its state (switch out/in, wakeup,
//! migration, entry/return of CUDA sync and NCCL calls); each piece gets one category, so
//! the categories of a step sum to its wall time. Rules (docs/attribution.md):
//! - inside a CUDA sync call while NCCL work issued since the previous sync is outstanding
//!   (a collective of a communicator of more than one rank, or of unknown size):
//!   `nccl_wait`, spinning on the CPU or sleeping; inside one with none outstanding (the
//!   GPU's own work, or collectives of one-rank communicators, which are local copies):
//!   `gpu_wait`;
//! - inside an NCCL call that blocks (sleeps) before returning (a call that blocks the host):
//!   `nccl_wait` for the whole call; other NCCL calls are enqueue work, `compute`;
//! - off-CPU and runnable (preempted, or woken and waiting for a CPU): `cpu_migration` when
//!   the thread was migrated since it left the CPU, else `runqueue`;
//! - off-CPU and blocked: `other_offcpu`, except until another thread of the same process
//!   wakes it (the step's work runs there: PyTorch's autograd thread during
//!   `backward()`): what that thread's time was meanwhile (`compute` where it ran, its
//!   syncs' `gpu_wait`, its blocking collectives' `nccl_wait`, its run-queue waits);
//! - on-CPU: `compute`, of which on-CPU samples whose kernel stack is in the page-fault
//!   handler (or that sit on the instruction that just faulted, being retried), times
//!   the on-CPU time since the previous sample, are `page_fault`.

pub mod align;
mod calls;
pub mod categories;
mod comms;
mod cut;
mod detail;
mod detect;
mod epoch;
mod gpu;
mod infiniband;
mod ingest;
mod methods;
pub mod ranks;
pub mod remote;
mod report;
pub mod steps;

pub use calls::Calls;
pub use comms::CommReport;
pub use detail::{Detail, OffCpu, StackKey, ThreadDetail};
pub use epoch::Epoch;
pub(crate) use gpu::Totals as GpuTotals;
pub use gpu::{CLOCK_EVENT_REASONS, GpuSample, GpuStep, GpuTotal};
pub use infiniband::IbStep;
pub(crate) use infiniband::Readings as IbReadings;
pub use report::{
    BlockingStack, Idle, JobReport, Methods, NcclCount, NvtxPattern, Step, StepRank, StepRule,
    StepsReport, ThreadReport, WorkerReport,
};

pub use categories::{Cat, Categories, NAMES, Unmeasured};

use std::collections::BTreeMap;

use crate::event::{Call, Event, Library, PyFrame, Task};
use detail::StackIds;
use steps::Collective;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Change {
    // At equal times, leave states before entering new ones.
    SyncEnd,
    NcclEnd,
    FaultEnd,
    SwitchIn,
    /// `own`: woken by another thread of the same process.
    Wakeup {
        own: bool,
    },
    Migrate,
    SwitchOut {
        runnable: bool,
    },
    FaultStart,
    NcclStart,
    SyncStart,
}

/// Consecutive faults this close in the code (bytes between the faulting instructions)
/// are one loop's: the gap between their entries is the first's cost, where the loop does
/// little else.
const BACK_TO_BACK_BYTES: u64 = 64;
/// And at most this far apart: a 4 KiB fault costs microseconds (2–15 µs on the machines
/// here); a longer gap also holds other work — a loop's between pages (81–167 µs in a
/// real all-reduce job on the H200, where its faults cost 2–3 µs), a sample's handler, a
/// stall — and its fault is charged the mean, the rest of the gap counted in the error.
const BACK_TO_BACK_NS: u64 = 50_000;
/// Gaps between faults at neighbouring instructions kept up to this long, for the error
/// bound: a fault on the CPU costs well under it (a 2 MiB page's zeroing, tens of µs);
/// beyond, the next fault is another pass's (the next step's first).
const LONG_GAP_NS: u64 = 1_000_000;
/// Back-to-back pairs a step needs before their mean is the cost of its other faults
/// (fewer: the step's samples in the handler estimate its fault time, as where no fault
/// is back to back).
const MIN_PAIRS: u64 = 8;

#[derive(Default)]
struct ThreadLog {
    pid: u32,
    changes: Vec<(u64, Change)>,
    /// Sync calls (start, end), for the NCCL-outstanding test.
    syncs: Vec<(u64, u64)>,
    collectives: Vec<Collective>,
    /// Samples in a page fault: (time, the previous sample's time).
    fault_samples: Vec<(u64, Option<u64>)>,
    /// Samples of the CUDA driver yielding the CPU while it waits for the GPU (in
    /// `sched_yield` called from libcuda): (time, the sampling period it stands for).
    driver_yields: Vec<(u64, u64)>,
    /// The same, with the on-CPU time each stands for (computed at `finish`).
    fault_time: Vec<(u64, u64)>,
    /// The previous sample's time.
    last_sample: Option<u64>,
    /// Faults: (entry, faulting instruction).
    faults: Vec<(u64, u64)>,
    /// Consecutive faults at neighbouring instructions, under [`LONG_GAP_NS`] apart
    /// (back to back where under [`BACK_TO_BACK_NS`]): (first's entry, next's), paired
    /// at attribution where faults are not timed.
    fault_pairs: Vec<(u64, u64)>,
    /// Faults are not timed but counted, and sampled: a step's `page_fault` is measured
    /// between its faults back to back (issue 52).
    faults_untimed: bool,
    migrations: Vec<(u64, bool)>,
    first_switch_is_in: Option<bool>,
    /// The thread's latest page fault: (time, faulting user instruction).
    last_fault: Option<(u64, u64)>,
    /// The end of the thread's last fault timed by fentry/fexit.
    last_fault_end: u64,
    /// The last fault timed by fentry/fexit: (its instruction, how long it took), beside
    /// `last_fault_end`.
    last_timed: Option<(u64, u64)>,
    /// NUMA hinting faults, by time.
    numa_hints: Vec<remote::Hint>,
    /// Loads sampled by the PMU, by time.
    mem_samples: Vec<crate::pmu::MemSample>,
    /// Readings of the thread's node-load counters, by time.
    node_loads: Vec<remote::LoadReading>,
    /// The latency gap of a remote load from each node (the run's, [`remote::remote_gaps`]).
    remote_gaps: Vec<Option<u16>>,
    /// The thread's NUMA node from each switch-in that changed it: (time, node).
    nodes: Vec<(u64, i32)>,
    /// Where the target's resident memory was, seen from the thread's node, by time.
    resident: Vec<remote::Resident>,
    /// The CPU's frequency in kHz where the run sampled loads: `remote_memory` is
    /// measured from them, not estimated.
    mem_khz: Option<u64>,
    /// Every sample: (time, stack id, in a page fault).
    stack_samples: Vec<(u64, u32, bool)>,
    /// Stacks at switch-out: (time, stack id).
    offcpu_stacks: Vec<(u64, u32)>,
    /// Stacks at the entry of traced calls: (time, stack id).
    call_stacks: Vec<(u64, u32)>,
    /// The native frames (kernel, user) of the thread's last off-CPU stack and the user
    /// frames of its last call-entry stack: what a `StackSame` record stands for.
    last_offcpu: Option<(Vec<u64>, Vec<u64>)>,
    last_call: Option<Vec<u64>>,
    /// The thread's last Python frames walked whole: what a `StackSame` record of Python
    /// frames stands for.
    /// By [`py_slot`]: of its call-entry stacks, of its off-CPU stacks, and of both
    /// (recordings before format 5).
    last_py: [Option<Vec<PyFrame>>; 3],
    /// Wakeups: (time, waker tid, waker tgid).
    wakeups: Vec<(u64, u32, u32)>,
    /// Migrations: (time, from CPU, to CPU).
    migration_cpus: Vec<(u64, i32, i32)>,
    /// Entries into the `--step-symbol` function.
    markers: Vec<u64>,
    /// NVTX range pushes: (time, name).
    nvtx: Vec<(u64, String)>,
    /// The thread's time cut into categorized pieces over the epoch being attributed.
    segments: Vec<(u64, u64, Cat)>,
    /// The thread's state where the previous epoch ended (none in the first).
    carry: Option<cut::State>,
    /// An off-CPU stretch still open where the previous epoch ended.
    off_open: Option<OpenOff>,
    /// The last syncs and collectives of earlier epochs: context for step detection and
    /// for telling NCCL syncs at the start of this one.
    history: History,
    /// Syncs and collectives over the whole run (which thread runs the loop).
    total_syncs: u64,
    total_collectives: u64,
    /// This epoch's collectives already given to the cross-rank matcher.
    fed: usize,
    /// The start of the last sync given to the cross-rank matcher.
    synced_to: u64,
    tail: Tail,
    /// Blocked at an earlier cut with no wakeup yet: (switch-out time, ns charged to
    /// `other_offcpu` since), moved to `compute` if another thread of the process ends it.
    pending_block: Option<(u64, u64)>,
}

impl ThreadLog {
    /// The remote share `[a, b)` of this thread is estimated from: its counted loads,
    /// else its hinting faults, else the latest reading of its process's resident pages.
    fn remote_access(&self, a: u64, b: u64) -> Option<remote::RemoteAccess> {
        // The thread's node at the step's end (its first known one before that).
        let at = self.nodes.partition_point(|n| n.0 < b);
        let node = self.nodes[..at].last().or(self.nodes.first());
        let gap = node
            .and_then(|&(_, node)| usize::try_from(node).ok())
            .and_then(|node| self.remote_gaps.get(node).copied().flatten());
        remote::counted(&self.node_loads, a, b, gap)
            .or_else(|| remote::estimate(&self.numa_hints, a, b))
            .or_else(|| remote::from_resident(&self.resident, b))
    }
}

/// An off-CPU stretch begun in an earlier epoch.
#[derive(Clone, Copy, Debug)]
struct OpenOff {
    start: u64,
    runnable: bool,
    stack: Option<u32>,
    /// The last wakeup seen inside it: (time, waker tid, waker tgid).
    wakeup: Option<(u64, u32, u32)>,
}

/// What earlier epochs leave for the next: a bounded tail.
#[derive(Default)]
struct History {
    syncs: Vec<(u64, u64)>,
    collectives: Vec<Collective>,
}

/// Timeline pieces and entry stacks of epochs handed on that stretches and calls still
/// open reach back to.
#[derive(Default)]
struct Tail {
    segments: Vec<(u64, u64, Cat)>,
    call_stacks: Vec<(u64, u32)>,
}

/// Collects what attribution needs, event by event.
#[allow(clippy::struct_excessive_bools)] // independent facts about the run
pub struct Timeline {
    threads: BTreeMap<u32, ThreadLog>,
    page_migrations: Vec<(u32, u64, u64)>,
    numa_moves: Vec<(u32, u64)>,
    /// Processes that exited, not yet told to the cross-rank matcher: (time, pid).
    exited: Vec<(u64, u32)>,
    cpu_nodes: Vec<i32>,
    fault_ranges: Vec<(u64, u64)>,
    /// The `sched_yield` system call's kernel ranges, and each target's CUDA driver's
    /// mappings by pid: a sample in the one called from the other is the driver waiting
    /// for the GPU.
    yield_ranges: Vec<(u64, u64)>,
    cuda_text: BTreeMap<u32, Vec<(u64, u64)>>,
    /// (pid, user address) where threads entered `sched_yield`: the instruction after the
    /// `syscall` in libc's wrapper, learnt from samples inside the call. A sample in the
    /// kernel's system-call entry or exit with that user address is in the same call.
    yield_ips: std::collections::BTreeSet<(u32, u64)>,
    /// Samples of the CUDA driver yielding, over the run.
    driver_yields_seen: u64,
    sample_period_ns: u64,
    offcpu_min_ns: u64,
    thread_names: BTreeMap<u32, String>,
    first_ns: u64,
    last_ns: u64,
    /// An epoch is tried on a run that went quiet: every record written is in.
    caught_up: bool,
    /// The first event's time: the probes were armed by then (the recording begins a
    /// little before).
    first_event_ns: Option<u64>,
    stacks: Vec<StackKey>,
    stack_ids: StackIds,
    /// Python frames waiting for the stack record they belong to: tid → (time, frames).
    py_pending: std::collections::HashMap<u32, (u64, Vec<PyFrame>), foldhash::fast::FixedState>,
    calls: Calls,
    target_pids: Vec<u32>,
    /// Each target's parent at attach.
    parents: BTreeMap<u32, u32>,
    env_ranks: BTreeMap<u32, (String, i32)>,
    /// Faults were timed by fentry/fexit on the fault handler (FaultTime events): their
    /// pieces are `page_fault` directly and samples do not estimate it.
    faults_timed: bool,
    /// A thread's faults came back to back where faults are not timed: some steps'
    /// `page_fault` is measured between them.
    fault_pairs_seen: bool,
    /// Why fentry/fexit did not time them.
    fault_timing_refused: Option<String>,
    /// SLIT distances between nodes.
    node_distances: Vec<Vec<u32>>,
    /// `kernel.numa_balancing` at attach.
    numa_balancing: Option<u32>,
    /// Why hinting faults were not traced.
    numa_hints_refused: Option<String>,
    numa_maps_why: Option<String>,
    /// Hinting faults of target threads seen.
    numa_hints_seen: u64,
    /// Readings of the targets' resident pages per node seen.
    resident_seen: u64,
    /// The PMU memory sampler of the run, described, or why there was none; the CPU's
    /// frequency where both a sampler and it are known (measured `remote_memory`).
    mem_sampler: Option<String>,
    mem_sampling_refused: Option<String>,
    mem_khz: Option<u64>,
    /// The node-load counters opened on the targets' threads, described, or why none
    /// were; the latest full reading's time (steps wait for the next: a thread whose
    /// counts stood still is written only then), readings seen and those of multiplexed
    /// counters.
    node_counters: Option<String>,
    node_counting_refused: Option<String>,
    node_loads_latest: Option<u64>,
    node_loads_seen: u64,
    node_loads_multiplexed: u64,
    /// A CUDA sync function was probed in some target: `nccl_wait` is measured.
    sync_probed: bool,
    /// The InfiniBand ports' counter readings, every how many ms they were taken, or why
    /// there were none.
    infiniband: infiniband::Readings,
    gpu: gpu::Readings,
    /// How the GPUs were read, or why they were not: `methods.gpu`.
    gpu_read: GpuRead,
    infiniband_every_ms: Option<u64>,
    infiniband_refused: Option<String>,
    /// An NCCL call was traced at entry only (`call_returns = "needed"`): blocking inside
    /// it cannot be seen.
    entry_only_seen: bool,
    /// Ranks given to `ncclCommInitRank*`, by pid.
    init_ranks: BTreeMap<u32, i32>,
    /// The communicators' sizes: which collectives communicate.
    comms: comms::Comms,
    /// How steps are found.
    rule: StepRule,
    /// Attribute an epoch once this many events are buffered (0: all at the end).
    epoch_events: u64,
    /// Events buffered since the last epoch, and the count at which to try the next.
    buffered: u64,
    next_try: u64,
    /// Where the buffered epoch starts: everything before it is attributed (0 until the
    /// first epoch: the first starts at `first_ns`, with what came before as its context).
    cut_ns: u64,
    /// Events that came after the epoch they belong to was attributed.
    late_events: u64,
    /// What the epochs so far attributed.
    done: epoch::Attributed,
    /// Epochs are handed on as they come ([`Timeline::take_epochs`]), not kept.
    emit: bool,
    /// An epoch's steps made on two threads when it has thousands (CPUs to spare).
    parallel_steps: bool,
}

/// A traced process as the attribution knows it before its events.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Target {
    pub pid: u32,
    /// Thread ids and names at attach.
    pub threads: Vec<(u32, String)>,
    /// The rank from the environment at attach: (variable, value).
    pub env_rank: Option<(String, i32)>,
    /// The job's size from the environment at attach: (variable, value).
    pub world_size: Option<(String, i32)>,
    /// Whether its CUDA syncs are probed (where a host waits for the GPU is seen).
    pub syncs_probed: bool,
    /// Its parent process at attach.
    pub parent_pid: Option<u32>,
    /// The job its launcher started it in, as its environment names it (job id,
    /// rendezvous): only ranks of one job are matched for the straggler.
    pub job: Option<String>,
    /// The address ranges of its CUDA driver's (libcuda's) executable mappings.
    pub cuda_text: Vec<(u64, u64)>,
}

/// What the attribution is told of the run before its first event: when tracing began,
/// the host's shape, what the probes measure and what they could not, the targets. The
/// pipeline makes it from a recording's header; the attribution never reads the
/// recording.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Setup {
    /// When tracing began (CLOCK_MONOTONIC).
    pub start_ns: u64,
    /// NUMA node of each CPU, indexed by CPU number (-1: unknown).
    pub cpu_nodes: Vec<i32>,
    /// SLIT distances between NUMA nodes (`[a][b]`, 10 = local); empty: unknown.
    pub node_distances: Vec<Vec<u32>>,
    /// Kernel address ranges of the page-fault handler, to tell samples taken while
    /// handling a fault.
    pub fault_handler_ranges: Vec<(u64, u64)>,
    /// Kernel address ranges of the `sched_yield` system call.
    pub sched_yield_ranges: Vec<(u64, u64)>,
    /// On-CPU sampling period (0: no sampling).
    pub sample_period_ns: u64,
    /// Off-CPU stretches shorter than this have no stack by design.
    pub offcpu_min_ns: u64,
    pub targets: Vec<Target>,
    /// Whether page faults were timed by fentry/fexit (else by samples).
    pub faults_timed: bool,
    /// Why fentry/fexit fault timing was not used.
    pub fault_timing_refused: Option<String>,
    /// `kernel.numa_balancing` at attach (None: unreadable).
    pub numa_balancing: Option<u32>,
    /// Why NUMA hinting faults were not traced (`None`: they were).
    pub numa_hints_refused: Option<String>,
    /// Why the targets' numa_maps were read (`None`: not read, or not said).
    pub numa_maps_why: Option<String>,
    /// The PMU memory sampler opened on the targets' threads, described.
    pub mem_sampler: Option<String>,
    /// Why no memory sampler was opened (`None`: one was).
    pub mem_sampling_refused: Option<String>,
    /// The CPU's base frequency in kHz, which turns sampled latencies into time.
    pub cpu_khz: Option<u64>,
    /// The node-load counters opened on the targets' threads (no sampler), described.
    pub node_counters: Option<String>,
    /// Why none were opened (`None`: they were, or a sampler was).
    pub node_counting_refused: Option<String>,
    /// The InfiniBand ports whose counters were read (`device/port`), indexed by the
    /// readings' port.
    pub infiniband_ports: Vec<String>,
    /// Every how many milliseconds they were read.
    pub infiniband_every_ms: Option<u64>,
    /// Why they were not read.
    pub infiniband_refused: Option<String>,
    /// How the GPUs were read through NVML, or why not.
    pub gpu_read: GpuRead,
}

/// How the GPUs were read through NVML (the recording header's), or why not.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GpuRead {
    pub gpus: usize,
    pub every_ms: Option<u64>,
    pub chosen: Option<String>,
    pub refused: Option<String>,
}

impl Timeline {
    #[must_use]
    pub fn new(setup: &Setup) -> Timeline {
        let mut timeline = Timeline {
            threads: BTreeMap::new(),
            page_migrations: Vec::new(),
            numa_moves: Vec::new(),
            exited: Vec::new(),
            cpu_nodes: setup.cpu_nodes.clone(),
            fault_ranges: setup.fault_handler_ranges.clone(),
            yield_ranges: setup.sched_yield_ranges.clone(),
            cuda_text: BTreeMap::new(),
            yield_ips: std::collections::BTreeSet::new(),
            driver_yields_seen: 0,
            sample_period_ns: setup.sample_period_ns,
            offcpu_min_ns: setup.offcpu_min_ns,
            thread_names: BTreeMap::new(),
            first_ns: setup.start_ns,
            last_ns: setup.start_ns,
            caught_up: false,
            first_event_ns: None,
            stacks: Vec::new(),
            stack_ids: StackIds::default(),
            py_pending: std::collections::HashMap::default(),
            calls: Calls::default(),
            target_pids: Vec::new(),
            parents: BTreeMap::new(),
            env_ranks: BTreeMap::new(),
            faults_timed: setup.faults_timed,
            fault_pairs_seen: false,
            fault_timing_refused: setup.fault_timing_refused.clone(),
            node_distances: setup.node_distances.clone(),
            numa_balancing: setup.numa_balancing,
            numa_hints_refused: setup.numa_hints_refused.clone(),
            numa_maps_why: setup.numa_maps_why.clone(),
            numa_hints_seen: 0,
            resident_seen: 0,
            mem_sampler: setup.mem_sampler.clone(),
            mem_sampling_refused: setup.mem_sampling_refused.clone(),
            mem_khz: setup.mem_sampler.as_ref().and(setup.cpu_khz),
            node_counters: setup.node_counters.clone(),
            node_counting_refused: setup.node_counting_refused.clone(),
            node_loads_latest: None,
            node_loads_seen: 0,
            node_loads_multiplexed: 0,
            sync_probed: false,
            infiniband: infiniband::Readings::new(setup.infiniband_ports.clone()),
            gpu: gpu::Readings::default(),
            gpu_read: setup.gpu_read.clone(),
            infiniband_every_ms: setup.infiniband_every_ms,
            infiniband_refused: setup.infiniband_refused.clone(),
            entry_only_seen: false,
            init_ranks: BTreeMap::new(),
            comms: comms::Comms::default(),
            rule: StepRule::Auto,
            epoch_events: 0,
            buffered: 0,
            next_try: 0,
            cut_ns: 0,
            late_events: 0,
            done: epoch::Attributed::default(),
            emit: false,
            parallel_steps: crate::pipeline::behind::spare_cpus(),
        };
        for t in &setup.targets {
            timeline.add_target(t);
        }
        timeline
    }

    /// Finds steps by `rule` and attributes the run as it goes, an epoch of at least
    /// `epoch_events` events at a time (0: the whole run at the end).
    pub fn stream(&mut self, rule: StepRule, epoch_events: u64) {
        self.rule = rule;
        self.epoch_events = epoch_events;
        self.next_try = epoch_events;
    }

    /// Hands each epoch's steps and timeline on ([`Timeline::take_epochs`]) instead of
    /// keeping them for [`Timeline::finish`]: memory bounded by an epoch.
    pub fn emit_epochs(&mut self) {
        self.emit = true;
    }

    /// Attribution starts at `ts` (the earlier records were only counted): thread states
    /// are not known before it.
    pub fn start_at(&mut self, ts: u64) {
        self.first_ns = self.first_ns.max(ts);
        self.last_ns = self.last_ns.max(ts);
    }

    /// Every stack interned so far, by id.
    #[must_use]
    pub fn stacks(&self) -> &[StackKey] {
        &self.stacks
    }

    /// A target that joined during the run (`--follow`).
    pub fn add_target(&mut self, t: &Target) {
        self.sync_probed |= t.syncs_probed;
        if t.syncs_probed {
            self.done.matcher.syncs_probed();
        }
        self.thread_names.extend(t.threads.iter().cloned());
        self.target_pids.push(t.pid);
        // A pid the kernel gave again after its process exited: a new process.
        self.done.exits.remove(&t.pid);
        if !t.cuda_text.is_empty() {
            self.cuda_text.insert(t.pid, t.cuda_text.clone());
        }
        if let Some(parent) = t.parent_pid {
            self.parents.insert(t.pid, parent);
        }
        if let Some(r) = t.env_rank.clone() {
            self.env_ranks.insert(t.pid, r);
        }
        if let Some(size) = t.world_size.clone() {
            self.comms.world(t.pid, size);
        }
        if let Some(job) = &t.job {
            self.done.matcher.job(t.pid, job);
        }
    }

    /// The id of a stack of `task` taken at `ts`, with the Python frames recorded just
    /// before it (same thread, same time), if any.
    fn intern(&mut self, task: Task, ts: u64, kstack: &[u64], ustack: &[u64]) -> u32 {
        let py = match self.py_pending.remove(&task.tid) {
            Some((at, frames)) if at == ts => frames,
            _ => Vec::new(),
        };
        let frames = detail::Frames {
            pid: task.tgid,
            kstack,
            ustack,
            py: &py,
        };
        self.stack_ids.intern(&mut self.stacks, frames)
    }

    fn log(&mut self, tid: u32, pid: u32) -> &mut ThreadLog {
        let mem_khz = self.mem_khz;
        let distances = &self.node_distances;
        let log = self.threads.entry(tid).or_insert_with(|| ThreadLog {
            mem_khz,
            remote_gaps: remote::remote_gaps(distances),
            ..ThreadLog::default()
        });
        if pid != 0 {
            log.pid = pid;
        }
        log
    }

    fn node(&self, cpu: i32) -> i32 {
        node_of(&self.cpu_nodes, cpu)
    }

    /// Adds one event.
    pub fn push(&mut self, event: &Event) {
        let ts = event.ts_ns();
        if ts < self.cut_ns
            && matches!(
                event,
                Event::OffCpu { .. }
                    | Event::PyStack { .. }
                    | Event::StackSame {
                        of: nccltrace_common::kind::OFFCPU | nccltrace_common::kind::PY_FRAMES,
                        ..
                    }
            )
        {
            // Stacks taken as a thread came back after a long stretch off the CPU
            // (`Header::offcpu_min_ns`) are timed at its switch-out, possibly epochs ago:
            // the stretch is still open (its switch-in arrives with them) and finds them.
            self.ingest(event);
            return;
        }
        if ts < self.cut_ns {
            // Its epoch is attributed already (records of different CPUs arrive a little
            // out of order; epochs end a reorder margin before the newest record). A late
            // call-entry stack is still what the thread's next reused one stands for.
            if let Event::CallStack { task, ustack, .. } = event {
                self.log(task.tid, task.tgid)
                    .last_call
                    .get_or_insert_default()
                    .clone_from(ustack);
            }
            self.late_events += 1;
            return;
        }
        self.last_ns = self.last_ns.max(ts);
        self.first_event_ns.get_or_insert(ts);
        self.buffered += 1;
        self.ingest(event);
        if self.epoch_events > 0 && self.buffered >= self.next_try {
            self.try_epoch();
        }
    }
}

/// The NUMA node of `cpu` in a CPU → node map (-1: unknown).
#[must_use]
pub fn node_of(cpu_nodes: &[i32], cpu: i32) -> i32 {
    usize::try_from(cpu)
        .ok()
        .and_then(|c| cpu_nodes.get(c))
        .copied()
        .unwrap_or(-1)
}

/// How far past a faulting instruction a user-mode sample still counts as the fault's
/// return path (x86 store instructions and the loop step after them).
const RETRY_BYTES: u64 = 16;

/// Where a thread keeps the Python frames that a `StackSame` record with `with` (or a
/// keyed walk for that stack kind) stands for.
fn py_slot(with: u16) -> usize {
    match with {
        nccltrace_common::kind::CALL_STACK => 0,
        nccltrace_common::kind::OFFCPU => 1,
        _ => 2,
    }
}

/// What a thread does, from its name (NCCL names its threads only with
/// NCCL_SET_THREAD_NAME=1; PyTorch and CUDA name theirs).
fn role(is_rank: bool, name: &str) -> &'static str {
    if is_rank {
        return "main (rank)";
    }
    match name {
        "pt_nccl_watchdg" => "NCCL watchdog (PyTorch)",
        "pt_nccl_heartbt" => "NCCL heartbeat (PyTorch)",
        "cuda-EvtHandlr" => "CUDA event handler",
        n if n.starts_with("pt_autograd") => "autograd",
        n if n.starts_with("pt_data_worker") || n.starts_with("pt_data_pin") => "dataloader",
        n if n.contains("ncclProxy") || n.starts_with("NCCL") => "NCCL proxy",
        n if n.starts_with("cuda") => "CUDA",
        _ => "other",
    }
}

/// Sums categories over steps.
#[must_use]
pub fn total(steps: &[Step]) -> Categories {
    let mut sum = Categories::default();
    for s in steps {
        sum.add(&s.categories);
    }
    sum
}

#[cfg(test)]
mod tests;
