//! Memory: user page faults (and their timing where fentry is allowed), NUMA hinting faults,
//! page migrations and NUMA task moves.

#[allow(clippy::wildcard_imports)]
use crate::*;

/// A target thread's user page fault. A raw tracepoint: the kernel passes the arguments
/// as they are instead of building a trace record first (program time 381 → 298 ns a
/// fault here, docs/benchmarks.md).
#[raw_tracepoint(tracepoint = "page_fault_user")]
pub fn raw_page_fault_user(ctx: RawTracePointContext) -> i32 {
    let _run = ProgramRun::start(run::RAW_PAGE_FAULT_USER);
    let (tgid, tid) = current();
    if !is_target(tgid) {
        return 0;
    }
    let timed = TargetRun::start(timed::PAGE_FAULT_USER);
    let address: u64 = ctx.arg(0);
    let regs: u64 = ctx.arg(1);
    let error_code: u64 = ctx.arg(2);
    // SAFETY: the helper checks the kernel address.
    let ip = unsafe { bpf_probe_read_kernel((regs + PT_REGS_IP) as *const u64) }.unwrap_or(0);
    emit(
        kind::FAULT,
        FaultEvent {
            // The timer's start is the record's time (one clock read fewer).
            hdr: header_at(kind::FAULT, tgid, tid, timed.start_ns),
            address,
            ip,
            error_code,
        },
    );
    0
}

/// Offset of `ip` in x86-64's `struct pt_regs` (the user ABI's register order).
pub(crate) const PT_REGS_IP: u64 = 16 * 8;

/// Entry times of the user page faults target threads are handling, by thread id.
#[map]
pub(crate) static FAULT_START: HashMap<u32, FaultStart> = HashMap::with_max_entries(16384, 0);

#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct FaultStart {
    ts_ns: u64,
    flags: u32,
    _pad: u32,
}

/// Entry of the fault handler (loaded only where the kernel permits fentry): a target
/// thread's user fault starts.
#[fentry(function = "handle_mm_fault")]
pub fn fentry_handle_mm_fault(ctx: FEntryContext) -> u32 {
    let _run = ProgramRun::start(run::FENTRY_HANDLE_MM_FAULT);
    let (tgid, tid) = current();
    if !is_target(tgid) {
        return 0;
    }
    let _timed = TargetRun::start(timed::FENTRY_HANDLE_MM_FAULT);
    let flags: u32 = ctx.arg(2);
    if flags & FAULT_FLAG_USER == 0 {
        return 0;
    }
    let start = FaultStart {
        // SAFETY: helper without preconditions.
        ts_ns: unsafe { bpf_ktime_get_ns() },
        flags,
        _pad: 0,
    };
    if FAULT_START.insert(&tid, &start, 0).is_err() {
        bump(counter::FAULT_START_FULL);
    }
    0
}

/// Return of the fault handler: one record with the fault's start and end (read after the
/// record is made, just before it is handed on).
#[fexit(function = "handle_mm_fault")]
pub fn fexit_handle_mm_fault(ctx: FExitContext) -> u32 {
    let _run = ProgramRun::start(run::FEXIT_HANDLE_MM_FAULT);
    let (tgid, tid) = current();
    // SAFETY: copied out at once.
    let Some(start) = (unsafe { FAULT_START.get(&tid) }).copied() else {
        return 0;
    };
    let _timed = TargetRun::start(timed::FEXIT_HANDLE_MM_FAULT);
    let _ = FAULT_START.remove(&tid);
    let address: u64 = ctx.arg(1);
    let result: u32 = ctx.ret().unwrap_or(0);
    // The fault ends when its record is made: this program's run so far is on the
    // fault's path too.
    emit_ending_now(
        kind::FAULT_TIME,
        FaultTimeEvent {
            hdr: header_at(kind::FAULT_TIME, tgid, tid, 0),
            start_ns: start.ts_ns,
            address,
            flags: start.flags,
            result,
        },
    );
    0
}

/// A NUMA hinting fault of a target thread: `task_numa_fault(last_cpupid, mem_node,
/// pages, flags)`, called in the faulting thread's context (no tracepoint reports it).
#[kprobe]
pub fn kprobe_task_numa_fault(ctx: ProbeContext) -> u32 {
    let _run = ProgramRun::start(run::KPROBE_TASK_NUMA_FAULT);
    let (tgid, tid) = current();
    if !is_target(tgid) {
        return 0;
    }
    emit(
        kind::NUMA_HINT,
        NumaHintEvent {
            hdr: header(kind::NUMA_HINT, tgid, tid),
            mem_node: ctx.arg::<i32>(1).unwrap_or(-1),
            pages: ctx.arg::<i32>(2).unwrap_or(0),
            flags: ctx.arg::<i32>(3).unwrap_or(0),
            _pad: 0,
        },
    );
    0
}

#[tracepoint]
pub fn tracepoint_mm_migrate_pages(ctx: TracePointContext) -> u32 {
    let _run = ProgramRun::start(run::TRACEPOINT_MM_MIGRATE_PAGES);
    let (tgid, tid) = current();
    if !is_target(tgid) {
        return 0;
    }
    emit(
        kind::PAGE_MIGRATION,
        PageMigrationEvent {
            hdr: header(kind::PAGE_MIGRATION, tgid, tid),
            succeeded: read_tp::<u64>(&ctx, offset!(pages_succeeded)).unwrap_or(0),
            failed: read_tp::<u64>(&ctx, offset!(pages_failed)).unwrap_or(0),
            mode: read_tp::<u32>(&ctx, offset!(pages_mode)).unwrap_or(0),
            reason: read_tp::<u32>(&ctx, offset!(pages_reason)).unwrap_or(0),
        },
    );
    0
}

#[tracepoint]
pub fn tracepoint_sched_move_numa(ctx: TracePointContext) -> u32 {
    let _run = ProgramRun::start(run::TRACEPOINT_SCHED_MOVE_NUMA);
    let Some(tgid) = read_tp::<u32>(&ctx, offset!(move_tgid)) else {
        return 0;
    };
    if !is_target(tgid) {
        return 0;
    }
    let tid = read_tp::<u32>(&ctx, offset!(move_pid)).unwrap_or(0);
    emit(
        kind::NUMA_TASK,
        NumaTaskEvent {
            hdr: header(kind::NUMA_TASK, tgid, tid),
            subkind: numa_task::MOVE,
            src_tid: tid,
            src_tgid: tgid,
            src_cpu: read_tp::<i32>(&ctx, offset!(move_src_cpu)).unwrap_or(-1),
            src_nid: read_tp::<i32>(&ctx, offset!(move_src_nid)).unwrap_or(-1),
            dst_tid: tid,
            dst_tgid: tgid,
            dst_cpu: read_tp::<i32>(&ctx, offset!(move_dst_cpu)).unwrap_or(-1),
            dst_nid: read_tp::<i32>(&ctx, offset!(move_dst_nid)).unwrap_or(-1),
            _pad: 0,
        },
    );
    0
}

/// `sched_swap_numa` and `sched_stick_numa` share their layout.
#[inline(always)]
pub(crate) fn swap_or_stick(ctx: &TracePointContext, subkind: u32) {
    let src_tgid = read_tp::<u32>(ctx, offset!(swap_src_tgid)).unwrap_or(0);
    let dst_tgid = read_tp::<u32>(ctx, offset!(swap_dst_tgid)).unwrap_or(0);
    let (tgid, tid) = if is_target(src_tgid) {
        (
            src_tgid,
            read_tp::<u32>(ctx, offset!(swap_src_pid)).unwrap_or(0),
        )
    } else if is_target(dst_tgid) {
        (
            dst_tgid,
            read_tp::<u32>(ctx, offset!(swap_dst_pid)).unwrap_or(0),
        )
    } else {
        return;
    };
    emit(
        kind::NUMA_TASK,
        NumaTaskEvent {
            hdr: header(kind::NUMA_TASK, tgid, tid),
            subkind,
            src_tid: read_tp::<u32>(ctx, offset!(swap_src_pid)).unwrap_or(0),
            src_tgid,
            src_cpu: read_tp::<i32>(ctx, offset!(swap_src_cpu)).unwrap_or(-1),
            src_nid: read_tp::<i32>(ctx, offset!(swap_src_nid)).unwrap_or(-1),
            dst_tid: read_tp::<u32>(ctx, offset!(swap_dst_pid)).unwrap_or(0),
            dst_tgid,
            dst_cpu: read_tp::<i32>(ctx, offset!(swap_dst_cpu)).unwrap_or(-1),
            dst_nid: read_tp::<i32>(ctx, offset!(swap_dst_nid)).unwrap_or(-1),
            _pad: 0,
        },
    );
}

#[tracepoint]
pub fn tracepoint_sched_swap_numa(ctx: TracePointContext) -> u32 {
    let _run = ProgramRun::start(run::TRACEPOINT_SCHED_SWAP_NUMA);
    swap_or_stick(&ctx, numa_task::SWAP);
    0
}

#[tracepoint]
pub fn tracepoint_sched_stick_numa(ctx: TracePointContext) -> u32 {
    let _run = ProgramRun::start(run::TRACEPOINT_SCHED_STICK_NUMA);
    swap_or_stick(&ctx, numa_task::STICK);
    0
}
