//! Stacks: on-CPU samples, the user stack at a call's entry, kernel and user stacks, and
//! the keys that let a thread's stack be said the same as its last one (the Python frames
//! walked beside them: `python.rs`).

use crate::python::emit_py_stack;
#[allow(clippy::wildcard_imports)]
use crate::*;

/// On-CPU sample of a target thread: kernel and user stacks, straight into the ring
/// buffer (bpf_get_stack, so no stack-map collisions).
#[perf_event]
pub fn perf_event_cpu_clock(ctx: PerfEventContext) -> u32 {
    let _run = ProgramRun::start(run::PERF_EVENT_CPU_CLOCK);
    let (tgid, tid) = current();
    if !is_target(tgid) {
        return 0;
    }
    let timed = TargetRun::start(timed::PERF_EVENT_CPU_CLOCK);
    // The timer's start is the record's time (one clock read fewer).
    let hdr = header_at(kind::SAMPLE, tgid, tid, timed.start_ns);
    emit_stacks(ctx.as_ptr(), hdr, true, false, false);
    0
}

/// The user stack at the first instruction of a traced function. Frame-pointer unwinding
/// there skips the caller (the callee has not pushed its frame yet, so the frame pointer
/// is still the caller's): the caller's return address is read from the top of the stack
/// and put second, after the function itself. Where the thread enters the function as it
/// did last time (`kind::STACK_SAME`), the native frames are not unwound again.
#[inline(always)]
pub(crate) fn emit_entry_stack(ctx: *mut core::ffi::c_void, regs: &pt_regs, tgid: u32, tid: u32) {
    // The Python frames first: the record they belong to comes next in the buffer.
    let hdr = header(kind::CALL_STACK, tgid, tid);
    let reuse = reuse_stacks();
    emit_py_stack(&hdr, reuse, false);
    // SAFETY: bpf_probe_read_user checks the addresses.
    let caller = unsafe { bpf_probe_read_user(regs.rsp as *const u64) }.unwrap_or(0);
    let framed = frame_pointer(regs.rsp, regs.rbp);
    let link = if reuse {
        frame_link(regs.rsp, regs.rbp)
    } else {
        [0, 0]
    };
    let key = StackKey {
        tid,
        _pad: 0,
        taken_ns: hdr.ts_ns,
        ip: regs.rip,
        sp: regs.rsp,
        bp: regs.rbp,
        words: [caller, link[0], link[1]],
    };
    if reuse && same_as_kept(&CALL_KEYS, native_slot(tid), &key, &hdr, kind::CALL_STACK) {
        return;
    }
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
        let u = user_stack(
            ctx,
            stack.cast::<u64>().add(1),
            ((USTACK_DEPTH - 1) * 8) as u32,
            framed,
            regs.rip,
        );
        let frames = if u > 0 { (u / 8) as usize } else { 0 };
        if frames > 0 && caller != 0 {
            // [function, caller, the caller's callers...]
            (*stack)[0] = (*stack)[1];
            (*stack)[1] = caller;
            (*event).ustack_len = (frames + 1) as u32;
        } else {
            (*event).ustack_len = 0;
        }
    }
    entry.submit(wake_flags(ring, 0));
    if reuse {
        keep(&CALL_KEYS, native_slot(tid), &key);
    }
}

/// Whether stacks are reused (`Config::reuse_stacks`).
#[inline(always)]
pub(crate) fn reuse_stacks() -> bool {
    // SAFETY: a plain read of a read-only global.
    unsafe { core::ptr::read_volatile(&raw const CONFIG.reuse_stacks) != 0 }
}

/// Per-thread keys of the last native stack written at a call's entry.
#[map]
pub(crate) static CALL_KEYS: Array<StackKey> = Array::with_max_entries(STACK_KEY_SLOTS, 0);

/// Per-thread keys of the last native stack written as a thread left the CPU.
#[map]
pub(crate) static OFFCPU_KEYS: Array<StackKey> = Array::with_max_entries(STACK_KEY_SLOTS, 0);

/// A thread's frames as a key: where they are, not what they are. Where a key equals the
/// one kept for its thread (under `STACK_REUSE_NS` ago), a `STACK_SAME` record stands for
/// the frames.
pub(crate) trait ReuseKey: Copy + 'static {
    fn tid(&self) -> u32;
    fn taken_ns(&self) -> u64;
    /// Whether the frames are where they were at `kept` (all but the time).
    fn same_place(&self, kept: &Self) -> bool;
}

/// The thread and time fields every key has.
macro_rules! key_head {
    () => {
        #[inline(always)]
        fn tid(&self) -> u32 {
            self.tid
        }

        #[inline(always)]
        fn taken_ns(&self) -> u64 {
            self.taken_ns
        }
    };
}

impl ReuseKey for StackKey {
    key_head!();

    /// Same place, same innermost frame link.
    #[inline(always)]
    fn same_place(&self, kept: &Self) -> bool {
        kept.ip == self.ip && kept.sp == self.sp && kept.bp == self.bp && kept.words == self.words
    }
}

impl ReuseKey for PyKey {
    key_head!();

    /// The same current frame holder, innermost frame and caller.
    #[inline(always)]
    fn same_place(&self, kept: &Self) -> bool {
        kept.holder == self.holder
            && kept.frames == self.frames
            && kept.codes == self.codes
            && kept.instrs == self.instrs
    }
}

/// A thread's slot in a map of native stack keys.
#[inline(always)]
pub(crate) fn native_slot(tid: u32) -> u32 {
    tid & (STACK_KEY_SLOTS - 1)
}

/// A thread's slot in [`PY_KEYS`]: one for the walks of its call-entry stacks, one for
/// its off-CPU stacks' (a thread that blocks elsewhere than in the call it enters, a
/// training loop's sync, would otherwise replace one with the other at every step).
#[inline(always)]
pub(crate) fn py_slot(tid: u32, with: u16) -> u32 {
    (native_slot(tid) << 1) | u32::from(with == kind::OFFCPU)
}

/// Whether `key` is where the frames last written for its thread in slot `slot` of `keys`
/// were, taken less than `STACK_REUSE_NS` ago: then a `STACK_SAME` record standing for a
/// record of kind `of` is written (with `hdr`'s time and thread) and true is returned.
#[inline(always)]
pub(crate) fn same_as_kept<K: ReuseKey>(
    keys: &Array<K>,
    slot: u32,
    key: &K,
    hdr: &Header,
    of: u16,
) -> bool {
    let same = is_kept(keys, slot, key);
    if same {
        emit_same(hdr, of);
    }
    same
}

/// Whether `key` is where the frames last written for its thread in slot `slot` of `keys`
/// were, taken less than `STACK_REUSE_NS` ago (nothing written).
#[inline(always)]
pub(crate) fn is_kept<K: ReuseKey>(keys: &Array<K>, slot: u32, key: &K) -> bool {
    let Some(kept) = keys.get(slot) else {
        return false;
    };
    kept.tid() == key.tid()
        && key.taken_ns().wrapping_sub(kept.taken_ns()) < STACK_REUSE_NS
        && key.same_place(kept)
}

/// Writes a `STACK_SAME` record standing for a record of kind `of` under `hdr`'s time and
/// thread (Python frames: with `hdr`'s kind, the stack they go with). Lost, it counts
/// under `of` (Python frames under `PY_STACK`).
#[inline(always)]
pub(crate) fn emit_same(hdr: &Header, of: u16) {
    let lost_as = if of == kind::PY_FRAMES {
        kind::PY_STACK
    } else {
        of
    };
    emit(
        lost_as,
        StackSameEvent {
            hdr: Header {
                kind: kind::STACK_SAME,
                ..*hdr
            },
            of: u32::from(of),
            with: u32::from(hdr.kind),
        },
    );
}

/// Keeps `key` in `slot` as its thread's last written frames (after their record was
/// written).
#[inline(always)]
pub(crate) fn keep<K: ReuseKey>(keys: &Array<K>, slot: u32, key: &K) {
    if let Some(slot) = keys.get_ptr_mut(slot) {
        // SAFETY: a live map value; a thread sharing the slot only makes the next
        // comparison fail.
        unsafe { *slot = *key };
    }
}

/// How far above the stack pointer a frame pointer is looked for ([`frame_link`]).
const FRAME_SPAN: u64 = 1 << 20;

/// Whether `bp` can be a frame pointer of the stack at `sp`: an aligned address less than
/// `FRAME_SPAN` above it. Code built without frame pointers keeps anything in that
/// register, and reading where nothing is mapped takes a page fault inside the program
/// (the frame link of the reuse key, and the kernel's unwinder, which then stops after
/// the instruction): on this VM's Python rank (Debian's CPython 3.11) that made every
/// off-CPU stack ~1 µs dearer, reused or not (docs/benchmarks.md, session 30). Where it
/// cannot be one, the link is not read and the user stack is the instruction alone, as
/// the unwinder would have made it.
#[inline(always)]
fn frame_pointer(sp: u64, bp: u64) -> bool {
    bp & 7 == 0 && bp.wrapping_sub(sp) < FRAME_SPAN
}

/// Writes the user stack into `buf` (`bytes` long) as the kernel's unwinder takes it;
/// where `framed` is false (no frame pointer to follow: [`frame_pointer`]) the
/// instruction `ip` alone, where the unwinder would have stopped. The bytes written, or
/// the helper's error.
///
/// # Safety
/// `buf` points at `bytes` bytes of writable memory (at least 8).
#[inline(always)]
unsafe fn user_stack(
    ctx: *mut core::ffi::c_void,
    buf: *mut u64,
    bytes: u32,
    framed: bool,
    ip: u64,
) -> i64 {
    if framed {
        // SAFETY: the caller's buffer; the helper checks what it reads.
        unsafe { bpf_get_stack(ctx, buf.cast(), bytes, u64::from(BPF_F_USER_STACK)) }
    } else {
        // SAFETY: the caller's buffer holds at least one word.
        unsafe { *buf = ip };
        8
    }
}

/// The two words at the frame pointer `bp` (the innermost frame link: the caller's frame
/// pointer and its return address) where it can be one ([`frame_pointer`]); else zeros.
#[inline(always)]
fn frame_link(sp: u64, bp: u64) -> [u64; 2] {
    if !frame_pointer(sp, bp) {
        return [0, 0];
    }
    // SAFETY: bpf_probe_read_user checks the address.
    unsafe { bpf_probe_read_user(bp as *const [u64; 2]) }.unwrap_or([0, 0])
}

/// The current task's user registers (where it entered the kernel) as a stack key.
#[inline(always)]
pub(crate) fn user_key(tid: u32, ts_ns: u64) -> Option<StackKey> {
    // SAFETY: helpers without preconditions; the registers are read with the checked
    // kernel read (pt_regs from `bp` at 32 to `sp` at 152).
    let regs = unsafe { bpf_task_pt_regs(bpf_get_current_task_btf()) } as u64;
    let words = unsafe { bpf_probe_read_kernel((regs + 4 * 8) as *const [u64; 16]) }.ok()?;
    // x86-64 pt_regs: bp is word 4, ip word 16 (`PT_REGS_IP`), sp word 19.
    let (bp, ip, sp) = (words[0], words[12], words[15]);
    let link = frame_link(sp, bp);
    Some(StackKey {
        tid,
        _pad: 0,
        taken_ns: ts_ns,
        ip,
        sp,
        bp,
        words: [link[0], link[1], 0],
    })
}

/// Whether off-CPU stacks have kernel frames (`offcpu::KERNEL`).
#[inline(always)]
pub(crate) fn offcpu_kernel() -> bool {
    // SAFETY: a plain read of a read-only global.
    let stacks = unsafe { core::ptr::read_volatile(&raw const CONFIG.offcpu_stacks) };
    stacks == offcpu::KERNEL
}

/// Submits the current task's user stack, and its kernel stack if `kernel`, as a
/// `SampleEvent` under `hdr`. Off-CPU stacks without kernel frames (`reuse`) are written
/// as `STACK_SAME` where the thread leaves as it did last time; with `fold`, where its
/// native frames are reused, neither `STACK_SAME` is written and the returned
/// `switch_flags` (`OFFCPU_SAME`, and `OFFCPU_PY_SAME` where its Python frames are reused
/// too) go into the switch record that follows instead: two ring records fewer at most
/// switch-outs of a training loop's threads. Else 0.
#[inline(always)]
pub(crate) fn emit_stacks(
    ctx: *mut core::ffi::c_void,
    hdr: Header,
    kernel: bool,
    reuse: bool,
    fold: bool,
) -> u32 {
    // The Python frames first: the record they belong to comes next in the buffer. Their
    // `STACK_SAME` waits until the native frames are known (`fold`).
    let py_same = emit_py_stack(&hdr, reuse && reuse_stacks(), fold);
    let key = if reuse && !kernel && reuse_stacks() {
        user_key(hdr.tid, hdr.ts_ns)
    } else {
        None
    };
    if let Some(key) = &key
        && is_kept(&OFFCPU_KEYS, native_slot(hdr.tid), key)
    {
        if fold {
            return switch_flags::OFFCPU_SAME
                | if py_same {
                    switch_flags::OFFCPU_PY_SAME
                } else {
                    0
                };
        }
        emit_same(&hdr, hdr.kind);
        return 0;
    }
    if py_same {
        emit_same(&hdr, kind::PY_FRAMES);
    }
    let ring = ring();
    let Some(mut entry) = ring.reserve::<SampleEvent>(0) else {
        bump(u32::from(hdr.kind));
        return 0;
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
        // Without a key (reuse off), the unwinder decides.
        let (framed, ip) = key
            .as_ref()
            .map_or((true, 0), |k| (frame_pointer(k.sp, k.bp), k.ip));
        let u = user_stack(
            ctx,
            (&raw mut (*event).ustack).cast(),
            (USTACK_DEPTH * 8) as u32,
            framed,
            ip,
        );
        (*event).ustack_len = if u > 0 { (u / 8) as u32 } else { 0 };
    }
    entry.submit(wake_flags(ring, 0));
    if let Some(key) = &key {
        keep(&OFFCPU_KEYS, native_slot(hdr.tid), key);
    }
    0
}
