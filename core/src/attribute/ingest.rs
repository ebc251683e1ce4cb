//! Each event into the thread logs: what every kind of record changes on the timeline.

use super::{Call, Change, Collective, Event, Library, RETRY_BYTES, Timeline, py_slot, remote};
use crate::event::Task;

impl Timeline {
    pub(super) fn call(&mut self, c: &Call) {
        if matches!(
            c.func,
            crate::event::Func::CommInitRank | crate::event::Func::CommInitRankConfig
        ) && let Some(r) = c.rank()
        {
            self.init_ranks.insert(c.task.tgid, r);
        }
        if matches!(
            c.func,
            crate::event::Func::CommInitRank
                | crate::event::Func::CommInitRankConfig
                | crate::event::Func::CommInitAll
        ) && let (Some(comm), Some(nranks)) = (c.new_comm(), c.nranks())
            && c.ret == Some(0)
        {
            self.comms.created(c.task.tgid, comm, nranks, c.rank());
            if let Some(id) = c.comm_id() {
                self.done.matcher.shares(c.task.tgid, id);
            }
        }
        if c.func.is_collective()
            && let Some(comm) = c.comm
        {
            self.comms.used(c.task.tgid, comm);
        }
        // A call is recorded at its return: one that began before the epoch it returned
        // in counts from that epoch's start (the earlier part is attributed already).
        let start_ns = c.start_ns.max(self.cut_ns);
        self.entry_only_seen |= !c.returned() && c.func.library() == Library::Nccl;
        self.calls.push(c.clone());
        let log = self.log(c.task.tid, c.task.tgid);
        match c.func.library() {
            Library::Marker => log.markers.push(c.start_ns),
            Library::Nvtx => log
                .nvtx
                .push((c.start_ns, c.message().unwrap_or_default().to_owned())),
            Library::Cuda => {
                log.changes.push((start_ns, Change::SyncStart));
                log.changes.push((c.end_ns, Change::SyncEnd));
                log.syncs.push((start_ns, c.end_ns));
                log.total_syncs += 1;
            }
            Library::Nccl => {
                // Traced at entry only: counted, but its inside is not known.
                if c.returned() {
                    log.changes.push((start_ns, Change::NcclStart));
                    log.changes.push((c.end_ns, Change::NcclEnd));
                }
                if c.func.is_collective() {
                    log.total_collectives += 1;
                    log.collectives.push(Collective {
                        func: c.func,
                        bytes: c.bytes.unwrap_or(0),
                        start_ns: c.start_ns,
                        end_ns: c.end_ns,
                        comm: c.comm.unwrap_or(0),
                    });
                }
            }
        }
    }

    #[allow(clippy::too_many_lines)] // one arm per event kind
    pub(super) fn ingest(&mut self, event: &Event) {
        match event {
            Event::Call(c) => self.call(c),
            Event::Switch {
                ts_ns,
                prev_tid,
                next_tid,
                next_tgid,
                prev_state,
                prev_is_target,
                next_is_target,
                task,
                offcpu_same,
            } => {
                // The off-CPU stack it left with, reused (format 6): as the `StackSame`
                // records before the switch record said (`task` is the task switched out
                // when that is a target).
                if let Some(python) = offcpu_same
                    && *prev_is_target
                {
                    if *python {
                        self.py_same(*ts_ns, *task, nccltrace_common::kind::OFFCPU);
                    }
                    self.native_same(*ts_ns, *task, nccltrace_common::kind::OFFCPU);
                }
                if *prev_is_target {
                    let log = self.log(*prev_tid, task.tgid);
                    log.first_switch_is_in.get_or_insert(false);
                    log.changes.push((
                        *ts_ns,
                        Change::SwitchOut {
                            runnable: *prev_state == 0,
                        },
                    ));
                }
                if *next_is_target {
                    let node = self.node(i32::from(task.cpu));
                    let log = self.log(*next_tid, *next_tgid);
                    log.first_switch_is_in.get_or_insert(true);
                    log.changes.push((*ts_ns, Change::SwitchIn));
                    if log.nodes.last().is_none_or(|(_, n)| *n != node) {
                        log.nodes.push((*ts_ns, node));
                    }
                }
            }
            Event::Wakeup {
                ts_ns,
                task,
                waker_tgid,
                waker_tid,
                ..
            } => {
                let own = *waker_tgid == task.tgid && *waker_tid != task.tid;
                let log = self.log(task.tid, task.tgid);
                log.changes.push((*ts_ns, Change::Wakeup { own }));
                log.wakeups.push((*ts_ns, *waker_tid, *waker_tgid));
            }
            Event::OffCpu {
                ts_ns,
                task,
                kstack,
                ustack,
            } => {
                let id = self.intern(*task, *ts_ns, kstack, ustack);
                let log = self.log(task.tid, task.tgid);
                log.offcpu_stacks.push((*ts_ns, id));
                let last = log.last_offcpu.get_or_insert_default();
                last.0.clone_from(kstack);
                last.1.clone_from(ustack);
            }
            Event::StackSame {
                ts_ns,
                task,
                of,
                with,
            } if *of == nccltrace_common::kind::PY_FRAMES => self.py_same(*ts_ns, *task, *with),
            Event::StackSame {
                ts_ns, task, of, ..
            } => self.native_same(*ts_ns, *task, *of),
            Event::Migrate {
                ts_ns,
                task,
                orig_cpu,
                dest_cpu,
            } => {
                let cross = self.node(*orig_cpu) != self.node(*dest_cpu);
                let log = self.log(task.tid, task.tgid);
                log.changes.push((*ts_ns, Change::Migrate));
                log.migrations.push((*ts_ns, cross));
                log.migration_cpus.push((*ts_ns, *orig_cpu, *dest_cpu));
            }
            Event::Fault {
                ts_ns, task, ip, ..
            } => {
                let log = self.log(task.tid, task.tgid);
                log.faults.push((*ts_ns, *ip));
                log.last_fault = Some((*ts_ns, *ip));
            }
            Event::PyStack {
                ts_ns,
                task,
                frames,
                keyed,
                ..
            } => {
                if let Some(with) = keyed {
                    self.log(task.tid, task.tgid).last_py[py_slot(*with)] = Some(frames.clone());
                }
                self.py_pending.insert(task.tid, (*ts_ns, frames.clone()));
            }
            Event::CallStack {
                ts_ns,
                task,
                ustack,
            } => {
                let id = self.intern(*task, *ts_ns, &[], ustack);
                let log = self.log(task.tid, task.tgid);
                log.call_stacks.push((*ts_ns, id));
                log.last_call.get_or_insert_default().clone_from(ustack);
            }
            Event::FaultTime {
                ts_ns,
                task,
                start_ns,
                ..
            } => {
                self.faults_timed = true;
                let cut_ns = self.cut_ns;
                let log = self.log(task.tid, task.tgid);
                // From the exception's entry (the page_fault_user tracepoint, just before
                // it) rather than the handler's: the entry path is the fault's cost too,
                // ~30% of it in an emulated guest.
                let entered = log
                    .last_fault
                    .filter(|(at, _)| *at <= *start_ns && *at >= log.last_fault_end);
                let start = entered.map_or(*start_ns, |(at, _)| at).max(cut_ns);
                // Its own time on the CPU, before the changes below are pushed (out of
                // time order).
                let on_cpu = ts_ns.saturating_sub(start).saturating_sub(off_cpu_within(
                    &log.changes,
                    start,
                    *ts_ns,
                ));
                // Back to back at one instruction (a loop touching fresh pages): from the
                // last fault's return to this one's entry the thread went back to user
                // mode and faulted again, with next to no work between. That way out
                // and in, which no probe sees, is fault time when shorter than the last
                // fault's own time on the CPU (a fault the thread was preempted or
                // blocked in is long, and a loop's whole compute phase after it once
                // counted as fault time in a busy guest).
                if let (Some((at, ip)), Some((last_ip, took))) = (entered, log.last_timed)
                    && ip.abs_diff(last_ip) < RETRY_BYTES
                    && at.saturating_sub(log.last_fault_end) < took
                    && log.last_fault_end >= cut_ns
                {
                    log.changes.push((log.last_fault_end, Change::FaultStart));
                    log.changes.push((at, Change::FaultEnd));
                }
                log.last_timed = entered.map(|(_, ip)| (ip, on_cpu));
                log.last_fault_end = *ts_ns;
                log.changes.push((start, Change::FaultStart));
                log.changes.push((*ts_ns, Change::FaultEnd));
            }
            Event::Sample {
                ts_ns,
                task,
                kstack,
                ustack,
            } => {
                let in_handler = kstack
                    .iter()
                    .any(|ip| self.fault_ranges.iter().any(|(a, b)| (*a..*b).contains(ip)));
                // The CUDA driver yielding the CPU: `sched_yield` called from libcuda.
                let in_yield = kstack
                    .iter()
                    .any(|ip| self.yield_ranges.iter().any(|(a, b)| (*a..*b).contains(ip)));
                if in_yield && let Some(&ip) = ustack.first() {
                    self.yield_ips.insert((task.tgid, ip));
                }
                let in_yield = in_yield
                    || (!kstack.is_empty()
                        && ustack
                            .first()
                            .is_some_and(|ip| self.yield_ips.contains(&(task.tgid, *ip))));
                let driver_yield = !in_handler
                    && in_yield
                    && self.cuda_text.get(&task.tgid).is_some_and(|text| {
                        ustack
                            .iter()
                            .any(|ip| text.iter().any(|(a, b)| (*a..*b).contains(ip)))
                    });
                let period = self.sample_period_ns;
                let window = 2 * period.max(1);
                self.driver_yields_seen += u64::from(driver_yield);
                let stack = self.intern(*task, *ts_ns, kstack, ustack);
                let log = self.log(task.tid, task.tgid);
                // In user mode on the instruction that just faulted, or right after it:
                // the return from the fault (a pending timer interrupt is delivered
                // there) and the retried access with its TLB refill are the fault's cost.
                // Near its entry, or its handler's return where fentry/fexit timed it.
                let retrying = kstack.is_empty()
                    && log.last_fault.is_some_and(|(at, ip)| {
                        ustack
                            .first()
                            .is_some_and(|u| (ip..ip + RETRY_BYTES).contains(u))
                            && ts_ns.saturating_sub(at.max(log.last_fault_end)) < window
                    });
                let in_fault = in_handler || retrying;
                if in_fault {
                    log.fault_samples.push((*ts_ns, log.last_sample));
                }
                if driver_yield {
                    log.driver_yields.push((*ts_ns, period));
                }
                log.stack_samples.push((*ts_ns, stack, in_fault));
                log.last_sample = Some(*ts_ns);
            }
            Event::PageMigration {
                ts_ns,
                task,
                succeeded,
                ..
            } => {
                self.page_migrations.push((task.tid, *ts_ns, *succeeded));
            }
            Event::NumaTask { ts_ns, task, .. } => self.numa_moves.push((task.tid, *ts_ns)),
            Event::NumaHint {
                ts_ns,
                task,
                cpu,
                mem_node,
                pages,
                local,
                ..
            } => {
                let hint = remote::Hint::new(
                    *ts_ns,
                    *pages,
                    *local,
                    *cpu,
                    *mem_node,
                    &self.cpu_nodes,
                    &self.node_distances,
                );
                self.numa_hints_seen += 1;
                self.log(task.tid, task.tgid).numa_hints.push(hint);
            }
            Event::CommSize {
                task,
                comm,
                nranks,
                rank,
                ..
            } => self.comms.read(task.tgid, *comm, *nranks, *rank),
            Event::NumaPages { ts_ns, task, kib } => {
                self.resident_seen += 1;
                let distances = &self.node_distances;
                for log in self.threads.values_mut().filter(|l| l.pid == task.tgid) {
                    let Some(&(_, node)) = log.nodes.last() else {
                        continue;
                    };
                    if let Some(r) = remote::Resident::new(*ts_ns, kib, node, distances) {
                        log.resident.push(r);
                    }
                }
            }
            Event::MemSample {
                ts_ns,
                task,
                weight,
                data_src,
            } => {
                let sample = crate::pmu::MemSample {
                    pid: task.tgid,
                    tid: task.tid,
                    time_ns: *ts_ns,
                    weight: *weight,
                    data_src: *data_src,
                };
                self.log(task.tid, task.tgid).mem_samples.push(sample);
            }
            Event::NodeLoads {
                ts_ns,
                task,
                dram,
                remote: far,
                multiplexed,
                full,
            } => {
                self.node_loads_seen += 1;
                self.node_loads_multiplexed += u64::from(*multiplexed);
                if *full {
                    self.node_loads_latest = self.node_loads_latest.max(Some(*ts_ns));
                }
                let reading = remote::LoadReading {
                    ts_ns: *ts_ns,
                    dram: *dram,
                    remote: *far,
                };
                self.log(task.tid, task.tgid).node_loads.push(reading);
            }
            Event::IbCounters {
                ts_ns,
                port,
                counters,
                ..
            } => self.infiniband.add(*ts_ns, *port, counters),
            Event::Gpu { ts_ns, reading, .. } => self.gpu.add(*ts_ns, reading),
            // The process ended: its last thread, or its main thread where the kernel's
            // tracepoint has no `group_dead` field (older kernels: it reads false).
            Event::Exit {
                ts_ns,
                task,
                group_dead,
            } if *group_dead || task.tid == task.tgid => self.exited.push((*ts_ns, task.tgid)),
            Event::Fork { .. } | Event::Exit { .. } => {}
        }
    }
}

impl Timeline {
    /// Python frames reused: the thread's previous ones for the stack kind `with`, for the
    /// stack record that follows; none when that walk was lost or is in an earlier
    /// recording window.
    fn py_same(&mut self, ts_ns: u64, task: Task, with: u16) {
        let log = self.log(task.tid, task.tgid);
        if let Some(frames) = log.last_py[py_slot(with)].clone() {
            self.py_pending.insert(task.tid, (ts_ns, frames));
        }
    }

    /// Native frames reused: those of the thread's previous record of kind `of`; none when
    /// that record was lost or is in an earlier recording window.
    fn native_same(&mut self, ts_ns: u64, task: Task, of: u16) {
        let log = self.log(task.tid, task.tgid);
        let last = if of == nccltrace_common::kind::CALL_STACK {
            log.last_call.take().map(|u| (Vec::new(), u))
        } else {
            log.last_offcpu.take()
        };
        if let Some((kstack, ustack)) = last {
            let id = self.intern(task, ts_ns, &kstack, &ustack);
            let log = self.log(task.tid, task.tgid);
            if of == nccltrace_common::kind::CALL_STACK {
                log.call_stacks.push((ts_ns, id));
                log.last_call = Some(ustack);
            } else {
                log.offcpu_stacks.push((ts_ns, id));
                log.last_offcpu = Some((kstack, ustack));
            }
        }
    }
}

/// How long a thread was off the CPU within `[start, end)` (`end`: now), from its
/// switches out and back in since `start`. The changes were pushed as their events came,
/// in time order, but for a call's start and the stretch between two faults, pushed at
/// their end: one from before `start` ends the walk, as every change of the window was
/// pushed after it.
fn off_cpu_within(changes: &[(u64, Change)], start: u64, end: u64) -> u64 {
    let mut off = 0;
    // Walking back from `end`: when the thread came back in, while a switch-out before
    // it is looked for.
    let mut back_in: Option<u64> = None;
    for &(ts, change) in changes.iter().rev() {
        match change {
            Change::SwitchIn => back_in = Some(ts.min(end)),
            Change::SwitchOut { .. } => {
                if let Some(back) = back_in.take() {
                    off += back.saturating_sub(ts.max(start));
                }
            }
            _ => {}
        }
        if ts < start {
            break;
        }
    }
    // Came back in with no switch-out since `start`: off from `start`.
    off + back_in.map_or(0, |back| back.saturating_sub(start))
}
