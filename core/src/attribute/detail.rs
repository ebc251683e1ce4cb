//! What the renderers get beside the steps: each thread's timeline (pieces by category,
//! samples, off-CPU stretches, migrations, faults), the stacks, the calls.

use super::Cat;
use crate::event::PyFrame;

/// A stack as captured: the process (for its maps), kernel and user frames, innermost
/// first, and the Python frames the thread was executing (innermost first; empty for a
/// thread that runs no Python or with Python frames off).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct StackKey {
    pub pid: u32,
    pub kstack: Vec<u64>,
    pub ustack: Vec<u64>,
    pub py: Vec<PyFrame>,
}

/// A stretch a thread spent off-CPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OffCpu {
    pub start_ns: u64,
    pub end_ns: u64,
    /// Preempted (still runnable) rather than blocked.
    pub runnable: bool,
    pub stack: Option<u32>,
    /// Who woke it: (tid, tgid).
    pub waker: Option<(u32, u32)>,
    /// When it was woken (runnable from then on).
    pub woken_ns: Option<u64>,
}

/// One thread's timeline, for the flamegraphs and the Perfetto trace.
#[derive(Clone, Debug)]
pub struct ThreadDetail {
    pub tid: u32,
    pub pid: u32,
    pub name: String,
    pub role: &'static str,
    /// (start, end, category) pieces over the traced interval.
    pub segments: Vec<(u64, u64, Cat)>,
    /// On-CPU samples: (time, stack id, category, on-CPU time it stands for).
    pub samples: Vec<(u64, u32, Cat, u64)>,
    pub offcpu: Vec<OffCpu>,
    pub migrations: Vec<(u64, i32, i32)>,
    pub faults: Vec<u64>,
    /// User stacks at the entry of traced calls: (time, stack id), by time.
    pub call_stacks: Vec<(u64, u32)>,
    /// The off-CPU stretch still open at the end of this part of the run (its end is
    /// that end).
    pub open: Option<OffCpu>,
}

impl ThreadDetail {
    /// The category at `ts`.
    #[must_use]
    pub fn category_at(&self, ts: u64) -> Option<Cat> {
        let i = self.segments.partition_point(|(_, e, _)| *e <= ts);
        self.segments
            .get(i)
            .filter(|(s, _, _)| *s <= ts)
            .map(|(_, _, c)| *c)
    }
}

/// Everything the flamegraph and trace renderers need.
#[derive(Clone, Debug, Default)]
pub struct Detail {
    pub first_ns: u64,
    pub end_ns: u64,
    pub threads: Vec<ThreadDetail>,
    pub stacks: Vec<StackKey>,
    pub calls: super::Calls,
    pub cpu_nodes: Vec<i32>,
    pub sample_period_ns: u64,
    /// Off-CPU stretches shorter than this have no stack by design (0: any may have one).
    pub offcpu_min_ns: u64,
    /// The steps' `[start, end)`, for graphs of step time.
    pub step_bounds: Vec<(u64, u64)>,
    /// The rank thread whose steps these are, and its process.
    pub rank_tid: Option<u32>,
    pub rank_pid: Option<u32>,
}

/// Stack ids by the stack's hash: each stack is kept once, in the table the ids index (a
/// map keyed by the stack itself held every stack twice: ~4,000 distinct stacks of up to
/// 96 frames in a 4-minute soak). A stack whose hash another already has is found in
/// `collisions`. A stack seen before is found from the frames as they lie (nothing is
/// copied but a new stack's frames).
#[derive(Debug, Default)]
pub(super) struct StackIds<S = foldhash::fast::RandomState> {
    by_hash: std::collections::HashMap<u64, u32, foldhash::fast::RandomState>,
    pub(super) collisions: std::collections::HashMap<StackKey, u32>,
    hasher: S,
}

/// The stack `pid`, `kstack`, `ustack` and `py` make, borrowed.
#[derive(Clone, Copy, Debug)]
pub(super) struct Frames<'a> {
    pub pid: u32,
    pub kstack: &'a [u64],
    pub ustack: &'a [u64],
    pub py: &'a [PyFrame],
}

impl Frames<'_> {
    fn is(&self, key: &StackKey) -> bool {
        key.pid == self.pid
            && key.kstack == self.kstack
            && key.ustack == self.ustack
            && key.py == self.py
    }

    fn to_key(self) -> StackKey {
        StackKey {
            pid: self.pid,
            kstack: self.kstack.to_vec(),
            ustack: self.ustack.to_vec(),
            py: self.py.to_vec(),
        }
    }
}

impl<S: std::hash::BuildHasher> StackIds<S> {
    fn hash(&self, f: &Frames<'_>) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut h = self.hasher.build_hasher();
        f.pid.hash(&mut h);
        f.kstack.hash(&mut h);
        f.ustack.hash(&mut h);
        f.py.hash(&mut h);
        h.finish()
    }

    /// The id of the stack `frames` make in `table`, where it is added when new.
    pub(super) fn intern(&mut self, table: &mut Vec<StackKey>, frames: Frames<'_>) -> u32 {
        use std::collections::hash_map::Entry;
        let id = table.len() as u32;
        match self.by_hash.entry(self.hash(&frames)) {
            Entry::Vacant(v) => {
                v.insert(id);
            }
            Entry::Occupied(o) if frames.is(&table[*o.get() as usize]) => return *o.get(),
            Entry::Occupied(_) => {
                let key = frames.to_key();
                if let Some(id) = self.collisions.get(&key) {
                    return *id;
                }
                self.collisions.insert(key, id);
            }
        }
        table.push(frames.to_key());
        id
    }
}
