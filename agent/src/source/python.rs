//! Python frames at the source: each Python target's layout and thread states handed to
//! the kernel programs (`PY_LAYOUTS`, `PY_THREADS`), the thread states kept up to date as
//! threads come and go, and the code objects the walks return named while the target
//! runs, for the recording.

use std::collections::{BTreeMap, BTreeSet, HashSet};

use aya::Ebpf;
use aya::maps::HashMap as BpfHashMap;
use nccltrace_common::{PyLayout, kind, names};

use super::{Sink, SourceError, map_error, missing_map};
use crate::host::Host;
use crate::python::{CodeInfo, Found, Interp, PythonInfo};

/// A Python target being traced.
#[derive(Debug)]
pub struct PyTarget {
    interp: Interp,
    /// The thread states in `PY_THREADS`: (tid, address).
    threads: BTreeSet<(u32, u64)>,
    /// Code objects whose names went to the current sink.
    emitted: HashSet<u64>,
}

/// Python targets by pid.
pub type PyTargets = BTreeMap<u32, PyTarget>;

/// Finds `pid`'s interpreter and, when its frames can be walked, hands its layout and
/// thread states to the programs. Returns what the recording says of it (`None`: not a
/// Python process).
pub fn start(
    ebpf: &mut Ebpf,
    host: &Host,
    pid: u32,
    targets: &mut PyTargets,
) -> Result<Option<PythonInfo>, SourceError> {
    match Interp::find(host, pid) {
        Err(Found::NotPython) => Ok(None),
        Err(Found::Unsupported(info)) => {
            if let Some(note) = &info.note {
                crate::note!("nccltrace: pid {pid}: {note}");
            }
            Ok(Some(info))
        }
        Ok(interp) => {
            let mut layouts: BpfHashMap<_, u32, PyLayout> = BpfHashMap::try_from(
                ebpf.map_mut(names::PY_LAYOUTS)
                    .ok_or_else(|| missing_map(names::PY_LAYOUTS))?,
            )
            .map_err(map_error(names::PY_LAYOUTS))?;
            layouts
                .insert(pid, interp.layout.kernel, 0)
                .map_err(map_error(names::PY_LAYOUTS))?;
            let info = interp.info.clone();
            let mut target = PyTarget {
                interp,
                threads: BTreeSet::new(),
                emitted: HashSet::new(),
            };
            refresh_one(ebpf, &mut target)?;
            targets.insert(pid, target);
            Ok(Some(info))
        }
    }
}

/// Puts the target's current thread states in `PY_THREADS` and takes out those gone.
fn refresh_one(ebpf: &mut Ebpf, target: &mut PyTarget) -> Result<(), SourceError> {
    let now: BTreeSet<(u32, u64)> = target.interp.threads().into_iter().collect();
    if now == target.threads {
        return Ok(());
    }
    let mut map: BpfHashMap<_, u32, u64> = BpfHashMap::try_from(
        ebpf.map_mut(names::PY_THREADS)
            .ok_or_else(|| missing_map(names::PY_THREADS))?,
    )
    .map_err(map_error(names::PY_THREADS))?;
    for (tid, _) in target.threads.difference(&now) {
        if !now.iter().any(|(t, _)| t == tid) {
            let _ = map.remove(tid);
        }
    }
    for (tid, tstate) in now.difference(&target.threads) {
        map.insert(tid, tstate, 0)
            .map_err(map_error(names::PY_THREADS))?;
    }
    target.threads = now;
    Ok(())
}

/// Brings every Python target's thread states up to date (threads started or ended
/// since: a thread states appears when a thread first runs Python code).
pub fn refresh(ebpf: &mut Ebpf, targets: &mut PyTargets) {
    for (pid, target) in targets.iter_mut() {
        if let Err(e) = refresh_one(ebpf, target) {
            log::warn!("python threads of pid {pid} not updated: {e}");
        }
    }
}

/// A new sink (a new recording window): code objects are named to it again.
pub fn new_window(targets: &mut PyTargets) {
    for t in targets.values_mut() {
        t.emitted.clear();
    }
}

/// Hands records on to `inner`, naming each code object a Python stack record shows for
/// the first time (read from the live target) just before the record.
pub struct Naming<'a, S: Sink> {
    pub inner: &'a mut S,
    pub targets: &'a mut PyTargets,
}

impl<S: Sink> Sink for Naming<'_, S> {
    fn record(&mut self, bytes: &[u8]) -> Result<(), crate::Error> {
        if !self.targets.is_empty()
            && matches!(
                crate::decode::record_kind(bytes),
                Ok(kind::PY_STACK | kind::PY_FRAMES)
            )
            && let Ok(crate::event::Event::PyStack { task, frames, .. }) =
                crate::decode::decode(bytes)
            && let Some(target) = self.targets.get_mut(&task.tgid)
        {
            let mut named: Vec<(u64, CodeInfo)> = Vec::new();
            for f in frames.iter().filter(|f| !f.is_entry()) {
                if target.emitted.insert(f.code)
                    && let Some(info) = target.interp.code(f.code)
                {
                    named.push((f.code, info.clone()));
                }
            }
            if !named.is_empty() {
                self.inner.python_codes(task.tgid, named);
            }
        }
        self.inner.record(bytes)
    }

    fn target_added(&mut self, target: &crate::record::TargetInfo) {
        self.inner.target_added(target);
    }

    fn tick(&mut self, lost: &BTreeMap<String, u64>, alive: usize) {
        self.inner.tick(lost, alive);
    }

    fn rotate_due(&self) -> bool {
        self.inner.rotate_due()
    }

    fn python_codes(&mut self, pid: u32, codes: Vec<(u64, CodeInfo)>) {
        self.inner.python_codes(pid, codes);
    }
}
