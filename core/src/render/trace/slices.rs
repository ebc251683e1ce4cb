//! The slices of an epoch: its steps on the steps track and its calls on their threads'
//! tracks, formatted on helper threads where CPUs are spare.

use std::io::{self, Write};

use super::event::{CallArgs, Ev, StepArgs};
use super::{Detail, PARALLEL, STEPS_TID, Step, TraceStream, Writer, dur};
use crate::event::{Library, datatype_name, redop_name};

impl<W: Write> TraceStream<W> {
    /// The steps and calls of an epoch, the calls and the steps' second half formatted
    /// aside, then written in order: the file is the same as written in one go. What no
    /// thread could be started for is formatted here after the rest.
    pub(super) fn aside(&mut self, detail: &Detail, steps: &[Step], pid: u32) -> io::Result<()> {
        let mid = if steps.len() >= 2 * PARALLEL {
            steps.len() / 2
        } else {
            steps.len()
        };
        let (head, tail) = steps.split_at(mid);
        let writer = |out: &mut Vec<u8>, first: bool| {
            let mut out = std::mem::take(out);
            out.clear();
            Writer {
                out,
                first,
                base_ns: self.w.base_ns,
                ev: Vec::with_capacity(512),
            }
        };
        let mut tail_w = writer(&mut self.steps_out, self.w.first && head.is_empty());
        let mut calls_w = writer(&mut self.calls_out, self.w.first && steps.is_empty());
        let (w, sequence) = (&mut self.w, &mut self.sequence);
        let mut spawned = (false, false);
        std::thread::scope(|scope| {
            let spawn = |name: &str| std::thread::Builder::new().name(format!("nccltrace-{name}"));
            // A thread only for a part worth one (a few calls are formatted after).
            let t = (!tail.is_empty())
                .then(|| {
                    spawn("trace-steps")
                        .spawn_scoped(scope, || write_steps(&mut tail_w, tail, pid))
                        .ok()
                })
                .flatten();
            let c = (detail.calls.len() >= PARALLEL)
                .then(|| {
                    spawn("trace-calls")
                        .spawn_scoped(scope, || write_calls(&mut calls_w, sequence, detail))
                        .ok()
                })
                .flatten();
            spawned = (t.is_some(), c.is_some());
            let mut written = write_steps(w, head, pid);
            for helper in [t, c].into_iter().flatten() {
                match helper.join() {
                    Ok(r) => written = written.and(r),
                    Err(panic) => std::panic::resume_unwind(panic),
                }
            }
            written
        })?;
        if !spawned.0 {
            write_steps(&mut tail_w, tail, pid)?;
        }
        if !spawned.1 {
            write_calls(&mut calls_w, &mut self.sequence, detail)?;
        }
        self.w.first = calls_w.first;
        self.w.out.write_all(&tail_w.out)?;
        self.w.out.write_all(&calls_w.out)?;
        self.steps_out = tail_w.out;
        self.calls_out = calls_w.out;
        Ok(())
    }
}

/// The steps of the rank process `pid` on the steps track.
pub(super) fn write_steps<W: Write>(w: &mut Writer<W>, steps: &[Step], pid: u32) -> io::Result<()> {
    let mut name = String::new();
    for s in steps {
        name.clear();
        name.push_str("step ");
        name.push_str(itoa::Buffer::new().format(s.index));
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
    Ok(())
}

/// The calls and syncs as slices; collectives numbered per (pid, communicator) in
/// `sequence`.
pub(super) fn write_calls<W: Write>(
    w: &mut Writer<W>,
    sequence: &mut std::collections::BTreeMap<(u32, u64), u64>,
    detail: &Detail,
) -> io::Result<()> {
    // Slice names made once per function (NVTX names once per call).
    let mut names: std::collections::HashMap<
        crate::event::Func,
        String,
        foldhash::fast::FixedState,
    > = std::collections::HashMap::default();
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
            nvtx_name = format!("NVTX {}", c.message().unwrap_or("?"));
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
            comm,
            seq,
            stream: c.stream,
            rank: c.rank(),
            python: c.python.as_deref(),
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
    Ok(())
}
