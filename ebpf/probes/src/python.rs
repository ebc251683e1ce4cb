//! The Python frames of a thread, walked from its thread state beside each stack taken of
//! it, or said to be the same as its last walk's.

use crate::stacks::{emit_same, is_kept, keep, py_slot};
#[allow(clippy::wildcard_imports)]
use crate::*;

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
