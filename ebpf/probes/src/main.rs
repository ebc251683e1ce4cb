//! Kernel programs: uprobes on NCCL and CUDA calls, scheduler and memory tracepoints.
//!
//! Thin by design: each program filters to the target thread groups, captures and submits
//! one record. Errors and drops only bump `COUNTERS`; user space pairs nothing and
//! interprets everything.
#![no_std]
#![no_main]
// A compare-and-swap on a map value: core's atomic types offer none on this target, the
// intrinsic compiles to the BPF cmpxchg instruction.
#![feature(core_intrinsics)]
#![allow(internal_features)]

// Call arguments are read as the x86-64 System V ABI passes them (rdi, rsi, rdx, rcx, r8, r9,
// then the stack above the return address), and the fault handler's `pt_regs` with x86-64's
// layout: another architecture needs its own register map, not a silent misreading.
#[cfg(not(bpf_target_arch = "x86_64"))]
compile_error!(
    "nccltrace's kernel programs read call arguments as x86-64 passes them: build nccltrace on \
     an x86-64 host (other architectures are not supported yet; `nccltrace report` and the \
     nccltrace-core crate build anywhere)"
);

use aya_ebpf::{
    EbpfContext,
    bindings::{BPF_F_USER_STACK, BPF_RB_AVAIL_DATA, BPF_RB_FORCE_WAKEUP, BPF_RB_NO_WAKEUP},
    helpers::{
        bpf_get_attach_cookie, bpf_get_current_pid_tgid, bpf_get_smp_processor_id, bpf_get_stack,
        bpf_ktime_get_ns, bpf_probe_read_kernel, bpf_probe_read_user,
        bpf_probe_read_user_str_bytes,
    },
    macros::{
        fentry, fexit, kprobe, map, perf_event, raw_tracepoint, tracepoint, uprobe, uretprobe,
    },
    maps::{Array, HashMap, LruHashMap, PerCpuArray, RingBuf},
    programs::{
        FEntryContext, FExitContext, PerfEventContext, ProbeContext, RawTracePointContext,
        RetProbeContext, TracePointContext,
    },
};
use aya_log_ebpf::warn;
use nccltrace_common::{
    CALL_SLOTS, CallEvent, CallSlot, Config, FAULT_FLAG_USER, FIELD_ABSENT, FaultEvent,
    FaultTimeEvent, Header, KSTACK_DEPTH, MAX_ARGS, MigrateEvent, NOT_READ, NumaHintEvent,
    NumaTaskEvent, PY_DEPTH, PY_ENTRY, PY_FRAME_WINDOW, PageMigrationEvent, PendingCall, PyLayout,
    PyStackEvent, RING_SHARDS, SampleEvent, SwitchEvent, TaskEvent, TpOffsets, USTACK_DEPTH,
    WakeupEvent, call_stacks, counter, func, kind, numa_task, offcpu, switch_flags, timed,
};

/// Every record, in ring buffers shared by groups of CPUs (`CONFIG.shards` of them in use,
/// each sized by user space at load): one buffer for all CPUs makes every producer fight
/// over its reservation lock (measured on 16 cores: the return program 162 ns with one
/// producer, 4.9 µs with fourteen). User space merges them by time.
#[map]
static EVENTS_0: RingBuf = RingBuf::with_byte_size(1 << 20, 0);
#[map]
static EVENTS_1: RingBuf = RingBuf::with_byte_size(4096, 0);
#[map]
static EVENTS_2: RingBuf = RingBuf::with_byte_size(4096, 0);
#[map]
static EVENTS_3: RingBuf = RingBuf::with_byte_size(4096, 0);
#[map]
static EVENTS_4: RingBuf = RingBuf::with_byte_size(4096, 0);
#[map]
static EVENTS_5: RingBuf = RingBuf::with_byte_size(4096, 0);
#[map]
static EVENTS_6: RingBuf = RingBuf::with_byte_size(4096, 0);
#[map]
static EVENTS_7: RingBuf = RingBuf::with_byte_size(4096, 0);

/// This CPU's ring buffer.
#[inline(always)]
fn ring() -> &'static RingBuf {
    // SAFETY: a helper without preconditions; a plain read of a read-only global.
    let cpu = unsafe { bpf_get_smp_processor_id() };
    let shards = unsafe { core::ptr::read_volatile(&raw const CONFIG.shards) };
    match cpu & shards.wrapping_sub(1) & (RING_SHARDS - 1) {
        0 => &EVENTS_0,
        1 => &EVENTS_1,
        2 => &EVENTS_2,
        3 => &EVENTS_3,
        4 => &EVENTS_4,
        5 => &EVENTS_5,
        6 => &EVENTS_6,
        _ => &EVENTS_7,
    }
}

/// Drops and errors, indexed by [`counter`] (and by [`kind`] for lost records).
#[map]
static COUNTERS: PerCpuArray<u64> = PerCpuArray::with_max_entries(counter::COUNT, 0);

/// Runs and nanoseconds of the timed programs for traced threads ([`timed`]).
#[map]
static TARGET_COSTS: PerCpuArray<u64> = PerCpuArray::with_max_entries(2 * timed::COUNT, 0);

/// Target thread groups (tgid → flags), filled by user space before attach.
#[map]
static TARGETS: HashMap<u32, u32> = HashMap::with_max_entries(1024, 0);

/// Threads of the targets (tid → tgid): lets scheduler events about a task that is not
/// `current` (the next task of a switch, a wakee) be filtered without reading task_struct.
#[map]
static THREADS: HashMap<u32, u32> = HashMap::with_max_entries(65536, 0);

/// Python thread states of target threads (tid → `PyThreadState *`), kept by user space
/// (`--python`): a thread found here gets its Python frames walked with its stacks.
#[map]
static PY_THREADS: HashMap<u32, u64> = HashMap::with_max_entries(16384, 0);

/// How to walk each Python target's frames (tgid → layout of its CPython version).
#[map]
static PY_LAYOUTS: HashMap<u32, PyLayout> = HashMap::with_max_entries(1024, 0);

/// Switch-out times of target threads off the CPU, while their off-CPU stacks wait for the
/// switch-in (`OFFCPU_MIN`). LRU: a thread that exits is switched out one last
/// time and never comes back.
#[map]
static OFF_SINCE: LruHashMap<u32, u64> = LruHashMap::with_max_entries(16384, 0);

/// The shortest off-CPU stretch whose stacks are taken, as the thread comes back (ns; 0:
/// taken at every switch-out); see `names::OFFCPU_MIN`.
#[map]
static OFFCPU_MIN: Array<u64> = Array::with_max_entries(1, 0);

/// The value of `OFFCPU_MIN`.
#[inline(always)]
fn offcpu_min_ns() -> u64 {
    OFFCPU_MIN.get(0).copied().unwrap_or(0)
}

/// Calls in flight, keyed by `tid << 32 | function id`.
#[map]
static PENDING: HashMap<u64, PendingCall> = HashMap::with_max_entries(16384, 0);

/// Calls in flight by thread slot (see [`CallSlot`]); `PENDING` takes the rest.
#[map]
static SLOTS: Array<CallSlot> = Array::with_max_entries(CALL_SLOTS, 0);

/// Tracepoint field offsets for this kernel, set by user space before load.
#[unsafe(no_mangle)]
static OFFSETS: TpOffsets = TpOffsets {
    switch_prev_pid: 0,
    switch_prev_state: 0,
    switch_next_pid: 0,
    wakeup_pid: 0,
    wakeup_target_cpu: 0,
    migrate_pid: 0,
    migrate_orig_cpu: 0,
    migrate_dest_cpu: 0,
    fork_child_pid: 0,
    exit_group_dead: 0,
    pages_succeeded: 0,
    pages_failed: 0,
    pages_mode: 0,
    pages_reason: 0,
    move_pid: 0,
    move_tgid: 0,
    move_src_cpu: 0,
    move_src_nid: 0,
    move_dst_cpu: 0,
    move_dst_nid: 0,
    swap_src_pid: 0,
    swap_src_tgid: 0,
    swap_src_cpu: 0,
    swap_src_nid: 0,
    swap_dst_pid: 0,
    swap_dst_tgid: 0,
    swap_dst_cpu: 0,
    swap_dst_nid: 0,
    _pad: 0,
};

/// Switches set by user space before load.
#[unsafe(no_mangle)]
static CONFIG: Config = Config {
    offcpu_stacks: 0,
    call_stacks: 0,
    streams: 0,
    shards: 1,
    wakeup_bytes: 0,
};

macro_rules! offset {
    ($field:ident) => {
        // SAFETY: a plain read of a read-only global; volatile so the loader's value is used
        // instead of the zero compiled in.
        unsafe { core::ptr::read_volatile(&raw const OFFSETS.$field) as usize }
    };
}

#[inline(always)]
fn bump(index: u32) {
    add(&COUNTERS, index, 1);
}

/// Adds `value` to this CPU's slot `index` of `map`.
#[inline(always)]
fn add(map: &PerCpuArray<u64>, index: u32, value: u64) {
    if let Some(slot) = map.get_ptr_mut(index) {
        // SAFETY: per-CPU slot, no other writer on this CPU while the program runs.
        unsafe { *slot += value };
    }
}

/// Times the rest of a program's run for a traced thread: from its making to its drop (at
/// every return after it), added to `TARGET_COSTS` under `id`.
struct TargetRun {
    id: u32,
    start_ns: u64,
}

impl TargetRun {
    #[inline(always)]
    fn start(id: u32) -> TargetRun {
        // SAFETY: helper without preconditions.
        let start_ns = unsafe { bpf_ktime_get_ns() };
        TargetRun { id, start_ns }
    }
}

impl Drop for TargetRun {
    #[inline(always)]
    fn drop(&mut self) {
        // SAFETY: helper without preconditions.
        let ns = unsafe { bpf_ktime_get_ns() }.wrapping_sub(self.start_ns);
        add(&TARGET_COSTS, 2 * self.id, 1);
        add(&TARGET_COSTS, 2 * self.id + 1, ns);
    }
}

#[inline(always)]
fn is_target(tgid: u32) -> bool {
    // SAFETY: the value is not kept past this call.
    unsafe { TARGETS.get(&tgid) }.is_some()
}

#[inline(always)]
fn target_of_thread(tid: u32) -> Option<u32> {
    // SAFETY: copied out at once.
    unsafe { THREADS.get(&tid) }.copied()
}

#[inline(always)]
fn header(kind: u16, tgid: u32, tid: u32) -> Header {
    Header {
        // SAFETY: helpers without preconditions.
        ts_ns: unsafe { bpf_ktime_get_ns() },
        tgid,
        tid,
        kind,
        cpu: unsafe { bpf_get_smp_processor_id() } as u16,
        _pad: 0,
    }
}

/// Submit flags: wake the reader only once `CONFIG.wakeup_bytes` are waiting. A wake-up
/// per record costs the traced thread an interrupt and a cross-CPU wake-up; the reader
/// polls on a timer and is woken early only when the buffer starts to fill.
#[inline(always)]
fn wake_flags(ring: &RingBuf) -> u64 {
    // SAFETY: a plain read of a read-only global.
    let threshold = unsafe { core::ptr::read_volatile(&raw const CONFIG.wakeup_bytes) };
    if threshold == 0 {
        0
    } else if ring.query(u64::from(BPF_RB_AVAIL_DATA)) >= threshold {
        u64::from(BPF_RB_FORCE_WAKEUP)
    } else {
        u64::from(BPF_RB_NO_WAKEUP)
    }
}

/// Submits `value` as one record, counting it lost under `kind` when the buffer is full.
#[inline(always)]
fn emit<T: 'static>(kind: u16, value: T) {
    let ring = ring();
    match ring.reserve::<T>(0) {
        Some(mut entry) => {
            entry.write(value);
            entry.submit(wake_flags(ring));
        }
        None => bump(u32::from(kind)),
    }
}

#[inline(always)]
fn current() -> (u32, u32) {
    let pid_tgid = bpf_get_current_pid_tgid();
    ((pid_tgid >> 32) as u32, pid_tgid as u32)
}

#[inline(always)]
fn read_tp<T>(ctx: &TracePointContext, offset: usize) -> Option<T> {
    // SAFETY: the offset comes from this kernel's format file for this tracepoint.
    unsafe { ctx.read_at::<T>(offset) }.ok()
}

/// Entry of a traced library call: remember the time and the arguments.
#[uprobe]
pub fn uprobe_lib_call(ctx: ProbeContext) -> u32 {
    let (tgid, tid) = current();
    if !is_target(tgid) {
        return 0;
    }
    let _timed = TargetRun::start(timed::UPROBE_LIB_CALL);
    // SAFETY: the cookie is the function id user space attached with (and ENTRY_ONLY).
    let cookie = unsafe { bpf_get_attach_cookie(ctx.as_ptr()) } as u32;
    let func_id = cookie & !func::ENTRY_ONLY;
    // SAFETY: regs is the probe's own register snapshot.
    let regs = unsafe { &*ctx.regs };
    let mut pending = PendingCall {
        start_ns: unsafe { bpf_ktime_get_ns() },
        args: [
            regs.rdi, regs.rsi, regs.rdx, regs.rcx, regs.r8, regs.r9, NOT_READ, NOT_READ,
        ],
    };
    // SAFETY: a plain read of a read-only global.
    let stacks = unsafe { core::ptr::read_volatile(&raw const CONFIG.call_stacks) };
    if call_stacks::wanted(stacks, func_id) {
        // Where the call was made from: the wait inside it is drawn at this call site.
        emit_entry_stack(ctx.as_ptr(), regs.rsp, tgid, tid);
    }
    if func_id == func::NVTX_RANGE_PUSH_A {
        // The range's name, into the argument slots the function does not use.
        let mut message = [0u8; func::NVTX_MESSAGE_BYTES];
        // SAFETY: the helper checks the user address and bounds the copy by the buffer.
        if unsafe { bpf_probe_read_user_str_bytes(regs.rdi as *const u8, &mut message) }.is_err() {
            bump(counter::READ_FAILED);
        }
        for (i, chunk) in message.chunks_exact(8).enumerate() {
            let mut word = [0u8; 8];
            word.copy_from_slice(chunk);
            pending.args[(1 + i) & (MAX_ARGS - 1)] = u64::from_le_bytes(word);
        }
    }
    // SAFETY: a plain read of a read-only global.
    let streams = unsafe { core::ptr::read_volatile(&raw const CONFIG.streams) } != 0;
    let on_stack = func::stack_args(func_id, streams);
    if on_stack > 0 {
        // The seventh and eighth arguments sit above the return address.
        let base = regs.rsp + 8;
        let read = if on_stack == 1 {
            // SAFETY: bpf_probe_read_user checks the address.
            unsafe { bpf_probe_read_user(base as *const u64) }.map(|word| [word, NOT_READ])
        } else {
            // SAFETY: as above.
            unsafe { bpf_probe_read_user(base as *const [u64; MAX_ARGS - 6]) }
        };
        match read {
            Ok(extra) => {
                pending.args[6] = extra[0];
                pending.args[7] = extra[1];
            }
            Err(_) => bump(counter::READ_FAILED),
        }
    }
    if cookie & func::ENTRY_ONLY != 0 {
        // No return probe: the record now, its return left unknown.
        emit(
            kind::CALL,
            CallEvent {
                hdr: header(kind::CALL, tgid, tid),
                start_ns: pending.start_ns,
                func: cookie,
                ret: 0,
                args: pending.args,
                out: 0,
            },
        );
        return 0;
    }
    let key = call_key(tid, func_id);
    if let Some(slot) = SLOTS.get_ptr_mut(tid & (CALL_SLOTS - 1)) {
        // SAFETY: a live map value; another thread only ever writes `owner` with `claim`,
        // from 0, so a value naming this thread is this thread's own.
        let owner = unsafe { &raw mut (*slot).owner };
        let holder = unsafe { owner.read_volatile() };
        let mine = holder >> 32 == u64::from(tid);
        if mine {
            // A call of this thread is in flight (a nested call): the older one waits in
            // the hash map and this one takes the slot.
            // SAFETY: only this thread writes a slot it holds.
            park(&ctx, holder, unsafe { &(*slot).call });
            unsafe { owner.write_volatile(key) };
        }
        // SAFETY: `owner` is a live, aligned map value.
        if mine || unsafe { claim(owner, key) } {
            // SAFETY: the slot is held by this thread (claimed above).
            unsafe { (*slot).call = pending };
            return 0;
        }
    }
    park(&ctx, key, &pending);
    0
}

/// Sets `*owner` from 0 to `key` atomically; false when another thread holds it.
#[inline(always)]
unsafe fn claim(owner: *mut u64, key: u64) -> bool {
    use core::intrinsics::{AtomicOrdering, atomic_cxchg};
    // SAFETY: the caller passes a live, aligned u64.
    unsafe {
        atomic_cxchg::<u64, { AtomicOrdering::AcqRel }, { AtomicOrdering::Acquire }>(owner, 0, key)
    }
    .1
}

#[inline(always)]
fn call_key(tid: u32, func_id: u32) -> u64 {
    (u64::from(tid) << 32) | u64::from(func_id)
}

/// Keeps a call in flight in the hash map (its thread's slot is taken).
#[inline(always)]
fn park(ctx: &ProbeContext, key: u64, pending: &PendingCall) {
    if PENDING.insert(&key, pending, 0).is_err() {
        bump(counter::PENDING_FULL);
        warn!(ctx, "nccltrace: pending-call map full");
    }
}

/// The entry of the call returning now: from the thread's slot, else from the hash map.
#[inline(always)]
fn unpark(tid: u32, func_id: u32) -> Option<PendingCall> {
    let key = call_key(tid, func_id);
    if let Some(slot) = SLOTS.get_ptr_mut(tid & (CALL_SLOTS - 1)) {
        // SAFETY: as in `uprobe_lib_call`.
        let owner = unsafe { &raw mut (*slot).owner };
        if unsafe { owner.read_volatile() } == key {
            // SAFETY: read while this thread holds the slot; then it is freed.
            let call = unsafe { (*slot).call };
            unsafe { owner.write_volatile(0) };
            return Some(call);
        }
    }
    // SAFETY: copied out before the entry is removed.
    let call = (unsafe { PENDING.get(&key) }).copied()?;
    let _ = PENDING.remove(&key);
    Some(call)
}

/// Return of a traced library call: pair with the entry and emit one record.
#[uretprobe]
pub fn uretprobe_lib_call(ctx: RetProbeContext) -> u32 {
    let (tgid, tid) = current();
    // SAFETY: as in the entry program.
    let func_id = unsafe { bpf_get_attach_cookie(ctx.as_ptr()) } as u32;
    // Only target threads' entries are kept, so a found entry means a target: the target
    // lookup is needed only when none is found.
    let Some(pending) = unpark(tid, func_id) else {
        if is_target(tgid) {
            bump(counter::UNPAIRED_RETURN);
        }
        return 0;
    };
    let _timed = TargetRun::start(timed::URETPROBE_LIB_CALL);
    let ret: i64 = ctx.ret();
    let mut out = 0u64;
    if let Some(index) = func::out_comm_arg(func_id) {
        let ptr = pending.args[index & (MAX_ARGS - 1)] as *const u64;
        // SAFETY: bpf_probe_read_user checks the address.
        match unsafe { bpf_probe_read_user(ptr) } {
            Ok(value) => out = value,
            Err(_) => bump(counter::READ_FAILED),
        }
    }
    let ring = ring();
    match ring.reserve::<CallEvent>(0) {
        Some(mut entry) => {
            entry.write(CallEvent {
                hdr: header(kind::CALL, tgid, tid),
                start_ns: pending.start_ns,
                func: func_id,
                ret: ret as i32,
                args: pending.args,
                out,
            });
            entry.submit(wake_flags(ring));
        }
        None => bump(u32::from(kind::CALL)),
    }
    0
}

#[tracepoint]
pub fn tracepoint_sched_switch(ctx: TracePointContext) -> u32 {
    let (cur_tgid, _) = current();
    let (Some(prev_pid), Some(next_pid), Some(prev_state)) = (
        read_tp::<i32>(&ctx, offset!(switch_prev_pid)),
        read_tp::<i32>(&ctx, offset!(switch_next_pid)),
        read_tp::<i64>(&ctx, offset!(switch_prev_state)),
    ) else {
        return 0;
    };
    let (prev_tid, next_tid) = (prev_pid as u32, next_pid as u32);
    let mut flags = 0;
    // The previous task is `current`, so its thread group is known without a lookup.
    if is_target(cur_tgid) {
        flags |= switch_flags::PREV_TARGET;
        if target_of_thread(prev_tid).is_none() && THREADS.insert(&prev_tid, &cur_tgid, 0).is_err()
        {
            bump(counter::THREADS_FULL);
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
    let _timed = TargetRun::start(timed::SCHED_SWITCH);
    let (tgid, tid) = if flags & switch_flags::PREV_TARGET != 0 {
        (cur_tgid, prev_tid)
    } else {
        (next_tgid, next_tid)
    };
    let hdr = header(kind::SWITCH, tgid, tid);
    // SAFETY: a plain read of a read-only global.
    if flags & switch_flags::PREV_TARGET != 0
        && unsafe { core::ptr::read_volatile(&raw const CONFIG.offcpu_stacks) } != offcpu::OFF
    {
        // The stacks the thread leaves the CPU with: why it blocked, and where it waits.
        // Taken now, at every switch, or when it comes back after a long enough stretch
        // (`kprobe_finish_task_switch`): the unwinding is most of a switch's cost.
        if offcpu_min_ns() == 0 {
            emit_stacks(
                ctx.as_ptr(),
                Header {
                    kind: kind::OFFCPU,
                    ..hdr
                },
                offcpu_kernel(),
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
    let (tgid, tid) = current();
    // SAFETY: copied out at once.
    let Some(since) = (unsafe { OFF_SINCE.get(&tid) }).copied() else {
        return 0;
    };
    let _timed = TargetRun::start(timed::KPROBE_FINISH_TASK_SWITCH);
    let _ = OFF_SINCE.remove(&tid);
    // SAFETY: helper without preconditions.
    let off = unsafe { bpf_ktime_get_ns() }.saturating_sub(since);
    if off < offcpu_min_ns() {
        bump(counter::OFFCPU_SHORT);
        add(&COUNTERS, counter::OFFCPU_SHORT_NS, off);
        return 0;
    }
    let mut hdr = header(kind::OFFCPU, tgid, tid);
    hdr.ts_ns = since;
    emit_stacks(ctx.as_ptr(), hdr, offcpu_kernel());
    0
}

#[tracepoint]
pub fn tracepoint_sched_waking(ctx: TracePointContext) -> u32 {
    let Some(pid) = read_tp::<i32>(&ctx, offset!(wakeup_pid)) else {
        return 0;
    };
    let tid = pid as u32;
    let Some(tgid) = target_of_thread(tid) else {
        return 0;
    };
    let _timed = TargetRun::start(timed::SCHED_WAKING);
    let (waker_tgid, waker_tid) = current();
    let target_cpu = read_tp::<i32>(&ctx, offset!(wakeup_target_cpu)).unwrap_or(-1);
    emit(
        kind::WAKEUP,
        WakeupEvent {
            hdr: header(kind::WAKEUP, tgid, tid),
            waker_tid,
            waker_tgid,
            target_cpu: target_cpu as u32,
            _pad: 0,
        },
    );
    0
}

#[tracepoint]
pub fn tracepoint_sched_migrate_task(ctx: TracePointContext) -> u32 {
    let Some(pid) = read_tp::<i32>(&ctx, offset!(migrate_pid)) else {
        return 0;
    };
    let tid = pid as u32;
    let Some(tgid) = target_of_thread(tid) else {
        return 0;
    };
    let orig_cpu = read_tp::<i32>(&ctx, offset!(migrate_orig_cpu)).unwrap_or(-1);
    let dest_cpu = read_tp::<i32>(&ctx, offset!(migrate_dest_cpu)).unwrap_or(-1);
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
    let (tgid, tid) = current();
    if !is_target(tgid) {
        return 0;
    }
    let Some(child) = read_tp::<i32>(&ctx, offset!(fork_child_pid)) else {
        return 0;
    };
    let child_tid = child as u32;
    // Tentative: a new thread stays; a new process is dropped at its first switch-out.
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

/// A target thread's user page fault. A raw tracepoint: the kernel passes the arguments
/// as they are instead of building a trace record first (program time 381 → 298 ns a
/// fault here, docs/benchmarks.md).
#[raw_tracepoint(tracepoint = "page_fault_user")]
pub fn raw_page_fault_user(ctx: RawTracePointContext) -> i32 {
    let (tgid, tid) = current();
    if !is_target(tgid) {
        return 0;
    }
    let _timed = TargetRun::start(timed::PAGE_FAULT_USER);
    let address: u64 = ctx.arg(0);
    let regs: u64 = ctx.arg(1);
    let error_code: u64 = ctx.arg(2);
    // SAFETY: the helper checks the kernel address.
    let ip = unsafe { bpf_probe_read_kernel((regs + PT_REGS_IP) as *const u64) }.unwrap_or(0);
    emit(
        kind::FAULT,
        FaultEvent {
            hdr: header(kind::FAULT, tgid, tid),
            address,
            ip,
            error_code,
        },
    );
    0
}

/// Offset of `ip` in x86-64's `struct pt_regs` (the user ABI's register order).
const PT_REGS_IP: u64 = 16 * 8;

/// Entry times of the user page faults target threads are handling, by thread id.
#[map]
static FAULT_START: HashMap<u32, FaultStart> = HashMap::with_max_entries(16384, 0);

#[repr(C)]
#[derive(Clone, Copy)]
struct FaultStart {
    ts_ns: u64,
    flags: u32,
    _pad: u32,
}

/// Entry of the fault handler (loaded only where the kernel permits fentry): a target
/// thread's user fault starts.
#[fentry(function = "handle_mm_fault")]
pub fn fentry_handle_mm_fault(ctx: FEntryContext) -> u32 {
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

/// Return of the fault handler: one record with the fault's start and end.
#[fexit(function = "handle_mm_fault")]
pub fn fexit_handle_mm_fault(ctx: FExitContext) -> u32 {
    let (tgid, tid) = current();
    // SAFETY: copied out at once.
    let Some(start) = (unsafe { FAULT_START.get(&tid) }).copied() else {
        return 0;
    };
    let _timed = TargetRun::start(timed::FEXIT_HANDLE_MM_FAULT);
    let _ = FAULT_START.remove(&tid);
    let address: u64 = ctx.arg(1);
    let result: u32 = ctx.ret().unwrap_or(0);
    emit(
        kind::FAULT_TIME,
        FaultTimeEvent {
            hdr: header(kind::FAULT_TIME, tgid, tid),
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
fn swap_or_stick(ctx: &TracePointContext, subkind: u32) {
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
    swap_or_stick(&ctx, numa_task::SWAP);
    0
}

#[tracepoint]
pub fn tracepoint_sched_stick_numa(ctx: TracePointContext) -> u32 {
    swap_or_stick(&ctx, numa_task::STICK);
    0
}

/// On-CPU sample of a target thread: kernel and user stacks, straight into the ring
/// buffer (bpf_get_stack, so no stack-map collisions).
#[perf_event]
pub fn perf_event_cpu_clock(ctx: PerfEventContext) -> u32 {
    let (tgid, tid) = current();
    if !is_target(tgid) {
        return 0;
    }
    let _timed = TargetRun::start(timed::PERF_EVENT_CPU_CLOCK);
    emit_stacks(ctx.as_ptr(), header(kind::SAMPLE, tgid, tid), true);
    0
}

/// The user stack at the first instruction of a traced function. Frame-pointer unwinding
/// there skips the caller (the callee has not pushed its frame yet, so the frame pointer
/// is still the caller's): the caller's return address is read from the top of the stack
/// and put second, after the function itself.
#[inline(always)]
fn emit_entry_stack(ctx: *mut core::ffi::c_void, rsp: u64, tgid: u32, tid: u32) {
    // The Python frames first: the record they belong to comes next in the buffer.
    let hdr = header(kind::CALL_STACK, tgid, tid);
    emit_py_stack(&hdr);
    let ring = ring();
    let Some(mut entry) = ring.reserve::<SampleEvent>(0) else {
        bump(u32::from(kind::CALL_STACK));
        return;
    };
    let event = entry.as_mut_ptr();
    // SAFETY: `event` points at reserved ring-buffer memory of the right size; the fields
    // user space reads are written here; the user read is checked by the helper.
    unsafe {
        (*event).hdr = hdr;
        (*event).kstack_len = 0;
        let stack = &raw mut (*event).ustack;
        let u = bpf_get_stack(
            ctx,
            stack.cast::<u64>().add(1).cast(),
            ((USTACK_DEPTH - 1) * 8) as u32,
            u64::from(BPF_F_USER_STACK),
        );
        let frames = if u > 0 { (u / 8) as usize } else { 0 };
        let caller = bpf_probe_read_user(rsp as *const u64).unwrap_or(0);
        if frames > 0 && caller != 0 {
            // [function, caller, the caller's callers...]
            (*stack)[0] = (*stack)[1];
            (*stack)[1] = caller;
            (*event).ustack_len = (frames + 1) as u32;
        } else {
            (*event).ustack_len = 0;
        }
    }
    entry.submit(wake_flags(ring));
}

/// Whether off-CPU stacks have kernel frames (`offcpu::KERNEL`).
#[inline(always)]
fn offcpu_kernel() -> bool {
    // SAFETY: a plain read of a read-only global.
    let stacks = unsafe { core::ptr::read_volatile(&raw const CONFIG.offcpu_stacks) };
    stacks == offcpu::KERNEL
}

/// Submits the current task's user stack, and its kernel stack if `kernel`, as a
/// `SampleEvent` under `hdr`.
#[inline(always)]
fn emit_stacks(ctx: *mut core::ffi::c_void, hdr: Header, kernel: bool) {
    // The Python frames first: the record they belong to comes next in the buffer.
    emit_py_stack(&hdr);
    let ring = ring();
    let Some(mut entry) = ring.reserve::<SampleEvent>(0) else {
        bump(u32::from(hdr.kind));
        return;
    };
    let event = entry.as_mut_ptr();
    // SAFETY: `event` points at reserved ring-buffer memory of the right size; every field
    // read by user space is written here (stack slots past the lengths are not read).
    unsafe {
        (*event).hdr = hdr;
        let k = if kernel {
            bpf_get_stack(
                ctx,
                (&raw mut (*event).kstack).cast(),
                (KSTACK_DEPTH * 8) as u32,
                0,
            )
        } else {
            0
        };
        (*event).kstack_len = if k > 0 { (k / 8) as u32 } else { 0 };
        let u = bpf_get_stack(
            ctx,
            (&raw mut (*event).ustack).cast(),
            (USTACK_DEPTH * 8) as u32,
            u64::from(BPF_F_USER_STACK),
        );
        (*event).ustack_len = if u > 0 { (u / 8) as u32 } else { 0 };
    }
    entry.submit(wake_flags(ring));
}

/// Appends one frame to a Python stack record; false when it is full.
#[inline(always)]
fn push_py(event: &mut PyStackEvent, code: u64, offset: u32) -> bool {
    // Each array indexed by a load of `len` of its own, checked on its own: where one
    // check served both, the 6.1 verifier lost the bound of the second index ("invalid
    // access to memory, mem_size=512 off=512").
    // SAFETY: a plain field of a valid record.
    let n = unsafe { core::ptr::read_volatile(&event.len) } as usize;
    let Some(c) = event.codes.get_mut(n) else {
        return false;
    };
    *c = code;
    // SAFETY: as above.
    let n = unsafe { core::ptr::read_volatile(&event.len) } as usize;
    let Some(o) = event.offsets.get_mut(n) else {
        return false;
    };
    *o = offset;
    event.len += 1;
    true
}

/// Writes the Python frames the current thread is executing as a `PY_STACK` record with
/// `stack`'s time, before the stack record itself: nothing when the thread is not a known
/// Python thread or runs no Python code. Walks the interpreter frame chain from the
/// thread state (`tstate->cframe->current_frame`, then `previous`), one user read per
/// frame, at most `PY_DEPTH` entries; code objects are named in user space.
#[inline(always)]
fn emit_py_stack(stack: &Header) {
    // SAFETY: copied out at once.
    let Some(tstate) = (unsafe { PY_THREADS.get(&stack.tid) }).copied() else {
        return;
    };
    let Some(layout) = (unsafe { PY_LAYOUTS.get(&stack.tgid) }).copied() else {
        return;
    };
    // SAFETY: bpf_probe_read_user checks the addresses.
    let Ok(cframe) =
        (unsafe { bpf_probe_read_user((tstate + u64::from(layout.tstate_cframe)) as *const u64) })
    else {
        return;
    };
    // 3.13 keeps the current frame in the thread state itself.
    let mut frame = if layout.cframe_current_frame == FIELD_ABSENT {
        cframe
    } else {
        match unsafe {
            bpf_probe_read_user((cframe + u64::from(layout.cframe_current_frame)) as *const u64)
        } {
            Ok(frame) => frame,
            Err(_) => return,
        }
    };
    if frame == 0 {
        return;
    }
    let ring = ring();
    let Some(mut entry) = ring.reserve::<PyStackEvent>(0) else {
        bump(u32::from(kind::PY_STACK));
        return;
    };
    // SAFETY: reserved ring-buffer memory of the right size, written before it is read.
    let event = unsafe { &mut *entry.as_mut_ptr() };
    event.hdr = Header {
        kind: kind::PY_STACK,
        ..*stack
    };
    event.len = 0;
    event.truncated = 0;
    let mut window = [0u64; 16];
    for _ in 0..PY_DEPTH {
        if frame == 0 {
            break;
        }
        // SAFETY: the helper checks the user address; the buffer holds the window.
        let bytes = unsafe {
            core::slice::from_raw_parts_mut(window.as_mut_ptr().cast::<u8>(), PY_FRAME_WINDOW)
        };
        if unsafe { aya_ebpf::helpers::bpf_probe_read_user_buf(frame as *const u8, bytes) }.is_err()
        {
            break;
        }
        let word = |at: u32| window[(at as usize >> 3) & 15];
        let byte = |at: u32| (word(at) >> ((at & 7) * 8)) as u8;
        let code = word(layout.frame_code);
        let full = if u32::from(byte(layout.frame_owner)) == layout.owner_cstack {
            // The shim frame an interpreter entry pushes (3.12): a boundary, no code.
            !push_py(event, PY_ENTRY, 0)
        } else {
            // 3.10 keeps an index there, not a pointer: user space undoes the subtraction
            // (no branch here: each one multiplies the verifier's work over the loop).
            let offset = word(layout.frame_instr).wrapping_sub(code) as u32;
            let entry_frame =
                layout.frame_is_entry != FIELD_ABSENT && byte(layout.frame_is_entry) != 0;
            !push_py(event, code, offset) || (entry_frame && !push_py(event, PY_ENTRY, 0))
        };
        frame = word(layout.frame_previous);
        if full {
            break;
        }
    }
    // Frames left: the walk hit its bound, or a frame could not be read.
    event.truncated = u32::from(frame != 0);
    entry.submit(wake_flags(ring));
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";

/// `nccltrace bench-pair` only, the benchmarks' baseline: the least a uprobe/uretprobe pair
/// that produces one record per call does (nothing at entry; at return one 8-byte record,
/// the reader woken as by default).
#[uprobe]
pub fn bench_entry(_ctx: ProbeContext) -> u32 {
    0
}

/// See [`bench_entry`].
#[uretprobe]
pub fn bench_return(_ctx: RetProbeContext) -> u32 {
    if let Some(mut entry) = EVENTS_0.reserve::<u64>(0) {
        // SAFETY: a helper without preconditions.
        entry.write(unsafe { bpf_ktime_get_ns() });
        entry.submit(0);
    }
    0
}
