//! The attribution's output model: steps.json (`StepsReport`, its `Step`s), the per-thread
//! totals, how each category was measured, and how steps are to be found.

use std::collections::BTreeMap;

use serde::Serialize;

use super::steps::Method;
use super::{Categories, ranks, remote};

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
    /// How far `page_fault` may be off in this step where it is estimated (faults not
    /// timed): `methods.page_fault` says how; null where timed or not measured.
    pub page_fault_error_ns: Option<u64>,
    /// How far `gpu_wait` may be off in this step where part of it is the CUDA driver's
    /// yields counted from samples (two standard errors of their count plus one period);
    /// null where the run had none (boxed: few runs have it, and every step is copied).
    pub gpu_wait_error_ns: Option<Box<u64>>,
    pub nccl: NcclCount,
    pub faults: u64,
    pub migrations: u64,
    pub cross_node_migrations: u64,
    pub numa_page_migrations: u64,
    pub numa_task_moves: u64,
    /// The remote share of the rank thread's sampled memory accesses (NUMA hinting
    /// faults) that `remote_memory` is estimated from; `None` before its first such fault
    /// or when they were not traced.
    pub remote_access: Option<Box<remote::RemoteAccess>>,
    /// Where the PMU sampled loads (`methods.remote_memory_estimated` false): the rank
    /// thread's sampled DRAM loads in the step and those a remote node served.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub remote_loads: Option<Box<crate::pmu::MeasuredStep>>,
    /// Where InfiniBand ports were read: each port's traffic and errors in the step (an
    /// estimate, `methods.infiniband` says how).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub infiniband: Option<super::IbStep>,
    /// Each GPU NVML sampled over the step ([`super::gpu`]); `None` where none was read.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu: Option<Box<Vec<super::GpuStep>>>,
    /// With several ranks: the rank whose late arrivals made the others wait most in this
    /// step.
    pub slowest_rank: Option<i32>,
    /// With several ranks: each rank's training-loop thread over this step's interval.
    pub ranks: Vec<StepRank>,
}

impl Step {
    /// A step of `[start_ns, end_ns)` with `categories` and nothing else counted in it.
    #[must_use]
    pub fn new(index: usize, start_ns: u64, end_ns: u64, categories: Categories) -> Step {
        Step {
            index,
            start_ns,
            end_ns,
            wall_ns: end_ns.saturating_sub(start_ns),
            categories,
            page_fault_error_ns: None,
            gpu_wait_error_ns: None,
            nccl: NcclCount::default(),
            faults: 0,
            migrations: 0,
            cross_node_migrations: 0,
            numa_page_migrations: 0,
            numa_task_moves: 0,
            remote_access: None,
            remote_loads: None,
            infiniband: None,
            gpu: None,
            slowest_rank: None,
            ranks: Vec::new(),
        }
    }
}

/// A stretch of the run in which the rank issued no collectives (a warm-up sleep, data
/// loading, compilation, evaluation, a checkpoint, the end): not a step, left out of the
/// step statistics, shares and slowest steps.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Idle {
    pub start_ns: u64,
    pub end_ns: u64,
    pub wall_ns: u64,
    /// `before the first step`, `after the last step`, `between steps` (a pause), or `the
    /// whole run: no step`.
    pub when: &'static str,
    /// The rank thread's time in it, ns per category.
    #[serde(rename = "categories_ns")]
    pub categories: Categories,
    /// The rank thread's page faults in it, and the pages the kernel moved between NUMA
    /// nodes for it (a `migrate_pages()` call, balancing): counted as a step's are.
    pub faults: u64,
    pub numa_page_migrations: u64,
    /// The rank's collectives in it: none where it issued none (a sleep, loading, the
    /// end's teardown); else collectives that repeat as no step does (an evaluation's, a
    /// phase of other work) after steps were found.
    pub collectives: u64,
    /// Where the rank thread spent it, heaviest first: on-CPU stacks (sampled) and
    /// off-CPU ones (`[blocked]`, `[preempted]`), named once stacks are symbolized.
    pub top_stacks: Vec<BlockingStack>,
    /// The weights those come from: ns per (stack id, 0 on-CPU / 1 preempted / 2
    /// blocked).
    #[serde(skip)]
    pub stack_ns: BTreeMap<(u32, u8), u64>,
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

/// A process that works for a rank and is not one: forked by it (a DataLoader worker),
/// it issued no collective.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct WorkerReport {
    pub pid: u32,
    /// Its parent at attach.
    pub parent_pid: Option<u32>,
    /// The rank it works for: its pid, and its number as `ranks` gives it.
    pub rank_pid: u32,
    pub rank: Option<i32>,
    /// Its threads traced.
    pub threads: usize,
    /// All its threads over the traced interval, ns per category (its CPU is `compute`
    /// and `page_fault`; its waits the others).
    #[serde(rename = "categories_ns")]
    pub categories: Categories,
    pub faults: u64,
    pub migrations: u64,
}

/// How `gpu_wait`, `nccl_wait`, `remote_memory` and `page_fault` were obtained, or why not.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Methods {
    pub gpu_wait: String,
    pub nccl_wait: String,
    pub page_fault: String,
    pub remote_memory: String,
    pub remote_memory_estimated: bool,
    /// How the steps' `infiniband` were obtained, or why there are none.
    pub infiniband: String,
    /// How the steps' `gpu` were obtained, or why there are none.
    pub gpu: String,
}

/// A job whose rank the steps followed: a run under `--all --follow` sees job after job,
/// and each job's steps are its own rank's, found afresh (their period, their method).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct JobReport {
    /// The process and thread the job's steps are of.
    pub rank_pid: u32,
    pub rank_tid: u32,
    /// The job as the ranks' matching names it (the least `ncclUniqueId` of the
    /// communicators its ranks made together, the launcher's job id); absent where neither
    /// was seen.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub job: Option<String>,
    pub method: Method,
    pub reason: String,
    pub period: Option<usize>,
    /// Its steps: `steps` from index `first_step` on, in order.
    pub first_step: usize,
    pub steps: usize,
    /// From when its steps were looked for: the run's start, or the exit of the rank
    /// followed before it.
    pub followed_from_ns: u64,
    /// When its rank's process exited; null while it ran to the run's end.
    pub exited_ns: Option<u64>,
    /// Its steps that began before `followed_from_ns` (before tracing was armed, or while
    /// the job before it was followed): left out, not traced whole.
    pub steps_left_out: usize,
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
    /// The jobs the steps followed, in order (one where the run saw one job): a job's
    /// rank exited and another job's rank issued collectives after it.
    pub jobs: Vec<JobReport>,
    pub methods: Methods,
    pub steps: Vec<Step>,
    /// Stretches in which the rank issued no collectives, in order: not steps.
    pub idle: Vec<Idle>,
    /// Processes that work for a rank (forked by it, no collective of their own): not
    /// ranks. Absent when there are none.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub workers: Vec<WorkerReport>,
    pub threads: Vec<ThreadReport>,
    /// Where the rank thread was blocked for `other_offcpu`, heaviest first (filled once
    /// stacks are symbolized).
    pub other_offcpu_top_stacks: Vec<BlockingStack>,
    /// Where the rank thread waited with collectives outstanding (`nccl_wait`), heaviest
    /// first: with Python frames, the line that waited.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub nccl_wait_top_stacks: Vec<BlockingStack>,
    /// Where the rank thread waited for the GPU's own work (`gpu_wait`), heaviest first.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub gpu_wait_top_stacks: Vec<BlockingStack>,
    /// Every traced rank (one per target process).
    pub ranks: Vec<ranks::RankReport>,
    /// The communicators made, read or used while traced, with their sizes.
    pub communicators: Vec<super::CommReport>,
    /// Processes whose every collective was on a one-rank communicator: each a job of its
    /// own, matched with no other for the straggler.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub one_rank_jobs: Vec<u32>,
    /// The straggler, where the traced ranks are one job.
    pub straggler: Option<ranks::Straggler>,
    /// Where the traced ranks are of several jobs (the launchers' environment names them):
    /// each job's straggler, matched among its own ranks only; `straggler` is then null.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub stragglers_by_job: Vec<ranks::Straggler>,
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

#[cfg(test)]
mod tests {
    /// Every step is copied into its epoch's vector (on a run of one-call steps, a tenth
    /// of the attribution's time): the remote-memory figures few steps have are boxed, as
    /// are `gpu_wait_error_ns` and the GPUs' shares (272 bytes with `gpu_wait`, the two
    /// error bounds and the GPUs).
    #[test]
    fn a_step_keeps_its_remote_memory_out_of_line() {
        let size = size_of::<super::Step>();
        assert!(size <= 272, "Step is {size} bytes");
        let step = super::Step::new(0, 1, 2, super::Categories::default());
        let json = serde_json::to_value(&step).unwrap();
        assert_eq!(json["remote_access"], serde_json::Value::Null);
        assert!(json.get("remote_loads").is_none());
    }
}
