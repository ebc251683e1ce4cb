//! Attribution in epochs: the run is attributed as it goes, not held until its end.
//!
//! Events are buffered until an epoch's worth has arrived. Steps are then found on the
//! buffer (with the tail of the earlier epochs as context, so the period search and the
//! step at the epoch's start come out as on the whole run); the steps that are closed,
//! all but the last [`LOOKAHEAD`] and all that end at least [`REORDER_NS`] before the
//! newest record, are attributed and final: their categories, every thread's time up to
//! the last one's end, the cross-rank matching and the timeline pieces. The buffer is then
//! cut there; each thread's state at the cut (on or off CPU, inside a sync, an NCCL call
//! or a fault) carries into the next epoch. A run that fits one epoch is attributed
//! exactly as a whole; docs/attribution.md says where a longer one can differ.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use super::cut::{categories, hand_over, split, step_categories, weigh_samples};
use super::steps::{Collective, Method};
use super::{
    Categories, Change, Detail, NcclCount, OffCpu, OpenOff, Step, StepRank, StepRule, StepsReport,
    ThreadDetail, ThreadLog, ThreadReport, Timeline, Unmeasured, WorkerReport, ranks, role,
};

mod build;
use build::{OFFCPU_STACK_SLACK, mark_unmeasured};

/// An epoch ends at least this long before the newest record: the recording is in time
/// order but for what was written while a drain pass ran (sub-millisecond, see
/// `source::rings`).
const REORDER_NS: u64 = 10_000_000;
/// InfiniBand readings older than this behind the newest record no longer hold the
/// epochs back: the ports stopped being read.
const IB_STALE_NS: u64 = 2_000_000_000;
/// Steps held back at an epoch's end: finding where the last ones end needs what follows.
const LOOKAHEAD: usize = 2;
/// Closed steps an epoch needs before it is attributed (else it waits for more events).
const MIN_STEPS: usize = 8;
/// Past this many epochs' worth of events, an epoch is attributed with what was found.
const FORCE_FACTOR: u64 = 16;
/// Collectives a process issues after the followed rank's exit before its rank is
/// followed as the next job's.
const SUCCESSOR_COLLECTIVES: usize = 16;
/// The tail of earlier epochs kept per thread as context.
const HISTORY_COLLECTIVES: usize = 1024;
const HISTORY_SYNCS: usize = 256;

/// One thread's totals over the epochs so far.
#[derive(Default)]
struct ThreadTotals {
    categories: Categories,
    nccl_calls: u64,
    faults: u64,
    migrations: u64,
    cross_node_migrations: u64,
}

/// What the epochs so far attributed.
#[derive(Default)]
pub(super) struct Attributed {
    /// (tid, pid) of the rank thread, fixed by the first epoch that saw collectives, until
    /// its process exits and another process's collectives follow (the next job).
    rank: Option<(u32, u32)>,
    /// The followed job, as far as it has gone.
    job: JobState,
    /// The jobs followed before it.
    jobs: Vec<super::JobReport>,
    /// Exits of traced processes attributed so far: pid → time.
    pub(super) exits: BTreeMap<u32, u64>,
    steps: Vec<Step>,
    threads: BTreeMap<u32, ThreadTotals>,
    rank_categories: BTreeMap<u32, Categories>,
    rank_nccl: BTreeMap<u32, ranks::RankNccl>,
    pub(super) matcher: ranks::Matcher,
    /// Lateness of matched collectives (see [`ranks::lateness`]) the steps to come use.
    lateness: Vec<(u64, u32, u64)>,
    detail: BTreeMap<u32, ThreadDetail>,
    calls: super::Calls,
    /// An NCCL call blocked the host (a lower bound of `nccl_wait` without sync probes).
    blocked_in_nccl: bool,
    epochs: u64,
    /// Epochs attributed and not yet taken (when they are handed on as they come).
    ready: Vec<Epoch>,
    /// Bounds of the last steps handed on that stretches still open reach back to.
    step_tail: Vec<(u64, u64)>,
    /// The last epoch is attributed.
    ended: bool,
    /// Stretches without collectives, left out of the steps.
    idle: Vec<super::Idle>,
    /// The next step's index.
    next_index: usize,
}

/// How the steps of the followed job were found, and which of them are its.
#[derive(Default)]
struct JobState {
    /// How the job's first epoch that found steps found them.
    found: Option<(Method, String, Option<usize>)>,
    /// How its last epoch looked for them, when none found any.
    fallback: Option<(Method, String, Option<usize>)>,
    /// Its steps that began before it was followed.
    left_out: usize,
    /// Its first step's index, and its epochs.
    first_index: usize,
    epochs: u64,
    /// From when it was followed (0: the run's start).
    from_ns: u64,
    /// Its rank's process exited: its steps are over, the next job's rank may be followed.
    over: bool,
}

/// One epoch's results: its steps, final, and its part of the timeline.
#[derive(Debug, Default)]
pub struct Epoch {
    pub steps: Vec<Step>,
    pub detail: Detail,
    /// The ranks' cross-rank tallies from the run's start to this epoch's end (empty
    /// with one rank).
    pub lateness: Vec<ranks::Lateness>,
}

/// Sorts `v`, in time proportional to its length and to how far its elements lie from
/// their places: a thread's changes are in time order but for the starts of calls and
/// faults, added when they end (sorting them from scratch was the most expensive step
/// of the trainer recording's attribution). Past a budget of moves (data in no order) it
/// falls back to the standard sort; the result is the same either way.
pub(super) fn sort_nearly<T: Ord + Copy>(v: &mut [T]) {
    let budget = v.len().saturating_mul(8).saturating_add(64);
    let mut moves = 0usize;
    for i in 1..v.len() {
        let x = v[i];
        if v[i - 1] <= x {
            continue;
        }
        let mut j = i;
        while j > 0 && v[j - 1] > x {
            v[j] = v[j - 1];
            j -= 1;
        }
        v[j] = x;
        moves += i - j;
        if moves > budget {
            v.sort_unstable();
            return;
        }
    }
}

impl Timeline {
    /// Attributes an epoch if enough steps closed; else tries again after more events.
    pub(super) fn try_epoch(&mut self) {
        self.try_epoch_spanning(2 * REORDER_NS);
    }

    /// As [`Timeline::try_epoch`], once the buffer spans `min_span_ns`.
    fn try_epoch_spanning(&mut self, min_span_ns: u64) {
        let force = self.buffered >= self.epoch_events.saturating_mul(FORCE_FACTOR);
        // An epoch ends REORDER_NS before the newest record: until the buffer spans twice
        // that, most of it would be held back and searched again at the next try (with
        // µs-long steps, 10 ms is thousands of them).
        let span = self.last_ns.saturating_sub(self.cut_ns.max(self.first_ns));
        if !force && span < min_span_ns {
            self.next_try = self.buffered.saturating_add(self.epoch_events);
            return;
        }
        if self.epoch(None, force) {
            self.buffered = 0;
            self.next_try = self.epoch_events;
        } else {
            // Again once the buffer has grown by half: long steps (thousands of events
            // each) do not make every try search the whole buffer again.
            let more = self.epoch_events.max(self.buffered / 2);
            self.next_try = self.buffered.saturating_add(more);
        }
    }

    /// Tries an epoch now, with what is buffered, once the first has been attributed (the
    /// step period is then known): for a run that went quiet.
    pub fn try_epoch_now(&mut self) {
        if self.epoch_events > 0 && self.buffered > 0 && self.done.epochs > 0 {
            // No waiting for the buffer to span more: no more records may come.
            self.caught_up = true;
            self.try_epoch_spanning(0);
            self.caught_up = false;
        }
    }

    /// Attributes the buffer up to the end of its last closed step (up to `end` when it
    /// is the run's end) and cuts it there. False when nothing could be attributed yet.
    /// Where the followed rank's process exited, its job's last steps are attributed up to
    /// the exit first, and the next job's rank is followed from there.
    pub(super) fn epoch(&mut self, end: Option<u64>, force: bool) -> bool {
        let cut = self.cut_ns.max(self.first_ns);
        let rank = self.done.rank.or_else(|| {
            // Chosen by collectives counted in time order.
            self.sort_logs();
            self.choose_rank()
        });
        let exit = rank.and_then(|(_, pid)| Some((pid, self.exit_of(pid)?)));
        if let Some((pid, x)) = exit.filter(|_| !self.done.job.over) {
            if x <= cut {
                // Passed with no other job's collectives after it then.
                self.done.job.over = true;
            } else if match end {
                // Its steps are final at once (none can follow); at the run's end, the
                // last epoch does that unless another job's steps come after.
                None => self.caught_up || x.saturating_add(REORDER_NS) <= self.last_ns,
                Some(_) => self.successor(pid, x).is_some(),
            } {
                self.epoch_to(Some(x), true, true);
                self.done.job.over = true;
                if end.is_none() {
                    return true;
                }
            }
        }
        self.epoch_to(end, force, false)
    }

    /// When `pid` exited, where its exit was seen.
    pub(super) fn exit_of(&self, pid: u32) -> Option<u64> {
        let pending = self.exited.iter().filter(|e| e.1 == pid).map(|e| e.0).min();
        self.done.exits.get(&pid).copied().or(pending)
    }

    /// After the followed rank's process exited: the process with the most collectives
    /// from `after` on, its exit not seen where one's is not (the next job), and its
    /// training-loop thread.
    fn successor(&self, old: u32, after: u64) -> Option<(u32, u32)> {
        // Not another rank of its job (its last collectives, after the rank's exit).
        let job = self.done.matcher.job_name(old);
        let other =
            |pid: u32| pid != old && (job.is_empty() || self.done.matcher.job_name(pid) != job);
        let mut per_pid: BTreeMap<u32, usize> = BTreeMap::new();
        for log in self.threads.values().filter(|l| other(l.pid)) {
            let from = log.collectives.partition_point(|c| c.start_ns < after);
            *per_pid.entry(log.pid).or_default() += log.collectives.len() - from;
        }
        let pid = per_pid
            .into_iter()
            // A few trailing collectives are no job's steps yet.
            .filter(|(_, n)| *n >= SUCCESSOR_COLLECTIVES)
            .max_by_key(|(pid, n)| {
                let running = self.exit_of(*pid).is_none();
                (running, *n, std::cmp::Reverse(*pid))
            })?
            .0;
        Some((self.loop_thread(pid)?, pid))
    }

    /// Follows `next`, the next job's rank: the job followed so far is done.
    fn next_job(&mut self, next: (u32, u32), cut: u64) {
        self.close_job();
        self.done.rank = Some(next);
        self.done.job = JobState {
            first_index: self.done.next_index,
            from_ns: cut,
            ..JobState::default()
        };
    }

    /// Adds the followed job, if a rank was followed, to the jobs done.
    fn close_job(&mut self) {
        if let Some(rank) = self.done.rank {
            let job = std::mem::take(&mut self.done.job);
            let report = self.job_report(rank, job);
            self.done.jobs.push(report);
        }
    }

    /// What `job`, of the rank `rank`, came to.
    fn job_report(&self, rank: (u32, u32), job: JobState) -> super::JobReport {
        let (method, mut reason, period) =
            job.found
                .or(job.fallback)
                .unwrap_or((Method::Window, String::new(), None));
        if job.epochs > 1 {
            // The detection's counts are the job's first epoch's, not all of its.
            reason = reason.replace(" occurrences)", " occurrences in the first epoch)");
        }
        let name = self.done.matcher.job_name(rank.1);
        super::JobReport {
            rank_pid: rank.1,
            rank_tid: rank.0,
            job: (!name.is_empty()).then(|| name.to_owned()),
            method,
            reason,
            period,
            first_step: job.first_index,
            steps: self.done.next_index.saturating_sub(job.first_index),
            followed_from_ns: job.from_ns.max(self.first_ns),
            exited_ns: self.exit_of(rank.1),
            steps_left_out: job.left_out,
        }
    }

    /// [`Timeline::epoch`]'s work; `job_end`: `end` is the exit of the followed rank's
    /// process, its steps end there and the records after it wait for the next epoch.
    fn epoch_to(&mut self, end: Option<u64>, force: bool, job_end: bool) -> bool {
        let last = match end {
            Some(e) if job_end => e,
            _ => end.map_or(self.last_ns, |e| e.max(self.last_ns)),
        };
        self.sort_logs();
        let cut = self.cut_ns.max(self.first_ns);
        if self.done.job.over
            && let Some((_, old)) = self.done.rank
            && let Some(next) = self.successor(old, cut)
        {
            self.next_job(next, cut);
        }
        // Fixed by the first epoch attributed, not by a try that found too few steps.
        let rank = self.done.rank.or_else(|| self.choose_rank());
        let (detected, found) = self.detect(rank, last);
        // The job's first epoch: steps that began before it was followed (before tracing
        // was armed, for the run's first) are not traced whole.
        let left_out = if self.done.job.epochs == 0 {
            detected.bounds.iter().filter(|(a, _)| *a < cut).count()
        } else {
            0
        };
        let mut bounds: Vec<(u64, u64)> = if !found && self.done.job.found.is_some() {
            // Steps were found before but not in this stretch (the run's short tail):
            // no windows mixed in among them.
            Vec::new()
        } else {
            detected
                .bounds
                .iter()
                .copied()
                .filter(|(a, _)| *a >= cut)
                .collect()
        };
        let until = if end.is_some() {
            last
        } else {
            let mut horizon = last.saturating_sub(REORDER_NS);
            // A step's InfiniBand counters are interpolated from the readings around its
            // end: wait for the next reading (unless the readings stopped).
            if let Some(read) = self.infiniband.horizon()
                && read.saturating_add(IB_STALE_NS) >= last
            {
                horizon = horizon.min(read);
            }
            // So are its counted loads: up to their latest full reading (the run's start
            // until the first comes).
            if self.node_counters.is_some() {
                let read = self.node_loads_latest.unwrap_or(self.first_ns);
                if read.saturating_add(IB_STALE_NS) >= last {
                    horizon = horizon.min(read);
                }
            }
            bounds.retain(|(_, b)| *b <= horizon);
            bounds.truncate(bounds.len().saturating_sub(LOOKAHEAD));
            if !force && (!found || bounds.len() < MIN_STEPS) {
                return false;
            }
            match bounds.last() {
                Some(b) => b.1,
                None => horizon,
            }
        };
        if until <= cut && end.is_none() {
            return false;
        }
        self.done.rank = rank;
        self.join_at_cut(&mut bounds, cut);
        let idle = self.idle_in(rank, found, &mut bounds, cut, until, end.is_some());
        let job = &mut self.done.job;
        if found {
            job.found
                .get_or_insert((detected.method, detected.reason, detected.period));
        } else {
            let reason = if bounds.is_empty() {
                format!(
                    "{}; the rank issued no collective: idle, not steps (steps.json idle)",
                    detected.reason.trim_end_matches(": 1 s windows")
                )
            } else {
                detected.reason
            };
            job.fallback = Some((detected.method, reason, detected.period));
        }
        job.left_out += left_out;
        job.epochs += 1;
        self.attribute(cut, until, &bounds, idle);
        self.trim(until);
        self.cut_ns = until;
        self.done.epochs += 1;
        true
    }

    /// The stretches of `[cut, until)` in which the rank issued no collectives, to be told
    /// apart from the steps: the whole stretch where no steps were found in it and it
    /// has none (its fallback windows dropped from `bounds`); where steps were found, a
    /// stretch without collectives before the run's first step or after its last (`end`)
    /// longer than two of its steps.
    fn idle_in(
        &self,
        rank: Option<(u32, u32)>,
        found: bool,
        bounds: &mut Vec<(u64, u64)>,
        cut: u64,
        until: u64,
        end: bool,
    ) -> Vec<(u64, u64, &'static str)> {
        let first_step = self.done.next_index == self.done.job.first_index;
        // Before the first event the probes were not armed yet: not seen idle.
        let cut = if first_step {
            self.first_event_ns.map_or(cut, |t| t.clamp(cut, until))
        } else {
            cut
        };
        let colls = rank.map_or_else(Vec::new, |(_, pid)| self.process_collectives(pid, false));
        let quiet = |a: u64, b: u64| !colls.iter().any(|c| (a..b).contains(&c.start_ns));
        if !found {
            // Before any step was found, collectives that repeat as no step does are cut
            // in 1 s windows, the run's fallback. Once steps were found, such a stretch is
            // not one of them (no windows among them): like a pause, with its collectives.
            if !quiet(cut, until) && !bounds.is_empty() {
                return Vec::new();
            }
            bounds.clear();
            let when = match (first_step, end) {
                (true, true) if self.done.job.found.is_none() && self.done.jobs.is_empty() => {
                    "the whole run: no step"
                }
                (true, true) if self.done.job.found.is_none() => "the whole job: no step",
                (true, _) => "before the first step",
                (false, true) => "after the last step",
                (false, false) => "between steps",
            };
            return vec![(cut, until, when)];
        }
        let (Some(&(first, _)), Some(&(_, last))) = (bounds.first(), bounds.last()) else {
            return Vec::new();
        };
        let mut walls: Vec<u64> = bounds.iter().map(|(a, b)| b.saturating_sub(*a)).collect();
        walls.sort_unstable();
        let median = walls[walls.len() / 2];
        let long = 2u64.saturating_mul(median);
        let pauses = pauses_between(bounds, &colls, median, first_step);
        let mut out = Vec::new();
        // Up to the first collective (the first step's may begin before its bound), from
        // the last one's return.
        let first = colls
            .first()
            .map_or(first, |c| c.start_ns.min(first))
            .max(cut);
        let last = colls.last().map_or(last, |c| c.end_ns.max(last)).min(until);
        if first_step && first.saturating_sub(cut) > long {
            out.push((cut, first, "before the first step"));
        }
        out.extend(pauses);
        if end && until.saturating_sub(last) > long && quiet(last, until) {
            out.push((last, until, "after the last step"));
        }
        out
    }

    /// Adds `stretches` (attributed) to the idle ones with the rank thread's categories in
    /// each; one that continues the previous extends it.
    fn record_idle(&mut self, stretches: Vec<(u64, u64, &'static str)>) {
        for (a, b, when) in stretches {
            let collectives = self.done.rank.map_or(0, |(_, pid)| {
                self.threads
                    .values()
                    .filter(|l| l.pid == pid)
                    .flat_map(|l| &l.collectives)
                    .filter(|c| (a..b).contains(&c.start_ns))
                    .count() as u64
            });
            let (categories, (faults, pages)) = self
                .done
                .rank
                .and_then(|(tid, _)| Some((tid, self.threads.get(&tid)?)))
                .map(|(tid, log)| {
                    let moved = self.faults_and_page_moves(log, tid, a, b);
                    (super::cut::categories(log, a, b), moved)
                })
                .unwrap_or_default();
            match self.done.idle.last_mut() {
                // The run's start and its end met: one stretch, named by the later.
                Some(last) if last.end_ns == a => {
                    last.when = when;
                    last.end_ns = b;
                    last.wall_ns = b.saturating_sub(last.start_ns);
                    last.categories.add(&categories);
                    last.faults += faults;
                    last.numa_page_migrations += pages;
                    last.collectives += collectives;
                }
                _ => self.done.idle.push(super::Idle {
                    start_ns: a,
                    end_ns: b,
                    wall_ns: b.saturating_sub(a),
                    when,
                    categories,
                    faults,
                    numa_page_migrations: pages,
                    collectives,
                    top_stacks: Vec::new(),
                    stack_ns: BTreeMap::new(),
                }),
            }
        }
    }

    /// Adds the rank thread's stacks in `detail` (one epoch's) to the idle stretches they
    /// fall in: on-CPU samples by their weight, off-CPU stretches by their overlap.
    fn weigh_idle(&mut self, detail: &Detail) {
        let Some(t) = detail
            .rank_tid
            .and_then(|tid| detail.threads.iter().find(|t| t.tid == tid))
        else {
            return;
        };
        for idle in &mut self.done.idle {
            let (a, b) = (idle.start_ns, idle.end_ns);
            for &(ts, stack, _, weight) in &t.samples {
                if (a..b).contains(&ts) {
                    *idle.stack_ns.entry((stack, 0)).or_default() += weight;
                }
            }
            for off in &t.offcpu {
                let overlap = off.end_ns.min(b).saturating_sub(off.start_ns.max(a));
                if let (Some(stack), true) = (off.stack, overlap > 0) {
                    let kind = if off.runnable { 1 } else { 2 };
                    *idle.stack_ns.entry((stack, kind)).or_default() += overlap;
                }
            }
        }
    }

    /// In an epoch after the first, the step that starts at the cut when detection on this
    /// epoch's events found the next one only (a gap of about a step before its first).
    fn join_at_cut(&self, bounds: &mut Vec<(u64, u64)>, cut: u64) {
        let Some(&(first, _)) = bounds.first() else {
            return;
        };
        if self.done.next_index == self.done.job.first_index || first <= cut {
            return;
        }
        let mut walls: Vec<u64> = bounds.iter().map(|(a, b)| b - a).collect();
        walls.sort_unstable();
        let median = walls[walls.len() / 2];
        if first - cut <= 2 * median {
            bounds.insert(0, (cut, first));
        }
    }

    /// Sorts what attribution searches by time, and weighs fault samples.
    fn sort_logs(&mut self) {
        let period = self.sample_period_ns;
        self.page_migrations.sort_unstable_by_key(|m| m.1);
        self.numa_moves.sort_unstable_by_key(|m| m.1);
        self.infiniband.sort();
        for log in self.threads.values_mut() {
            log.numa_hints.sort_unstable_by_key(|h| h.ts_ns);
            log.mem_samples.sort_unstable_by_key(|s| s.time_ns);
            log.node_loads.sort_unstable_by_key(|r| r.ts_ns);
            log.resident.sort_unstable_by_key(|r| r.ts_ns);
            log.nodes.sort_unstable_by_key(|n| n.0);
            sort_nearly(&mut log.changes);
            log.syncs.sort_unstable();
            log.collectives.sort_by_key(|c| c.start_ns);
            log.faults.sort_unstable();
            log.driver_yields.sort_unstable();
            log.wakeups.sort_unstable();
            log.call_stacks.sort_unstable();
            log.offcpu_stacks.sort_unstable();
            log.migrations.sort_unstable_by_key(|m| m.0);
            // Timed faults: only the samples outside the timed pieces count (see
            // `cut::categories`), the return to user mode that no probe sees.
            log.fault_time = weigh_samples(log, period);
            log.fault_time.sort_unstable();
        }
    }

    /// Every thread's pieces, the steps in `bounds`, the `idle` stretches and the totals over
    /// `[cut, until)`.
    fn attribute(
        &mut self,
        cut: u64,
        until: u64,
        bounds: &[(u64, u64)],
        idle: Vec<(u64, u64, &'static str)>,
    ) {
        // NCCL outstanding is a property of the process: collectives from any thread.
        // Collectives of one-rank communicators are local copies: not NCCL outstanding.
        let mut collective_ends: BTreeMap<u32, Vec<u64>> = BTreeMap::new();
        for log in self.threads.values() {
            collective_ends.entry(log.pid).or_default().extend(
                log.history
                    .collectives
                    .iter()
                    .chain(&log.collectives)
                    .filter(|c| !self.comms.one_rank(log.pid, c.comm))
                    .map(|c| c.end_ns),
            );
        }
        for ends in collective_ends.values_mut() {
            ends.sort_unstable();
        }
        // A thread first seen in this epoch is attributed from the run's start, as if the
        // run were one epoch (its state before then follows from its first switch).
        let mut from = BTreeMap::new();
        let mut handed = BTreeMap::new();
        for (tid, log) in &mut self.threads {
            let ends = collective_ends.get(&log.pid).map_or(&[][..], Vec::as_slice);
            let a = if log.carry.is_some() {
                cut
            } else {
                self.first_ns
            };
            let mut segments = Vec::new();
            let mut hands = Vec::new();
            let state = split(log, ends, a, until, &mut segments, &mut hands);
            log.segments = segments;
            if !hands.is_empty() {
                handed.insert(*tid, hands);
            }
            log.carry = Some(state);
            // Untimed faults are measured between those back to back: paired once sorted
            // (records come per CPU, not in time order).
            log.faults_untimed =
                !self.faults_timed && self.sample_period_ns > 0 && !self.fault_ranges.is_empty();
            if log.faults_untimed {
                log.fault_pairs = log
                    .faults
                    .windows(2)
                    .filter(|w| w[0].1.abs_diff(w[1].1) <= super::BACK_TO_BACK_BYTES)
                    .filter(|w| w[1].0 - w[0].0 < super::LONG_GAP_NS)
                    .map(|w| (w[0].0, w[1].0))
                    .collect();
                self.fault_pairs_seen |= !log.fault_pairs.is_empty();
            }
            from.insert(*tid, a);
        }
        self.match_ranks(until);
        // Who is who, once for the epoch: the counts they follow do not change in it.
        let identities = self.identities();
        let loop_threads: BTreeMap<u32, u32> = identities
            .iter()
            .filter_map(|id| self.loop_thread(id.pid).map(|tid| (id.pid, tid)))
            .collect();
        // The training loops' waits for their own process's threads (not a helper's
        // sleep that another thread ends: a heartbeat's).
        handed.retain(|tid, _| {
            loop_threads.values().any(|t| t == tid) || self.done.rank.is_some_and(|r| r.0 == *tid)
        });
        hand_over(&mut self.threads, &handed);
        // Each process's collectives of the epoch, gathered once for the steps and totals.
        let pids = identities
            .iter()
            .map(|id| id.pid)
            .chain(self.done.rank.map(|r| r.1))
            .collect();
        let (colls, lent) = self.lend_collectives(&pids);
        // The totals first: they say what the run could not measure, which steps handed
        // on now carry.
        self.totals(&from, until, &identities, &loop_threads, &colls);
        let steps = self.steps(bounds, &identities, &loop_threads, &colls);
        self.give_back(colls, lent);
        self.done.next_index += steps.len();
        self.settle_blocks(until, &loop_threads);
        self.record_idle(idle);
        let emit = self.emit;
        let detail = self.epoch_detail(cut, until, emit);
        self.weigh_idle(&detail);
        self.keep_or_emit(steps, detail, emit);
        self.done.lateness.retain(|(at, _, _)| *at >= until);
    }

    /// Drops what is attributed: everything before `until` but the state it leaves and
    /// a bounded tail as context.
    fn trim(&mut self, until: u64) {
        let keep = |ts: u64| ts >= until;
        self.page_migrations.retain(|m| keep(m.1));
        self.numa_moves.retain(|m| keep(m.1));
        self.infiniband.trim(until);
        self.gpu.trim(until);
        for log in self.threads.values_mut() {
            let block = log
                .pending_block
                .map(|(since, _)| (since, Change::SwitchOut { runnable: false }));
            log.changes.retain(|c| keep(c.0) || Some(*c) == block);
            let old = take_where(&mut log.syncs, |s| s.1 <= until);
            tail(&mut log.history.syncs, &old, HISTORY_SYNCS);
            let moved = log.collectives.partition_point(|c| c.start_ns < until);
            tail(
                &mut log.history.collectives,
                &log.collectives[..moved],
                HISTORY_COLLECTIVES,
            );
            log.collectives.drain(..moved);
            log.fed = log.fed.saturating_sub(moved);
            log.fault_samples.retain(|s| keep(s.0));
            log.driver_yields.retain(|t| keep(t.0));
            log.fault_time.clear();
            log.faults.retain(|f| keep(f.0));
            log.fault_pairs.clear();
            log.migrations.retain(|m| keep(m.0));
            log.migration_cpus.retain(|m| keep(m.0));
            log.stack_samples.retain(|s| keep(s.0));
            log.offcpu_stacks
                .retain(|s| keep(s.0) || s.0 + OFFCPU_STACK_SLACK >= until);
            log.call_stacks.retain(|s| keep(s.0));
            log.wakeups.retain(|w| keep(w.0));
            log.markers.retain(|t| keep(*t));
            log.nvtx.retain(|n| keep(n.0));
            log.mem_samples.retain(|s| keep(s.time_ns));
            super::remote::trim_loads(&mut log.node_loads, until);
            // The latest resident reading and node before the cut stay: later steps use them.
            let before = log.resident.partition_point(|r| r.ts_ns < until);
            log.resident.drain(..before.saturating_sub(1));
            let before = log.nodes.partition_point(|n| n.0 < until);
            log.nodes.drain(..before.saturating_sub(1));
            // The latest hinting faults stay: a quiet step's estimate looks back at them.
            let before = log.numa_hints.partition_point(|h| h.ts_ns < until);
            log.numa_hints
                .drain(..before.saturating_sub(super::remote::CONTEXT_HINTS));
        }
    }

    /// Attributes the last epoch: the run ended at `end_ns`. Once; [`Timeline::finish`]
    /// does it when not done before.
    pub fn end(&mut self, end_ns: u64, rule: StepRule) {
        if self.done.ended {
            return;
        }
        if self.done.epochs == 0 {
            self.rule = rule;
        }
        let end_ns = end_ns.max(self.last_ns);
        self.epoch(Some(end_ns), true);
        self.done.ended = true;
    }

    /// What the run could not measure, as far as it has gone.
    fn unmeasured(&self) -> Unmeasured {
        Unmeasured {
            nccl_wait: !self.sync_probed && !self.done.blocked_in_nccl,
            nccl_wait_lower_bound: !self.sync_probed && self.done.blocked_in_nccl,
            page_fault: !self.faults_timed
                && (self.sample_period_ns == 0 || self.fault_ranges.is_empty()),
        }
    }

    /// The epochs attributed since the last call, when they are handed on as they come
    /// ([`Timeline::emit_epochs`]): their steps and timeline are then not kept here.
    pub fn take_epochs(&mut self) -> Vec<Epoch> {
        std::mem::take(&mut self.done.ready)
    }

    /// Epochs attributed so far.
    #[cfg(test)]
    pub(super) fn epochs_done(&self) -> u64 {
        self.done.epochs
    }

    /// Whether epochs wait to be taken ([`Timeline::take_epochs`]).
    #[must_use]
    pub fn has_epochs(&self) -> bool {
        !self.done.ready.is_empty()
    }

    /// Attributes what is left (the run ended at `end_ns`) and returns the run's reports.
    #[must_use]
    pub fn finish(mut self, end_ns: u64, rule: StepRule) -> (StepsReport, Detail) {
        self.done.matcher.finishing();
        self.end(end_ns, rule);
        let end_ns = end_ns.max(self.last_ns);
        let rank = self.done.rank;
        let identities = self.identities();
        let unmeasured = self.unmeasured();
        let mut steps_out = std::mem::take(&mut self.done.steps);
        mark_unmeasured(&mut steps_out, unmeasured);
        let (ranks_out, threads) = self.reports(&identities, unmeasured);
        let workers = self.worker_reports(&identities, &threads);
        let straggler = self.done.matcher.straggler(&identities);
        let mut stragglers_by_job = self.done.matcher.stragglers(&identities);
        if stragglers_by_job.len() < 2 {
            stragglers_by_job.clear();
        }
        self.close_job();
        let jobs = std::mem::take(&mut self.done.jobs);
        // The run's method and rank are its first job's that found steps (the one job of
        // most runs).
        let first = jobs
            .iter()
            .find(|j| j.method != Method::Window || j.steps > 0)
            .or(jobs.first());
        let (method, mut reason, period) = first.map_or_else(
            || {
                let job = &self.done.job;
                job.found
                    .clone()
                    .or_else(|| job.fallback.clone())
                    .unwrap_or((Method::Window, String::new(), None))
            },
            |j| (j.method, j.reason.clone(), j.period),
        );
        let left_out = jobs.first().map_or(0, |j| j.steps_left_out);
        if left_out > 0 {
            let _ = write!(
                reason,
                "; {left_out} step(s) that began before tracing was armed are left out (not \
                 traced whole)"
            );
        }
        let rank = first.map_or(rank, |j| Some((j.rank_tid, j.rank_pid)));
        let detail = Detail {
            first_ns: self.first_ns,
            end_ns,
            threads: std::mem::take(&mut self.done.detail)
                .into_values()
                .collect(),
            stacks: std::mem::take(&mut self.stacks),
            calls: std::mem::take(&mut self.done.calls),
            cpu_nodes: self.cpu_nodes.clone(),
            sample_period_ns: self.sample_period_ns,
            offcpu_min_ns: self.offcpu_min_ns,
            step_bounds: steps_out.iter().map(|s| (s.start_ns, s.end_ns)).collect(),
            rank_tid: rank.map(|r| r.0),
            rank_pid: rank.map(|r| r.1),
        };
        let report = StepsReport {
            partial_steps_left_out: left_out,
            clock: "every *_ns timestamp (start_ns, end_ns) is CLOCK_MONOTONIC of the traced \
                    host in ns; summary.json's start_unix_ns is the wall-clock time (ns since \
                    1970) of the recording's start, duration_ns counted from it",
            method,
            reason,
            period,
            rank_pid: rank.map(|r| r.1),
            rank_tid: rank.map(|r| r.0),
            jobs,
            epochs: self.done.epochs,
            late_events_left_out: self.late_events,
            methods: self.methods(unmeasured),
            steps: steps_out,
            threads,
            other_offcpu_top_stacks: Vec::new(),
            nccl_wait_top_stacks: Vec::new(),
            gpu_wait_top_stacks: Vec::new(),
            ranks: ranks_out,
            communicators: self.comms.report(),
            idle: std::mem::take(&mut self.done.idle),
            workers,
            one_rank_jobs: self.comms.alone(),
            straggler,
            stragglers_by_job,
        };
        (report, detail)
    }
}

/// A pause between steps is idle from this long on, or ten median steps if longer: a
/// stall of the step's own (its data late) is part of it; an evaluation or a checkpoint
/// is not.
const PAUSE_MIN_NS: u64 = 1_000_000_000;

/// The pauses between the steps in `bounds` (evaluation, a checkpoint): a step whose first
/// collective comes a pause later after its start than the steps' median lead starts that
/// median lead before it (its bound moved), and the stretch before it is idle. The first
/// step of the run is left to the stretch before it.
fn pauses_between(
    bounds: &mut [(u64, u64)],
    colls: &[Collective],
    median_wall: u64,
    first_step: bool,
) -> Vec<(u64, u64, &'static str)> {
    let lead = |&(a, b): &(u64, u64)| {
        let i = colls.partition_point(|c| c.start_ns < a);
        colls
            .get(i)
            .filter(|c| c.start_ns < b)
            .map(|c| c.start_ns - a)
    };
    let mut leads: Vec<u64> = bounds.iter().filter_map(lead).collect();
    if leads.is_empty() {
        return Vec::new();
    }
    leads.sort_unstable();
    let usual = leads[leads.len() / 2];
    let pause = PAUSE_MIN_NS.max(median_wall.saturating_mul(10));
    let mut out = Vec::new();
    for (i, bound) in bounds.iter_mut().enumerate() {
        if i == 0 && first_step {
            continue;
        }
        if let Some(l) = lead(bound)
            && l > usual.saturating_add(pause)
        {
            let start = bound.0 + (l - usual);
            out.push((bound.0, start, "between steps"));
            bound.0 = start;
        }
    }
    out
}

/// Appends `old` to a tail kept at most `max` long.
/// Moves the items of `v` that `pred` picks into a vector of their own, in order; `v`
/// keeps the others, with room for as many as it gave (it fills again each epoch:
/// regrowing it from nothing cost a copy of every item a few times over).
fn take_where<T>(v: &mut Vec<T>, mut pred: impl FnMut(&T) -> bool) -> Vec<T> {
    let k = v.iter().position(|x| !pred(x)).unwrap_or(v.len());
    if v[k..].iter().all(|x| !pred(x)) {
        // The usual case, those picked first: the buffer goes with them, the few kept
        // are copied into a new one, with room for half as many again as the buffer held
        // (with room for as many, the next epoch's buffer was a little longer each time:
        // on a run of 300,000 one-call steps, a copy of the whole buffer every epoch).
        let mut kept = Vec::with_capacity(v.len() + v.len() / 2);
        kept.extend(v.drain(k..));
        return std::mem::replace(v, kept);
    }
    let n = v.iter().filter(|x| pred(x)).count();
    let mut taken = Vec::with_capacity(n);
    taken.extend(v.extract_if(.., |x| pred(x)));
    taken
}

/// Keeps the last `max` of `kept` followed by `old` in `kept` (only the last `max` of
/// `old` are copied: an epoch of one-call steps moves thousands out).
fn tail<T: Copy>(kept: &mut Vec<T>, old: &[T], max: usize) {
    kept.extend_from_slice(&old[old.len().saturating_sub(max)..]);
    if kept.len() > max {
        kept.drain(..kept.len() - max);
    }
}

#[cfg(test)]
mod take_tests {
    /// The last `max` of what was kept and what was moved out, in order.
    #[test]
    fn tail_keeps_the_last() {
        for (kept, old, want) in [
            (vec![1, 2], vec![3], vec![1, 2, 3]),
            (vec![1, 2], vec![3, 4, 5], vec![3, 4, 5]),
            (vec![1, 2], (3..10).collect(), vec![7, 8, 9]),
            (vec![], vec![], vec![]),
            (vec![1, 2, 3, 4], vec![], vec![2, 3, 4]),
        ] {
            let mut kept = kept;
            super::tail(&mut kept, &old, 3);
            assert_eq!(kept, want);
        }
    }

    #[test]
    fn take_where_keeps_order_and_room() {
        // Picked first (the usual case), interleaved, none, all.
        for (v, picked, kept) in [
            (vec![1, 2, 3, 10, 11], vec![1, 2, 3], vec![10, 11]),
            (vec![1, 10, 2, 11, 3], vec![1, 2, 3], vec![10, 11]),
            (vec![10, 11], vec![], vec![10, 11]),
            (vec![1, 2], vec![1, 2], vec![]),
        ] {
            let mut v = v;
            let taken = super::take_where(&mut v, |x| *x < 10);
            assert_eq!((taken.clone(), v.clone()), (picked, kept));
            assert!(v.capacity() >= taken.len() + v.len());
        }
    }
}
