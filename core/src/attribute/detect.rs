//! Which thread runs the training loop, and where its steps are: the rank thread's choice
//! and step detection on what an epoch holds (with the tail of the earlier ones).

use std::collections::BTreeMap;

use super::steps::{self, Collective, Detected};
use super::{StepRule, ThreadLog, Timeline, ranks};

/// Each process's collectives of an epoch, by pid.
pub(super) type Collectives = BTreeMap<u32, Vec<Collective>>;

impl Timeline {
    /// The rank thread runs the training loop: in the process that issued the most
    /// collectives, the thread that waits on the GPU most often (PyTorch's main thread:
    /// DDP issues its all-reduces from the autograd thread, but `.item()` syncs on the
    /// main one), else the thread issuing the most collectives. Where a process that
    /// issued collectives exited, those issued before the first such exit are counted: the
    /// first job is followed first, the next one after it.
    pub(super) fn choose_rank(&self) -> Option<(u32, u32)> {
        let mut by_pid = self.collectives_by_pid();
        let first_exit = by_pid
            .iter()
            .filter(|(_, n)| **n > 0)
            .filter_map(|(pid, _)| self.exit_of(*pid))
            .min();
        if let Some(e) = first_exit {
            by_pid.clear();
            for log in self.threads.values() {
                let before = log.collectives.partition_point(|c| c.start_ns < e);
                *by_pid.entry(log.pid).or_default() += before as u64;
            }
        }
        let pid = by_pid
            .iter()
            .filter(|(_, n)| **n > 0)
            .max_by_key(|(pid, n)| (**n, std::cmp::Reverse(**pid)))
            .map(|(pid, _)| *pid)?;
        self.threads
            .iter()
            .filter(|(_, l)| l.pid == pid)
            .max_by_key(|(tid, l)| (l.total_syncs, l.total_collectives, std::cmp::Reverse(**tid)))
            .map(|(tid, _)| (*tid, pid))
    }

    /// Each process's collectives over the run so far, from all its threads.
    fn collectives_by_pid(&self) -> BTreeMap<u32, u64> {
        let mut per_pid: BTreeMap<u32, u64> = BTreeMap::new();
        for log in self.threads.values() {
            *per_pid.entry(log.pid).or_default() += log.total_collectives;
        }
        per_pid
    }

    /// A process's training-loop thread over the run so far: the one that waits on the
    /// GPU most often, else the one issuing the most collectives.
    pub(super) fn loop_thread(&self, pid: u32) -> Option<u32> {
        self.threads
            .iter()
            .filter(|(_, l)| l.pid == pid)
            .filter(|(_, l)| l.total_syncs > 0 || l.total_collectives > 0)
            .max_by_key(|(tid, l)| (l.total_syncs, l.total_collectives, std::cmp::Reverse(**tid)))
            .map(|(tid, _)| *tid)
    }

    /// A process's collectives from every thread, by start: the earlier epochs' tail
    /// too when `history`.
    pub(super) fn process_collectives(&self, pid: u32, history: bool) -> Vec<Collective> {
        fn parts(l: &ThreadLog, history: bool) -> [&[Collective]; 2] {
            let old = if history {
                &l.history.collectives[..]
            } else {
                &[][..]
            };
            [old, &l.collectives[..]]
        }
        let of_pid = || self.threads.values().filter(|l| l.pid == pid);
        // Sized once (grown by doubling, copying them was a tenth of the attribution of a
        // run of one-call steps).
        let len = of_pid()
            .flat_map(|l| parts(l, history))
            .map(<[Collective]>::len)
            .sum();
        let mut c = Vec::with_capacity(len);
        let mut threads = 0;
        for l in of_pid() {
            let before = c.len();
            for part in parts(l, history) {
                c.extend_from_slice(part);
            }
            threads += usize::from(c.len() > before);
        }
        // One thread's collectives are in order but where one began before the cut and
        // returned after it.
        if threads > 1 || !c.is_sorted_by_key(|c| c.start_ns) {
            c.sort_by_key(|c| c.start_ns);
        }
        c
    }

    /// Each process's collectives of the epoch for the steps and totals (as
    /// [`Timeline::process_collectives`] without history). Where one thread issued them
    /// all, in order, its buffer is lent rather than copied (on a run of one-call steps,
    /// thousands an epoch); [`Timeline::give_back`] returns it. Also the lenders:
    /// (pid, tid).
    pub(super) fn lend_collectives(
        &mut self,
        pids: &std::collections::BTreeSet<u32>,
    ) -> (Collectives, Vec<(u32, u32)>) {
        let mut colls = BTreeMap::new();
        let mut lent = Vec::new();
        for &pid in pids {
            let mut issuers = self
                .threads
                .iter()
                .filter(|(_, l)| l.pid == pid && !l.collectives.is_empty());
            let only = match (issuers.next(), issuers.next()) {
                (Some((tid, l)), None) if l.collectives.is_sorted_by_key(|c| c.start_ns) => {
                    Some(*tid)
                }
                _ => None,
            };
            let c = match only.and_then(|tid| self.threads.get_mut(&tid).map(|l| (tid, l))) {
                Some((tid, log)) => {
                    lent.push((pid, tid));
                    std::mem::take(&mut log.collectives)
                }
                None => self.process_collectives(pid, false),
            };
            colls.insert(pid, c);
        }
        (colls, lent)
    }

    /// Returns the buffers [`Timeline::lend_collectives`] lent.
    pub(super) fn give_back(&mut self, mut colls: Collectives, lent: Vec<(u32, u32)>) {
        for (pid, tid) in lent {
            if let (Some(c), Some(log)) = (colls.remove(&pid), self.threads.get_mut(&tid)) {
                log.collectives = c;
            }
        }
    }

    /// Steps in the buffer by the rule, and whether they were found (not the fallback).
    pub(super) fn detect(&self, rank: Option<(u32, u32)>, end_ns: u64) -> (Detected, bool) {
        let cut = self.cut_ns.max(self.first_ns);
        let of_rank = |l: &&ThreadLog| rank.is_none_or(|r| l.pid == r.1);
        let markers: Vec<u64> = self
            .threads
            .values()
            .filter(of_rank)
            .flat_map(|l| l.markers.iter().copied())
            .collect();
        // When no steps can be found: 1 s windows, saying why.
        let fallback = |why: &str| {
            let w = steps::windows(cut, end_ns, 1_000_000_000, format!("{why}: 1 s windows"));
            (w, false)
        };
        let found = |d: Detected| (d, true);
        match (&self.rule, rank) {
            (StepRule::Nvtx(pattern), _) => {
                let pushes: Vec<u64> = self
                    .threads
                    .values()
                    .filter(of_rank)
                    .flat_map(|l| l.nvtx.iter())
                    .filter(|(_, name)| pattern.0.is_match(name))
                    .map(|(t, _)| *t)
                    .collect();
                let re = pattern.0.as_str();
                steps::by_nvtx(&pushes, re).map_or_else(
                    || {
                        fallback(&format!(
                            "--step-nvtx {re:?}: fewer than two NVTX ranges matched"
                        ))
                    },
                    found,
                )
            }
            (StepRule::Window(w), _) => found(steps::windows(
                cut,
                end_ns,
                *w,
                format!("--step-window {w} ns"),
            )),
            // A recording made with --step-symbol holds the marker's entries.
            (StepRule::Auto, _) if !markers.is_empty() => steps::by_marker(&markers).map_or_else(
                || fallback("--step-symbol: the marker was entered fewer than twice"),
                found,
            ),
            (StepRule::Auto, Some((tid, pid))) => {
                let log = &self.threads[&tid];
                let syncs: Vec<(u64, u64)> = log
                    .history
                    .syncs
                    .iter()
                    .chain(&log.syncs)
                    .copied()
                    .collect();
                steps::detect(&self.process_collectives(pid, true), &syncs)
                    .map_or_else(|| fallback("no repeating sequence of collectives"), found)
            }
            (StepRule::Auto, None) => fallback("no collectives traced"),
        }
    }

    /// The targets that are workers of a rank, each with that rank's pid: a process that
    /// issued no collective, forked by a traced one (a DataLoader worker, another helper),
    /// works for the nearest traced ancestor that issued collectives, or, where none has
    /// yet, for the eldest traced ancestor that its environment names a rank (the workers
    /// inherit the variable, so theirs says nothing).
    pub(super) fn workers(&self) -> BTreeMap<u32, u32> {
        let issued = self.collectives_by_pid();
        let issued = |pid: u32| issued.get(&pid).copied().unwrap_or(0) > 0;
        let traced = |pid: u32| self.target_pids.contains(&pid);
        let mut out = BTreeMap::new();
        for &pid in &self.target_pids {
            if issued(pid) {
                continue;
            }
            let mut named = None;
            let mut at = pid;
            // Up the traced ancestors (a bounded walk: pids may be reused into a cycle).
            for _ in 0..self.target_pids.len() {
                let Some(&parent) = self.parents.get(&at).filter(|p| traced(**p)) else {
                    break;
                };
                if issued(parent) {
                    named = Some(parent);
                    break;
                }
                if self.env_ranks.contains_key(&parent) {
                    named = Some(parent);
                }
                at = parent;
            }
            if let Some(rank) = named {
                out.insert(pid, rank);
            }
        }
        out
    }

    /// Rank numbers of the traced processes that are not workers of another.
    pub(super) fn identities(&self) -> Vec<ranks::RankIdentity> {
        let workers = self.workers();
        let pids: Vec<u32> = self
            .target_pids
            .iter()
            .copied()
            .filter(|p| !workers.contains_key(p))
            .collect();
        let mut ids = ranks::identify(&pids, &self.init_ranks, &self.env_ranks);
        // Neither seen made nor named by its environment: its rank in its communicator,
        // read from the communicator's memory, before the order of the pids.
        let read = self.comms.ranks();
        for id in &mut ids {
            if id.rank_source == ranks::PID_ORDER
                && let Some(&r) = read.get(&id.pid)
            {
                id.rank = r;
                id.rank_source = "communicator memory".into();
            }
        }
        ids
    }
}
