//! The communicators of the traced processes: how many ranks each has, and where that
//! was learnt. A communicator of one rank communicates nothing (its collectives are local
//! copies): a sync after them waits for the GPU's own work, not for NCCL.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

/// Where a communicator's size was learnt.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SizeFrom {
    /// The arguments of its `ncclCommInitRank*` / `ncclCommInitAll`, seen.
    Init,
    /// Its memory, at the offset the library's `ncclCommCount` reads (made before attach).
    Memory,
}

/// What is known of the processes' communicators.
#[derive(Clone, Debug, Default)]
pub(super) struct Comms {
    /// (pid, handle) → (nranks, the process's rank in it, where from).
    sizes: BTreeMap<(u32, u64), (i32, Option<i32>, SizeFrom)>,
    /// The job's size from a process's environment: (variable, value).
    world: BTreeMap<u32, (String, i32)>,
    /// Communicators that collectives were issued on.
    used: BTreeSet<(u32, u64)>,
}

/// One communicator, as steps.json `communicators` lists it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct CommReport {
    pub pid: u32,
    /// The handle the process's calls pass, in hex.
    pub comm: String,
    /// Its size; null where it could not be learnt (its collectives then count as
    /// communication: `nccl_wait` stays an upper bound).
    pub nranks: Option<i32>,
    /// The process's rank in it, where known.
    pub rank: Option<i32>,
    /// Where the size came from: `ncclCommInitRank` (its creation, traced), `memory` (read
    /// from the communicator where the library's ncclCommCount reads it), `environment
    /// WORLD_SIZE=1` (a job of one rank), or why it is unknown.
    pub nranks_from: String,
    /// Whether collectives were issued on it while traced.
    pub used: bool,
}

impl Comms {
    pub(super) fn created(&mut self, pid: u32, comm: u64, nranks: i32, rank: Option<i32>) {
        self.sizes
            .insert((pid, comm), (nranks, rank, SizeFrom::Init));
    }

    /// A size read from memory never replaces the creation's arguments.
    pub(super) fn read(&mut self, pid: u32, comm: u64, nranks: i32, rank: Option<i32>) {
        self.sizes
            .entry((pid, comm))
            .or_insert((nranks, rank, SizeFrom::Memory));
    }

    pub(super) fn used(&mut self, pid: u32, comm: u64) {
        self.used.insert((pid, comm));
    }

    pub(super) fn world(&mut self, pid: u32, size: (String, i32)) {
        self.world.insert(pid, size);
    }

    /// Whether `comm` of `pid` has one rank: its size says so, or, where its size is not
    /// known, the process's job has one rank (every communicator of it then has one).
    pub(super) fn one_rank(&self, pid: u32, comm: u64) -> bool {
        match self.sizes.get(&(pid, comm)) {
            Some((n, ..)) => *n == 1,
            None => self.world.get(&pid).is_some_and(|(_, n)| *n == 1),
        }
    }

    /// The processes whose collectives were all on one-rank communicators: each a job of
    /// its own, never matched with another.
    pub(super) fn alone(&self) -> Vec<u32> {
        let pids: BTreeSet<u32> = self.used.iter().map(|(pid, _)| *pid).collect();
        pids.into_iter()
            .filter(|pid| {
                self.used
                    .range((*pid, 0)..=(*pid, u64::MAX))
                    .all(|(p, c)| self.one_rank(*p, *c))
            })
            .collect()
    }

    /// Each process's rank in its largest communicator that collectives were issued on,
    /// where that was read from its memory (its world communicator, in a job that splits
    /// none off before it).
    pub(super) fn ranks(&self) -> BTreeMap<u32, i32> {
        let mut best: BTreeMap<u32, (i32, i32)> = BTreeMap::new();
        for (&(pid, comm), &(nranks, rank, from)) in &self.sizes {
            if let (SizeFrom::Memory, Some(rank), true) =
                (from, rank, self.used.contains(&(pid, comm)))
                && best.get(&pid).is_none_or(|(n, _)| nranks > *n)
            {
                best.insert(pid, (nranks, rank));
            }
        }
        best.into_iter()
            .map(|(pid, (_, rank))| (pid, rank))
            .collect()
    }

    /// Every communicator that was made or used while traced, or read.
    pub(super) fn report(&self) -> Vec<CommReport> {
        let keys: BTreeSet<(u32, u64)> = self.sizes.keys().chain(&self.used).copied().collect();
        keys.into_iter()
            .map(|(pid, comm)| {
                let (nranks, rank, nranks_from) = match self.sizes.get(&(pid, comm)) {
                    Some((n, rank, SizeFrom::Init)) => (Some(*n), *rank, "ncclCommInitRank".into()),
                    Some((n, rank, SizeFrom::Memory)) => (Some(*n), *rank, "memory".into()),
                    None => match self.world.get(&pid) {
                        Some((var, 1)) => (Some(1), Some(0), format!("environment {var}=1")),
                        _ => (
                            None,
                            None,
                            "unknown: made before attach, and its size could not be read \
                             from its memory"
                                .into(),
                        ),
                    },
                };
                CommReport {
                    pid,
                    comm: format!("{comm:#x}"),
                    nranks,
                    rank,
                    nranks_from,
                    used: self.used.contains(&(pid, comm)),
                }
            })
            .collect()
    }

    /// How collectives were told communication or local copies, for `methods`.
    pub(super) fn describe(&self) -> String {
        let report = self.report();
        let used: Vec<&CommReport> = report.iter().filter(|c| c.used).collect();
        if used.is_empty() {
            return "no collective was traced".into();
        }
        let one = used.iter().filter(|c| c.nranks == Some(1)).count();
        let unknown = used.iter().filter(|c| c.nranks.is_none()).count();
        let mut words = format!(
            "{} communicator(s) carried collectives: {one} of one rank (local copies: the \
             syncs after them are gpu_wait), {} of more, {unknown} of unknown size (counted \
             as communication)",
            used.len(),
            used.len() - one - unknown
        );
        if unknown > 0 {
            words.push_str(
                "; sizes come from ncclCommInitRank* when traced, else from the communicator's \
                 memory where the library's ncclCommCount showed where to read, else from a \
                 job size of 1 in the environment (WORLD_SIZE and the like)",
            );
        }
        words
    }
}
