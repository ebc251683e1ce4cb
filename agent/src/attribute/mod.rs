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

mod categories;
pub mod ranks;
pub mod steps;

pub use categories::{Cat, Categories, NAMES, Unmeasured};

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

use crate::event::{Call, Event, Library};
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
    /// The thread's time cut into categorized pieces over the whole trace (at `finish`).
    segments: Vec<(u64, u64, Cat)>,
}

/// A stack as captured: the process (for its maps), kernel and user frames, innermost
/// first.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StackKey {
    pub pid: u32,
    pub kstack: Vec<u64>,
    pub ustack: Vec<u64>,
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
    /// The steps' `[start, end)`, for graphs of step time.
    pub step_bounds: Vec<(u64, u64)>,
    /// The rank thread whose steps these are.
    pub rank_tid: Option<u32>,
}

/// Collects what attribution needs, event by event.
pub struct Timeline {
    threads: BTreeMap<u32, ThreadLog>,
    page_migrations: Vec<(u32, u64, u64)>,
    numa_moves: Vec<(u32, u64)>,
    cpu_nodes: Vec<i32>,
    fault_ranges: Vec<(u64, u64)>,
    sample_period_ns: u64,
    thread_names: BTreeMap<u32, String>,
    first_ns: u64,
    last_ns: u64,
    stacks: Vec<StackKey>,
    stack_ids: std::collections::HashMap<StackKey, u32>,
    calls: Vec<Call>,
    target_pids: Vec<u32>,
    env_ranks: BTreeMap<u32, (String, i32)>,
    /// Faults were timed by fentry/fexit on the fault handler (FaultTime events): their
    /// pieces are `page_fault` directly and samples do not estimate it.
    faults_timed: bool,
    /// Why fentry/fexit did not time them.
    fault_timing_refused: Option<String>,
    /// A CUDA sync function was probed in some target: `nccl_wait` is measured.
    sync_probed: bool,
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
            thread_names: header
                .targets
                .iter()
                .flat_map(|t| t.threads.iter().cloned())
                .collect(),
            first_ns: header.clock.monotonic_ns,
            last_ns: header.clock.monotonic_ns,
            stacks: Vec::new(),
            stack_ids: std::collections::HashMap::new(),
            calls: Vec::new(),
            target_pids: header.targets.iter().map(|t| t.pid).collect(),
            env_ranks: header
                .targets
                .iter()
                .filter_map(|t| t.env_rank.clone().map(|r| (t.pid, r)))
                .collect(),
            faults_timed: header.fault_timing.is_some(),
            fault_timing_refused: header.fault_timing_refused.clone(),
            sync_probed: header.targets.iter().any(syncs_probed),
        }
    }

    /// Attribution starts at `ts` (the earlier records were only counted): thread states
    /// are not known before it.
    pub fn start_at(&mut self, ts: u64) {
        self.first_ns = self.first_ns.max(ts);
        self.last_ns = self.last_ns.max(ts);
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

    fn intern(&mut self, pid: u32, kstack: &[u64], ustack: &[u64]) -> u32 {
        let key = StackKey {
            pid,
            kstack: kstack.to_vec(),
            ustack: ustack.to_vec(),
        };
        if let Some(id) = self.stack_ids.get(&key) {
            return *id;
        }
        let id = self.stacks.len() as u32;
        self.stacks.push(key.clone());
        self.stack_ids.insert(key, id);
        id
    }

    fn log(&mut self, tid: u32, pid: u32) -> &mut ThreadLog {
        let log = self.threads.entry(tid).or_default();
        if pid != 0 {
            log.pid = pid;
        }
        log
    }

    fn node(&self, cpu: i32) -> i32 {
        usize::try_from(cpu)
            .ok()
            .and_then(|c| self.cpu_nodes.get(c))
            .copied()
            .unwrap_or(-1)
    }

    fn call(&mut self, c: &Call) {
        self.calls.push(c.clone());
        let log = self.log(c.task.tid, c.task.tgid);
        match c.func.library() {
            Library::Marker => log.markers.push(c.start_ns),
            Library::Nvtx => log
                .nvtx
                .push((c.start_ns, c.message.clone().unwrap_or_default())),
            Library::Cuda => {
                log.changes.push((c.start_ns, Change::SyncStart));
                log.changes.push((c.end_ns, Change::SyncEnd));
                log.syncs.push((c.start_ns, c.end_ns));
            }
            Library::Nccl => {
                log.changes.push((c.start_ns, Change::NcclStart));
                log.changes.push((c.end_ns, Change::NcclEnd));
                if c.func.is_collective() {
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
    #[allow(clippy::too_many_lines)] // one arm per event kind
    pub fn push(&mut self, event: &Event) {
        let ts = event.ts_ns();
        self.last_ns = self.last_ns.max(ts);
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
                    let log = self.log(*next_tid, *next_tgid);
                    log.first_switch_is_in.get_or_insert(true);
                    log.changes.push((*ts_ns, Change::SwitchIn));
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
                let id = self.intern(task.tgid, kstack, ustack);
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
            Event::CallStack {
                ts_ns,
                task,
                ustack,
            } => {
                let id = self.intern(task.tgid, &[], ustack);
                self.log(task.tid, task.tgid).call_stacks.push((*ts_ns, id));
            }
            Event::FaultTime {
                ts_ns,
                task,
                start_ns,
                ..
            } => {
                self.faults_timed = true;
                let log = self.log(task.tid, task.tgid);
                log.changes.push((*start_ns, Change::FaultStart));
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
                let stack = self.intern(task.tgid, kstack, ustack);
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
            Event::Fork { .. } | Event::Exit { .. } => {}
        }
    }

    /// Attributes the rank thread's steps and every thread's totals up to `end_ns`.
    #[allow(clippy::too_many_lines)] // detection, steps and threads in one pass over the logs
    #[must_use]
    pub fn finish(mut self, end_ns: u64, rule: StepRule) -> (StepsReport, Detail) {
        let end_ns = end_ns.max(self.last_ns);
        let period = self.sample_period_ns;
        self.page_migrations.sort_unstable_by_key(|m| m.1);
        self.numa_moves.sort_unstable_by_key(|m| m.1);
        for log in self.threads.values_mut() {
            log.changes.sort_unstable();
            log.syncs.sort_unstable();
            log.collectives.sort_by_key(|c| c.start_ns);
            log.faults.sort_unstable();
            log.wakeups.sort_unstable();
            log.call_stacks.sort_unstable();
            log.migrations.sort_unstable_by_key(|m| m.0);
            if !self.faults_timed {
                log.fault_time = weigh_samples(log, period);
            }
            log.fault_time.sort_unstable();
        }
        // NCCL outstanding is a property of the process: collectives from any thread.
        let mut collective_ends: BTreeMap<u32, Vec<u64>> = BTreeMap::new();
        for log in self.threads.values() {
            collective_ends
                .entry(log.pid)
                .or_default()
                .extend(log.collectives.iter().map(|c| c.end_ns));
        }
        for ends in collective_ends.values_mut() {
            ends.sort_unstable();
        }
        // Every thread's timeline, cut once; steps and totals add up its pieces.
        let first_ns = self.first_ns;
        for log in self.threads.values_mut() {
            let ends = collective_ends.get(&log.pid).map_or(&[][..], Vec::as_slice);
            let mut segments = Vec::new();
            Self::split(log, ends, first_ns, end_ns, &mut segments);
            log.segments = segments;
        }
        let mut process_collectives: BTreeMap<u32, Vec<Collective>> = BTreeMap::new();
        for log in self.threads.values() {
            process_collectives
                .entry(log.pid)
                .or_default()
                .extend(log.collectives.iter().copied());
        }
        for c in process_collectives.values_mut() {
            c.sort_by_key(|c| c.start_ns);
        }
        // The rank thread runs the training loop: in the process that issues the most
        // collectives, the thread that waits on the GPU most often (PyTorch's main thread:
        // DDP issues its all-reduces from the autograd thread, but `.item()` syncs on the
        // main one), else the thread issuing the most collectives.
        let rank_pid = process_collectives
            .iter()
            .filter(|(_, c)| !c.is_empty())
            .max_by_key(|(pid, c)| (c.len(), std::cmp::Reverse(**pid)))
            .map(|(pid, _)| *pid);
        let rank = rank_pid.and_then(|pid| {
            self.threads
                .iter()
                .filter(|(_, l)| l.pid == pid)
                .max_by_key(|(tid, l)| {
                    (l.syncs.len(), l.collectives.len(), std::cmp::Reverse(**tid))
                })
                .map(|(tid, _)| (*tid, pid))
        });

        let markers: Vec<u64> = self
            .threads
            .values()
            .filter(|l| rank.is_none_or(|r| l.pid == r.1))
            .flat_map(|l| l.markers.iter().copied())
            .collect();
        // When no steps can be found: 1 s windows, saying why.
        let fallback = |why: &str| {
            steps::windows(
                self.first_ns,
                end_ns,
                1_000_000_000,
                format!("{why}: 1 s windows"),
            )
        };
        let detected = match (rule, rank) {
            (StepRule::Nvtx(pattern), _) => {
                let pushes: Vec<u64> = self
                    .threads
                    .values()
                    .filter(|l| rank.is_none_or(|r| l.pid == r.1))
                    .flat_map(|l| l.nvtx.iter())
                    .filter(|(_, name)| pattern.0.is_match(name))
                    .map(|(t, _)| *t)
                    .collect();
                let re = pattern.0.as_str();
                steps::by_nvtx(&pushes, re).unwrap_or_else(|| {
                    fallback(&format!(
                        "--step-nvtx {re:?}: fewer than two NVTX ranges matched"
                    ))
                })
            }
            (StepRule::Window(w), _) => {
                steps::windows(self.first_ns, end_ns, w, format!("--step-window {w} ns"))
            }
            // A recording made with --step-symbol holds the marker's entries.
            (StepRule::Auto, _) if !markers.is_empty() => steps::by_marker(&markers)
                .unwrap_or_else(|| {
                    fallback("--step-symbol: the marker was entered fewer than twice")
                }),
            (StepRule::Auto, Some((tid, pid))) => {
                steps::detect(&process_collectives[&pid], &self.threads[&tid].syncs)
                    .unwrap_or_else(|| fallback("no repeating sequence of collectives"))
            }
            (StepRule::Auto, None) => fallback("no collectives traced"),
        };
        let identities = self.identities();
        let loop_threads: BTreeMap<u32, u32> = identities
            .iter()
            .filter_map(|id| self.loop_thread(id.pid).map(|tid| (id.pid, tid)))
            .collect();
        let rank_of = |pid: u32| {
            identities
                .iter()
                .find(|i| i.pid == pid)
                .map_or(-1, |i| i.rank)
        };
        let lateness = rank.map_or_else(Vec::new, |(_, pid)| {
            ranks::lateness(&process_collectives, pid)
        });
        let mut steps_out = Vec::new();
        if let Some((tid, pid)) = rank {
            let log = &self.threads[&tid];
            let colls = &process_collectives[&pid];
            // A step that began before tracing was armed (the probes attach one by one
            // before the recording's start) was not traced whole: left out, and said.
            let whole = detected
                .bounds
                .iter()
                .copied()
                .filter(|(a, _)| *a >= first_ns);
            for (index, (a, b)) in whole.enumerate() {
                let mut step = self.step(index, log, tid, colls, a, b);
                if loop_threads.len() > 1 {
                    step.slowest_rank = ranks::slowest_in(&lateness, a, b).map(rank_of);
                    step.ranks = loop_threads
                        .iter()
                        .map(|(p, t)| StepRank {
                            rank: rank_of(*p),
                            pid: *p,
                            categories: Self::categories(&self.threads[t], a, b),
                        })
                        .collect();
                }
                steps_out.push(step);
            }
        }
        let rank_reports: Vec<ranks::RankReport> = identities
            .iter()
            .map(|id| {
                let colls = process_collectives
                    .get(&id.pid)
                    .map_or(&[][..], Vec::as_slice);
                ranks::RankReport {
                    pid: id.pid,
                    rank: id.rank,
                    rank_source: id.rank_source.clone(),
                    nccl: ranks::RankNccl {
                        collectives: colls.len() as u64,
                        bytes: colls.iter().fold(0u64, |n, c| n.saturating_add(c.bytes)),
                    },
                    categories: loop_threads
                        .get(&id.pid)
                        .map_or_else(Categories::default, |t| {
                            Self::categories(&self.threads[t], self.first_ns, end_ns)
                        }),
                }
            })
            .collect();
        let straggler = ranks::straggler(
            &process_collectives
                .iter()
                .filter(|(_, c)| !c.is_empty())
                .map(|(p, c)| (*p, c.clone()))
                .collect(),
            &identities,
        );
        let mut threads = Vec::new();
        for (tid, log) in &self.threads {
            let categories = Self::categories(log, self.first_ns, end_ns);
            threads.push(ThreadReport {
                tid: *tid,
                pid: log.pid,
                name: self.thread_names.get(tid).cloned().unwrap_or_default(),
                role: role(
                    Some(*tid) == rank.map(|r| r.0),
                    self.thread_names.get(tid).map_or("", String::as_str),
                ),
                categories,
                nccl_calls: log
                    .changes
                    .iter()
                    .filter(|(_, c)| *c == Change::NcclStart)
                    .count() as u64,
                faults: log.faults.len() as u64,
                migrations: log.migrations.len() as u64,
                cross_node_migrations: log.migrations.iter().filter(|(_, x)| *x).count() as u64,
            });
        }
        let nodes: BTreeSet<i32> = self.cpu_nodes.iter().copied().filter(|n| *n >= 0).collect();
        let mut detail = self.detail(rank.map(|r| r.0), end_ns);
        detail.step_bounds = steps_out.iter().map(|s| (s.start_ns, s.end_ns)).collect();
        detail.rank_tid = rank.map(|r| r.0);
        // Without sync probes only NCCL calls that block the host are seen: what they show
        // is a lower bound; with none of them, nothing was measured.
        let blocked_in_nccl = threads.iter().any(|t| t.categories.nccl_wait > 0);
        let unmeasured = Unmeasured {
            nccl_wait: !self.sync_probed && !blocked_in_nccl,
            nccl_wait_lower_bound: !self.sync_probed && blocked_in_nccl,
            page_fault: !self.faults_timed && (period == 0 || self.fault_ranges.is_empty()),
        };
        for step in &mut steps_out {
            step.categories.unmeasured = unmeasured;
            for r in &mut step.ranks {
                r.categories.unmeasured = unmeasured;
            }
        }
        let mut rank_reports = rank_reports;
        for r in &mut rank_reports {
            r.categories.unmeasured = unmeasured;
        }
        for t in &mut threads {
            t.categories.unmeasured = unmeasured;
        }
        let left_out = detected
            .bounds
            .iter()
            .filter(|(a, _)| *a < first_ns)
            .count();
        let mut reason = detected.reason.clone();
        if left_out > 0 && rank.is_some() {
            let _ = std::fmt::Write::write_fmt(
                &mut reason,
                format_args!(
                    "; {left_out} step(s) that began before tracing was armed are left out \
                     (not traced whole)"
                ),
            );
        }
        let report = StepsReport {
            partial_steps_left_out: if rank.is_some() { left_out } else { 0 },
            clock: "every *_ns timestamp (start_ns, end_ns) is CLOCK_MONOTONIC of the traced \
                    host in ns; summary.json's start_unix_ns is the wall-clock time (ns since \
                    1970) of the recording's start, duration_ns counted from it",
            method: detected.method,
            reason,
            period: detected.period,
            rank_pid: rank.map(|r| r.1),
            rank_tid: rank.map(|r| r.0),
            methods: Methods {
                nccl_wait: if self.sync_probed {
                    "time inside CUDA sync calls (cuStreamSynchronize, cuEventSynchronize, \
                     cuCtxSynchronize and their _ptsz forms) while NCCL work issued before \
                     them is outstanding, spinning or blocked, and inside NCCL calls that \
                     block the host"
                        .into()
                } else if unmeasured.nccl_wait_lower_bound {
                    "a lower bound: no CUDA sync function was probed (the profile has \
                     cuda_sync off, or no libcuda was mapped), so only NCCL calls that block \
                     the host are seen; waits inside CUDA syncs count as compute (spinning) \
                     or other_offcpu (blocking). Use the default profile to measure them"
                        .into()
                } else {
                    "not measured: no CUDA sync function was probed (the profile has \
                     cuda_sync off, or no libcuda was mapped), so waits for NCCL cannot be \
                     told from other work: a spinning wait counts as compute, a blocking one \
                     as other_offcpu. Use the default profile to measure it"
                        .into()
                },
                page_fault: self.fault_method(),
                remote_memory: format!(
                    "not measured: needs PMU events (node-loads/node-load-misses), which this \
                     host does not expose{}",
                    if nodes.len() <= 1 {
                        "; the host has one NUMA node, so nothing is remote"
                    } else {
                        ""
                    }
                ),
                remote_memory_estimated: false,
            },
            steps: steps_out,
            threads,
            other_offcpu_top_stacks: Vec::new(),
            ranks: rank_reports,
            straggler,
        };
        (report, detail)
    }

    /// Rank numbers of the traced processes.
    fn identities(&self) -> Vec<ranks::RankIdentity> {
        let init: BTreeMap<u32, i32> = self
            .calls
            .iter()
            .filter(|c| {
                matches!(
                    c.func,
                    crate::event::Func::CommInitRank | crate::event::Func::CommInitRankConfig
                )
            })
            .filter_map(|c| c.rank.map(|r| (c.task.tgid, r)))
            .collect();
        ranks::identify(&self.target_pids, &init, &self.env_ranks)
    }

    /// A process's training-loop thread: the one that waits on the GPU most often, else
    /// the one issuing the most collectives.
    fn loop_thread(&self, pid: u32) -> Option<u32> {
        self.threads
            .iter()
            .filter(|(_, l)| l.pid == pid)
            .filter(|(_, l)| !l.syncs.is_empty() || !l.collectives.is_empty())
            .max_by_key(|(tid, l)| (l.syncs.len(), l.collectives.len(), std::cmp::Reverse(**tid)))
            .map(|(tid, _)| *tid)
    }

    /// Per-thread timelines with categorized pieces, samples and off-CPU stretches.
    /// What the renderers need, moved out of the logs (the last use of them: each log is
    /// dropped once its thread is done, so the run is not held twice).
    fn detail(&mut self, rank_tid: Option<u32>, end_ns: u64) -> Detail {
        // The interning index repeats every stack: not needed past this point.
        self.stack_ids = std::collections::HashMap::new();
        let mut threads = Vec::new();
        for (tid, mut log) in std::mem::take(&mut self.threads) {
            let name = self.thread_names.get(&tid).cloned().unwrap_or_default();
            let mut thread = ThreadDetail {
                tid,
                pid: log.pid,
                role: role(Some(tid) == rank_tid, &name),
                name,
                segments: std::mem::take(&mut log.segments),
                samples: Vec::new(),
                offcpu: Vec::new(),
                migrations: std::mem::take(&mut log.migration_cpus),
                faults: std::mem::take(&mut log.faults),
                call_stacks: std::mem::take(&mut log.call_stacks),
            };
            let fault_weight: BTreeMap<u64, u64> = log.fault_time.iter().copied().collect();
            for &(ts, stack, in_fault) in &log.stack_samples {
                let at = thread.category_at(ts).unwrap_or(Cat::Compute);
                let (cat, weight) = match fault_weight.get(&ts) {
                    Some(w) if in_fault && at == Cat::Compute => (Cat::PageFault, *w),
                    _ => (at, self.sample_period_ns),
                };
                thread.samples.push((ts, stack, cat, weight));
            }
            let mut open: Option<(u64, bool)> = None;
            for &(ts, change) in &log.changes {
                match change {
                    Change::SwitchOut { runnable } => open = Some((ts, runnable)),
                    Change::SwitchIn => {
                        let Some((start, runnable)) = open.take() else {
                            continue;
                        };
                        // The stack record is made by the same program run, just before
                        // the switch record.
                        let i = log
                            .offcpu_stacks
                            .partition_point(|(t, _)| *t + 100_000 < start);
                        let stack = log
                            .offcpu_stacks
                            .get(i)
                            .filter(|(t, _)| *t <= start + 100_000 && *t <= ts)
                            .map(|(_, id)| *id);
                        let wakeup = log
                            .wakeups
                            .partition_point(|(t, _, _)| *t <= ts)
                            .checked_sub(1)
                            .map(|i| &log.wakeups[i])
                            .filter(|(t, _, _)| *t >= start);
                        let waker = wakeup.map(|(_, tid, tgid)| (*tid, *tgid));
                        let woken_ns = wakeup.map(|(t, _, _)| *t);
                        thread.offcpu.push(OffCpu {
                            start_ns: start,
                            end_ns: ts,
                            runnable,
                            stack,
                            waker,
                            woken_ns,
                        });
                    }
                    _ => {}
                }
            }
            threads.push(thread);
        }
        Detail {
            first_ns: self.first_ns,
            end_ns,
            threads,
            stacks: std::mem::take(&mut self.stacks),
            calls: std::mem::take(&mut self.calls),
            cpu_nodes: self.cpu_nodes.clone(),
            sample_period_ns: self.sample_period_ns,
            step_bounds: Vec::new(),
            rank_tid: None,
        }
    }

    /// How `page_fault` was measured, for `methods.page_fault`.
    fn fault_method(&self) -> String {
        let why_not = self
            .fault_timing_refused
            .as_deref()
            .unwrap_or("fentry/fexit not tried");
        if self.faults_timed {
            "fentry/fexit on handle_mm_fault: each user fault of a target thread timed from \
             the handler's entry to its return, on the CPU or blocked inside it"
                .into()
        } else if self.sample_period_ns > 0 && self.fault_ranges.is_empty() {
            "not measured: the page-fault handler's addresses were not found in \
             /proc/kallsyms (unreadable, or kernel.kptr_restrict hides them), so samples in \
             it cannot be told; fault time stays in compute"
                .into()
        } else if self.sample_period_ns > 0 {
            format!(
                "on-CPU samples every {} µs whose kernel stack is in the page-fault handler, \
                 times the period ({why_not})",
                self.sample_period_ns / 1000
            )
        } else {
            format!("not measured: on-CPU sampling is off in this profile ({why_not})")
        }
    }

    #[allow(clippy::too_many_arguments)] // the step, its thread and its process's calls
    fn step(
        &self,
        index: usize,
        log: &ThreadLog,
        tid: u32,
        collectives: &[Collective],
        a: u64,
        b: u64,
    ) -> Step {
        // Sorted by time in `finish`: each step looks at its own stretch only.
        let within = |lo: usize, hi: usize| lo..hi.max(lo);
        let page_migrations = &self.page_migrations[within(
            self.page_migrations.partition_point(|m| m.1 < a),
            self.page_migrations.partition_point(|m| m.1 < b),
        )];
        let numa_moves = &self.numa_moves[within(
            self.numa_moves.partition_point(|m| m.1 < a),
            self.numa_moves.partition_point(|m| m.1 < b),
        )];
        // Everything below is sorted by time: binary searches keep long runs linear.
        let lo = collectives.partition_point(|c| c.start_ns < a);
        let nccl = collectives[lo..]
            .iter()
            .take_while(|c| c.start_ns < b)
            .fold(NcclCount::default(), |n, c| NcclCount {
                collectives: n.collectives + 1,
                bytes: n.bytes.saturating_add(c.bytes),
            });
        let faults =
            log.faults.partition_point(|t| *t < b) - log.faults.partition_point(|t| *t < a);
        let lo = log.migrations.partition_point(|m| m.0 < a);
        let migrations = &log.migrations[lo..log.migrations.partition_point(|m| m.0 < b).max(lo)];
        Step {
            index,
            start_ns: a,
            end_ns: b,
            wall_ns: b - a,
            categories: Self::categories(log, a, b),
            nccl,
            faults: faults as u64,
            migrations: migrations.len() as u64,
            cross_node_migrations: migrations.iter().filter(|(_, x)| *x).count() as u64,
            numa_page_migrations: page_migrations
                .iter()
                .filter(|(t, _, _)| *t == tid)
                .map(|(_, _, n)| n)
                .sum(),
            slowest_rank: None,
            ranks: Vec::new(),
            numa_task_moves: numa_moves.iter().filter(|(t, _)| *t == tid).count() as u64,
        }
    }

    /// `[a, b)` of one thread by category: its pieces clipped to the interval, page faults
    /// (on-CPU samples in the fault handler, outside NCCL waits) carved out of compute.
    fn categories(log: &ThreadLog, a: u64, b: u64) -> Categories {
        let mut cat = Categories::default();
        let segs = &log.segments;
        let first = segs.partition_point(|(_, e, _)| *e <= a);
        for (s, e, c) in &segs[first..] {
            if *s >= b {
                break;
            }
            *cat.slot(*c) += (*e).min(b).saturating_sub((*s).max(a));
        }
        let lo = log.fault_time.partition_point(|(ts, _)| *ts < a);
        let fault_ns: u64 = log.fault_time[lo..]
            .iter()
            .take_while(|(ts, _)| *ts < b)
            .filter(|(ts, _)| category_at(segs, *ts) != Some(Cat::NcclWait))
            .map(|(_, weight)| weight)
            .sum();
        let fault_ns = fault_ns.min(cat.compute);
        cat.page_fault += fault_ns;
        cat.compute -= fault_ns;
        cat
    }

    /// Cuts `[a, b)` of one thread into (start, end, category) pieces, adjacent pieces of
    /// one category merged (page faults are not carved out here: they come from samples).
    fn split(
        log: &ThreadLog,
        collective_ends: &[u64],
        a: u64,
        b: u64,
        segments: &mut Vec<(u64, u64, Cat)>,
    ) {
        if b <= a {
            return;
        }
        let mut sync_ends: Vec<u64> = log.syncs.iter().map(|(_, e)| *e).collect();
        sync_ends.sort_unstable();
        // Whether a sync starting at `start` has NCCL work outstanding: a collective
        // returned after the previous sync of this thread ended.
        let outstanding = |start: u64| {
            let prev_end = sync_ends
                .partition_point(|e| *e <= start)
                .checked_sub(1)
                .map_or(0, |i| sync_ends[i]);
            let i = collective_ends.partition_point(|e| *e <= prev_end);
            collective_ends.get(i).is_some_and(|e| *e <= start)
        };
        let (blocking_calls, own_waits) = marks(log);
        // Before its first switch-in a thread was off-CPU: blocked, unless a wakeup says
        // otherwise.
        let first_in = log.first_switch_is_in == Some(true);
        let mut state = State {
            on_cpu: !first_in,
            runnable: !first_in,
            ..State::default()
        };
        let mut t = a;
        let mut charge = |from: u64, to: u64, state: State| {
            let (from, to) = (from.max(a), to.min(b));
            if to > from {
                let which = state.category();
                match segments.last_mut() {
                    Some(last) if last.1 == from && last.2 == which => last.1 = to,
                    _ => segments.push((from, to, which)),
                }
            }
        };
        for &(ts, change) in &log.changes {
            if ts >= b {
                break;
            }
            charge(t, ts, state);
            t = t.max(ts);
            match change {
                Change::SwitchOut { runnable } => {
                    state.on_cpu = false;
                    state.runnable = runnable;
                    state.migrated = false;
                    state.waits_on_own = !runnable && own_waits.contains(&ts);
                }
                Change::SwitchIn => {
                    state.on_cpu = true;
                    state.runnable = true;
                    state.migrated = false;
                }
                Change::Wakeup { .. } => {
                    state.runnable = true;
                    state.waits_on_own = false;
                }
                Change::Migrate => state.migrated = true,
                Change::SyncStart => {
                    state.sync_depth += 1;
                    state.sync_nccl = outstanding(ts);
                }
                Change::SyncEnd => state.sync_depth = state.sync_depth.saturating_sub(1),
                Change::NcclStart => {
                    state.nccl_depth += 1;
                    state.nccl_blocking = blocking_calls.contains(&ts);
                }
                Change::NcclEnd => {
                    state.nccl_depth = state.nccl_depth.saturating_sub(1);
                    state.nccl_blocking &= state.nccl_depth > 0;
                }
                Change::FaultStart => state.fault_depth += 1,
                Change::FaultEnd => state.fault_depth = state.fault_depth.saturating_sub(1),
            }
        }
        charge(t, b, state);
    }
}

/// The category of the piece holding `ts`.
fn category_at(segments: &[(u64, u64, Cat)], ts: u64) -> Option<Cat> {
    let i = segments.partition_point(|(_, e, _)| *e <= ts);
    segments
        .get(i)
        .filter(|(s, _, _)| *s <= ts)
        .map(|(_, _, c)| *c)
}

/// The on-CPU time each fault sample stands for: the thread's on-CPU time since its
/// previous sample. The kernel re-arms the cpu-clock timer after the sample's handler and
/// delays samples while interrupts are off (more so inside fault handling), so the real
/// interval runs a few percent over the nominal period; wall-clock gaps also hold
/// preemptions, which are taken out using the thread's switches. The nominal period when
/// there is no previous sample or the on-CPU gap is outside [period, 1.5 × period).
fn weigh_samples(log: &ThreadLog, period: u64) -> Vec<(u64, u64)> {
    let mut off: Vec<(u64, u64)> = Vec::new();
    let mut out_at: Option<u64> = None;
    for &(ts, change) in &log.changes {
        match change {
            Change::SwitchOut { .. } => out_at = Some(ts),
            Change::SwitchIn => {
                if let Some(at) = out_at.take() {
                    off.push((at, ts));
                }
            }
            _ => {}
        }
    }
    log.fault_samples
        .iter()
        .map(|&(ts, prev)| {
            let weight = prev.map_or(period, |prev| {
                let first = off.partition_point(|(_, e)| *e <= prev);
                let off_cpu: u64 = off[first..]
                    .iter()
                    .take_while(|(s, _)| *s < ts)
                    .map(|(s, e)| (*e).min(ts).saturating_sub((*s).max(prev)))
                    .sum();
                let on_cpu = ts.saturating_sub(prev).saturating_sub(off_cpu);
                // Longer: samples were missing in between; shorter: clock skew.
                if (period..period + period / 2).contains(&on_cpu) {
                    on_cpu
                } else {
                    period
                }
            });
            (ts, weight)
        })
        .collect()
}

/// Start times of the thread's NCCL calls that blocked before returning, and of its
/// blocked intervals that ended with a wakeup from another thread of its process.
fn marks(log: &ThreadLog) -> (BTreeSet<u64>, BTreeSet<u64>) {
    // NCCL calls that blocked (slept) before returning block the host: all their time is
    // NCCL wait. A call only preempted is enqueue work that waited for a CPU: a preemption
    // once made a minimal-profile run report nccl_wait as measured.
    let mut blocking_calls = BTreeSet::new();
    let mut open: Option<u64> = None;
    for &(ts, change) in &log.changes {
        match change {
            Change::NcclStart => open = Some(ts),
            Change::SwitchOut { runnable: false } => {
                if let Some(start) = open {
                    blocking_calls.insert(start);
                }
            }
            Change::NcclEnd => open = None,
            _ => {}
        }
    }
    // Blocked intervals that end with a wakeup from another thread of the process:
    // the thread waits for the process's own work (autograd, worker queues).
    let mut own_waits = BTreeSet::new();
    let mut blocked_since: Option<u64> = None;
    for &(ts, change) in &log.changes {
        match change {
            Change::SwitchOut { runnable: false } => blocked_since = Some(ts),
            Change::Wakeup { own } => {
                if let Some(since) = blocked_since.take()
                    && own
                {
                    own_waits.insert(since);
                }
            }
            Change::SwitchIn => blocked_since = None,
            _ => {}
        }
    }
    (blocking_calls, own_waits)
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

/// A thread's state between two changes.
#[allow(clippy::struct_excessive_bools)] // independent facts about one thread
#[derive(Clone, Copy, Debug, Default)]
struct State {
    on_cpu: bool,
    runnable: bool,
    migrated: bool,
    sync_depth: u32,
    sync_nccl: bool,
    nccl_depth: u32,
    /// Inside an NCCL call that goes off-CPU before it returns.
    nccl_blocking: bool,
    /// Blocked until another thread of the process wakes it.
    waits_on_own: bool,
    /// Inside a timed page fault (fentry/fexit).
    fault_depth: u32,
}

impl State {
    fn in_nccl_sync(self) -> bool {
        self.sync_depth > 0 && self.sync_nccl
    }

    /// The category time in this state belongs to (the rules in the module docs).
    fn category(self) -> Cat {
        if self.in_nccl_sync() || self.nccl_blocking {
            Cat::NcclWait
        } else if self.fault_depth > 0 && (self.on_cpu || !self.runnable) {
            // Handling the fault on the CPU, or blocked inside it (reading the page in).
            Cat::PageFault
        } else if self.on_cpu {
            Cat::Compute
        } else if self.nccl_depth > 0 {
            Cat::NcclWait
        } else if self.runnable {
            if self.migrated {
                Cat::CpuMigration
            } else {
                Cat::Runqueue
            }
        } else if self.sync_depth > 0 || self.waits_on_own {
            Cat::Compute
        } else {
            Cat::OtherOffcpu
        }
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
    use crate::event::{Func, Task};
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
            task: task(10),
            func,
            start_ns: start,
            end_ns: end,
            ret: 0,
            count: Some(256),
            datatype: Some(7),
            bytes: Some(1024),
            redop: None,
            peer: None,
            comm: Some(1),
            stream: Some(2),
            new_comm: None,
            rank: None,
            nranks: None,
            message: None,
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
