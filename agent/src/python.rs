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

pub use nccltrace_core::python::*;

use crate::host::Host;
use crate::source::discover::{MapEntry, parse_maps};

mod layout;
use layout::{BYTES_SVAL, OB_TYPE, UNICODE_STATE, VAR_SIZE, debug};
pub use layout::{Layout, SUPPORTED, layout, layout_from_debug_offsets};

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
mod tests;
