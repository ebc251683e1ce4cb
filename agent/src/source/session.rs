//! An attached session: draining the rings into a sink, following new targets, the
//! programs' accounting, stopping and detaching.

use super::*;

/// Why draining stopped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StopReason {
    TargetsExited,
    Duration,
    Signal(&'static str),
    /// The sink asked for a new output window (`--rotate`): tracing goes on.
    Rotate,
}

impl std::fmt::Display for StopReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StopReason::TargetsExited => write!(f, "every target exited"),
            StopReason::Duration => write!(f, "--duration elapsed"),
            StopReason::Signal(name) => write!(f, "{name} received"),
            StopReason::Rotate => write!(f, "--rotate: the next window began"),
        }
    }
}

/// Receives every raw record as it is drained.
pub trait Sink {
    /// One raw kernel record. An error stops the run (the outputs already written stay).
    fn record(&mut self, bytes: &[u8]) -> Result<(), crate::Error>;
    /// A target attached during the run (`--follow`).
    fn target_added(&mut self, target: &TargetInfo);
    /// Called about once a second with the records lost so far, by kind, and the number
    /// of targets still running.
    fn tick(&mut self, lost: &BTreeMap<String, u64>, alive: usize);
    /// Checked about ten times a second: true ends [`Attached::run`] with
    /// [`StopReason::Rotate`], the programs still armed.
    fn rotate_due(&self) -> bool {
        false
    }
    /// Names of Python code objects seen for the first time in this sink's records (the
    /// record that shows them comes next).
    fn python_codes(&mut self, _pid: u32, _codes: Vec<(u64, crate::python::CodeInfo)>) {}
    /// The programs' run time so far, as they account it: when tracing starts,
    /// about once a second, and when it stops.
    fn program_stats(&mut self, _reading: crate::record::ProgramReading) {}
    /// Each NUMA node's allocation counters (numastat): when tracing starts and when it
    /// stops.
    fn numastat(&mut self, _at_ns: u64, _nodes: Vec<(u32, Vec<(String, u64)>)>) {}
}

impl Attached {
    /// Attaches to a target found after the start (`--follow`): its threads and pid join
    /// the maps, its libraries are probed unless an earlier target maps the same files, its
    /// threads get sampling events when they are sampled per thread. Returns what the
    /// recording keeps about it.
    pub fn add_target(&mut self, t: &Target) -> Result<TargetInfo, SourceError> {
        let host = Host::live();
        let ebpf = self.ebpf.as_mut().ok_or(SourceError::Detached)?;
        register_threads(ebpf, &host, t)?;
        let (libs, probes) = target_libs(t, &self.profile);
        for lib in libs {
            let returns = self.profile.probes.call_returns;
            probe_library(
                ebpf,
                &self.uprobes,
                lib,
                t.pid,
                returns,
                &mut self.probed,
                &mut self.links,
            )?;
        }
        if self.header.sample_period_ns > 0 && self.profile.sampling.scope == SampleScope::Thread {
            let period = self.header.sample_period_ns;
            sample_threads(ebpf, &host, t.pid, period, &mut self.links)?;
        }
        self.targets
            .insert(t.pid, 1, 0)
            .map_err(map_error(names::TARGETS))?;
        self.pids.push(t.pid);
        let py = if self.profile.probes.python_frames {
            python::start(ebpf, &host, t.pid, &mut self.python)?
        } else {
            None
        };
        let info = target_info(&host, t, probes, py);
        self.comms.add(&info);
        self.header.targets.push(info.clone());
        Ok(info)
    }

    /// The records go to a new sink (a new recording window) from now on: Python code
    /// objects are named to it again as they are seen.
    pub fn new_window(&mut self) {
        python::new_window(&mut self.python);
        self.comms.new_window();
    }

    /// `--follow`: attaches to every process that maps NCCL and is not traced yet.
    fn follow_new(&mut self, sink: &mut impl Sink) {
        let Some(mut follow) = self.follow.take() else {
            return;
        };
        let host = Host::live();
        for pid in processes_with_nccl_cached(&host, &mut follow.verdicts) {
            if self.pids.contains(&pid) || follow.refused.contains(&pid) {
                continue;
            }
            let attached = discover(&host, pid, follow.step_symbol.as_deref(), follow.nvtx)
                .and_then(|t| self.add_target(&t));
            match attached {
                Ok(info) => {
                    crate::note!(
                        "nccltrace: --follow: attached to pid {pid} ({}): {} probes",
                        info.comm,
                        info.probes.len()
                    );
                    sink.target_added(&info);
                }
                Err(e) => {
                    crate::note!("nccltrace: --follow: warning: pid {pid} not traced: {e}");
                    follow.refused.push(pid);
                }
            }
        }
        self.follow = Some(follow);
    }

    /// Lost records by kind name, and the other counters by name, summed over CPUs.
    #[must_use]
    pub fn counters(&self) -> (BTreeMap<String, u64>, BTreeMap<String, u64>) {
        let mut lost = BTreeMap::new();
        let mut other = BTreeMap::new();
        for index in 0..counter::COUNT {
            let Ok(values) = self.counters.get(&index, 0) else {
                continue;
            };
            let total: u64 = values.iter().sum();
            if index < kind::COUNT as u32 {
                if index > 0 {
                    lost.insert(Event::kind_name(index as u16).to_owned(), total);
                }
                continue;
            }
            let Some(name) = counter::name(index) else {
                continue;
            };
            other.insert(name.to_owned(), total);
        }
        // The PMU sampler's own losses (its ring full), and damaged rings.
        if let Some(mem) = &self.mem {
            lost.insert(Event::kind_name(kind::MEM_SAMPLE).to_owned(), mem.lost);
            if mem.damaged > 0 {
                other.insert("mem_sample_rings_damaged".to_owned(), mem.damaged);
            }
        }
        // Threads started later whose counters the kernel refused: their loads uncounted.
        if let Some(counting) = self.counting.as_ref().filter(|c| c.refused() > 0) {
            other.insert(
                "node_counter_threads_refused".to_owned(),
                counting.refused(),
            );
        }
        (lost, other)
    }

    /// Drains until every target has exited, `duration` passes, or `stop` is signalled;
    /// then disarms every program and drains what is left.
    pub async fn run(
        &mut self,
        duration: Option<Duration>,
        sink: &mut impl Sink,
        stop: &mut crate::stop::Stop,
    ) -> Result<StopReason, crate::Error> {
        // Records handled between checks of the stop conditions: a producer faster than
        // the drain must not keep the loop from seeing Ctrl-C or the deadline.
        const BUDGET: usize = 16_384;
        let deadline = duration.map(|d| tokio::time::Instant::now() + d);
        // The programs wake the reader only when the buffer fills (see `wake_flags` in the
        // kernel programs); otherwise it is drained on this timer.
        let mut poll = tokio::time::interval(DRAIN_EVERY);
        poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut ticks = 0u32;
        let host = Host::live();
        let mut last_tick = Instant::now();
        let mut last_follow = Instant::now();
        let mut more = true;
        // The first window counts from the reading taken before any probe was attached:
        // the calls made while attaching are in its recording too.
        match self.baseline.take() {
            Some(reading) => sink.program_stats(reading),
            None => self.read_program_stats(sink),
        }
        self.read_counters(sink, &host)?;
        let reason = loop {
            // The ports' readings first: they date from before the records drained next.
            self.pull_infiniband(sink)?;
            self.pull_gpu(sink)?;
            if more {
                more = self.drain_rings(sink, BUDGET)?;
            }
            // The PMU's samples with the programs' records: ones older than attribution's
            // reorder margin when they arrive are counted as late events.
            self.drain_mem(sink)?;
            tokio::select! {
                biased;
                name = stop.requested() => break StopReason::Signal(name),
                () = async {
                    match deadline {
                        Some(d) => tokio::time::sleep_until(d).await,
                        None => std::future::pending().await,
                    }
                } => break StopReason::Duration,
                _ = poll.tick() => {
                    more = true;
                    ticks = ticks.wrapping_add(1);
                    self.read_node_loads(sink, ticks.is_multiple_of(100))?;
                    self.calibrate(false);
                    if !ticks.is_multiple_of(10) {
                        continue;
                    }
                    if self.calibration.is_none() {
                        self.accounting.tick(last_tick.elapsed());
                    }
                    if sink.rotate_due() {
                        break StopReason::Rotate;
                    }
                    if let Some(logger) = self.logger.as_mut() {
                        logger.flush();
                    }
                    if self.follow.is_some() {
                        if last_follow.elapsed() >= Duration::from_secs(1) {
                            last_follow = Instant::now();
                            self.follow_new(sink);
                        }
                    } else if self.pids.iter().all(|p| !host.process_alive(*p)) {
                        break StopReason::TargetsExited;
                    }
                    if last_tick.elapsed() >= Duration::from_secs(1) {
                        last_tick = Instant::now();
                        if let Some(ebpf) = self.ebpf.as_mut() {
                            python::refresh(ebpf, &mut self.python);
                        }
                        self.read_resident(sink, &host)?;
                        self.follow_threads(&host);
                        self.accounting.new_second();
                        self.read_program_stats(sink);
                        self.start_calibration();
                        let lost = self.counters().0;
                        let alive = self.pids.iter().filter(|p| host.process_alive(**p)).count();
                        sink.tick(&lost, alive);
                    }
                }
                // The kernel only signals readiness once the consumer has caught up, so
                // with records left over the loop goes round again without waiting.
                () = tokio::task::yield_now(), if more => {}
                ready = self.rings.readable(), if !more => {
                    ready?;
                    more = true;
                }
            }
        };
        self.pull_infiniband(sink)?;
        self.pull_gpu(sink)?;
        if !matches!(reason, StopReason::Rotate) {
            self.disarm();
            // Its last readings are in; the last of all is taken below.
            self.ib_reader = None;
            if let Some(reader) = self.gpu_reader.take() {
                for record in reader.finish() {
                    sink.record(&record)?;
                }
            }
        }
        // Everything drained so far goes to this sink (a window's last records included).
        self.drain_rings(sink, usize::MAX)?;
        self.drain_mem(sink)?;
        // The steps up to the end are interpolated from these.
        self.read_counters(sink, &host)?;
        // A run shorter than a second has its traps measured now.
        self.read_last_program_stats(sink);
        Ok(reason)
    }

    /// Hands at most `budget` records of the rings to `sink`, each Python code object and
    /// each communicator named in them read from the target the first time; returns
    /// whether records are left.
    fn drain_rings(&mut self, sink: &mut impl Sink, budget: usize) -> Result<bool, crate::Error> {
        let mut naming = python::Naming {
            inner: sink,
            targets: &mut self.python,
        };
        let mut sizing = comms::Sizing {
            inner: &mut naming,
            comms: &mut self.comms,
        };
        self.rings.drain(&mut sizing, budget)
    }

    /// Once, where the programs' run time is accounted: starts measuring what a traced
    /// call's traps cost here (a few milliseconds of calls of the agent's own, a second
    /// into the run, a round between two drains: `calibrate`).
    fn start_calibration(&mut self) {
        if self.traps.is_none()
            && self.calibration.is_none()
            && self.accounting.available()
            && let Some(ebpf) = self.ebpf.as_mut()
        {
            // Timed as the job's calls pay their traps (see `Accounting::pause`); no window
            // opens until it is done.
            self.accounting.pause();
            let before = program_runs(ebpf);
            self.calibration = Some((
                traps::Calibration::new(self.header.sample_period_ns > 0),
                before,
            ));
        }
    }

    /// A round of the calibration, if one is under way (`all`: every round left, at the
    /// end of a run); at its end, its figures and the program runs it caused.
    fn calibrate(&mut self, all: bool) {
        let (Some((calibration, _)), Some(ebpf)) = (self.calibration.as_mut(), self.ebpf.as_mut())
        else {
            return;
        };
        if all {
            calibration.finish(ebpf, &self.uprobes, &mut self.links);
        } else if !calibration.step(ebpf, &self.uprobes, &mut self.links) {
            return;
        }
        let Some((calibration, before)) = self.calibration.take() else {
            return;
        };
        let (traps, sampling) = calibration.results();
        self.traps = Some(traps);
        self.sampling_cost = sampling;
        // The calibration's own runs of the call programs (rejected at once: the agent is
        // no target) are not the job's: exactly `traps::CALLS_MADE` each, and their share
        // of the time the program ran meanwhile (the job's calls ran it too).
        let after = program_runs(ebpf);
        for name in names::UPROBE_PROGRAMS {
            let (r0, t0) = before.get(name).copied().unwrap_or((0, 0));
            let (r1, t1) = after.get(name).copied().unwrap_or((0, 0));
            let (runs, ns) = (r1.saturating_sub(r0), t1.saturating_sub(t0));
            // The entry program ran in both sets of calls, the return program in one.
            let made = if name == names::UPROBE_LIB_CALL {
                2 * traps::CALLS_MADE
            } else {
                traps::CALLS_MADE
            };
            let own_runs = made.min(runs);
            let own_ns = ns.checked_div(runs).map_or(0, |per_run| per_run * own_runs);
            self.calibration_runs
                .insert(name.to_owned(), (own_runs, own_ns));
        }
    }

    /// Each program's runs and run time so far, where the programs account them.
    fn program_reading(&self) -> Option<crate::record::ProgramReading> {
        self.program_reading_at(
            host::clock_ns(libc::CLOCK_MONOTONIC),
            self.accounting.accounted_ns(),
        )
    }

    /// [`Self::program_reading`] as of `at_ns`, the kernel having accounted
    /// `accounted_ns` by then.
    fn program_reading_at(
        &self,
        at_ns: u64,
        accounted_ns: u64,
    ) -> Option<crate::record::ProgramReading> {
        let ebpf = self.ebpf.as_ref().filter(|_| self.accounting.available())?;
        let programs = program_runs(ebpf)
            .into_iter()
            .map(|(name, (runs, ns))| {
                let (r, t) = self.calibration_runs.get(&name).copied().unwrap_or((0, 0));
                (name, runs.saturating_sub(r), ns.saturating_sub(t))
            })
            .collect();
        let sum = |index: u32| -> u64 {
            self.target_costs
                .get(&index, 0)
                .map_or(0, |values| values.iter().sum())
        };
        // Uprobe programs on links made per target run only for targets: counted whole
        // (they do not time themselves).
        let per_target =
            |name: &str| self.uprobes.per_target() && names::UPROBE_PROGRAMS.contains(&name);
        // Every run is counted; runs are timed only in the accounting's windows: their
        // time is the timed runs' mean times every run (an estimate, as the kernel's
        // figures are). None timed: 0, and the summary charges them the kernel's mean run.
        let traced = (0..timed::COUNT)
            .filter_map(|id| {
                let name = timed::PROGRAMS[id as usize];
                // A formatted tracepoint's slot is its raw program's where that one ran.
                let name = names::TRACEPOINTS
                    .iter()
                    .find(|tp| tp.program == name)
                    .map_or(name, |tp| {
                        super::load::tracepoint_program(tp, self.raw_sched).0
                    });
                (!per_target(name)).then(|| {
                    let slot = timed::SLOTS * id;
                    let (runs, timed, ns) = (sum(slot), sum(slot + 1), sum(slot + 2));
                    let estimate = u128::from(ns) * u128::from(runs) / u128::from(timed.max(1));
                    (
                        name.to_owned(),
                        runs,
                        u64::try_from(estimate).unwrap_or(u64::MAX),
                    )
                })
            })
            .collect();
        let (trap_ns, entry_trap_ns, trap_refused) = match &self.traps {
            Some(Ok(t)) => (Some(t.pair_ns), Some(t.entry_ns), None),
            Some(Err(why)) => (None, None, Some(why.clone())),
            None => (
                None,
                None,
                Some("tracing stopped before it was measured".to_owned()),
            ),
        };
        let (sample_interrupt_ns, sample_interrupt_refused) = match &self.sampling_cost {
            Some(Ok(ns)) => (Some(*ns), None),
            Some(Err(why)) => (None, Some(why.clone())),
            None if self.header.sample_period_ns == 0 => (None, None),
            None => (
                None,
                Some("tracing stopped before it was measured".to_owned()),
            ),
        };
        Some(crate::record::ProgramReading {
            at_ns,
            accounted_ns: Some(accounted_ns),
            programs,
            traced,
            trap_ns,
            entry_trap_ns,
            trap_refused,
            sample_interrupt_ns,
            sample_interrupt_refused,
        })
    }

    /// The last reading, with the traps measured if they are not yet: its time and
    /// accounted time taken as tracing ended, so that a run shorter than its first window
    /// is counted whole and the calibration after it (its window closed, the programs
    /// disarmed) is in neither.
    fn read_last_program_stats(&mut self, sink: &mut impl Sink) {
        let (at_ns, accounted_ns) = (
            host::clock_ns(libc::CLOCK_MONOTONIC),
            self.accounting.accounted_ns(),
        );
        self.start_calibration();
        self.calibrate(true);
        if let Some(reading) = self.program_reading_at(at_ns, accounted_ns) {
            sink.program_stats(reading);
        }
    }

    /// Hands `sink` the programs' run time so far.
    fn read_program_stats(&self, sink: &mut impl Sink) {
        if let Some(reading) = self.program_reading() {
            sink.program_stats(reading);
        }
    }

    /// Stops tracing at once: the programs stay attached but, with no target left in
    /// `TARGETS`, emit nothing. Detaching takes seconds (see `detach`), so outputs are
    /// written between the two.
    pub fn disarm(&mut self) {
        if self.stopped_ns.is_some() {
            return;
        }
        for pid in &self.pids {
            // A target added by --follow and already gone is not an error; anything else
            // leaves the programs emitting until they are detached: said.
            if let Err(e) = self.targets.remove(pid)
                && !matches!(e, aya::maps::MapError::KeyNotFound)
            {
                crate::note!(
                    "nccltrace: warning: pid {pid} could not be disarmed ({e}): what its \
                     probes emit after the stop is not recorded"
                );
            }
        }
        // The probes made for one target skip `TARGETS`: this stops them.
        if let Err(e) = self.armed.set(0, 0, 0) {
            crate::note!(
                "nccltrace: warning: the probes could not be disarmed ({e}): what they emit \
                 after the stop is not recorded, and may fill the ring buffers"
            );
        }
        self.stopped_ns = Some(host::clock_ns(libc::CLOCK_MONOTONIC));
    }

    /// Detaches and unloads every program (the maps user space holds stay readable), on
    /// a thread of its own: each detach waits for an RCU grace period under a kernel-wide
    /// mutex (~70-130 ms each here; closing from many threads did not overlap them), so
    /// the outputs are made meanwhile. Returns the thread (`None`: detached here, no thread
    /// to be had) and how many attachments it releases.
    pub fn detach_in_background(&mut self) -> (Option<std::thread::JoinHandle<()>>, usize) {
        let links = std::mem::take(&mut self.links);
        let count = links.len();
        // The uprobe programs loaded for uprobe-multi links go with their links.
        let uprobes = std::mem::replace(
            &mut self.uprobes,
            UprobePrograms::PerFunction { per_target: false },
        );
        let (ebpf, uprobes) = (self.ebpf.take(), uprobes);
        // When no thread can be had, the closure (and what it owns) is dropped here.
        let thread = std::thread::Builder::new()
            .name("nccltrace-detach".into())
            .spawn(move || {
                // Uprobe-multi links each on a thread of its own, beside the rest.
                let (multi, rest): (Vec<Link>, Vec<Link>) =
                    links.into_iter().partition(|l| matches!(l, Link::Multi(_)));
                multi::release_each(multi, || drop(rest));
                drop((ebpf, uprobes));
            })
            .ok();
        (thread, count)
    }
}
