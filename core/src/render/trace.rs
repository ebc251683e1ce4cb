//! `trace.json` in the Chrome Trace Event Format, for Perfetto (ui.perfetto.dev) and
//! chrome://tracing: one track per thread (named, with its role), the NCCL calls and CUDA
//! syncs as slices with their arguments, a `steps` track, off-CPU stretches with who woke
//! the thread, migrations and fault bursts as instants, and faults/migrations per second
//! as counters. Written event by event.

use std::io::{self, Write};

use serde::Serialize;
use serde_json::json;

use super::json::{Obj, key};

use crate::attribute::{Detail, Step, StepsReport};

mod event;
mod slices;
use event::{Args, Burst, Count, Ev, Moved, Runnable, Woken};
use slices::{write_calls, write_steps};

/// The first GPU's process id in the trace (no real process has it).
const GPU_PID: u32 = 0x7fff_ff00;
/// The steps track's thread id (no real thread has it).
const STEPS_TID: u64 = 0x7fff_fff0;
/// An epoch's calls are formatted on a thread of their own from this many on, and the
/// second half of its steps from twice this many.
const PARALLEL: usize = 1024;
/// Faults closer than this form one burst.
const BURST_GAP_NS: u64 = 1_000_000;
/// Counter bin.
const BIN_NS: u64 = 100_000_000;
/// At most this many counter bins per process.
const MAX_BINS: u64 = 100_000;

struct Writer<W: Write> {
    out: W,
    first: bool,
    base_ns: u64,
    /// The event being written: one write to `out` an event (a write a field cost more
    /// than the field).
    ev: Vec<u8>,
}

impl<W: Write> Writer<W> {
    /// Writes one event field by field (the name escaped; the fixed fields need not be).
    fn event<A: Args>(&mut self, ev: &Ev<'_, A>) -> io::Result<()> {
        self.separator()?;
        self.ev.clear();
        let mut o = Obj::new(&mut self.ev)?;
        o.plain(key!("ph"), ev.ph)?;
        if let Some(s) = ev.s {
            o.plain(key!("s"), s)?;
        }
        if let Some(cat) = ev.cat {
            o.plain(key!("cat"), cat)?;
        }
        o.str(key!("name"), ev.name)?;
        o.u64(key!("pid"), u64::from(ev.pid))?;
        if let Some(tid) = ev.tid {
            o.u64(key!("tid"), tid)?;
        }
        if let Some(ts) = ev.ts {
            write_us(o.key(key!("ts"))?, ts)?;
        }
        if let Some(dur) = ev.dur {
            write_us(o.key(key!("dur"))?, dur)?;
        }
        let mut args = Obj::new(o.key(key!("args"))?)?;
        ev.args.write(&mut args)?;
        args.end()?;
        o.end()?;
        self.out.write_all(&self.ev)
    }

    /// Writes one event given whole (the few metadata events).
    fn raw(&mut self, value: &impl Serialize) -> io::Result<()> {
        self.separator()?;
        serde_json::to_writer(&mut self.out, value)?;
        Ok(())
    }

    /// What goes before an event: a newline, and a comma after the first.
    fn separator(&mut self) -> io::Result<()> {
        let sep: &[u8] = if self.first { b"\n" } else { b",\n" };
        self.first = false;
        self.out.write_all(sep)
    }

    /// Nanoseconds since the start of the trace.
    fn ts(&self, ns: u64) -> u64 {
        ns.saturating_sub(self.base_ns)
    }

    /// Whether `ns` is on the traced time axis: what began while the probes were being
    /// attached (before the recording's start) is left out rather than drawn at 0.
    fn traced(&self, ns: u64) -> bool {
        ns >= self.base_ns
    }
}

/// `ns` as microseconds with three decimals, exactly (no floating point).
fn write_us(out: &mut impl Write, ns: u64) -> io::Result<()> {
    let frac = ns % 1000;
    out.write_all(itoa::Buffer::new().format(ns / 1000).as_bytes())?;
    out.write_all(&[
        b'.',
        b'0' + (frac / 100) as u8,
        b'0' + (frac / 10 % 10) as u8,
        b'0' + (frac % 10) as u8,
    ])
}

/// Counts each time of `times` (ns since the trace's start) in its 100-ms bin, into the
/// count `of` picks: a run of times in one bin is looked up once (a lookup a fault was a
/// tenth of trace.json's time).
fn count_in_bins(
    bins: &mut std::collections::BTreeMap<u64, (u64, u64)>,
    times: impl Iterator<Item = u64>,
    of: impl Fn(&mut (u64, u64)) -> &mut u64,
) {
    let mut run: Option<(u64, u64)> = None;
    for bin in times.map(|ns| ns / BIN_NS) {
        match &mut run {
            Some((b, n)) if *b == bin => *n += 1,
            _ => {
                if let Some((b, n)) = run.replace((bin, 1)) {
                    *of(bins.entry(b).or_default()) += n;
                }
            }
        }
    }
    if let Some((b, n)) = run {
        *of(bins.entry(b).or_default()) += n;
    }
}

fn dur(a: u64, b: u64) -> u64 {
    b.saturating_sub(a)
}

/// What trace.json says of the run besides its events: the wall clock at ts 0, where it
/// ran, and the traced processes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RunInfo {
    /// CLOCK_REALTIME when the trace's ts 0 was taken.
    pub realtime_ns: u64,
    pub kernel: String,
    pub host: String,
    pub agent_version: String,
    /// The traced processes: (pid, command name).
    pub processes: Vec<(u32, String)>,
}

/// Writes the trace of one `detail` (the whole run at once).
pub fn write(
    run: &RunInfo,
    detail: &Detail,
    steps: &StepsReport,
    out: impl Write,
) -> io::Result<()> {
    let mut trace = TraceStream::new(out, detail.first_ns)?;
    trace.epoch(detail, &steps.steps, steps.rank_pid)?;
    trace.finish(run, &roles(&steps.ranks, &steps.workers), detail.end_ns)
}

/// What each traced process is, as trace.json names it: `rank N` (the number summary.json
/// and steps.json give it: NCCL's, the environment's, the communicator's or pid order's)
/// or `worker of rank N`.
#[must_use]
pub fn roles(
    ranks: &[crate::attribute::ranks::RankReport],
    workers: &[crate::attribute::WorkerReport],
) -> Vec<(u32, String)> {
    ranks
        .iter()
        .map(|r| (r.pid, format!("rank {}", r.rank)))
        .chain(workers.iter().map(|w| {
            let rank = w.rank.map_or_else(|| "?".to_owned(), |r| r.to_string());
            (w.pid, format!("worker of rank {rank}"))
        }))
        .collect()
}

/// A fault burst still open: (first fault, last fault, faults).
type OpenBurst = (u64, u64, usize);

/// trace.json written as the run is attributed, an epoch at a time ([`TraceStream::epoch`]):
/// what needs the whole run (names, counters per 100 ms) at [`TraceStream::finish`].
/// Events of the runnable-threads counter are written in time order, held back until no
/// stretch still open can come before them; fault bursts across epochs stay whole.
pub struct TraceStream<W: Write> {
    w: Writer<W>,
    /// Collectives so far per (pid, communicator): their sequence numbers.
    sequence: std::collections::BTreeMap<(u32, u64), u64>,
    /// Runnable-thread count changes not written yet: (time, pid, +1/-1).
    runnable_changes: Vec<(u64, u32, i64)>,
    runnable: std::collections::BTreeMap<u32, i64>,
    bursts: std::collections::BTreeMap<u32, (u32, OpenBurst)>,
    /// Faults and migrations per pid and 100 ms bin.
    bins: std::collections::BTreeMap<u32, std::collections::BTreeMap<u64, (u64, u64)>>,
    /// Each thread's name track, as last seen: (pid, tid, name, role).
    threads: std::collections::BTreeMap<u32, (u32, String, &'static str)>,
    cpu_nodes: Vec<i32>,
    /// Calls, and the second half of many steps, formatted on helper threads
    /// ([`TraceStream::parallel`]).
    parallel: bool,
    /// The calls' text and the steps' second half, kept from epoch to epoch.
    calls_out: Vec<u8>,
    steps_out: Vec<u8>,
}

impl<W: Write> TraceStream<W> {
    /// Starts the trace; `base_ns` (CLOCK_MONOTONIC) is its time 0.
    pub fn new(mut out: W, base_ns: u64) -> io::Result<Self> {
        out.write_all(b"{\"displayTimeUnit\":\"ns\",\"traceEvents\":[")?;
        Ok(TraceStream {
            w: Writer {
                out,
                first: true,
                base_ns,
                ev: Vec::with_capacity(512),
            },
            sequence: std::collections::BTreeMap::new(),
            runnable_changes: Vec::new(),
            runnable: std::collections::BTreeMap::new(),
            bursts: std::collections::BTreeMap::new(),
            bins: std::collections::BTreeMap::new(),
            threads: std::collections::BTreeMap::new(),
            cpu_nodes: Vec::new(),
            parallel: false,
            calls_out: Vec::new(),
            steps_out: Vec::new(),
        })
    }

    /// Writes one epoch: its steps (of the rank process `rank_pid`), calls, off-CPU
    /// stretches, migrations and fault bursts.
    pub fn epoch(
        &mut self,
        detail: &Detail,
        steps: &[Step],
        rank_pid: Option<u32>,
    ) -> io::Result<()> {
        self.cpu_nodes.clone_from(&detail.cpu_nodes);
        for t in &detail.threads {
            self.threads.insert(t.tid, (t.pid, t.name.clone(), t.role));
        }
        let steps = rank_pid.map_or(&[][..], |_| steps);
        let pid = rank_pid.unwrap_or_default();
        if self.parallel && (detail.calls.len() >= PARALLEL || steps.len() >= 2 * PARALLEL) {
            self.aside(detail, steps, pid)?;
        } else {
            write_steps(&mut self.w, steps, pid)?;
            write_calls(&mut self.w, &mut self.sequence, detail)?;
        }
        for t in &detail.threads {
            self.thread(t)?;
        }
        self.runnable(detail)
    }

    /// Formats each epoch's calls, and the second half of its steps when it has
    /// thousands, on threads of their own while the first half is written (where the
    /// host has CPUs to spare).
    pub fn parallel(&mut self, on: bool) {
        self.parallel = on;
    }
}

impl<W: Write> TraceStream<W> {
    /// One thread's off-CPU stretches, migrations and fault bursts; counts for the bins.
    fn thread(&mut self, t: &crate::attribute::ThreadDetail) -> io::Result<()> {
        for off in &t.offcpu {
            let name = if off.runnable {
                "off-CPU: preempted"
            } else {
                "off-CPU: blocked"
            };
            if !self.w.traced(off.start_ns) {
                continue;
            }
            let args = Woken(off.waker);
            let (ts, d) = (self.w.ts(off.start_ns), dur(off.start_ns, off.end_ns));
            let ev = Ev::slice("sched", name, t.pid, u64::from(t.tid), ts, d, args);
            self.w.event(&ev)?;
        }
        let base = self.w.base_ns;
        for &(ts, from, to) in t.migrations.iter().filter(|m| m.0 >= base) {
            let args = Moved {
                from_cpu: from,
                to_cpu: to,
                from_node: self.node(from),
                to_node: self.node(to),
            };
            let ev = Ev::instant(
                "sched",
                "migration",
                t.pid,
                u64::from(t.tid),
                self.w.ts(ts),
                args,
            );
            self.w.event(&ev)?;
        }
        let bins = self.bins.entry(t.pid).or_default();
        count_in_bins(
            bins,
            t.faults.iter().map(|ts| ts.saturating_sub(base)),
            |b| &mut b.0,
        );
        count_in_bins(
            bins,
            t.migrations.iter().map(|m| m.0.saturating_sub(base)),
            |b| &mut b.1,
        );
        for &ts in &t.faults {
            if !self.w.traced(ts) {
                continue;
            }
            match self.bursts.get_mut(&t.tid) {
                Some((_, (_, last, n))) if ts - *last < BURST_GAP_NS => {
                    *last = ts;
                    *n += 1;
                }
                _ => {
                    if let Some((pid, burst)) = self.bursts.insert(t.tid, (t.pid, (ts, ts, 1))) {
                        self.burst(pid, t.tid, burst)?;
                    }
                }
            }
        }
        Ok(())
    }

    fn burst(&mut self, pid: u32, tid: u32, (start, last, faults): OpenBurst) -> io::Result<()> {
        let args = Burst {
            faults,
            span_us: dur(start, last) as f64 / 1000.0,
        };
        let ev = Ev::instant(
            "memory",
            "page faults",
            pid,
            u64::from(tid),
            self.w.ts(start),
            args,
        );
        self.w.event(&ev)
    }

    fn node(&self, cpu: i32) -> i32 {
        crate::attribute::node_of(&self.cpu_nodes, cpu)
    }

    /// Runnable-but-waiting target threads, as a counter stepping at each change: the
    /// changes before any stretch still open could add one.
    fn runnable(&mut self, detail: &Detail) -> io::Result<()> {
        // Runnable from the switch-out when preempted, else from the wakeup on.
        let from = |off: &crate::attribute::OffCpu| {
            if off.runnable {
                Some(off.start_ns)
            } else {
                off.woken_ns
            }
        };
        let mut watermark = detail.end_ns;
        for t in &detail.threads {
            for off in &t.offcpu {
                if let Some(from) = from(off).filter(|f| *f < off.end_ns) {
                    self.runnable_changes.push((from, t.pid, 1));
                    self.runnable_changes.push((off.end_ns, t.pid, -1));
                }
            }
            if let Some(f) = t.open.as_ref().and_then(from) {
                watermark = watermark.min(f);
            }
        }
        self.runnable_changes.sort_unstable();
        let ready = self.runnable_changes.partition_point(|c| c.0 < watermark);
        let ready: Vec<(u64, u32, i64)> = self.runnable_changes.drain(..ready).collect();
        self.write_runnable(ready)
    }

    fn write_runnable(&mut self, changes: Vec<(u64, u32, i64)>) -> io::Result<()> {
        for (ts, pid, delta) in changes {
            let n = self.runnable.entry(pid).or_insert(0);
            *n += delta;
            let waiting = (*n).max(0);
            if !self.w.traced(ts) {
                continue;
            }
            let args = Runnable(waiting);
            let ev = Ev::counter("runnable threads", pid, self.w.ts(ts), args);
            self.w.event(&ev)?;
        }
        Ok(())
    }

    /// Ends the trace (the run ended at `end_ns`): names of processes (by `roles`,
    /// [`roles`]) and threads, the counters per 100 ms, the clock.
    pub fn finish(mut self, run: &RunInfo, roles: &[(u32, String)], end_ns: u64) -> io::Result<()> {
        let changes = std::mem::take(&mut self.runnable_changes);
        self.write_runnable(changes)?;
        for (tid, (pid, burst)) in std::mem::take(&mut self.bursts) {
            self.burst(pid, tid, burst)?;
        }
        self.names(run, roles)?;
        self.counters(end_ns)?;
        let other = json!({
            "clock": "CLOCK_MONOTONIC; ts 0 is monotonic_ns_at_0",
            "monotonic_ns_at_0": self.w.base_ns,
            "realtime_ns_at_0": run.realtime_ns,
            "kernel": run.kernel,
            "host": run.host,
            "nccltrace": run.agent_version,
        });
        write!(self.w.out, "\n],\"otherData\":")?;
        serde_json::to_writer(&mut self.w.out, &other)?;
        writeln!(self.w.out, "}}")?;
        self.w.out.flush()
    }

    /// Each GPU's utilization as a counter track of a process of its own ("GPU 0: its
    /// name"): the busy percent of each NVML sample from the sample's start, 0 after the
    /// last one.
    pub fn gpus(
        &mut self,
        names: &[String],
        samples: &[crate::attribute::GpuSample],
    ) -> io::Result<()> {
        for (i, name) in names.iter().enumerate() {
            let gpu = u32::try_from(i).unwrap_or(u32::MAX);
            let pid = GPU_PID.saturating_add(gpu);
            let w = &mut self.w;
            w.raw(&json!({"ph": "M", "name": "process_name", "pid": pid,
                "args": {"name": format!("GPU {i}: {name} (NVML)")}}))?;
            w.raw(&json!({"ph": "M", "name": "process_sort_index", "pid": pid,
                "args": {"sort_index": -1}}))?;
            let mine = samples.iter().filter(|s| s.0 == gpu);
            let mut last = None;
            for &(_, from, to, pct) in mine {
                if !w.traced(from) {
                    continue;
                }
                let ev = Ev::counter("GPU busy %", pid, w.ts(from), Count("busy", f64::from(pct)));
                w.event(&ev)?;
                last = Some(to);
            }
            if let Some(to) = last {
                let ev = Ev::counter("GPU busy %", pid, w.ts(to), Count("busy", 0.0));
                w.event(&ev)?;
            }
        }
        Ok(())
    }

    fn names(&mut self, run: &RunInfo, roles: &[(u32, String)]) -> io::Result<()> {
        let w = &mut self.w;
        for (pid, comm) in &run.processes {
            // What summary.json and steps.json say it is, not the target's position.
            let role = roles
                .iter()
                .find(|(p, _)| p == pid)
                .map_or("rank ?", |(_, r)| r.as_str());
            w.raw(&json!({"ph": "M", "name": "process_name", "pid": *pid,
                "args": {"name": format!("{role} (pid {pid}) {comm}")}}))?;
            w.raw(
                &json!({"ph": "M", "name": "thread_name", "pid": *pid, "tid": STEPS_TID,
                "args": {"name": "steps"}}),
            )?;
            w.raw(
                &json!({"ph": "M", "name": "thread_sort_index", "pid": *pid, "tid": STEPS_TID,
                "args": {"sort_index": -2}}),
            )?;
        }
        for (tid, (pid, name, role)) in &self.threads {
            let name = if name.is_empty() {
                format!("{tid}")
            } else {
                format!("{name} {tid}")
            };
            w.raw(
                &json!({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                "args": {"name": format!("{name} ({role})")}}),
            )?;
            if role.starts_with("main") {
                w.raw(
                    &json!({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                    "args": {"sort_index": -1}}),
                )?;
            }
        }
        Ok(())
    }

    /// Faults and migrations per second per process, in 100 ms bins (wider when the span
    /// would need more than MAX_BINS: a damaged clock, or a run of hours).
    fn counters(&mut self, end_ns: u64) -> io::Result<()> {
        let first_ns = self.w.base_ns;
        let span = end_ns.saturating_sub(first_ns);
        let bin_ns = BIN_NS.max(span / MAX_BINS + 1);
        let bins = (span / bin_ns + 1) as usize;
        for (pid, fine) in std::mem::take(&mut self.bins) {
            let (mut faults, mut migrations) = (vec![0u64; bins], vec![0u64; bins]);
            for (bin, (f, m)) in fine {
                let b = (bin * BIN_NS / bin_ns) as usize;
                if let (Some(fb), Some(mb)) = (faults.get_mut(b), migrations.get_mut(b)) {
                    *fb += f;
                    *mb += m;
                }
            }
            for (b, (f, m)) in faults.iter().zip(&migrations).enumerate() {
                let ts = self.w.ts(first_ns.saturating_add(b as u64 * bin_ns));
                let per_s = 1e9 / bin_ns as f64;
                self.w.event(&Ev::counter(
                    "faults/s",
                    pid,
                    ts,
                    Count("faults", *f as f64 * per_s),
                ))?;
                let args = Count("migrations", *m as f64 * per_s);
                self.w.event(&Ev::counter("migrations/s", pid, ts, args))?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
