//! Writing the outputs into their folder as the run is attributed.

use std::collections::BTreeMap;
use std::io;
use std::path::Path;

use super::{Outputs, Summary};

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
    if let Some(bpf) = &mut outputs.summary.agent.bpf {
        bpf.per_step(streamer.handed.0, streamer.handed.1);
    }
    streamer.finish(outputs, text)
}

/// Writes the outputs as the run is attributed: each epoch's steps go to steps.json and
/// steps.csv, its timeline to trace.json (each on a thread of its own), its stacks'
/// weights into the flamegraphs; what needs the whole run (names, symbols, the rest of
/// steps.json, the table) is written at [`Streamer::finish`].
pub struct Streamer {
    dir: std::path::PathBuf,
    steps: Option<Worker<StepsJsonFile>>,
    csv: Option<Worker<StepsCsvFile>>,
    trace: Option<Worker<TraceFile>>,
    flamegraphs: Option<Worker<Flamegraphs>>,
    /// Steps handed on, and their wall time.
    handed: (usize, u64),
    failed: Option<(std::path::PathBuf, io::Error)>,
}

/// A failure to write, with the file it concerns.
type Failure = (std::path::PathBuf, io::Error);

/// An output written from the epochs, on a thread of its own ([`Worker`]).
trait Output: Send + 'static {
    /// What completes it, once the run is over.
    type End: Send + 'static;
    fn epoch(&mut self, epoch: &crate::attribute::Epoch) -> Result<(), Failure>;
    fn end(self, end: Self::End) -> Result<(), Failure>;
}

/// What a worker is handed.
enum Msg<E> {
    Epoch(std::sync::Arc<crate::attribute::Epoch>),
    End(E),
}

/// A thread writing one [`Output`] while the run is attributed: the outputs took as long
/// as the attribution, and trace.json as long as all the others together.
struct Worker<O: Output> {
    to: std::sync::mpsc::SyncSender<Msg<O::End>>,
    done: std::thread::JoinHandle<Result<(), Failure>>,
    /// The file a failure of the thread itself is told under.
    path: std::path::PathBuf,
}

impl<O: Output> Worker<O> {
    fn start(name: &str, path: std::path::PathBuf, mut output: O) -> Result<Worker<O>, Failure> {
        let stopped = path.clone();
        // None queued: an epoch is handed on when the thread has written the one before
        // (it writes one while the next is attributed). Each epoch held is every step and
        // call of ~20 ms of the run: with two queued a writer, `report` of 300,000
        // one-call steps peaked at 43-70 MB, with none at 44-49 MB, as fast.
        let (to, from) = std::sync::mpsc::sync_channel::<Msg<O::End>>(0);
        let done = std::thread::Builder::new()
            .name(format!("nccltrace-{name}"))
            .spawn(move || {
                for msg in from {
                    match msg {
                        Msg::Epoch(e) => output.epoch(&e)?,
                        Msg::End(end) => {
                            let ended = output.end(end);
                            crate::procfs::log_thread_cpu();
                            return ended;
                        }
                    }
                }
                Err((stopped, io::Error::other("the output was not ended")))
            })
            .map_err(|e| (path.clone(), e))?;
        Ok(Worker { to, done, path })
    }

    /// Hands on an epoch; an error is the thread's, which stopped on it.
    fn epoch(self, epoch: std::sync::Arc<crate::attribute::Epoch>) -> Result<Self, Failure> {
        match self.to.send(Msg::Epoch(epoch)) {
            Ok(()) => Ok(self),
            Err(_) => Err(self.join()),
        }
    }

    /// Asks the thread to end the output ([`Worker::finished`] says how it went).
    fn end(&self, end: O::End) {
        // A send fails only when the thread stopped on an error: joining gives it.
        let _ = self.to.send(Msg::End(end));
    }

    /// Waits for the thread; how writing went.
    fn finished(self) -> Result<(), Failure> {
        drop(self.to);
        let path = self.path;
        self.done
            .join()
            .unwrap_or_else(|_| Err((path, io::Error::other("its writing thread panicked"))))
    }

    /// The error the thread stopped on.
    fn join(self) -> Failure {
        let path = self.path.clone();
        self.finished()
            .err()
            .unwrap_or_else(|| (path, io::Error::other("its writing thread stopped")))
    }
}

/// steps.json, a row per step, then the rest of the report.
struct StepsJsonFile {
    path: std::path::PathBuf,
    json: crate::render::steps::StepsJson<super::behind::OutputFile>,
}

impl Output for StepsJsonFile {
    /// The rest of steps.json: the report but its steps.
    type End = Box<crate::attribute::StepsReport>;

    fn epoch(&mut self, epoch: &crate::attribute::Epoch) -> Result<(), Failure> {
        // Flushed each epoch: a run can be followed in the file as it goes.
        epoch
            .steps
            .iter()
            .try_for_each(|s| self.json.step(s))
            .and_then(|()| self.json.flush())
            .map_err(|e| (self.path.clone(), e))
    }

    fn end(self, report: Self::End) -> Result<(), Failure> {
        self.json.finish(&report).map_err(|e| (self.path, e))
    }
}

/// steps.csv, a row per step. On a thread of its own beside steps.json's: together they
/// were the slowest writer of a run of short steps.
struct StepsCsvFile {
    path: std::path::PathBuf,
    out: super::behind::OutputFile,
}

impl Output for StepsCsvFile {
    type End = ();

    fn epoch(&mut self, epoch: &crate::attribute::Epoch) -> Result<(), Failure> {
        crate::render::steps::write_csv_rows(&epoch.steps, &mut self.out)
            .and_then(|()| io::Write::flush(&mut self.out))
            .map_err(|e| (self.path.clone(), e))
    }

    fn end(mut self, (): ()) -> Result<(), Failure> {
        io::Write::flush(&mut self.out).map_err(|e| (self.path, e))
    }
}

/// trace.json, begun at the first epoch (its ts 0 is that epoch's first event).
struct TraceFile {
    path: std::path::PathBuf,
    out: Option<super::behind::OutputFile>,
    trace: Option<crate::render::trace::TraceStream<super::behind::OutputFile>>,
}

/// What ends trace.json.
struct TraceEnd {
    run: Box<crate::render::trace::RunInfo>,
    /// When tracing began: ts 0 of a trace that had no epoch.
    start_ns: u64,
    /// What each process is ([`crate::render::trace::roles`]).
    roles: Vec<(u32, String)>,
    end_ns: u64,
    /// The GPUs' names and utilization samples.
    gpus: Vec<String>,
    gpu_samples: Vec<crate::attribute::GpuSample>,
}

impl TraceEnd {
    fn of(outputs: &Outputs) -> TraceEnd {
        TraceEnd {
            run: Box::new((&outputs.header).into()),
            start_ns: outputs.header.clock.monotonic_ns,
            roles: crate::render::trace::roles(&outputs.steps.ranks, &outputs.steps.workers),
            end_ns: outputs.detail.end_ns,
            gpus: outputs.header.gpus.iter().map(|g| g.name.clone()).collect(),
            gpu_samples: outputs.gpu_samples.clone(),
        }
    }
}

impl Output for TraceFile {
    type End = TraceEnd;

    fn epoch(&mut self, e: &crate::attribute::Epoch) -> Result<(), Failure> {
        let written = (|| {
            if self.trace.is_none()
                && let Some(out) = self.out.take()
            {
                let mut trace = crate::render::trace::TraceStream::new(out, e.detail.first_ns)?;
                trace.parallel(super::behind::spare_cpus());
                self.trace = Some(trace);
            }
            match &mut self.trace {
                Some(t) => t.epoch(&e.detail, &e.steps, e.detail.rank_pid),
                None => Ok(()),
            }
        })();
        written.map_err(|err| (self.path.clone(), err))
    }

    fn end(mut self, end: TraceEnd) -> Result<(), Failure> {
        let written = (|| {
            let mut t = match self.trace.take() {
                Some(t) => t,
                None => crate::render::trace::TraceStream::new(
                    self.out
                        .take()
                        .ok_or_else(|| io::Error::other("trace ended twice"))?,
                    end.start_ns,
                )?,
            };
            t.gpus(&end.gpus, &end.gpu_samples)?;
            t.finish(&end.run, &end.roles, end.end_ns)
        })();
        written.map_err(|err| (self.path, err))
    }
}

/// The flamegraphs' weights, added up from the epochs on a thread of their own (on the
/// trainer recording they were a sixth of the report's main thread), and the steps'
/// table for the summary in words (a twentieth of the main thread on one-call steps).
#[derive(Default)]
struct Flamegraphs {
    weights: [crate::render::flamegraph::Weights; 4],
    /// Samples per stack, for the share of short user stacks.
    samples: BTreeMap<u32, u64>,
    table: crate::render::steps::StepTable,
}

impl Output for Flamegraphs {
    /// Where the weights go once every epoch is weighed.
    type End = std::sync::mpsc::Sender<Flamegraphs>;

    fn epoch(&mut self, e: &crate::attribute::Epoch) -> Result<(), Failure> {
        use crate::render::flamegraph::{Kind, count_samples};
        for (kind, w) in Kind::ALL.iter().zip(&mut self.weights) {
            w.weigh(&e.detail, *kind);
        }
        count_samples(&e.detail, &mut self.samples);
        for s in &e.steps {
            self.table.push(s);
        }
        Ok(())
    }

    fn end(self, to: Self::End) -> Result<(), Failure> {
        // The receiver gone: the run's end stopped on an error of its own.
        let _ = to.send(self);
        Ok(())
    }
}

/// The attributed graph's heaviest other_offcpu, nccl_wait and gpu_wait stacks (for
/// steps.json).
type TopStacks = (
    Vec<crate::attribute::BlockingStack>,
    Vec<crate::attribute::BlockingStack>,
    Vec<crate::attribute::BlockingStack>,
);

/// What the four flamegraphs are drawn from at the end.
struct Graphs<'a> {
    dir: &'a Path,
    stacks: &'a [crate::attribute::StackKey],
    symbols: &'a crate::symbolize::Symbols,
    min_ns: u64,
}

impl Graphs<'_> {
    /// Writes each graph's folded lines and SVG, the four side by side (they were a
    /// fifth of the trainer recording's report, one after another); per graph, the top
    /// stacks where it has them and the first failure.
    fn write(
        &self,
        weights: &[crate::render::flamegraph::Weights; 4],
    ) -> Vec<(Option<TopStacks>, Option<Failure>)> {
        use crate::render::flamegraph::Kind;
        std::thread::scope(|scope| {
            let running: Vec<_> = Kind::ALL
                .iter()
                .zip(weights)
                .map(|(&kind, w)| {
                    let draw = move || self.one(kind, w);
                    // Drawn here if no thread can be started.
                    let thread = std::thread::Builder::new()
                        .name("nccltrace-flame".into())
                        .spawn_scoped(scope, draw)
                        .map_err(|_| draw);
                    (kind, thread)
                })
                .collect();
            running
                .into_iter()
                .map(|(kind, thread)| match thread {
                    Ok(thread) => thread.join().unwrap_or_else(|_| {
                        let path = self.dir.join(format!("{}.svg", kind.file()));
                        (
                            None,
                            Some((path, io::Error::other("its drawing thread panicked"))),
                        )
                    }),
                    Err(draw) => draw(),
                })
                .collect()
        })
    }

    /// One graph.
    fn one(
        &self,
        kind: crate::render::flamegraph::Kind,
        w: &crate::render::flamegraph::Weights,
    ) -> (Option<TopStacks>, Option<Failure>) {
        use crate::render::flamegraph::{self, Kind};
        let lines = w.lines(self.stacks, self.symbols, self.min_ns);
        let tops = (kind == Kind::Attributed).then(|| {
            (
                flamegraph::top_stacks(&lines, "other_offcpu", 5),
                flamegraph::top_stacks(&lines, "nccl_wait", 5),
                flamegraph::top_stacks(&lines, "gpu_wait", 5),
            )
        });
        let folded = write_file(self.dir, &format!("{}.folded", kind.file()), &mut |out| {
            flamegraph::write_folded(&lines, out)
        });
        let svg = write_file(self.dir, &format!("{}.svg", kind.file()), &mut |out| {
            flamegraph::write_svg(kind, &lines, out)
        });
        (tops, folded.err().or(svg.err()))
    }
}

impl std::fmt::Debug for Streamer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Streamer")
            .field("dir", &self.dir)
            .field("steps", &self.handed.0)
            .finish_non_exhaustive()
    }
}

impl Streamer {
    /// Starts steps.json, steps.csv and trace.json in `dir`.
    pub fn create(dir: &Path) -> Result<Streamer, Failure> {
        // Written behind, by a thread each, where there are CPUs for it
        // (docs/attribution.md).
        let open = |name: &str, thread: &str| {
            let path = dir.join(name);
            std::fs::File::create(&path)
                .and_then(|f| super::behind::OutputFile::new(f, thread))
                .map_err(|e| (path, e))
        };
        let json = crate::render::steps::StepsJson::new(open("steps.json", "steps-io")?)
            .map_err(|e| (dir.join("steps.json"), e))?;
        let mut csv = open("steps.csv", "csv-io")?;
        io::Write::write_all(
            &mut csv,
            format!("{}\n", crate::render::steps::csv_columns().join(",")).as_bytes(),
        )
        .map_err(|e| (dir.join("steps.csv"), e))?;
        let steps = StepsJsonFile {
            path: dir.join("steps.json"),
            json,
        };
        let csv = StepsCsvFile {
            path: dir.join("steps.csv"),
            out: csv,
        };
        let trace = TraceFile {
            out: Some(open("trace.json", "trace-io")?),
            path: dir.join("trace.json"),
            trace: None,
        };
        Ok(Streamer {
            dir: dir.to_owned(),
            steps: Some(Worker::start("steps", dir.join("steps.json"), steps)?),
            csv: Some(Worker::start("csv", dir.join("steps.csv"), csv)?),
            trace: Some(Worker::start("trace", dir.join("trace.json"), trace)?),
            flamegraphs: Some(Worker::start(
                "flamegraphs",
                dir.join(format!(
                    "{}.svg",
                    crate::render::flamegraph::Kind::OnCpu.file()
                )),
                Flamegraphs::default(),
            )?),
            handed: (0, 0),
            failed: None,
        })
    }

    /// Hands `epoch` to an output's thread; a thread that stopped says why, once.
    fn hand<O: Output>(
        worker: &mut Option<Worker<O>>,
        epoch: std::sync::Arc<crate::attribute::Epoch>,
        failed: &mut Option<Failure>,
    ) {
        if let Some(w) = worker.take() {
            match w.epoch(epoch) {
                Ok(w) => *worker = Some(w),
                Err(e) => {
                    failed.get_or_insert(e);
                }
            }
        }
    }

    /// One epoch: its steps, final, and its part of the timeline.
    pub fn epoch(&mut self, epoch: crate::attribute::Epoch) {
        let epoch = std::sync::Arc::new(epoch);
        Self::hand(&mut self.steps, epoch.clone(), &mut self.failed);
        Self::hand(&mut self.csv, epoch.clone(), &mut self.failed);
        Self::hand(&mut self.trace, epoch.clone(), &mut self.failed);
        Self::hand(&mut self.flamegraphs, epoch.clone(), &mut self.failed);
        self.handed.0 += epoch.steps.len();
        self.handed.1 += epoch.steps.iter().map(|s| s.wall_ns).sum::<u64>();
    }

    /// Completes every output but `summary.json` and prints the summary in words.
    pub fn finish(mut self, outputs: &Outputs, text: &mut impl io::Write) -> Result<(), Failure> {
        use crate::render;
        if let Some(trace) = &self.trace {
            trace.end(TraceEnd::of(outputs));
        }
        // The weights come back once their thread has weighed every epoch (symbolizing
        // meanwhile); a thread that stopped has nothing to give, and says why below.
        let (to, weighed) = std::sync::mpsc::channel();
        if let Some(flamegraphs) = &self.flamegraphs {
            flamegraphs.end(to);
        }
        if let Some(doctor) = &outputs.doctor
            && let Err(e) = write_file(&self.dir, "doctor.json", &mut |out| {
                serde_json::to_writer_pretty(&mut *out, doctor)?;
                io::Write::write_all(out, b"\n")
            })
        {
            self.failed.get_or_insert(e);
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
        let weighed: Flamegraphs = weighed.recv().unwrap_or_default();
        let mut report = render::steps::without_steps(&outputs.steps);
        let graphs = Graphs {
            dir: &self.dir,
            stacks,
            symbols: &symbols,
            min_ns: outputs.header.offcpu_min_ns,
        };
        for (tops, failed) in graphs.write(&weighed.weights) {
            if let Some((other_offcpu, nccl_wait, gpu_wait)) = tops {
                report.other_offcpu_top_stacks = other_offcpu;
                report.nccl_wait_top_stacks = nccl_wait;
                report.gpu_wait_top_stacks = gpu_wait;
            }
            if let Some(e) = failed {
                self.failed.get_or_insert(e);
            }
        }
        for idle in &mut report.idle {
            idle.top_stacks = render::flamegraph::named_top(stacks, &symbols, &idle.stack_ns, 5);
        }
        if let Some(steps) = &self.steps {
            steps.end(Box::new(report.clone()));
        }
        if let Some(csv) = &self.csv {
            csv.end(());
        }
        let stdout = Path::new("(standard output)");
        let share = render::flamegraph::short_stack_share(stacks, &weighed.samples);
        let mut print = || -> io::Result<()> {
            render::summary::write_text(&outputs.summary, text)?;
            // Before the steps: the table's verdict stays the last line.
            render::summary::write_cost(&outputs.summary.agent, text)?;
            render::steps::write_table(&report, &weighed.table, text)?;
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
        for done in [
            self.steps.take().map(Worker::finished),
            self.csv.take().map(Worker::finished),
            self.trace.take().map(Worker::finished),
            self.flamegraphs.take().map(Worker::finished),
        ]
        .into_iter()
        .flatten()
        {
            if let Err(e) = done {
                self.failed.get_or_insert(e);
            }
        }
        self.failed.map_or(Ok(()), Err)
    }
}
