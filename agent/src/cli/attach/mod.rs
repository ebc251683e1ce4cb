//! `nccltrace attach --pid PID`: join running ranks, trace, write every output.

use std::collections::BTreeMap;
use std::io::{IsTerminal as _, Write as _};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::pipeline::Aggregator;
use crate::record::{Header, Meta, Reader, Writer};
use crate::source::{self, Sink};
use crate::{Error, host};

mod args;
mod sink;
mod windows;

pub use args::AttachArgs;
use args::Settings;

use sink::LiveSink;
use windows::{Counts, WindowPlan, Windows, window_counts};

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
    // Loading and verifying the programs needs no target: it goes on beside discovery and
    // the doctor's report.
    let prepared = source::Prepared::start(&settings.profile);
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
    let traced = runtime.block_on(trace(settings, &targets, stop, prepared));
    // Without waiting for a scrape stuck on a file that never reads.
    runtime.shutdown_timeout(std::time::Duration::from_millis(500));
    traced
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
    let kernel = std::fs::File::open("/proc/kallsyms")
        .map(|file| crate::symbolize::kernel_names(std::io::BufReader::new(file), &kernel_ips))
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

/// Attaches to `targets` (and, with --follow, to later ones) and says so.
fn attach_all(
    settings: &Settings,
    targets: &[source::Target],
    prepared: source::Prepared,
) -> Result<source::Attached, Error> {
    let mut attached = source::attach_prepared(prepared, targets)?;
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

async fn trace(
    mut settings: Settings,
    targets: &[source::Target],
    mut stop: crate::stop::Stop,
    prepared: source::Prepared,
) -> Result<(), Error> {
    let doctor = match targets.first() {
        Some(first) => Some(health_report(&settings.out.path, first.pid)?),
        None => None,
    };
    let (metrics, server) = serve_metrics(settings.metrics.take(), doctor.as_ref())?;
    let mut attached = attach_all(&settings, targets, prepared)?;
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
                 (each waits for an RCU grace period)",
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
