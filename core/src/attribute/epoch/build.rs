//! What an epoch's close builds: the cross-rank matching, the steps with their
//! categories, every thread's totals, the timeline pieces the renderers get, and the
//! reports at the end of the run.

use super::{
    BTreeMap, Categories, Change, Collective, Detail, Epoch, NcclCount, OffCpu, OpenOff, Step,
    StepRank, ThreadDetail, ThreadLog, ThreadReport, Timeline, Unmeasured, WorkerReport,
    categories, ranks, role, step_categories,
};

impl Timeline {
    /// Gives the cross-rank matcher every collective and CUDA sync not given yet, and the
    /// processes that exited before `until`, in time order: a process's exit after its
    /// collectives and before those of any process started after it (an elastic
    /// restart's next ranks are never matched with the last collectives of the ranks they
    /// replace).
    pub(super) fn match_ranks(&mut self, until: u64) {
        enum Feed {
            Call(u32, Collective),
            Sync(u32, u64),
            Exit(u32),
        }
        let mut feed: Vec<(u64, Feed)> = Vec::new();
        for log in self.threads.values_mut() {
            let calls = log.collectives.get(log.fed..).unwrap_or(&[]);
            feed.extend(calls.iter().map(|c| (c.start_ns, Feed::Call(log.pid, *c))));
            log.fed = log.collectives.len();
            let new = log.syncs.iter().filter(|s| s.0 > log.synced_to);
            feed.extend(new.map(|s| (s.0, Feed::Sync(log.pid, s.1))));
            log.synced_to = log.syncs.iter().map(|s| s.0).fold(log.synced_to, u64::max);
        }
        let (gone, later): (Vec<_>, Vec<_>) = self.exited.iter().partition(|e| e.0 < until);
        self.exited = later;
        for &(ts, pid) in &gone {
            // Its first: the main thread's exit, then the last thread's.
            let at = self.done.exits.entry(pid).or_insert(ts);
            *at = (*at).min(ts);
        }
        feed.extend(gone.into_iter().map(|(ts, pid)| (ts, Feed::Exit(pid))));
        feed.sort_by_key(|f| f.0);
        let mut groups = Vec::new();
        for (ts, f) in feed {
            match f {
                // A one-rank communicator's collectives wait for no other process: each
                // process using only such is a job of its own (issue 51).
                Feed::Call(pid, c) if self.comms.one_rank(pid, c.comm) => {}
                Feed::Call(pid, c) => self.done.matcher.add(pid, &c),
                Feed::Sync(pid, end) => self.done.matcher.synced(pid, ts, end),
                Feed::Exit(pid) => {
                    groups.extend(self.done.matcher.matched());
                    self.done.matcher.exited(pid);
                }
            }
        }
        groups.extend(self.done.matcher.matched());
        let Some((_, rank_pid)) = self.done.rank else {
            return;
        };
        self.done
            .lateness
            .extend(groups.iter().filter_map(|g| ranks::late_entry(g, rank_pid)));
        self.done.lateness.sort_unstable();
    }

    /// The rank thread's steps in `bounds`.
    pub(super) fn steps(
        &self,
        bounds: &[(u64, u64)],
        identities: &[ranks::RankIdentity],
        loop_threads: &BTreeMap<u32, u32>,
        colls: &BTreeMap<u32, Vec<Collective>>,
    ) -> Vec<Step> {
        let Some((tid, pid)) = self.done.rank else {
            return Vec::new();
        };
        let rank_of = |pid: u32| {
            identities
                .iter()
                .find(|i| i.pid == pid)
                .map_or(-1, |i| i.rank)
        };
        let colls = colls.get(&pid).map_or(&[][..], Vec::as_slice);
        let log = &self.threads[&tid];
        // The ranks beside it: its job's (another job's steps are not these), while their
        // process ran.
        let job = self.done.matcher.job_name(pid);
        let loop_threads: Vec<(u32, u32, Option<u64>)> = loop_threads
            .iter()
            .filter(|(p, _)| self.done.matcher.job_name(**p) == job)
            .map(|(p, t)| (*p, *t, self.done.exits.get(p).copied()))
            .collect();
        // Steps handed on now say what the run could not measure so far (kept ones are
        // marked at its end, when it is known).
        let unmeasured = if self.emit {
            self.unmeasured()
        } else {
            Unmeasured::default()
        };
        // Steps `bounds[from..]`, written into `slots` (one a step).
        let fill = |slots: &mut [std::mem::MaybeUninit<Step>], from: usize| {
            let bounds = &bounds[from..];
            // The step's collectives start at or after this one (steps come in time order).
            let mut first = 0;
            for (i, (slot, &(a, b))) in slots.iter_mut().zip(bounds).enumerate() {
                first += gallop(&colls[first..], |c| c.start_ns < a);
                let index = self.done.next_index + from + i;
                let mut step = self.step(index, log, tid, &colls[first..], a, b);
                step.categories.unmeasured = unmeasured;
                if loop_threads.len() > 1 {
                    step.slowest_rank = ranks::slowest_in(&self.done.lateness, a, b).map(rank_of);
                    step.ranks = loop_threads
                        .iter()
                        .filter(|(_, _, exit)| exit.is_none_or(|x| x > a))
                        .map(|(p, t, _)| StepRank {
                            rank: rank_of(*p),
                            pid: *p,
                            categories: Categories {
                                unmeasured,
                                ..step_categories(&self.threads[t], a, b)
                            },
                        })
                        .collect();
                }
                slot.write(step);
            }
        };
        let n = bounds.len();
        let mut out = Vec::with_capacity(n);
        let slots = &mut out.spare_capacity_mut()[..n];
        let mut halved = false;
        if n >= PARALLEL_STEPS && self.parallel_steps {
            // The second half on a thread of its own (a run of µs-long steps has
            // thousands an epoch, and its attribution was most of `report`'s time).
            let (left, right) = slots.split_at_mut(n / 2);
            std::thread::scope(|scope| {
                let helper = std::thread::Builder::new()
                    .name("nccltrace-steps-half".into())
                    .spawn_scoped(scope, move || fill(right, n / 2));
                // No thread to be had: all of them here, below.
                if let Ok(helper) = helper {
                    fill(left, 0);
                    if let Err(panic) = helper.join() {
                        std::panic::resume_unwind(panic);
                    }
                    halved = true;
                }
            });
        }
        if !halved {
            fill(slots, 0);
        }
        // SAFETY: `fill` wrote every one of the first `n` slots: each slice it was given
        // is zipped with as many bounds (the halves cover `0..n`); had it panicked, this
        // is not reached (the steps written then leak, nothing is read uninitialized).
        unsafe { out.set_len(n) };
        out
    }

    /// Every thread's and every rank's totals over `[from, until)` (`from` per thread;
    /// `loop_threads`: each process's training-loop thread).
    pub(super) fn totals(
        &mut self,
        from: &BTreeMap<u32, u64>,
        until: u64,
        identities: &[ranks::RankIdentity],
        loop_threads: &BTreeMap<u32, u32>,
        colls: &BTreeMap<u32, Vec<Collective>>,
    ) {
        for (tid, log) in &self.threads {
            let t = self.done.threads.entry(*tid).or_default();
            let c = categories(log, from[tid], until);
            self.done.blocked_in_nccl |= c.nccl_wait > 0;
            t.categories.add(&c);
            t.nccl_calls += log
                .changes
                .iter()
                .filter(|(ts, c)| *ts < until && *c == Change::NcclStart)
                .count() as u64;
            t.faults += log.faults.partition_point(|f| f.0 < until) as u64;
            let migrations = &log.migrations[..log.migrations.partition_point(|m| m.0 < until)];
            t.migrations += migrations.len() as u64;
            t.cross_node_migrations += migrations.iter().filter(|(_, x)| *x).count() as u64;
        }
        for id in identities {
            let n = self.done.rank_nccl.entry(id.pid).or_default();
            for c in colls[&id.pid].iter().take_while(|c| c.start_ns < until) {
                n.collectives += 1;
                n.bytes = n.bytes.saturating_add(c.bytes);
            }
            if let Some(t) = loop_threads.get(&id.pid) {
                let c = categories(&self.threads[t], from[t], until);
                self.done.rank_categories.entry(id.pid).or_default().add(&c);
            }
        }
    }

    /// A thread blocked at the cut with no wakeup yet: whether another thread of its
    /// process wakes it (the wait is then the process's own work, `compute`, not
    /// `other_offcpu`) is known only in a later epoch. Its `other_offcpu` time is noted
    /// here and moved once the wakeup is seen (the switch-out stays in its changes so that
    /// the next epoch's cut sees the block).
    pub(super) fn settle_blocks(&mut self, until: u64, loop_threads: &BTreeMap<u32, u32>) {
        // tid → pid of the training-loop threads.
        let loop_threads: BTreeMap<u32, u32> =
            loop_threads.iter().map(|(pid, tid)| (*tid, *pid)).collect();
        for (tid, log) in &mut self.threads {
            if let Some((since, ns)) = log.pending_block {
                let next = log.changes.iter().take_while(|c| c.0 < until).find(|c| {
                    c.0 >= since && matches!(c.1, Change::Wakeup { .. } | Change::SwitchIn)
                });
                if let Some(&(_, change)) = next {
                    log.pending_block = None;
                    if change == (Change::Wakeup { own: true }) {
                        let t = self.done.threads.entry(*tid).or_default();
                        t.categories.other_offcpu -= ns.min(t.categories.other_offcpu);
                        t.categories.compute += ns;
                        if let Some(pid) = loop_threads.get(tid) {
                            let r = self.done.rank_categories.entry(*pid).or_default();
                            r.other_offcpu -= ns.min(r.other_offcpu);
                            r.compute += ns;
                        }
                    }
                }
            }
            if !log
                .carry
                .is_some_and(crate::attribute::cut::State::blocked_other)
            {
                continue;
            }
            let since = log
                .changes
                .iter()
                .take_while(|c| c.0 < until)
                .filter(|c| c.1 == (Change::SwitchOut { runnable: false }))
                .map(|c| c.0)
                .last()
                .or(log.pending_block.map(|p| p.0))
                .or(log.off_open.map(|o| o.start));
            let Some(since) = since else { continue };
            let ns: u64 = log
                .segments
                .iter()
                .filter(|(_, _, c)| *c == crate::attribute::Cat::OtherOffcpu)
                .map(|(a, b, _)| (*b).min(until).saturating_sub((*a).max(since)))
                .sum();
            log.pending_block = match log.pending_block {
                Some((s, before)) if s == since => Some((s, before + ns)),
                _ => Some((since, ns)),
            };
        }
    }

    /// The timeline pieces, samples and off-CPU stretches up to `until`, for the
    /// flamegraphs and the Perfetto trace. Handed on as they come (`emit`), each thread's
    /// pieces and entry stacks reach back to the stretches and calls still open, so that
    /// what closes later is weighed as on the whole run.
    pub(super) fn epoch_detail(&mut self, cut: u64, until: u64, emit: bool) -> Detail {
        let rank_tid = self.done.rank.map(|r| r.0);
        let calls = self.calls.take_where(|c| c.end_ns <= until);
        let mut threads = Vec::with_capacity(self.threads.len());
        for (tid, log) in &mut self.threads {
            let name = self.thread_names.get(tid).cloned().unwrap_or_default();
            let mut thread = ThreadDetail {
                tid: *tid,
                pid: log.pid,
                role: role(Some(*tid) == rank_tid, &name),
                name,
                segments: std::mem::take(&mut log.tail.segments),
                samples: Vec::new(),
                offcpu: Vec::new(),
                migrations: Vec::new(),
                faults: Vec::new(),
                call_stacks: std::mem::take(&mut log.tail.call_stacks),
                open: None,
            };
            let before = |ts: &u64| *ts < until;
            thread.segments.append(&mut log.segments);
            thread
                .migrations
                .extend(log.migration_cpus.iter().filter(|m| before(&m.0)).copied());
            thread
                .faults
                .extend(log.faults.iter().map(|f| f.0).filter(before));
            thread
                .call_stacks
                .extend(log.call_stacks.iter().filter(|c| before(&c.0)).copied());
            let fault_weight: BTreeMap<u64, u64> = log.fault_time.iter().copied().collect();
            for &(ts, stack, in_fault) in log.stack_samples.iter().filter(|s| before(&s.0)) {
                let at = category_at_thread(&thread, ts);
                let (cat, weight) = match fault_weight.get(&ts) {
                    Some(w) if in_fault && at == crate::attribute::Cat::Compute => {
                        (crate::attribute::Cat::PageFault, *w)
                    }
                    _ if at == crate::attribute::Cat::Compute
                        && log.driver_yields.binary_search_by_key(&ts, |y| y.0).is_ok() =>
                    {
                        (crate::attribute::Cat::GpuWait, self.sample_period_ns)
                    }
                    _ => (at, self.sample_period_ns),
                };
                thread.samples.push((ts, stack, cat, weight));
            }
            // Past the first epoch, a switch-out before the cut is there only to settle a
            // block (`settle_blocks`): its stretch is open already.
            let from = if self.done.epochs > 0 { cut } else { 0 };
            log.off_open = off_cpu(log, from, until, &mut thread.offcpu);
            thread.open = log.off_open.map(|o| OffCpu {
                start_ns: o.start,
                end_ns: until,
                runnable: o.runnable,
                stack: o.stack,
                waker: o.wakeup.map(|(_, tid, tgid)| (tid, tgid)),
                woken_ns: o.wakeup.map(|(t, _, _)| t),
            });
            if emit {
                // What the next epoch's stretches and calls reach back to.
                let from = self
                    .calls
                    .iter()
                    .filter(|c| c.task.tid == *tid)
                    .map(|c| c.start_ns)
                    .chain(log.off_open.map(|o| o.start))
                    .min()
                    .unwrap_or(until);
                log.tail.segments = thread
                    .segments
                    .iter()
                    .filter(|(_, e, _)| *e > from)
                    .copied()
                    .collect();
                log.tail.call_stacks = thread
                    .call_stacks
                    .iter()
                    .filter(|(t, _)| *t >= from)
                    .copied()
                    .collect();
            }
            threads.push(thread);
        }
        Detail {
            first_ns: self.first_ns,
            end_ns: until,
            threads,
            stacks: Vec::new(),
            calls,
            cpu_nodes: self.cpu_nodes.clone(),
            sample_period_ns: self.sample_period_ns,
            offcpu_min_ns: self.offcpu_min_ns,
            step_bounds: Vec::new(),
            rank_tid,
            rank_pid: self.done.rank.map(|r| r.1),
        }
    }

    /// Keeps an epoch's steps and timeline for [`Timeline::finish`], or hands them on.
    pub(super) fn keep_or_emit(&mut self, steps: Vec<Step>, mut detail: Detail, emit: bool) {
        if emit {
            // The rank thread's stretches still open reach back into these steps.
            let from = self
                .done
                .rank
                .and_then(|(tid, _)| self.threads.get(&tid))
                .and_then(|l| l.tail.segments.first().map(|s| s.0))
                .unwrap_or(u64::MAX);
            detail.step_bounds = std::mem::take(&mut self.done.step_tail);
            detail
                .step_bounds
                .extend(steps.iter().map(|s| (s.start_ns, s.end_ns)));
            let until = detail.end_ns;
            self.done.step_tail = detail
                .step_bounds
                .iter()
                .filter(|(_, e)| *e > from.min(until))
                .copied()
                .collect();
            let lateness = self.done.matcher.lateness();
            self.done.ready.push(Epoch {
                steps,
                detail,
                lateness,
            });
            return;
        }
        self.done.steps.extend(steps);
        self.done.calls.append(&mut detail.calls);
        for t in detail.threads {
            match self.done.detail.entry(t.tid) {
                std::collections::btree_map::Entry::Vacant(v) => {
                    v.insert(t);
                }
                std::collections::btree_map::Entry::Occupied(mut o) => {
                    let o = o.get_mut();
                    o.role = t.role;
                    o.segments.extend(t.segments);
                    o.samples.extend(t.samples);
                    o.offcpu.extend(t.offcpu);
                    o.migrations.extend(t.migrations);
                    o.faults.extend(t.faults);
                    o.call_stacks.extend(t.call_stacks);
                    o.open = t.open;
                }
            }
        }
    }

    /// Every rank's and every thread's totals, for the reports.
    pub(super) fn reports(
        &mut self,
        identities: &[ranks::RankIdentity],
        unmeasured: Unmeasured,
    ) -> (Vec<ranks::RankReport>, Vec<ThreadReport>) {
        let rank = self.done.rank;
        let ranks_out = identities
            .iter()
            .map(|id| ranks::RankReport {
                pid: id.pid,
                rank: id.rank,
                rank_source: id.rank_source.clone(),
                nccl: self.done.rank_nccl.remove(&id.pid).unwrap_or_default(),
                categories: Categories {
                    unmeasured,
                    ..self
                        .done
                        .rank_categories
                        .remove(&id.pid)
                        .unwrap_or_default()
                },
                matched: self
                    .done
                    .matcher
                    .alignment(id.pid)
                    .map(super::super::align::Alignment::describe),
            })
            .collect();
        let threads = self
            .done
            .threads
            .iter()
            .map(|(tid, t)| {
                let name = self.thread_names.get(tid).cloned().unwrap_or_default();
                ThreadReport {
                    tid: *tid,
                    pid: self.threads.get(tid).map_or(0, |l| l.pid),
                    role: role(Some(*tid) == rank.map(|r| r.0), &name),
                    name,
                    categories: Categories {
                        unmeasured,
                        ..t.categories
                    },
                    nccl_calls: t.nccl_calls,
                    faults: t.faults,
                    migrations: t.migrations,
                    cross_node_migrations: t.cross_node_migrations,
                }
            })
            .collect();
        (ranks_out, threads)
    }

    /// The workers of the ranks in `identities`, from their threads' totals.
    pub(super) fn worker_reports(
        &self,
        identities: &[ranks::RankIdentity],
        threads: &[ThreadReport],
    ) -> Vec<WorkerReport> {
        self.workers()
            .into_iter()
            .map(|(pid, rank_pid)| {
                let mut w = WorkerReport {
                    pid,
                    parent_pid: self.parents.get(&pid).copied(),
                    rank_pid,
                    rank: identities
                        .iter()
                        .find(|i| i.pid == rank_pid)
                        .map(|i| i.rank),
                    threads: 0,
                    categories: Categories::default(),
                    faults: 0,
                    migrations: 0,
                };
                for t in threads.iter().filter(|t| t.pid == pid) {
                    w.threads += 1;
                    w.categories.add(&t.categories);
                    w.categories.unmeasured = t.categories.unmeasured;
                    w.faults += t.faults;
                    w.migrations += t.migrations;
                }
                w
            })
            .collect()
    }

    /// Thread `tid`'s page faults in [a, b), and the pages moved between nodes for it.
    pub(super) fn faults_and_page_moves(
        &self,
        log: &ThreadLog,
        tid: u32,
        a: u64,
        b: u64,
    ) -> (u64, u64) {
        let faults = crate::attribute::cut::faults_in(log, a, b);
        let lo = self.page_migrations.partition_point(|m| m.1 < a);
        let hi = self.page_migrations.partition_point(|m| m.1 < b).max(lo);
        let pages = self.page_migrations[lo..hi]
            .iter()
            .filter(|(t, _, _)| *t == tid)
            .map(|(_, _, n)| n)
            .sum();
        (faults, pages)
    }

    /// One step of the rank thread.
    pub(super) fn step(
        &self,
        index: usize,
        log: &ThreadLog,
        tid: u32,
        collectives: &[Collective],
        a: u64,
        b: u64,
    ) -> Step {
        // Sorted by time: each step looks at its own stretch only.
        let within = |lo: usize, hi: usize| lo..hi.max(lo);
        let numa_moves = &self.numa_moves[within(
            self.numa_moves.partition_point(|m| m.1 < a),
            self.numa_moves.partition_point(|m| m.1 < b),
        )];
        // Everything below is sorted by time: binary searches keep long runs linear.
        let lo = gallop(collectives, |c| c.start_ns < a);
        let nccl = collectives[lo..]
            .iter()
            .take_while(|c| c.start_ns < b)
            .fold(NcclCount::default(), |n, c| NcclCount {
                collectives: n.collectives + 1,
                bytes: n.bytes.saturating_add(c.bytes),
            });
        let (faults, page_migrations) = self.faults_and_page_moves(log, tid, a, b);
        let lo = log.migrations.partition_point(|m| m.0 < a);
        let migrations = &log.migrations[lo..log.migrations.partition_point(|m| m.0 < b).max(lo)];
        Step {
            index,
            start_ns: a,
            end_ns: b,
            wall_ns: b - a,
            categories: step_categories(log, a, b),
            page_fault_error_ns: crate::attribute::cut::fault_error(
                log,
                a,
                b,
                self.sample_period_ns,
            ),
            gpu_wait_error_ns: (self.driver_yields_seen > 0).then(|| {
                let n = crate::attribute::cut::driver_yields_in(log, a, b) as f64;
                Box::new(((2.0 * n.sqrt() + 1.0) * self.sample_period_ns as f64).round() as u64)
            }),
            nccl,
            faults,
            migrations: migrations.len() as u64,
            cross_node_migrations: migrations.iter().filter(|(_, x)| *x).count() as u64,
            numa_page_migrations: page_migrations,
            slowest_rank: None,
            ranks: Vec::new(),
            numa_task_moves: numa_moves.iter().filter(|(t, _)| *t == tid).count() as u64,
            remote_access: log.remote_access(a, b).map(Box::new),
            infiniband: self.infiniband.step(a, b),
            gpu: Some(self.gpu.step(a, b))
                .filter(|g| !g.is_empty())
                .map(Box::new),
            remote_loads: log.mem_khz.map(|_| {
                Box::new(crate::pmu::measure(
                    &log.mem_samples,
                    a,
                    b,
                    crate::pmu::SAMPLE_PERIOD,
                ))
            }),
        }
    }
}

/// Marks what the run could not measure in `steps` and their per-rank categories.
pub(super) fn mark_unmeasured(steps: &mut [Step], unmeasured: Unmeasured) {
    for step in steps {
        step.categories.unmeasured = unmeasured;
        for r in &mut step.ranks {
            r.categories.unmeasured = unmeasured;
        }
    }
}

/// Steps an epoch from which its steps are made on two threads (where CPUs are spare).
const PARALLEL_STEPS: usize = 2048;

/// The partition point of `v` by `pred` (true on a prefix), found by galloping from the
/// start: a few probes when it lies near the start, as the next step's first collective
/// does (a binary search over the epoch's collectives a step was a tenth of the steps'
/// making on a run of one-call steps).
fn gallop<T>(v: &[T], pred: impl Fn(&T) -> bool) -> usize {
    let mut hi = 1;
    while hi < v.len() && pred(&v[hi]) {
        hi *= 2;
    }
    let lo = hi / 2;
    let hi = hi.min(v.len());
    lo + v[lo..hi].partition_point(pred)
}

/// How long before its switch record an off-CPU stack record may be: the same program
/// run makes both.
pub(super) const OFFCPU_STACK_SLACK: u64 = 100_000;

/// The category at `ts` of a thread's pieces so far (compute when none holds it).
pub(super) fn category_at_thread(thread: &ThreadDetail, ts: u64) -> crate::attribute::Cat {
    thread
        .category_at(ts)
        .unwrap_or(crate::attribute::Cat::Compute)
}

/// Appends the thread's off-CPU stretches that closed in `[from, until)` (one open from the
/// previous epoch included); returns the one still open at `until`.
pub(super) fn off_cpu(
    log: &ThreadLog,
    from: u64,
    until: u64,
    out: &mut Vec<OffCpu>,
) -> Option<OpenOff> {
    let mut open = log.off_open;
    let changes = log.changes.iter().skip_while(|c| c.0 < from);
    for &(ts, change) in changes.take_while(|c| c.0 < until) {
        match change {
            Change::SwitchOut { runnable } => {
                open = Some(OpenOff {
                    start: ts,
                    runnable,
                    stack: None,
                    wakeup: None,
                });
            }
            Change::SwitchIn => {
                let Some(o) = open.take() else {
                    continue;
                };
                let wakeup = last_wakeup(log, o.start, ts).or(o.wakeup);
                out.push(OffCpu {
                    start_ns: o.start,
                    end_ns: ts,
                    runnable: o.runnable,
                    stack: o.stack.or_else(|| offcpu_stack(log, o.start, ts)),
                    waker: wakeup.map(|(_, tid, tgid)| (tid, tgid)),
                    woken_ns: wakeup.map(|(t, _, _)| t),
                });
            }
            _ => {}
        }
    }
    open.map(|o| OpenOff {
        stack: o.stack.or_else(|| offcpu_stack(log, o.start, until)),
        wakeup: last_wakeup(log, o.start, until).or(o.wakeup),
        ..o
    })
}

/// The stack taken when the thread left the CPU at `start` (it came back at `back`): the
/// same program run records it just before the switch.
pub(super) fn offcpu_stack(log: &ThreadLog, start: u64, back: u64) -> Option<u32> {
    let i = log
        .offcpu_stacks
        .partition_point(|(t, _)| *t + OFFCPU_STACK_SLACK < start);
    log.offcpu_stacks
        .get(i)
        .filter(|(t, _)| *t <= start + OFFCPU_STACK_SLACK && *t <= back)
        .map(|(_, id)| *id)
}

/// The last wakeup of the thread in `[from, to]`.
pub(super) fn last_wakeup(log: &ThreadLog, from: u64, to: u64) -> Option<(u64, u32, u32)> {
    log.wakeups
        .partition_point(|(t, _, _)| *t <= to)
        .checked_sub(1)
        .map(|i| log.wakeups[i])
        .filter(|(t, _, _)| *t >= from)
}

#[cfg(test)]
mod tests {
    /// Galloping finds the partition point a binary search finds, wherever it lies.
    #[test]
    fn gallop_finds_the_partition_point() {
        for len in 0..70u64 {
            let v: Vec<u64> = (0..len).map(|i| i * 3).collect();
            for at in 0..=len * 3 + 1 {
                let pred = |x: &u64| *x < at;
                assert_eq!(
                    super::gallop(&v, pred),
                    v.partition_point(pred),
                    "{len} {at}"
                );
            }
        }
    }
}
