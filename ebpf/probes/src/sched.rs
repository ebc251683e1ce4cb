//! The scheduler: switches (with off-CPU stacks), wake-ups, migrations, forks and exits of
//! target threads.

use crate::stacks::{emit_stacks, offcpu_kernel};
#[allow(clippy::wildcard_imports)]
use crate::*;

#[tracepoint]
pub fn tracepoint_sched_switch(ctx: TracePointContext) -> u32 {
    let _run = ProgramRun::start(run::TRACEPOINT_SCHED_SWITCH);
    let (Some(prev_pid), Some(next_pid), Some(prev_state)) = (
        read_tp::<i32>(&ctx, offset!(switch_prev_pid)),
        read_tp::<i32>(&ctx, offset!(switch_next_pid)),
        read_tp::<i64>(&ctx, offset!(switch_prev_state)),
    ) else {
        return 0;
    };
    let (cur_tgid, _) = current();
    on_switch(
        ctx.as_ptr(),
        cur_tgid,
        prev_pid as u32,
        next_pid as u32,
        prev_state,
    )
}

/// `sched_switch` as a raw tracepoint (Linux 5.18+): `(preempt, prev, next, prev_state)`.
#[raw_tracepoint(tracepoint = "sched_switch")]
pub fn raw_sched_switch(ctx: RawTracePointContext) -> i32 {
    let _run = ProgramRun::start(run::RAW_SCHED_SWITCH);
    let preempt: u64 = ctx.arg(0);
    let next: u64 = ctx.arg(2);
    let state: u64 = ctx.arg(3);
    let Some(next_pid) = task_field::<i32>(next, offset!(task_pid)) else {
        return 0;
    };
    // `prev` is the current task. Its state as the formatted tracepoint reports it, as far
    // as anything reads it (running or not): a task preempted in the kernel is reported
    // as `TASK_REPORT_MAX` (not running) whatever its state; otherwise running is 0.
    let (cur_tgid, prev_tid) = current();
    let prev_state = if preempt == 0 {
        i64::from(state as u32)
    } else {
        TASK_REPORT_MAX
    };
    on_switch(
        ctx.as_ptr(),
        cur_tgid,
        prev_tid,
        next_pid as u32,
        prev_state,
    ) as i32
}

/// What the formatted `sched_switch` reports as `prev_state` for a task preempted in the
/// kernel (Linux 4.14+: `TASK_REPORT_IDLE << 1`).
const TASK_REPORT_MAX: i64 = 0x100;

/// A field of the kernel's `struct task_struct` at `task + offset` (from the BTF).
#[inline(always)]
fn task_field<T>(task: u64, offset: usize) -> Option<T> {
    if task == 0 || offset == FIELD_ABSENT as usize {
        return None;
    }
    // SAFETY: the helper checks the kernel address.
    unsafe { bpf_probe_read_kernel((task + offset as u64) as *const T) }.ok()
}

/// A context switch from `prev_tid` (the current task, of thread group `cur_tgid`) to
/// `next_tid`.
#[inline(always)]
fn on_switch(
    ctx: *mut core::ffi::c_void,
    cur_tgid: u32,
    prev_tid: u32,
    next_tid: u32,
    prev_state: i64,
) -> u32 {
    let mut flags = 0;
    // The previous task is `current`, so its thread group is known without a lookup.
    if is_target(cur_tgid) {
        flags |= switch_flags::PREV_TARGET;
        if target_of_thread(prev_tid).is_none() {
            mark_thread(prev_tid);
            if THREADS.insert(&prev_tid, &cur_tgid, 0).is_err() {
                bump(counter::THREADS_FULL);
            }
        }
    } else if target_of_thread(prev_tid).is_some() {
        // A child process that fork() registered tentatively: it is not a target thread.
        let _ = THREADS.remove(&prev_tid);
    }
    let next_tgid = target_of_thread(next_tid).unwrap_or(0);
    if next_tgid != 0 {
        flags |= switch_flags::NEXT_TARGET;
    }
    if flags == 0 {
        return 0;
    }
    let timed = TargetRun::start(timed::SCHED_SWITCH);
    let (tgid, tid) = if flags & switch_flags::PREV_TARGET != 0 {
        (cur_tgid, prev_tid)
    } else {
        (next_tgid, next_tid)
    };
    // The timer's start is the record's time (one clock read fewer).
    let hdr = header_at(kind::SWITCH, tgid, tid, timed.start_ns);
    // SAFETY: a plain read of a read-only global.
    if flags & switch_flags::PREV_TARGET != 0
        && unsafe { core::ptr::read_volatile(&raw const CONFIG.offcpu_stacks) } != offcpu::OFF
    {
        // The stacks the thread leaves the CPU with: why it blocked, and where it waits.
        // Taken now, at every switch, or when it comes back after a long enough stretch
        // (`kprobe_finish_task_switch`): the unwinding is most of a switch's cost.
        if offcpu_min_ns() == 0 {
            flags |= emit_stacks(
                ctx,
                Header {
                    kind: kind::OFFCPU,
                    ..hdr
                },
                offcpu_kernel(),
                true,
                true,
            );
        } else if OFF_SINCE.insert(&prev_tid, &hdr.ts_ns, 0).is_err() {
            bump(u32::from(kind::OFFCPU));
        }
    }
    emit(
        kind::SWITCH,
        SwitchEvent {
            hdr,
            prev_tid,
            next_tid,
            prev_state,
            next_tgid,
            flags,
        },
    );
    0
}

/// The first code a task runs after a switch, in its own context: the stacks a target
/// thread was off the CPU with are still in place, and taken only if it was off for at
/// least `OFFCPU_MIN` (the record timed at the switch-out). Shorter stretches
/// are counted with their time.
#[kprobe]
pub fn kprobe_finish_task_switch(ctx: ProbeContext) -> u32 {
    let _run = ProgramRun::start(run::KPROBE_FINISH_TASK_SWITCH);
    let (tgid, tid) = current();
    // SAFETY: copied out at once.
    let Some(since) = (unsafe { OFF_SINCE.get(&tid) }).copied() else {
        return 0;
    };
    let timed = TargetRun::start(timed::KPROBE_FINISH_TASK_SWITCH);
    let _ = OFF_SINCE.remove(&tid);
    let off = timed.start_ns.saturating_sub(since);
    if off < offcpu_min_ns() {
        bump(counter::OFFCPU_SHORT);
        add(&COUNTERS, counter::OFFCPU_SHORT_NS, off);
        return 0;
    }
    let hdr = header_at(kind::OFFCPU, tgid, tid, since);
    emit_stacks(ctx.as_ptr(), hdr, offcpu_kernel(), true, false);
    0
}

#[tracepoint]
pub fn tracepoint_sched_waking(ctx: TracePointContext) -> u32 {
    let _run = ProgramRun::start(run::TRACEPOINT_SCHED_WAKING);
    let Some(pid) = read_tp::<i32>(&ctx, offset!(wakeup_pid)) else {
        return 0;
    };
    on_waking(pid as u32)
}

/// `sched_waking` as a raw tracepoint: `(p)`.
#[raw_tracepoint(tracepoint = "sched_waking")]
pub fn raw_sched_waking(ctx: RawTracePointContext) -> i32 {
    let _run = ProgramRun::start(run::RAW_SCHED_WAKING);
    let task: u64 = ctx.arg(0);
    let Some(pid) = task_field::<i32>(task, offset!(task_pid)) else {
        return 0;
    };
    on_waking(pid as u32) as i32
}

/// A wake-up of thread `tid`.
#[inline(always)]
fn on_waking(tid: u32) -> u32 {
    let Some(tgid) = target_of_thread(tid) else {
        return 0;
    };
    let timed = TargetRun::start(timed::SCHED_WAKING);
    let (waker_tgid, waker_tid) = current();
    emit(
        kind::WAKEUP,
        WakeupEvent {
            hdr: header_at(kind::WAKEUP, tgid, tid, timed.start_ns),
            waker_tid,
            waker_tgid,
            target_cpu: u32::MAX,
            _pad: 0,
        },
    );
    0
}

#[tracepoint]
pub fn tracepoint_sched_migrate_task(ctx: TracePointContext) -> u32 {
    let _run = ProgramRun::start(run::TRACEPOINT_SCHED_MIGRATE_TASK);
    let Some(pid) = read_tp::<i32>(&ctx, offset!(migrate_pid)) else {
        return 0;
    };
    on_migrate(pid as u32, || {
        (
            read_tp::<i32>(&ctx, offset!(migrate_orig_cpu)).unwrap_or(-1),
            read_tp::<i32>(&ctx, offset!(migrate_dest_cpu)).unwrap_or(-1),
        )
    })
}

/// `sched_migrate_task` as a raw tracepoint: `(p, dest_cpu)`, the task still on its
/// CPU of origin.
#[raw_tracepoint(tracepoint = "sched_migrate_task")]
pub fn raw_sched_migrate_task(ctx: RawTracePointContext) -> i32 {
    let _run = ProgramRun::start(run::RAW_SCHED_MIGRATE_TASK);
    let task: u64 = ctx.arg(0);
    let dest: u64 = ctx.arg(1);
    let Some(pid) = task_field::<i32>(task, offset!(task_pid)) else {
        return 0;
    };
    on_migrate(pid as u32, || {
        (
            task_field::<i32>(task, offset!(task_cpu)).unwrap_or(-1),
            dest as i32,
        )
    }) as i32
}

/// A move of thread `tid` between CPUs, `cpus` (origin, destination) read only for
/// targets.
#[inline(always)]
fn on_migrate(tid: u32, cpus: impl FnOnce() -> (i32, i32)) -> u32 {
    let Some(tgid) = target_of_thread(tid) else {
        return 0;
    };
    let (orig_cpu, dest_cpu) = cpus();
    emit(
        kind::MIGRATE,
        MigrateEvent {
            hdr: header(kind::MIGRATE, tgid, tid),
            orig_cpu: orig_cpu as u32,
            dest_cpu: dest_cpu as u32,
        },
    );
    0
}

#[tracepoint]
pub fn tracepoint_sched_process_fork(ctx: TracePointContext) -> u32 {
    let _run = ProgramRun::start(run::TRACEPOINT_SCHED_PROCESS_FORK);
    let (tgid, tid) = current();
    if !is_target(tgid) {
        return 0;
    }
    let Some(child) = read_tp::<i32>(&ctx, offset!(fork_child_pid)) else {
        return 0;
    };
    let child_tid = child as u32;
    // Tentative: a new thread stays; a new process is dropped at its first switch-out.
    mark_thread(child_tid);
    if THREADS.insert(&child_tid, &tgid, 0).is_err() {
        bump(counter::THREADS_FULL);
    }
    emit(
        kind::FORK,
        TaskEvent {
            hdr: header(kind::FORK, tgid, tid),
            child_tid,
            group_dead: 0,
        },
    );
    0
}

#[tracepoint]
pub fn tracepoint_sched_process_exit(ctx: TracePointContext) -> u32 {
    let _run = ProgramRun::start(run::TRACEPOINT_SCHED_PROCESS_EXIT);
    let (tgid, tid) = current();
    if !is_target(tgid) {
        return 0;
    }
    let at = offset!(exit_group_dead);
    let group_dead = if at == FIELD_ABSENT as usize {
        0
    } else {
        read_tp::<u8>(&ctx, at).unwrap_or(0)
    };
    let _ = THREADS.remove(&tid);
    emit(
        kind::EXIT,
        TaskEvent {
            hdr: header(kind::EXIT, tgid, tid),
            child_tid: 0,
            group_dead: u32::from(group_dead),
        },
    );
    0
}
