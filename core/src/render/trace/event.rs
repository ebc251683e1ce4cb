//! One trace event and the arguments each kind carries, written field by field.

use super::{Obj, Step, Write, io};
use crate::render::json::{AsKey, Key, category_keys, key};

/// One trace event, written as it is (no intermediate JSON tree: traces run to millions
/// of events).
pub(super) struct Ev<'a, A: Args> {
    pub(super) ph: &'static str,
    pub(super) s: Option<&'static str>,
    pub(super) cat: Option<&'static str>,
    pub(super) name: &'a str,
    pub(super) pid: u32,
    pub(super) tid: Option<u64>,
    /// Nanoseconds since the start of the trace (written in µs).
    pub(super) ts: Option<u64>,
    pub(super) dur: Option<u64>,
    pub(super) args: A,
}

/// An event's `args` object, written field by field ([`super::json`]).
pub(super) trait Args {
    fn write(&self, o: &mut Obj<'_, impl Write>) -> io::Result<()>;
}

impl<'a, A: Args> Ev<'a, A> {
    pub(super) fn new(ph: &'static str, name: &'a str, pid: u32, args: A) -> Self {
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
    pub(super) fn slice(
        cat: &'static str,
        name: &'a str,
        pid: u32,
        tid: u64,
        ts: u64,
        dur: u64,
        args: A,
    ) -> Self {
        Ev {
            cat: Some(cat),
            tid: Some(tid),
            ts: Some(ts),
            dur: Some(dur),
            ..Ev::new("X", name, pid, args)
        }
    }

    /// An instant on a thread.
    pub(super) fn instant(
        cat: &'static str,
        name: &'a str,
        pid: u32,
        tid: u64,
        ts: u64,
        args: A,
    ) -> Self {
        Ev {
            s: Some("t"),
            cat: Some(cat),
            tid: Some(tid),
            ts: Some(ts),
            ..Ev::new("i", name, pid, args)
        }
    }

    /// A counter sample of the process.
    pub(super) fn counter(name: &'a str, pid: u32, ts: u64, args: A) -> Self {
        Ev {
            ts: Some(ts),
            ..Ev::new("C", name, pid, args)
        }
    }
}

/// The arguments of a step slice: its categories in ms and its counts.
pub(super) struct StepArgs<'a>(pub(super) &'a Step);

impl Args for StepArgs<'_> {
    fn write(&self, o: &mut Obj<'_, impl Write>) -> io::Result<()> {
        // The keys made once, not once a step.
        static KEYS: std::sync::LazyLock<[Key; crate::attribute::NAMES.len()]> =
            std::sync::LazyLock::new(|| category_keys("_ms"));
        let s = self.0;
        for (key, (_, value)) in KEYS.iter().zip(s.categories.named()) {
            o.ms(*key, value)?;
        }
        o.u64(key!("nccl_collectives"), s.nccl.collectives)?;
        o.u64(key!("nccl_bytes"), s.nccl.bytes)?;
        o.u64(key!("faults"), s.faults)?;
        o.u64(key!("migrations"), s.migrations)
    }
}

/// The arguments of an NCCL call or CUDA sync slice (those the call has).
pub(super) struct CallArgs<'a> {
    /// None: traced at entry only.
    pub(super) ret: Option<i32>,
    pub(super) bytes: Option<u64>,
    pub(super) count: Option<u64>,
    pub(super) datatype: Option<&'a str>,
    pub(super) op: Option<&'a str>,
    pub(super) peer_or_root: Option<i32>,
    pub(super) comm: Option<u64>,
    /// The n-th collective on a communicator: the same operation on every rank.
    pub(super) seq: Option<u64>,
    pub(super) stream: Option<u64>,
    pub(super) rank: Option<i32>,
    /// The Python frame the call was made from.
    pub(super) python: Option<&'a str>,
}

impl Args for CallArgs<'_> {
    fn write(&self, o: &mut Obj<'_, impl Write>) -> io::Result<()> {
        if let Some(ret) = self.ret {
            o.i64(key!("ret"), i64::from(ret))?;
        }
        for (key, v) in [(key!("bytes"), self.bytes), (key!("count"), self.count)] {
            if let Some(v) = v {
                o.u64(key, v)?;
            }
        }
        for (key, v) in [(key!("datatype"), self.datatype), (key!("op"), self.op)] {
            if let Some(v) = v {
                o.str(key, v)?;
            }
        }
        if let Some(v) = self.peer_or_root {
            o.i64(key!("peer_or_root"), i64::from(v))?;
        }
        hex(o, key!("comm"), self.comm)?;
        if let Some(v) = self.seq {
            o.u64(key!("seq"), v)?;
        }
        hex(o, key!("stream"), self.stream)?;
        if let Some(v) = self.rank {
            o.i64(key!("rank"), i64::from(v))?;
        }
        if let Some(v) = self.python {
            o.str(key!("python"), v)?;
        }
        Ok(())
    }
}

/// A pointer-like value as a hex string, when there is one.
pub(super) fn hex(o: &mut Obj<'_, impl Write>, key: impl AsKey, v: Option<u64>) -> io::Result<()> {
    match v {
        Some(v) => o.hex(key, v),
        None => Ok(()),
    }
}

/// Who woke a thread (when known).
pub(super) struct Woken(pub(super) Option<(u32, u32)>);

impl Args for Woken {
    fn write(&self, o: &mut Obj<'_, impl Write>) -> io::Result<()> {
        if let Some((tid, pid)) = self.0 {
            o.u64("woken_by_tid", u64::from(tid))?;
            o.u64("woken_by_pid", u64::from(pid))?;
        }
        Ok(())
    }
}

pub(super) struct Moved {
    pub(super) from_cpu: i32,
    pub(super) to_cpu: i32,
    pub(super) from_node: i32,
    pub(super) to_node: i32,
}

impl Args for Moved {
    fn write(&self, o: &mut Obj<'_, impl Write>) -> io::Result<()> {
        o.i64("from_cpu", i64::from(self.from_cpu))?;
        o.i64("to_cpu", i64::from(self.to_cpu))?;
        o.i64("from_node", i64::from(self.from_node))?;
        o.i64("to_node", i64::from(self.to_node))
    }
}

pub(super) struct Burst {
    pub(super) faults: usize,
    pub(super) span_us: f64,
}

impl Args for Burst {
    fn write(&self, o: &mut Obj<'_, impl Write>) -> io::Result<()> {
        o.u64("faults", self.faults as u64)?;
        o.value("span_us", &self.span_us)
    }
}

/// Runnable target threads waiting for a CPU.
pub(super) struct Runnable(pub(super) i64);

impl Args for Runnable {
    fn write(&self, o: &mut Obj<'_, impl Write>) -> io::Result<()> {
        o.i64("waiting for a CPU", self.0)
    }
}

/// A counter's one value, `{"NAME": VALUE}`.
pub(super) struct Count(pub(super) &'static str, pub(super) f64);

impl Args for Count {
    fn write(&self, o: &mut Obj<'_, impl Write>) -> io::Result<()> {
        o.value(self.0, &self.1)
    }
}
