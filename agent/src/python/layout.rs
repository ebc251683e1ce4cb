//! Where each CPython minor version keeps what the frame walk and the naming read: byte
//! offsets per version, and 3.13's own `_Py_DebugOffsets`.

use nccltrace_common::{FIELD_ABSENT, PyLayout};

/// Where a CPython minor version keeps what user space reads (x86-64).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    /// What the kernel's frame walk needs.
    pub kernel: PyLayout,
    /// `_PyRuntimeState` → `interpreters.head`.
    pub(super) runtime_interpreters_head: u64,
    /// `PyInterpreterState` → `next`, `threads.head`.
    pub(super) interp_next: u64,
    pub(super) interp_threads_head: u64,
    /// `PyThreadState` → `next`, and the thread's id: `native_thread_id` (3.11+), or
    /// (3.10) `thread_id`, its `pthread_t`, whose kernel id sits in glibc's
    /// `struct pthread` (found per process, [`Interp::find`]).
    pub(super) tstate_next: u64,
    pub(super) tstate_native_thread_id: u64,
    pub(super) pthread_id: bool,
    /// `PyCodeObject` fields.
    pub(super) code_filename: u64,
    pub(super) code_qualname: u64,
    pub(super) code_linetable: u64,
    pub(super) code_firstlineno: u64,
    pub(super) code_adaptive: u32,
    /// `sizeof(PyASCIIObject)`, `sizeof(PyCompactUnicodeObject)`: where a compact
    /// string's characters start.
    pub(super) unicode_ascii_size: u64,
    pub(super) unicode_compact_size: u64,
    /// 3.10's frames, instruction index and line table.
    pub(super) v310: bool,
}

/// Offsets shared by the versions supported.
pub(super) const OB_TYPE: u64 = 8;
pub(super) const VAR_SIZE: u64 = 16;
pub(super) const UNICODE_STATE: u64 = 32;
pub(super) const BYTES_SVAL: u64 = 32;

/// The layout of CPython 3.`minor`, when this build knows it.
#[must_use]
pub fn layout(minor: u32) -> Option<Layout> {
    match minor {
        // Frames are PyFrameObjects (Include/cpython/frameobject.h): `tstate->frame`,
        // `f_back`, `f_code`, `f_lasti` (an instruction index); no qualified names.
        10 => Some(Layout {
            kernel: PyLayout {
                tstate_cframe: 24,
                cframe_current_frame: FIELD_ABSENT,
                frame_previous: 24,
                frame_code: 32,
                frame_instr: 96,
                frame_owner: FIELD_ABSENT,
                frame_is_entry: FIELD_ABSENT,
                owner_cstack: FIELD_ABSENT,
            },
            runtime_interpreters_head: 32,
            interp_next: 0,
            interp_threads_head: 8,
            tstate_next: 8,
            tstate_native_thread_id: 176,
            code_filename: 104,
            code_qualname: 112,
            code_linetable: 120,
            code_firstlineno: 40,
            code_adaptive: 0,
            unicode_ascii_size: 48,
            unicode_compact_size: 72,
            pthread_id: true,
            v310: true,
        }),
        11 => Some(Layout {
            kernel: PyLayout {
                tstate_cframe: 56,
                cframe_current_frame: 8,
                frame_previous: 48,
                frame_code: 32,
                frame_instr: 56,
                frame_owner: 69,
                frame_is_entry: 68,
                owner_cstack: FIELD_ABSENT,
            },
            runtime_interpreters_head: 40,
            interp_next: 0,
            interp_threads_head: 16,
            tstate_next: 8,
            tstate_native_thread_id: 160,
            code_filename: 112,
            code_qualname: 128,
            code_linetable: 136,
            code_firstlineno: 72,
            code_adaptive: 184,
            unicode_ascii_size: 48,
            unicode_compact_size: 72,
            pthread_id: false,
            v310: false,
        }),
        12 => Some(Layout {
            kernel: PyLayout {
                tstate_cframe: 56,
                cframe_current_frame: 0,
                frame_previous: 8,
                frame_code: 0,
                frame_instr: 56,
                frame_owner: 70,
                frame_is_entry: FIELD_ABSENT,
                // FRAME_OWNED_BY_CSTACK (Include/internal/pycore_frame.h).
                owner_cstack: 3,
            },
            runtime_interpreters_head: 40,
            interp_next: 0,
            interp_threads_head: 72,
            tstate_next: 8,
            tstate_native_thread_id: 144,
            code_filename: 112,
            code_qualname: 128,
            code_linetable: 136,
            code_firstlineno: 68,
            code_adaptive: 192,
            unicode_ascii_size: 40,
            unicode_compact_size: 56,
            pthread_id: false,
            v310: false,
        }),
        _ => None,
    }
}

/// The versions whose frames are walked, for messages.
pub const SUPPORTED: &str = "3.10 to 3.13";

/// `_Py_DebugOffsets` (CPython 3.13, Include/internal/pycore_runtime.h): what the
/// interpreter publishes at the start of `_PyRuntime` for out-of-process tools. Word
/// indices of the fields used (byte offset / 8, checked with offsetof against 3.13.0's
/// header); the struct is 73 words long.
pub(super) mod debug {
    pub const WORDS: usize = 73;
    pub const COOKIE: &[u8; 8] = b"xdebugpy";
    pub const FREE_THREADED: usize = 2;
    pub const INTERPRETERS_HEAD: usize = 5;
    pub const INTERP_NEXT: usize = 8;
    pub const INTERP_THREADS_HEAD: usize = 9;
    pub const TSTATE_NEXT: usize = 21;
    pub const TSTATE_CURRENT_FRAME: usize = 23;
    pub const TSTATE_NATIVE_THREAD_ID: usize = 25;
    pub const FRAME_PREVIOUS: usize = 29;
    pub const FRAME_EXECUTABLE: usize = 30;
    pub const FRAME_INSTR_PTR: usize = 31;
    pub const FRAME_OWNER: usize = 33;
    pub const CODE_FILENAME: usize = 35;
    pub const CODE_QUALNAME: usize = 37;
    pub const CODE_LINETABLE: usize = 38;
    pub const CODE_FIRSTLINENO: usize = 39;
    pub const CODE_ADAPTIVE: usize = 43;
    pub const UNICODE_ASCII_SIZE: usize = 70;
}

/// The layout of a CPython 3.13 from its `_Py_DebugOffsets` (`words`, read from the
/// process); `None` for another cookie, a free-threaded build (another object header), or
/// frame fields outside the window the kernel reads.
#[must_use]
#[allow(clippy::wildcard_imports)] // the field indices, named as in the header
pub fn layout_from_debug_offsets(words: &[u64]) -> Option<Layout> {
    use debug::*;
    // The version field is PY_VERSION_HEX: 3.13 only.
    if words.len() < WORDS
        || words[0].to_le_bytes() != *COOKIE
        || (words[1] >> 16) & 0xffff != 0x030d
        || words[FREE_THREADED] != 0
    {
        return None;
    }
    let small = |i: usize| u32::try_from(words[i]).ok();
    let in_window = |i: usize, len: u64| words[i] + len <= nccltrace_common::PY_FRAME_WINDOW as u64;
    if !(in_window(FRAME_PREVIOUS, 8)
        && in_window(FRAME_EXECUTABLE, 8)
        && in_window(FRAME_INSTR_PTR, 8)
        && in_window(FRAME_OWNER, 1))
    {
        return None;
    }
    Some(Layout {
        kernel: PyLayout {
            tstate_cframe: small(TSTATE_CURRENT_FRAME)?,
            cframe_current_frame: FIELD_ABSENT,
            frame_previous: small(FRAME_PREVIOUS)?,
            frame_code: small(FRAME_EXECUTABLE)?,
            frame_instr: small(FRAME_INSTR_PTR)?,
            frame_owner: small(FRAME_OWNER)?,
            frame_is_entry: FIELD_ABSENT,
            // FRAME_OWNED_BY_CSTACK (Include/internal/pycore_frame.h).
            owner_cstack: 3,
        },
        runtime_interpreters_head: words[INTERPRETERS_HEAD],
        interp_next: words[INTERP_NEXT],
        interp_threads_head: words[INTERP_THREADS_HEAD],
        tstate_next: words[TSTATE_NEXT],
        tstate_native_thread_id: words[TSTATE_NATIVE_THREAD_ID],
        code_filename: words[CODE_FILENAME],
        code_qualname: words[CODE_QUALNAME],
        code_linetable: words[CODE_LINETABLE],
        code_firstlineno: words[CODE_FIRSTLINENO],
        code_adaptive: small(CODE_ADAPTIVE)?,
        unicode_ascii_size: words[UNICODE_ASCII_SIZE],
        // PyCompactUnicodeObject adds utf8_length and utf8 to PyASCIIObject.
        unicode_compact_size: words[UNICODE_ASCII_SIZE] + 16,
        pthread_id: false,
        v310: false,
    })
}
