//! Stacks: on-CPU samples, the user stack at a call's entry, kernel and user stacks, and
//! the Python frames walked beside them.

#[allow(clippy::wildcard_imports)]
use crate::*;

/// On-CPU sample of a target thread: kernel and user stacks, straight into the ring
/// buffer (bpf_get_stack, so no stack-map collisions).
#[perf_event]
pub fn perf_event_cpu_clock(ctx: PerfEventContext) -> u32 {
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
fn py_slot(tid: u32, with: u16) -> u32 {
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
fn is_kept<K: ReuseKey>(keys: &Array<K>, slot: u32, key: &K) -> bool {
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
fn emit_same(hdr: &Header, of: u16) {
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

/// Appends one frame to a Python stack record, with an interpreter-entry marker after it
/// when `marker` is 1 (a bit, not an entry: no branch depends on it, and each one
/// multiplies the verifier's work over the walk's loop); false when it is full.
#[inline(always)]
pub(crate) fn push_py(event: &mut PyFramesEvent, code: u64, offset: u32, marker: u64) -> bool {
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
    event.entries |= marker << (n & 63);
    event.len += 1;
    true
}

/// Where the `bpf_loop` walk of the Python frames stands: the record it fills, this CPU's
/// `PY_WINDOW` to read a frame into, the next frame.
struct PyWalk<'e> {
    event: &'e mut PyFramesEvent,
    window: &'e mut [u64; 16],
    frame: u64,
    entry_flag: u64,
    layout: PyLayout,
}

/// Whether the walk runs as a `bpf_loop` callback (`Config::py_loop`): the verifier checks
/// the callback once instead of every turn of an unrolled loop on every path to it.
#[inline(always)]
fn py_loop() -> bool {
    // SAFETY: a plain read of a read-only global; the verifier reads it as a constant and
    // skips the variant not taken (so kernels without `bpf_loop` never meet the call).
    unsafe { core::ptr::read_volatile(&raw const CONFIG.py_loop) != 0 }
}

/// One turn of the walk as a `bpf_loop` callback: 0 goes on, 1 stops.
extern "C" fn py_walk_step(_index: u64, walk: *mut core::ffi::c_void) -> i64 {
    // SAFETY: `walk` is the `PyWalk` `emit_py_stack` passed to the helper.
    let walk = unsafe { &mut *walk.cast::<PyWalk>() };
    i64::from(!py_frame(
        walk.event,
        walk.window,
        &mut walk.frame,
        &walk.layout,
        walk.entry_flag,
    ))
}

/// The walk as an unrolled loop (kernels before 5.17), a function of its own; the frame it
/// stopped at.
#[inline(never)]
fn py_walk_unrolled(
    event: &mut PyFramesEvent,
    window: &mut [u64; 16],
    mut frame: u64,
    layout: &PyLayout,
    entry_flag: u64,
) -> u64 {
    for _ in 0..PY_DEPTH {
        if !py_frame(event, window, &mut frame, layout, entry_flag) {
            break;
        }
    }
    frame
}

/// Reads the interpreter frame at `at` into `window` (its first `PY_FRAME_WINDOW` bytes);
/// false when it cannot be read.
#[inline(always)]
fn read_frame(window: &mut [u64; 16], at: u64) -> bool {
    // SAFETY: the helper checks the user address; the buffer holds the window.
    let bytes = unsafe {
        core::slice::from_raw_parts_mut(window.as_mut_ptr().cast::<u8>(), PY_FRAME_WINDOW)
    };
    unsafe { aya_ebpf::helpers::bpf_probe_read_user_buf(at as *const u8, bytes) }.is_ok()
}

/// Reads the frame `frame` into `window`, adds it to `event` and moves `frame` to the one
/// it was called from; false when the walk is over (no frame left, an unreadable frame, a
/// full record).
#[inline(always)]
fn py_frame(
    event: &mut PyFramesEvent,
    window: &mut [u64; 16],
    frame: &mut u64,
    layout: &PyLayout,
    entry_flag: u64,
) -> bool {
    if *frame == 0 {
        return false;
    }
    if !read_frame(window, *frame) {
        return false;
    }
    let word = |at: u32| window[(at as usize >> 3) & 15];
    let byte = |at: u32| (word(at) >> ((at & 7) * 8)) as u8;
    let code = word(layout.frame_code);
    let full = if u32::from(byte(layout.frame_owner)) == layout.owner_cstack {
        // The shim frame an interpreter entry pushes (3.12): a boundary, no code.
        !push_py(event, PY_ENTRY, 0, 0)
    } else {
        // 3.10 keeps an index there, not a pointer: user space undoes the subtraction
        // (no branch here: each one multiplies the verifier's work over the loop).
        let offset = word(layout.frame_instr).wrapping_sub(code) as u32;
        // 3.11's `is_entry` is a C bool (0 or 1): masked, not compared.
        let marker = u64::from(byte(layout.frame_is_entry)) & entry_flag & 1;
        !push_py(event, code, offset, marker)
    };
    *frame = word(layout.frame_previous);
    !full
}

/// Writes the Python frames the current thread is executing as a `PY_FRAMES` record with
/// `stack`'s time, before the stack record itself: nothing when the thread is not a known
/// Python thread or runs no Python code. Walks the interpreter frame chain from the
/// thread state (`tstate->cframe->current_frame`, then `previous`), one user read per
/// frame, at most `PY_DEPTH` entries; code objects are named in user space. With `reuse`,
/// frames that are where they were at the thread's previous walk ([`PyKey`]) are written
/// as a `STACK_SAME` record instead of being walked again; with `defer`, that record is
/// left to the caller and true returned (else false).
#[inline(always)]
pub(crate) fn emit_py_stack(stack: &Header, reuse: bool, defer: bool) -> bool {
    // SAFETY: copied out at once.
    let Some(tstate) = (unsafe { PY_THREADS.get(&stack.tid) }).copied() else {
        return false;
    };
    let Some(layout) = (unsafe { PY_LAYOUTS.get(&stack.tgid) }).copied() else {
        return false;
    };
    // SAFETY: bpf_probe_read_user checks the addresses.
    let Ok(cframe) =
        (unsafe { bpf_probe_read_user((tstate + u64::from(layout.tstate_cframe)) as *const u64) })
    else {
        return false;
    };
    // 3.13 keeps the current frame in the thread state itself.
    let frame = if layout.cframe_current_frame == FIELD_ABSENT {
        cframe
    } else {
        match unsafe {
            bpf_probe_read_user((cframe + u64::from(layout.cframe_current_frame)) as *const u64)
        } {
            Ok(frame) => frame,
            Err(_) => return false,
        }
    };
    if frame == 0 {
        return false;
    }
    // This CPU's frame window.
    let Some(window) = PY_WINDOW.get_ptr_mut(0) else {
        return false;
    };
    // SAFETY: this CPU's slot, written and read within one turn of the walk.
    let window = unsafe { &mut *window };
    // A key whole either way: an `Option` left its payload undefined on the failed read's
    // path, and the compiler then stored a register the verifier had not seen written.
    let (keyed, key) = if reuse {
        py_key(stack, cframe, frame, window, &layout)
    } else {
        (false, PyKey::default())
    };
    let slot = py_slot(stack.tid, stack.kind);
    if keyed && is_kept(&PY_KEYS, slot, &key) {
        if !defer {
            emit_same(stack, kind::PY_FRAMES);
        }
        return defer;
    }
    let ring = ring();
    let Some(mut entry) = ring.reserve::<PyFramesEvent>(0) else {
        bump(u32::from(kind::PY_STACK));
        return false;
    };
    // SAFETY: reserved ring-buffer memory of the right size, written before it is read.
    let event = unsafe { &mut *entry.as_mut_ptr() };
    event.hdr = Header {
        kind: kind::PY_FRAMES,
        ..*stack
    };
    event.len = 0;
    event.truncated = 0;
    event.entries = 0;
    // Whether frames say they entered the interpreter (3.11; 3.12 pushes shim frames).
    let entry_flag = u64::from(layout.frame_is_entry != FIELD_ABSENT);
    let frame = if py_loop() {
        let mut walk = PyWalk {
            event: &mut *event,
            window,
            frame,
            entry_flag,
            layout,
        };
        // SAFETY: the callback is a static function of this object; `walk` outlives the
        // call, and the helper passes it back unchanged.
        unsafe {
            bpf_loop(
                PY_DEPTH as u32,
                py_walk_step as *mut core::ffi::c_void,
                (&raw mut walk).cast(),
                0,
            );
        }
        walk.frame
    } else {
        py_walk_unrolled(event, window, frame, &layout, entry_flag)
    };
    // Frames left: the walk hit its bound, or a frame could not be read.
    let key_flags = if stack.kind == kind::OFFCPU {
        PY_KEYED | PY_KEYED_OFFCPU
    } else {
        PY_KEYED | PY_KEYED_CALL
    };
    event.truncated = if frame != 0 { PY_TRUNCATED } else { 0 } | if keyed { key_flags } else { 0 };
    entry.submit(wake_flags(ring, 0));
    if keyed {
        keep(&PY_KEYS, slot, &key);
    }
    false
}

/// Per-thread keys of the last Python frames walked whole, two slots a thread
/// ([`py_slot`]): for its call-entry stacks and for its off-CPU stacks.
#[map]
pub(crate) static PY_KEYS: Array<PyKey> = Array::with_max_entries(2 * STACK_KEY_SLOTS, 0);

/// The key of the thread's Python frames: `holder` (what the thread state points at), the
/// innermost frame `frame` and its caller, read into `window`; false with it when a frame
/// cannot be read.
#[inline(always)]
fn py_key(
    stack: &Header,
    holder: u64,
    frame: u64,
    window: &mut [u64; 16],
    layout: &PyLayout,
) -> (bool, PyKey) {
    let mut key = PyKey {
        tid: stack.tid,
        _pad: 0,
        taken_ns: stack.ts_ns,
        holder,
        frames: [frame, 0],
        codes: [0, 0],
        instrs: [0, 0],
    };
    for i in 0..2 {
        let at = key.frames[i];
        if at == 0 {
            break;
        }
        if !read_frame(window, at) {
            return (false, key);
        }
        let word = |at: u32| window[(at as usize >> 3) & 15];
        key.codes[i] = word(layout.frame_code);
        key.instrs[i] = word(layout.frame_instr);
        if i == 0 {
            key.frames[1] = word(layout.frame_previous);
        }
    }
    (true, key)
}
