//! Cutting one thread's time into categorized pieces: the state machine of the rules in
//! the module docs, run over the thread's changes in time order.

use std::collections::BTreeSet;

use super::{Cat, Categories, Change, ThreadLog};

/// `[a, b)` of one thread by category: its pieces clipped to the interval, page faults
/// (on-CPU samples in the fault handler or on the instruction that just faulted, outside
/// GPU and NCCL waits and timed faults) and remote-memory stalls carved out of compute
/// (measured ones taken while spinning in a sync out of nccl_wait, then gpu_wait).
pub(super) fn categories(log: &ThreadLog, a: u64, b: u64) -> Categories {
    categories_with(log, a, b, false)
}

/// As [`categories`], for a step: where faults are not timed, those back to back are
/// measured between them ([`fault_estimate`]). Totals and idle stretches, summed over
/// epochs, keep the samples' estimate, which adds up across them (a step is attributed
/// whole in one epoch: its figure is the same however the run is cut).
pub(super) fn step_categories(log: &ThreadLog, a: u64, b: u64) -> Categories {
    categories_with(log, a, b, true)
}

fn categories_with(log: &ThreadLog, a: u64, b: u64, step: bool) -> Categories {
    let mut cat = Categories::default();
    let segs = &log.segments;
    let first = segs.partition_point(|(_, e, _)| *e <= a);
    for (s, e, c) in &segs[first..] {
        if *s >= b {
            break;
        }
        *cat.slot(*c) += (*e).min(b).saturating_sub((*s).max(a));
    }
    // Untimed faults: those back to back measured between them, the others at their
    // mean (a sample every 10 ms lands in few steps' faults); else the samples.
    let fault_ns = match fault_estimate(log, a, b).filter(|_| step) {
        Some((ns, _)) => ns,
        None => sampled_fault_ns(log, a, b).0,
    };
    let fault_ns = fault_ns.min(cat.compute);
    cat.page_fault += fault_ns;
    cat.compute -= fault_ns;
    // The CUDA driver yielding the CPU outside a sync waits for the GPU (room in a full
    // launch queue): each such sample of compute time, a period of it.
    let yields = driver_yield_ns(log, a, b).min(cat.compute);
    cat.gpu_wait += yields;
    cat.compute -= yields;
    // Remote-memory stalls, measured from PMU load samples or estimated from hinting
    // faults, are carved out of what is left of compute (never added on top: the
    // categories keep summing to wall time). Measured loads the thread stalled on while
    // it spun waiting for NCCL (polling memory the GPU writes, which may lie on the far
    // node) are carved out of nccl_wait instead: the sample's time says which.
    let (stall, wait_stall) = match log.mem_khz {
        Some(khz) => {
            let period = crate::pmu::SAMPLE_PERIOD;
            let waiting = |s: &crate::pmu::MemSample| {
                matches!(
                    category_at(segs, s.time_ns),
                    Some(Cat::NcclWait | Cat::GpuWait)
                )
            };
            let samples = &log.mem_samples;
            let measured = |waited: bool| {
                crate::pmu::measure_where(samples, a, b, period, |s| waiting(s) == waited)
                    .stall_ns(khz)
            };
            (measured(false), measured(true))
        }
        None => (
            log.remote_access(a, b)
                .and_then(|r| r.stall_ns(cat.compute)),
            None,
        ),
    };
    if let Some(stall) = stall {
        let stall = stall.min(cat.compute);
        // Spinning for NCCL first, then for the GPU's own work.
        let waited = wait_stall.unwrap_or(0).min(cat.nccl_wait + cat.gpu_wait);
        let from_nccl = waited.min(cat.nccl_wait);
        cat.compute -= stall;
        cat.nccl_wait -= from_nccl;
        cat.gpu_wait -= waited - from_nccl;
        cat.remote_memory = Some(stall + waited);
    }
    cat
}

/// Cuts `[a, b)` of one thread into (start, end, category) pieces, adjacent pieces of
/// one category merged (page faults are not carved out here: they come from samples).
/// Starts from the state the previous epoch left (or, in the first, the one the thread's
/// first switch implies); returns the state at `b`, for the next. `handed` gets the
/// stretches it was blocked until another thread of its process woke it (`compute` in
/// `segments` until [`hand_over`] gives them that thread's categories).
pub(super) fn split(
    log: &ThreadLog,
    collective_ends: &[u64],
    a: u64,
    b: u64,
    segments: &mut Vec<(u64, u64, Cat)>,
    handed: &mut Vec<(u64, u64)>,
) -> State {
    // Before its first switch-in a thread was off-CPU: blocked, unless a wakeup says
    // otherwise.
    let first_in = log.first_switch_is_in == Some(true);
    let mut state = log.carry.unwrap_or(State {
        on_cpu: !first_in,
        runnable: !first_in,
        ..State::default()
    });
    if b <= a {
        return state;
    }
    let mut sync_ends: Vec<u64> = log
        .history
        .syncs
        .iter()
        .chain(&log.syncs)
        .map(|(_, e)| *e)
        .collect();
    sync_ends.sort_unstable();
    // Whether a sync starting at `start` has NCCL work outstanding: a collective
    // returned after the previous sync of this thread ended.
    let outstanding = |start: u64| {
        let prev_end = sync_ends
            .partition_point(|e| *e <= start)
            .checked_sub(1)
            .map_or(0, |i| sync_ends[i]);
        let i = collective_ends.partition_point(|e| *e <= prev_end);
        collective_ends.get(i).is_some_and(|e| *e <= start)
    };
    let (blocking_calls, own_waits) = marks(log);
    let mut t = a;
    let mut charge = |from: u64, to: u64, state: State| {
        let (from, to) = (from.max(a), to.min(b));
        if to > from {
            let which = state.category();
            if which == Cat::Compute && !state.on_cpu {
                match handed.last_mut() {
                    Some(last) if last.1 == from => last.1 = to,
                    _ => handed.push((from, to)),
                }
            }
            match segments.last_mut() {
                Some(last) if last.1 == from && last.2 == which => last.1 = to,
                _ => segments.push((from, to, which)),
            }
        }
    };
    for &(ts, change) in &log.changes {
        if ts >= b {
            break;
        }
        charge(t, ts, state);
        t = t.max(ts);
        match change {
            Change::SwitchOut { runnable } => {
                state.on_cpu = false;
                state.runnable = runnable;
                state.migrated = false;
                state.waits_on_own = !runnable && own_waits.contains(&ts);
            }
            Change::SwitchIn => {
                state.on_cpu = true;
                state.runnable = true;
                state.migrated = false;
            }
            Change::Wakeup { .. } => {
                state.runnable = true;
                state.waits_on_own = false;
            }
            Change::Migrate => state.migrated = true,
            Change::SyncStart => {
                state.sync_depth += 1;
                state.sync_nccl = outstanding(ts);
            }
            Change::SyncEnd => state.sync_depth = state.sync_depth.saturating_sub(1),
            Change::NcclStart => {
                state.nccl_depth += 1;
                state.nccl_blocking = blocking_calls.contains(&ts);
            }
            Change::NcclEnd => {
                state.nccl_depth = state.nccl_depth.saturating_sub(1);
                state.nccl_blocking &= state.nccl_depth > 0;
            }
            Change::FaultStart => state.fault_depth += 1,
            Change::FaultEnd => state.fault_depth = state.fault_depth.saturating_sub(1),
        }
    }
    charge(t, b, state);
    state
}

/// A step's work handed to another thread: each thread's stretches blocked until another
/// thread of its process woke it (`handed`, by tid, from [`split`]) take the categories
/// that thread's pieces had over them (PyTorch's main thread during `backward()` waits
/// for the autograd thread: the step then spent that time as the autograd thread did, in
/// a sync for the GPU, a blocking collective or a run queue, not in compute). One level:
/// a waker's own hand-offs stay `compute`; where the waker is not traced, so do they.
pub(super) fn hand_over(
    threads: &mut std::collections::BTreeMap<u32, ThreadLog>,
    handed: &std::collections::BTreeMap<u32, Vec<(u64, u64)>>,
) {
    // By tid, the other threads' pieces to lay over its own.
    let mut given = std::collections::BTreeMap::new();
    for (tid, stretches) in handed {
        let Some(log) = threads.get(tid) else {
            continue;
        };
        let mut pieces = Vec::new();
        for &(s, e) in stretches {
            // The wakeup that ended the block: at the stretch's end, or after it where the
            // epoch cut the block.
            let i = log.wakeups.partition_point(|w| w.0 < e);
            let Some(&(_, waker, waker_pid)) = log.wakeups.get(i) else {
                continue;
            };
            if waker == *tid || waker_pid != log.pid {
                continue;
            }
            let Some(theirs) = threads.get(&waker) else {
                continue;
            };
            let segs = &theirs.segments;
            let first = segs.partition_point(|p| p.1 <= s);
            pieces.extend(
                segs[first..]
                    .iter()
                    .take_while(|p| p.0 < e)
                    .map(|p| (p.0.max(s), p.1.min(e), p.2))
                    .filter(|p| p.2 != Cat::Compute),
            );
        }
        if !pieces.is_empty() {
            given.insert(*tid, pieces);
        }
    }
    for (tid, pieces) in given {
        if let Some(log) = threads.get_mut(&tid) {
            log.segments = overlay(&log.segments, &pieces);
        }
    }
}

/// `segments` with `pieces` (in order, apart) laid over them,
/// adjacent pieces of one category merged.
fn overlay(segments: &[(u64, u64, Cat)], pieces: &[(u64, u64, Cat)]) -> Vec<(u64, u64, Cat)> {
    let mut out: Vec<(u64, u64, Cat)> = Vec::with_capacity(segments.len() + 2 * pieces.len());
    let mut push = |p: (u64, u64, Cat)| {
        if p.1 <= p.0 {
            return;
        }
        match out.last_mut() {
            Some(last) if last.1 == p.0 && last.2 == p.2 => last.1 = p.1,
            _ => out.push(p),
        }
    };
    let mut next = pieces.iter().peekable();
    for &(s, e, c) in segments {
        let mut t = s;
        while let Some(&&p) = next.peek() {
            if p.0 >= e {
                break;
            }
            push((t, p.0.max(t), c));
            push((p.0.max(t), p.1.min(e), p.2));
            t = t.max(p.1.min(e));
            if p.1 > e {
                break;
            }
            next.next();
        }
        push((t, e, c));
    }
    out
}

/// The category of the piece holding `ts`.
pub(super) fn category_at(segments: &[(u64, u64, Cat)], ts: u64) -> Option<Cat> {
    let i = segments.partition_point(|(_, e, _)| *e <= ts);
    segments
        .get(i)
        .filter(|(s, _, _)| *s <= ts)
        .map(|(_, _, c)| *c)
}

/// How far `[a, b)`'s `page_fault` may be off where faults are not timed: measured
/// between back-to-back faults, the error of the mean its other faults are charged
/// ([`fault_estimate`]); from its own samples, two standard errors of their count plus
/// one period (a step with no sample may hold up to about a period of faults). None
/// where faults are timed or sampling is off.
pub(super) fn fault_error(log: &ThreadLog, a: u64, b: u64, period: u64) -> Option<u64> {
    if period == 0 || !log.faults_untimed {
        return None;
    }
    let from_samples = || {
        let n = sampled_fault_ns(log, a, b).1 as f64;
        ((2.0 * n.sqrt() + 1.0) * period as f64).round() as u64
    };
    Some(fault_estimate(log, a, b).map_or_else(from_samples, |(_, error)| error))
}

/// The gaps between the thread's consecutive faults at neighbouring instructions that
/// began in `[a, b)` with the thread on the CPU throughout (no switch between them): each
/// under [`super::BACK_TO_BACK_NS`] the first fault's cost, with whatever short else ran
/// in it (an interrupt) as the thread's own clock counts it.
pub(super) fn back_to_back(log: &ThreadLog, a: u64, b: u64) -> impl Iterator<Item = u64> + '_ {
    let lo = log.fault_pairs.partition_point(|p| p.0 < a);
    let switched = |from: u64, to: u64| {
        let i = log.changes.partition_point(|c| c.0 <= from);
        log.changes[i..]
            .iter()
            .take_while(|c| c.0 < to)
            .any(|c| matches!(c.1, Change::SwitchOut { .. }))
    };
    log.fault_pairs[lo..]
        .iter()
        .take_while(move |p| p.0 < b)
        .filter(move |p| !switched(p.0, p.1))
        .map(|p| p.1 - p.0)
}

/// `[a, b)`'s page-fault time where faults are not timed, and how far it may be off: the
/// gaps of its faults back to back (measured), and its other faults at their mean, with
/// two standard errors of that mean. None where faults are timed, sampling is off, or the
/// stretch has fewer than [`super::MIN_PAIRS`] such gaps. Only the stretch's own records
/// count: attributed in epochs or at once, a step reads the same.
pub(super) fn fault_estimate(log: &ThreadLog, a: u64, b: u64) -> Option<(u64, u64)> {
    if !log.faults_untimed {
        return None;
    }
    // Short gaps (count, sum, sum of squares), and the long ones (count, sum).
    let (mut n, mut sum, mut sq, mut over, mut over_ns) = (0u64, 0u64, 0f64, 0u64, 0u64);
    for gap in back_to_back(log, a, b) {
        if gap < super::BACK_TO_BACK_NS {
            (n, sum, sq) = (n + 1, sum + gap, sq + (gap as f64) * (gap as f64));
        } else {
            (over, over_ns) = (over + 1, over_ns + gap);
        }
    }
    if n < super::MIN_PAIRS {
        return None;
    }
    let rest = faults_in(log, a, b).saturating_sub(n) as f64;
    let mean = sum as f64 / n as f64;
    let var = (sq / n as f64 - mean * mean).max(0.0);
    let ns = sum as f64 + rest * mean;
    // The mean's error over the faults charged it, and what the long gaps held beyond a
    // fault's mean: their fault may have cost any of it.
    let error = rest * 2.0 * (var / n as f64).sqrt() + (over_ns as f64 - over as f64 * mean);
    Some((ns.round() as u64, error.round() as u64))
}

/// The on-CPU time of the thread's samples of the CUDA driver yielding the CPU in
/// `[a, b)` outside syncs and faults (in `compute` pieces), a sampling period each.
pub(super) fn driver_yield_ns(log: &ThreadLog, a: u64, b: u64) -> u64 {
    driver_yields(log, a, b).map(|t| t.1).sum()
}

/// How many of those samples `[a, b)` holds.
pub(super) fn driver_yields_in(log: &ThreadLog, a: u64, b: u64) -> usize {
    driver_yields(log, a, b).count()
}

fn driver_yields(log: &ThreadLog, a: u64, b: u64) -> impl Iterator<Item = &(u64, u64)> {
    let lo = log.driver_yields.partition_point(|t| t.0 < a);
    log.driver_yields[lo..]
        .iter()
        .take_while(move |t| t.0 < b)
        .filter(|t| category_at(&log.segments, t.0) == Some(Cat::Compute))
}

/// The thread's faults counted by the kernel in `[a, b)`.
pub(super) fn faults_in(log: &ThreadLog, a: u64, b: u64) -> u64 {
    (log.faults.partition_point(|f| f.0 < b) - log.faults.partition_point(|f| f.0 < a)) as u64
}

/// The on-CPU time of the thread's samples in page faults in `[a, b)`, and their count.
/// Not while spinning for NCCL or the GPU, nor inside a fault timed by fentry/fexit (its
/// piece is page_fault already): a sample after the handler's return, on the faulting
/// instruction, stands for the untraced return and retried access.
pub(super) fn sampled_fault_ns(log: &ThreadLog, a: u64, b: u64) -> (u64, u64) {
    let lo = log.fault_time.partition_point(|(ts, _)| *ts < a);
    log.fault_time[lo..]
        .iter()
        .take_while(|(ts, _)| *ts < b)
        .filter(|(ts, _)| {
            !matches!(
                category_at(&log.segments, *ts),
                Some(Cat::NcclWait | Cat::GpuWait | Cat::PageFault)
            )
        })
        .fold((0, 0), |(ns, n), (_, weight)| (ns + weight, n + 1))
}

/// The on-CPU time each fault sample stands for: the thread's on-CPU time since its
/// previous sample. The kernel re-arms the cpu-clock timer after the sample's handler and
/// delays samples while interrupts are off (more so inside fault handling), so the real
/// interval runs a few percent over the nominal period; wall-clock gaps also hold
/// preemptions, which are taken out using the thread's switches. The nominal period when
/// there is no previous sample or the on-CPU gap is outside [period, 1.5 × period).
pub(super) fn weigh_samples(log: &ThreadLog, period: u64) -> Vec<(u64, u64)> {
    let mut off: Vec<(u64, u64)> = Vec::new();
    // Off-CPU since an earlier epoch.
    let mut out_at: Option<u64> = log.off_open.map(|o| o.start);
    for &(ts, change) in &log.changes {
        match change {
            Change::SwitchOut { .. } => out_at = Some(ts),
            Change::SwitchIn => {
                if let Some(at) = out_at.take() {
                    off.push((at, ts));
                }
            }
            _ => {}
        }
    }
    log.fault_samples
        .iter()
        .map(|&(ts, prev)| {
            let weight = prev.map_or(period, |prev| {
                let first = off.partition_point(|(_, e)| *e <= prev);
                let off_cpu: u64 = off[first..]
                    .iter()
                    .take_while(|(s, _)| *s < ts)
                    .map(|(s, e)| (*e).min(ts).saturating_sub((*s).max(prev)))
                    .sum();
                let on_cpu = ts.saturating_sub(prev).saturating_sub(off_cpu);
                // Longer: samples were missing in between; shorter: clock skew.
                if (period..period + period / 2).contains(&on_cpu) {
                    on_cpu
                } else {
                    period
                }
            });
            (ts, weight)
        })
        .collect()
}

/// Start times of the thread's NCCL calls that blocked before returning, and of its
/// blocked intervals that ended with a wakeup from another thread of its process.
fn marks(log: &ThreadLog) -> (BTreeSet<u64>, BTreeSet<u64>) {
    // NCCL calls that blocked (slept) before returning block the host: all their time is
    // NCCL wait. A call only preempted is enqueue work that waited for a CPU: a preemption
    // once made a minimal-profile run report nccl_wait as measured.
    let mut blocking_calls = BTreeSet::new();
    let mut open: Option<u64> = None;
    for &(ts, change) in &log.changes {
        match change {
            Change::NcclStart => open = Some(ts),
            Change::SwitchOut { runnable: false } => {
                if let Some(start) = open {
                    blocking_calls.insert(start);
                }
            }
            Change::NcclEnd => open = None,
            _ => {}
        }
    }
    // Blocked intervals that end with a wakeup from another thread of the process:
    // the thread waits for the process's own work (autograd, worker queues).
    let mut own_waits = BTreeSet::new();
    let mut blocked_since: Option<u64> = None;
    for &(ts, change) in &log.changes {
        match change {
            Change::SwitchOut { runnable: false } => blocked_since = Some(ts),
            Change::Wakeup { own } => {
                if let Some(since) = blocked_since.take()
                    && own
                {
                    own_waits.insert(since);
                }
            }
            Change::SwitchIn => blocked_since = None,
            _ => {}
        }
    }
    (blocking_calls, own_waits)
}

/// A thread's state between two changes.
#[allow(clippy::struct_excessive_bools)] // independent facts about one thread
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct State {
    on_cpu: bool,
    runnable: bool,
    migrated: bool,
    sync_depth: u32,
    sync_nccl: bool,
    nccl_depth: u32,
    /// Inside an NCCL call that goes off-CPU before it returns.
    nccl_blocking: bool,
    /// Blocked until another thread of the process wakes it.
    waits_on_own: bool,
    /// Inside a timed page fault (fentry/fexit).
    fault_depth: u32,
}

impl State {
    /// Blocked off-CPU with its time in `other_offcpu`: until a wakeup says whether
    /// another thread of the process ends the wait.
    pub(super) fn blocked_other(self) -> bool {
        !self.on_cpu && !self.runnable && self.category() == Cat::OtherOffcpu
    }

    fn in_nccl_sync(self) -> bool {
        self.sync_depth > 0 && self.sync_nccl
    }

    /// The category time in this state belongs to (the rules in the module docs).
    fn category(self) -> Cat {
        if self.in_nccl_sync() || self.nccl_blocking {
            Cat::NcclWait
        } else if self.fault_depth > 0 && (self.on_cpu || !self.runnable) {
            // Handling the fault on the CPU, or blocked inside it (reading the page in).
            Cat::PageFault
        } else if self.on_cpu {
            // Spinning inside a sync (`cudaDeviceScheduleAuto`) waits for the GPU too.
            if self.sync_depth > 0 {
                Cat::GpuWait
            } else {
                Cat::Compute
            }
        } else if self.runnable {
            // Preempted, inside an NCCL call or not: a wait for a CPU (a call only
            // preempted is enqueue work, docs/attribution.md).
            if self.migrated {
                Cat::CpuMigration
            } else {
                Cat::Runqueue
            }
        } else if self.nccl_depth > 0 {
            Cat::NcclWait
        } else if self.sync_depth > 0 {
            Cat::GpuWait
        } else if self.waits_on_own {
            Cat::Compute
        } else {
            Cat::OtherOffcpu
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The category of each kind of state, as the module docs state the rules: one row a
    /// rule, and the order in which they win.
    #[test]
    #[allow(clippy::too_many_lines)] // one table: every rule, one row each
    fn state_categories_follow_the_rules() {
        let on = State {
            on_cpu: true,
            runnable: true,
            ..State::default()
        };
        let preempted = State {
            runnable: true,
            ..State::default()
        };
        let blocked = State::default();
        let nccl_sync = |s: State| State {
            sync_depth: 1,
            sync_nccl: true,
            ..s
        };
        let gpu_sync = |s: State| State { sync_depth: 1, ..s };
        let rows: [(&str, State, Cat); 17] = [
            ("on the CPU", on, Cat::Compute),
            ("preempted", preempted, Cat::Runqueue),
            (
                "preempted after a migration",
                State {
                    migrated: true,
                    ..preempted
                },
                Cat::CpuMigration,
            ),
            ("blocked", blocked, Cat::OtherOffcpu),
            (
                "blocked until its process wakes it",
                State {
                    waits_on_own: true,
                    ..blocked
                },
                Cat::Compute,
            ),
            (
                "spinning in a sync, NCCL outstanding",
                nccl_sync(on),
                Cat::NcclWait,
            ),
            (
                "asleep in a sync, NCCL outstanding",
                nccl_sync(blocked),
                Cat::NcclWait,
            ),
            (
                "preempted in a sync, NCCL outstanding",
                nccl_sync(preempted),
                Cat::NcclWait,
            ),
            (
                "spinning in a sync, GPU work only",
                gpu_sync(on),
                Cat::GpuWait,
            ),
            (
                "asleep in a sync, GPU work only",
                gpu_sync(blocked),
                Cat::GpuWait,
            ),
            (
                "preempted in a sync, GPU work only",
                gpu_sync(preempted),
                Cat::Runqueue,
            ),
            (
                "in an NCCL call that blocks the host, on the CPU",
                State {
                    nccl_depth: 1,
                    nccl_blocking: true,
                    ..on
                },
                Cat::NcclWait,
            ),
            (
                "enqueueing in an NCCL call",
                State {
                    nccl_depth: 1,
                    ..on
                },
                Cat::Compute,
            ),
            // Regression: a preemption inside an NCCL call that never slept was nccl_wait,
            // which also made a `minimal` run's nccl_wait a "lower bound" (measured) at
            // random on a busy machine.
            (
                "preempted in an NCCL call",
                State {
                    nccl_depth: 1,
                    ..preempted
                },
                Cat::Runqueue,
            ),
            (
                "asleep in an NCCL call",
                State {
                    nccl_depth: 1,
                    ..blocked
                },
                Cat::NcclWait,
            ),
            (
                "handling a fault on the CPU",
                State {
                    fault_depth: 1,
                    ..on
                },
                Cat::PageFault,
            ),
            (
                "a fault inside an NCCL wait",
                nccl_sync(State {
                    fault_depth: 1,
                    ..on
                }),
                Cat::NcclWait,
            ),
        ];
        for (what, state, expected) in rows {
            assert_eq!(state.category(), expected, "{what}: {state:?}");
        }
    }

    /// Only a plain block waits for its wakeup to be settled across an epoch's end.
    #[test]
    fn only_plain_blocks_are_settled_later() {
        let blocked = State::default();
        assert!(blocked.blocked_other());
        let in_sync = State {
            sync_depth: 1,
            sync_nccl: true,
            ..blocked
        };
        assert!(!in_sync.blocked_other());
        let preempted = State {
            runnable: true,
            ..blocked
        };
        assert!(!preempted.blocked_other());
    }
}
