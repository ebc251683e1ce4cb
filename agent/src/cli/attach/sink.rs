//! The live run's sink: each record saved to the recording, counted, fed to the streaming
//! attribution and the metrics, and the progress shown.

use super::*;

/// Saves each record and shows the run's progress.
pub(super) struct LiveSink {
    pub(super) store: Store,
    pub(super) path: PathBuf,
    pub(super) header: Header,
    /// How steps are found, and the events per attribution epoch.
    pub(super) rule: crate::attribute::StepRule,
    pub(super) epoch_events: u64,
    /// The outputs' folder: written as the run is attributed.
    pub(super) out: PathBuf,
    /// The run attributed while it is traced: a thread following the recording as it is
    /// written ([`crate::record::Follow`]), and what it goes by.
    pub(super) live: Option<std::thread::JoinHandle<Aggregator>>,
    pub(super) progress: std::sync::Arc<crate::record::Progress>,
    /// `--metrics`: fed by the attribution, lost counts and targets set each tick.
    pub(super) metrics: Option<std::sync::Arc<crate::metrics::Metrics>>,
    pub(super) metrics_grace: Duration,
    /// `--rotate`, and when this sink's window began.
    pub(super) rotate: Option<super::super::Rotate>,
    pub(super) started: Instant,
    /// The last step attributed, for the status line.
    pub(super) last_step: std::sync::Arc<crate::metrics::LastStep>,
    pub(super) nccl_calls: u64,
    pub(super) records: u64,
    pub(super) status: bool,
    pub(super) last: (Instant, u64),
}

impl LiveSink {
    pub(super) fn aggregator(&self) -> Aggregator {
        streaming_aggregator(
            &self.header,
            &self.rule,
            self.epoch_events,
            &self.out,
            self.metrics.as_ref(),
            &self.last_step,
        )
    }

    /// Starts attributing the run as it is recorded, on a thread that follows the
    /// recording (it lags at most a second: `tick` flushes the writer). Without a thread to
    /// be had, the recording is read back when the run ends.
    pub(super) fn attribute_live(&mut self) {
        let mut agg = self.aggregator();
        let (path, progress) = (self.path.clone(), self.progress.clone());
        let follow = move || {
            // Only on CPU time nothing else wants (the threads it starts inherit this): the
            // job being traced always comes first; attribution lags and catches up.
            idle_priority();
            match crate::record::Follow::open(&path, progress) {
                Ok(mut reader) => agg.feed(&mut reader),
                Err(e) => agg.incomplete(e.to_string()),
            }
            agg
        };
        self.live = std::thread::Builder::new()
            .name("nccltrace-attr".into())
            .spawn(follow)
            .ok();
    }

    /// Says that tracing stopped and what happens next.
    pub(super) fn say_stopped(&self, reason: &str, probes: usize) {
        if self.live.is_some() {
            crate::note!(
                "nccltrace: tracing stopped ({reason}); {} records, attributed as they came: \
                 finishing the outputs while the kernel releases {probes} probes",
                self.records
            );
        } else {
            crate::note!(
                "nccltrace: tracing stopped ({reason}); attributing {} records while the \
                 kernel releases {probes} probes",
                self.records
            );
        }
    }

    /// What the live attribution made of the recording up to now (it is told to stop at
    /// what is in the file); `None` when there is none, or its thread failed.
    pub(super) fn join_live(&mut self) -> Option<Aggregator> {
        let live = self.live.take()?;
        self.progress.close();
        live.join().ok()
    }

    /// Records `meta` where the run is kept (the recording, or memory after a spill).
    pub(super) fn meta(&mut self, meta: Meta) {
        match &mut self.store {
            Store::Disk(writer) => {
                if let Err(e) = writer.meta(&meta) {
                    self.spill(e);
                }
            }
            Store::Memory { agg, .. } => agg.meta(meta),
        }
    }

    /// Moves from disk to memory after `error`: nothing written or gathered is lost.
    pub(super) fn spill(&mut self, error: crate::record::RecordError) {
        crate::note!(
            "nccltrace: warning: {error}; the recording stops here, tracing goes on in memory \
             and every other output is written at the end"
        );
        let Store::Disk(writer) = &mut self.store else {
            return;
        };
        let unwritten = writer.take_unwritten();
        let mut agg = if let Some(agg) = self.join_live() {
            agg
        } else {
            let mut agg = self.aggregator();
            match Reader::open(&self.path) {
                Ok(mut reader) => agg.feed(&mut reader),
                // Said, not silently dropped: the outputs cover what follows.
                Err(e) => agg.incomplete(format!(
                    "the recording could not be read back after its write failed ({e}): the \
                     records written before are left out of the outputs; `nccltrace report` \
                     may read them"
                )),
            }
            agg
        };
        agg.feed(&mut Reader::records_only(
            std::io::Cursor::new(unwritten),
            &self.path,
            self.header.clone(),
        ));
        self.store = Store::Memory {
            agg: Box::new(agg),
            error,
        };
    }

    /// Writes the closing record and puts the recording on disk.
    pub(super) fn close(&mut self, end: &Meta) {
        match &mut self.store {
            Store::Disk(writer) => {
                if let Err(e) = writer.meta(end).and_then(|()| writer.sync()) {
                    self.spill(e);
                }
            }
            Store::Memory { agg, .. } => agg.meta(end.clone()),
        }
    }

    /// Every record of the run folded into an aggregator (read back from the recording),
    /// and the writer to close the recording with, or why it was not written in full.
    pub(super) fn finish(
        mut self,
        limit: u64,
    ) -> (Aggregator, Result<Writer, crate::record::RecordError>) {
        if let Store::Disk(writer) = &mut self.store
            && let Err(e) = writer.flush()
        {
            self.spill(e);
        }
        // Attributed as it was recorded (`--max-attributed-events` reads it back instead;
        // after a spill the memory aggregator holds it all).
        let live = self.join_live();
        // Made only when the recording is to be read back: a streaming aggregator creates
        // the output files, which would clobber those the live one wrote.
        let read_back = live.is_none() && matches!(self.store, Store::Disk(_));
        let agg = if read_back {
            Some(self.aggregator())
        } else {
            live
        };
        match self.store {
            Store::Memory { agg, error } => (*agg, Err(error)),
            Store::Disk(writer) => {
                let Some(mut agg) = agg else {
                    return (Aggregator::new(self.header.clone()), Ok(writer));
                };
                if !read_back {
                    return (agg, Ok(writer));
                }
                let skip = if limit == 0 {
                    0
                } else {
                    self.records.saturating_sub(limit)
                };
                match Reader::open(&self.path) {
                    Ok(mut reader) => agg.feed_last(&mut reader, skip),
                    Err(e) => agg.incomplete(e.to_string()),
                }
                (agg, Ok(writer))
            }
        }
    }
}

impl Sink for LiveSink {
    fn rotate_due(&self) -> bool {
        match self.rotate {
            Some(super::super::Rotate::Every(d)) => self.started.elapsed() >= d,
            Some(super::super::Rotate::Bytes(b)) => self.progress.durable() >= b,
            None => false,
        }
    }

    fn record(&mut self, bytes: &[u8]) -> Result<(), Error> {
        self.records += 1;
        match &mut self.store {
            Store::Disk(writer) => {
                if let Err(e) = writer.kernel(bytes) {
                    self.spill(e);
                }
            }
            Store::Memory { agg, .. } => {
                let _ = agg.push_raw(bytes);
            }
        }
        if self.status
            && let Ok(crate::event::Event::Call(c)) = crate::decode::decode(bytes)
        {
            self.nccl_calls += u64::from(c.func.library() == crate::event::Library::Nccl);
        }
        Ok(())
    }

    fn target_added(&mut self, target: &crate::record::TargetInfo) {
        let meta = Meta::Target {
            target: Box::new(target.clone()),
        };
        match &mut self.store {
            Store::Disk(writer) => match writer.meta(&meta) {
                Ok(()) => {}
                Err(crate::record::RecordError::TooLarge { bytes, .. }) => {
                    // A process with a huge memory map: recorded without the map's text.
                    crate::note!(
                        "nccltrace: warning: pid {}'s memory map ({bytes} bytes) is too large \
                         to record: `report` elsewhere cannot name its frames",
                        target.pid
                    );
                    let mut lean = target.clone();
                    lean.maps_text.clear();
                    let meta = Meta::Target {
                        target: Box::new(lean),
                    };
                    if let Err(e) = writer.meta(&meta) {
                        self.spill(e);
                    }
                }
                Err(e) => self.spill(e),
            },
            Store::Memory { agg, .. } => agg.meta(meta),
        }
    }

    fn python_codes(&mut self, pid: u32, codes: Vec<(u64, crate::python::CodeInfo)>) {
        self.meta(Meta::PythonCodes { pid, codes });
    }

    fn program_stats(&mut self, reading: crate::record::ProgramReading) {
        self.meta(Meta::ProgramStats(reading));
    }

    fn numastat(&mut self, at_ns: u64, nodes: Vec<(u32, Vec<(String, u64)>)>) {
        if !nodes.is_empty() {
            self.meta(Meta::Numastat { at_ns, nodes });
        }
    }

    fn tick(&mut self, lost_by_kind: &std::collections::BTreeMap<String, u64>, alive: usize) {
        let lost: u64 = lost_by_kind.values().sum();
        if let Some(m) = &self.metrics {
            m.set_lost(lost_by_kind);
            m.set_targets(alive);
            let host = host::Host::live();
            for gone in m.retire(|pid| host.process_alive(pid), self.metrics_grace) {
                crate::note!(
                    "nccltrace: rank {:?}'s process is gone: its series are no longer served",
                    gone.rank
                );
            }
        }
        // The live attribution reads what is flushed: at most a tick behind.
        if let Store::Disk(writer) = &mut self.store
            && let Err(e) = writer.flush()
        {
            self.spill(e);
        }
        if lost > 0 && !self.status {
            crate::note!("nccltrace: warning: {lost} events lost so far (ring buffer full)");
        }
        if !self.status {
            return;
        }
        let (at, before) = self.last;
        let rate = (self.records - before) as f64 / at.elapsed().as_secs_f64().max(1e-3);
        self.last = (Instant::now(), self.records);
        let steps = self.last_step.line().unwrap_or_default();
        // Cleared to the end of the line: the step part varies in length.
        let _ = write!(
            std::io::stderr(),
            "\rnccltrace: {rate:>9.0} events/s  {:>8} NCCL calls  {lost:>6} lost  {steps}\x1b[K",
            self.nccl_calls
        );
    }
}
