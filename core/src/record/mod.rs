//! Record stage: `recording.nctr`, written live and read back by `nccltrace report`.
//!
//! Layout (little-endian):
//! ```text
//! magic "NCCLTRC\0" | u32 format version | u32 header length | u32 header CRC-32 | header (JSON)
//! then records: u32 payload length | u32 payload CRC-32 | payload
//! payload: u8 type (1 = kernel record as the ring buffer gave it, 2 = agent metadata JSON) | body
//! ```
//! Raw kernel records go in as the ring buffer gave them so `report` runs the very decoder
//! the live run used; since format version 2, stack and Python stack records without their
//! unused slots (`decode::compact`: 10× smaller on the demo trainer's recording); since
//! version 3, record kinds an older reader does not know (`STACK_SAME`, `PY_FRAMES`), so
//! that it refuses the file by its version instead of counting them undecodable; since
//! version 4, `STACK_SAME` records that stand for a thread's previous Python frames; since
//! version 5, two such walks kept a thread (of its call-entry and of its off-CPU stacks),
//! the record saying which. Since version 6, a switch-out whose off-CPU stack is reused
//! whole says so in its switch record's flags instead of one or two `STACK_SAME` records.
//! Version 1 to 5 recordings are read too.
//! A truncated or damaged file is detected by the lengths and checksums; past damage in
//! the middle, reading resumes at the next record whose length and checksum hold, and the
//! bytes skipped are counted ([`Reader::damage`]).

use std::collections::BTreeMap;
use std::io;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

pub const MAGIC: &[u8; 8] = b"NCCLTRC\0";
pub const FORMAT_VERSION: u32 = 6;
/// The oldest format version this reader reads.
pub const OLDEST_FORMAT_VERSION: u32 = 1;
/// Records larger than this are taken as damage, not allocated.
const MAX_RECORD: u32 = 1 << 20;
const MAX_HEADER: u32 = 64 << 20;

const TYPE_KERNEL: u8 = 1;
const TYPE_META: u8 = 2;

/// Failures reading or writing a recording.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    #[error("cannot read {path}: {source}")]
    Open {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("writing the recording failed: {0}")]
    Write(#[source] io::Error),
    #[error("{path} is empty: expected a recording made by `nccltrace attach`")]
    Empty { path: PathBuf },
    #[error("{path} is not an nccltrace recording: expected the magic \"NCCLTRC\" at offset 0")]
    Foreign { path: PathBuf },
    #[error(
        "{path} has format version {version}; this nccltrace reads versions \
         {OLDEST_FORMAT_VERSION} to {FORMAT_VERSION}: use the nccltrace that made it"
    )]
    Version { path: PathBuf, version: u32 },
    #[error(
        "the recording's {what} record would be {bytes} bytes, over the {MAX_RECORD}-byte limit \
         of a record: it is left out"
    )]
    TooLarge { what: &'static str, bytes: usize },
    #[error("{path} is damaged at offset {offset}: expected {expected}")]
    Damaged {
        path: PathBuf,
        offset: u64,
        expected: String,
    },
}

impl RecordError {
    /// Whether the problem is the input the user gave (exit code 2).
    #[must_use]
    pub fn is_bad_input(&self) -> bool {
        !matches!(self, RecordError::Write(_) | RecordError::TooLarge { .. })
    }
}

/// Monotonic ↔ wall clock reference taken at attach.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct ClockRef {
    pub monotonic_ns: u64,
    pub realtime_ns: u64,
}

/// One attached probe, as the recording remembers it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct ProbeInfo {
    pub func: String,
    pub symbol: String,
    pub library: String,
    /// Where the probes sit.
    pub file_offset: u64,
    /// 4 bytes past the symbol, over the `endbr64` it opens with (a CET build).
    #[serde(default)]
    pub past_endbr64: bool,
}

/// A traced process.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct TargetInfo {
    pub pid: u32,
    pub comm: String,
    pub cmdline: Vec<String>,
    pub nccl_library: Option<String>,
    pub cuda_library: Option<String>,
    pub probes: Vec<ProbeInfo>,
    /// The target's executable and library mappings, kept so later stages can symbolize
    /// after the target has exited.
    #[serde(default)]
    pub maps: Vec<String>,
    /// Thread ids and names at attach.
    #[serde(default)]
    pub threads: Vec<(u32, String)>,
    /// `/proc/PID/maps` at attach: user frames are symbolized from it after the target
    /// has exited.
    #[serde(default)]
    pub maps_text: String,
    /// The rank from the environment at attach: (variable, value).
    #[serde(default)]
    pub env_rank: Option<(String, i32)>,
    /// The job from the launcher's environment at attach: (variable, value).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job: Option<(String, String)>,
    /// Where the job's ranks met to start, from the environment at attach
    /// (`MASTER_ADDR:MASTER_PORT`, torch.distributed's `env://`): two jobs on one host
    /// never share it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rendezvous: Option<String>,
    /// The job's size from the environment at attach: (variable, value). A job of one
    /// rank communicates nothing, whatever its communicators.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub world_size: Option<(String, i32)>,
    /// Where its NCCL library keeps a communicator's size and rank (read off the library's
    /// `ncclCommCount` and `ncclCommUserRank`), or why that is not known: communicators
    /// made before attach are read there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub comm_fields: Option<Result<CommFields, String>>,
    /// Its parent process at attach: a process a rank forked that issues no collective
    /// (a DataLoader worker) is that rank's worker, not a rank.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent_pid: Option<u32>,
    /// The CPython interpreter found in the target, and whether its frames are walked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub python: Option<crate::python::PythonInfo>,
}

/// Offsets into an NCCL communicator (`struct ncclComm`, private to each NCCL version).
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct CommFields {
    /// Of its number of ranks (`ncclCommCount`).
    pub nranks: u32,
    /// Of the process's rank in it (`ncclCommUserRank`), where found.
    pub rank: Option<u32>,
}

impl TargetInfo {
    /// The job as its launcher's environment names it (job id and rendezvous, where set),
    /// for matching only the ranks of one job: `SLURM_JOB_ID=4711, MASTER_ADDR:MASTER_PORT=
    /// 10.0.0.1:29500`.
    #[must_use]
    pub fn job_key(&self) -> Option<String> {
        let parts: Vec<String> = self
            .job
            .iter()
            .map(|(var, value)| format!("{var}={value}"))
            .chain(
                self.rendezvous
                    .iter()
                    .map(|r| format!("MASTER_ADDR:MASTER_PORT={r}")),
            )
            .collect();
        (!parts.is_empty()).then(|| parts.join(", "))
    }
}

/// What a recording starts with.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Header {
    pub format_version: u32,
    pub agent_version: String,
    pub kernel_release: String,
    pub hostname: String,
    pub clock: ClockRef,
    /// NUMA node of each CPU, indexed by CPU number (-1: unknown).
    pub cpu_nodes: Vec<i32>,
    pub profile: String,
    pub targets: Vec<TargetInfo>,
    /// On-CPU sampling period (0: no sampling).
    #[serde(default)]
    pub sample_period_ns: u64,
    /// Kernel address ranges of the page-fault handler (from /proc/kallsyms), to tell
    /// samples taken while handling a fault.
    #[serde(default)]
    pub fault_handler_ranges: Vec<(u64, u64)>,
    /// Kernel address ranges of the `sched_yield` system call (from /proc/kallsyms), to
    /// tell samples of the CUDA driver yielding while it waits for the GPU.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sched_yield_ranges: Vec<(u64, u64)>,
    /// `--step-nvtx` of the run: `report` cuts steps the same way unless told otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step_nvtx: Option<String>,
    /// How page faults were timed when fentry/fexit loaded ("fentry/fexit on
    /// handle_mm_fault"); `None`: by samples.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fault_timing: Option<String>,
    /// Why fentry/fexit fault timing was not used (the kernel refused it, or the profile
    /// has page faults off).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fault_timing_refused: Option<String>,
    /// The profile had page faults off: none were traced (their count is null, not 0).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub page_faults_off: bool,
    /// SLIT distances between NUMA nodes (`[a][b]`, 10 = local); empty: unknown.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub node_distances: Vec<Vec<u32>>,
    /// `kernel.numa_balancing` at attach (None: unreadable).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub numa_balancing: Option<u32>,
    /// Why NUMA hinting faults were not traced (the profile has numa off, or the kernel
    /// refused the kprobe on `task_numa_fault`); `None` (written as null): they were.
    #[serde(default = "hints_not_recorded")]
    pub numa_hints_refused: Option<String>,
    /// The PMU memory sampler opened on the targets' threads (`crate::pmu`), described.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mem_sampler: Option<String>,
    /// Why no memory sampler was opened (`None`, written as null: one was).
    #[serde(default = "mem_not_recorded")]
    pub mem_sampling_refused: Option<String>,
    /// The node-load counters opened on the targets' threads where no sampler was
    /// (`crate::pmu::NodeCounters`), described.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_counters: Option<String>,
    /// Why none were opened where no sampler was either.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_counting_refused: Option<String>,
    /// Every how many seconds the targets' numa_maps were read (NUMA balancing off or
    /// untraced on a host of several nodes); `None`: they were not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub numa_maps_every_s: Option<u64>,
    /// Why they were read (balancing off, hints untraced, or a target's memory under a
    /// policy balancing does not scan); `None` where not read or in older recordings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub numa_maps_why: Option<String>,
    /// The CPU's base frequency in kHz, which turns sampled latencies into time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_khz: Option<u64>,
    /// Why the programs' run time was not accounted (`None`, written as null: it was,
    /// in `program_stats` records).
    #[serde(default = "stats_not_recorded")]
    pub bpf_stats_refused: Option<String>,
    /// Which frames off-CPU stacks have and when they were taken (only for long enough
    /// stretches, or at every switch-out and why); `None`: the profile has them off, or
    /// the recording is older (kernel and user frames at every switch-out).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offcpu_stacks: Option<String>,
    /// Off-CPU stretches shorter than this (ns) have no stack (0: every stretch may).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub offcpu_min_ns: u64,
    /// Where attaching went: each phase and its microseconds, in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub attach_phases_us: Vec<(String, u64)>,
    /// How the uprobes were attached (uprobe-multi links or one per function); `None` in
    /// older recordings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uprobes: Option<String>,
    /// How the kernel programs walked Python frames ("bpf_loop callback", or "unrolled
    /// loop (why)"); `None` without Python frames and in older recordings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub python_walk: Option<String>,
    /// Which scheduler tracepoints ran: "raw (...)" or "formatted (why)"; `None` without
    /// scheduler probes and in older recordings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sched_tracepoints: Option<String>,
    /// The InfiniBand ports whose counters were read while tracing (`device/port`), in
    /// the order the `infiniband_counters` records index them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub infiniband_ports: Vec<String>,
    /// Every how many milliseconds they were read (`None`: they were not).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub infiniband_every_ms: Option<u64>,
    /// Why no InfiniBand counters were read (`None`, written as null: they were).
    #[serde(default = "ib_not_recorded")]
    pub infiniband_refused: Option<String>,
    /// The GPUs read through NVML while tracing, in the order the `gpu_reading` records
    /// index them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpus: Vec<GpuInfo>,
    /// Every how many milliseconds they were read (`None`: they were not).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_every_ms: Option<u64>,
    /// Which GPUs were chosen and how (the targets' open `/dev/nvidiaN`, or every GPU).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpus_chosen: Option<String>,
    /// Why no GPU was read (`None`, written as null: they were).
    #[serde(default = "gpu_not_recorded")]
    pub gpu_refused: Option<String>,
}

/// A GPU read through NVML.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct GpuInfo {
    pub name: String,
    pub uuid: String,
    /// Its `/dev/nvidiaN`'s N.
    pub minor: Option<u32>,
}

/// A recording without the field was made before nccltrace read GPUs.
#[expect(
    clippy::unnecessary_wraps,
    reason = "serde's default takes the field's type"
)]
fn gpu_not_recorded() -> Option<String> {
    Some("the recording was made by an nccltrace that did not read GPUs".to_owned())
}

#[expect(
    clippy::trivially_copy_pass_by_ref,
    reason = "serde's skip_serializing_if passes a reference"
)]
pub(crate) fn is_zero(v: &u64) -> bool {
    *v == 0
}

/// A recording without the field was made before nccltrace traced hinting faults.
#[expect(
    clippy::unnecessary_wraps,
    reason = "serde's default takes the field's type"
)]
fn hints_not_recorded() -> Option<String> {
    Some("the recording was made by an nccltrace that did not trace them".to_owned())
}

/// A recording without the field was made before nccltrace read a PMU memory sampler.
#[expect(
    clippy::unnecessary_wraps,
    reason = "serde's default takes the field's type"
)]
fn mem_not_recorded() -> Option<String> {
    Some("the recording was made by an nccltrace that did not sample memory loads".to_owned())
}

/// A recording without the field was made before nccltrace read InfiniBand counters.
#[expect(
    clippy::unnecessary_wraps,
    reason = "serde's default takes the field's type"
)]
fn ib_not_recorded() -> Option<String> {
    Some("the recording was made by an nccltrace that did not read InfiniBand counters".to_owned())
}

/// A recording without the field was made before nccltrace accounted its programs.
#[expect(
    clippy::unnecessary_wraps,
    reason = "serde's default takes the field's type"
)]
fn stats_not_recorded() -> Option<String> {
    Some(
        "the recording was made by an nccltrace that did not account its programs' run time"
            .to_owned(),
    )
}

/// One reading of the programs' run time, cumulative since they were loaded (the
/// recording's `program_stats` records).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProgramReading {
    /// CLOCK_MONOTONIC.
    pub at_ns: u64,
    /// (program, runs, run time in ns), every run on every CPU.
    pub programs: Vec<(String, u64, u64)>,
    /// How long, of the time since the first reading, the programs were accounted (in
    /// windows, profile `[cost] timing_ms`: by the programs themselves; by the kernel in
    /// recordings before 2026-12-07); `None` in older recordings, where it was on
    /// throughout.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accounted_ns: Option<u64>,
    /// (program, runs for traced threads, ns of those runs from the target check on), for
    /// the programs that time themselves (`nccltrace_common::timed`).
    #[serde(default)]
    pub traced: Vec<(String, u64, u64)>,
    /// What a traced call's uprobe and uretprobe traps cost on this host, measured once
    /// while tracing (ns a call), or why not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trap_ns: Option<u64>,
    /// The same for a call traced at entry only (its uprobe trap alone); `None` in older
    /// recordings, whose calls all had both.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub entry_trap_ns: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trap_refused: Option<String>,
    /// What one interrupt of a sampling clock costs the thread it lands on (ns), measured
    /// once while tracing where the profile samples, or why not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sample_interrupt_ns: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sample_interrupt_refused: Option<String>,
}

/// Agent metadata records.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Meta {
    /// Written last: why the run stopped and what was lost.
    End {
        end_monotonic_ns: u64,
        reason: String,
        lost_by_kind: BTreeMap<String, u64>,
        counters: BTreeMap<String, u64>,
        /// How long loading and attaching took.
        #[serde(default)]
        attach_ns: u64,
        /// The agent's peak resident memory (VmHWM).
        #[serde(default)]
        agent_peak_rss_kb: u64,
    },
    /// Names of the kernel frames seen in stacks, from /proc/kallsyms at the end of the
    /// live run, so `report` symbolizes kernel frames on any machine.
    KernelSymbols { symbols: Vec<(u64, String)> },
    /// Names of a target's JIT-compiled code (from its `/tmp/perf-PID.map`, as Python
    /// 3.12's perf trampolines write it), the entries its stacks touch: (start, size, name).
    JitSymbols {
        pid: u32,
        symbols: Vec<(u64, u64, String)>,
    },
    /// A target attached during the run (`--follow`): it joins the header's targets.
    Target { target: Box<TargetInfo> },
    /// The placement health report made at attach (`doctor.json`), so that `report`
    /// rebuilds it elsewhere.
    Doctor { report: serde_json::Value },
    /// Mappings of a target made after attach (libraries loaded since), read at the end
    /// of the run: `/proc/PID/maps` lines, added to the target's `maps_text`.
    Maps { pid: u32, added: String },
    /// Build ids of the files the user frames lie in, as the live run read them: `report`
    /// leaves frames of a file whose build id differs unnamed instead of naming them wrong.
    BuildIds {
        pid: u32,
        /// (path, build id in hex).
        files: Vec<(String, String)>,
    },
    /// The agent's peak resident memory (VmHWM) over the whole live run, taken after
    /// every output but summary.json was written: the recording's last record.
    AgentPeak { peak_rss_kb: u64 },
    /// Python code objects of a target, named while it ran, as its stacks first showed
    /// them: (address, name, file, line table), so that `report` names Python frames
    /// anywhere.
    PythonCodes {
        pid: u32,
        codes: Vec<(u64, crate::python::CodeInfo)>,
    },
    /// The programs' accounting of their own run time (`PROGRAM_COSTS`), cumulative
    /// since they were loaded. Written when tracing starts, every second, and when it stops.
    ProgramStats(ProgramReading),
    /// The NUMA nodes' allocation counters (`/sys/devices/system/node/nodeN/numastat`, in
    /// pages, node-wide), read when tracing starts and when it stops.
    Numastat {
        at_ns: u64,
        /// (node, (counter, pages)).
        nodes: Vec<(u32, Vec<(String, u64)>)>,
    },
}

impl Meta {
    /// The record's type name, as serialized.
    #[must_use]
    pub fn kind(&self) -> &'static str {
        match self {
            Meta::End { .. } => "end",
            Meta::KernelSymbols { .. } => "kernel_symbols",
            Meta::JitSymbols { .. } => "jit_symbols",
            Meta::Target { .. } => "target",
            Meta::Doctor { .. } => "doctor",
            Meta::AgentPeak { .. } => "agent_peak",
            Meta::BuildIds { .. } => "build_ids",
            Meta::Maps { .. } => "maps",
            Meta::PythonCodes { .. } => "python_codes",
            Meta::ProgramStats(_) => "program_stats",
            Meta::Numastat { .. } => "numastat",
        }
    }
}

/// One record read back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Record {
    Kernel(Vec<u8>),
    Meta(Meta),
}

mod read;
mod write;

pub use read::*;
pub use write::*;

#[cfg(test)]
mod tests;
