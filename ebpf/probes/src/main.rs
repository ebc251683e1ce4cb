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
    bindings::{
        BPF_F_USER_STACK, BPF_RB_AVAIL_DATA, BPF_RB_FORCE_WAKEUP, BPF_RB_NO_WAKEUP, pt_regs,
    },
    helpers::{
        bpf_get_attach_cookie, bpf_get_current_pid_tgid, bpf_get_current_task_btf,
        bpf_get_smp_processor_id, bpf_get_stack, bpf_ktime_get_ns, bpf_loop, bpf_probe_read_kernel,
        bpf_probe_read_user, bpf_probe_read_user_str_bytes, bpf_task_pt_regs,
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
    NumaTaskEvent, PY_DEPTH, PY_ENTRY, PY_FRAME_WINDOW, PY_KEYED, PY_KEYED_CALL, PY_KEYED_OFFCPU,
    PY_TRUNCATED, PageMigrationEvent, PendingCall, PyFramesEvent, PyKey, PyLayout, RING_SHARDS,
    STACK_KEY_SLOTS, STACK_REUSE_NS, SampleEvent, StackKey, StackSameEvent, SwitchEvent, TaskEvent,
    TpOffsets, USTACK_DEPTH, WakeupEvent, call_stacks, counter, func, kind, maybe, numa_task,
    offcpu, run, switch_flags, timed,
};

/// Every record, in ring buffers shared by groups of CPUs (`CONFIG.shards` of them in use,
/// each sized by user space at load): one buffer for all CPUs makes every producer fight
/// over its reservation lock (measured on 16 cores: the return program 162 ns with one
/// producer, 4.9 µs with fourteen). User space merges them by time.
#[map]
pub(crate) static EVENTS_0: RingBuf = RingBuf::with_byte_size(1 << 20, 0);
#[map]
pub(crate) static EVENTS_1: RingBuf = RingBuf::with_byte_size(4096, 0);
#[map]
pub(crate) static EVENTS_2: RingBuf = RingBuf::with_byte_size(4096, 0);
#[map]
pub(crate) static EVENTS_3: RingBuf = RingBuf::with_byte_size(4096, 0);
#[map]
pub(crate) static EVENTS_4: RingBuf = RingBuf::with_byte_size(4096, 0);
#[map]
pub(crate) static EVENTS_5: RingBuf = RingBuf::with_byte_size(4096, 0);
#[map]
pub(crate) static EVENTS_6: RingBuf = RingBuf::with_byte_size(4096, 0);
#[map]
pub(crate) static EVENTS_7: RingBuf = RingBuf::with_byte_size(4096, 0);

/// This CPU's ring buffer.
#[inline(always)]
pub(crate) fn ring() -> &'static RingBuf {
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
pub(crate) static COUNTERS: PerCpuArray<u64> = PerCpuArray::with_max_entries(counter::COUNT, 0);

/// Runs, timed runs and their nanoseconds of the timed programs for traced threads
/// ([`timed`]).
#[map]
pub(crate) static TARGET_COSTS: PerCpuArray<u64> =
    PerCpuArray::with_max_entries(timed::SLOTS * timed::COUNT, 0);

/// Every program's runs and their nanoseconds while `TIMING` is set ([`run`]).
#[map]
pub(crate) static PROGRAM_COSTS: PerCpuArray<u64> =
    PerCpuArray::with_max_entries(run::SLOTS * run::COUNT, 0);

/// One `u32`, nonzero while the programs account their runs (user space sets it with the
/// accounting's windows; see `names::TIMING`).
#[map]
pub(crate) static TIMING: Array<u32> = Array::with_max_entries(1, 0);

/// Per pid, whether it may be a target thread or thread group ([`maybe`]): sized by user
/// space to the host's pid_max.
#[map]
pub(crate) static MAYBE: Array<u8> = Array::with_max_entries(1, 0);

/// Nonzero from attach to the stop (`names::ARMED`).
#[map]
pub(crate) static ARMED: Array<u32> = Array::with_max_entries(1, 0);

/// Target thread groups (tgid → flags), filled by user space before attach.
#[map]
pub(crate) static TARGETS: HashMap<u32, u32> = HashMap::with_max_entries(1024, 0);

/// Threads of the targets (tid → tgid): lets scheduler events about a task that is not
/// `current` (the next task of a switch, a wakee) be filtered without reading task_struct.
#[map]
pub(crate) static THREADS: HashMap<u32, u32> = HashMap::with_max_entries(65536, 0);

/// Python thread states of target threads (tid → `PyThreadState *`), kept by user space
/// (`--python`): a thread found here gets its Python frames walked with its stacks.
#[map]
pub(crate) static PY_THREADS: HashMap<u32, u64> = HashMap::with_max_entries(16384, 0);

/// How to walk each Python target's frames (tgid → layout of its CPython version).
#[map]
pub(crate) static PY_LAYOUTS: HashMap<u32, PyLayout> = HashMap::with_max_entries(1024, 0);

/// The bytes of one interpreter frame, read by the walk of Python frames: on the stack
/// they would push the programs that walk (near the kernel's 512 bytes for a whole call
/// chain) over it, with the walk's frame added. Used within one turn of the walk; the
/// programs that walk do not interrupt one another on a CPU (docs/python.md).
#[map]
pub(crate) static PY_WINDOW: PerCpuArray<[u64; 16]> = PerCpuArray::with_max_entries(1, 0);

/// Switch-out times of target threads off the CPU, while their off-CPU stacks wait for the
/// switch-in (`OFFCPU_MIN`). LRU: a thread that exits is switched out one last
/// time and never comes back.
#[map]
pub(crate) static OFF_SINCE: LruHashMap<u32, u64> = LruHashMap::with_max_entries(16384, 0);

/// The shortest off-CPU stretch whose stacks are taken, as the thread comes back (ns; 0:
/// taken at every switch-out); see `names::OFFCPU_MIN`.
#[map]
pub(crate) static OFFCPU_MIN: Array<u64> = Array::with_max_entries(1, 0);

/// The value of `OFFCPU_MIN`.
#[inline(always)]
pub(crate) fn offcpu_min_ns() -> u64 {
    OFFCPU_MIN.get(0).copied().unwrap_or(0)
}

/// Calls in flight, keyed by `tid << 32 | function id`.
#[map]
pub(crate) static PENDING: HashMap<u64, PendingCall> = HashMap::with_max_entries(16384, 0);

/// Calls in flight by thread slot (see [`CallSlot`]); `PENDING` takes the rest.
#[map]
pub(crate) static SLOTS: Array<CallSlot> = Array::with_max_entries(CALL_SLOTS, 0);

/// Tracepoint field offsets for this kernel, set by user space before load.
#[unsafe(no_mangle)]
pub(crate) static OFFSETS: TpOffsets = TpOffsets {
    switch_prev_pid: 0,
    switch_prev_state: 0,
    switch_next_pid: 0,
    wakeup_pid: 0,
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
    task_pid: 0,
    task_cpu: 0,
};

/// Switches set by user space before load.
#[unsafe(no_mangle)]
pub(crate) static CONFIG: Config = Config {
    offcpu_stacks: 0,
    call_stacks: 0,
    streams: 0,
    shards: 1,
    wakeup_bytes: 0,
    reuse_stacks: 0,
    py_loop: 0,
};

macro_rules! offset {
    ($field:ident) => {
        // SAFETY: a plain read of a read-only global; volatile so the loader's value is used
        // instead of the zero compiled in.
        unsafe { core::ptr::read_volatile(&raw const OFFSETS.$field) as usize }
    };
}

mod calls;
mod memory;
mod python;
mod sched;
mod stacks;

#[inline(always)]
pub(crate) fn bump(index: u32) {
    add(&COUNTERS, index, 1);
}

/// Adds `value` to this CPU's slot `index` of `map`.
#[inline(always)]
pub(crate) fn add(map: &PerCpuArray<u64>, index: u32, value: u64) {
    if let Some(slot) = map.get_ptr_mut(index) {
        // SAFETY: per-CPU slot, no other writer on this CPU while the program runs.
        unsafe { *slot += value };
    }
}

/// Whether the programs account their runs now (`TIMING`).
#[inline(always)]
fn timing() -> bool {
    TIMING.get(0).is_some_and(|on| *on != 0)
}

/// A program's whole run, from its making (its first statement) to its drop (at every
/// return), counted and timed into `PROGRAM_COSTS` under `id` while `TIMING` is set: the
/// program's own accounting in place of the kernel's (`BPF_ENABLE_STATS`), which flips a
/// static key in every program's entry path on the host each time it is turned on or off
/// (issue 59). Outside the windows a run costs one array load.
pub(crate) struct ProgramRun {
    slot: u32,
    /// 0 or 1: not timed (the switch was off at the start).
    start_ns: u64,
}

impl ProgramRun {
    #[inline(always)]
    pub(crate) fn start(id: u32) -> ProgramRun {
        let slot = run::SLOTS * id;
        let Some(switch) = TIMING.get_ptr(0) else {
            return ProgramRun { slot, start_ns: 0 };
        };
        // SAFETY: a live map value.
        let start_ns = if unsafe { core::ptr::read_volatile(switch) } != 0 {
            // SAFETY: helper without preconditions.
            unsafe { bpf_ktime_get_ns() }
        } else {
            // The switch read again rather than a 0: a constant on one path and a clock on
            // the other, tested at the drop, make the verifier walk the whole program once
            // for each (the entry program's comment on its cookie). At run time this is 0,
            // or 1 if the switch was turned on in between: both below any clock reading.
            // SAFETY: a live map value.
            u64::from(unsafe { core::ptr::read_volatile(switch) })
        };
        ProgramRun { slot, start_ns }
    }
}

impl Drop for ProgramRun {
    #[inline(always)]
    fn drop(&mut self) {
        if self.start_ns <= 1 {
            return;
        }
        // SAFETY: helper without preconditions.
        let ns = unsafe { bpf_ktime_get_ns() }.wrapping_sub(self.start_ns);
        add(&PROGRAM_COSTS, self.slot, 1);
        add(&PROGRAM_COSTS, self.slot + 1, ns);
    }
}

/// Times the rest of a program's run for a traced thread: from its making to its drop (at
/// every return after it), added to `TARGET_COSTS` under `id`.
pub(crate) struct TargetRun {
    id: u32,
    start_ns: u64,
    /// Not added up (a run of a probe made for a target, counted whole in user space).
    skip: bool,
}

impl TargetRun {
    #[inline(always)]
    fn start(id: u32) -> TargetRun {
        Self::start_unless(id, false)
    }

    /// Timed unless `skip`. The start is read either way: where it was read on one path
    /// only, the verifier walked what follows (the Python frames' loop) once for each,
    /// and the entry program's verification went from ~60 to ~85 ms.
    #[inline(always)]
    pub(crate) fn start_unless(id: u32, skip: bool) -> TargetRun {
        // SAFETY: helper without preconditions.
        let start_ns = unsafe { bpf_ktime_get_ns() };
        TargetRun { id, start_ns, skip }
    }
}

impl Drop for TargetRun {
    #[inline(always)]
    fn drop(&mut self) {
        if self.skip {
            return;
        }
        let slot = timed::SLOTS * self.id;
        add(&TARGET_COSTS, slot, 1);
        // Timed only in the accounting's windows: the clock read and the sum cost every
        // run otherwise.
        if timing() {
            // SAFETY: helper without preconditions.
            let ns = unsafe { bpf_ktime_get_ns() }.wrapping_sub(self.start_ns);
            add(&TARGET_COSTS, slot + 1, 1);
            add(&TARGET_COSTS, slot + 2, ns);
        }
    }
}

#[inline(always)]
pub(crate) fn is_target(tgid: u32) -> bool {
    // SAFETY: the value is not kept past this call.
    may_be(tgid, maybe::PROCESS) && unsafe { TARGETS.get(&tgid) }.is_some()
}

#[inline(always)]
pub(crate) fn target_of_thread(tid: u32) -> Option<u32> {
    if !may_be(tid, maybe::THREAD) {
        return None;
    }
    // SAFETY: copied out at once.
    unsafe { THREADS.get(&tid) }.copied()
}

/// Whether tracing is on (from attach to the stop).
#[inline(always)]
pub(crate) fn armed() -> bool {
    ARMED.get(0).is_some_and(|on| *on != 0)
}

/// Whether `pid` may be a target thread or thread group (`bit`): false only where its byte
/// says it is not (a pid past the map's end may be).
#[inline(always)]
fn may_be(pid: u32, bit: u8) -> bool {
    MAYBE.get(pid).is_none_or(|bits| bits & bit != 0)
}

/// Marks `tid` as a possible target thread, before its `THREADS` entry is made.
#[inline(always)]
pub(crate) fn mark_thread(tid: u32) {
    if let Some(bits) = MAYBE.get_ptr_mut(tid) {
        // SAFETY: a live map value; only this bit is ever set here, and user space sets a
        // thread group's bit before that group is a target (so before any program sets a
        // bit of its threads).
        unsafe { *bits |= maybe::THREAD };
    }
}

#[inline(always)]
pub(crate) fn header(kind: u16, tgid: u32, tid: u32) -> Header {
    // SAFETY: helper without preconditions.
    header_at(kind, tgid, tid, unsafe { bpf_ktime_get_ns() })
}

/// [`header`] with the time already taken.
#[inline(always)]
pub(crate) fn header_at(kind: u16, tgid: u32, tid: u32, ts_ns: u64) -> Header {
    Header {
        ts_ns,
        tgid,
        tid,
        kind,
        cpu: unsafe { bpf_get_smp_processor_id() } as u16,
        _pad: 0,
    }
}

/// Submit flags: wake the reader only once `CONFIG.wakeup_bytes` are waiting. A wake-up
/// per record costs the traced thread an interrupt and a cross-CPU wake-up; the reader
/// polls on a timer and is woken early only when the buffer starts to fill. Looking at
/// the fill level costs a record ~55 ns on the CPU machines (the reader's position lies
/// on a cache line the reader writes), a fifth of an entry-only call's program: small
/// records look for about one in [`WAKE_CHECK_EVERY`], chosen by a multiplicative hash of
/// their time `ts_ns` (spread even for records at a fixed period), so a buffer an eighth
/// full is noticed a few records later. `ts_ns` 0: look (records that are large, or
/// costly anyway).
#[inline(always)]
pub(crate) fn wake_flags(ring: &RingBuf, ts_ns: u64) -> u64 {
    // SAFETY: a plain read of a read-only global.
    let threshold = unsafe { core::ptr::read_volatile(&raw const CONFIG.wakeup_bytes) };
    if threshold == 0 {
        0
    } else if (ts_ns.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 60) < 16 / WAKE_CHECK_EVERY
        && ring.query(u64::from(BPF_RB_AVAIL_DATA)) >= threshold
    {
        u64::from(BPF_RB_FORCE_WAKEUP)
    } else {
        u64::from(BPF_RB_NO_WAKEUP)
    }
}

/// About one small record in this many looks at its buffer's fill level ([`wake_flags`]):
/// a power of two, at most 16.
const WAKE_CHECK_EVERY: u64 = 16;

/// Submits `value` as one record, counting it lost under `kind` when the buffer is full.
#[inline(always)]
pub(crate) fn emit<T: nccltrace_common::Record + 'static>(kind: u16, value: T) {
    submit_record(kind, value, false);
}

/// [`emit`], the record's time read once it is made, just before it is handed on (the
/// end of what the record times, the program's own run up to there included).
#[inline(always)]
pub(crate) fn emit_ending_now<T: nccltrace_common::Record + 'static>(kind: u16, value: T) {
    submit_record(kind, value, true);
}

#[inline(always)]
fn submit_record<T: nccltrace_common::Record + 'static>(kind: u16, value: T, stamp: bool) {
    let ring = ring();
    match ring.reserve::<T>(0) {
        Some(mut entry) => {
            entry.write(value);
            // SAFETY: every record begins with its header, just written.
            let hdr = unsafe { &mut *entry.as_mut_ptr().cast::<Header>() };
            if stamp {
                // SAFETY: helper without preconditions.
                hdr.ts_ns = unsafe { bpf_ktime_get_ns() };
            }
            let ts_ns = hdr.ts_ns;
            entry.submit(wake_flags(ring, ts_ns));
        }
        None => bump(u32::from(kind)),
    }
}

#[inline(always)]
pub(crate) fn current() -> (u32, u32) {
    let pid_tgid = bpf_get_current_pid_tgid();
    ((pid_tgid >> 32) as u32, pid_tgid as u32)
}

#[inline(always)]
pub(crate) fn read_tp<T>(ctx: &TracePointContext, offset: usize) -> Option<T> {
    // SAFETY: the offset comes from this kernel's format file for this tracepoint.
    unsafe { ctx.read_at::<T>(offset) }.ok()
}

#[cfg(not(test))]
#[panic_handler]
pub(crate) fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
pub(crate) static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";

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
