//! Record stage: `recording.nctr`, written live and read back by `nccltrace report`.
//!
//! Layout (little-endian):
//! ```text
//! magic "NCCLTRC\0" | u32 format version | u32 header length | u32 header CRC-32 | header (JSON)
//! then records: u32 payload length | u32 payload CRC-32 | payload
//! payload: u8 type (1 = kernel record as the ring buffer gave it, 2 = agent metadata JSON) | body
//! ```
//! Raw kernel records go in unchanged so `report` runs the very decoder the live run used.
//! A truncated or damaged file is detected by the lengths and checksums; past damage in
//! the middle, reading resumes at the next record whose length and checksum hold, and the
//! bytes skipped are counted ([`Reader::damage`]).

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{self, BufRead, BufReader, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

pub const MAGIC: &[u8; 8] = b"NCCLTRC\0";
pub const FORMAT_VERSION: u32 = 1;
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
        "{path} has format version {version}; this nccltrace reads version {FORMAT_VERSION}: \
         use the nccltrace that made it"
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
    /// The CPython interpreter found in the target, and whether its frames are walked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub python: Option<crate::python::PythonInfo>,
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
    /// Every how many seconds the targets' numa_maps were read (NUMA balancing off or
    /// untraced on a host of several nodes); `None`: they were not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub numa_maps_every_s: Option<u64>,
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
    /// The kernel's accounting of the programs' run time (BPF_ENABLE_STATS), cumulative
    /// since they were loaded. Written when tracing starts, every second, and when it stops.
    ProgramStats(ProgramReading),
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
        }
    }
}

/// One record read back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Record {
    Kernel(Vec<u8>),
    Meta(Meta),
}

/// Writes a recording as the run goes. Records are gathered in memory and written a
/// megabyte at a time; the file only ever holds whole records: when a write fails (a full
/// disk) the file is cut back to the last whole record and the records not written stay
/// available through [`Writer::take_unwritten`], so nothing collected is lost.
pub struct Writer {
    file: File,
    buf: Vec<u8>,
    /// Bytes of whole records known to be in the file.
    durable: u64,
    records: u64,
    failed: bool,
    /// Published for a reader following the file as it is written ([`Follow`]).
    progress: std::sync::Arc<Progress>,
}

/// How far a recording being written holds whole records, and whether more will come:
/// what a [`Follow`] reader may read.
#[derive(Debug, Default)]
pub struct Progress {
    durable: std::sync::atomic::AtomicU64,
    closed: std::sync::atomic::AtomicBool,
}

impl Progress {
    /// Bytes of the recording written and flushed so far.
    #[must_use]
    pub fn durable(&self) -> u64 {
        self.durable.load(std::sync::atomic::Ordering::Acquire)
    }

    /// No more records will be read by followers (the rest of the run is handled
    /// otherwise, or the run is over): they end at what is in the file now.
    pub fn close(&self) {
        self.closed
            .store(true, std::sync::atomic::Ordering::Release);
    }
}

/// A recording read while it is written: reads stop at the last whole record the writer
/// flushed and wait (polling every 20 ms) for more, until the writer's [`Progress`] is
/// closed; then the end of what was written is the end of the file.
pub struct Follow {
    file: File,
    pos: u64,
    progress: std::sync::Arc<Progress>,
}

impl Follow {
    /// A reader of the recording at `path` being written with `progress`.
    pub fn open(
        path: &Path,
        progress: std::sync::Arc<Progress>,
    ) -> Result<Reader<BufReader<Follow>>, RecordError> {
        let file = File::open(path).map_err(|source| RecordError::Open {
            path: path.to_owned(),
            source,
        })?;
        let follow = Follow {
            file,
            pos: 0,
            progress: progress.clone(),
        };
        let mut reader = Reader::new(BufReader::with_capacity(1 << 16, follow), path)?;
        reader.follow = Some(progress);
        Ok(reader)
    }
}

impl Read for Follow {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        use std::sync::atomic::Ordering::Acquire;
        loop {
            // Closed is read first: the durable length read after it is final.
            let closed = self.progress.closed.load(Acquire);
            let durable = self.progress.durable.load(Acquire);
            if durable > self.pos {
                let n = usize::try_from(durable - self.pos)
                    .unwrap_or(usize::MAX)
                    .min(buf.len());
                let got = self.file.read(&mut buf[..n])?;
                self.pos += got as u64;
                if got > 0 || n == 0 {
                    return Ok(got);
                }
            }
            if closed {
                return Ok(0);
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
}

impl Seek for Follow {
    fn seek(&mut self, to: SeekFrom) -> io::Result<u64> {
        self.pos = self.file.seek(to)?;
        Ok(self.pos)
    }
}

const WRITE_CHUNK: usize = 1 << 20;

impl Writer {
    /// Creates `path` (which must not exist) and writes the header.
    pub fn create(path: &Path, header: &Header) -> Result<Writer, RecordError> {
        let file = File::options()
            .write(true)
            .create_new(true)
            .open(path)
            .map_err(|source| RecordError::Open {
                path: path.to_owned(),
                source,
            })?;
        let json = serde_json::to_vec(header).map_err(|e| RecordError::Write(e.into()))?;
        let mut buf = Vec::with_capacity(WRITE_CHUNK + 4096);
        buf.extend_from_slice(MAGIC);
        buf.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        buf.extend_from_slice(&(json.len() as u32).to_le_bytes());
        buf.extend_from_slice(&crc32fast::hash(&json).to_le_bytes());
        buf.extend_from_slice(&json);
        let mut w = Writer {
            file,
            buf,
            durable: 0,
            records: 0,
            failed: false,
            progress: std::sync::Arc::default(),
        };
        w.flush()?;
        Ok(w)
    }

    /// Writes the gathered records. On failure the file is cut back to its whole records
    /// and the writer refuses further writes; the records stay in [`Writer::take_unwritten`].
    pub fn flush(&mut self) -> Result<(), RecordError> {
        if self.failed {
            return Err(RecordError::Write(io::Error::other(
                "an earlier write of the recording failed",
            )));
        }
        if self.buf.is_empty() {
            return Ok(());
        }
        if let Err(e) = self.file.write_all(&self.buf) {
            self.failed = true;
            // Part of the chunk may have reached the file: drop it, so that the file ends
            // on a whole record. Shrinking a file works on a full disk.
            let _ = self.file.set_len(self.durable);
            let _ = io::Seek::seek(&mut self.file, io::SeekFrom::Start(self.durable));
            return Err(RecordError::Write(e));
        }
        self.durable += self.buf.len() as u64;
        self.buf.clear();
        self.progress
            .durable
            .store(self.durable, std::sync::atomic::Ordering::Release);
        Ok(())
    }

    /// What a reader following this recording ([`Follow`]) goes by.
    #[must_use]
    pub fn progress(&self) -> std::sync::Arc<Progress> {
        self.progress.clone()
    }

    fn write(&mut self, kind: u8, body: &[u8]) -> Result<(), RecordError> {
        let mut hasher = crc32fast::Hasher::new();
        hasher.update(&[kind]);
        hasher.update(body);
        let len = (body.len() + 1) as u32;
        self.buf.extend_from_slice(&len.to_le_bytes());
        self.buf.extend_from_slice(&hasher.finalize().to_le_bytes());
        self.buf.push(kind);
        self.buf.extend_from_slice(body);
        self.records += 1;
        if self.buf.len() >= WRITE_CHUNK {
            self.flush()?;
        }
        Ok(())
    }

    /// Appends a kernel record exactly as received.
    pub fn kernel(&mut self, bytes: &[u8]) -> Result<(), RecordError> {
        self.write(TYPE_KERNEL, bytes)
    }

    /// Appends agent metadata. Symbol tables larger than a record may be are written as
    /// several records (the reader joins them); any other metadata that large is refused
    /// (the reader would take it for damage).
    pub fn meta(&mut self, meta: &Meta) -> Result<(), RecordError> {
        let json = serde_json::to_vec(meta).map_err(|e| RecordError::Write(e.into()))?;
        if json.len() < MAX_RECORD as usize {
            return self.write(TYPE_META, &json);
        }
        let halves = match meta {
            Meta::KernelSymbols { symbols } if symbols.len() > 1 => {
                let (a, b) = symbols.split_at(symbols.len() / 2);
                [
                    Meta::KernelSymbols {
                        symbols: a.to_vec(),
                    },
                    Meta::KernelSymbols {
                        symbols: b.to_vec(),
                    },
                ]
            }
            Meta::JitSymbols { pid, symbols } if symbols.len() > 1 => {
                let (a, b) = symbols.split_at(symbols.len() / 2);
                [
                    Meta::JitSymbols {
                        pid: *pid,
                        symbols: a.to_vec(),
                    },
                    Meta::JitSymbols {
                        pid: *pid,
                        symbols: b.to_vec(),
                    },
                ]
            }
            _ => {
                return Err(RecordError::TooLarge {
                    what: meta.kind(),
                    bytes: json.len(),
                });
            }
        };
        halves.iter().try_for_each(|half| self.meta(half))
    }

    /// Records written so far.
    #[must_use]
    pub fn records(&self) -> u64 {
        self.records
    }

    /// After a failed write: the records that are not in the file, in the recording's
    /// record framing (read them with [`Reader::records_only`]).
    pub fn take_unwritten(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.buf)
    }

    /// Writes everything gathered and waits until it is on disk.
    pub fn sync(&mut self) -> Result<(), RecordError> {
        self.flush()?;
        self.file.sync_data().map_err(RecordError::Write)
    }

    /// Flushes everything to disk.
    pub fn finish(mut self) -> Result<(), RecordError> {
        self.sync()
    }
}

/// Whether `bytes` do not match their stored CRC-32. Under the fuzzer (`cfg(fuzzing)`)
/// checksums are not checked, so that mutated inputs reach the decoder behind them.
fn checksum_differs(bytes: &[u8], crc: u32) -> bool {
    !cfg!(fuzzing) && crc32fast::hash(bytes) != crc
}

/// Reads a recording back.
pub struct Reader<R> {
    input: R,
    path: PathBuf,
    offset: u64,
    /// The current record's payload when it was copied (reused).
    payload: Vec<u8>,
    /// Bytes of the input's buffer the record last returned lies in, consumed at the
    /// next read.
    consume: usize,
    damage: Damage,
    pub header: Header,
    /// When the recording is read while it is written ([`Follow`]): how far it is.
    follow: Option<std::sync::Arc<Progress>>,
}

/// Damaged stretches a reader skipped to resume at the next whole record.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Damage {
    /// How many damaged stretches.
    pub regions: u64,
    /// Bytes skipped over them.
    pub bytes: u64,
    /// Where the first began (offset in the file), and what was expected there.
    pub first: Option<(u64, String)>,
}

impl std::fmt::Display for Damage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} damaged stretch(es) skipped, {} bytes in all (the records in them are lost)",
            self.regions, self.bytes
        )?;
        if let Some((offset, expected)) = &self.first {
            write!(
                f,
                "; the first at offset {offset}, where {expected} was expected"
            )?;
        }
        Ok(())
    }
}

/// Candidate starts examined per read while looking for the next whole record: with a
/// window of twice this (plus a prefix), a record of the largest size starting at any
/// candidate lies whole in the window.
const SCAN_STEP: usize = MAX_RECORD as usize;

impl Reader<BufReader<File>> {
    /// Opens `path` and reads its header.
    pub fn open(path: &Path) -> Result<Self, RecordError> {
        let file = File::open(path).map_err(|source| RecordError::Open {
            path: path.to_owned(),
            source,
        })?;
        Reader::new(BufReader::with_capacity(1 << 20, file), path)
    }
}

/// Reads up to `buf.len()` bytes; returns how many were there (short at end of file).
fn read_full(input: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut filled = 0;
    while filled < buf.len() {
        match input.read(&mut buf[filled..]) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(filled)
}

impl<R: BufRead> Reader<R> {
    /// Reads the header from `input`; `path` is only used in messages.
    pub fn new(mut input: R, path: &Path) -> Result<Self, RecordError> {
        let open_err = |source| RecordError::Open {
            path: path.to_owned(),
            source,
        };
        let damaged = |offset: u64, expected: &str| RecordError::Damaged {
            path: path.to_owned(),
            offset,
            expected: expected.to_owned(),
        };
        let mut fixed = [0u8; 20];
        let got = read_full(&mut input, &mut fixed).map_err(open_err)?;
        if got == 0 {
            return Err(RecordError::Empty {
                path: path.to_owned(),
            });
        }
        if got < 8 || &fixed[..8] != MAGIC {
            return Err(RecordError::Foreign {
                path: path.to_owned(),
            });
        }
        if got < 20 {
            return Err(damaged(
                got as u64,
                "a 20-byte file header (file is truncated)",
            ));
        }
        let version = u32::from_le_bytes(fixed[8..12].try_into().unwrap_or_default());
        if version != FORMAT_VERSION {
            return Err(RecordError::Version {
                path: path.to_owned(),
                version,
            });
        }
        let len = u32::from_le_bytes(fixed[12..16].try_into().unwrap_or_default());
        let crc = u32::from_le_bytes(fixed[16..20].try_into().unwrap_or_default());
        if len > MAX_HEADER {
            return Err(damaged(12, "a header length below 64 MiB"));
        }
        let mut json = vec![0u8; len as usize];
        if read_full(&mut input, &mut json).map_err(open_err)? < json.len() {
            return Err(damaged(
                20,
                &format!("a {len}-byte header (file is truncated)"),
            ));
        }
        if checksum_differs(&json, crc) {
            return Err(damaged(20, "a header matching its checksum"));
        }
        let header: Header = serde_json::from_slice(&json)
            .map_err(|e| damaged(20, &format!("a valid JSON header ({e})")))?;
        Ok(Reader {
            input,
            path: path.to_owned(),
            offset: 20 + u64::from(len),
            payload: Vec::new(),
            consume: 0,
            damage: Damage::default(),
            header,
            follow: None,
        })
    }

    /// Reads bare records (no file header) from `input`, as [`Writer::take_unwritten`]
    /// gives them; `header` is the recording's.
    pub fn records_only(input: R, path: &Path, header: Header) -> Self {
        Reader {
            input,
            path: path.to_owned(),
            offset: 0,
            payload: Vec::new(),
            consume: 0,
            damage: Damage::default(),
            header,
            follow: None,
        }
    }

    /// True when the next record is not written yet and reading it would wait for the
    /// writer (a recording followed as it is written, caught up); false otherwise.
    #[must_use]
    pub fn would_wait(&self) -> bool {
        use std::sync::atomic::Ordering::Acquire;
        self.follow
            .as_ref()
            .is_some_and(|p| !p.closed.load(Acquire) && p.durable.load(Acquire) <= self.offset)
    }

    /// The damaged stretches skipped so far.
    #[must_use]
    pub fn damage(&self) -> &Damage {
        &self.damage
    }
}

impl<R: BufRead + Seek> Reader<R> {
    /// The next record; `Ok(None)` at a clean end of file.
    pub fn next_record(&mut self) -> Result<Option<Record>, RecordError> {
        Ok(self.next_raw()?.map(|r| match r {
            RawRecord::Kernel(bytes) => Record::Kernel(bytes.to_vec()),
            RawRecord::Meta(meta) => Record::Meta(meta),
        }))
    }

    /// As [`Reader::next_record`], a kernel record borrowed from the reader's buffer (no
    /// allocation per record; no copy when the record lies whole in the input's buffer).
    /// Past a damaged record, reading resumes at the next whole one (counted in
    /// [`Reader::damage`]); damage with no whole record after it (a cut file) is the error.
    pub fn next_raw(&mut self) -> Result<Option<RawRecord<'_>>, RecordError> {
        let located = loop {
            let start = self.offset;
            let expected = match self.locate() {
                Err(RecordError::Damaged { expected, .. }) => expected,
                other => break other?,
            };
            let resynced = self.resync(start + 1);
            let Some(found) = resynced.map_err(|source| RecordError::Open {
                path: self.path.clone(),
                source,
            })?
            else {
                return Err(RecordError::Damaged {
                    path: self.path.clone(),
                    offset: start,
                    expected,
                });
            };
            self.damage.regions += 1;
            self.damage.bytes += found - start;
            self.damage.first.get_or_insert((start, expected));
        };
        let Some(located) = located else {
            return Ok(None);
        };
        Ok(Some(match located {
            Located::Meta(meta) => RawRecord::Meta(meta),
            Located::Copied => RawRecord::Kernel(&self.payload[1..]),
            Located::InBuffer { len } => {
                // The record was not consumed yet: this returns the same buffer, unread.
                let buffered = self.input.fill_buf().map_err(|source| RecordError::Open {
                    path: self.path.clone(),
                    source,
                })?;
                RawRecord::Kernel(&buffered[9..8 + len])
            }
        }))
    }

    /// Finds the first offset at or after `from` where a whole record lies (its length in
    /// range, its checksum matching, a known type, valid metadata) and positions the input
    /// there. `None`: no such record before the end.
    fn resync(&mut self, from: u64) -> io::Result<Option<u64>> {
        self.consume = 0;
        let mut base = from;
        let mut window: Vec<u8> = Vec::with_capacity(2 * SCAN_STEP + 8);
        loop {
            self.input.seek(SeekFrom::Start(base))?;
            window.resize(2 * SCAN_STEP + 8, 0);
            let got = read_full(&mut self.input, &mut window)?;
            window.truncate(got);
            let candidates = got.min(SCAN_STEP);
            for i in 0..candidates {
                if whole_record_at(&window[i..]) {
                    let found = base + i as u64;
                    self.input.seek(SeekFrom::Start(found))?;
                    self.offset = found;
                    return Ok(Some(found));
                }
            }
            if got <= SCAN_STEP {
                return Ok(None);
            }
            base += SCAN_STEP as u64;
        }
    }
}

/// Whether `bytes` open with a whole, valid record.
fn whole_record_at(bytes: &[u8]) -> bool {
    let Some(prefix) = bytes.get(..8) else {
        return false;
    };
    let len = u32::from_le_bytes(prefix[..4].try_into().unwrap_or_default());
    let crc = u32::from_le_bytes(prefix[4..].try_into().unwrap_or_default());
    if !(1..=MAX_RECORD).contains(&len) {
        return false;
    }
    let Some(payload) = bytes.get(8..8 + len as usize) else {
        return false;
    };
    !checksum_differs(payload, crc)
        && parse_payload(payload, crc, |_| RecordError::Write(io::Error::other(""))).is_ok()
}

impl<R: BufRead> Reader<R> {
    /// Checks the next record as it lies (damage is an error) and moves past it; a kernel
    /// record's bytes stay where [`Located`] says.
    fn locate(&mut self) -> Result<Option<Located>, RecordError> {
        self.input.consume(std::mem::take(&mut self.consume));
        let start = self.offset;
        let damaged = |expected: String| RecordError::Damaged {
            path: self.path.clone(),
            offset: start,
            expected,
        };
        let open = |source| RecordError::Open {
            path: self.path.clone(),
            source,
        };
        // (length, checksum) of a record lying whole in the input's buffer.
        let whole = {
            let buffered = self.input.fill_buf().map_err(open)?;
            if buffered.is_empty() {
                return Ok(None);
            }
            let field =
                |at: usize| u32::from_le_bytes(buffered[at..at + 4].try_into().unwrap_or_default());
            (buffered.len() >= 8)
                .then(|| (field(0), field(4)))
                .filter(|(len, _)| {
                    (1..=MAX_RECORD).contains(len) && buffered.len() - 8 >= *len as usize
                })
        };
        if let Some((len, crc)) = whole {
            self.offset += 8 + u64::from(len);
            self.consume = 8 + len as usize;
            // The buffer is not empty, so this returns it again without reading.
            let buffered = self.input.fill_buf().map_err(open)?;
            return Ok(
                parse_payload(&buffered[8..8 + len as usize], crc, damaged)?.map(|r| match r {
                    RawRecord::Kernel(_) => Located::InBuffer { len: len as usize },
                    RawRecord::Meta(meta) => Located::Meta(meta),
                }),
            );
        }
        // A record across the end of the input's buffer (or a damaged length): copied.
        let mut prefix = [0u8; 8];
        let got = read_full(&mut self.input, &mut prefix).map_err(open)?;
        if got < 8 {
            return Err(damaged(
                "an 8-byte record prefix (file is truncated)".into(),
            ));
        }
        let len = u32::from_le_bytes(prefix[..4].try_into().unwrap_or_default());
        let crc = u32::from_le_bytes(prefix[4..].try_into().unwrap_or_default());
        if len == 0 || len > MAX_RECORD {
            return Err(damaged(format!(
                "a record length between 1 and {MAX_RECORD}, found {len}"
            )));
        }
        self.payload.resize(len as usize, 0);
        let got = read_full(&mut self.input, &mut self.payload).map_err(open)?;
        if got < self.payload.len() {
            return Err(damaged(format!(
                "a {len}-byte record, found {got} (file is truncated)"
            )));
        }
        self.offset += 8 + u64::from(len);
        Ok(
            parse_payload(&self.payload, crc, damaged)?.map(|r| match r {
                RawRecord::Kernel(_) => Located::Copied,
                RawRecord::Meta(meta) => Located::Meta(meta),
            }),
        )
    }
}

/// Where a checked record lies.
enum Located {
    /// Whole in the input's buffer, `len` payload bytes after the 8-byte prefix.
    InBuffer {
        len: usize,
    },
    /// In the reader's own payload buffer.
    Copied,
    Meta(Meta),
}

/// A record's payload (after its length and checksum): checked against `crc`, then its
/// type byte and the body.
fn parse_payload(
    payload: &[u8],
    crc: u32,
    damaged: impl Fn(String) -> RecordError,
) -> Result<Option<RawRecord<'_>>, RecordError> {
    if checksum_differs(payload, crc) {
        return Err(damaged("a record matching its checksum".into()));
    }
    let (kind, body) = (payload[0], &payload[1..]);
    match kind {
        TYPE_KERNEL => Ok(Some(RawRecord::Kernel(body))),
        TYPE_META => serde_json::from_slice(body)
            .map(|m| Some(RawRecord::Meta(m)))
            .map_err(|e| damaged(format!("valid metadata JSON ({e})"))),
        other => Err(damaged(format!("record type 1 or 2, found {other}"))),
    }
}

/// One record read back, a kernel record borrowed from the reader.
#[derive(Debug, PartialEq, Eq)]
pub enum RawRecord<'a> {
    Kernel(&'a [u8]),
    Meta(Meta),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header() -> Header {
        Header {
            format_version: FORMAT_VERSION,
            kernel_release: "6.18".into(),
            cpu_nodes: vec![0, 0],
            targets: vec![TargetInfo {
                pid: 7,
                comm: "trainer".into(),
                ..Default::default()
            }],
            ..Default::default()
        }
    }

    fn write_sample(dir: &Path) -> PathBuf {
        let path = dir.join("r.nctr");
        let mut w = Writer::create(&path, &header()).unwrap();
        w.kernel(&[1, 2, 3]).unwrap();
        w.kernel(&[4; 100]).unwrap();
        w.meta(&Meta::End {
            end_monotonic_ns: 5,
            reason: "target exited".into(),
            lost_by_kind: BTreeMap::new(),
            counters: BTreeMap::new(),
            attach_ns: 0,
            agent_peak_rss_kb: 0,
        })
        .unwrap();
        w.finish().unwrap();
        path
    }

    fn read_all(path: &Path) -> Result<Vec<Record>, RecordError> {
        let mut r = Reader::open(path)?;
        let mut out = Vec::new();
        while let Some(rec) = r.next_record()? {
            out.push(rec);
        }
        Ok(out)
    }

    /// What is written comes back identical, header and records.
    #[test]
    fn round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let path = write_sample(dir.path());
        assert_eq!(Reader::open(&path).unwrap().header, header());
        let recs = read_all(&path).unwrap();
        assert_eq!(recs.len(), 3);
        assert_eq!(recs[0], Record::Kernel(vec![1, 2, 3]));
        assert!(matches!(recs[2], Record::Meta(Meta::End { .. })));
    }

    /// Truncation anywhere is reported with an offset; the records before it still read.
    #[test]
    fn truncated_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = write_sample(dir.path());
        let full = std::fs::read(&path).unwrap();
        for cut in [full.len() - 1, full.len() - 60, 30, 19, 5] {
            std::fs::write(&path, &full[..cut]).unwrap();
            match read_all(&path) {
                Err(RecordError::Damaged { .. } | RecordError::Foreign { .. }) => {}
                other => panic!("cut at {cut}: {other:?}"),
            }
        }
        std::fs::write(&path, &full[..full.len() - 1]).unwrap();
        let mut r = Reader::open(&path).unwrap();
        assert!(r.next_record().unwrap().is_some());
        assert!(r.next_record().unwrap().is_some());
        let err = r.next_record().unwrap_err();
        assert!(err.to_string().contains("offset"), "{err}");
    }

    /// Records are read in place when they lie whole in the input's buffer and copied when
    /// they cross its end: every buffer size gives the same records, and damage is found
    /// either way.
    #[test]
    fn records_across_buffer_edges() {
        let dir = tempfile::tempdir().unwrap();
        let path = write_sample(dir.path());
        let expected = read_all(&path).unwrap();
        let read_with = |capacity: usize| -> Result<Vec<Record>, RecordError> {
            let file = BufReader::with_capacity(capacity, File::open(&path).unwrap());
            let mut r = Reader::new(file, &path)?;
            let mut out = Vec::new();
            while let Some(rec) = r.next_record()? {
                out.push(rec);
            }
            Ok(out)
        };
        for capacity in [1, 7, 8, 9, 13, 30, 64, 4096] {
            assert_eq!(
                read_with(capacity).unwrap(),
                expected,
                "buffer of {capacity}"
            );
        }
        let mut bytes = std::fs::read(&path).unwrap();
        let n = bytes.len();
        bytes[n - 10] ^= 0xff;
        std::fs::write(&path, &bytes).unwrap();
        for capacity in [7, 4096] {
            assert!(matches!(
                read_with(capacity),
                Err(RecordError::Damaged { .. })
            ));
        }
    }

    /// A flipped byte in a record fails its checksum; empty and foreign files are named.
    #[test]
    fn damaged_empty_foreign() {
        let dir = tempfile::tempdir().unwrap();
        let path = write_sample(dir.path());
        let mut bytes = std::fs::read(&path).unwrap();
        let n = bytes.len();
        bytes[n - 10] ^= 0xff;
        std::fs::write(&path, &bytes).unwrap();
        assert!(matches!(read_all(&path), Err(RecordError::Damaged { .. })));
        std::fs::write(&path, b"").unwrap();
        assert!(matches!(read_all(&path), Err(RecordError::Empty { .. })));
        std::fs::write(&path, b"{\"not\": \"a recording\"}").unwrap();
        assert!(matches!(read_all(&path), Err(RecordError::Foreign { .. })));
    }

    /// Regression (issue 17): one damaged byte in the middle dropped every record after it.
    /// Now reading resumes at the next whole record, whatever was damaged (a payload byte,
    /// a length, a checksum) and however the input is buffered, and the skipped stretch
    /// is counted; several megabytes of garbage are crossed too.
    #[test]
    fn resumes_after_damage_in_the_middle() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r.nctr");
        let mut w = Writer::create(&path, &header()).unwrap();
        let mut starts = Vec::new();
        let header_len = std::fs::metadata(&path).unwrap().len() as usize;
        let mut at = header_len;
        for i in 0..100u32 {
            let body = vec![(i % 251) as u8; 10 + (i as usize * 37) % 300];
            starts.push(at);
            at += 8 + 1 + body.len();
            w.kernel(&body).unwrap();
        }
        w.finish().unwrap();
        let clean = std::fs::read(&path).unwrap();
        let read_with = |bytes: &[u8], capacity: usize| {
            let mut r = Reader::new(
                BufReader::with_capacity(capacity, io::Cursor::new(bytes)),
                &path,
            )
            .unwrap();
            let mut out = Vec::new();
            while let Some(rec) = r.next_record().unwrap() {
                out.push(rec);
            }
            (out, r.damage().clone())
        };
        // Record 50's payload, its length field, its checksum.
        for (what, at) in [
            ("payload", starts[50] + 12),
            ("length", starts[50] + 2),
            ("crc", starts[50] + 5),
        ] {
            let mut bytes = clean.clone();
            bytes[at] ^= 0x5a;
            for capacity in [7, 64, 4096, 1 << 20] {
                let (records, damage) = read_with(&bytes, capacity);
                assert_eq!(records.len(), 99, "{what}, buffer {capacity}");
                assert_eq!(damage.regions, 1, "{what}");
                assert_eq!(damage.bytes as usize, starts[51] - starts[50], "{what}");
                assert_eq!(damage.first.as_ref().unwrap().0 as usize, starts[50]);
                let expected = Record::Kernel(vec![51; 10 + (51 * 37) % 300]);
                assert_eq!(records[50], expected, "{what}: the record after resumes");
            }
        }
        // 3 MiB of garbage between records 20 and 21.
        let mut bytes = clean[..starts[21]].to_vec();
        bytes.extend((0..3 << 20).map(|i: u32| (i.wrapping_mul(2_654_435_761) >> 13) as u8));
        bytes.extend_from_slice(&clean[starts[21]..]);
        let (records, damage) = read_with(&bytes, 1 << 20);
        assert_eq!(records.len(), 100);
        assert_eq!((damage.regions, damage.bytes), (1, 3 << 20));
    }

    /// Regression (issue 18): the writer did not enforce the record limit the reader does,
    /// so a large symbol table made `report` stop at "damaged". Symbol tables over the
    /// limit are split over several records and read back whole; other metadata that
    /// large is refused with its size.
    #[test]
    fn large_symbol_tables_are_split() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r.nctr");
        let mut w = Writer::create(&path, &header()).unwrap();
        let symbols: Vec<(u64, String)> = (0..60_000u64)
            .map(|i| {
                (
                    0xffff_ffff_8100_0000 + i * 16,
                    format!("kernel_function_number_{i}"),
                )
            })
            .collect();
        w.meta(&Meta::KernelSymbols {
            symbols: symbols.clone(),
        })
        .unwrap();
        let huge = Meta::Target {
            target: Box::new(TargetInfo {
                maps_text: "x".repeat(MAX_RECORD as usize),
                ..TargetInfo::default()
            }),
        };
        let err = w.meta(&huge).unwrap_err();
        assert!(err.to_string().contains("target record"), "{err}");
        w.finish().unwrap();
        let mut back = Vec::new();
        let mut parts = 0;
        for rec in read_all(&path).unwrap() {
            if let Record::Meta(Meta::KernelSymbols { symbols }) = rec {
                parts += 1;
                back.extend(symbols);
            }
        }
        assert!(parts > 1, "{parts} records");
        assert_eq!(back, symbols);
    }
}
