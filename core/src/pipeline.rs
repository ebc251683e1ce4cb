//! The stages after `source`, the same live and replayed: raw records → decode →
//! aggregate → render. `attach` feeds it from the ring buffer, `report` from a recording.

use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::path::Path;

use serde::Serialize;

use crate::attribute::{StepRule, StepsReport, Timeline};
use crate::decode::{self, DecodeError};
use crate::event::{Event, Func, Library};
use crate::record::{self, Header, Meta, RawRecord, Reader};

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

/// What follows a run beside its outputs (the metrics endpoint, a status line): handed each
/// target as it is added, each event before it is attributed, and each epoch once its
/// steps are final.
pub trait Sink: Send {
    fn target(&mut self, _target: &record::TargetInfo) {}
    fn event(&mut self, _event: &Event) {}
    fn epoch(&mut self, _epoch: &crate::attribute::Epoch) {}
    /// The run ended: publish what is held.
    fn flush(&mut self) {}
}

/// Folds events into the summary.
pub struct Aggregator {
    header: Header,
    events: u64,
    undecodable: u64,
    last_ts: u64,
    nccl: BTreeMap<Func, OpStats>,
    cuda: BTreeMap<Func, SyncStats>,
    sched: SchedStats,
    memory: MemoryStats,
    threads: BTreeSet<u32>,
    samples: u64,
    offcpu_stacks: u64,
    call_stacks: u64,
    python_stacks_by_pid: BTreeMap<u32, u64>,
    timeline: Timeline,
    kernel_symbols: BTreeMap<u64, String>,
    jit_symbols: BTreeMap<u32, Vec<(u64, u64, String)>>,
    python_codes: crate::python::PythonCodes,
    /// Attribution covers only the records after this many, from this time.
    window: Option<(u64, u64)>,
    end: Option<Meta>,
    incomplete: Option<String>,
    damaged: Option<record::Damage>,
    doctor: Option<serde_json::Value>,
    /// The agent's peak memory over the whole live run (its last record).
    agent_peak_rss_kb: Option<u64>,
    build_ids: crate::symbolize::BuildIds,
    /// Writes each epoch's outputs as it is attributed (see [`Aggregator::stream_into`]).
    streamer: Option<Streamer>,
    /// Who else follows the run as it is attributed (metrics, the status line).
    sinks: Vec<Box<dyn Sink>>,
    /// When the last epoch was tried because the reader caught up with the run.
    last_idle_epoch: Option<std::time::Instant>,
}

impl Aggregator {
    #[must_use]
    pub fn new(header: Header) -> Aggregator {
        let hints = header.numa_hints_refused.is_none().then_some(0);
        let pmu_samples = header.mem_sampler.as_ref().map(|_| 0);
        let readings = header.numa_maps_every_s.map(|_| 0);
        Aggregator {
            timeline: Timeline::new(&header),
            header,
            events: 0,
            undecodable: 0,
            last_ts: 0,
            nccl: BTreeMap::new(),
            cuda: BTreeMap::new(),
            sched: SchedStats::default(),
            memory: MemoryStats {
                numa_hint_fault_pages: hints,
                numa_hint_fault_pages_remote: hints,
                pmu_load_samples: pmu_samples,
                numa_maps_readings: readings,
                ..MemoryStats::default()
            },
            threads: BTreeSet::new(),
            samples: 0,
            offcpu_stacks: 0,
            call_stacks: 0,
            python_stacks_by_pid: BTreeMap::new(),
            kernel_symbols: BTreeMap::new(),
            jit_symbols: BTreeMap::new(),
            python_codes: BTreeMap::new(),
            window: None,
            end: None,
            incomplete: None,
            damaged: None,
            doctor: None,
            agent_peak_rss_kb: None,
            build_ids: BTreeMap::new(),
            streamer: None,
            sinks: Vec::new(),
            last_idle_epoch: None,
        }
    }

    /// Hands `sink` every target, event and attributed epoch from now on. Call before
    /// adding events.
    pub fn add_sink(&mut self, sink: Box<dyn Sink>) {
        self.sinks.push(sink);
        self.timeline.emit_epochs();
    }

    /// Writes the outputs into `dir` as the run is attributed ([`Streamer`]): memory is
    /// then bounded by an epoch, not the run. Call before adding events.
    pub fn stream_into(&mut self, dir: &Path) -> Result<(), (std::path::PathBuf, io::Error)> {
        self.streamer = Some(Streamer::create(dir)?);
        self.timeline.emit_epochs();
        Ok(())
    }

    /// Attributes the last epoch (the run's end is the closing record's, else the last
    /// record's) and hands it on; returns the streamer.
    fn end_epochs(&mut self, rule: &StepRule) -> Option<Streamer> {
        let end_at = match &self.end {
            Some(Meta::End {
                end_monotonic_ns, ..
            }) => *end_monotonic_ns,
            _ => self.last_ts,
        };
        self.timeline.end(end_at, rule.clone());
        self.drain_epochs();
        for sink in &mut self.sinks {
            sink.flush();
        }
        self.streamer.take()
    }

    /// The run is read up to what was written: at most once a second, the steps closed
    /// since the last epoch are attributed without waiting for a full epoch of events, so
    /// a quiet run (a job that paused or ended, under `--follow`) has its steps out.
    fn caught_up(&mut self) {
        let due = self
            .last_idle_epoch
            .is_none_or(|t| t.elapsed() >= std::time::Duration::from_secs(1));
        if due {
            self.last_idle_epoch = Some(std::time::Instant::now());
            self.timeline.try_epoch_now();
            self.drain_epochs();
        }
    }

    /// Hands the epochs attributed so far to the streamer.
    fn drain_epochs(&mut self) {
        // Epochs are handed on only when one of these asked for them (`emit_epochs`).
        for mut e in self.timeline.take_epochs() {
            let d = &mut e.detail;
            let stacks = self.timeline.stacks();
            crate::python::name_call_sites(&mut d.calls, &d.threads, stacks, &self.python_codes);
            for sink in &mut self.sinks {
                sink.epoch(&e);
            }
            if let Some(streamer) = &mut self.streamer {
                streamer.epoch(e);
            }
        }
    }

    /// Decodes and adds one raw kernel record; undecodable ones are counted, not fatal.
    pub fn push_raw(&mut self, bytes: &[u8]) -> Result<Event, DecodeError> {
        match decode::decode(bytes) {
            Ok(event) => {
                self.push(&event);
                Ok(event)
            }
            Err(e) => {
                self.undecodable += 1;
                Err(e)
            }
        }
    }

    /// Finds steps by `rule` and attributes the run in epochs of at least `epoch_events`
    /// events as they are added, instead of all at [`Aggregator::finish`].
    pub fn stream(&mut self, rule: StepRule, epoch_events: u64) {
        self.timeline.stream(rule, epoch_events);
    }

    /// Adds one event.
    pub fn push(&mut self, event: &Event) {
        for sink in &mut self.sinks {
            sink.event(event);
        }
        self.timeline.push(event);
        self.count(event);
        self.drain_epochs();
    }

    /// Counts one event in the totals without attributing it (it is before the window
    /// the attribution covers).
    fn count(&mut self, event: &Event) {
        self.events += 1;
        self.last_ts = self.last_ts.max(event.ts_ns());
        match event {
            Event::Call(call) => match call.func.library() {
                Library::Nccl => {
                    let s = self.nccl.entry(call.func).or_default();
                    s.calls += 1;
                    // Saturating: a damaged recording may carry any value.
                    s.bytes = s.bytes.saturating_add(call.bytes.unwrap_or(0));
                    s.enqueue_ns = s.enqueue_ns.saturating_add(call.duration_ns());
                    s.errors += u64::from(call.ret != 0);
                    self.threads.insert(call.task.tid);
                }
                Library::Cuda => {
                    let s = self.cuda.entry(call.func).or_default();
                    s.calls += 1;
                    s.wait_ns = s.wait_ns.saturating_add(call.duration_ns());
                }
                Library::Marker | Library::Nvtx => {}
            },
            Event::Switch {
                task,
                prev_is_target,
                prev_state,
                ..
            } => {
                self.threads.insert(task.tid);
                if *prev_is_target {
                    self.sched.switches_out += 1;
                    self.sched.involuntary_switches += u64::from(*prev_state == 0);
                }
            }
            Event::Wakeup { .. } => self.sched.wakeups += 1,
            Event::Migrate { .. } => self.sched.migrations += 1,
            Event::Fork { .. } => self.sched.forks += 1,
            Event::Exit { .. } => self.sched.thread_exits += 1,
            Event::Fault { .. } => self.memory.page_faults += 1,
            Event::FaultTime {
                ts_ns, start_ns, ..
            } => {
                self.memory.timed_faults += 1;
                self.memory.fault_handler_ns = self
                    .memory
                    .fault_handler_ns
                    .saturating_add(ts_ns.saturating_sub(*start_ns));
            }
            Event::PageMigration {
                succeeded, failed, ..
            } => {
                self.memory.pages_migrated = self.memory.pages_migrated.saturating_add(*succeeded);
                self.memory.page_migrations_failed =
                    self.memory.page_migrations_failed.saturating_add(*failed);
            }
            Event::NumaTask { .. } => self.memory.numa_task_events += 1,
            Event::NumaPages { .. } => {
                *self.memory.numa_maps_readings.get_or_insert(0) += 1;
            }
            Event::MemSample { .. } => {
                *self.memory.pmu_load_samples.get_or_insert(0) += 1;
            }
            Event::NumaHint { pages, local, .. } => {
                let pages = u64::from(*pages);
                let add = |n: &mut Option<u64>, by: u64| *n = Some(n.unwrap_or(0) + by);
                add(&mut self.memory.numa_hint_fault_pages, pages);
                add(
                    &mut self.memory.numa_hint_fault_pages_remote,
                    if *local { 0 } else { pages },
                );
            }
            Event::Sample { .. } => self.samples += 1,
            Event::OffCpu { .. } => self.offcpu_stacks += 1,
            Event::CallStack { .. } => self.call_stacks += 1,
            Event::PyStack { task, .. } => {
                *self.python_stacks_by_pid.entry(task.tgid).or_default() += 1;
            }
        }
    }

    /// Adds agent metadata.
    pub fn meta(&mut self, meta: Meta) {
        match meta {
            Meta::KernelSymbols { symbols } => self.kernel_symbols.extend(symbols),
            Meta::JitSymbols { pid, symbols } => {
                self.jit_symbols.entry(pid).or_default().extend(symbols);
            }
            Meta::PythonCodes { pid, codes } => self
                .python_codes
                .extend(codes.into_iter().map(|(code, info)| ((pid, code), info))),
            Meta::Target { target } => {
                self.timeline.add_target(&target);
                for sink in &mut self.sinks {
                    sink.target(&target);
                }
                self.header.targets.push(*target);
            }
            end @ Meta::End { .. } => self.end = Some(end),
            Meta::Doctor { report } => self.doctor = Some(report),
            Meta::AgentPeak { peak_rss_kb } => self.agent_peak_rss_kb = Some(peak_rss_kb),
            Meta::Maps { pid, added } => {
                if let Some(t) = self.header.targets.iter_mut().find(|t| t.pid == pid) {
                    t.maps_text.push_str(&added);
                }
            }
            Meta::BuildIds { pid, files } => self
                .build_ids
                .extend(files.into_iter().map(|(path, id)| ((pid, path), id))),
        }
    }

    /// Adds every record `reader` has left. A damaged tail is reported on stderr and the
    /// input marked incomplete; the complete records before it are kept.
    pub fn feed<R: io::BufRead + io::Seek + Send>(&mut self, reader: &mut Reader<R>) {
        self.feed_last(reader, 0);
    }

    /// As [`Aggregator::feed`], attributing only the kernel records after the first `skip`
    /// (those are counted in the totals): memory bounded by what is attributed.
    ///
    /// Reading, checking and decoding run on a thread of their own, a batch of records
    /// ahead of the attribution (on the 5.3 M-event soak recording they are half the
    /// work before the outputs).
    pub fn feed_last<R: io::BufRead + io::Seek + Send>(
        &mut self,
        reader: &mut Reader<R>,
        skip: u64,
    ) {
        let (full_tx, full_rx) = std::sync::mpsc::sync_channel::<Vec<Decoded>>(2);
        let (empty_tx, empty_rx) = std::sync::mpsc::channel::<Vec<Decoded>>();
        std::thread::scope(|scope| {
            let read = move || {
                let started = std::time::Instant::now();
                decode_batches(reader, &full_tx, &empty_rx);
                log::debug!("records read and decoded in {:?}", started.elapsed());
            };
            // Spawning fails only when the system is out of threads or memory.
            if let Err(e) = std::thread::Builder::new()
                .name("nccltrace-read".into())
                .spawn_scoped(scope, read)
            {
                self.incomplete(format!(
                    "cannot start the reading thread ({e}): no record was read; \
                     `nccltrace report` reads the recording again"
                ));
            }
            let mut seen = 0u64;
            for mut batch in full_rx {
                for item in batch.drain(..) {
                    match item {
                        Decoded::Event(event) => {
                            seen += 1;
                            if seen <= skip {
                                self.count(&event);
                            } else {
                                if seen == skip + 1 && skip > 0 {
                                    self.timeline.start_at(event.ts_ns());
                                    self.window = Some((skip, event.ts_ns()));
                                }
                                self.push(&event);
                            }
                        }
                        Decoded::Undecodable => {
                            seen += 1;
                            self.undecodable += 1;
                        }
                        Decoded::Meta(meta) => self.meta(meta),
                        Decoded::CaughtUp => self.caught_up(),
                        Decoded::Skipped(damage) => {
                            crate::note!(
                                "nccltrace: warning: the recording is damaged: {damage}; the \
                                 records around them are kept"
                            );
                            self.damaged = Some(damage);
                        }
                        Decoded::Damaged(e) => {
                            crate::note!(
                                "nccltrace: warning: {e}; keeping the complete records before it"
                            );
                            self.incomplete(e.to_string());
                        }
                    }
                }
                // The reader may have stopped; then the batch is dropped here.
                let _ = empty_tx.send(batch);
            }
        });
    }

    /// Marks the input as cut short (a damaged recording), with the reason.
    pub fn incomplete(&mut self, why: String) {
        self.incomplete = Some(why);
    }

    /// The summary and the per-step report of everything pushed.
    #[must_use]
    pub fn finish(mut self, rule: StepRule) -> Outputs {
        let start = self.header.clock.monotonic_ns;
        let streamer = self.end_epochs(&rule);
        let mut agent = AgentStats::default();
        let (end_ns, stop_reason, lost_by_kind, counters) = match self.end {
            Some(Meta::End {
                end_monotonic_ns,
                reason,
                lost_by_kind,
                counters,
                attach_ns,
                agent_peak_rss_kb,
            }) => {
                agent = AgentStats {
                    attach_ms: attach_ns as f64 / 1e6,
                    peak_rss_kb: self.agent_peak_rss_kb.unwrap_or(agent_peak_rss_kb),
                };
                (end_monotonic_ns, Some(reason), lost_by_kind, counters)
            }
            // Only the closing record is kept in `end`.
            _ => (self.last_ts, None, BTreeMap::new(), BTreeMap::new()),
        };
        let incomplete = self.incomplete.or_else(|| {
            stop_reason.is_none().then(|| {
                "the recording has no closing record (the agent did not finish writing it): \
                 lost-event counts are unknown"
                    .to_owned()
            })
        });
        let (mut steps, mut detail) = self.timeline.finish(end_ns, rule);
        let d = &mut detail;
        crate::python::name_call_sites(&mut d.calls, &d.threads, &d.stacks, &self.python_codes);
        let attributed = self.window.map(|(skipped, from)| {
            format!(
                "steps, categories, flamegraphs and trace.json cover the last {} of {} \
                 events (from {:.1} s into the run; --max-attributed-events); the totals \
                 cover all of them; `nccltrace report` on the recording attributes the whole run",
                self.events - skipped,
                self.events,
                from.saturating_sub(start) as f64 / 1e9
            )
        });
        if let Some(why) = &attributed {
            steps.reason = format!("{}; {why}", steps.reason);
        }
        let targets = target_summaries(&self.header.targets, &self.python_stacks_by_pid);
        let nccl = nccl_totals(self.nccl);
        let mut cuda_sync = CudaSyncStats::default();
        for (func, s) in self.cuda {
            cuda_sync.calls += s.calls;
            cuda_sync.wait_ns = cuda_sync.wait_ns.saturating_add(s.wait_ns);
            cuda_sync.by_func.insert(func.name().to_owned(), s);
        }
        let mut sched = self.sched;
        sched.threads_seen = self.threads.len() as u64;
        let summary = Summary {
            duration_ns: end_ns.saturating_sub(start),
            start_unix_ns: self.header.clock.realtime_ns,
            stop_reason,
            targets,
            nccl,
            cuda_sync,
            sched,
            memory: self.memory,
            events: self.events,
            cpu_samples: self.samples,
            offcpu_stacks: self.offcpu_stacks,
            call_stacks: self.call_stacks,
            undecodable_records: self.undecodable,
            lost_events: lost_by_kind.values().sum(),
            lost_by_kind,
            counters,
            ranks: steps.ranks.clone(),
            straggler: steps.straggler.clone(),
            agent,
            incomplete,
            attributed,
            damaged: self.damaged.map(|d| d.to_string()),
        };
        Outputs {
            summary,
            steps,
            detail,
            kernel_symbols: self.kernel_symbols,
            jit_symbols: self.jit_symbols,
            python_codes: self.python_codes,
            doctor: self.doctor,
            build_ids: self.build_ids,
            header: self.header,
            streamer,
        }
    }
}

/// What summary.json says of each target (`python_stacks`: Python stacks by pid).
fn target_summaries(
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
fn nccl_totals(by_func: BTreeMap<Func, OpStats>) -> NcclStats {
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

/// Everything the pipeline produces.
#[derive(Debug)]
pub struct Outputs {
    pub summary: Summary,
    pub steps: StepsReport,
    pub detail: crate::attribute::Detail,
    /// Kernel frame names recorded at the end of the live run.
    pub kernel_symbols: BTreeMap<u64, String>,
    /// JIT code names per target (perf map files), recorded at the end of the live run.
    pub jit_symbols: BTreeMap<u32, Vec<(u64, u64, String)>>,
    /// Python code objects named during the live run.
    pub python_codes: crate::python::PythonCodes,
    /// The placement health report made at attach (`doctor.json`), when the recording
    /// keeps it.
    pub doctor: Option<serde_json::Value>,
    /// Build ids of the files user frames lie in, as the live run read them.
    pub build_ids: crate::symbolize::BuildIds,
    pub header: Header,
    /// What was written as the run was attributed; `steps.steps` and `detail` are then
    /// empty.
    pub streamer: Option<Streamer>,
}

/// A record read back and decoded, as the reading thread hands it over.
enum Decoded {
    Event(Event),
    Undecodable,
    Meta(Meta),
    /// Damaged stretches skipped in the middle: just before the end (or the damaged tail).
    Skipped(record::Damage),
    /// The damaged tail: the last item.
    Damaged(record::RecordError),
    /// The reader has caught up with a recording being written (the end of a batch sent
    /// before it was full).
    CaughtUp,
}

/// Records per batch handed from the reading thread to the attribution.
const BATCH: usize = 4096;

/// Reads and decodes every record `reader` has left, in batches sent to `full`; batches
/// come back through `empty` to be refilled. Stops at the end, at damage, or when the
/// receiver is gone.
fn decode_batches<R: io::BufRead + io::Seek>(
    reader: &mut Reader<R>,
    full: &std::sync::mpsc::SyncSender<Vec<Decoded>>,
    empty: &std::sync::mpsc::Receiver<Vec<Decoded>>,
) {
    loop {
        let mut batch = empty
            .try_recv()
            .unwrap_or_else(|_| Vec::with_capacity(BATCH));
        let mut done = false;
        while batch.len() < BATCH {
            // Followed live and caught up: what is read so far goes now, not when the
            // batch is full (a quiet run would hold its last steps back).
            if !batch.is_empty() && reader.would_wait() {
                batch.push(Decoded::CaughtUp);
                break;
            }
            match reader.next_raw() {
                Ok(Some(RawRecord::Kernel(bytes))) => {
                    let item = decode::decode(bytes).map_or(Decoded::Undecodable, Decoded::Event);
                    batch.push(item);
                }
                Ok(Some(RawRecord::Meta(meta))) => batch.push(Decoded::Meta(meta)),
                Ok(None) => done = true,
                Err(e) => {
                    if reader.damage().regions > 0 {
                        batch.push(Decoded::Skipped(reader.damage().clone()));
                    }
                    batch.push(Decoded::Damaged(e));
                    done = true;
                    break;
                }
            }
            if done {
                if reader.damage().regions > 0 {
                    batch.push(Decoded::Skipped(reader.damage().clone()));
                }
                break;
            }
        }
        if full.send(batch).is_err() || done {
            return;
        }
    }
}

/// Why a recording could not be replayed.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error(transparent)]
    Record(#[from] record::RecordError),
    /// An output file in the folder the replay streams into.
    #[error("cannot write output {}: {source}", path.display())]
    Output {
        path: std::path::PathBuf,
        #[source]
        source: io::Error,
    },
}

/// Replays a recording through the pipeline. A damaged tail is reported on stderr and
/// the complete records before it are kept.
pub fn replay(path: &Path, rule: StepRule, epoch_events: u64) -> Result<Outputs, ReplayError> {
    replay_from(Reader::open(path)?, rule, epoch_events, None)
}

/// As [`replay`], writing the outputs into `dir` as the recording is attributed
/// ([`Streamer`]); [`write_outputs`] completes them.
pub fn replay_into(
    path: &Path,
    rule: StepRule,
    epoch_events: u64,
    dir: &Path,
) -> Result<Outputs, ReplayError> {
    let reader = Reader::open(path)?;
    replay_from(reader, rule, epoch_events, Some(dir))
}

/// Events per attribution epoch: the run is attributed in stretches of at least this many
/// events as it is read (see `attribute::epoch`).
pub const EPOCH_EVENTS: u64 = 1 << 12;

/// As [`replay`], from any reader (the fuzzer feeds it bytes), streaming the outputs into
/// `dir` when given.
pub fn replay_from<R: io::BufRead + io::Seek + Send>(
    mut reader: Reader<R>,
    mut rule: StepRule,
    epoch_events: u64,
    dir: Option<&Path>,
) -> Result<Outputs, ReplayError> {
    // A recording made with --step-nvtx is cut the same way unless told otherwise.
    if rule == StepRule::Auto
        && let Some(pattern) = reader.header.step_nvtx.as_deref()
        && let Ok(pattern) = crate::attribute::NvtxPattern::new(pattern)
    {
        rule = StepRule::Nvtx(pattern);
    }
    let started = std::time::Instant::now();
    let mut agg = Aggregator::new(reader.header.clone());
    agg.stream(rule.clone(), epoch_events);
    if let Some(dir) = dir {
        agg.stream_into(dir)
            .map_err(|(path, source)| ReplayError::Output { path, source })?;
    }
    agg.feed(&mut reader);
    log::debug!("read and decoded in {:?}", started.elapsed());
    let started = std::time::Instant::now();
    let outputs = agg.finish(rule);
    log::debug!("attributed in {:?}", started.elapsed());
    Ok(outputs)
}

/// Creates `dir/name` and fills it with `write`; the failure names the file.
fn write_file(
    dir: &Path,
    name: &str,
    write: &mut dyn FnMut(&mut io::BufWriter<std::fs::File>) -> io::Result<()>,
) -> Result<(), (std::path::PathBuf, io::Error)> {
    let path = dir.join(name);
    let started = std::time::Instant::now();
    let result = std::fs::File::create(&path).and_then(|f| {
        let mut out = io::BufWriter::with_capacity(1 << 20, f);
        write(&mut out)?;
        io::Write::flush(&mut out)
    });
    log::debug!("{name} written in {:?}", started.elapsed());
    result.map_err(|e| (path, e))
}

/// Writes `summary.json` into `dir`: last, after [`write_outputs`], so that a live run's
/// summary can give the agent's peak memory with the outputs' cost included.
pub fn write_summary(dir: &Path, summary: &Summary) -> Result<(), (std::path::PathBuf, io::Error)> {
    write_file(dir, "summary.json", &mut |out| {
        crate::render::summary::write_json(summary, out)
    })
}

/// Writes every output of this stage but `summary.json` ([`write_summary`]) into `dir`, and
/// the summary in words to `text`: what was streamed as the run was attributed is
/// completed, and outputs kept whole are written now.
pub fn write_outputs(
    dir: &Path,
    outputs: &mut Outputs,
    text: &mut impl io::Write,
) -> Result<(), (std::path::PathBuf, io::Error)> {
    let streamer = if let Some(s) = outputs.streamer.take() {
        s
    } else {
        let mut s = Streamer::create(dir)?;
        // The whole run as one epoch; the stacks stay for the symbols.
        let d = &mut outputs.detail;
        let detail = crate::attribute::Detail {
            threads: std::mem::take(&mut d.threads),
            calls: std::mem::take(&mut d.calls),
            step_bounds: std::mem::take(&mut d.step_bounds),
            stacks: Vec::new(),
            cpu_nodes: d.cpu_nodes.clone(),
            ..*d
        };
        s.epoch(crate::attribute::Epoch {
            steps: std::mem::take(&mut outputs.steps.steps),
            detail,
            lateness: Vec::new(),
        });
        s
    };
    streamer.finish(outputs, text)
}

/// Writes the outputs as the run is attributed: each epoch's steps go to steps.json and
/// steps.csv as they close, its timeline to trace.json (on a thread of its own), its
/// stacks' weights into the flamegraphs; what needs the whole run (names, symbols, the
/// rest of steps.json, the table) is written at [`Streamer::finish`].
pub struct Streamer {
    dir: std::path::PathBuf,
    json: Option<crate::render::steps::StepsJson<io::BufWriter<std::fs::File>>>,
    csv: Option<io::BufWriter<std::fs::File>>,
    trace: Option<TraceThread>,
    weights: [crate::render::flamegraph::Weights; 4],
    samples: BTreeMap<u32, u64>,
    table: crate::render::steps::StepTable,
    failed: Option<(std::path::PathBuf, io::Error)>,
}

/// What the trace thread is handed.
enum ToTrace {
    Epoch(std::sync::Arc<crate::attribute::Epoch>),
    End {
        header: Box<Header>,
        ranks: Vec<crate::attribute::ranks::RankReport>,
        end_ns: u64,
    },
}

/// trace.json, written on a thread of its own while the run is attributed (the largest
/// output: it took as long as all the others together).
struct TraceThread {
    to: std::sync::mpsc::SyncSender<ToTrace>,
    done: std::thread::JoinHandle<io::Result<()>>,
}

impl TraceThread {
    fn start(path: &Path) -> io::Result<TraceThread> {
        let file = std::fs::File::create(path)?;
        // Two epochs in flight at most: memory stays bounded when the disk is slow.
        let (to, from) = std::sync::mpsc::sync_channel::<ToTrace>(2);
        let done = std::thread::Builder::new()
            .name("nccltrace-trace".into())
            .spawn(move || {
                let out = io::BufWriter::with_capacity(1 << 20, file);
                let mut trace: Option<crate::render::trace::TraceStream<_>> = None;
                let mut out = Some(out);
                for msg in from {
                    match msg {
                        ToTrace::Epoch(e) => {
                            if trace.is_none()
                                && let Some(out) = out.take()
                            {
                                trace = Some(crate::render::trace::TraceStream::new(
                                    out,
                                    e.detail.first_ns,
                                )?);
                            }
                            if let Some(t) = &mut trace {
                                t.epoch(&e.detail, &e.steps, e.detail.rank_pid)?;
                            }
                        }
                        ToTrace::End {
                            header,
                            ranks,
                            end_ns,
                        } => {
                            let t = match trace.take() {
                                Some(t) => t,
                                None => crate::render::trace::TraceStream::new(
                                    out.take()
                                        .ok_or_else(|| io::Error::other("trace ended twice"))?,
                                    header.clock.monotonic_ns,
                                )?,
                            };
                            return t.finish(&header, &ranks, end_ns);
                        }
                    }
                }
                Err(io::Error::other("the trace was not ended"))
            })?;
        Ok(TraceThread { to, done })
    }

    /// Ends the trace; how writing it went.
    fn end(self, end: ToTrace) -> io::Result<()> {
        // A send fails only when the thread stopped on an error: join gives it.
        let _ = self.to.send(end);
        drop(self.to);
        self.done
            .join()
            .unwrap_or_else(|_| Err(io::Error::other("writing trace.json panicked")))
    }
}

impl std::fmt::Debug for Streamer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Streamer")
            .field("dir", &self.dir)
            .field("steps", &self.table.len())
            .finish_non_exhaustive()
    }
}

impl Streamer {
    /// Starts steps.json, steps.csv and trace.json in `dir`.
    pub fn create(dir: &Path) -> Result<Streamer, (std::path::PathBuf, io::Error)> {
        let open = |name: &str| {
            let path = dir.join(name);
            std::fs::File::create(&path)
                .map(|f| io::BufWriter::with_capacity(1 << 20, f))
                .map_err(|e| (path, e))
        };
        let json = crate::render::steps::StepsJson::new(open("steps.json")?)
            .map_err(|e| (dir.join("steps.json"), e))?;
        let mut csv = open("steps.csv")?;
        io::Write::write_all(
            &mut csv,
            format!("{}\n", crate::render::steps::csv_columns().join(",")).as_bytes(),
        )
        .map_err(|e| (dir.join("steps.csv"), e))?;
        let trace_path = dir.join("trace.json");
        let trace = TraceThread::start(&trace_path).map_err(|e| (trace_path, e))?;
        Ok(Streamer {
            dir: dir.to_owned(),
            json: Some(json),
            csv: Some(csv),
            trace: Some(trace),
            weights: Default::default(),
            samples: BTreeMap::new(),
            table: crate::render::steps::StepTable::default(),
            failed: None,
        })
    }

    fn fail(&mut self, name: &str, e: io::Error) {
        self.failed.get_or_insert((self.dir.join(name), e));
    }

    /// One epoch: its steps, final, and its part of the timeline.
    pub fn epoch(&mut self, epoch: crate::attribute::Epoch) {
        use crate::render;
        let (steps, detail) = (&epoch.steps, &epoch.detail);
        for s in steps {
            self.table.push(s);
        }
        // Flushed each epoch: a run can be followed in the files as it goes.
        if let Some(json) = &mut self.json
            && let Err(e) = steps
                .iter()
                .try_for_each(|s| json.step(s))
                .and_then(|()| json.flush())
        {
            self.json = None;
            self.fail("steps.json", e);
        }
        if let Some(out) = &mut self.csv
            && let Err(e) =
                render::steps::write_csv_rows(steps, out).and_then(|()| io::Write::flush(out))
        {
            self.csv = None;
            self.fail("steps.csv", e);
        }
        for (kind, w) in render::flamegraph::Kind::ALL.iter().zip(&mut self.weights) {
            w.weigh(detail, *kind);
        }
        render::flamegraph::count_samples(detail, &mut self.samples);
        if let Some(trace) = &self.trace
            && trace
                .to
                .send(ToTrace::Epoch(std::sync::Arc::new(epoch)))
                .is_err()
            && let Some(trace) = self.trace.take()
        {
            // The thread stopped on an error: it says which.
            if let Err(e) = trace.end(ToTrace::End {
                header: Box::default(),
                ranks: Vec::new(),
                end_ns: 0,
            }) {
                self.fail("trace.json", e);
            }
        }
    }

    /// Completes every output but `summary.json` and prints the summary in words.
    pub fn finish(
        mut self,
        outputs: &Outputs,
        text: &mut impl io::Write,
    ) -> Result<(), (std::path::PathBuf, io::Error)> {
        use crate::render;
        let end = ToTrace::End {
            header: Box::new(outputs.header.clone()),
            ranks: outputs.steps.ranks.clone(),
            end_ns: outputs.detail.end_ns,
        };
        let trace = self
            .trace
            .take()
            .map(|t| std::thread::spawn(move || t.end(end)));
        if let Some(mut out) = self.csv.take()
            && let Err(e) = io::Write::flush(&mut out)
        {
            self.fail("steps.csv", e);
        }
        let mut file = |name: &str,
                        write: &mut dyn FnMut(
            &mut io::BufWriter<std::fs::File>,
        ) -> io::Result<()>| {
            if let Err(e) = write_file(&self.dir, name, write) {
                self.failed.get_or_insert(e);
            }
        };
        if let Some(doctor) = &outputs.doctor {
            file("doctor.json", &mut |out| {
                serde_json::to_writer_pretty(&mut *out, doctor)?;
                io::Write::write_all(out, b"\n")
            });
        }
        let started = std::time::Instant::now();
        let stacks = &outputs.detail.stacks;
        let symbols = crate::symbolize::symbolize(
            &outputs.header,
            stacks,
            &outputs.kernel_symbols,
            &outputs.jit_symbols,
            &outputs.python_codes,
            &outputs.build_ids,
        );
        for line in &symbols.stale {
            crate::note!("nccltrace: warning: {line}");
        }
        log::debug!("symbolized in {:?}", started.elapsed());
        let mut report = render::steps::without_steps(&outputs.steps);
        for (kind, w) in render::flamegraph::Kind::ALL.iter().zip(&self.weights) {
            let lines = w.lines(stacks, &symbols);
            if *kind == render::flamegraph::Kind::Attributed {
                report.other_offcpu_top_stacks =
                    render::flamegraph::top_stacks(&lines, "other_offcpu", 5);
                report.nccl_wait_top_stacks =
                    render::flamegraph::top_stacks(&lines, "nccl_wait", 5);
            }
            file(&format!("{}.folded", kind.file()), &mut |out| {
                render::flamegraph::write_folded(&lines, out)
            });
            file(&format!("{}.svg", kind.file()), &mut |out| {
                render::flamegraph::write_svg(*kind, &lines, out)
            });
        }
        if let Some(json) = self.json.take()
            && let Err(e) = json.finish(&report)
        {
            self.fail("steps.json", e);
        }
        let stdout = Path::new("(standard output)");
        let share = render::flamegraph::short_stack_share(stacks, &self.samples);
        let mut print = || -> io::Result<()> {
            render::summary::write_text(&outputs.summary, text)?;
            render::steps::write_table(&report, &self.table, text)?;
            if let Some(share) = share
                && share > 0.5
            {
                writeln!(
                    text,
                    "Stacks: {:.0}% of user stacks have at most two frames: the target was likely \
                     built without frame pointers, so flamegraphs stop early instead of showing \
                     wrong frames",
                    share * 100.0
                )?;
            }
            Ok(())
        };
        // A closed stdout (`nccltrace report … | head`) is the reader's choice, not a
        // failure: the files are complete.
        if let Err(e) = print()
            && e.kind() != io::ErrorKind::BrokenPipe
        {
            self.failed.get_or_insert((stdout.to_owned(), e));
        }
        if let Some(trace) = trace {
            let result = trace
                .join()
                .unwrap_or_else(|_| Err(io::Error::other("writing trace.json panicked")));
            if let Err(e) = result {
                self.fail("trace.json", e);
            }
        }
        self.failed.map_or(Ok(()), Err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{Call, Task};

    /// Totals from a damaged recording saturate instead of overflowing: the fuzzer found
    /// two calls whose byte counts add past u64::MAX (a panic with overflow checks on).
    #[test]
    fn totals_saturate() {
        let mut agg = Aggregator::new(Header::default());
        for func in [Func::AllReduce, Func::AllReduce, Func::CuStreamSynchronize] {
            agg.push(&Event::Call(Call {
                bytes: Some(u64::MAX - 1),
                comm: Some(1),
                ..Call::new(
                    Task {
                        tgid: 1,
                        tid: 1,
                        cpu: 0,
                    },
                    func,
                    0,
                    u64::MAX,
                )
            }));
        }
        let out = agg.finish(StepRule::Auto);
        assert_eq!(out.summary.nccl.bytes, u64::MAX);
        assert_eq!(out.summary.nccl.by_op["AllReduce"].enqueue_ns, u64::MAX);
    }
}
