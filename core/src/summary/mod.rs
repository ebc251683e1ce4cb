//! The output model of a run: what summary.json says (totals per NCCL function and CUDA
//! sync, scheduler and memory counts, targets, ranks, the agent's own cost). Filled by the
//! pipeline, written by `render::summary`.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::event::Func;

mod cost;
pub use cost::{BPF_COST_METHOD, BpfCost, CallRuns, CostSplit, ProgramCost};

/// Per-NCCL-function totals.
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct OpStats {
    pub calls: u64,
    pub bytes: u64,
    /// Time inside the call (NCCL calls are asynchronous: this is enqueue time, not the
    /// collective's duration), and calls that returned an error: over the calls whose
    /// return was traced; null when none was (`call_returns = "needed"`).
    pub enqueue_ns: Option<u64>,
    pub errors: Option<u64>,
    /// Calls traced at entry only (counted, their bytes known, not their time or result).
    #[serde(skip_serializing_if = "crate::record::is_zero")]
    pub entry_only: u64,
}

/// NCCL totals.
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct NcclStats {
    /// Every traced NCCL API call: collectives, send/receive, group start/end,
    /// communicator setup and teardown.
    pub calls: u64,
    /// The calls that move data (collectives, send and receive): what `ranks[].nccl`
    /// and the steps count.
    pub collectives: u64,
    pub bytes: u64,
    /// Calls that returned an error, among those whose return was traced.
    pub errors: u64,
    /// Calls traced at entry only (`call_returns = "needed"`): their time inside NCCL,
    /// their result and any blocking inside them are not seen.
    #[serde(skip_serializing_if = "crate::record::is_zero")]
    pub entry_only: u64,
    pub by_op: BTreeMap<String, OpStats>,
}

/// Per-CUDA-sync-function totals.
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct SyncStats {
    pub calls: u64,
    pub wait_ns: u64,
}

/// CUDA driver synchronisation totals: where the host really waits.
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct CudaSyncStats {
    pub calls: u64,
    pub wait_ns: u64,
    pub by_func: BTreeMap<String, SyncStats>,
}

/// Scheduler totals over the target threads.
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct SchedStats {
    pub threads_seen: u64,
    pub switches_out: u64,
    pub involuntary_switches: u64,
    pub wakeups: u64,
    pub migrations: u64,
    pub forks: u64,
    pub thread_exits: u64,
}

/// Memory totals.
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct MemoryStats {
    /// User page faults of target threads; null where the profile had page faults off
    /// (none were traced: not zero).
    pub page_faults: Option<u64>,
    pub pages_migrated: u64,
    pub page_migrations_failed: u64,
    pub numa_task_events: u64,
    /// NUMA-balancing hinting faults of target threads, in pages: all, and those to a
    /// page on another node than the faulting CPU's; null where they were not traced
    /// (`methods.remote_memory` says why).
    pub numa_hint_fault_pages: Option<u64>,
    pub numa_hint_fault_pages_remote: Option<u64>,
    /// Readings of the targets' /proc/PID/numa_maps (taken while NUMA balancing is off);
    /// null where none were taken.
    pub numa_maps_readings: Option<u64>,
    /// Loads of target threads sampled by the PMU; null where no sampler was opened.
    pub pmu_load_samples: Option<u64>,
    /// Readings of target threads' node-load counters (no sampler, the PMU counts them);
    /// null where none were opened.
    pub node_load_readings: Option<u64>,
    /// Faults timed by fentry/fexit on the fault handler, where the kernel permits it.
    pub timed_faults: u64,
    /// Their time inside the handler.
    pub fault_handler_ns: u64,
    /// Each NUMA node's allocation counters (numastat: `numa_hit`, `numa_miss`,
    /// `numa_foreign`, `local_node`, `other_node`, …) from when tracing started to when it
    /// stopped, in pages, node-wide (every process's allocations); null without both
    /// readings (a recording made before they were taken, or no
    /// /sys/devices/system/node).
    pub numastat_pages: Option<BTreeMap<String, BTreeMap<String, u64>>>,
}

/// A target as the summary lists it.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct TargetSummary {
    pub pid: u32,
    pub comm: String,
    pub nccl_library: Option<String>,
    pub cuda_library: Option<String>,
    pub probes: usize,
    /// The CPython interpreter found in it: its version, whether its frames are named,
    /// and why not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub python: Option<crate::python::PythonInfo>,
    /// Python stacks taken of its threads.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub python_stacks: Option<u64>,
    /// Of those, the ones not walked again: the thread's current frame, innermost frame
    /// and its caller (each with its code object and instruction) were those of its
    /// previous off-CPU or call-entry walk, under a second before (profile
    /// `reuse_stacks`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub python_stacks_reused: Option<u64>,
}

/// What the agent itself cost.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct AgentStats {
    /// From the attach command's start to every probe attached: finding the targets and
    /// the doctor's report, beside loading and verifying the programs, then attaching
    /// (recordings before session 19: from the loading only, after the targets were found).
    pub attach_ms: f64,
    /// Where that went, phase by phase, in order (empty for older recordings).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub attach_phases_ms: Vec<AttachPhase>,
    /// How the uprobes were attached: "uprobe-multi links, one per target process, file
    /// and program" (one grace period per link to release at the stop) or "one
    /// perf-event uprobe per function, for the target process" / ", for every process"
    /// (one each); absent for older recordings.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub uprobes: Option<String>,
    /// How the kernel programs walked Python frames: "bpf_loop callback" (Linux 5.17+,
    /// verified once) or "unrolled loop (why)"; absent without Python frames.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub python_walk: Option<String>,
    /// Which scheduler tracepoints ran: "raw tracepoints (task_struct pid at N, cpu at M,
    /// from the kernel BTF)" or "formatted tracepoints (why not raw)"; absent without
    /// scheduler probes and for older recordings.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sched_tracepoints: Option<String>,
    /// Peak resident memory (VmHWM) of the whole agent process over the whole run, its
    /// end (reading back, attributing, writing every other output) included.
    pub peak_rss_kb: u64,
    /// The eBPF programs' own run time over the traced run; null when not measured,
    /// with the reason in `bpf_unmeasured`.
    pub bpf: Option<BpfCost>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bpf_unmeasured: Option<String>,
}

/// One phase of attaching.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct AttachPhase {
    pub phase: String,
    pub ms: f64,
}

impl AttachPhase {
    /// The phases as the recording's header has them (name, µs).
    #[must_use]
    pub fn all(phases: &[(String, u64)]) -> Vec<AttachPhase> {
        phases
            .iter()
            .map(|(phase, us)| AttachPhase {
                phase: phase.clone(),
                ms: *us as f64 / 1e3,
            })
            .collect()
    }
}

/// The GPUs read through NVML: each with its figures over the run, or why none was.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct GpuSummary {
    pub read: Vec<crate::attribute::GpuTotal>,
    /// Every how many milliseconds they were read.
    pub every_ms: Option<u64>,
    /// Which GPUs were chosen and how.
    pub chosen: Option<String>,
    /// Why none was read (null: they were).
    pub refused: Option<String>,
}

/// `summary.json`.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Summary {
    pub duration_ns: u64,
    pub start_unix_ns: u64,
    pub stop_reason: Option<String>,
    pub targets: Vec<TargetSummary>,
    pub nccl: NcclStats,
    pub cuda_sync: CudaSyncStats,
    pub sched: SchedStats,
    pub memory: MemoryStats,
    /// Each InfiniBand port's traffic and errors from its first reading to its last
    /// (absent where none was read; steps.json's `methods.infiniband` says why).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub infiniband: Option<crate::attribute::IbStep>,
    /// The GPUs the targets use, as NVML read them over the run.
    pub gpus: GpuSummary,
    pub events: u64,
    /// On-CPU samples of target threads.
    pub cpu_samples: u64,
    /// Stacks of target threads off the CPU.
    pub offcpu_stacks: u64,
    /// Which frames they have and when they were taken (only for long enough stretches,
    /// as threads came back, or at every switch-out and why); counters
    /// `offcpu_stacks_skipped_short` and `_ns` count the shorter stretches and their time.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub offcpu_stacks_taken: Option<String>,
    /// Stacks captured at the entry of traced calls (profile `call_stacks`).
    pub call_stacks: u64,
    /// Of `offcpu_stacks` and `call_stacks` (user frames only), those whose native frames
    /// were not unwound again: the thread was where it had been at its previous stack of
    /// that kind (same instruction, stack and frame pointers, innermost frame link),
    /// taken under a second before. Their Python frames are reused likewise (per target,
    /// `python_stacks_reused`).
    pub stacks_reused: u64,
    /// Reused native or Python frames whose earlier record is not in the recording (lost,
    /// or in an earlier window of a rotated recording): drawn without those frames.
    pub stacks_reused_unresolved: u64,
    pub undecodable_records: u64,
    pub lost_events: u64,
    pub lost_by_kind: BTreeMap<String, u64>,
    pub counters: BTreeMap<String, u64>,
    /// Every traced rank: its number and where it came from, its NCCL traffic, its
    /// training-loop thread's categories.
    pub ranks: Vec<crate::attribute::ranks::RankReport>,
    /// Processes that work for a rank (forked by it, no collective of their own), as
    /// steps.json gives them; absent when none.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub workers: Vec<crate::attribute::WorkerReport>,
    /// With several ranks of one job: the one whose late arrivals make the others wait
    /// most.
    pub straggler: Option<crate::attribute::ranks::Straggler>,
    /// With ranks of several jobs (as their launchers' environment names them): each job's
    /// straggler, its ranks matched among themselves; `straggler` is then null.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub stragglers_by_job: Vec<crate::attribute::ranks::Straggler>,
    /// The agent's own cost in the live run.
    pub agent: AgentStats,
    /// Set when the recording ended without its closing record (the agent was killed, or
    /// the file was cut): the numbers cover what was recorded.
    pub incomplete: Option<String>,
    /// Set when only the end of the run was attributed (`--max-attributed-events`).
    pub attributed: Option<String>,
    /// Set when damaged stretches in the middle of the recording were skipped (reading
    /// resumed at the next whole record): how many, how many bytes, where the first was.
    pub damaged: Option<String>,
}

/// What summary.json says of each target (`python_stacks`: Python stacks by pid, and
/// of them reused).
pub(crate) fn target_summaries(
    targets: &[crate::record::TargetInfo],
    python_stacks: &BTreeMap<u32, (u64, u64)>,
) -> Vec<TargetSummary> {
    targets
        .iter()
        .map(|t| TargetSummary {
            pid: t.pid,
            comm: t.comm.clone(),
            nccl_library: t.nccl_library.clone(),
            cuda_library: t.cuda_library.clone(),
            probes: t.probes.len(),
            python: t.python.clone(),
            python_stacks: t
                .python
                .as_ref()
                .map(|_| python_stacks.get(&t.pid).map_or(0, |n| n.0)),
            python_stacks_reused: t
                .python
                .as_ref()
                .map(|_| python_stacks.get(&t.pid).map_or(0, |n| n.1)),
        })
        .collect()
}

/// The CUDA sync totals of each function's.
pub(crate) fn cuda_totals(by_func: BTreeMap<Func, SyncStats>) -> CudaSyncStats {
    let mut cuda_sync = CudaSyncStats::default();
    for (func, s) in by_func {
        cuda_sync.calls += s.calls;
        cuda_sync.wait_ns = cuda_sync.wait_ns.saturating_add(s.wait_ns);
        cuda_sync.by_func.insert(func.name().to_owned(), s);
    }
    cuda_sync
}

/// NCCL totals from the per-function ones.
pub(crate) fn nccl_totals(by_func: BTreeMap<Func, OpStats>) -> NcclStats {
    let mut nccl = NcclStats::default();
    for (func, s) in by_func {
        nccl.calls += s.calls;
        if func.is_collective() {
            nccl.collectives += s.calls;
        }
        nccl.bytes = nccl.bytes.saturating_add(s.bytes);
        nccl.errors += s.errors.unwrap_or(0);
        nccl.entry_only += s.entry_only;
        nccl.by_op.insert(func.name().to_owned(), s);
    }
    nccl
}
