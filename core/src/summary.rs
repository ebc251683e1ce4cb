//! The output model of a run: what summary.json says (totals per NCCL function and CUDA
//! sync, scheduler and memory counts, targets, ranks, the agent's own cost). Filled by the
//! pipeline, written by `render::summary`.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::event::Func;

/// Per-NCCL-function totals.
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct OpStats {
    pub calls: u64,
    pub bytes: u64,
    /// Time inside the call (NCCL calls are asynchronous: this is enqueue time, not the
    /// collective's duration).
    pub enqueue_ns: u64,
    pub errors: u64,
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
    pub errors: u64,
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
    pub page_faults: u64,
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
    /// Faults timed by fentry/fexit on the fault handler, where the kernel permits it.
    pub timed_faults: u64,
    /// Their time inside the handler.
    pub fault_handler_ns: u64,
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
    /// Python stacks (frames walked) taken of its threads.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub python_stacks: Option<u64>,
}

/// What the agent itself cost.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct AgentStats {
    /// Loading the programs and attaching every probe.
    pub attach_ms: f64,
    /// Peak resident memory (VmHWM) of the whole agent process over the whole run, its
    /// end (reading back, attributing, writing every other output) included.
    pub peak_rss_kb: u64,
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
    pub events: u64,
    /// On-CPU samples of target threads.
    pub cpu_samples: u64,
    /// Stacks captured as target threads left the CPU.
    pub offcpu_stacks: u64,
    /// Stacks captured at the entry of traced calls (profile `call_stacks`).
    pub call_stacks: u64,
    pub undecodable_records: u64,
    pub lost_events: u64,
    pub lost_by_kind: BTreeMap<String, u64>,
    pub counters: BTreeMap<String, u64>,
    /// Every traced rank: its number and where it came from, its NCCL traffic, its
    /// training-loop thread's categories.
    pub ranks: Vec<crate::attribute::ranks::RankReport>,
    /// With several ranks: the one whose late arrivals make the others wait most.
    pub straggler: Option<crate::attribute::ranks::Straggler>,
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

/// What summary.json says of each target (`python_stacks`: Python stacks by pid).
pub(crate) fn target_summaries(
    targets: &[crate::record::TargetInfo],
    python_stacks: &BTreeMap<u32, u64>,
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
                .map(|_| python_stacks.get(&t.pid).copied().unwrap_or(0)),
        })
        .collect()
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
        nccl.errors += s.errors;
        nccl.by_op.insert(func.name().to_owned(), s);
    }
    nccl
}
