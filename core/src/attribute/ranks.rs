//! Several ranks: who is who, and who makes the others wait.
//!
//! Collectives are matched per communicator: each process's communicators are numbered in
//! the order it first uses them (the handles differ between processes, and the id that
//! would name them is only visible at init), and the n-th collective on a process's k-th
//! communicator is matched with the n-th on every other rank's k-th. For each matched
//! collective the last rank to arrive makes every other rank wait from its own arrival
//! until then; those waits are charged to the last rank. The straggler is the rank charged
//! the most.
//!
//! Only ranks of one job are matched: processes that share no communicator (their
//! `ncclCommInitRank` calls, where seen, name different unique ids, [`Matcher::shares`];
//! else their environment names different jobs or rendezvous, [`Matcher::job`]) share no
//! collective, and matching them would charge one job's ranks with the other's pace. Each
//! job gets its own straggler.
//!
//! Before a job's collectives are matched, its ranks' first ones are lined up
//! ([`super::align`]): a rank the probes caught one collective earlier than the others
//! (it had not entered it when they were armed, the others had) would otherwise be
//! matched one off throughout.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

use super::Categories;
use super::align::{self, Alignment, Seen};
use super::steps::Collective;

/// How a rank's number was found.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct RankIdentity {
    pub pid: u32,
    pub rank: i32,
    /// `ncclCommInitRank`, `environment RANK` (or the variable used), `communicator memory`
    /// (its rank in its communicator, read where the library reads it), or `pid order`.
    pub rank_source: String,
}

/// NCCL traffic of a rank.
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct RankNccl {
    /// Calls that move data (collectives, send and receive), as `nccl.collectives` in
    /// summary.json counts them.
    pub collectives: u64,
    pub bytes: u64,
}

/// One rank in summary.json and steps.json.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct RankReport {
    pub pid: u32,
    pub rank: i32,
    pub rank_source: String,
    pub nccl: RankNccl,
    /// Its training-loop thread over the traced interval, ns per category.
    #[serde(rename = "categories_ns")]
    pub categories: Categories,
    /// How its collectives were lined up with the other ranks' of its job; absent where
    /// it was not matched with any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub matched: Option<String>,
}

/// The rank whose late arrivals make the others wait most.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Straggler {
    pub rank: i32,
    pub pid: u32,
    /// Share of all cross-rank waiting charged to it.
    pub share_of_waits: f64,
    /// Mean of its arrival minus the earliest arrival, over matched collectives.
    pub mean_lateness_ns: u64,
    /// The job its ranks were matched in: the least unique id of the communicators they
    /// were seen to make together (`ncclUniqueId 0x…`), and as their environment names it
    /// (a launcher's job id and rendezvous); absent where neither named one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub job: Option<String>,
}

/// One rank's cross-rank tallies so far ([`Matcher::lateness`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Lateness {
    pub pid: u32,
    /// Waits it made the others do, as the last to arrive.
    pub caused_ns: u64,
    /// Summed lateness behind the first arrival.
    pub behind_ns: u64,
    pub matched: u64,
}

/// The rank source of a process numbered by the order of the pids: nothing else named it.
pub const PID_ORDER: &str = "pid order";

/// Numbers the ranks: CommInitRank's argument when seen, else the environment, else the
/// order of the pids.
#[must_use]
pub fn identify(
    pids: &[u32],
    init_ranks: &BTreeMap<u32, i32>,
    env_ranks: &BTreeMap<u32, (String, i32)>,
) -> Vec<RankIdentity> {
    let mut sorted = pids.to_vec();
    sorted.sort_unstable();
    sorted
        .iter()
        .enumerate()
        .map(|(i, pid)| {
            let (rank, rank_source) = if let Some(r) = init_ranks.get(pid) {
                (*r, "ncclCommInitRank".to_owned())
            } else if let Some((var, r)) = env_ranks.get(pid) {
                (*r, format!("environment {var}"))
            } else {
                (i as i32, PID_ORDER.to_owned())
            };
            RankIdentity {
                pid: *pid,
                rank,
                rank_source,
            }
        })
        .collect()
}

/// Arrivals kept per rank and communicator until the other ranks reach them.
const MAX_PENDING: usize = 65_536;
/// A job's ranks are lined up on a communicator once one of them has this many
/// collectives waiting on it, whether or not their completions are known by then.
const ALIGN_BY: usize = 1_024;
/// Communicators lined up per rank (each on its own: ranks may be caught at different
/// collectives of each); the later ones are matched in order.
const ALIGNED_COMMS: usize = 4;

/// Matches collectives across ranks as they come (each rank's in the order it issued
/// them), and keeps the straggler's tallies: the same matching at any run length, in
/// memory bounded by how far the ranks are apart.
#[derive(Clone, Debug, Default)]
pub struct Matcher {
    /// Per pid: its communicators in first-use order, and each one's arrivals not yet
    /// matched.
    ranks: BTreeMap<u32, (Vec<u64>, Vec<std::collections::VecDeque<u64>>)>,
    /// Wait each pid made the others do, as the last to arrive.
    charged: BTreeMap<u32, u64>,
    /// Per pid: summed lateness behind the first arrival, and matched collectives.
    behind: BTreeMap<u32, (u64, u64)>,
    /// Per job: every wait charged in it.
    total: BTreeMap<String, u64>,
    /// The job of each pid that named one ([`Matcher::job`]); the others are one job, "".
    jobs: BTreeMap<u32, String>,
    /// The unique ids of the communicators each pid was seen to make ([`Matcher::shares`]).
    ids: BTreeMap<u32, BTreeSet<u64>>,
    /// The job of each pid with a seen id: the pids linked to it through shared ids, named
    /// by their least id (and the environment's job, where it names one).
    id_jobs: BTreeMap<u32, String>,
    /// Per pid and communicator (in first-use order) not lined up yet: its first
    /// collectives on it.
    probes: BTreeMap<(u32, usize), Vec<Seen>>,
    /// Completions are seen at CUDA synchronisations ([`Matcher::synced`]), not at the
    /// calls' returns.
    syncs_probed: bool,
    /// Per pid and communicator lined up: how.
    aligned: BTreeMap<(u32, usize), Alignment>,
    /// Jobs and communicators whose ranks are lined up.
    decided: BTreeSet<(String, usize)>,
    /// Line every job up with what it has (the run ended).
    finishing: bool,
}

impl Matcher {
    /// The job `pid` belongs to (its launcher's job id and rendezvous, as its environment
    /// names them): it is matched only with the pids of that job. Pids never named are
    /// one job together.
    pub fn job(&mut self, pid: u32, job: &str) {
        self.jobs.insert(pid, job.to_owned());
    }

    /// `pid` made a communicator of unique id `id` (its `ncclCommInitRank` seen): it is one
    /// job with every pid that made one of the same id, and with theirs in turn (tensor-
    /// and data-parallel groups link a job's ranks), apart from the pids that share none —
    /// whatever their environment says (two launches in one Slurm allocation share its job
    /// id, not their communicators).
    pub fn shares(&mut self, pid: u32, id: u64) {
        if !self.ids.entry(pid).or_default().insert(id) {
            return;
        }
        // The pids linked to `pid`, by a walk over shared ids (a job's ranks and groups:
        // few of each).
        let mut linked = BTreeSet::from([pid]);
        let mut ids = self.ids[&pid].clone();
        loop {
            let more: Vec<u32> = self
                .ids
                .iter()
                .filter(|(p, theirs)| !linked.contains(*p) && !theirs.is_disjoint(&ids))
                .map(|(p, _)| *p)
                .collect();
            if more.is_empty() {
                break;
            }
            for p in more {
                ids.extend(self.ids[&p].iter().copied());
                linked.insert(p);
            }
        }
        let least = ids.first().copied().unwrap_or(id);
        for p in linked {
            let name = match self.jobs.get(&p) {
                Some(env) => format!("{env}, ncclUniqueId {least:#018x}"),
                None => format!("ncclUniqueId {least:#018x}"),
            };
            self.id_jobs.insert(p, name);
        }
    }

    /// The job `pid` was matched in, as [`Straggler::job`] names it ("" where nothing
    /// named one).
    #[must_use]
    pub fn job_name(&self, pid: u32) -> &str {
        self.job_of(pid)
    }

    fn job_of(&self, pid: u32) -> &str {
        self.id_jobs
            .get(&pid)
            .or_else(|| self.jobs.get(&pid))
            .map_or("", String::as_str)
    }

    /// `pids` (sorted, each once) by job.
    fn by_job<'a>(&self, pids: impl Iterator<Item = &'a u32>) -> BTreeMap<String, Vec<u32>> {
        let mut out: BTreeMap<String, Vec<u32>> = BTreeMap::new();
        for pid in pids {
            out.entry(self.job_of(*pid).to_owned())
                .or_default()
                .push(*pid);
        }
        out
    }

    /// The targets' CUDA synchronisations are traced: a collective is seen complete when
    /// the first synchronisation its process began after it returns
    /// ([`Matcher::synced`]), not when its call returns (NCCL's calls return once the
    /// work is queued).
    pub fn syncs_probed(&mut self) {
        self.syncs_probed = true;
    }

    /// A CUDA synchronisation of `pid` from `start_ns` to `end_ns` (in the order they
    /// began, after the collectives that began before it).
    pub fn synced(&mut self, pid: u32, start_ns: u64, end_ns: u64) {
        for probe in self.probes.range_mut((pid, 0)..=(pid, usize::MAX)) {
            for s in probe
                .1
                .iter_mut()
                .filter(|s| s.done_ns == 0 && s.arrival_ns < start_ns)
            {
                s.done_ns = end_ns;
            }
        }
    }

    /// `pid` exited: its collectives not matched yet never will be (its peers' are matched
    /// with the other ranks' only). When the last rank of its job has gone (an elastic
    /// restart), the job's next ranks are lined up afresh.
    pub fn exited(&mut self, pid: u32) {
        self.ranks.remove(&pid);
        self.probes.retain(|k, _| k.0 != pid);
        let job = self.job_of(pid).to_owned();
        if !self.ranks.keys().any(|p| self.job_of(*p) == job) {
            self.decided.retain(|d| d.0 != job);
        }
    }

    /// The run ended: the next [`Matcher::matched`] lines every job up with what it has.
    pub fn finishing(&mut self) {
        self.finishing = true;
    }

    /// How `pid`'s collectives on its first communicator were lined up with its job's
    /// other ranks', once they were.
    #[must_use]
    pub fn alignment(&self, pid: u32) -> Option<&Alignment> {
        self.aligned.get(&(pid, 0))
    }

    /// One collective of `pid`, after the earlier ones of that pid.
    pub fn add(&mut self, pid: u32, c: &Collective) {
        let (order, queues) = self.ranks.entry(pid).or_default();
        let k = order.iter().position(|h| *h == c.comm).unwrap_or_else(|| {
            order.push(c.comm);
            queues.push(std::collections::VecDeque::new());
            order.len() - 1
        });
        queues[k].push_back(c.start_ns);
        if k < ALIGNED_COMMS && !self.aligned.contains_key(&(pid, k)) {
            let probe = self.probes.entry((pid, k)).or_default();
            if probe.len() < align::PROBE {
                probe.push(Seen {
                    func: c.func,
                    bytes: c.bytes,
                    arrival_ns: c.start_ns,
                    done_ns: if self.syncs_probed { 0 } else { c.end_ns },
                });
            }
        }
        // A rank alone (or one the others never reach) is not matched: keep only its last
        // arrivals, so that a long single-rank run does not hold every collective.
        if queues[k].len() > MAX_PENDING {
            queues[k].pop_front();
        }
    }

    /// Arrivals waiting for the other ranks, over all ranks and communicators.
    #[must_use]
    pub fn pending(&self) -> usize {
        self.ranks
            .values()
            .flat_map(|r| r.1.iter().map(std::collections::VecDeque::len))
            .sum()
    }

    /// Every collective that all ranks have now reached, matched: per collective, each
    /// pid's arrival (call entry). Nothing with fewer than two ranks.
    /// Each job's ranks are matched among themselves only.
    pub fn matched(&mut self) -> Vec<BTreeMap<u32, u64>> {
        let mut out = Vec::new();
        for (job, pids) in self.by_job(self.ranks.keys()) {
            if pids.len() < 2 {
                continue;
            }
            let comms = pids
                .iter()
                .map(|p| self.ranks[p].0.len())
                .min()
                .unwrap_or(0);
            for k in 0..comms {
                if k < ALIGNED_COMMS && !self.lined_up(&job, &pids, k) {
                    continue;
                }
                let n = pids
                    .iter()
                    .map(|p| self.ranks[p].1[k].len())
                    .min()
                    .unwrap_or(0);
                for _ in 0..n {
                    let arrivals: BTreeMap<u32, u64> = pids
                        .iter()
                        .filter_map(|p| {
                            let t = self.ranks.get_mut(p)?.1[k].pop_front()?;
                            Some((*p, t))
                        })
                        .collect();
                    self.record(&arrivals);
                    out.push(arrivals);
                }
            }
        }
        out
    }

    /// Whether `job`'s ranks (`pids`) are lined up on their `k`-th communicator. Each is
    /// aligned with the first as soon
    /// as every one has [`align::MIN_PAIRS`] collectives with their completions seen and
    /// causality allows one pairing for each (else once each has [`align::PROBE`], or
    /// many are waiting, or the run ended: in order, saying why); the ranks ahead drop
    /// the collectives the others missed. A rank of the job traced later is matched in
    /// order from its first.
    fn lined_up(&mut self, job: &str, pids: &[u32], k: usize) -> bool {
        if self.decided.contains(&(job.to_owned(), k)) {
            for pid in pids {
                if !self.aligned.contains_key(&(*pid, k)) {
                    self.probes.remove(&(*pid, k));
                    let why = "traced after the job's other ranks were lined up".to_owned();
                    self.aligned.insert((*pid, k), Alignment::ByOrder { why });
                }
            }
            return true;
        }
        let probe = |p: &u32| self.probes.get(&(*p, k)).map_or(&[][..], Vec::as_slice);
        let known = |p: &u32| probe(p).iter().filter(|s| s.done_ns != 0).count();
        if pids.iter().any(|p| known(p) < align::MIN_PAIRS) && !self.finishing {
            return false;
        }
        let reference = probe(&pids[0]).to_vec();
        let found: Vec<Alignment> = pids[1..]
            .iter()
            .map(|p| align::align(&reference, probe(p)))
            .collect();
        // Undecided (none fits, or several) while more collectives may tell: wait for
        // them, up to a full probe each with its completions, or many waiting.
        let full = pids.iter().all(|p| known(p) >= align::PROBE);
        let waiting = |p: &u32| {
            self.ranks
                .get(p)
                .and_then(|r| r.1.get(k))
                .map_or(0, std::collections::VecDeque::len)
        };
        let undecided = found.iter().any(|a| matches!(a, Alignment::ByOrder { .. }));
        if undecided && !full && !self.finishing && pids.iter().all(|p| waiting(p) < ALIGN_BY) {
            return false;
        }
        let of: Vec<Option<&Alignment>> = std::iter::once(None)
            .chain(found.iter().map(Some))
            .collect();
        for (pid, drop) in pids.iter().zip(align::dropped(&of)) {
            if let Some(q) = self.ranks.get_mut(pid).and_then(|r| r.1.get_mut(k)) {
                q.drain(..drop.min(q.len()));
            }
            self.probes.remove(&(*pid, k));
        }
        self.aligned.insert((pids[0], k), Alignment::Reference);
        self.aligned
            .extend(pids[1..].iter().map(|p| (*p, k)).zip(found));
        self.decided.insert((job.to_owned(), k));
        true
    }

    /// Charges one matched collective (each pid's arrival): the last to arrive made the
    /// others wait.
    pub fn record(&mut self, arrivals: &BTreeMap<u32, u64>) {
        let Some(first) = arrivals.values().copied().min() else {
            return;
        };
        let Some((&last_pid, &last)) = arrivals.iter().max_by_key(|(_, t)| **t) else {
            return;
        };
        let waits: u64 = arrivals.values().map(|t| last - t).sum();
        *self.charged.entry(last_pid).or_default() += waits;
        // The job's name is copied only the first time it is charged.
        let job = self
            .id_jobs
            .get(&last_pid)
            .or_else(|| self.jobs.get(&last_pid))
            .map_or("", String::as_str);
        match self.total.get_mut(job) {
            Some(total) => *total += waits,
            None => {
                self.total.insert(job.to_owned(), waits);
            }
        }
        for (pid, t) in arrivals {
            let e = self.behind.entry(*pid).or_default();
            e.0 += t - first;
            e.1 += 1;
        }
    }

    /// Per pid, so far: the waits it made the others do as the last to arrive, its summed
    /// lateness behind the first arrival, and its matched collectives.
    #[must_use]
    pub fn lateness(&self) -> Vec<Lateness> {
        self.behind
            .iter()
            .map(|(pid, (behind_ns, matched))| Lateness {
                pid: *pid,
                caused_ns: self.charged.get(pid).copied().unwrap_or(0),
                behind_ns: *behind_ns,
                matched: *matched,
            })
            .collect()
    }

    /// The rank charged the most waits so far, when at least two ranks of a job issued
    /// collectives and one made another wait, in one job only. Where several jobs have
    /// one, none: [`Matcher::stragglers`] names each job's.
    #[must_use]
    pub fn straggler(&self, ids: &[RankIdentity]) -> Option<Straggler> {
        let mut all = self.stragglers(ids);
        if all.len() == 1 { all.pop() } else { None }
    }

    /// Each job's straggler (the rank charged the most waits in it), for the jobs where at
    /// least two ranks issued collectives and one made another wait; by job.
    #[must_use]
    pub fn stragglers(&self, ids: &[RankIdentity]) -> Vec<Straggler> {
        // The pids matched so far (by [`Matcher::matched`], or handed to
        // [`Matcher::record`] directly).
        self.by_job(self.behind.keys())
            .into_iter()
            .filter_map(|(job, pids)| {
                let total = self.total.get(&job).copied().unwrap_or(0);
                let matched = pids.len();
                // Nobody made anybody wait: no straggler to name.
                if matched < 2 || total == 0 {
                    return None;
                }
                let (pid, waits) = pids
                    .iter()
                    .map(|p| (*p, self.charged.get(p).copied().unwrap_or(0)))
                    .max_by_key(|(_, w)| *w)?;
                let (sum, n) = self.behind.get(&pid).copied().unwrap_or((0, 1));
                Some(Straggler {
                    rank: ids.iter().find(|r| r.pid == pid).map_or(-1, |r| r.rank),
                    pid,
                    share_of_waits: waits as f64 / total as f64,
                    mean_lateness_ns: sum / n.max(1),
                    job: (!job.is_empty()).then_some(job),
                })
            })
            .collect()
    }
}

/// Per matched collective, each pid's arrival (call entry).
fn matched(collectives: &BTreeMap<u32, Vec<Collective>>) -> (Matcher, Vec<BTreeMap<u32, u64>>) {
    let mut m = Matcher::default();
    for (pid, cs) in collectives {
        for c in cs {
            m.add(*pid, c);
        }
    }
    m.finishing();
    let out = m.matched();
    (m, out)
}

/// The straggler, when there are at least two ranks with collectives.
#[must_use]
pub fn straggler(
    collectives: &BTreeMap<u32, Vec<Collective>>,
    ids: &[RankIdentity],
) -> Option<Straggler> {
    matched(collectives).0.straggler(ids)
}

/// The lateness entry of one matched collective, seen from `reference`: (its arrival,
/// the pid arriving last, how far behind the first that one arrived).
#[must_use]
pub fn late_entry(arrivals: &BTreeMap<u32, u64>, reference: u32) -> Option<(u64, u32, u64)> {
    let at = *arrivals.get(&reference)?;
    let first = arrivals.values().copied().min()?;
    let (pid, last) = arrivals.iter().max_by_key(|(_, t)| **t)?;
    Some((at, *pid, last - first))
}

/// Per matched collective, sorted by the reference rank's arrival: (that arrival, the pid
/// arriving last, how far behind the first it arrived). Empty with fewer than two ranks.
#[must_use]
pub fn lateness(
    collectives: &BTreeMap<u32, Vec<Collective>>,
    reference: u32,
) -> Vec<(u64, u32, u64)> {
    if collectives.len() < 2 {
        return Vec::new();
    }
    let mut out: Vec<(u64, u32, u64)> = matched(collectives)
        .1
        .iter()
        .filter_map(|arrivals| late_entry(arrivals, reference))
        .collect();
    out.sort_unstable();
    out
}

/// The rank charged the most lateness among matched collectives whose reference arrival
/// is in `[a, b)` (`lateness` as made by [`lateness`]).
#[must_use]
pub fn slowest_in(lateness: &[(u64, u32, u64)], a: u64, b: u64) -> Option<u32> {
    let lo = lateness.partition_point(|(t, _, _)| *t < a);
    let mut late: BTreeMap<u32, u64> = BTreeMap::new();
    for (_, pid, l) in lateness[lo..].iter().take_while(|(t, _, _)| *t < b) {
        *late.entry(*pid).or_default() += l;
    }
    late.into_iter().max_by_key(|(_, l)| *l).map(|(pid, _)| pid)
}

#[cfg(test)]
mod tests;
