//! The NCCL and CUDA calls: the entry program keeps the arguments (or, traced at entry
//! only, writes the record), the return program pairs them and writes one record.

use crate::stacks::emit_entry_stack;
#[allow(clippy::wildcard_imports)]
use crate::*;

/// Entry of a traced library call: remember the time and the arguments.
#[uprobe]
pub fn uprobe_lib_call(ctx: ProbeContext) -> u32 {
    let _run = ProgramRun::start(run::UPROBE_LIB_CALL);
    let (tgid, tid) = current();
    // SAFETY: the cookie is the function id user space attached with (and its flags).
    let cookie = unsafe { bpf_get_attach_cookie(ctx.as_ptr()) } as u32;
    // A probe made for one target fires only there: the check and the self-timing (for
    // the cost of the runs in traced threads) are for probes on every process. After the
    // stop neither kind writes (the other kind finds its target gone from `TARGETS`).
    if (cookie & func::IN_TARGET == 0 && !is_target(tgid)) || !armed() {
        return 0;
    }
    // The flag read again for the timer: the one tested above is a known constant on
    // each path after the test, and two constants kept apart made the verifier walk the
    // rest (the Python frames' loop) once for each (entry program verified in ~55 ms
    // instead of ~45 here). A volatile read of the copy on the stack: the compiler cannot
    // reuse what it knows, and the verifier does not narrow the spilled value by a test of
    // another register (a second helper call cost ~20 ns a run).
    // SAFETY: a live local.
    let again = unsafe { core::ptr::read_volatile(&raw const cookie) };
    let run = TargetRun::start_unless(timed::UPROBE_LIB_CALL, again & func::IN_TARGET != 0);
    let cookie = cookie & !func::IN_TARGET;
    let func_id = cookie & !func::ENTRY_ONLY;
    // SAFETY: regs is the probe's own register snapshot.
    let regs = unsafe { &*ctx.regs };
    let mut pending = PendingCall {
        // The timer's start is the call's (one clock read, ~40 ns, fewer).
        start_ns: run.start_ns,
        args: [
            regs.rdi, regs.rsi, regs.rdx, regs.rcx, regs.r8, regs.r9, 0, 0,
        ],
    };
    // Two stores: written in the literal, the two words of all ones became a call of the
    // program's `memset` (a BPF-to-BPF call on every traced call).
    // SAFETY: fields of a live local.
    unsafe {
        (&raw mut pending.args[6]).write_volatile(NOT_READ);
        (&raw mut pending.args[7]).write_volatile(NOT_READ);
    }
    // SAFETY: a plain read of a read-only global.
    let stacks = unsafe { core::ptr::read_volatile(&raw const CONFIG.call_stacks) };
    if call_stacks::wanted(stacks, func_id) {
        // Where the call was made from: the wait inside it is drawn at this call site.
        emit_entry_stack(ctx.as_ptr(), regs, tgid, tid);
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
                hdr: header_at(kind::CALL, tgid, tid, pending.start_ns),
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
pub(crate) unsafe fn claim(owner: *mut u64, key: u64) -> bool {
    use core::intrinsics::{AtomicOrdering, atomic_cxchg};
    // SAFETY: the caller passes a live, aligned u64.
    unsafe {
        atomic_cxchg::<u64, { AtomicOrdering::AcqRel }, { AtomicOrdering::Acquire }>(owner, 0, key)
    }
    .1
}

#[inline(always)]
pub(crate) fn call_key(tid: u32, func_id: u32) -> u64 {
    (u64::from(tid) << 32) | u64::from(func_id)
}

/// Keeps a call in flight in the hash map (its thread's slot is taken).
#[inline(always)]
pub(crate) fn park(ctx: &ProbeContext, key: u64, pending: &PendingCall) {
    if PENDING.insert(&key, pending, 0).is_err() {
        bump(counter::PENDING_FULL);
        warn!(ctx, "nccltrace: pending-call map full");
    }
}

/// The entry of the call returning now: from the thread's slot, else from the hash map.
#[inline(always)]
pub(crate) fn unpark(tid: u32, func_id: u32) -> Option<PendingCall> {
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
    let _run = ProgramRun::start(run::URETPROBE_LIB_CALL);
    let (tgid, tid) = current();
    // SAFETY: as in the entry program.
    let cookie = unsafe { bpf_get_attach_cookie(ctx.as_ptr()) } as u32;
    let in_target = cookie & func::IN_TARGET != 0;
    let func_id = cookie & !func::IN_TARGET;
    // Only target threads' entries are kept, so a found entry means a target: the target
    // lookup is needed only when none is found.
    let Some(pending) = unpark(tid, func_id) else {
        if in_target || is_target(tgid) {
            bump(counter::UNPAIRED_RETURN);
        }
        return 0;
    };
    // Its start is the return's time too (one clock read fewer).
    let run = TargetRun::start_unless(timed::URETPROBE_LIB_CALL, in_target);
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
                hdr: header_at(kind::CALL, tgid, tid, run.start_ns),
                start_ns: pending.start_ns,
                func: func_id,
                ret: ret as i32,
                args: pending.args,
                out,
            });
            entry.submit(wake_flags(ring, run.start_ns));
        }
        None => bump(u32::from(kind::CALL)),
    }
    0
}
