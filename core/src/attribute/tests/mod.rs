//! The attribution's unit tests: timelines built event by event, attributed, checked.

use super::steps::Method;
use super::*;

mod faults;
mod jobs;
mod remote;
mod stacks;

/// A stored stack, borrowed as the interning takes it.
fn frames(k: &StackKey) -> super::detail::Frames<'_> {
    super::detail::Frames {
        pid: k.pid,
        kstack: &k.kstack,
        ustack: &k.ustack,
        py: &k.py,
    }
}

/// Stacks are interned once each; stacks whose hashes collide (a hasher that hashes
/// everything alike) still get ids of their own, and the same ids again.
#[test]
fn stacks_interned_once_even_when_hashes_collide() {
    #[derive(Default)]
    struct Alike;
    impl std::hash::BuildHasher for Alike {
        type Hasher = Alike;
        fn build_hasher(&self) -> Alike {
            Alike
        }
    }
    impl std::hash::Hasher for Alike {
        fn finish(&self) -> u64 {
            7
        }
        fn write(&mut self, _: &[u8]) {}
    }
    let key = |pid, ip| StackKey {
        pid,
        kstack: vec![ip],
        ustack: vec![ip + 1],
        py: Vec::new(),
    };
    let mut ids = StackIds::<Alike>::default();
    let mut table = Vec::new();
    let keys = [
        key(1, 10),
        key(1, 20),
        key(2, 10),
        key(1, 20),
        key(1, 10),
        key(2, 10),
    ];
    let got: Vec<u32> = keys
        .into_iter()
        .map(|k| ids.intern(&mut table, frames(&k)))
        .collect();
    assert_eq!(got, [0, 1, 2, 1, 0, 2]);
    assert_eq!(table, [key(1, 10), key(1, 20), key(2, 10)]);
    let mut ids = StackIds::<foldhash::fast::RandomState>::default();
    let mut table = Vec::new();
    assert_eq!(ids.intern(&mut table, frames(&key(1, 10))), 0);
    assert_eq!(ids.intern(&mut table, frames(&key(1, 10))), 0);
    assert!(ids.collisions.is_empty());
}
/// The changes' sort gives the standard sort's order: on a log in order but for starts
/// added late (the fast path), and on one in no order (past the budget, the fallback).
#[test]
fn nearly_sorted_changes_sort_as_the_standard_sort() {
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let changes = [
        Change::SwitchIn,
        Change::SwitchOut { runnable: true },
        Change::SyncStart,
        Change::SyncEnd,
        Change::FaultStart,
    ];
    for shuffled in [false, true] {
        let mut v: Vec<(u64, Change)> = Vec::new();
        let mut ts = 0;
        for _ in 0..5_000 {
            ts += next() % 1_000;
            let c = changes[(next() % 5) as usize];
            if shuffled {
                v.push((next() % 5_000_000, c));
            } else if next() % 4 == 0 {
                // A start, added at its end: a few hundred µs back.
                v.push((ts.saturating_sub(next() % 400_000), c));
            } else {
                v.push((ts, c));
            }
        }
        let mut want = v.clone();
        want.sort_unstable();
        super::epoch::sort_nearly(&mut v);
        assert_eq!(v, want, "shuffled: {shuffled}");
    }
    let mut empty: Vec<(u64, Change)> = Vec::new();
    super::epoch::sort_nearly(&mut empty);
}

use crate::event::Func;
use crate::record::{ClockRef, Header};

fn header() -> Header {
    Header {
        clock: ClockRef {
            monotonic_ns: 0,
            realtime_ns: 0,
        },
        cpu_nodes: vec![0, 0, 1, 1],
        sample_period_ns: 100_000,
        fault_handler_ranges: vec![(0xffff_0000, 0xffff_1000)],
        targets: vec![crate::record::TargetInfo {
            pid: 10,
            probes: vec![crate::record::ProbeInfo {
                func: "cuStreamSynchronize".into(),
                symbol: "cuStreamSynchronize".into(),
                library: "libcuda.so.1".into(),
                file_offset: 0,
                past_endbr64: false,
            }],
            ..Default::default()
        }],
        ..Header::default()
    }
}

/// Regression (issue 18): each step scanned every page migration and NUMA move of the
/// run; now they are sorted once and each step takes its own stretch. Events pushed
/// out of time order, of the rank thread and another, land in the right steps.
#[test]
fn numa_events_counted_per_step() {
    let mut tl = Timeline::new(&Setup::from(&header()));
    tl.push(&call(Func::AllReduce, 100, 200));
    let migration = |ts_ns, tid| Event::PageMigration {
        ts_ns,
        task: task(tid),
        succeeded: 4,
        failed: 0,
        mode: 0,
        reason: 0,
    };
    let moved = |ts_ns, tid| Event::NumaTask {
        ts_ns,
        task: task(tid),
        kind: crate::event::NumaTaskKind::Move,
        src_cpu: 0,
        src_nid: 0,
        dst_cpu: 2,
        dst_nid: 1,
    };
    for e in [
        migration(15_000, 10),
        migration(5_000, 10),
        migration(6_000, 11),
        moved(12_000, 10),
        moved(3_000, 10),
        moved(4_000, 10),
    ] {
        tl.push(&e);
    }
    let (report, _) = tl.finish(20_000, StepRule::Window(10_000));
    let counts: Vec<(u64, u64)> = report
        .steps
        .iter()
        .map(|s| (s.numa_page_migrations, s.numa_task_moves))
        .collect();
    assert_eq!(counts, [(4, 2), (4, 1)]);
}

/// Regression (issue 17): `--profile minimal` (no CUDA sync probe) showed nccl_wait
/// 0.000 and `--sample-hz 0` page_fault 0. A category the run could not measure is
/// null in every output, with the reason in `methods`; the categories measured still
/// add up.
#[test]
fn unmeasured_categories_are_null() {
    let mut bare = header();
    bare.targets[0].probes.clear();
    bare.sample_period_ns = 0;
    let mut tl = Timeline::new(&Setup::from(&bare));
    tl.push(&call(Func::AllReduce, 3_000, 3_100));
    let (report, _) = tl.finish(10_000, StepRule::Window(10_000));
    let json = serde_json::to_value(&report).unwrap();
    for c in [
        &json["steps"][0]["categories_ns"],
        &json["threads"][0]["categories_ns"],
    ] {
        assert!(c["nccl_wait"].is_null(), "{c}");
        assert!(c["page_fault"].is_null(), "{c}");
        assert_eq!(c["compute"], 10_000, "{c}");
    }
    assert!(report.methods.nccl_wait.starts_with("not measured"));
    assert!(report.methods.page_fault.starts_with("not measured"));
    // Regression (issue 18): sampling on but no fault handler addresses (no kallsyms):
    // fault time was silently 0 while the method said "samples".
    let mut no_kallsyms = header();
    no_kallsyms.fault_handler_ranges.clear();
    let mut tl = Timeline::new(&Setup::from(&no_kallsyms));
    tl.push(&call(Func::AllReduce, 3_000, 3_100));
    let (report, _) = tl.finish(10_000, StepRule::Window(10_000));
    let json = serde_json::to_value(&report).unwrap();
    assert!(json["threads"][0]["categories_ns"]["page_fault"].is_null());
    assert!(
        report.methods.page_fault.contains("kallsyms"),
        "{}",
        report.methods.page_fault
    );
    // Measured (the sync probed, sampling on): numbers, not null.
    let mut tl = Timeline::new(&Setup::from(&header()));
    tl.push(&call(Func::AllReduce, 3_000, 3_100));
    let (report, _) = tl.finish(10_000, StepRule::Window(10_000));
    let json = serde_json::to_value(&report).unwrap();
    assert_eq!(json["threads"][0]["categories_ns"]["nccl_wait"], 0);
    assert_eq!(json["threads"][0]["categories_ns"]["page_fault"], 0);
}

fn task(tid: u32) -> Task {
    Task {
        tgid: 10,
        tid,
        cpu: 0,
    }
}

fn call(func: Func, start: u64, end: u64) -> Event {
    Event::Call(Call {
        count: Some(256),
        datatype: Some(7),
        bytes: Some(1024),
        comm: Some(1),
        stream: Some(2),
        ..Call::new(task(10), func, start, end)
    })
}

fn switch(ts: u64, out: bool, state: i64) -> Event {
    switch_of(10, ts, out, state)
}

/// A `StackSame` record of thread `tid`: its stack of kind `of` is the previous one's.
fn stack_same(ts: u64, tid: u32, of: u16) -> Event {
    py_same(ts, tid, of, 0)
}

/// A `StackSame` record of kind `of`, for Python frames those kept `with` a stack kind
/// (0: before format 5, one walk kept for both).
fn py_same(ts: u64, tid: u32, of: u16, with: u16) -> Event {
    Event::StackSame {
        ts_ns: ts,
        task: task(tid),
        of,
        with,
    }
}

/// A Python walk of thread `tid`: one frame of code object `code`, kept for the stack
/// kind `keyed` (0: for both, before format 5).
fn py_stack(ts: u64, tid: u32, code: u64, keyed: Option<u16>) -> Event {
    Event::PyStack {
        ts_ns: ts,
        task: task(tid),
        frames: vec![PyFrame { code, offset: 4 }],
        truncated: false,
        keyed,
    }
}

/// 20,000 calls of 1 µs, one every 2 µs from 1 ms on (40 ms); with `switches`, the
/// thread preempted for 300 ns after every third.
fn one_microsecond_calls(tl: &mut Timeline, switches: bool) {
    for i in 0..20_000u64 {
        let t = 1_000_000 + i * 2_000;
        tl.push(&Event::Call(Call::new(
            task(10),
            Func::AllReduce,
            t,
            t + 1_000,
        )));
        if switches && i % 3 == 0 {
            tl.push(&switch(t + 1_200, true, 0));
            tl.push(&switch(t + 1_500, false, 0));
        }
    }
}

/// With µs-long steps an epoch waits until its buffer spans twice the reorder horizon
/// (else most of each try's buffer was held back and searched again at the next): 40 ms
/// of 2-µs calls in epochs of 2,048 events make at most three epochs (eight before), and
/// find the same steps as one epoch over the whole run.
#[test]
fn short_steps_wait_for_the_reorder_horizon() {
    let run = |epoch_events: u64| {
        let mut tl = Timeline::new(&Setup::from(&header()));
        tl.stream(StepRule::Window(100_000), epoch_events);
        one_microsecond_calls(&mut tl, false);
        tl.finish(41_000_000, StepRule::Window(100_000)).0
    };
    let (epochs, whole) = (run(2_048), run(0));
    assert!(epochs.epochs <= 3, "{} epochs", epochs.epochs);
    assert_eq!(epochs.steps.len(), whole.steps.len());
    assert!(whole.steps.len() >= 390, "{} steps", whole.steps.len());
}

/// An epoch's steps made on two threads are the ones made on one: thousands of 1-µs
/// steps an epoch, the thread switching off and on the CPU every 3 µs.
#[test]
fn steps_made_on_two_threads_are_the_same() {
    let run = |parallel: bool| {
        let mut tl = Timeline::new(&Setup::from(&header()));
        tl.parallel_steps = parallel;
        tl.stream(StepRule::Window(1_000), 4_096);
        one_microsecond_calls(&mut tl, true);
        tl.finish(41_000_000, StepRule::Window(1_000)).0
    };
    let (one, two) = (run(false), run(true));
    assert!(one.steps.len() >= 30_000, "{} steps", one.steps.len());
    assert!(one.epochs >= 2, "{} epochs", one.epochs);
    assert_eq!(one.steps.len(), two.steps.len());
    assert!(one.steps == two.steps);
    assert!(one.steps.iter().any(|s| s.categories.runqueue > 0));
}

/// A run that went quiet has its closed steps attributed at the next idle try, without
/// waiting for its buffer to span twice the reorder horizon (no more records may come):
/// 100-µs steps, 16 ms of records past the cut, then nothing (fails if the idle try waits).
#[test]
fn a_quiet_run_is_attributed_without_waiting_for_the_horizon() {
    let mut tl = Timeline::new(&Setup::from(&header()));
    tl.stream(StepRule::Window(100_000), 64);
    let call = |us: u64| {
        let t = us * 1_000;
        Event::Call(Call::new(task(10), Func::AllReduce, t, t + 50_000))
    };
    // A call every 100 µs up to the first epoch.
    let mut us = 1_000;
    while tl.epochs_done() == 0 {
        assert!(us < 100_000, "no epoch in 100 ms of records");
        tl.push(&call(us));
        us += 100;
    }
    // Then up to 16 ms past the cut, and quiet: steps closed before the horizon, but less
    // than twice the horizon since the cut.
    let end_us = tl.cut_ns / 1_000 + 16_000;
    assert!(us < end_us, "the first epoch came late: {us} µs");
    for us in (us..end_us).step_by(100) {
        tl.push(&call(us));
    }
    assert_eq!(tl.epochs_done(), 1);
    tl.try_epoch_now();
    assert_eq!(tl.epochs_done(), 2, "the idle try attributed nothing");
}

/// Off-CPU stacks taken as the thread comes back are timed at its switch-out
/// (`Header::offcpu_min_ns`): here 39 ms earlier, epochs ago. The stretch still gets
/// its stack; late records of any other kind stay left out and counted.
#[test]
fn stack_taken_at_the_switch_in_finds_its_stretch_across_epochs() {
    let mut tl = Timeline::new(&Setup::from(&header()));
    tl.stream(StepRule::Window(1_000_000), 8);
    let other = Task {
        tgid: 10,
        tid: 11,
        cpu: 1,
    };
    let mut events = vec![switch(1_000_000, true, 1)];
    for ms in 0..60u64 {
        let t = ms * 1_000_000 + 500_000;
        events.push(Event::Call(Call::new(other, Func::AllReduce, t, t + 1_000)));
    }
    events.sort_by_key(Event::ts_ns);
    let back = events.partition_point(|e| e.ts_ns() < 40_000_000);
    events.insert(back, switch(40_000_000, false, 0));
    // What the kernel submits just after the switch-in: the stacks, timed at the
    // switch-out.
    events.insert(
        back + 1,
        Event::OffCpu {
            ts_ns: 1_000_000,
            task: task(10),
            kstack: vec![0xffff_2000],
            ustack: vec![7],
        },
    );
    // A late record of another kind is still left out.
    events.insert(
        back + 2,
        Event::Wakeup {
            ts_ns: 2_000_000,
            task: task(10),
            waker_tid: 11,
            waker_tgid: 10,
        },
    );
    for e in &events {
        tl.push(e);
    }
    let (report, detail) = tl.finish(61_000_000, StepRule::Window(1_000_000));
    assert_eq!(report.late_events_left_out, 1);
    let thread = detail.threads.iter().find(|t| t.tid == 10).unwrap();
    let off: Vec<&OffCpu> = thread
        .offcpu
        .iter()
        .filter(|o| o.start_ns == 1_000_000)
        .collect();
    assert_eq!(off.len(), 1, "{:?}", thread.offcpu);
    assert_eq!(off[0].end_ns, 40_000_000);
    let stack = off[0].stack.expect("the stretch has its stack");
    assert_eq!(detail.stacks[stack as usize].kstack, vec![0xffff_2000]);
}

/// One step of known shape: 1 ms compute (200 µs of it page faults, by samples), a
/// 500 µs preemption with a cross-node migration 100 µs in, an async AllReduce, a 3 ms
/// sync sleeping while NCCL work is outstanding, 1 ms blocked elsewhere. Every
/// nanosecond lands in its category.
#[test]
fn one_step_partitioned() {
    let mut tl = Timeline::new(&Setup::from(&header()));
    let mut events = vec![];
    for step in 0..3u64 {
        let t = step * 10_000_000;
        // Compute 0..1 ms; faults sampled at 2 points (2 × 100 µs).
        events.push(Event::Sample {
            ts_ns: t + 100_000,
            task: task(10),
            kstack: vec![0xffff_0010],
            ustack: vec![],
        });
        events.push(Event::Sample {
            ts_ns: t + 200_000,
            task: task(10),
            kstack: vec![0xffff_0020],
            ustack: vec![],
        });
        events.push(Event::Sample {
            ts_ns: t + 300_000,
            task: task(10),
            kstack: vec![],
            ustack: vec![1],
        });
        // Preempted 1.0..1.5 ms, migrated to node 1.
        events.push(switch(t + 1_000_000, true, 0));
        events.push(Event::Migrate {
            ts_ns: t + 1_100_000,
            task: task(10),
            orig_cpu: 0,
            dest_cpu: 2,
        });
        events.push(switch(t + 1_500_000, false, 0));
        events.push(call(Func::AllReduce, t + 1_500_000, t + 1_510_000));
        // Sync 1.51..4.51 ms, asleep 1.6..4.5 ms.
        events.push(switch(t + 1_600_000, true, 1));
        events.push(Event::Wakeup {
            ts_ns: t + 4_400_000,
            task: task(10),
            waker_tid: 1,
            waker_tgid: 1,
        });
        events.push(switch(t + 4_500_000, false, 0));
        events.push(call(
            Func::CuStreamSynchronize,
            t + 1_510_000,
            t + 4_510_000,
        ));
        // Blocked on something else 5..6 ms.
        events.push(switch(t + 5_000_000, true, 1));
        events.push(switch(t + 6_000_000, false, 0));
    }
    events.sort_by_key(Event::ts_ns);
    for e in &events {
        tl.push(e);
    }
    let (report, _) = tl.finish(30_000_000, StepRule::Auto);
    assert_eq!(report.method, Method::Auto);
    assert_eq!(report.rank_tid, Some(10));
    assert_eq!(report.steps.len(), 2);
    let s = &report.steps[0];
    assert_eq!(s.wall_ns, 10_000_000);
    assert_eq!(s.categories.total(), s.wall_ns);
    assert_eq!(s.categories.nccl_wait, 3_000_000);
    assert_eq!(s.categories.page_fault, 200_000);
    // Preempted 500 µs, migrated 100 µs in: the wait after the migration is its cost.
    assert_eq!(s.categories.cpu_migration, 400_000);
    assert_eq!(s.categories.runqueue, 100_000);
    assert_eq!(s.categories.other_offcpu, 1_000_000);
    assert_eq!(s.categories.remote_memory, None);
    assert_eq!((s.migrations, s.cross_node_migrations), (1, 1));
    assert_eq!(
        s.nccl,
        NcclCount {
            collectives: 1,
            bytes: 1024
        }
    );
}

/// A sync with no NCCL work since the previous sync waits for the GPU's own work:
/// `gpu_wait`, not `nccl_wait`; a spinning sync with NCCL outstanding is `nccl_wait`,
/// although on-CPU.
#[test]
fn only_syncs_after_collectives_are_nccl_waits() {
    let mut tl = Timeline::new(&Setup::from(&header()));
    for e in [
        call(Func::CuStreamSynchronize, 1_000, 2_000),
        call(Func::AllReduce, 3_000, 3_100),
        call(Func::CuStreamSynchronize, 4_000, 9_000),
    ] {
        tl.push(&e);
    }
    let (report, _) = tl.finish(10_000, StepRule::Window(10_000));
    assert_eq!(report.method, Method::Window);
    let t = &report.threads[0].categories;
    assert_eq!(t.nccl_wait, 5_000);
    assert_eq!(t.gpu_wait, 1_000);
    assert_eq!(t.compute, 4_000);
    assert_eq!(t.total(), 10_000);
    assert!(report.methods.nccl_wait.starts_with("an upper bound"));
    assert_eq!(report.communicators[0].nranks, None);
}

/// The collectives of `tl`'s one thread after its communicator (handle 1) is known: an
/// all-reduce, then the sync that waits for it. (nccl_wait, gpu_wait) of the run.
fn waits_after(mut tl: Timeline, known: Option<Event>) -> ((u64, u64), StepsReport) {
    for e in known.into_iter().chain([
        call(Func::AllReduce, 3_000, 3_100),
        call(Func::CuStreamSynchronize, 4_000, 9_000),
    ]) {
        tl.push(&e);
    }
    let (report, _) = tl.finish(10_000, StepRule::Window(10_000));
    let t = report.threads[0].categories;
    ((t.nccl_wait, t.gpu_wait), report)
}

/// Regression (issue 51): a one-rank communicator communicates nothing (on the H100 a
/// DDP job of world size 1 read "13% of step time waits on NCCL" while its NCCL kernels
/// took 0.0 ms a step). Its size from ncclCommInitRank, from the communicator's memory
/// (made before attach) or from a job size of 1 in the environment makes the sync after
/// its collectives `gpu_wait`; a communicator of two ranks keeps it `nccl_wait`.
#[test]
fn a_one_rank_communicator_waits_for_the_gpu_only() {
    let init = |nranks: i32| {
        let mut c = Call::new(task(10), Func::CommInitRank, 100, 200);
        *c.extra_mut() = crate::event::CallExtra {
            nranks: Some(nranks),
            rank: Some(0),
            new_comm: Some(1),
            ..Default::default()
        };
        Event::Call(c)
    };
    let read = |nranks: i32| Event::CommSize {
        ts_ns: 150,
        task: task(10),
        comm: 1,
        nranks,
        rank: Some(0),
    };
    let timeline = || Timeline::new(&Setup::from(&header()));
    let (waits, report) = waits_after(timeline(), Some(init(1)));
    assert_eq!(waits, (0, 5_000));
    assert_eq!(report.communicators[0].nranks_from, "ncclCommInitRank");
    assert_eq!(waits_after(timeline(), Some(init(2))).0, (5_000, 0));
    let (waits, report) = waits_after(timeline(), Some(read(1)));
    assert_eq!(waits, (0, 5_000));
    assert_eq!(report.communicators[0].nranks_from, "memory");
    assert!(
        report.methods.nccl_wait.contains("1 of one rank"),
        "{}",
        report.methods.nccl_wait
    );
    assert_eq!(waits_after(timeline(), Some(read(8))).0, (5_000, 0));
    // The job's size from the environment, where the communicator's is unknown.
    let sized = |n: i32| {
        let mut h = header();
        h.targets[0].world_size = Some(("WORLD_SIZE".into(), n));
        Timeline::new(&Setup::from(&h))
    };
    let (waits, report) = waits_after(sized(1), None);
    assert_eq!(waits, (0, 5_000));
    assert_eq!(
        report.communicators[0].nranks_from,
        "environment WORLD_SIZE=1"
    );
    assert_eq!(waits_after(sized(2), None).0, (5_000, 0));
    // The creation's arguments win over a size read later.
    assert_eq!(waits_after(sized(1), Some(init(4))).0, (5_000, 0));
}

/// Regression (issue 51): eight one-rank jobs sharing one GPU read as one job of eight
/// ranks, one named the straggler "731 ms late on average". Processes whose collectives
/// are all on one-rank communicators are jobs of their own: no straggler among them, even
/// where one arrives later each time; the same processes on a communicator of two ranks
/// are matched and the late one named.
#[test]
fn one_rank_jobs_have_no_straggler() {
    let run = |nranks: i32| {
        let mut h = header();
        let mut other = h.targets[0].clone();
        other.pid = 11;
        h.targets.push(other);
        let mut tl = Timeline::new(&Setup::from(&h));
        let on = |pid: u32| Task {
            tgid: pid,
            tid: pid,
            cpu: 0,
        };
        for pid in [10, 11] {
            tl.push(&Event::CommSize {
                ts_ns: 1,
                task: on(pid),
                comm: 1,
                nranks,
                rank: Some(i32::try_from(pid - 10).unwrap()),
            });
        }
        for i in 0..40u64 {
            let at = 1_000 + i * 10_000;
            for (pid, late) in [(10, 0), (11, 3_000)] {
                let mut c = Call::new(on(pid), Func::AllReduce, at + late, at + late + 100);
                c.comm = Some(1);
                c.bytes = Some(1024);
                tl.push(&Event::Call(c));
                tl.push(&Event::Call(Call::new(
                    on(pid),
                    Func::CuStreamSynchronize,
                    at + 4_000,
                    at + 5_000,
                )));
            }
        }
        tl.finish(500_000, StepRule::Auto).0
    };
    let alone = run(1);
    assert_eq!(alone.straggler, None);
    assert!(alone.stragglers_by_job.is_empty());
    assert_eq!(alone.one_rank_jobs, [10, 11]);
    let together = run(2);
    assert_eq!(together.straggler.map(|s| s.pid), Some(11));
    assert!(together.one_rank_jobs.is_empty());
}

/// The rank sleeping `[from, to)`: off the CPU and back every 10 ms.
fn sleeping(from: u64, to: u64) -> Vec<Event> {
    (from..to)
        .step_by(10_000_000)
        .flat_map(|t| [switch(t, true, 1), switch(t + 9_000_000, false, 0)])
        .collect()
}

/// Training steps of 10 ms in `[from, to)`: an all-reduce, then the sync that waits for it.
fn training(from: u64, to: u64) -> Vec<Event> {
    (from..to)
        .step_by(10_000_000)
        .flat_map(|t| {
            [
                call(Func::AllReduce, t + 1_000_000, t + 1_100_000),
                call(Func::CuStreamSynchronize, t + 6_000_000, t + 9_000_000),
            ]
        })
        .collect()
}

/// Regression (issue 51): a script that sleeps before its loop had its first four
/// "steps" made of 1-s windows of the sleep (0 collectives), p99 step 1000 ms, and a
/// sleep-only process was cut into steps. A stretch without collectives before the first
/// step, after the last, or a whole run of them, is idle: named in steps.json `idle`,
/// never a step; attributed in epochs as the agent does (the sleep in epochs of its own,
/// before any step is found) or at once.
#[test]
fn idle_is_not_a_step() {
    // The first sleep's switches out each with the stack they left with.
    let asleep = |ts: u64| Event::OffCpu {
        ts_ns: ts,
        task: task(10),
        kstack: vec![0xffff_0000_0000_1000],
        ustack: vec![0x4000_1234, 0x4000_0100],
    };
    let events: Vec<Event> = sleeping(0, 3_000_000_000)
        .into_iter()
        .flat_map(|e| match e {
            Event::Switch {
                ts_ns,
                prev_is_target: true,
                ..
            } => vec![asleep(ts_ns), e],
            e => vec![e],
        })
        .chain(training(3_000_000_000, 3_400_000_000))
        .chain(sleeping(3_400_000_000, 5_400_000_000))
        .collect();
    for epoch_events in [0, 50] {
        let mut tl = Timeline::new(&Setup::from(&header()));
        tl.stream(StepRule::Auto, epoch_events);
        for e in &events {
            tl.push(e);
        }
        let (report, _) = tl.finish(5_400_000_000, StepRule::Auto);
        assert_eq!(report.method, Method::Auto, "epochs of {epoch_events}");
        assert!(
            report
                .steps
                .iter()
                .all(|s| s.wall_ns == 10_000_000 && s.nccl.collectives == 1),
            "epochs of {epoch_events}: {:?}",
            report
                .steps
                .iter()
                .map(|s| (s.start_ns, s.wall_ns))
                .collect::<Vec<_>>()
        );
        assert!(report.steps.len() >= 38, "{} steps", report.steps.len());
        let idle: Vec<(&str, u64)> = report
            .idle
            .iter()
            .map(|i| (i.when, i.wall_ns / 100_000_000))
            .collect();
        assert_eq!(
            idle,
            [("before the first step", 30), ("after the last step", 20)],
            "epochs of {epoch_events}: {:?}",
            report.idle
        );
        let before = &report.idle[0];
        assert_eq!(before.categories.total(), before.wall_ns);
        assert!(before.categories.other_offcpu > 2_000_000_000, "{before:?}");
        // Where it slept: one stack, blocked, for all 9 ms of each 10 the sleep was off-CPU.
        let stacks: Vec<(u8, u64)> = before
            .stack_ns
            .iter()
            .map(|((_, k), ns)| (*k, *ns))
            .collect();
        assert_eq!(stacks, [(2, 300 * 9_000_000)], "epochs of {epoch_events}");
    }
    // Nothing but sleep: no step at all.
    let mut tl = Timeline::new(&Setup::from(&header()));
    for e in sleeping(0, 3_000_000_000) {
        tl.push(&e);
    }
    let (report, _) = tl.finish(3_000_000_000, StepRule::Auto);
    assert!(report.steps.is_empty(), "{:?}", report.steps.len());
    assert_eq!(report.idle.len(), 1);
    assert_eq!(report.idle[0].when, "the whole run: no step");
    assert!(
        report.reason.contains("idle, not steps"),
        "{}",
        report.reason
    );
}

/// Regression (issue 51): a GPT-2-shaped DDP job read "Ranks: 5", ranks 1–4 its
/// DataLoader workers (forked by the rank, 0 collectives, the rank's RANK inherited).
/// Forked targets that issue no collective are workers of the rank that forked them, with
/// their own totals; the ranks are the processes that issue collectives. A second
/// generation works for the same rank; a process no rank forked stays a rank.
#[test]
fn forked_workers_are_not_ranks() {
    let mut h = header();
    h.targets[0].env_rank = Some(("RANK".into(), 3));
    for (pid, parent) in [(11, 10), (12, 10), (13, 11), (20, 1)] {
        let mut t = h.targets[0].clone();
        t.pid = pid;
        t.parent_pid = Some(parent);
        // The workers inherit the rank's variable; the other process has none.
        if pid == 20 {
            t.env_rank = None;
        }
        h.targets.push(t);
    }
    let on = |pid: u32| Task {
        tgid: pid,
        tid: pid,
        cpu: 0,
    };
    let mut tl = Timeline::new(&Setup::from(&h));
    for i in 0..40u64 {
        let at = 1_000 + i * 10_000;
        tl.push(&call(Func::AllReduce, at, at + 100));
        tl.push(&Event::Call(Call::new(
            task(10),
            Func::CuStreamSynchronize,
            at + 4_000,
            at + 5_000,
        )));
        // Worker 11 blocks for 2 µs each step: off-CPU in its own totals.
        for (ts, out) in [(at + 6_000, true), (at + 8_000, false)] {
            tl.push(&Event::Switch {
                ts_ns: ts,
                task: on(11),
                prev_tid: if out { 11 } else { 99 },
                next_tid: if out { 99 } else { 11 },
                next_tgid: if out { 0 } else { 11 },
                prev_state: i64::from(out),
                prev_is_target: out,
                next_is_target: !out,
                offcpu_same: None,
            });
        }
    }
    let (report, _) = tl.finish(500_000, StepRule::Auto);
    let ranks: Vec<(u32, i32)> = report.ranks.iter().map(|r| (r.pid, r.rank)).collect();
    // Numbered by pid order among the ranks only.
    assert_eq!(ranks, [(10, 3), (20, 1)], "{:?}", report.ranks);
    let workers: Vec<(u32, u32, Option<i32>, Option<u32>)> = report
        .workers
        .iter()
        .map(|w| (w.pid, w.rank_pid, w.rank, w.parent_pid))
        .collect();
    assert_eq!(
        workers,
        [
            (11, 10, Some(3), Some(10)),
            (12, 10, Some(3), Some(10)),
            (13, 10, Some(3), Some(11))
        ]
    );
    let w11 = &report.workers[0];
    assert_eq!(w11.threads, 1);
    assert_eq!(w11.categories.other_offcpu, 40 * 2_000, "{w11:?}");
}

/// Regression (issue 51): a pause between steps (an evaluation, a checkpoint: no
/// collectives) was one long step. Steps of 10 ms, a 2-s sleep after the 40th, 40 more:
/// the sleep is idle `between steps`, no step is longer than a step, whether attributed at
/// once or in epochs; a late start of 0.5 s (a stall of the step's own) stays in its step.
#[test]
fn a_pause_between_steps_is_idle() {
    let run = |pause: u64, epoch_events: u64| {
        // Pages moved in the pause (a long `migrate_pages()` call reads as one): counted
        // in it, in no step.
        let moved = Event::PageMigration {
            ts_ns: 400_000_000 + pause / 2,
            task: task(10),
            succeeded: 2048,
            failed: 0,
            mode: 0,
            reason: 0,
        };
        let events: Vec<Event> = training(0, 400_000_000)
            .into_iter()
            .chain(sleeping(400_000_000, 400_000_000 + pause))
            .chain([moved])
            .chain(training(400_000_000 + pause, 800_000_000 + pause))
            .collect();
        let mut tl = Timeline::new(&Setup::from(&header()));
        tl.stream(StepRule::Auto, epoch_events);
        for e in &events {
            tl.push(e);
        }
        tl.finish(800_000_000 + pause, StepRule::Auto).0
    };
    for epoch_events in [0, 50] {
        let report = run(2_000_000_000, epoch_events);
        let longest = report.steps.iter().map(|s| s.wall_ns).max().unwrap();
        assert!(longest <= 10_000_000, "epochs of {epoch_events}: {longest}");
        let between: Vec<u64> = report
            .idle
            .iter()
            .filter(|i| i.when == "between steps")
            .map(|i| i.wall_ns / 100_000_000)
            .collect();
        assert_eq!(between, [20], "epochs of {epoch_events}: {:?}", report.idle);
        assert!(report.steps.len() >= 78, "{}", report.steps.len());
        let pages = |i: &crate::attribute::Idle| (i.when, i.numa_page_migrations);
        assert!(
            report
                .idle
                .iter()
                .map(pages)
                .any(|p| p == ("between steps", 2048))
        );
        assert!(report.steps.iter().all(|s| s.numa_page_migrations == 0));
    }
    let stalled = run(500_000_000, 0);
    assert!(
        stalled.idle.iter().all(|i| i.when != "between steps"),
        "{:?}",
        stalled.idle
    );
    assert!(stalled.steps.iter().any(|s| s.wall_ns > 500_000_000));
    let in_steps: u64 = stalled.steps.iter().map(|s| s.numa_page_migrations).sum();
    assert_eq!(in_steps, 2048);
}

/// Collectives that repeat as no step does (an evaluation's, a warm-up's): each its own
/// size, 10 ms apart, on the rank thread.
fn irregular(from: u64, to: u64) -> Vec<Event> {
    (from..to)
        .step_by(10_000_000)
        .enumerate()
        .flat_map(|(i, t)| {
            let mut c = call(Func::Broadcast, t + 1_000_000, t + 1_100_000);
            if let Event::Call(c) = &mut c {
                c.bytes = Some(4096 * (i as u64 + 1));
                c.count = Some(1024 * (i as u64 + 1));
            }
            [
                c,
                call(Func::CuStreamSynchronize, t + 6_000_000, t + 9_000_000),
            ]
        })
        .collect()
}

/// Regression (issue 51): steps found, then collectives that repeat as no step does (an
/// evaluation's), attributed in epochs: 2.58 s of the 2.8-s run were in no step and no
/// idle stretch. Every attributed stretch is a step or a stretch that is not one, with
/// its collectives counted; at once, the run that never repeats as a whole is in 1 s
/// windows only (never windows beside found steps).
#[test]
fn collectives_that_do_not_repeat_are_not_lost() {
    let end = 2_800_000_000;
    for epoch_events in [0u64, 50] {
        let events: Vec<Event> = training(0, 400_000_000)
            .into_iter()
            .chain(irregular(400_000_000, 2_400_000_000))
            .chain(training(2_400_000_000, end))
            .collect();
        let mut tl = Timeline::new(&Setup::from(&header()));
        tl.stream(StepRule::Auto, epoch_events);
        for e in &events {
            tl.push(e);
        }
        let r = tl.finish(end, StepRule::Auto).0;
        let steps: u64 = r.steps.iter().map(|s| s.wall_ns).sum();
        let idle: u64 = r.idle.iter().map(|s| s.wall_ns).sum();
        // All but the first step's lead (1 ms before its first collective).
        let covered = steps + idle;
        assert!(
            covered + 10_000_000 >= end && covered <= end,
            "epochs of {epoch_events}: {steps} in steps, {idle} idle: {:?}",
            r.idle
        );
        let windows = r.method == Method::Window;
        assert!(windows || r.steps.iter().all(|s| s.wall_ns <= 10_000_000));
        if epoch_events > 0 {
            let with: u64 = r.idle.iter().map(|i| i.collectives).sum();
            assert!(with >= 200, "{:?}", r.idle);
        }
    }
}

/// A switch of thread `tid` of process 10 (out: blocked when `state` is 1).
fn switch_of(tid: u32, ts: u64, out: bool, state: i64) -> Event {
    Event::Switch {
        ts_ns: ts,
        task: task(tid),
        prev_tid: if out { tid } else { 99 },
        next_tid: if out { 99 } else { tid },
        next_tgid: if out { 0 } else { 10 },
        prev_state: state,
        prev_is_target: out,
        next_is_target: !out,
        offcpu_same: None,
    }
}

/// Issue 51: a thread blocked until another thread of its process wakes it spent that
/// time as the other did (PyTorch's main thread in `backward()` waits for the autograd
/// thread, which on the H100 GPT-2 job spent it launching kernels and in syncs): here
/// 3 ms of the helper's 3.99-ms hand-off are its sync for the GPU, and are the main
/// thread's `gpu_wait` too; a wake from another process is still `other_offcpu`. Only the
/// training loop's thread takes its waker's time: the helper's own waits stay its own.
#[test]
fn a_wait_for_another_thread_is_what_that_thread_did() {
    let run = |waker_tgid: u32| {
        let mut tl = Timeline::new(&Setup::from(&header()));
        let sync = |tid: u32, start: u64, end: u64| {
            Event::Call(Call::new(task(tid), Func::CuStreamSynchronize, start, end))
        };
        let events = [
            switch_of(11, 500_000, false, 0),
            switch_of(10, 1_000_000, true, 1),
            sync(11, 1_500_000, 4_500_000),
            Event::Wakeup {
                ts_ns: 4_990_000,
                task: task(10),
                waker_tid: 11,
                waker_tgid,
            },
            switch_of(11, 5_000_000, true, 1),
            switch_of(10, 5_000_000, false, 0),
            sync(10, 8_000_000, 9_000_000),
            // Makes process 10 a rank, and thread 10 its loop's thread.
            call(Func::AllReduce, 9_500_000, 9_600_000),
        ];
        for e in &events {
            tl.push(e);
        }
        let (report, _) = tl.finish(10_000_000, StepRule::Window(10_000_000));
        let of = |tid: u32| {
            let t = report.threads.iter().find(|t| t.tid == tid).unwrap();
            t.categories
        };
        (of(10), of(11))
    };
    let (main, helper) = run(10);
    assert_eq!(helper.gpu_wait, 3_000_000, "{helper:?}");
    assert_eq!(main.gpu_wait, 4_000_000, "{main:?}");
    assert_eq!(main.runqueue, 10_000, "{main:?}");
    assert_eq!(main.compute, 5_990_000, "{main:?}");
    assert_eq!(main.total(), 10_000_000);
    let (main, _) = run(20);
    assert_eq!(main.gpu_wait, 1_000_000, "{main:?}");
    assert_eq!(main.other_offcpu, 3_990_000, "{main:?}");
}
