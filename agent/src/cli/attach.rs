//! `nccltrace attach --pid PID`: join running ranks, trace, write every output.

use std::collections::BTreeMap;
use std::io::{IsTerminal as _, Write as _};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::pipeline::Aggregator;
use crate::profile::Profile;
use crate::record::{Header, Meta, Reader, Writer};
use crate::source::{self, Sink};
use crate::{Error, host};

#[derive(Debug, clap::Args)]
#[allow(clippy::struct_excessive_bools)] // command-line flags
pub struct AttachArgs {
    /// Process ids of the ranks (comma-separated, or repeat the flag).
    #[arg(long, short, required_unless_present = "all", value_delimiter = ',')]
    pid: Vec<u32>,
    /// Every process on the host that maps NCCL (in libnccl or linked into another
    /// library).
    #[arg(long, conflicts_with = "pid")]
    all: bool,
    /// With --all: also attach to processes that load NCCL later (elastic restarts, new
    /// ranks), until --duration or Ctrl-C; the run does not end when the targets exit.
    #[arg(long, requires = "all")]
    follow: bool,
    /// Folder for the outputs (refused if it exists, unless --force).
    #[arg(long, short, default_value = "nccltrace-out")]
    out: PathBuf,
    /// Stop after this long (500ms, 30s, 2m, 1h; a bare number is seconds); it also bounds
    /// --wait-for-nccl. Default: until the targets exit or Ctrl-C.
    #[arg(long, short, allow_hyphen_values = true)]
    duration: Option<String>,
    /// Probe preset: default, minimal, full, or a TOML file.
    #[arg(long, default_value = "default")]
    profile: String,
    /// Write into --out even if it exists.
    #[arg(long)]
    force: bool,
    /// Cut steps into fixed windows (100ms, 1s) instead of finding them.
    #[arg(long)]
    step_window: Option<String>,
    /// On-CPU samples per second of a target thread's CPU time (overrides the profile; 0: off).
    #[arg(long)]
    sample_hz: Option<u32>,
    /// If a target has not loaded NCCL yet, wait until it does (or exits), then attach.
    #[arg(long)]
    wait_for_nccl: bool,
    /// Steps start at each call of this function (SYMBOL or SYMBOL@LIBRARY).
    #[arg(long, conflicts_with = "step_window")]
    step_symbol: Option<String>,
    /// Steps start at each NVTX range pushed with a name matching this regular expression
    /// (nvtxRangePushA of libnvToolsExt or another library exporting it).
    #[arg(long, conflicts_with_all = ["step_window", "step_symbol"])]
    step_nvtx: Option<String>,
    /// Attribute (steps, categories, flamegraphs, trace) only the last N events of the
    /// run; totals count every event, and `nccltrace report` attributes the whole
    /// recording. 0: the whole run (memory stays bounded either way: the run is attributed
    /// in epochs as it is read).
    #[arg(long, default_value_t = 0)]
    max_attributed_events: u64,
    /// Attribute in epochs of at least this many events (0: the whole run at once). For
    /// tests and for checking that epochs do not change the outputs.
    #[arg(long, hide = true, default_value_t = crate::pipeline::EPOCH_EVENTS)]
    epoch_events: u64,
    /// Serve Prometheus metrics on this address while tracing (per-rank step times and
    /// categories, NCCL calls and bytes, lost events, NUMA and InfiniBand counters). Alone:
    /// 127.0.0.1:9464, loopback only; 0.0.0.0:PORT serves every interface. Port 0 picks a
    /// free port (printed).
    #[arg(long, value_name = "ADDR", num_args = 0..=1, default_missing_value = crate::metrics::DEFAULT_ADDR)]
    metrics: Option<String>,
    /// Cut the run into windows, each a complete output folder named by its UTC start
    /// time under --out: after a length of time (1h) or once the recording holds a size
    /// (1GiB). For an agent left running: tracing goes on across windows.
    #[arg(long, value_name = "TIME|SIZE")]
    rotate: Option<String>,
    /// With --rotate: keep only the newest N windows (0: all).
    #[arg(long, value_name = "N", requires = "rotate", default_value_t = 0)]
    keep: usize,
    /// How long the series of a rank whose process is gone stay served (a restarted rank
    /// with the same labels keeps them).
    #[arg(long, hide = true, default_value = "5m", requires = "metrics")]
    metrics_grace: String,
}

/// Validated attach settings.
struct Settings {
    pids: Vec<u32>,
    out: super::OutDir,
    duration: Option<Duration>,
    profile: Profile,
    step_rule: crate::attribute::StepRule,
    wait_for_nccl: bool,
    step_symbol: Option<String>,
    step_nvtx: Option<String>,
    follow: bool,
    max_attributed_events: u64,
    epoch_events: u64,
    /// Bound before anything is traced (`--metrics`), and how long a gone rank's series
    /// stay.
    metrics: Option<std::net::TcpListener>,
    metrics_grace: Duration,
    rotate: Option<super::Rotate>,
    keep: usize,
}

impl AttachArgs {
    fn validate(self) -> Result<Settings, Error> {
        let duration = self
            .duration
            .as_deref()
            .map(super::parse_duration)
            .transpose()?;
        // clap's `requires` counts a flag's default (false) as given: checked here.
        if self.follow && !self.all {
            return Err(Error::InvalidArgument {
                what: "--follow",
                value: "without --all".into(),
                expected: "--all --follow (attach to every process that maps NCCL, now and later)",
            });
        }
        let mut profile = Profile::load(&self.profile)?;
        if let Some(hz) = self.sample_hz {
            profile.set_sample_hz(hz)?;
        }
        let step_rule = super::step_rule(self.step_window.as_deref(), self.step_nvtx.as_deref())?;
        let mut pids = if self.all {
            let found = source::processes_with_nccl(&host::Host::live());
            if found.is_empty() && !self.follow {
                return Err(Error::InvalidArgument {
                    what: "--all",
                    value: "no process maps NCCL".into(),
                    expected: "a running job that has initialised NCCL (or use --pid with --wait-for-nccl)",
                });
            }
            crate::note!(
                "nccltrace: --all found {} process(es) mapping NCCL: {found:?}",
                found.len()
            );
            found
        } else {
            self.pid
        };
        pids.sort_unstable();
        pids.dedup();
        if let Some(zero) = pids.iter().find(|p| **p == 0) {
            return Err(Error::InvalidArgument {
                what: "pid",
                value: zero.to_string(),
                expected: "a process id above 0",
            });
        }
        let rotate = self
            .rotate
            .as_deref()
            .map(super::parse_rotate)
            .transpose()?;
        if let Some(super::Rotate::Every(d)) = rotate
            && d < Duration::from_secs(1)
        {
            return Err(Error::InvalidArgument {
                what: "--rotate",
                value: self.rotate.unwrap_or_default(),
                expected: "windows of at least 1s (windows are named by the second they start)",
            });
        }
        let metrics = self
            .metrics
            .as_deref()
            .map(crate::metrics::http::bind)
            .transpose()?;
        // Last: a folder is made only for a command that is otherwise valid.
        let out = super::OutDir::create(&self.out, self.force)?;
        Ok(Settings {
            pids,
            out,
            duration,
            profile,
            step_rule,
            wait_for_nccl: self.wait_for_nccl,
            step_symbol: self.step_symbol,
            step_nvtx: self.step_nvtx,
            follow: self.follow,
            max_attributed_events: self.max_attributed_events,
            epoch_events: self.epoch_events,
            metrics,
            metrics_grace: super::parse_duration(&self.metrics_grace)?,
            rotate,
            keep: self.keep,
        })
    }
}

/// Where the run's records go: the recording on disk, read back when the run ends, so
/// the agent's memory stays flat however long it traces; after a failed write (a full
/// disk), memory, seeded with what the file and the writer's buffer hold.
enum Store {
    Disk(Writer),
    Memory {
        agg: Box<Aggregator>,
        /// Why the recording stopped being written.
        error: crate::record::RecordError,
    },
}

/// Puts the calling thread under SCHED_IDLE. A refusal (a seccomp filter, an old kernel)
/// leaves it as it was: the attribution then competes with the job like any thread.
fn idle_priority() {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: `param` is a valid sched_param for the duration of the call; pid 0 is the
    // calling thread.
    let rc = unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &raw const param) };
    if rc != 0 {
        log::debug!("SCHED_IDLE refused: {}", std::io::Error::last_os_error());
    }
}

/// An aggregator that finds steps by `rule` and writes the outputs into `out` as the run is
/// attributed (at the end instead, said, when the files cannot be made now).
fn streaming_aggregator(
    header: &Header,
    rule: &crate::attribute::StepRule,
    epoch_events: u64,
    out: &std::path::Path,
    metrics: Option<&std::sync::Arc<crate::metrics::Metrics>>,
    last_step: &std::sync::Arc<crate::metrics::LastStep>,
) -> Aggregator {
    let mut agg = Aggregator::new(header.clone());
    agg.stream(rule.clone(), epoch_events);
    agg.add_sink(Box::new(crate::metrics::StatusSink(last_step.clone())));
    if let Some(m) = metrics {
        agg.add_sink(Box::new(crate::metrics::Feed::new(
            m.clone(),
            host::Host::live(),
            header,
        )));
    }
    if let Err((path, e)) = agg.stream_into(out) {
        crate::note!(
            "nccltrace: warning: cannot write {} ({e}); the outputs are written at the end \
             instead",
            path.display()
        );
    }
    agg
}

/// Saves each record and shows the run's progress.
struct LiveSink {
    store: Store,
    path: PathBuf,
    header: Header,
    /// How steps are found, and the events per attribution epoch.
    rule: crate::attribute::StepRule,
    epoch_events: u64,
    /// The outputs' folder: written as the run is attributed.
    out: PathBuf,
    /// The run attributed while it is traced: a thread following the recording as it is
    /// written ([`crate::record::Follow`]), and what it goes by.
    live: Option<std::thread::JoinHandle<Aggregator>>,
    progress: std::sync::Arc<crate::record::Progress>,
    /// `--metrics`: fed by the attribution, lost counts and targets set each tick.
    metrics: Option<std::sync::Arc<crate::metrics::Metrics>>,
    metrics_grace: Duration,
    /// `--rotate`, and when this sink's window began.
    rotate: Option<super::Rotate>,
    started: Instant,
    /// The last step attributed, for the status line.
    last_step: std::sync::Arc<crate::metrics::LastStep>,
    nccl_calls: u64,
    records: u64,
    status: bool,
    last: (Instant, u64),
}

impl LiveSink {
    fn aggregator(&self) -> Aggregator {
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
    fn attribute_live(&mut self) {
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
    fn say_stopped(&self, reason: &str, probes: usize) {
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
    fn join_live(&mut self) -> Option<Aggregator> {
        let live = self.live.take()?;
        self.progress.close();
        live.join().ok()
    }

    /// Records `meta` where the run is kept (the recording, or memory after a spill).
    fn meta(&mut self, meta: Meta) {
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
    fn spill(&mut self, error: crate::record::RecordError) {
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
    fn close(&mut self, end: &Meta) {
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
    fn finish(mut self, limit: u64) -> (Aggregator, Result<Writer, crate::record::RecordError>) {
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
            Some(super::Rotate::Every(d)) => self.started.elapsed() >= d,
            Some(super::Rotate::Bytes(b)) => self.progress.durable() >= b,
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

/// Finds NCCL in `pid`; with `--wait-for-nccl`, polls until the process loads it, exits,
/// `--duration` passes or a signal comes.
fn discover(
    host: &host::Host,
    pid: u32,
    settings: &Settings,
    stop: &crate::stop::Stop,
) -> Result<source::Target, Error> {
    let started = Instant::now();
    let exited = || -> Error {
        source::SourceError::ExitedBeforeNccl {
            pid,
            waited_s: started.elapsed().as_secs_f64(),
        }
        .into()
    };
    let mut announced = false;
    loop {
        let nvtx = settings.step_nvtx.is_some();
        match source::discover(host, pid, settings.step_symbol.as_deref(), nvtx) {
            Err(source::SourceError::NoNccl { .. }) if settings.wait_for_nccl => {
                if let Some(signal) = stop.signalled() {
                    return Err(Error::Interrupted {
                        signal,
                        during: format!("waiting for pid {pid} to load NCCL"),
                    });
                }
                if !host.process_alive(pid) {
                    return Err(exited());
                }
                if let Some(duration) = settings.duration
                    && started.elapsed() >= duration
                {
                    return Err(source::SourceError::NcclNotLoadedInTime { pid, duration }.into());
                }
                if !announced {
                    crate::note!("nccltrace: waiting for pid {pid} to load NCCL (--wait-for-nccl)");
                    announced = true;
                }
                std::thread::sleep(Duration::from_millis(200));
            }
            Err(source::SourceError::NoSuchProcess { .. }) if announced => return Err(exited()),
            other => return other.map_err(Error::from),
        }
    }
}

/// At most two malloc arenas. glibc gives threads arenas of their own (up to eight per
/// CPU) and keeps what they freed: with `--rotate`, each window's threads (attribution,
/// reading, trace writer, finishing) left the process about 7 MB larger, up to ~35 MB more
/// on a 2-CPU host. The agent's threads allocate little concurrently; two arenas are
/// plenty.
fn few_malloc_arenas() {
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt only sets an allocator parameter; called before any thread starts.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 2);
    }
}

pub fn run(args: AttachArgs) -> Result<(), Error> {
    few_malloc_arenas();
    // First, before any folder is made: without privileges nothing else can work, and
    // /proc of other users' processes would look absent.
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let missing = host::missing_capabilities(&status);
    if !missing.is_empty() {
        return Err(Error::NotPrivileged {
            missing: missing.join(", "),
        });
    }
    let settings = args.validate()?;
    let stop = crate::stop::Stop::install().map_err(Error::Runtime)?;
    let host = host::Host::live();
    let targets = settings
        .pids
        .iter()
        .map(|pid| discover(&host, *pid, &settings, &stop))
        .collect::<Result<Vec<_>, _>>()?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(Error::Runtime)?;
    runtime.block_on(trace(settings, &targets, stop))
}

/// The health report at attach: `OUT/doctor.json` and the warnings on stderr.
fn health_report(out: &std::path::Path, pid: u32) -> Result<serde_json::Value, Error> {
    let report = crate::doctor::diagnose(&host::Host::live(), Some(pid));
    let path = out.join("doctor.json");
    let mut file = std::fs::File::create(&path).map_err(|source| Error::Output {
        path: path.clone(),
        source,
    })?;
    crate::doctor::write_json(&report, &mut file)
        .map_err(|source| Error::Output { path, source })?;
    let serious: Vec<_> = report
        .findings
        .iter()
        .filter(|f| f.severity >= crate::doctor::findings::Severity::Warn)
        .collect();
    if serious.is_empty() {
        crate::note!("nccltrace: doctor: no placement problems found for pid {pid} (doctor.json)");
    }
    for f in serious {
        crate::note!(
            "nccltrace: doctor: {:?} [{}] {}{}",
            f.severity,
            f.id,
            f.summary,
            f.fix
                .as_deref()
                .map(|x| format!("; fix: {x}"))
                .unwrap_or_default()
        );
    }
    Ok(serde_json::to_value(&report).unwrap_or_default())
}

/// Names that only this host knows at the end of the run, added to `outputs` and returned
/// as records for the recording (so `report` elsewhere names the same frames): kernel
/// frames from /proc/kallsyms, JIT code (Python's perf trampolines) from each target's
/// perf map, which may be gone by the time a report is made; and the build ids of the
/// files the user frames lie in, so that `report` does not name them from another build.
fn record_symbols(outputs: &mut crate::pipeline::Outputs) -> Vec<Meta> {
    // Libraries loaded since attach (read while the target still runs).
    let mut maps = Vec::new();
    for t in &mut outputs.header.targets {
        let Ok(now) = std::fs::read_to_string(format!("/proc/{}/maps", t.pid)) else {
            continue;
        };
        let added = crate::source::discover::maps_added(&t.maps_text, &now);
        if !added.is_empty() {
            t.maps_text.push_str(&added);
            maps.push(Meta::Maps { pid: t.pid, added });
        }
    }
    let kernel_ips = crate::symbolize::kernel_addresses(&outputs.detail.stacks);
    let kernel = std::fs::read_to_string("/proc/kallsyms")
        .map(|text| crate::symbolize::kernel_names(&text, &kernel_ips))
        .unwrap_or_default();
    outputs.kernel_symbols.extend(kernel.iter().cloned());
    let mut records = maps;
    records.push(Meta::KernelSymbols { symbols: kernel });
    let ids = crate::symbolize::stack_build_ids(&outputs.header, &outputs.detail.stacks);
    let mut by_pid: std::collections::BTreeMap<u32, Vec<(String, String)>> =
        std::collections::BTreeMap::new();
    for ((pid, path), id) in &ids {
        by_pid
            .entry(*pid)
            .or_default()
            .push((path.clone(), id.clone()));
    }
    records.extend(
        by_pid
            .into_iter()
            .map(|(pid, files)| Meta::BuildIds { pid, files }),
    );
    outputs.build_ids.extend(ids);
    for t in &outputs.header.targets {
        let symbols = crate::symbolize::jit_symbols(t.pid, &outputs.detail.stacks);
        if !symbols.is_empty() {
            outputs.jit_symbols.insert(t.pid, symbols.clone());
            records.push(Meta::JitSymbols {
                pid: t.pid,
                symbols,
            });
        }
    }
    records
}

/// The line saying what nccltrace attached to in target `t`.
fn attached_line(t: &crate::record::TargetInfo, attach_ms: u128, profile: &str) -> String {
    // Functions of a CET build open with endbr64, which the kernel would single-step.
    let past = t.probes.iter().filter(|p| p.past_endbr64).count();
    let probes = if past > 0 {
        format!(
            "{} probes ({past} past the endbr64 their function opens with)",
            t.probes.len()
        )
    } else {
        format!("{} probes", t.probes.len())
    };
    format!(
        "nccltrace: attached to pid {} ({}) in {attach_ms} ms: {probes}; NCCL {}; CUDA {}; profile \
         {profile}",
        t.pid,
        t.comm,
        t.nccl_library.as_deref().unwrap_or("-"),
        t.cuda_library.as_deref().unwrap_or("not mapped"),
    )
}

/// The end of a live run: the symbol records, every output, then summary.json with the
/// whole process's peak memory (the end of the run in it), also the recording's last
/// record so that `report` gives the same figure. Returns how writing the outputs and
/// closing the recording went.
fn write_everything(
    out: &std::path::Path,
    outputs: &mut crate::pipeline::Outputs,
    writer: Result<Writer, crate::record::RecordError>,
) -> (
    Result<(), (PathBuf, std::io::Error)>,
    Result<(), crate::record::RecordError>,
) {
    let symbols = record_symbols(outputs);
    let writer = writer.and_then(|mut w| {
        for m in &symbols {
            match w.meta(m) {
                // One record too large to keep is said and left out; the rest go on.
                Err(e @ crate::record::RecordError::TooLarge { .. }) => {
                    crate::note!("nccltrace: warning: {e}");
                }
                other => other?,
            }
        }
        Ok(w)
    });
    let written = crate::pipeline::write_outputs(out, outputs, &mut std::io::stdout().lock());
    let peak_rss_kb = host::Host::live()
        .peak_rss_kb(std::process::id())
        .unwrap_or(outputs.summary.agent.peak_rss_kb);
    outputs.summary.agent.peak_rss_kb = peak_rss_kb;
    let written = written.and(crate::pipeline::write_summary(out, &outputs.summary));
    let write_end = writer.and_then(|mut w| {
        w.meta(&Meta::AgentPeak { peak_rss_kb })?;
        w.finish()
    });
    (written, write_end)
}

/// With `--max-attributed-events`: the command that attributes the whole run.
fn whole_run_hint(rec_path: &std::path::Path, out: &std::path::Path) {
    crate::note!(
        "nccltrace: only the end of the run was attributed (--max-attributed-events); the \
         whole run: nccltrace report {} --out {}",
        crate::stop::shell_word(&rec_path.to_string_lossy()),
        crate::stop::shell_word(&format!(
            "{}-whole",
            out.to_string_lossy().trim_end_matches('/')
        )),
    );
}

/// The recording's closing record: why the run stopped, what was lost, what it cost.
/// The closing record of the recording: lost events and counters since attach, or, with
/// `base` (the last window's end, moved on), since then.
fn end_record(attached: &source::Attached, reason: String, base: Option<&mut Counts>) -> Meta {
    let now = attached.counters();
    let (lost_by_kind, counters) = match base {
        Some(base) => window_counts(now, base),
        None => now,
    };
    Meta::End {
        end_monotonic_ns: attached
            .stopped_ns
            .unwrap_or_else(|| host::clock_ns(libc::CLOCK_MONOTONIC)),
        reason,
        lost_by_kind,
        counters,
        attach_ns: u64::try_from(attached.attach_time.as_nanos()).unwrap_or(u64::MAX),
        agent_peak_rss_kb: host::Host::live()
            .peak_rss_kb(std::process::id())
            .unwrap_or(0),
    }
}

type SharedMetrics = std::sync::Arc<crate::metrics::Metrics>;

/// With `--metrics`, starts the `/metrics` server on the runtime and says where it is.
fn serve_metrics(
    listener: Option<std::net::TcpListener>,
    doctor: Option<&serde_json::Value>,
) -> Result<(Option<SharedMetrics>, Option<tokio::task::JoinHandle<()>>), Error> {
    let Some(listener) = listener else {
        return Ok((None, None));
    };
    let addr = listener.local_addr().map_err(Error::Runtime)?;
    let metrics = std::sync::Arc::new(crate::metrics::Metrics::new(host::Host::live()));
    if let Some(report) = doctor {
        metrics.set_findings(report);
    }
    let server = crate::metrics::http::serve(listener, metrics.clone()).map_err(|source| {
        Error::MetricsAddress {
            addr: addr.to_string(),
            source,
        }
    })?;
    let reach = if addr.ip().is_loopback() {
        "this host only"
    } else {
        "other hosts too"
    };
    crate::note!(
        "nccltrace: metrics at http://{addr}/metrics (Prometheus; reachable from {reach})"
    );
    Ok((Some(metrics), Some(server)))
}

/// What a window of the run needs besides its folder: the same for every window.
struct WindowPlan<'a> {
    settings: &'a Settings,
    doctor: Option<&'a serde_json::Value>,
    metrics: Option<&'a SharedMetrics>,
    last_step: &'a std::sync::Arc<crate::metrics::LastStep>,
}

impl WindowPlan<'_> {
    /// Starts recording into `dir` (made if missing; an old recording there replaced),
    /// attributed live.
    fn open(&self, dir: &std::path::Path, header: &Header) -> Result<LiveSink, Error> {
        let folder = |source| Error::OutputFolder {
            path: dir.to_owned(),
            source,
        };
        std::fs::create_dir_all(dir).map_err(folder)?;
        let rec_path = dir.join("recording.nctr");
        if rec_path.exists() {
            std::fs::remove_file(&rec_path).map_err(|source| Error::Output {
                path: rec_path.clone(),
                source,
            })?;
        }
        let mut writer = Writer::create(&rec_path, header)?;
        if let Some(report) = self.doctor {
            writer.meta(&Meta::Doctor {
                report: report.clone(),
            })?;
        }
        let settings = self.settings;
        let progress = writer.progress();
        let mut sink = LiveSink {
            store: Store::Disk(writer),
            path: rec_path,
            header: header.clone(),
            rule: settings.step_rule.clone(),
            epoch_events: settings.epoch_events,
            out: dir.to_owned(),
            live: None,
            progress,
            metrics: self.metrics.cloned(),
            metrics_grace: settings.metrics_grace,
            rotate: settings.rotate,
            started: Instant::now(),
            last_step: self.last_step.clone(),
            nccl_calls: 0,
            records: 0,
            status: std::io::stderr().is_terminal(),
            last: (Instant::now(), 0),
        };
        if settings.max_attributed_events == 0 {
            sink.attribute_live();
        }
        Ok(sink)
    }

    /// The folder of a window starting now: a new one under --out with --rotate, else
    /// --out itself.
    fn folder(&self) -> PathBuf {
        let root = &self.settings.out.path;
        match self.settings.rotate {
            Some(_) => root.join(super::utc_stamp(std::time::SystemTime::now())),
            None => root.clone(),
        }
    }
}

/// Lost events by kind, and the other counters, as the programs count them.
type Counts = (BTreeMap<String, u64>, BTreeMap<String, u64>);

/// Lost events and counters `now` since `base` (the last window's end), and `base` moved
/// on.
fn window_counts(now: Counts, base: &mut Counts) -> Counts {
    let since = |now: &BTreeMap<String, u64>, then: &BTreeMap<String, u64>| {
        now.iter()
            .map(|(k, v)| {
                (
                    k.clone(),
                    v.saturating_sub(then.get(k).copied().unwrap_or(0)),
                )
            })
            .collect::<BTreeMap<_, _>>()
    };
    let delta = (since(&now.0, &base.0), since(&now.1, &base.1));
    *base = now;
    delta
}

/// Ends a window while tracing goes on into the next: its closing record now, its
/// outputs on a thread of their own (the drain must not pause for them).
fn end_window(
    mut sink: LiveSink,
    end: &Meta,
    dir: PathBuf,
    settings: &Settings,
) -> std::thread::JoinHandle<()> {
    sink.close(end);
    let (rule, limit) = (settings.step_rule.clone(), settings.max_attributed_events);
    std::thread::spawn(move || {
        let (agg, writer) = sink.finish(limit);
        let mut outputs = agg.finish(rule);
        let (written, write_end) = write_everything(&dir, &mut outputs, writer);
        if let Err((path, e)) = written {
            crate::note!("nccltrace: warning: cannot write {}: {e}", path.display());
        }
        if let Err(e) = write_end {
            crate::note!("nccltrace: warning: {e}");
        }
        drop(outputs);
        release_free_memory();
        crate::note!("nccltrace: window complete in {}", dir.display());
    })
}

/// Hands the memory a finished window freed back to the system. glibc keeps freed memory
/// in per-thread arenas; each window's threads (attribution, trace writer, finishing) would
/// otherwise leave the process a little larger at every window (the 4-minute daemon soak
/// grew 9 MB/min without this).
fn release_free_memory() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim only returns free pages of the allocator to the kernel.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// With `--keep N`: removes the oldest complete windows (their summary.json written)
/// beyond N. Only folders named as windows are touched.
fn prune_windows(root: &std::path::Path, keep: usize, current: &std::path::Path) {
    if keep == 0 {
        return;
    }
    let is_window =
        |name: &str| name.len() == 16 && name.as_bytes()[8] == b'T' && name.ends_with('Z');
    let mut windows: Vec<PathBuf> = host::Host::at(root)
        .list("")
        .into_iter()
        .filter(|n| is_window(n))
        .map(|n| root.join(n))
        .collect();
    windows.sort();
    let mut excess = windows.len().saturating_sub(keep);
    for w in windows {
        if excess == 0 {
            break;
        }
        if w != current && w.join("summary.json").exists() {
            if let Err(e) = std::fs::remove_dir_all(&w) {
                crate::note!(
                    "nccltrace: warning: cannot remove old window {}: {e}",
                    w.display()
                );
            }
            excess -= 1;
        }
    }
}

/// Attaches to `targets` (and, with --follow, to later ones) and says so.
fn attach_all(settings: &Settings, targets: &[source::Target]) -> Result<source::Attached, Error> {
    let mut attached = source::attach(targets, &settings.profile)?;
    for t in &attached.header.targets {
        let ms = attached.attach_time.as_millis();
        crate::note!("{}", attached_line(t, ms, &settings.profile.name));
    }
    attached.header.step_nvtx.clone_from(&settings.step_nvtx);
    if settings.follow {
        attached.follow = Some(source::Follow::new(
            settings.step_symbol.clone(),
            settings.step_nvtx.is_some(),
        ));
        crate::note!("nccltrace: --follow: attaching to processes that load NCCL until stopped");
    }
    Ok(attached)
}

/// The windows of a run: the one being recorded, and those still being finished.
struct Windows {
    sink: LiveSink,
    out: PathBuf,
    base: Counts,
    finishing: Vec<std::thread::JoinHandle<()>>,
}

impl Windows {
    /// Starts the next window; the current one is finished on a thread. If the next
    /// cannot be started, the current one goes on.
    fn rotate(&mut self, plan: &WindowPlan<'_>, attached: &mut source::Attached) {
        let next_dir = plan.folder();
        match plan.open(&next_dir, &attached.header) {
            Ok(next) => {
                let reason = source::StopReason::Rotate.to_string();
                let end = end_record(attached, reason, Some(&mut self.base));
                let done = std::mem::replace(&mut self.sink, next);
                attached.new_window();
                let dir = std::mem::replace(&mut self.out, next_dir);
                self.finishing.retain(|t| !t.is_finished());
                self.finishing
                    .push(end_window(done, &end, dir, plan.settings));
                prune_windows(&plan.settings.out.path, plan.settings.keep, &self.out);
            }
            Err(e) => {
                crate::note!(
                    "nccltrace: warning: cannot start the next window ({e}); this one goes on"
                );
                self.sink.started = Instant::now();
            }
        }
    }
}

async fn trace(
    mut settings: Settings,
    targets: &[source::Target],
    mut stop: crate::stop::Stop,
) -> Result<(), Error> {
    let doctor = match targets.first() {
        Some(first) => Some(health_report(&settings.out.path, first.pid)?),
        None => None,
    };
    let (metrics, server) = serve_metrics(settings.metrics.take(), doctor.as_ref())?;
    let mut attached = attach_all(&settings, targets)?;
    let last_step = std::sync::Arc::default();
    let mut out_dir = settings.out.take();
    let plan = WindowPlan {
        settings: &settings,
        doctor: doctor.as_ref(),
        metrics: metrics.as_ref(),
        last_step: &last_step,
    };
    let out = plan.folder();
    let sink = plan.open(&out, &attached.header)?;
    out_dir.keep();
    stop.tracing_started();
    let deadline = settings.duration.map(|d| Instant::now() + d);
    let mut w = Windows {
        sink,
        out,
        base: Counts::default(),
        finishing: Vec::new(),
    };
    let outcome = loop {
        let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
        let outcome = attached.run(left, &mut w.sink, &mut stop).await;
        if !matches!(outcome, Ok(source::StopReason::Rotate)) {
            break outcome;
        }
        w.rotate(&plan, &mut attached);
    };
    attached.disarm();
    // Scrapes are refused from here on, never left waiting while the outputs are written.
    server.inspect(tokio::task::JoinHandle::abort);
    let reason = match &outcome {
        Ok(r) => r.to_string(),
        Err(e) => format!("stopped by an error: {e}"),
    };
    let Windows {
        mut sink,
        out,
        mut base,
        finishing,
    } = w;
    if sink.status {
        crate::note!();
    }
    let windows = settings.rotate.is_some().then_some(&mut base);
    let end = end_record(&attached, reason.clone(), windows);
    let rec_path = sink.path.clone();
    // Whatever happened above, keep what was collected: the closing record goes to disk
    // first (a forced exit from here on loses no record), then every output is written
    // before the error is reported.
    sink.close(&end);
    stop.recording_closed(format!(
        "nccltrace report {} --out {} --force",
        crate::stop::shell_word(&rec_path.to_string_lossy()),
        crate::stop::shell_word(&out.to_string_lossy()),
    ));
    let (detaching, probes) = attached.detach_in_background();
    sink.say_stopped(&reason, probes);
    let started = Instant::now();
    let (agg, writer) = sink.finish(settings.max_attributed_events);
    let mut outputs = agg.finish(settings.step_rule.clone());
    crate::note!(
        "nccltrace: attributed in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    if outputs.summary.attributed.is_some() {
        whole_run_hint(&rec_path, &out);
    }
    let (written, write_end) = write_everything(&out, &mut outputs, writer);
    for t in finishing {
        let _ = t.join();
    }
    stop.outputs_complete();
    if let Some(thread) = detaching {
        if !thread.is_finished() {
            crate::note!(
                "nccltrace: outputs complete in {}; the kernel is still releasing the probes \
                 (about 0.1 s each)",
                out.display()
            );
        }
        let _ = thread.join();
    }
    outcome?;
    written.map_err(|(path, source)| Error::Output { path, source })?;
    write_end?;
    Ok(())
}

#[cfg(test)]
mod window_tests {
    use super::*;

    /// `--keep 2`: the oldest complete windows go; the current one, one still being
    /// written (no summary.json yet) and other folders stay.
    #[test]
    fn prune_keeps_the_newest_complete_windows() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let names = [
            "20261203T100000Z",
            "20261203T110000Z",
            "20261203T120000Z",
            "20261203T130000Z",
        ];
        for (i, n) in names.iter().enumerate() {
            std::fs::create_dir(root.join(n)).unwrap();
            // The newest but one is still being finished; the newest is current.
            if i < 2 {
                std::fs::write(root.join(n).join("summary.json"), "{}").unwrap();
            }
        }
        std::fs::create_dir(root.join("mine")).unwrap();
        prune_windows(root, 2, &root.join(names[3]));
        let mut left = host::Host::at(root).list("");
        left.sort();
        assert_eq!(left, ["20261203T120000Z", "20261203T130000Z", "mine"]);
        // 0 keeps everything.
        prune_windows(root, 0, &root.join(names[3]));
        assert_eq!(host::Host::at(root).list("").len(), 3);
    }
}
