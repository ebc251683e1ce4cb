//! Stack records: on-CPU samples, reused native stacks and their keys, Python frames and the
//! interpreter layout the walk reads them by.

use crate::Header;

/// Kernel frames kept per sample.
pub const KSTACK_DEPTH: usize = 32;
/// User frames kept per sample.
pub const USTACK_DEPTH: usize = 64;

/// An on-CPU sample of a target thread. Only the first `kstack_len` / `ustack_len`
/// entries of the stacks are meaningful.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SampleEvent {
    pub hdr: Header,
    pub kstack_len: u32,
    pub ustack_len: u32,
    pub kstack: [u64; KSTACK_DEPTH],
    pub ustack: [u64; USTACK_DEPTH],
}
const _: () = assert!(core::mem::size_of::<SampleEvent>() == 800);

/// A stack record whose native frames are the thread's previous ones of the same kind
/// ([`crate::kind::STACK_SAME`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StackSameEvent {
    pub hdr: Header,
    /// The kind of stack record it stands for: [`crate::kind::OFFCPU`],
    /// [`crate::kind::CALL_STACK`] or [`crate::kind::PY_FRAMES`].
    pub of: u32,
    /// Of Python frames: the kind of the stack record they go with, whose kept walk they
    /// are ([`crate::kind::OFFCPU`] or [`crate::kind::CALL_STACK`]); 0 before format 5,
    /// when a thread kept one walk for both. Of native frames, `of` again (unused).
    pub with: u32,
}
const _: () = assert!(core::mem::size_of::<StackSameEvent>() == 32);

/// How long a thread's native stack is reused by [`crate::kind::STACK_SAME`] records before it
/// is taken whole again (ns): bounds how long a recording window (or a reader that lost
/// the whole record) goes without it.
pub const STACK_REUSE_NS: u64 = 1_000_000_000;

/// The key a thread's native stack is reused under (per thread, by kind): where the
/// thread is and the innermost frame link (`STACK_SAME`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StackKey {
    /// The thread the slot holds (slots are indexed by tid modulo their count).
    pub tid: u32,
    pub _pad: u32,
    /// When the whole stack was taken.
    pub taken_ns: u64,
    pub ip: u64,
    pub sp: u64,
    pub bp: u64,
    /// The two words at `bp` (the caller's frame pointer and its return address), and
    /// at a call's entry the return address on top of the stack.
    pub words: [u64; 3],
}

/// Slots of the per-thread stack keys (a power of two).
pub const STACK_KEY_SLOTS: u32 = 4096;

/// The key a thread's Python frames are reused under (a `STACK_SAME` record of
/// [`crate::kind::PY_FRAMES`]): where the thread state says the current frame is, and the
/// innermost frame and its caller, each by address, code object and instruction word.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PyKey {
    /// The thread the slot holds (slots are indexed by tid modulo [`STACK_KEY_SLOTS`]).
    pub tid: u32,
    pub _pad: u32,
    /// When the frames were walked whole.
    pub taken_ns: u64,
    /// `tstate->cframe` (the C frame of the running interpreter loop, 3.11 and 3.12) or
    /// `tstate->current_frame` (3.13).
    pub holder: u64,
    /// The innermost frame and its caller (0: none).
    pub frames: [u64; 2],
    pub codes: [u64; 2],
    pub instrs: [u64; 2],
}
const _: () = assert!(core::mem::size_of::<PyKey>() == 72);

/// Python frames kept per stack (innermost first, entry markers included).
pub const PY_DEPTH: usize = 40;

/// `PyStackEvent::codes` value marking the end of one run of the interpreter loop (an
/// entry frame: the frames after it were executed by an outer `_PyEval_EvalFrameDefault`).
pub const PY_ENTRY: u64 = 0;

/// The Python frames of one stack, innermost first: each frame's code object and how far
/// into it the frame's instruction pointer is (bytes from the code object's address);
/// `codes[i] == PY_ENTRY` marks an interpreter entry between frames.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PyStackEvent {
    pub hdr: Header,
    /// Frames in use.
    pub len: u32,
    /// Nonzero: the walk stopped at [`PY_DEPTH`] with frames left (the outermost are
    /// missing).
    pub truncated: u32,
    pub codes: [u64; PY_DEPTH],
    pub offsets: [u32; PY_DEPTH],
}
const _: () = assert!(core::mem::size_of::<PyStackEvent>() == 512);

/// The Python frames of one stack, innermost first, as [`PyStackEvent`] but every entry a
/// frame: bit `i` of `entries` says an interpreter entry (a `PY_ENTRY` marker) follows
/// frame `i` ([`crate::kind::PY_FRAMES`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PyFramesEvent {
    pub hdr: Header,
    /// Frames in use.
    pub len: u32,
    /// [`PY_TRUNCATED`]: the walk stopped at [`PY_DEPTH`] with frames left (the outermost
    /// are missing); [`PY_KEYED`]: what later `STACK_SAME` records of the thread's Python
    /// frames stand for.
    pub truncated: u32,
    pub entries: u64,
    pub codes: [u64; PY_DEPTH],
    pub offsets: [u32; PY_DEPTH],
}
const _: () = assert!(core::mem::size_of::<PyFramesEvent>() == 520);

/// [`PyFramesEvent::truncated`] bit: outer frames are missing.
pub const PY_TRUNCATED: u32 = 1;
/// [`PyFramesEvent::truncated`] bit: the frames were kept as the thread's [`PyKey`]
/// (an off-CPU or call-entry stack's walk, not a sample's): the `STACK_SAME` records of
/// Python frames that follow for the thread stand for these.
pub const PY_KEYED: u32 = 2;
/// With [`PY_KEYED`]: kept as the walk of the thread's call-entry stacks.
pub const PY_KEYED_CALL: u32 = 4;
/// With [`PY_KEYED`]: kept as the walk of the thread's off-CPU stacks. With neither bit
/// (before format 5) the thread kept one walk for both.
pub const PY_KEYED_OFFCPU: u32 = 8;

/// Where a CPython interpreter keeps what the frame walk reads (per target process,
/// `PY_LAYOUTS`; byte offsets, [`crate::FIELD_ABSENT`] for a field the version lacks).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PyLayout {
    /// `PyThreadState` → `_PyCFrame *cframe` (3.11, 3.12), or → the current frame itself
    /// (3.13 `current_frame`, 3.10 `frame`).
    pub tstate_cframe: u32,
    /// `_PyCFrame` → `current_frame`; [`crate::FIELD_ABSENT`] where the thread state points at
    /// the frame itself (3.13).
    pub cframe_current_frame: u32,
    /// `_PyInterpreterFrame` → `previous`.
    pub frame_previous: u32,
    /// `_PyInterpreterFrame` → the code object (`f_code`).
    pub frame_code: u32,
    /// `_PyInterpreterFrame` → the instruction pointer (`prev_instr`); 3.10: `f_lasti`, an
    /// index, reported minus the code object's address all the same (user space adds it
    /// back).
    pub frame_instr: u32,
    /// `_PyInterpreterFrame` → `owner` (a byte).
    pub frame_owner: u32,
    /// `_PyInterpreterFrame` → `is_entry` (a byte; 3.11 only).
    pub frame_is_entry: u32,
    /// The `owner` of the interpreter's entry shim frames (3.12: `FRAME_OWNED_BY_CSTACK`).
    pub owner_cstack: u32,
}
const _: () = assert!(core::mem::size_of::<PyLayout>() == 32);

/// Bytes of an interpreter frame the walk reads at once; every [`PyLayout`] frame field
/// lies inside them (3.10's `f_lasti` ends at 100).
pub const PY_FRAME_WINDOW: usize = 104;
