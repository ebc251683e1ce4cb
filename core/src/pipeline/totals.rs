//! The run's totals, counted as each event arrives (summary.json's counts): calls and bytes
//! per NCCL function, CUDA sync waits, scheduler and memory events, stack records, and the
//! node counters' first and last readings.

use std::collections::BTreeMap;

use nccltrace_common::kind;

use super::Aggregator;
use crate::event::{Event, Library};

impl Aggregator {
    /// Counts one event in the totals without attributing it (it is before the window
    /// the attribution covers).
    pub(super) fn count(&mut self, event: &Event) {
        self.events += 1;
        self.last_ts = self.last_ts.max(event.ts_ns());
        if let Event::Call(call) = event {
            self.call_runs.entries += 1;
            self.call_runs.returns += u64::from(call.ret.is_some());
        }
        match event {
            Event::Call(call) => match call.func.library() {
                Library::Nccl => {
                    let s = self.nccl.entry(call.func).or_default();
                    s.calls += 1;
                    // Saturating: a damaged recording may carry any value.
                    s.bytes = s.bytes.saturating_add(call.bytes.unwrap_or(0));
                    if let Some(ret) = call.ret {
                        let enqueue = s.enqueue_ns.get_or_insert(0);
                        *enqueue = enqueue.saturating_add(call.duration_ns());
                        *s.errors.get_or_insert(0) += u64::from(ret != 0);
                    } else {
                        s.entry_only += 1;
                    }
                    self.threads.insert(call.task.tid);
                }
                Library::Cuda => {
                    let s = self.cuda.entry(call.func).or_default();
                    s.calls += 1;
                    s.wait_ns = s.wait_ns.saturating_add(call.duration_ns());
                }
                Library::Marker | Library::Nvtx => {}
            },
            Event::Switch {
                task,
                prev_is_target,
                prev_state,
                offcpu_same,
                ..
            } => {
                self.threads.insert(task.tid);
                if *prev_is_target {
                    self.sched.switches_out += 1;
                    self.sched.involuntary_switches += u64::from(*prev_state == 0);
                    self.count_folded(task, *offcpu_same);
                }
            }
            Event::Wakeup { .. } => self.sched.wakeups += 1,
            Event::Migrate { .. } => self.sched.migrations += 1,
            Event::Fork { .. } => self.sched.forks += 1,
            Event::Exit { .. } => self.sched.thread_exits += 1,
            Event::Fault { .. } => *self.memory.page_faults.get_or_insert(0) += 1,
            Event::FaultTime {
                ts_ns, start_ns, ..
            } => {
                self.memory.timed_faults += 1;
                self.memory.fault_handler_ns = self
                    .memory
                    .fault_handler_ns
                    .saturating_add(ts_ns.saturating_sub(*start_ns));
            }
            Event::PageMigration {
                succeeded, failed, ..
            } => {
                self.memory.pages_migrated = self.memory.pages_migrated.saturating_add(*succeeded);
                self.memory.page_migrations_failed =
                    self.memory.page_migrations_failed.saturating_add(*failed);
            }
            Event::NumaTask { .. } => self.memory.numa_task_events += 1,
            // Told in steps.json's `communicators`.
            Event::CommSize { .. } => {}
            Event::NumaPages { .. } => {
                *self.memory.numa_maps_readings.get_or_insert(0) += 1;
            }
            Event::MemSample { .. } => {
                *self.memory.pmu_load_samples.get_or_insert(0) += 1;
            }
            Event::NodeLoads { .. } => {
                *self.memory.node_load_readings.get_or_insert(0) += 1;
            }
            Event::NumaHint { pages, local, .. } => {
                let pages = u64::from(*pages);
                let add = |n: &mut Option<u64>, by: u64| *n = Some(n.unwrap_or(0) + by);
                add(&mut self.memory.numa_hint_fault_pages, pages);
                add(
                    &mut self.memory.numa_hint_fault_pages_remote,
                    if *local { 0 } else { pages },
                );
            }
            Event::Sample { .. } => self.samples += 1,
            Event::OffCpu { .. }
            | Event::CallStack { .. }
            | Event::StackSame { .. }
            | Event::PyStack { .. } => self.count_stack(event),
            Event::IbCounters {
                ts_ns,
                port,
                counters,
                ..
            } => {
                self.infiniband.add(*ts_ns, *port, counters);
                self.infiniband.keep_ends();
            }
            Event::Gpu { ts_ns, reading, .. } => self.gpu.add(*ts_ns, reading),
        }
    }

    /// The off-CPU stack a switch record says was reused (format 6): as the `StackSame`
    /// records it stands for (native frames: `with` 0, as decoded).
    fn count_folded(&mut self, task: &crate::event::Task, offcpu_same: Option<bool>) {
        if let Some(python) = offcpu_same {
            if python {
                self.count_same(task, kind::PY_FRAMES, kind::OFFCPU);
            }
            self.count_same(task, kind::OFFCPU, 0);
        }
    }

    /// A stack of kind `of` reused (Python frames: kept `with` a stack kind).
    fn count_same(&mut self, task: &crate::event::Task, of: u16, with: u16) {
        if of == kind::PY_FRAMES {
            let n = self.python_stacks_by_pid.entry(task.tgid).or_default();
            n.0 += 1;
            n.1 += 1;
        }
        self.stacks.reused(task.tid, of, with);
    }

    /// Off-CPU, call-entry and Python stack records, whole or reused.
    fn count_stack(&mut self, event: &Event) {
        match event {
            Event::OffCpu { task, .. } => self.stacks.whole(task.tid, kind::OFFCPU, 0),
            Event::CallStack { task, .. } => self.stacks.whole(task.tid, kind::CALL_STACK, 0),
            Event::StackSame { task, of, with, .. } => self.count_same(task, *of, *with),
            Event::PyStack { task, keyed, .. } => {
                self.python_stacks_by_pid.entry(task.tgid).or_default().0 += 1;
                if let Some(with) = keyed {
                    self.stacks.whole(task.tid, kind::PY_FRAMES, *with);
                }
            }
            _ => {}
        }
    }
}

/// Readings of each NUMA node's counters: (node, (counter, value)).
pub(super) type NodeCounters = Vec<(u32, Vec<(String, u64)>)>;
/// Each node's counters over a stretch: `node0` → counter → pages.
pub(super) type NodeDeltas = BTreeMap<String, BTreeMap<String, u64>>;

/// Each node's counters from `first` to `last` (`node0` → counter → pages); a counter
/// that went back is left out.
pub(super) fn numastat_delta(first: &NodeCounters, last: &NodeCounters) -> Option<NodeDeltas> {
    let out: NodeDeltas = last
        .iter()
        .filter_map(|(node, counters)| {
            let (_, then) = first.iter().find(|(n, _)| n == node)?;
            let deltas = counters
                .iter()
                .filter_map(|(name, v)| {
                    let (_, v0) = then.iter().find(|(n, _)| n == name)?;
                    Some((name.clone(), v.checked_sub(*v0)?))
                })
                .collect();
            Some((format!("node{node}"), deltas))
        })
        .collect();
    (!out.is_empty()).then_some(out)
}

/// Off-CPU and call-entry stack records counted, reused ones included.
#[derive(Default)]
pub(super) struct StackCounts {
    pub(super) offcpu: u64,
    pub(super) call: u64,
    pub(super) reused: u64,
    /// Reused with no whole record of their thread and kind before them.
    pub(super) unresolved: u64,
    /// Threads (and stack kinds, and for Python frames the stack kind they were kept
    /// for) with a whole stack record so far.
    bases: std::collections::HashSet<(u32, u16, u16), foldhash::fast::FixedState>,
}

impl StackCounts {
    fn add(&mut self, of: u16) {
        if of == kind::CALL_STACK {
            self.call += 1;
        } else if of == kind::OFFCPU {
            self.offcpu += 1;
        }
    }

    fn whole(&mut self, tid: u32, of: u16, with: u16) {
        self.add(of);
        self.bases.insert((tid, of, with));
    }

    fn reused(&mut self, tid: u32, of: u16, with: u16) {
        self.add(of);
        if of != kind::PY_FRAMES {
            self.reused += 1;
        }
        if !self.bases.contains(&(tid, of, with)) {
            self.unresolved += 1;
        }
    }
}
