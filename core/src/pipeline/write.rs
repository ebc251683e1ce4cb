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
        bpf.per_step(streamer.table.len(), streamer.table.wall_ns());
    }
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
        run: Box<crate::render::trace::RunInfo>,
        /// When tracing began: ts 0 of a trace that had no epoch.
        start_ns: u64,
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
                            run,
                            start_ns,
                            ranks,
                            end_ns,
                        } => {
                            let t = match trace.take() {
                                Some(t) => t,
                                None => crate::render::trace::TraceStream::new(
                                    out.take()
                                        .ok_or_else(|| io::Error::other("trace ended twice"))?,
                                    start_ns,
                                )?,
                            };
                            return t.finish(&run, &ranks, end_ns);
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
                run: Box::default(),
                start_ns: 0,
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
            run: Box::new((&outputs.header).into()),
            start_ns: outputs.header.clock.monotonic_ns,
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
            let lines = w.lines(stacks, &symbols, outputs.header.offcpu_min_ns);
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
            // Before the steps: the table's verdict stays the last line.
            render::summary::write_cost(&outputs.summary.agent, text)?;
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
