//! Python frames of a running CPython, without a relaunch: finding the interpreter in a
//! target (its executable or libpython, its version read from the process), the thread
//! state of each of its threads (handed to the kernel programs, which walk the frame
//! chain at every stack they take), and the names of the code objects those walks return
//! (`function (file:line)`), read from the target's memory once per code object.
//!
//! Layouts are per CPython minor version: byte offsets printed by `offsetof` against the
//! interpreter's own headers (tests/fixtures/pyoffsets.c; 3.11 from Debian 12's
//! python3.11-dev 3.11.2, 3.12 from Ubuntu 24.04's python3.12-dev 3.12.3), checked on
//! every target before use: a thread list that does not name the target's own threads
//! turns Python frames off for it with the reason, never a wrong frame.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;

use nccltrace_common::{FIELD_ABSENT, PyLayout};
pub use nccltrace_core::python::*;

use crate::host::Host;
use crate::source::discover::{MapEntry, parse_maps};

/// Where a CPython minor version keeps what user space reads (x86-64).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    /// What the kernel's frame walk needs.
    pub kernel: PyLayout,
    /// `_PyRuntimeState` → `interpreters.head`.
    runtime_interpreters_head: u64,
    /// `PyInterpreterState` → `next`, `threads.head`.
    interp_next: u64,
    interp_threads_head: u64,
    /// `PyThreadState` → `next`, and the thread's id: `native_thread_id` (3.11+), or
    /// (3.10) `thread_id`, its `pthread_t`, whose kernel id sits in glibc's
    /// `struct pthread` (found per process, [`Interp::find`]).
    tstate_next: u64,
    tstate_native_thread_id: u64,
    pthread_id: bool,
    /// `PyCodeObject` fields.
    code_filename: u64,
    code_qualname: u64,
    code_linetable: u64,
    code_firstlineno: u64,
    code_adaptive: u32,
    /// `sizeof(PyASCIIObject)`, `sizeof(PyCompactUnicodeObject)`: where a compact
    /// string's characters start.
    unicode_ascii_size: u64,
    unicode_compact_size: u64,
    /// 3.10's frames, instruction index and line table.
    v310: bool,
}

/// Offsets shared by the versions supported.
const OB_TYPE: u64 = 8;
const VAR_SIZE: u64 = 16;
const UNICODE_STATE: u64 = 32;
const BYTES_SVAL: u64 = 32;

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
mod debug {
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

/// An interpreter found in a live target.
#[derive(Debug)]
pub struct Interp {
    pub pid: u32,
    pub info: PythonInfo,
    pub layout: Layout,
    runtime: u64,
    code_type: u64,
    mem: File,
    /// `/proc/PID/task` of the target, seen from here.
    tasks: std::path::PathBuf,
    /// The target lives in another PID namespace (a container): the thread ids its
    /// interpreter keeps are that namespace's, translated through `NSpid`.
    own_pid_ns: bool,
    /// 3.10: where glibc's `struct pthread` keeps the thread's kernel id.
    pthread_tid: Option<u64>,
    /// Code objects named so far (address → name), or found not to be code.
    codes: HashMap<u64, Option<CodeInfo>>,
}

/// Why a target's Python frames are not walked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Found {
    /// Not a Python process (no `_PyRuntime` in any mapped file).
    NotPython,
    /// A CPython whose frames cannot be walked: what is known, with the reason.
    Unsupported(PythonInfo),
}

/// A data symbol's address in the target: the file's address plus the load bias of the
/// mapping of the segment it lies in.
fn runtime_address(
    obj: &object::File<'_>,
    maps: &[MapEntry],
    path: &str,
    address: u64,
) -> Option<u64> {
    use object::{Object as _, ObjectSegment as _};
    let segment = obj.segments().find(|s| {
        let (start, size) = (s.address(), s.size());
        (start..start + size).contains(&address)
    })?;
    let (offset, _) = segment.file_range();
    let page = |v: u64| v & !0xfff;
    let m = maps
        .iter()
        .find(|m| m.path.as_deref() == Some(path) && m.offset == page(offset))?;
    Some(m.start + address - page(segment.address()))
}

/// The addresses of `names` in the file at `path` as process maps `maps` load it.
fn symbols(
    host_path: &std::path::Path,
    maps: &[MapEntry],
    path: &str,
    names: &[&str],
) -> Option<HashMap<String, u64>> {
    use object::{Object as _, ObjectSymbol as _};
    let file = File::open(host_path).ok()?;
    // SAFETY: read-only private mapping; a file replaced under us gives wrong addresses,
    // which the layout check then refuses.
    let map = unsafe { memmap2::Mmap::map(&file) }.ok()?;
    let obj = object::File::parse(&*map).ok()?;
    let mut found = HashMap::new();
    for sym in obj.dynamic_symbols().chain(obj.symbols()) {
        let Ok(name) = sym.name() else { continue };
        if sym.is_undefined() || !names.contains(&name) || found.contains_key(name) {
            continue;
        }
        if let Some(at) = runtime_address(&obj, maps, path, sym.address()) {
            found.insert(name.to_owned(), at);
        }
    }
    Some(found)
}

/// `3.11.7` from `Py_Version` (`PY_VERSION_HEX`: 0x030B07F0).
#[must_use]
pub fn version_of(hex: u32) -> (u32, u32, u32) {
    (hex >> 24, (hex >> 16) & 0xff, (hex >> 8) & 0xff)
}

/// The minor version a file name says (`libpython3.10.so.1.0`, `python3.10`).
fn minor_from_name(path: &str) -> Option<u32> {
    let name = path.rsplit('/').next()?;
    let rest = name.split("python3.").nth(1)?;
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

impl Interp {
    /// Finds the CPython interpreter of process `pid`: the mapped file (executable or
    /// libpython) that defines `_PyRuntime`.
    pub fn find(host: &Host, pid: u32) -> Result<Interp, Found> {
        let maps_text =
            std::fs::read_to_string(host.path(&format!("proc/{pid}/maps"))).unwrap_or_default();
        let maps = parse_maps(&maps_text);
        let files = crate::source::discover::mapped_files(&maps);
        let candidates = files.iter().filter(|p| {
            let name = p.rsplit('/').next().unwrap_or("");
            name.starts_with("python") || name.starts_with("libpython")
        });
        for path in candidates {
            let host_path = host.path(&format!("proc/{pid}/root{path}"));
            let Some(syms) = symbols(
                &host_path,
                &maps,
                path,
                &["_PyRuntime", "PyCode_Type", "Py_Version"],
            ) else {
                continue;
            };
            let Some(&runtime) = syms.get("_PyRuntime") else {
                continue;
            };
            let mem = File::open(host.path(&format!("proc/{pid}/mem")));
            let version = match (&mem, syms.get("Py_Version")) {
                (Ok(mem), Some(&at)) => read_u32(mem, at).map(version_of),
                _ => None,
            };
            let mut info = PythonInfo {
                version: version.map_or_else(
                    || minor_from_name(path).map_or("3.?".to_owned(), |m| format!("3.{m}")),
                    |(a, b, c)| format!("{a}.{b}.{c}"),
                ),
                path: path.clone(),
                frames: false,
                note: None,
            };
            let minor = version.map(|v| v.1).or_else(|| minor_from_name(path));
            let from_process = match (&mem, minor) {
                // 3.14 grew the struct: its fields sit elsewhere.
                (Ok(mem), Some(13)) => {
                    let mut bytes = vec![0u8; debug::WORDS * 8];
                    mem.read_exact_at(&mut bytes, runtime).ok().and_then(|()| {
                        let words: Vec<u64> = bytes
                            .chunks_exact(8)
                            .map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default()))
                            .collect();
                        layout_from_debug_offsets(&words)
                    })
                }
                _ => None,
            };
            let Some(layout) = from_process.or_else(|| minor.and_then(layout)) else {
                info.note = Some(format!(
                    "CPython {}: its frame layout is not known to this nccltrace (it knows \
                     {SUPPORTED}); stacks stay native",
                    info.version
                ));
                return Err(Found::Unsupported(info));
            };
            let (Ok(mem), Some(&code_type)) = (mem, syms.get("PyCode_Type")) else {
                info.note = Some(format!(
                    "CPython {}: cannot read the process's memory or find PyCode_Type; stacks \
                     stay native",
                    info.version
                ));
                return Err(Found::Unsupported(info));
            };
            let nspid = nspid(&host.path(&format!("proc/{pid}/status")));
            let mut interp = Interp {
                pid,
                info,
                layout,
                runtime,
                code_type,
                mem,
                tasks: host.path(&format!("proc/{pid}/task")),
                own_pid_ns: nspid.len() > 1,
                pthread_tid: None,
                codes: HashMap::new(),
            };
            if layout.pthread_id {
                interp.pthread_tid = interp.find_pthread_tid();
            }
            return match interp.check(host) {
                Ok(()) => {
                    interp.info.frames = true;
                    Ok(interp)
                }
                Err(why) => {
                    interp.info.note = Some(format!(
                        "CPython {}: {why}; Python frames are off for pid {pid} (stacks stay \
                         native)",
                        interp.info.version
                    ));
                    Err(Found::Unsupported(interp.info))
                }
            };
        }
        Err(Found::NotPython)
    }

    /// The layout check: the thread list read with this layout names only threads of the
    /// process, the main thread among them.
    fn check(&self, host: &Host) -> Result<(), String> {
        let threads = self.threads();
        if threads.is_empty() {
            return Err("no thread state found with the layout of this version".to_owned());
        }
        let live = host.threads(self.pid);
        if let Some((tid, _)) = threads.iter().find(|(tid, _)| !live.contains(tid)) {
            return Err(format!(
                "the layout check failed (thread id {tid} read from a thread state is not a \
                 thread of the process)"
            ));
        }
        if !threads.iter().any(|(tid, _)| *tid == self.pid) {
            return Err("the layout check failed (the main thread has no thread state)".into());
        }
        Ok(())
    }

    /// The process's thread ids as its own PID namespace numbers them: (that id, this
    /// host's id).
    fn task_ids(&self) -> HashMap<u32, u32> {
        std::fs::read_dir(&self.tasks)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|t| {
                let ids = nspid(&t.path().join("status"));
                Some((*ids.last()?, *ids.first()?))
            })
            .collect()
    }

    /// Every thread state's raw thread id field (3.10: `thread_id`, a `pthread_t`).
    fn raw_thread_ids(&self) -> Vec<(u64, u64)> {
        let l = &self.layout;
        let mut out = Vec::new();
        let mut interp = self.read_u64(self.runtime + l.runtime_interpreters_head);
        for _ in 0..64 {
            let Some(i) = interp.filter(|a| *a != 0) else {
                break;
            };
            let mut tstate = self.read_u64(i + l.interp_threads_head);
            for _ in 0..4096 {
                let Some(t) = tstate.filter(|a| *a != 0) else {
                    break;
                };
                if let Some(id) = self.read_u64(t + l.tstate_native_thread_id) {
                    out.push((id, t));
                }
                tstate = self.read_u64(t + l.tstate_next);
            }
            interp = self.read_u64(i + l.interp_next);
        }
        out
    }

    /// 3.10: where glibc's `struct pthread` (what a `pthread_t` points at) keeps the
    /// thread's kernel id (0x2d0 on x86-64 glibc 2.36): the first 4-byte offset, within
    /// the struct's first 2 KiB, at which every thread state's `pthread_t` holds a
    /// distinct thread id of the process.
    fn find_pthread_tid(&self) -> Option<u64> {
        let live: std::collections::HashSet<u32> = self.task_ids().into_keys().collect();
        let blocks: Vec<Vec<u8>> = self
            .raw_thread_ids()
            .iter()
            .filter_map(|(pthread, _)| self.read_bytes(*pthread, 0x800))
            .collect();
        if blocks.is_empty() {
            return None;
        }
        (0..0x800usize).step_by(4).find_map(|at| {
            let ids: std::collections::HashSet<u32> = blocks
                .iter()
                .map(|b| u32::from_le_bytes(b[at..at + 4].try_into().unwrap_or_default()))
                .filter(|id| live.contains(id))
                .collect();
            (ids.len() == blocks.len()).then_some(at as u64)
        })
    }

    /// Every thread state of every interpreter of the process: (thread id as this host
    /// numbers it, address).
    #[must_use]
    pub fn threads(&self) -> Vec<(u32, u64)> {
        // Namespace tid → host tid, for a target in a PID namespace of its own.
        let translate = self.own_pid_ns.then(|| self.task_ids());
        let mut out = Vec::new();
        for (id, tstate) in self.raw_thread_ids() {
            let tid = if self.layout.pthread_id {
                // 3.10: the kernel id from glibc's struct pthread.
                let Some(at) = self.pthread_tid else { continue };
                let Some(tid) = read_u32(&self.mem, id + at) else {
                    continue;
                };
                tid
            } else {
                let Ok(tid) = u32::try_from(id) else { continue };
                tid
            };
            match &translate {
                None => out.push((tid, tstate)),
                Some(map) => {
                    if let Some(&host_tid) = map.get(&tid) {
                        out.push((host_tid, tstate));
                    }
                }
            }
        }
        out
    }

    fn read_u64(&self, at: u64) -> Option<u64> {
        let mut b = [0u8; 8];
        self.mem.read_exact_at(&mut b, at).ok()?;
        Some(u64::from_le_bytes(b))
    }

    fn read_bytes(&self, at: u64, len: usize) -> Option<Vec<u8>> {
        let mut b = vec![0u8; len];
        self.mem.read_exact_at(&mut b, at).ok()?;
        Some(b)
    }

    /// A `str` object's text (compact strings, as code objects' names are).
    fn read_str(&self, at: u64) -> Option<String> {
        let l = &self.layout;
        let length = usize::try_from(self.read_u64(at + VAR_SIZE)?).ok()?;
        if length > 4096 {
            return None;
        }
        let state = u32::try_from(self.read_u64(at + UNICODE_STATE)? & 0xffff_ffff).ok()?;
        let (kind, compact, ascii) = ((state >> 2) & 7, (state >> 5) & 1, (state >> 6) & 1);
        if compact == 0 {
            return None;
        }
        if ascii == 1 {
            let bytes = self.read_bytes(at + l.unicode_ascii_size, length)?;
            return String::from_utf8(bytes).ok();
        }
        let width = match kind {
            1 | 2 | 4 => kind as usize,
            _ => return None,
        };
        let bytes = self.read_bytes(at + l.unicode_compact_size, length * width)?;
        Some(
            bytes
                .chunks_exact(width)
                .filter_map(|c| {
                    let mut w = [0u8; 4];
                    w[..width].copy_from_slice(c);
                    char::from_u32(u32::from_le_bytes(w))
                })
                .collect(),
        )
    }

    /// The code object at `code`, read from the process once; `None` when what lies there
    /// is not a code object (any more).
    pub fn code(&mut self, code: u64) -> Option<&CodeInfo> {
        if !self.codes.contains_key(&code) {
            let info = self.read_code(code);
            self.codes.insert(code, info);
        }
        self.codes.get(&code).and_then(Option::as_ref)
    }

    fn read_code(&self, code: u64) -> Option<CodeInfo> {
        let l = &self.layout;
        if self.read_u64(code + OB_TYPE)? != self.code_type {
            return None;
        }
        let filename = self.read_str(self.read_u64(code + l.code_filename)?)?;
        let qualname = self.read_str(self.read_u64(code + l.code_qualname)?)?;
        let firstlineno = self.read_u64(code + l.code_firstlineno)? & 0xffff_ffff;
        let table = self.read_u64(code + l.code_linetable)?;
        let size = usize::try_from(self.read_u64(table + VAR_SIZE)?).ok()?;
        let linetable = if size <= 1 << 20 {
            self.read_bytes(table + BYTES_SVAL, size)?
        } else {
            Vec::new()
        };
        Some(CodeInfo {
            qualname,
            filename,
            firstlineno: i32::try_from(firstlineno as u32).unwrap_or(0),
            linetable,
            adaptive: l.code_adaptive,
            v310: l.v310,
        })
    }
}

/// The `NSpid:` ids of a `/proc/…/status` file: this host's id first, the innermost
/// namespace's last.
fn nspid(status: &std::path::Path) -> Vec<u32> {
    std::fs::read_to_string(status)
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("NSpid:"))
        .map(|ids| {
            ids.split_whitespace()
                .filter_map(|i| i.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

fn read_u32(mem: &File, at: u64) -> Option<u32> {
    let mut b = [0u8; 4];
    mem.read_exact_at(&mut b, at).ok()?;
    Some(u32::from_le_bytes(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_and_names() {
        assert_eq!(version_of(0x030b_07f0), (3, 11, 7));
        assert_eq!(version_of(0x030c_03f0), (3, 12, 3));
        assert_eq!(minor_from_name("/usr/lib/libpython3.10.so.1.0"), Some(10));
        assert_eq!(minor_from_name("/usr/bin/python3.13"), Some(13));
        assert_eq!(minor_from_name("/usr/bin/python3"), None);
        assert!(layout(10).is_some() && layout(11).is_some() && layout(12).is_some());
        assert!(layout(9).is_none() && layout(13).is_none());
        assert_eq!(
            short_file("/opt/v/lib/python3.12/site-packages/torch/_tensor.py"),
            "torch/_tensor.py"
        );
        assert_eq!(short_file("/home/u/train.py"), "train.py");
        assert_eq!(short_file("<string>"), "<string>");
    }

    /// The table reader against CPython's own `co_lines()` for every code object of a
    /// standard module, by the python3 on this machine (3.11+).
    #[test]
    fn location_tables_read_as_cpython_reads_them() {
        location_tables_of("python3");
        // 3.10's own table format, where pyenv keeps a 3.10 (these machines do).
        for (minor, dir) in pyenv_versions() {
            let python = dir.join("bin/python3");
            if minor == 10 && python.exists() {
                location_tables_of(python.to_str().unwrap());
            }
        }
    }

    /// The CPython 3 versions pyenv keeps here: (minor, its folder).
    fn pyenv_versions() -> Vec<(u32, std::path::PathBuf)> {
        let root = std::env::var_os("PYENV_ROOT")
            .map_or_else(|| "/root/.pyenv".into(), std::path::PathBuf::from);
        std::fs::read_dir(root.join("versions"))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|entry| {
                let name = entry.file_name().to_string_lossy().into_owned();
                let minor = name.strip_prefix("3.")?.split('.').next()?.parse().ok()?;
                Some((minor, entry.path()))
            })
            .collect()
    }

    /// [`location_tables_read_as_cpython_reads_them`] for the interpreter `python`.
    fn location_tables_of(python: &str) {
        let script = r#"
import json, sys, inspect, json.decoder as m
out = []
def walk(c):
    out.append({"first": c.co_firstlineno, "table": c.co_linetable.hex(),
                "lines": [list(x) for x in c.co_lines()]})
    for k in c.co_consts:
        if hasattr(k, "co_linetable"): walk(k)
for name in ("json.decoder", "inspect", "argparse"):
    mod = __import__(name, fromlist=["x"])
    src = open(mod.__file__).read()
    walk(compile(src, mod.__file__, "exec"))
print(sys.version_info[1]); print(json.dumps(out))
"#;
        let out = std::process::Command::new(python)
            .args(["-c", script])
            .output()
            .expect("python3 runs (cargo xtask setup installs it)");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8(out.stdout).unwrap();
        let (minor, json) = text.split_once('\n').unwrap();
        let minor: u32 = minor.trim().parse().unwrap();
        assert!(minor >= 10, "needs CPython 3.10+");
        let codes: Vec<serde_json::Value> = serde_json::from_str(json).unwrap();
        let mut checked = 0;
        for c in &codes {
            let first = i32::try_from(c["first"].as_i64().unwrap()).unwrap();
            let hex = c["table"].as_str().unwrap();
            let table: Vec<u8> = (0..hex.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
                .collect();
            for r in c["lines"].as_array().unwrap() {
                let (start, end) = (r[0].as_u64().unwrap(), r[1].as_u64().unwrap());
                let line = r[2].as_i64().map(|l| i32::try_from(l).unwrap());
                for unit in (start / 2)..(end / 2) {
                    let unit = u32::try_from(unit).unwrap();
                    let ours = if minor == 10 {
                        line_at_310(&table, first, unit * 2)
                    } else {
                        line_at(&table, first, unit)
                    };
                    assert_eq!(ours, line, "{python}: unit {unit} of {c}");
                    checked += 1;
                }
            }
        }
        assert!(checked > 10_000, "only {checked} code units checked");
    }

    /// The layout table and 3.13's debug-offset indices against `offsetof` in the headers
    /// of every CPython on this machine (Debian's python3-dev, which `cargo xtask setup`
    /// installs, and pyenv's), printed by tests/fixtures/pyoffsets.c.
    #[test]
    #[allow(clippy::too_many_lines, clippy::wildcard_imports)] // one table per version
    fn layouts_match_the_interpreters_headers() {
        let mut includes = vec![std::path::PathBuf::from("/usr/include/python3.11")];
        for (minor, dir) in pyenv_versions() {
            includes.push(dir.join(format!("include/python3.{minor}")));
        }
        let source = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/pyoffsets.c");
        let dir = tempfile::tempdir().unwrap();
        let mut checked = Vec::new();
        for include in includes
            .iter()
            .filter(|i| i.join("internal/pycore_runtime.h").exists())
        {
            let exe = dir.path().join("pyoffsets");
            let built = std::process::Command::new("cc")
                .arg("-I")
                .arg(include)
                .arg(source)
                .arg("-o")
                .arg(&exe)
                .output()
                .unwrap();
            if !built.status.success() {
                // Versions whose internal headers differ (3.10 and older): not walked.
                continue;
            }
            let out = std::process::Command::new(&exe).output().unwrap();
            let text = String::from_utf8(out.stdout).unwrap();
            let v: HashMap<&str, u64> = text
                .lines()
                .filter_map(|l| {
                    let (k, v) = l.split_once(' ')?;
                    Some((k, v.parse().ok()?))
                })
                .collect();
            let minor = u32::try_from(v["minor"]).unwrap();
            let l = match minor {
                13 => {
                    use debug::*;
                    let pairs = [
                        ("debug_interpreters_head", INTERPRETERS_HEAD),
                        ("debug_interp_next", INTERP_NEXT),
                        ("debug_interp_threads_head", INTERP_THREADS_HEAD),
                        ("debug_tstate_next", TSTATE_NEXT),
                        ("debug_tstate_current_frame", TSTATE_CURRENT_FRAME),
                        ("debug_tstate_native_thread_id", TSTATE_NATIVE_THREAD_ID),
                        ("debug_frame_previous", FRAME_PREVIOUS),
                        ("debug_frame_executable", FRAME_EXECUTABLE),
                        ("debug_frame_instr_ptr", FRAME_INSTR_PTR),
                        ("debug_frame_owner", FRAME_OWNER),
                        ("debug_code_filename", CODE_FILENAME),
                        ("debug_code_qualname", CODE_QUALNAME),
                        ("debug_code_linetable", CODE_LINETABLE),
                        ("debug_code_firstlineno", CODE_FIRSTLINENO),
                        ("debug_code_adaptive", CODE_ADAPTIVE),
                        ("debug_unicode_ascii_size", UNICODE_ASCII_SIZE),
                        ("debug_free_threaded", FREE_THREADED),
                    ];
                    for (name, word) in pairs {
                        assert_eq!(v[name], word as u64 * 8, "3.13 {name}");
                    }
                    assert_eq!(v["debug_size"], WORDS as u64 * 8);
                    // The layout 3.13 publishes, as the agent derives it: filled from
                    // the header's own offsets.
                    let mut words = vec![0u64; WORDS];
                    words[0] = u64::from_le_bytes(*COOKIE);
                    words[1] = 0x030d_00f0;
                    let fields = [
                        (INTERPRETERS_HEAD, "runtime_interpreters_head"),
                        (INTERP_NEXT, "interp_next"),
                        (INTERP_THREADS_HEAD, "interp_threads_head"),
                        (TSTATE_NEXT, "tstate_next"),
                        (TSTATE_CURRENT_FRAME, "tstate_cframe"),
                        (TSTATE_NATIVE_THREAD_ID, "tstate_native_thread_id"),
                        (FRAME_PREVIOUS, "frame_previous"),
                        (FRAME_EXECUTABLE, "frame_code"),
                        (FRAME_INSTR_PTR, "frame_instr"),
                        (FRAME_OWNER, "frame_owner"),
                        (CODE_FILENAME, "code_filename"),
                        (CODE_QUALNAME, "code_qualname"),
                        (CODE_LINETABLE, "code_linetable"),
                        (CODE_FIRSTLINENO, "code_firstlineno"),
                        (CODE_ADAPTIVE, "code_adaptive"),
                        (UNICODE_ASCII_SIZE, "unicode_ascii_size"),
                    ];
                    for (word, name) in fields {
                        words[word] = v[name];
                    }
                    layout_from_debug_offsets(&words).expect("3.13's layout")
                }
                m => layout(m).unwrap_or_else(|| panic!("no layout for 3.{m}")),
            };
            let k = &l.kernel;
            let expect = [
                ("runtime_interpreters_head", l.runtime_interpreters_head),
                ("interp_next", l.interp_next),
                ("interp_threads_head", l.interp_threads_head),
                ("tstate_next", l.tstate_next),
                ("tstate_native_thread_id", l.tstate_native_thread_id),
                ("tstate_cframe", u64::from(k.tstate_cframe)),
                ("frame_previous", u64::from(k.frame_previous)),
                ("frame_code", u64::from(k.frame_code)),
                ("frame_instr", u64::from(k.frame_instr)),
                ("frame_owner", u64::from(k.frame_owner)),
                ("code_filename", l.code_filename),
                ("code_qualname", l.code_qualname),
                ("code_linetable", l.code_linetable),
                ("code_firstlineno", l.code_firstlineno),
                ("code_adaptive", u64::from(l.code_adaptive)),
                ("unicode_ascii_size", l.unicode_ascii_size),
                ("unicode_compact_size", l.unicode_compact_size),
                ("unicode_state", UNICODE_STATE),
                ("bytes_sval", BYTES_SVAL),
                ("object_type", OB_TYPE),
                ("var_size", VAR_SIZE),
            ];
            for (name, ours) in expect {
                match v.get(name) {
                    Some(&theirs) => {
                        assert_eq!(theirs, ours, "3.{minor} {name} ({})", include.display());
                    }
                    // 3.10's frames have no owner, its code objects no adaptive copy.
                    None => {
                        assert!(minor == 10 && ["frame_owner", "code_adaptive"].contains(&name));
                    }
                }
            }
            if (11..13).contains(&minor) {
                assert_eq!(u64::from(k.cframe_current_frame), v["cframe_current_frame"]);
            }
            if minor == 11 {
                assert_eq!(u64::from(k.frame_is_entry), v["frame_is_entry"]);
            }
            checked.push(minor);
        }
        assert!(
            checked.contains(&11),
            "Debian's python3-dev headers were not found"
        );
        println!("checked 3.{checked:?}");
    }
}
