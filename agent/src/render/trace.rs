//! `trace.json` in the Chrome Trace Event Format, for Perfetto (ui.perfetto.dev) and
//! chrome://tracing: one track per thread (named, with its role), the NCCL calls and CUDA
//! syncs as slices with their arguments, a `steps` track, off-CPU stretches with who woke
//! the thread, migrations and fault bursts as instants, and faults/migrations per second
//! as counters. Written event by event.

use std::io::{self, Write};

use serde::Serialize;
use serde_json::json;

use crate::attribute::{Detail, Step, StepsReport};
use crate::event::{Library, datatype_name, redop_name};
use crate::record::Header;

/// The steps track's thread id (no real thread has it).
const STEPS_TID: u64 = 0x7fff_fff0;
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
}

/// One trace event, written as it is (no intermediate JSON tree: traces run to millions
/// of events).
struct Ev<'a, A: Serialize> {
    ph: &'static str,
    s: Option<&'static str>,
    cat: Option<&'a str>,
    name: &'a str,
    pid: u32,
    tid: Option<u64>,
    /// Nanoseconds since the start of the trace (written in µs).
    ts: Option<u64>,
    dur: Option<u64>,
    args: A,
}

impl<'a, A: Serialize> Ev<'a, A> {
    fn new(ph: &'static str, name: &'a str, pid: u32, args: A) -> Self {
        Ev {
            ph,
            s: None,
            cat: None,
            name,
            pid,
            tid: None,
            ts: None,
            dur: None,
            args,
        }
    }

    /// A complete slice on a thread.
    fn slice(cat: &'a str, name: &'a str, pid: u32, tid: u64, ts: u64, dur: u64, args: A) -> Self {
        Ev {
            cat: Some(cat),
            tid: Some(tid),
            ts: Some(ts),
            dur: Some(dur),
            ..Ev::new("X", name, pid, args)
        }
    }

    /// An instant on a thread.
    fn instant(cat: &'a str, name: &'a str, pid: u32, tid: u64, ts: u64, args: A) -> Self {
        Ev {
            s: Some("t"),
            cat: Some(cat),
            tid: Some(tid),
            ts: Some(ts),
            ..Ev::new("i", name, pid, args)
        }
    }

    /// A counter sample of the process.
    fn counter(name: &'a str, pid: u32, ts: u64, args: A) -> Self {
        Ev {
            ts: Some(ts),
            ..Ev::new("C", name, pid, args)
        }
    }
}

/// The arguments of a step slice: its categories in ms and its counts.
struct StepArgs<'a>(&'a Step);

impl Serialize for StepArgs<'_> {
    fn serialize<S: serde::Serializer>(&self, ser: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap as _;
        let s = self.0;
        let mut map = ser.serialize_map(None)?;
        for (name, value) in s.categories.named() {
            map.serialize_entry(&format_args!("{name}_ms"), &value.map(|v| v as f64 / 1e6))?;
        }
        map.serialize_entry("nccl_collectives", &s.nccl.collectives)?;
        map.serialize_entry("nccl_bytes", &s.nccl.bytes)?;
        map.serialize_entry("faults", &s.faults)?;
        map.serialize_entry("migrations", &s.migrations)?;
        map.end()
    }
}

/// The arguments of an NCCL call or CUDA sync slice.
#[derive(Serialize)]
struct CallArgs<'a> {
    ret: i32,
    #[serde(skip_serializing_if = "Option::is_none")]
    bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    count: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    datatype: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    op: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    peer_or_root: Option<i32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    comm: Option<Hex>,
    /// The n-th collective on a communicator: the same operation on every rank.
    #[serde(skip_serializing_if = "Option::is_none")]
    seq: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    stream: Option<Hex>,
    #[serde(skip_serializing_if = "Option::is_none")]
    rank: Option<i32>,
}

/// A pointer-like value written as a hex string, without an allocation per event.
struct Hex(u64);

impl Serialize for Hex {
    fn serialize<S: serde::Serializer>(&self, ser: S) -> Result<S::Ok, S::Error> {
        ser.collect_str(&format_args!("{:#x}", self.0))
    }
}

#[derive(Serialize)]
struct Woken {
    #[serde(skip_serializing_if = "Option::is_none")]
    woken_by_tid: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    woken_by_pid: Option<u32>,
}

#[derive(Serialize)]
struct Moved {
    from_cpu: i32,
    to_cpu: i32,
    from_node: i32,
    to_node: i32,
}

#[derive(Serialize)]
struct Burst {
    faults: usize,
    span_us: f64,
}

#[derive(Serialize)]
struct Runnable {
    #[serde(rename = "waiting for a CPU")]
    waiting: i64,
}

impl<W: Write> Writer<W> {
    /// Writes one event: its fixed fields by hand (their keys need no escaping; each
    /// event's `args` through serde_json). Three times faster than serializing `Ev`.
    fn event<A: Serialize>(&mut self, ev: &Ev<'_, A>) -> io::Result<()> {
        self.separator()?;
        let out = &mut self.out;
        out.write_all(b"{\"ph\":")?;
        serde_json::to_writer(&mut *out, ev.ph)?;
        if let Some(s) = ev.s {
            out.write_all(b",\"s\":")?;
            serde_json::to_writer(&mut *out, s)?;
        }
        if let Some(cat) = ev.cat {
            out.write_all(b",\"cat\":")?;
            serde_json::to_writer(&mut *out, cat)?;
        }
        out.write_all(b",\"name\":")?;
        serde_json::to_writer(&mut *out, ev.name)?;
        out.write_all(b",\"pid\":")?;
        out.write_all(itoa::Buffer::new().format(ev.pid).as_bytes())?;
        if let Some(tid) = ev.tid {
            out.write_all(b",\"tid\":")?;
            out.write_all(itoa::Buffer::new().format(tid).as_bytes())?;
        }
        if let Some(ts) = ev.ts {
            out.write_all(b",\"ts\":")?;
            write_us(out, ts)?;
        }
        if let Some(dur) = ev.dur {
            out.write_all(b",\"dur\":")?;
            write_us(out, dur)?;
        }
        out.write_all(b",\"args\":")?;
        serde_json::to_writer(&mut *out, &ev.args)?;
        out.write_all(b"}")
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

fn dur(a: u64, b: u64) -> u64 {
    b.saturating_sub(a)
}

/// A counter's one value, `{"NAME": VALUE}`.
struct Count(&'static str, f64);

impl Serialize for Count {
    fn serialize<S: serde::Serializer>(&self, ser: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap as _;
        let mut map = ser.serialize_map(Some(1))?;
        map.serialize_entry(self.0, &self.1)?;
        map.end()
    }
}

/// Writes the trace.
#[allow(clippy::too_many_lines)] // one section per kind of track event
pub fn write(
    header: &Header,
    detail: &Detail,
    steps: &StepsReport,
    out: impl Write,
) -> io::Result<()> {
    let mut w = Writer {
        out,
        first: true,
        base_ns: detail.first_ns,
    };
    w.out
        .write_all(b"{\"displayTimeUnit\":\"ns\",\"traceEvents\":[")?;
    for t in &header.targets {
        // The rank summary.json and steps.json give it (NCCL's, the environment's, or pid
        // order), not the target's position.
        let rank = steps
            .ranks
            .iter()
            .find(|r| r.pid == t.pid)
            .map_or_else(|| "?".to_owned(), |r| r.rank.to_string());
        w.raw(&json!({"ph": "M", "name": "process_name", "pid": t.pid,
            "args": {"name": format!("rank {rank} (pid {}) {}", t.pid, t.comm)}}))?;
        w.raw(
            &json!({"ph": "M", "name": "thread_name", "pid": t.pid, "tid": STEPS_TID,
            "args": {"name": "steps"}}),
        )?;
        w.raw(
            &json!({"ph": "M", "name": "thread_sort_index", "pid": t.pid, "tid": STEPS_TID,
            "args": {"sort_index": -2}}),
        )?;
    }
    for t in &detail.threads {
        let name = if t.name.is_empty() {
            format!("{}", t.tid)
        } else {
            format!("{} {}", t.name, t.tid)
        };
        w.raw(
            &json!({"ph": "M", "name": "thread_name", "pid": t.pid, "tid": t.tid,
            "args": {"name": format!("{name} ({})", t.role)}}),
        )?;
        if t.role.starts_with("main") {
            w.raw(
                &json!({"ph": "M", "name": "thread_sort_index", "pid": t.pid, "tid": t.tid,
                "args": {"sort_index": -1}}),
            )?;
        }
    }
    if let Some(pid) = steps.rank_pid {
        for s in &steps.steps {
            let name = format!("step {}", s.index);
            let (ts, d) = (w.ts(s.start_ns), dur(s.start_ns, s.end_ns));
            w.event(&Ev::slice(
                "step",
                &name,
                pid,
                STEPS_TID,
                ts,
                d,
                StepArgs(s),
            ))?;
        }
    }
    let mut sequence: std::collections::BTreeMap<(u32, u64), u64> =
        std::collections::BTreeMap::new();
    // Slice names made once per function (NVTX names once per call).
    let mut names: std::collections::HashMap<crate::event::Func, String> =
        std::collections::HashMap::new();
    let mut nvtx_name: String;
    for c in &detail.calls {
        let library = c.func.library();
        let cat = match library {
            Library::Nccl => "nccl",
            Library::Cuda => "cuda_sync",
            Library::Marker => "step_marker",
            Library::Nvtx => "nvtx",
        };
        let name: &str = if library == Library::Nvtx {
            nvtx_name = format!("NVTX {}", c.message.as_deref().unwrap_or("?"));
            &nvtx_name
        } else {
            names.entry(c.func).or_insert_with(|| match library {
                Library::Nccl => format!("nccl{}", c.func.name()),
                Library::Marker => "step marker".to_owned(),
                _ => c.func.name().to_owned(),
            })
        };
        let comm = c.comm;
        let seq = comm.filter(|_| c.func.is_collective()).map(|comm| {
            let n = sequence.entry((c.task.tgid, comm)).or_insert(0);
            *n += 1;
            *n - 1
        });
        let args = CallArgs {
            ret: c.ret,
            bytes: c.bytes,
            count: c.count,
            datatype: c.datatype.map(datatype_name),
            op: c.redop.map(redop_name),
            peer_or_root: c.peer,
            comm: comm.map(Hex),
            seq,
            stream: c.stream.map(Hex),
            rank: c.rank,
        };
        if !w.traced(c.start_ns) {
            continue;
        }
        let (ts, d) = (w.ts(c.start_ns), dur(c.start_ns, c.end_ns));
        w.event(&Ev::slice(
            cat,
            name,
            c.task.tgid,
            u64::from(c.task.tid),
            ts,
            d,
            args,
        ))?;
    }
    let node = |cpu: i32| {
        usize::try_from(cpu)
            .ok()
            .and_then(|c| detail.cpu_nodes.get(c))
            .copied()
            .unwrap_or(-1)
    };
    for t in &detail.threads {
        for off in &t.offcpu {
            let name = if off.runnable {
                "off-CPU: preempted"
            } else {
                "off-CPU: blocked"
            };
            if !w.traced(off.start_ns) {
                continue;
            }
            let args = Woken {
                woken_by_tid: off.waker.map(|w| w.0),
                woken_by_pid: off.waker.map(|w| w.1),
            };
            let (ts, d) = (w.ts(off.start_ns), dur(off.start_ns, off.end_ns));
            w.event(&Ev::slice(
                "sched",
                name,
                t.pid,
                u64::from(t.tid),
                ts,
                d,
                args,
            ))?;
        }
        let base = w.base_ns;
        for &(ts, from, to) in t.migrations.iter().filter(|m| m.0 >= base) {
            let args = Moved {
                from_cpu: from,
                to_cpu: to,
                from_node: node(from),
                to_node: node(to),
            };
            let ev = Ev::instant(
                "sched",
                "migration",
                t.pid,
                u64::from(t.tid),
                w.ts(ts),
                args,
            );
            w.event(&ev)?;
        }
        let mut i = 0;
        while i < t.faults.len() {
            let start = t.faults[i];
            if !w.traced(start) {
                i += 1;
                continue;
            }
            let mut j = i;
            while j + 1 < t.faults.len() && t.faults[j + 1] - t.faults[j] < BURST_GAP_NS {
                j += 1;
            }
            let args = Burst {
                faults: j - i + 1,
                span_us: dur(start, t.faults[j]) as f64 / 1000.0,
            };
            let ev = Ev::instant(
                "memory",
                "page faults",
                t.pid,
                u64::from(t.tid),
                w.ts(start),
                args,
            );
            w.event(&ev)?;
            i = j + 1;
        }
    }
    // Runnable-but-waiting target threads, as a counter stepping at each change.
    let mut changes: Vec<(u64, u32, i64)> = Vec::new();
    for t in &detail.threads {
        for off in &t.offcpu {
            // Runnable from the switch-out when preempted, else from the wakeup on.
            let from = if off.runnable {
                Some(off.start_ns)
            } else {
                off.woken_ns
            };
            if let Some(from) = from.filter(|f| *f < off.end_ns) {
                changes.push((from, t.pid, 1));
                changes.push((off.end_ns, t.pid, -1));
            }
        }
    }
    changes.sort_unstable();
    let mut runnable: std::collections::BTreeMap<u32, i64> = std::collections::BTreeMap::new();
    for (ts, pid, delta) in changes {
        let n = runnable.entry(pid).or_insert(0);
        *n += delta;
        if !w.traced(ts) {
            continue;
        }
        let args = Runnable {
            waiting: (*n).max(0),
        };
        w.event(&Ev::counter("runnable threads", pid, w.ts(ts), args))?;
    }
    // Counters per process, in 100 ms bins.
    let mut pids: Vec<u32> = detail.threads.iter().map(|t| t.pid).collect();
    pids.sort_unstable();
    pids.dedup();
    // 100 ms bins, wider when the span would need more than MAX_BINS (a damaged clock).
    let span = detail.end_ns.saturating_sub(detail.first_ns);
    let bin_ns = BIN_NS.max(span / MAX_BINS + 1);
    let bins = (span / bin_ns + 1) as usize;
    for pid in pids {
        let (mut faults, mut migrations) = (vec![0u64; bins], vec![0u64; bins]);
        for t in detail.threads.iter().filter(|t| t.pid == pid) {
            for ts in &t.faults {
                if let Some(b) =
                    faults.get_mut((ts.saturating_sub(detail.first_ns) / bin_ns) as usize)
                {
                    *b += 1;
                }
            }
            for (ts, _, _) in &t.migrations {
                if let Some(b) =
                    migrations.get_mut((ts.saturating_sub(detail.first_ns) / bin_ns) as usize)
                {
                    *b += 1;
                }
            }
        }
        for (b, (f, m)) in faults.iter().zip(&migrations).enumerate() {
            let ts = w.ts(detail.first_ns.saturating_add(b as u64 * bin_ns));
            let per_s = 1e9 / bin_ns as f64;
            w.event(&Ev::counter(
                "faults/s",
                pid,
                ts,
                Count("faults", *f as f64 * per_s),
            ))?;
            let args = Count("migrations", *m as f64 * per_s);
            w.event(&Ev::counter("migrations/s", pid, ts, args))?;
        }
    }
    let other = json!({
        "clock": "CLOCK_MONOTONIC; ts 0 is monotonic_ns_at_0",
        "monotonic_ns_at_0": detail.first_ns,
        "realtime_ns_at_0": header.clock.realtime_ns,
        "kernel": header.kernel_release,
        "host": header.hostname,
        "nccltrace": header.agent_version,
    });
    write!(w.out, "\n],\"otherData\":")?;
    serde_json::to_writer(&mut w.out, &other)?;
    writeln!(w.out, "}}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attribute::steps::Method;
    use crate::attribute::{Categories, Methods, NcclCount};
    use serde_json::Value;

    /// trace.json of a fixed timeline, against its golden file.
    #[test]
    fn trace_golden() {
        let (detail, _) = crate::render::fixture::detail();
        let header = Header {
            targets: vec![crate::record::TargetInfo {
                pid: 10,
                comm: "trainer".into(),
                ..Default::default()
            }],
            kernel_release: "6.18".into(),
            ..Default::default()
        };
        let step = Step {
            index: 0,
            start_ns: 0,
            end_ns: 8_000_000,
            wall_ns: 8_000_000,
            categories: Categories {
                compute: 3_000_000,
                nccl_wait: 3_000_000,
                page_fault: 1_000_000,
                runqueue: 1_000_000,
                ..Categories::default()
            },
            nccl: NcclCount {
                collectives: 1,
                bytes: 4096,
            },
            faults: 3,
            migrations: 1,
            cross_node_migrations: 1,
            numa_page_migrations: 0,
            numa_task_moves: 0,
            slowest_rank: None,
            ranks: vec![],
        };
        let steps = StepsReport {
            clock: "",
            partial_steps_left_out: 0,
            epochs: 1,
            late_events_left_out: 0,
            method: Method::Auto,
            reason: String::new(),
            period: Some(1),
            rank_pid: Some(10),
            rank_tid: Some(10),
            methods: Methods {
                nccl_wait: String::new(),
                page_fault: String::new(),
                remote_memory: String::new(),
                remote_memory_estimated: false,
            },
            steps: vec![step],
            threads: vec![],
            other_offcpu_top_stacks: vec![],
            // Regression (issue 18): the process was named "rank 0" (its position) while
            // summary.json said rank 3.
            ranks: vec![crate::attribute::ranks::RankReport {
                pid: 10,
                rank: 3,
                rank_source: "environment RANK".into(),
                nccl: crate::attribute::ranks::RankNccl {
                    collectives: 1,
                    bytes: 4096,
                },
                categories: Categories::default(),
            }],
            straggler: None,
        };
        let mut out = Vec::new();
        write(&header, &detail, &steps, &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        let parsed: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(
            parsed["traceEvents"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|e| e["cat"] == "nccl")
                .count(),
            1
        );
        assert!(text.contains("\"rank 3 (pid 10) trainer\""), "{text}");
        crate::render::golden("trace.json", &text);
    }
}
