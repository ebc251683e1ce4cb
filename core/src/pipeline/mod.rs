//! The stages after `source`, the same live and replayed: raw records → decode →
//! aggregate → render. `attach` feeds it from the ring buffer, `report` from a recording
//! (`replay`); `write` puts the outputs into their folder as the run is attributed.

pub(crate) mod behind;
mod replay;
mod setup;
#[cfg(test)]
mod tests;
mod totals;
mod write;

use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::path::Path;

use crate::attribute::{StepRule, StepsReport, Timeline};
use crate::decode::{self, DecodeError};
use crate::event::{Event, Func};
use crate::record::{self, Header, Meta};
pub use crate::summary::{
    AgentStats, CudaSyncStats, MemoryStats, NcclStats, OpStats, SchedStats, Summary, SyncStats,
    TargetSummary,
};
use crate::summary::{cuda_totals, nccl_totals, target_summaries};
pub use replay::{EPOCH_EVENTS, ReplayError, replay, replay_from, replay_into};
use totals::{NodeCounters, NodeDeltas, StackCounts, numastat_delta};
pub use write::{Streamer, write_outputs, write_summary};

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
    stacks: StackCounts,
    /// Python stacks by pid: (all, reused).
    python_stacks_by_pid: BTreeMap<u32, (u64, u64)>,
    /// The first numastat reading and the last after it.
    numastat: Option<(NodeCounters, Option<NodeCounters>)>,
    /// Each InfiniBand port's first and last readings: the run's totals.
    infiniband: crate::attribute::IbReadings,
    /// The GPUs' readings, summed.
    gpu: crate::attribute::GpuTotals,
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
    /// The first and the last reading of the programs' run time.
    program_stats: Option<(crate::record::ProgramReading, crate::record::ProgramReading)>,
    /// The call records so far (with the lost ones added at the end): the call programs'
    /// runs.
    call_runs: crate::summary::CallRuns,
    /// The agent's cost per reading interval, split between the steps and the rest.
    cost_split: crate::summary::CostSplit,
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
        let faults = (!header.page_faults_off).then_some(0);
        let infiniband = crate::attribute::IbReadings::new(header.infiniband_ports.clone());
        Aggregator {
            timeline: Timeline::new(&(&header).into()),
            header,
            events: 0,
            undecodable: 0,
            last_ts: 0,
            nccl: BTreeMap::new(),
            cuda: BTreeMap::new(),
            sched: SchedStats::default(),
            memory: MemoryStats {
                page_faults: faults,
                numa_hint_fault_pages: hints,
                numa_hint_fault_pages_remote: hints,
                pmu_load_samples: pmu_samples,
                numa_maps_readings: readings,
                ..MemoryStats::default()
            },
            threads: BTreeSet::new(),
            samples: 0,
            stacks: StackCounts::default(),
            python_stacks_by_pid: BTreeMap::new(),
            infiniband,
            gpu: crate::attribute::GpuTotals::default(),
            numastat: None,
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
            program_stats: None,
            call_runs: crate::summary::CallRuns::default(),
            cost_split: crate::summary::CostSplit::default(),
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
        // Asked after every event: most often there is none.
        if !self.timeline.has_epochs() {
            return;
        }
        // Epochs are handed on only when one of these asked for them (`emit_epochs`).
        for mut e in self.timeline.take_epochs() {
            let d = &mut e.detail;
            let stacks = self.timeline.stacks();
            crate::python::name_call_sites(&mut d.calls, &d.threads, stacks, &self.python_codes);
            for sink in &mut self.sinks {
                sink.epoch(&e);
            }
            self.cost_split
                .steps(e.steps.iter().map(|s| (s.start_ns, s.end_ns)));
            self.cost_split.settle(e.detail.end_ns);
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
        self.cost_split.record(event.ts_ns());
        self.drain_epochs();
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
                self.timeline.add_target(&(&*target).into());
                for sink in &mut self.sinks {
                    sink.target(&target);
                }
                self.header.targets.push(*target);
            }
            end @ Meta::End { .. } => self.end = Some(end),
            Meta::Doctor { report } => self.doctor = Some(report),
            Meta::AgentPeak { peak_rss_kb } => self.agent_peak_rss_kb = Some(peak_rss_kb),
            Meta::Numastat { nodes, .. } => match &mut self.numastat {
                Some((_, last)) => *last = Some(nodes),
                None => self.numastat = Some((nodes, None)),
            },
            Meta::ProgramStats(reading) => {
                self.cost_split.reading(&reading, self.call_runs);
                match &mut self.program_stats {
                    Some((_, last)) => *last = reading,
                    None => self.program_stats = Some((reading.clone(), reading)),
                }
            }
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

    /// The node's counters over the run: numastat per node, InfiniBand per port, the
    /// GPUs.
    fn node_totals(
        &self,
    ) -> (
        Option<NodeDeltas>,
        Option<crate::attribute::IbStep>,
        crate::summary::GpuSummary,
    ) {
        let numastat = self
            .numastat
            .as_ref()
            .and_then(|(first, last)| numastat_delta(first, last.as_ref()?));
        (numastat, self.infiniband.totals(), self.gpu_summary())
    }

    /// Marks the input as cut short (a damaged recording), with the reason.
    pub fn incomplete(&mut self, why: String) {
        self.incomplete = Some(why);
    }

    /// The programs' run time between the first and the last reading, or why there is
    /// none.
    fn bpf_cost(&self) -> (Option<crate::summary::BpfCost>, Option<String>) {
        // A call lost in the ring ran the entry program (and maybe the return one).
        let lost = match &self.end {
            Some(Meta::End { lost_by_kind, .. }) => lost_by_kind
                .get(Event::kind_name(nccltrace_common::kind::CALL))
                .copied()
                .unwrap_or(0),
            _ => 0,
        };
        let calls = crate::summary::CallRuns {
            entries: self.call_runs.entries.saturating_add(lost),
            ..self.call_runs
        };
        let bpf = self
            .program_stats
            .as_ref()
            .and_then(|(first, last)| crate::summary::BpfCost::between(first, last, calls));
        let unaccounted = self.program_stats.as_ref().is_some_and(|(first, last)| {
            last.at_ns > first.at_ns
                && first.accounted_ns.is_some()
                && first.accounted_ns == last.accounted_ns
        });
        let unmeasured = bpf.is_none().then(|| {
            if unaccounted {
                return "the programs did not account their runs between the readings (no \
                        window of profile [cost] timing_ms fell between them)"
                    .to_owned();
            }
            self.header.bpf_stats_refused.clone().unwrap_or_else(|| {
                "the programs' run time was read fewer than twice (the recording ends before \
                 tracing stopped)"
                    .to_owned()
            })
        });
        (bpf, unmeasured)
    }

    /// The GPUs read over the run, or why none was.
    fn gpu_summary(&self) -> crate::summary::GpuSummary {
        crate::summary::GpuSummary {
            read: self.gpu.report(&self.header.gpus),
            every_ms: self.header.gpu_every_ms,
            chosen: self.header.gpus_chosen.clone(),
            refused: self.header.gpu_refused.clone(),
        }
    }

    /// The summary and the per-step report of everything pushed.
    #[must_use]
    pub fn finish(mut self, rule: StepRule) -> Outputs {
        let (numastat_pages, infiniband, gpus) = self.node_totals();
        let start = self.header.clock.monotonic_ns;
        let streamer = self.end_epochs(&rule);
        let (bpf, bpf_unmeasured) = self.bpf_cost();
        let mut agent = AgentStats {
            bpf,
            bpf_unmeasured,
            ..AgentStats::default()
        };
        let (end_ns, stop_reason, lost_by_kind, counters) = match self.end {
            Some(Meta::End {
                end_monotonic_ns,
                reason,
                lost_by_kind,
                counters,
                attach_ns,
                agent_peak_rss_kb,
            }) => {
                agent.attach_ms = attach_ns as f64 / 1e6;
                attach_notes(&mut agent, &self.header);
                agent.peak_rss_kb = self.agent_peak_rss_kb.unwrap_or(agent_peak_rss_kb);
                (end_monotonic_ns, Some(reason), lost_by_kind, counters)
            }
            // Only the closing record is kept in `end`.
            _ => (self.last_ts, None, BTreeMap::new(), BTreeMap::new()),
        };
        let incomplete = self.incomplete.or_else(|| unclosed(stop_reason.is_none()));
        let (mut steps, mut detail) = self.timeline.finish(end_ns, rule);
        split_cost(&mut self.cost_split, &steps, agent.bpf.as_mut());
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
        let cuda_sync = cuda_totals(self.cuda);
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
            memory: MemoryStats {
                numastat_pages,
                ..self.memory
            },
            infiniband,
            gpus,
            events: self.events,
            cpu_samples: self.samples,
            offcpu_stacks: self.stacks.offcpu,
            offcpu_stacks_taken: self.header.offcpu_stacks.clone(),
            call_stacks: self.stacks.call,
            stacks_reused: self.stacks.reused,
            stacks_reused_unresolved: self.stacks.unresolved,
            undecodable_records: self.undecodable,
            lost_events: lost_by_kind.values().sum(),
            lost_by_kind,
            counters,
            ranks: steps.ranks.clone(),
            workers: steps.workers.clone(),
            straggler: steps.straggler.clone(),
            stragglers_by_job: steps.stragglers_by_job.clone(),
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
            gpu_samples: self.gpu.take_samples(),
            header: self.header,
            streamer,
        }
    }
}

/// Splits the agent's cost between the steps and the rest; the steps kept for the end (not
/// handed on as they came) cover the cost's intervals now.
fn split_cost(
    split: &mut crate::summary::CostSplit,
    steps: &StepsReport,
    bpf: Option<&mut crate::summary::BpfCost>,
) {
    split.steps(steps.steps.iter().map(|s| (s.start_ns, s.end_ns)));
    split.settle(u64::MAX);
    if let Some(bpf) = bpf {
        bpf.split(split);
    }
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
    /// The GPUs' utilization samples, by GPU and time (trace.json's counter tracks).
    pub gpu_samples: Vec<crate::attribute::GpuSample>,
    pub header: Header,
    /// What was written as the run was attributed; `steps.steps` and `detail` are then
    /// empty.
    pub streamer: Option<Streamer>,
}

/// Why the summary is incomplete where the recording has no closing record.
fn unclosed(no_end: bool) -> Option<String> {
    no_end.then(|| {
        "the recording has no closing record (the agent did not finish writing it): \
         lost-event counts are unknown"
            .to_owned()
    })
}

/// What the header says of the attach: its phases, how the uprobes were attached, how the
/// programs walked Python frames, which scheduler tracepoints ran.
fn attach_notes(agent: &mut crate::summary::AgentStats, header: &crate::record::Header) {
    agent.attach_phases_ms = crate::summary::AttachPhase::all(&header.attach_phases_us);
    agent.uprobes.clone_from(&header.uprobes);
    agent.python_walk.clone_from(&header.python_walk);
    agent
        .sched_tracepoints
        .clone_from(&header.sched_tracepoints);
}
