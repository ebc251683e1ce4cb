//! Attribute stage: per step and per thread, where the wall time went. Pure: works the
//! same on live events and on a replayed recording.
//!
//! A thread's time is cut at every event that changes its state (switch out/in, wakeup,
//! migration, entry/return of CUDA sync and NCCL calls); each piece gets one category, so
//! the categories of a step sum to its wall time. Rules (docs/attribution.md):
//! - inside a CUDA sync call while NCCL work issued since the previous sync is outstanding:
//!   `nccl_wait`, spinning on the CPU or sleeping;
//! - inside an NCCL call that blocks (sleeps) before returning (a call that blocks the host):
//!   `nccl_wait` for the whole call; other NCCL calls are enqueue work, `compute`;
//! - off-CPU and runnable (preempted, or woken and waiting for a CPU): `cpu_migration` when
//!   the thread was migrated since it left the CPU, else `runqueue`;
//! - off-CPU and blocked: `other_offcpu`, except inside a CUDA sync with no NCCL work
//!   outstanding, which waits for the GPU's own compute, and until another thread of the
//!   same process wakes it (the step's work runs there: PyTorch's autograd thread during
//!   `backward()`): `compute`;
//! - on-CPU: `compute`, of which on-CPU samples whose kernel stack is in the page-fault
//!   handler (or that sit on the instruction that just faulted, being retried), times
//!   the on-CPU time since the previous sample, are `page_fault`.

pub mod categories;
mod cut;
mod epoch;
pub mod remote;
pub use epoch::Epoch;
pub mod ranks;
pub mod steps;

pub use categories::{Cat, Categories, NAMES, Unmeasured};

use std::collections::BTreeMap;

use serde::Serialize;

use crate::event::{Call, Event, Library, PyFrame, Task};
use crate::record::Header;
use steps::{Collective, Method};

/// NCCL traffic in a step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct NcclCount {
    /// Calls that move data (collectives, send and receive); group and communicator
    /// calls are left out.
    pub collectives: u64,
    pub bytes: u64,
}

/// One step of the rank thread.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Step {
    pub index: usize,
    pub start_ns: u64,
    pub end_ns: u64,
    pub wall_ns: u64,
    /// Where the wall time went, ns per category.
    #[serde(rename = "categories_ns")]
    pub categories: Categories,
    pub nccl: NcclCount,
    pub faults: u64,
    pub migrations: u64,
    pub cross_node_migrations: u64,
    pub numa_page_migrations: u64,
    pub numa_task_moves: u64,
    /// The remote share of the rank thread's sampled memory accesses (NUMA hinting
    /// faults) that `remote_memory` is estimated from; `None` before its first such fault
    /// or when they were not traced.
    pub remote_access: Option<remote::RemoteAccess>,
    /// Where the PMU sampled loads (`methods.remote_memory_estimated` false): the rank
    /// thread's sampled DRAM loads in the step and those a remote node served.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub remote_loads: Option<crate::pmu::MeasuredStep>,
    /// With several ranks: the rank whose late arrivals made the others wait most in this
    /// step.
    pub slowest_rank: Option<i32>,
    /// With several ranks: each rank's training-loop thread over this step's interval.
    pub ranks: Vec<StepRank>,
}

/// One rank's categories in a step.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct StepRank {
    pub rank: i32,
    pub pid: u32,
    #[serde(rename = "categories_ns")]
    pub categories: Categories,
}

/// A thread's totals over the traced interval.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ThreadReport {
    pub tid: u32,
    pub pid: u32,
    pub name: String,
    pub role: &'static str,
    #[serde(rename = "categories_ns")]
    pub categories: Categories,
    pub nccl_calls: u64,
    pub faults: u64,
    pub migrations: u64,
    pub cross_node_migrations: u64,
}

/// How `nccl_wait`, `remote_memory` and `page_fault` were obtained, or why not.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Methods {
    pub nccl_wait: String,
    pub page_fault: String,
    pub remote_memory: String,
    pub remote_memory_estimated: bool,
}

/// `steps.json`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StepsReport {
    /// The clock of every `*_ns` timestamp (not durations) in this file.
    pub clock: &'static str,
    /// Steps found that began before tracing was armed, left out of `steps` and of every
    /// statistic (their beginning was not traced).
    pub partial_steps_left_out: usize,
    /// Epochs the run was attributed in, as it went (1: the whole run at once).
    pub epochs: u64,
    /// Records that came after the epoch holding them was attributed: counted in the
    /// totals, left out of steps and categories.
    pub late_events_left_out: u64,
    pub method: Method,
    pub reason: String,
    /// Collectives per step, when found automatically.
    pub period: Option<usize>,
    pub rank_pid: Option<u32>,
    pub rank_tid: Option<u32>,
    pub methods: Methods,
    pub steps: Vec<Step>,
    pub threads: Vec<ThreadReport>,
    /// Where the rank thread was blocked for `other_offcpu`, heaviest first (filled once
    /// stacks are symbolized).
    pub other_offcpu_top_stacks: Vec<BlockingStack>,
    /// Where the rank thread waited for NCCL and the GPU (`nccl_wait`), heaviest first:
    /// with Python frames, the line that waited.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub nccl_wait_top_stacks: Vec<BlockingStack>,
    /// Every traced rank (one per target process).
    pub ranks: Vec<ranks::RankReport>,
    pub straggler: Option<ranks::Straggler>,
}

/// A stack the rank thread blocked in, with the time it accounts for in its steps.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct BlockingStack {
    /// Frames root first, `;`-separated, as in the `.folded` files.
    pub stack: String,
    pub total_ns: u64,
}

/// How steps are to be found.
#[derive(Clone, Debug, PartialEq, Default)]
pub enum StepRule {
    #[default]
    Auto,
    Window(u64),
    /// `--step-nvtx REGEX`: a step starts at each NVTX range push whose name matches.
    Nvtx(NvtxPattern),
}

/// A `--step-nvtx` regular expression, compiled.
#[derive(Clone, Debug)]
pub struct NvtxPattern(pub regex_lite::Regex);

impl PartialEq for NvtxPattern {
    fn eq(&self, other: &Self) -> bool {
        self.0.as_str() == other.0.as_str()
    }
}

impl NvtxPattern {
    /// Compiles `pattern`; the error says what is wrong with it.
    pub fn new(pattern: &str) -> Result<Self, String> {
        regex_lite::Regex::new(pattern)
            .map(NvtxPattern)
            .map_err(|e| e.to_string())
    }
}

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

#[derive(Default)]
struct ThreadLog {
    pid: u32,
    changes: Vec<(u64, Change)>,
    /// Sync calls (start, end), for the NCCL-outstanding test.
    syncs: Vec<(u64, u64)>,
    collectives: Vec<Collective>,
    /// Samples in a page fault: (time, the previous sample's time).
    fault_samples: Vec<(u64, Option<u64>)>,
    /// The same, with the on-CPU time each stands for (computed at `finish`).
    fault_time: Vec<(u64, u64)>,
    /// The previous sample's time.
    last_sample: Option<u64>,
    faults: Vec<u64>,
    migrations: Vec<(u64, bool)>,
    first_switch_is_in: Option<bool>,
    /// The thread's latest page fault: (time, faulting user instruction).
    last_fault: Option<(u64, u64)>,
    /// The end of the thread's last fault timed by fentry/fexit.
    last_fault_end: u64,
    /// NUMA hinting faults, by time.
    numa_hints: Vec<remote::Hint>,
    /// Loads sampled by the PMU, by time.
    mem_samples: Vec<crate::pmu::MemSample>,
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
    tail: Tail,
    /// Blocked at an earlier cut with no wakeup yet: (switch-out time, ns charged to
    /// `other_offcpu` since), moved to `compute` if another thread of the process ends it.
    pending_block: Option<(u64, u64)>,
}

impl ThreadLog {
    /// The remote share `[a, b)` of this thread is estimated from: its hinting faults,
    /// else the latest reading of its process's resident pages.
    fn remote_access(&self, a: u64, b: u64) -> Option<remote::RemoteAccess> {
        remote::estimate(&self.numa_hints, a, b)
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

/// A stack as captured: the process (for its maps), kernel and user frames, innermost
/// first, and the Python frames the thread was executing (innermost first; empty for a
/// thread that runs no Python or with Python frames off).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct StackKey {
    pub pid: u32,
    pub kstack: Vec<u64>,
    pub ustack: Vec<u64>,
    pub py: Vec<PyFrame>,
}

/// A stretch a thread spent off-CPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OffCpu {
    pub start_ns: u64,
    pub end_ns: u64,
    /// Preempted (still runnable) rather than blocked.
    pub runnable: bool,
    pub stack: Option<u32>,
    /// Who woke it: (tid, tgid).
    pub waker: Option<(u32, u32)>,
    /// When it was woken (runnable from then on).
    pub woken_ns: Option<u64>,
}

/// One thread's timeline, for the flamegraphs and the Perfetto trace.
#[derive(Clone, Debug)]
pub struct ThreadDetail {
    pub tid: u32,
    pub pid: u32,
    pub name: String,
    pub role: &'static str,
    /// (start, end, category) pieces over the traced interval.
    pub segments: Vec<(u64, u64, Cat)>,
    /// On-CPU samples: (time, stack id, category, on-CPU time it stands for).
    pub samples: Vec<(u64, u32, Cat, u64)>,
    pub offcpu: Vec<OffCpu>,
    pub migrations: Vec<(u64, i32, i32)>,
    pub faults: Vec<u64>,
    /// User stacks at the entry of traced calls: (time, stack id), by time.
    pub call_stacks: Vec<(u64, u32)>,
    /// The off-CPU stretch still open at the end of this part of the run (its end is
    /// that end).
    pub open: Option<OffCpu>,
}

impl ThreadDetail {
    /// The category at `ts`.
    #[must_use]
    pub fn category_at(&self, ts: u64) -> Option<Cat> {
        let i = self.segments.partition_point(|(_, e, _)| *e <= ts);
        self.segments
            .get(i)
            .filter(|(s, _, _)| *s <= ts)
            .map(|(_, _, c)| *c)
    }
}

/// Everything the flamegraph and trace renderers need.
#[derive(Clone, Debug, Default)]
pub struct Detail {
    pub first_ns: u64,
    pub end_ns: u64,
    pub threads: Vec<ThreadDetail>,
    pub stacks: Vec<StackKey>,
    pub calls: Vec<Call>,
    pub cpu_nodes: Vec<i32>,
    pub sample_period_ns: u64,
    /// Off-CPU stretches shorter than this have no stack by design (0: any may have one).
    pub offcpu_min_ns: u64,
    /// The steps' `[start, end)`, for graphs of step time.
    pub step_bounds: Vec<(u64, u64)>,
    /// The rank thread whose steps these are, and its process.
    pub rank_tid: Option<u32>,
    pub rank_pid: Option<u32>,
}

/// Stack ids by the stack's hash: each stack is kept once, in the table the ids index (a
/// map keyed by the stack itself held every stack twice: ~4,000 distinct stacks of up to
/// 96 frames in a 4-minute soak). A stack whose hash another already has is found in
/// `collisions`.
#[derive(Debug, Default)]
struct StackIds<S = std::collections::hash_map::RandomState> {
    by_hash: std::collections::HashMap<u64, u32>,
    collisions: std::collections::HashMap<StackKey, u32>,
    hasher: S,
}

impl<S: std::hash::BuildHasher> StackIds<S> {
    /// `key`'s id in `table`, where it is added when new.
    fn intern(&mut self, table: &mut Vec<StackKey>, key: StackKey) -> u32 {
        use std::collections::hash_map::Entry;
        let id = table.len() as u32;
        match self.by_hash.entry(self.hasher.hash_one(&key)) {
            Entry::Vacant(v) => {
                v.insert(id);
            }
            Entry::Occupied(o) if table[*o.get() as usize] == key => return *o.get(),
            Entry::Occupied(_) => {
                if let Some(id) = self.collisions.get(&key) {
                    return *id;
                }
                self.collisions.insert(key.clone(), id);
            }
        }
        table.push(key);
        id
    }
}

/// Collects what attribution needs, event by event.
#[allow(clippy::struct_excessive_bools)] // independent facts about the run
pub struct Timeline {
    threads: BTreeMap<u32, ThreadLog>,
    page_migrations: Vec<(u32, u64, u64)>,
    numa_moves: Vec<(u32, u64)>,
    cpu_nodes: Vec<i32>,
    fault_ranges: Vec<(u64, u64)>,
    sample_period_ns: u64,
    offcpu_min_ns: u64,
    thread_names: BTreeMap<u32, String>,
    first_ns: u64,
    last_ns: u64,
    stacks: Vec<StackKey>,
    stack_ids: StackIds,
    /// Python frames waiting for the stack record they belong to: tid → (time, frames).
    py_pending: std::collections::HashMap<u32, (u64, Vec<PyFrame>)>,
    calls: Vec<Call>,
    target_pids: Vec<u32>,
    env_ranks: BTreeMap<u32, (String, i32)>,
    /// Faults were timed by fentry/fexit on the fault handler (FaultTime events): their
    /// pieces are `page_fault` directly and samples do not estimate it.
    faults_timed: bool,
    /// Why fentry/fexit did not time them.
    fault_timing_refused: Option<String>,
    /// SLIT distances between nodes.
    node_distances: Vec<Vec<u32>>,
    /// `kernel.numa_balancing` at attach.
    numa_balancing: Option<u32>,
    /// Why hinting faults were not traced.
    numa_hints_refused: Option<String>,
    /// Hinting faults of target threads seen.
    numa_hints_seen: u64,
    /// Readings of the targets' resident pages per node seen.
    resident_seen: u64,
    /// The PMU memory sampler of the run, described, or why there was none; the CPU's
    /// frequency where both a sampler and it are known (measured `remote_memory`).
    mem_sampler: Option<String>,
    mem_sampling_refused: Option<String>,
    mem_khz: Option<u64>,
    /// A CUDA sync function was probed in some target: `nccl_wait` is measured.
    sync_probed: bool,
    /// An NCCL call was traced at entry only (`call_returns = "needed"`): blocking inside
    /// it cannot be seen.
    entry_only_seen: bool,
    /// Ranks given to `ncclCommInitRank*`, by pid.
    init_ranks: BTreeMap<u32, i32>,
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
}

/// Whether `t` had a CUDA sync function probed.
fn syncs_probed(t: &crate::record::TargetInfo) -> bool {
    t.probes.iter().any(|p| {
        crate::event::Func::from_name(&p.func).is_some_and(|f| f.library() == Library::Cuda)
    })
}

impl Timeline {
    #[must_use]
    pub fn new(header: &Header) -> Timeline {
        Timeline {
            threads: BTreeMap::new(),
            page_migrations: Vec::new(),
            numa_moves: Vec::new(),
            cpu_nodes: header.cpu_nodes.clone(),
            fault_ranges: header.fault_handler_ranges.clone(),
            sample_period_ns: header.sample_period_ns,
            offcpu_min_ns: header.offcpu_min_ns,
            thread_names: header
                .targets
                .iter()
                .flat_map(|t| t.threads.iter().cloned())
                .collect(),
            first_ns: header.clock.monotonic_ns,
            last_ns: header.clock.monotonic_ns,
            stacks: Vec::new(),
            stack_ids: StackIds::default(),
            py_pending: std::collections::HashMap::new(),
            calls: Vec::new(),
            target_pids: header.targets.iter().map(|t| t.pid).collect(),
            env_ranks: header
                .targets
                .iter()
                .filter_map(|t| t.env_rank.clone().map(|r| (t.pid, r)))
                .collect(),
            faults_timed: header.fault_timing.is_some(),
            fault_timing_refused: header.fault_timing_refused.clone(),
            node_distances: header.node_distances.clone(),
            numa_balancing: header.numa_balancing,
            numa_hints_refused: header.numa_hints_refused.clone(),
            numa_hints_seen: 0,
            resident_seen: 0,
            mem_sampler: header.mem_sampler.clone(),
            mem_sampling_refused: header.mem_sampling_refused.clone(),
            mem_khz: header.mem_sampler.as_ref().and(header.cpu_khz),
            sync_probed: header.targets.iter().any(syncs_probed),
            entry_only_seen: false,
            init_ranks: BTreeMap::new(),
            rule: StepRule::Auto,
            epoch_events: 0,
            buffered: 0,
            next_try: 0,
            cut_ns: 0,
            late_events: 0,
            done: epoch::Attributed::default(),
            emit: false,
        }
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
    pub fn add_target(&mut self, t: &crate::record::TargetInfo) {
        self.sync_probed |= syncs_probed(t);
        self.thread_names.extend(t.threads.iter().cloned());
        self.target_pids.push(t.pid);
        if let Some(r) = t.env_rank.clone() {
            self.env_ranks.insert(t.pid, r);
        }
    }

    /// The id of a stack of `task` taken at `ts`, with the Python frames recorded just
    /// before it (same thread, same time), if any.
    fn intern(&mut self, task: Task, ts: u64, kstack: &[u64], ustack: &[u64]) -> u32 {
        let py = match self.py_pending.remove(&task.tid) {
            Some((at, frames)) if at == ts => frames,
            _ => Vec::new(),
        };
        let key = StackKey {
            pid: task.tgid,
            kstack: kstack.to_vec(),
            ustack: ustack.to_vec(),
            py,
        };
        self.stack_ids.intern(&mut self.stacks, key)
    }

    fn log(&mut self, tid: u32, pid: u32) -> &mut ThreadLog {
        let mem_khz = self.mem_khz;
        let log = self.threads.entry(tid).or_insert_with(|| ThreadLog {
            mem_khz,
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

    fn call(&mut self, c: &Call) {
        if matches!(
            c.func,
            crate::event::Func::CommInitRank | crate::event::Func::CommInitRankConfig
        ) && let Some(r) = c.rank
        {
            self.init_ranks.insert(c.task.tgid, r);
        }
        // A call is recorded at its return: one that began before the epoch it returned
        // in counts from that epoch's start (the earlier part is attributed already).
        let start_ns = c.start_ns.max(self.cut_ns);
        self.entry_only_seen |= !c.returned() && c.func.library() == Library::Nccl;
        self.calls.push(c.clone());
        let log = self.log(c.task.tid, c.task.tgid);
        match c.func.library() {
            Library::Marker => log.markers.push(c.start_ns),
            Library::Nvtx => log
                .nvtx
                .push((c.start_ns, c.message.clone().unwrap_or_default())),
            Library::Cuda => {
                log.changes.push((start_ns, Change::SyncStart));
                log.changes.push((c.end_ns, Change::SyncEnd));
                log.syncs.push((start_ns, c.end_ns));
                log.total_syncs += 1;
            }
            Library::Nccl => {
                // Traced at entry only: counted, but its inside is not known.
                if c.returned() {
                    log.changes.push((start_ns, Change::NcclStart));
                    log.changes.push((c.end_ns, Change::NcclEnd));
                }
                if c.func.is_collective() {
                    log.total_collectives += 1;
                    log.collectives.push(Collective {
                        func: c.func,
                        bytes: c.bytes.unwrap_or(0),
                        start_ns: c.start_ns,
                        end_ns: c.end_ns,
                        comm: c.comm.unwrap_or(0),
                    });
                }
            }
        }
    }

    /// Adds one event.
    pub fn push(&mut self, event: &Event) {
        let ts = event.ts_ns();
        if ts < self.cut_ns && matches!(event, Event::OffCpu { .. } | Event::PyStack { .. }) {
            // Stacks taken as a thread came back after a long stretch off the CPU
            // (`Header::offcpu_min_ns`) are timed at its switch-out, possibly epochs ago:
            // the stretch is still open (its switch-in arrives with them) and finds them.
            self.ingest(event);
            return;
        }
        if ts < self.cut_ns {
            // Its epoch is attributed already (records of different CPUs arrive a little
            // out of order; epochs end a reorder margin before the newest record).
            self.late_events += 1;
            return;
        }
        self.last_ns = self.last_ns.max(ts);
        self.buffered += 1;
        self.ingest(event);
        if self.epoch_events > 0 && self.buffered >= self.next_try {
            self.try_epoch();
        }
    }

    #[allow(clippy::too_many_lines)] // one arm per event kind
    fn ingest(&mut self, event: &Event) {
        match event {
            Event::Call(c) => self.call(c),
            Event::Switch {
                ts_ns,
                prev_tid,
                next_tid,
                next_tgid,
                prev_state,
                prev_is_target,
                next_is_target,
                task,
            } => {
                if *prev_is_target {
                    let log = self.log(*prev_tid, task.tgid);
                    log.first_switch_is_in.get_or_insert(false);
                    log.changes.push((
                        *ts_ns,
                        Change::SwitchOut {
                            runnable: *prev_state == 0,
                        },
                    ));
                }
                if *next_is_target {
                    let node = self.node(i32::from(task.cpu));
                    let log = self.log(*next_tid, *next_tgid);
                    log.first_switch_is_in.get_or_insert(true);
                    log.changes.push((*ts_ns, Change::SwitchIn));
                    if log.nodes.last().is_none_or(|(_, n)| *n != node) {
                        log.nodes.push((*ts_ns, node));
                    }
                }
            }
            Event::Wakeup {
                ts_ns,
                task,
                waker_tgid,
                waker_tid,
                ..
            } => {
                let own = *waker_tgid == task.tgid && *waker_tid != task.tid;
                let log = self.log(task.tid, task.tgid);
                log.changes.push((*ts_ns, Change::Wakeup { own }));
                log.wakeups.push((*ts_ns, *waker_tid, *waker_tgid));
            }
            Event::OffCpu {
                ts_ns,
                task,
                kstack,
                ustack,
            } => {
                let id = self.intern(*task, *ts_ns, kstack, ustack);
                self.log(task.tid, task.tgid)
                    .offcpu_stacks
                    .push((*ts_ns, id));
            }
            Event::Migrate {
                ts_ns,
                task,
                orig_cpu,
                dest_cpu,
            } => {
                let cross = self.node(*orig_cpu) != self.node(*dest_cpu);
                let log = self.log(task.tid, task.tgid);
                log.changes.push((*ts_ns, Change::Migrate));
                log.migrations.push((*ts_ns, cross));
                log.migration_cpus.push((*ts_ns, *orig_cpu, *dest_cpu));
            }
            Event::Fault {
                ts_ns, task, ip, ..
            } => {
                let log = self.log(task.tid, task.tgid);
                log.faults.push(*ts_ns);
                log.last_fault = Some((*ts_ns, *ip));
            }
            Event::PyStack {
                ts_ns,
                task,
                frames,
                ..
            } => {
                self.py_pending.insert(task.tid, (*ts_ns, frames.clone()));
            }
            Event::CallStack {
                ts_ns,
                task,
                ustack,
            } => {
                let id = self.intern(*task, *ts_ns, &[], ustack);
                self.log(task.tid, task.tgid).call_stacks.push((*ts_ns, id));
            }
            Event::FaultTime {
                ts_ns,
                task,
                start_ns,
                ..
            } => {
                self.faults_timed = true;
                let cut_ns = self.cut_ns;
                let log = self.log(task.tid, task.tgid);
                // From the exception's entry (the page_fault_user tracepoint, just before
                // it) rather than the handler's: the entry path is the fault's cost too,
                // ~30% of it in an emulated guest.
                let entered = log
                    .last_fault
                    .map(|(at, _)| at)
                    .filter(|at| *at <= *start_ns && *at >= log.last_fault_end);
                log.last_fault_end = *ts_ns;
                let start = entered.unwrap_or(*start_ns).max(cut_ns);
                log.changes.push((start, Change::FaultStart));
                log.changes.push((*ts_ns, Change::FaultEnd));
            }
            Event::Sample {
                ts_ns,
                task,
                kstack,
                ustack,
            } => {
                let in_handler = kstack
                    .iter()
                    .any(|ip| self.fault_ranges.iter().any(|(a, b)| (*a..*b).contains(ip)));
                let period = self.sample_period_ns;
                let window = 2 * period.max(1);
                let stack = self.intern(*task, *ts_ns, kstack, ustack);
                let log = self.log(task.tid, task.tgid);
                // In user mode on the instruction that just faulted, or right after it:
                // the return from the fault (a pending timer interrupt is delivered
                // there) and the retried access with its TLB refill are the fault's cost.
                let retrying = kstack.is_empty()
                    && log.last_fault.is_some_and(|(at, ip)| {
                        ustack
                            .first()
                            .is_some_and(|u| (ip..ip + RETRY_BYTES).contains(u))
                            && ts_ns.saturating_sub(at) < window
                    });
                let in_fault = in_handler || retrying;
                if in_fault {
                    log.fault_samples.push((*ts_ns, log.last_sample));
                }
                log.stack_samples.push((*ts_ns, stack, in_fault));
                log.last_sample = Some(*ts_ns);
            }
            Event::PageMigration {
                ts_ns,
                task,
                succeeded,
                ..
            } => {
                self.page_migrations.push((task.tid, *ts_ns, *succeeded));
            }
            Event::NumaTask { ts_ns, task, .. } => self.numa_moves.push((task.tid, *ts_ns)),
            Event::NumaHint {
                ts_ns,
                task,
                cpu,
                mem_node,
                pages,
                local,
                ..
            } => {
                let hint = remote::Hint::new(
                    *ts_ns,
                    *pages,
                    *local,
                    *cpu,
                    *mem_node,
                    &self.cpu_nodes,
                    &self.node_distances,
                );
                self.numa_hints_seen += 1;
                self.log(task.tid, task.tgid).numa_hints.push(hint);
            }
            Event::NumaPages { ts_ns, task, kib } => {
                self.resident_seen += 1;
                let distances = &self.node_distances;
                for log in self.threads.values_mut().filter(|l| l.pid == task.tgid) {
                    let Some(&(_, node)) = log.nodes.last() else {
                        continue;
                    };
                    if let Some(r) = remote::Resident::new(*ts_ns, kib, node, distances) {
                        log.resident.push(r);
                    }
                }
            }
            Event::MemSample {
                ts_ns,
                task,
                weight,
                data_src,
            } => {
                let sample = crate::pmu::MemSample {
                    pid: task.tgid,
                    tid: task.tid,
                    time_ns: *ts_ns,
                    weight: *weight,
                    data_src: *data_src,
                };
                self.log(task.tid, task.tgid).mem_samples.push(sample);
            }
            Event::Fork { .. } | Event::Exit { .. } => {}
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
mod tests {
    use super::*;

    /// Stacks are interned once each; stacks whose hashes collide (a hasher that hashes
    /// everything alike) still get ids of their own, and the same ids again.
    #[test]
    fn stacks_interned_once_even_when_hashes_collide() {
        #[derive(Default)]
        struct Alike;
        impl std::hash::BuildHasher for Alike {
            type Hasher = Alike;
            fn build_hasher(&self) -> Alike {
                Alike
            }
        }
        impl std::hash::Hasher for Alike {
            fn finish(&self) -> u64 {
                7
            }
            fn write(&mut self, _: &[u8]) {}
        }
        let key = |pid, ip| StackKey {
            pid,
            kstack: vec![ip],
            ustack: vec![ip + 1],
            py: Vec::new(),
        };
        let mut ids = StackIds::<Alike>::default();
        let mut table = Vec::new();
        let keys = [
            key(1, 10),
            key(1, 20),
            key(2, 10),
            key(1, 20),
            key(1, 10),
            key(2, 10),
        ];
        let got: Vec<u32> = keys
            .into_iter()
            .map(|k| ids.intern(&mut table, k))
            .collect();
        assert_eq!(got, [0, 1, 2, 1, 0, 2]);
        assert_eq!(table, [key(1, 10), key(1, 20), key(2, 10)]);
        let mut ids = StackIds::<std::collections::hash_map::RandomState>::default();
        let mut table = Vec::new();
        assert_eq!(ids.intern(&mut table, key(1, 10)), 0);
        assert_eq!(ids.intern(&mut table, key(1, 10)), 0);
        assert!(ids.collisions.is_empty());
    }
    use crate::event::Func;
    use crate::record::{ClockRef, Header};

    fn header() -> Header {
        Header {
            clock: ClockRef {
                monotonic_ns: 0,
                realtime_ns: 0,
            },
            cpu_nodes: vec![0, 0, 1, 1],
            sample_period_ns: 100_000,
            fault_handler_ranges: vec![(0xffff_0000, 0xffff_1000)],
            targets: vec![crate::record::TargetInfo {
                pid: 10,
                probes: vec![crate::record::ProbeInfo {
                    func: "cuStreamSynchronize".into(),
                    symbol: "cuStreamSynchronize".into(),
                    library: "libcuda.so.1".into(),
                    file_offset: 0,
                    past_endbr64: false,
                }],
                ..Default::default()
            }],
            ..Header::default()
        }
    }

    /// Regression (issue 18): each step scanned every page migration and NUMA move of the
    /// run; now they are sorted once and each step takes its own stretch. Events pushed
    /// out of time order, of the rank thread and another, land in the right steps.
    #[test]
    fn numa_events_counted_per_step() {
        let mut tl = Timeline::new(&header());
        tl.push(&call(Func::AllReduce, 100, 200));
        let migration = |ts_ns, tid| Event::PageMigration {
            ts_ns,
            task: task(tid),
            succeeded: 4,
            failed: 0,
            mode: 0,
            reason: 0,
        };
        let moved = |ts_ns, tid| Event::NumaTask {
            ts_ns,
            task: task(tid),
            kind: crate::event::NumaTaskKind::Move,
            src_cpu: 0,
            src_nid: 0,
            dst_cpu: 2,
            dst_nid: 1,
        };
        for e in [
            migration(15_000, 10),
            migration(5_000, 10),
            migration(6_000, 11),
            moved(12_000, 10),
            moved(3_000, 10),
            moved(4_000, 10),
        ] {
            tl.push(&e);
        }
        let (report, _) = tl.finish(20_000, StepRule::Window(10_000));
        let counts: Vec<(u64, u64)> = report
            .steps
            .iter()
            .map(|s| (s.numa_page_migrations, s.numa_task_moves))
            .collect();
        assert_eq!(counts, [(4, 2), (4, 1)]);
    }

    /// Where the PMU sampled loads, `remote_memory` is measured from the rank thread's
    /// remote-DRAM samples (latency × period at the CPU's frequency), carved out of
    /// compute, and labelled measured; samples pushed out of time order land in their step.
    #[test]
    fn remote_memory_measured_from_pmu_samples() {
        use nccltrace_common::kind;
        let mut h = header();
        h.mem_sampler = Some("Intel PEBS load latency (cpu/mem-loads, ldlat=30)".into());
        h.mem_sampling_refused = None;
        h.cpu_khz = Some(2_000_000);
        let mut tl = Timeline::new(&h);
        tl.push(&call(Func::AllReduce, 100, 200));
        // perf_mem_data_src: a load served by DRAM, remote or local (level number + bit).
        let dram = |remote: u64| 2 | (13 << 33) | (remote << 37);
        let sample = |ts_ns, remote, weight| Event::MemSample {
            ts_ns,
            task: task(10),
            weight,
            data_src: dram(remote),
        };
        for e in [
            sample(13_000_000, 0, 300),
            sample(3_000_000, 1, 100),
            sample(2_000_000, 1, 100),
            sample(4_000_000, 1, 100),
            sample(12_000_000, 0, 300),
        ] {
            tl.push(&e);
        }
        let (report, _) = tl.finish(20_000_000, StepRule::Window(10_000_000));
        assert_eq!(report.steps.len(), 2);
        let (far, near) = (&report.steps[0], &report.steps[1]);
        // 3 samples × 100 cycles × 20,000 loads each at 2 GHz: 3 ms.
        assert_eq!(far.categories.remote_memory, Some(3_000_000));
        assert_eq!(far.categories.compute + 3_000_000, far.wall_ns);
        let loads = far.remote_loads.unwrap();
        assert_eq!((loads.dram_samples, loads.remote_samples), (3, 3));
        // Local DRAM only: measured as none, not unknown.
        assert_eq!(near.categories.remote_memory, Some(0));
        assert_eq!(near.remote_loads.unwrap().share(), Some(0.0));
        assert!(!report.methods.remote_memory_estimated);
        assert!(
            report
                .methods
                .remote_memory
                .starts_with("measured by Intel PEBS"),
            "{}",
            report.methods.remote_memory
        );
        assert_eq!(Event::kind_name(kind::MEM_SAMPLE), "mem_sample");
        // No sampler: not measured, and the reason the host gave.
        let mut h = header();
        h.mem_sampling_refused = Some("no PMU memory sampling: only software".into());
        let mut tl = Timeline::new(&h);
        tl.push(&call(Func::AllReduce, 100, 200));
        tl.push(&sample(3_000_000, 1, 500));
        let (report, _) = tl.finish(20_000_000, StepRule::Window(10_000_000));
        assert_eq!(report.steps[0].categories.remote_memory, None);
        assert!(report.steps[0].remote_loads.is_none());
        assert!(
            report
                .methods
                .remote_memory
                .contains("no PMU memory sampling: only software"),
            "{}",
            report.methods.remote_memory
        );
    }

    /// With NUMA balancing off, the share comes from where the process's memory is
    /// (numa_maps readings) seen from the node the rank thread runs on, the latest reading
    /// before each step's end; labelled an estimate with that method.
    #[test]
    fn remote_memory_estimated_from_resident_pages() {
        let mut h = header();
        h.node_distances = vec![vec![10, 20], vec![20, 10]];
        h.numa_balancing = Some(0);
        let mut tl = Timeline::new(&h);
        // The rank thread runs on CPU 0 (node 0) from the start.
        tl.push(&switch(50, false, 0));
        tl.push(&call(Func::AllReduce, 100, 200));
        let pages = |ts_ns, kib: Vec<u64>| Event::NumaPages {
            ts_ns,
            task: task(10),
            kib,
        };
        // Three quarters on node 1, then all moved to node 0.
        tl.push(&pages(1_000_000, vec![1 << 20, 3 << 20]));
        tl.push(&pages(12_000_000, vec![4 << 20, 0]));
        let (report, _) = tl.finish(20_000_000, StepRule::Window(10_000_000));
        assert_eq!(report.steps.len(), 2);
        let (far, near) = (&report.steps[0], &report.steps[1]);
        let share = far.remote_access.unwrap().share();
        assert!((share - 0.75).abs() < 1e-9, "{share}");
        // Three quarters remote at SLIT 10/20: 37.5% of the on-CPU time.
        let c = &far.categories;
        let remote = c.remote_memory.unwrap();
        assert_eq!(remote, (c.compute + remote) * 375 / 1000);
        assert_eq!(near.remote_access.unwrap().remote_pages, 0);
        assert_eq!(near.categories.remote_memory, Some(0));
        assert!(report.methods.remote_memory_estimated);
        assert!(
            report
                .methods
                .remote_memory
                .starts_with("estimated from the target's resident pages"),
            "{}",
            report.methods.remote_memory
        );
    }

    /// Regression (issue 18): summing categories dropped `remote_memory`.
    #[test]
    fn sums_keep_remote_memory() {
        let mut sum = Categories::default();
        for remote in [Some(5), None, Some(7)] {
            sum.add(&Categories {
                remote_memory: remote,
                ..Categories::default()
            });
        }
        assert_eq!(sum.remote_memory, Some(12));
    }

    /// Regression (issue 17): `--profile minimal` (no CUDA sync probe) showed nccl_wait
    /// 0.000 and `--sample-hz 0` page_fault 0. A category the run could not measure is
    /// null in every output, with the reason in `methods`; the categories measured still
    /// add up.
    #[test]
    fn unmeasured_categories_are_null() {
        let mut bare = header();
        bare.targets[0].probes.clear();
        bare.sample_period_ns = 0;
        let mut tl = Timeline::new(&bare);
        tl.push(&call(Func::AllReduce, 3_000, 3_100));
        let (report, _) = tl.finish(10_000, StepRule::Window(10_000));
        let json = serde_json::to_value(&report).unwrap();
        for c in [
            &json["steps"][0]["categories_ns"],
            &json["threads"][0]["categories_ns"],
        ] {
            assert!(c["nccl_wait"].is_null(), "{c}");
            assert!(c["page_fault"].is_null(), "{c}");
            assert_eq!(c["compute"], 10_000, "{c}");
        }
        assert!(report.methods.nccl_wait.starts_with("not measured"));
        assert!(report.methods.page_fault.starts_with("not measured"));
        // Regression (issue 18): sampling on but no fault handler addresses (no kallsyms):
        // fault time was silently 0 while the method said "samples".
        let mut no_kallsyms = header();
        no_kallsyms.fault_handler_ranges.clear();
        let mut tl = Timeline::new(&no_kallsyms);
        tl.push(&call(Func::AllReduce, 3_000, 3_100));
        let (report, _) = tl.finish(10_000, StepRule::Window(10_000));
        let json = serde_json::to_value(&report).unwrap();
        assert!(json["threads"][0]["categories_ns"]["page_fault"].is_null());
        assert!(
            report.methods.page_fault.contains("kallsyms"),
            "{}",
            report.methods.page_fault
        );
        // Measured (the sync probed, sampling on): numbers, not null.
        let mut tl = Timeline::new(&header());
        tl.push(&call(Func::AllReduce, 3_000, 3_100));
        let (report, _) = tl.finish(10_000, StepRule::Window(10_000));
        let json = serde_json::to_value(&report).unwrap();
        assert_eq!(json["threads"][0]["categories_ns"]["nccl_wait"], 0);
        assert_eq!(json["threads"][0]["categories_ns"]["page_fault"], 0);
    }

    fn task(tid: u32) -> Task {
        Task {
            tgid: 10,
            tid,
            cpu: 0,
        }
    }

    fn call(func: Func, start: u64, end: u64) -> Event {
        Event::Call(Call {
            count: Some(256),
            datatype: Some(7),
            bytes: Some(1024),
            comm: Some(1),
            stream: Some(2),
            ..Call::new(task(10), func, start, end)
        })
    }

    fn switch(ts: u64, out: bool, state: i64) -> Event {
        Event::Switch {
            ts_ns: ts,
            task: task(10),
            prev_tid: if out { 10 } else { 99 },
            next_tid: if out { 99 } else { 10 },
            next_tgid: if out { 0 } else { 10 },
            prev_state: state,
            prev_is_target: out,
            next_is_target: !out,
        }
    }

    /// Off-CPU stacks taken as the thread comes back are timed at its switch-out
    /// (`Header::offcpu_min_ns`): here 39 ms earlier, epochs ago. The stretch still gets
    /// its stack; late records of any other kind stay left out and counted.
    #[test]
    fn stack_taken_at_the_switch_in_finds_its_stretch_across_epochs() {
        let mut tl = Timeline::new(&header());
        tl.stream(StepRule::Window(1_000_000), 8);
        let other = Task {
            tgid: 10,
            tid: 11,
            cpu: 1,
        };
        let mut events = vec![switch(1_000_000, true, 1)];
        for ms in 0..60u64 {
            let t = ms * 1_000_000 + 500_000;
            events.push(Event::Call(Call::new(other, Func::AllReduce, t, t + 1_000)));
        }
        events.sort_by_key(Event::ts_ns);
        let back = events.partition_point(|e| e.ts_ns() < 40_000_000);
        events.insert(back, switch(40_000_000, false, 0));
        // What the kernel submits just after the switch-in: the stacks, timed at the
        // switch-out.
        events.insert(
            back + 1,
            Event::OffCpu {
                ts_ns: 1_000_000,
                task: task(10),
                kstack: vec![0xffff_2000],
                ustack: vec![7],
            },
        );
        // A late record of another kind is still left out.
        events.insert(
            back + 2,
            Event::Wakeup {
                ts_ns: 2_000_000,
                task: task(10),
                waker_tid: 11,
                waker_tgid: 10,
                target_cpu: 0,
            },
        );
        for e in &events {
            tl.push(e);
        }
        let (report, detail) = tl.finish(61_000_000, StepRule::Window(1_000_000));
        assert_eq!(report.late_events_left_out, 1);
        let thread = detail.threads.iter().find(|t| t.tid == 10).unwrap();
        let off: Vec<&OffCpu> = thread
            .offcpu
            .iter()
            .filter(|o| o.start_ns == 1_000_000)
            .collect();
        assert_eq!(off.len(), 1, "{:?}", thread.offcpu);
        assert_eq!(off[0].end_ns, 40_000_000);
        let stack = off[0].stack.expect("the stretch has its stack");
        assert_eq!(detail.stacks[stack as usize].kstack, vec![0xffff_2000]);
    }

    /// One step of known shape: 1 ms compute (200 µs of it page faults, by samples), a
    /// 500 µs preemption with a cross-node migration 100 µs in, an async AllReduce, a 3 ms
    /// sync sleeping while NCCL work is outstanding, 1 ms blocked elsewhere. Every
    /// nanosecond lands in its category.
    #[test]
    fn one_step_partitioned() {
        let mut tl = Timeline::new(&header());
        let mut events = vec![];
        for step in 0..3u64 {
            let t = step * 10_000_000;
            // Compute 0..1 ms; faults sampled at 2 points (2 × 100 µs).
            events.push(Event::Sample {
                ts_ns: t + 100_000,
                task: task(10),
                kstack: vec![0xffff_0010],
                ustack: vec![],
            });
            events.push(Event::Sample {
                ts_ns: t + 200_000,
                task: task(10),
                kstack: vec![0xffff_0020],
                ustack: vec![],
            });
            events.push(Event::Sample {
                ts_ns: t + 300_000,
                task: task(10),
                kstack: vec![],
                ustack: vec![1],
            });
            // Preempted 1.0..1.5 ms, migrated to node 1.
            events.push(switch(t + 1_000_000, true, 0));
            events.push(Event::Migrate {
                ts_ns: t + 1_100_000,
                task: task(10),
                orig_cpu: 0,
                dest_cpu: 2,
            });
            events.push(switch(t + 1_500_000, false, 0));
            events.push(call(Func::AllReduce, t + 1_500_000, t + 1_510_000));
            // Sync 1.51..4.51 ms, asleep 1.6..4.5 ms.
            events.push(switch(t + 1_600_000, true, 1));
            events.push(Event::Wakeup {
                ts_ns: t + 4_400_000,
                task: task(10),
                waker_tid: 1,
                waker_tgid: 1,
                target_cpu: 0,
            });
            events.push(switch(t + 4_500_000, false, 0));
            events.push(call(
                Func::CuStreamSynchronize,
                t + 1_510_000,
                t + 4_510_000,
            ));
            // Blocked on something else 5..6 ms.
            events.push(switch(t + 5_000_000, true, 1));
            events.push(switch(t + 6_000_000, false, 0));
        }
        events.sort_by_key(Event::ts_ns);
        for e in &events {
            tl.push(e);
        }
        let (report, _) = tl.finish(30_000_000, StepRule::Auto);
        assert_eq!(report.method, Method::Auto);
        assert_eq!(report.rank_tid, Some(10));
        assert_eq!(report.steps.len(), 2);
        let s = &report.steps[0];
        assert_eq!(s.wall_ns, 10_000_000);
        assert_eq!(s.categories.total(), s.wall_ns);
        assert_eq!(s.categories.nccl_wait, 3_000_000);
        assert_eq!(s.categories.page_fault, 200_000);
        // Preempted 500 µs, migrated 100 µs in: the wait after the migration is its cost.
        assert_eq!(s.categories.cpu_migration, 400_000);
        assert_eq!(s.categories.runqueue, 100_000);
        assert_eq!(s.categories.other_offcpu, 1_000_000);
        assert_eq!(s.categories.remote_memory, None);
        assert_eq!((s.migrations, s.cross_node_migrations), (1, 1));
        assert_eq!(
            s.nccl,
            NcclCount {
                collectives: 1,
                bytes: 1024
            }
        );
    }

    /// A sync with no NCCL work since the previous sync waits for the GPU's compute: it is
    /// not `nccl_wait`; a spinning sync with NCCL outstanding is, although on-CPU.
    #[test]
    fn only_syncs_after_collectives_are_nccl_waits() {
        let mut tl = Timeline::new(&header());
        for e in [
            call(Func::CuStreamSynchronize, 1_000, 2_000),
            call(Func::AllReduce, 3_000, 3_100),
            call(Func::CuStreamSynchronize, 4_000, 9_000),
        ] {
            tl.push(&e);
        }
        let (report, _) = tl.finish(10_000, StepRule::Window(10_000));
        assert_eq!(report.method, Method::Window);
        let t = &report.threads[0].categories;
        assert_eq!(t.nccl_wait, 5_000);
        assert_eq!(t.compute, 5_000);
        assert_eq!(t.total(), 10_000);
    }

    /// Faults timed by fentry/fexit are `page_fault` from the handler's entry to its
    /// return, on the CPU or blocked inside it (a page read in); samples in the handler no
    /// longer estimate it, so nothing is counted twice.
    #[test]
    fn timed_faults_replace_samples() {
        let mut h = header();
        h.fault_timing = Some("fentry/fexit on handle_mm_fault".into());
        let mut tl = Timeline::new(&h);
        let fault = |start: u64, end: u64| Event::FaultTime {
            ts_ns: end,
            task: task(10),
            start_ns: start,
            address: 0x1000,
        };
        let mut events = vec![
            switch(0, false, 0),
            // A sample in the handler: it would stand for 100 µs if samples estimated it.
            Event::Sample {
                ts_ns: 200_000,
                task: task(10),
                kstack: vec![0xffff_0010],
                ustack: vec![],
            },
            fault(100_000, 250_000),
            // A major fault: blocked 2.1..2.9 ms inside it.
            switch(2_100_000, true, 1),
            switch(2_900_000, false, 0),
            fault(2_000_000, 3_000_000),
        ];
        events.sort_by_key(Event::ts_ns);
        for e in &events {
            tl.push(e);
        }
        let (report, detail) = tl.finish(10_000_000, StepRule::Window(10_000_000));
        let c = &report.threads[0].categories;
        assert_eq!(c.page_fault, 150_000 + 1_000_000);
        assert_eq!(c.other_offcpu, 0);
        assert_eq!(c.total(), 10_000_000);
        assert!(report.methods.page_fault.starts_with("fentry/fexit"));
        // The sample inside the fault is drawn as fault time in the flamegraphs.
        assert_eq!(detail.threads[0].samples[0].2, Cat::PageFault);
    }
}
