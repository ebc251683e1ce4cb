//! Communicators made before attach: their size and the target's rank in each, read from
//! the target's memory the first time a collective names them, at the offsets its NCCL
//! library's `ncclCommCount` and `ncclCommUserRank` load from
//! ([`crate::nccl_code`]). `attach --pid` joins jobs whose communicators exist already: a
//! one-rank communicator communicates nothing, and only its size tells.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::os::unix::fs::FileExt as _;
use std::path::Path;

use super::{BTreeMap, Host, Sink, agent_record, kind};
use crate::record::{CommFields, TargetInfo};

/// The most bytes of a getter decoded (NCCL 2.28.9's are 789).
const MAX_CODE: usize = 4096;
/// Sizes beyond this are not a communicator's (a stale handle, a wrong offset).
const MAX_RANKS: i32 = 1 << 20;

/// Where `library` keeps a communicator's size and rank, or why that is not known.
pub(super) fn fields(library: &Path) -> Result<CommFields, String> {
    let code = |names: &[&str]| {
        crate::source::discover::function_code(library, names, MAX_CODE).map_err(|e| e.to_string())
    };
    let count = code(&["pncclCommCount", "ncclCommCount"])?
        .ok_or("the library exports no ncclCommCount")?;
    let nranks = nccltrace_core::nccl_code::returned_field(&count).ok_or(
        "ncclCommCount's code has no single load of the size returned through its second \
         argument (not x86-64, or a form the decoder does not know)",
    )?;
    let rank = code(&["pncclCommUserRank", "ncclCommUserRank"])?
        .as_deref()
        .and_then(nccltrace_core::nccl_code::returned_field);
    Ok(CommFields { nranks, rank })
}

/// The communicators seen so far and what was read of them.
#[derive(Default)]
pub(super) struct CommSizes {
    /// Each target's offsets, where its library showed them.
    fields: HashMap<u32, CommFields>,
    /// Communicators already read (or tried).
    seen: HashSet<(u32, u64)>,
    /// `/proc/PID/mem`, open once per target.
    mem: HashMap<u32, File>,
}

impl CommSizes {
    pub(super) fn new(targets: &[TargetInfo]) -> CommSizes {
        let mut sizes = CommSizes::default();
        for t in targets {
            sizes.add(t);
        }
        sizes
    }

    pub(super) fn add(&mut self, t: &TargetInfo) {
        if let Some(Ok(fields)) = t.comm_fields {
            self.fields.insert(t.pid, fields);
        }
    }

    /// A new recording window: each communicator is read and written again when next
    /// named (the window's replay knows only its own records).
    pub(super) fn new_window(&mut self) {
        self.seen.clear();
    }

    /// A `COMM_SIZE` record for the communicator of a collective `record`, the first time
    /// one of its process names it.
    fn on_record(&mut self, bytes: &[u8]) -> Option<nccltrace_common::CommSizeEvent> {
        if self.fields.is_empty() || crate::decode::record_kind(bytes) != Ok(kind::CALL) {
            return None;
        }
        let Ok(crate::event::Event::Call(call)) = crate::decode::decode(bytes) else {
            return None;
        };
        let pid = call.task.tgid;
        let comm = call.comm.filter(|_| call.func.is_collective())?;
        let fields = *self.fields.get(&pid)?;
        if !self.seen.insert((pid, comm)) {
            return None;
        }
        let mem = match self.mem.entry(pid) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert(File::open(Host::live().path(&format!("proc/{pid}/mem"))).ok()?)
            }
        };
        let read = |offset: u32| {
            let mut word = [0u8; 4];
            mem.read_exact_at(&mut word, comm.checked_add(u64::from(offset))?)
                .ok()?;
            Some(i32::from_le_bytes(word))
        };
        let nranks = read(fields.nranks).filter(|n| (1..=MAX_RANKS).contains(n))?;
        let rank = fields
            .rank
            .and_then(read)
            .filter(|r| (0..nranks).contains(r))
            .unwrap_or(-1);
        Some(nccltrace_common::CommSizeEvent {
            hdr: agent_record(call.end_ns, pid, pid, kind::COMM_SIZE),
            comm,
            nranks,
            rank,
        })
    }
}

/// Hands records on to `inner`, each collective's communicator read and written after it
/// the first time it is named.
pub struct Sizing<'a, S: Sink> {
    pub inner: &'a mut S,
    pub(super) comms: &'a mut CommSizes,
}

impl<S: Sink> Sink for Sizing<'_, S> {
    fn record(&mut self, bytes: &[u8]) -> Result<(), crate::Error> {
        let size = self.comms.on_record(bytes);
        self.inner.record(bytes)?;
        if let Some(size) = size {
            self.inner.record(&crate::decode::as_bytes(&size))?;
        }
        Ok(())
    }

    fn target_added(&mut self, target: &TargetInfo) {
        self.inner.target_added(target);
    }

    fn tick(&mut self, lost: &BTreeMap<String, u64>, alive: usize) {
        self.inner.tick(lost, alive);
    }

    fn rotate_due(&self) -> bool {
        self.inner.rotate_due()
    }

    fn python_codes(&mut self, pid: u32, codes: Vec<(u64, crate::python::CodeInfo)>) {
        self.inner.python_codes(pid, codes);
    }
}
