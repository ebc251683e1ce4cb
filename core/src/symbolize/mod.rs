//! Symbolize stage: user frames with blazesym (the file's ELF symbols, then its debug
//! file's, then DWARF; demangled), one pass per file, from the maps kept in the recording;
//! kernel frames from the names recorded out of /proc/kallsyms at the end of the live run;
//! JIT-compiled code (Python 3.12's perf trampolines, other JITs) from the target's
//! `/tmp/perf-PID.map`, also recorded then. Works after the target has exited.

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use blazesym::symbolize::source::{Elf, Source};
use blazesym::symbolize::{Input, Symbolized, Symbolizer};

use crate::attribute::StackKey;
use crate::procfs::{MapEntry, parse_maps};
use crate::record::Header;

/// Frame names for every address in the stacks.
#[derive(Clone, Debug, Default)]
pub struct Symbols {
    pub(crate) user: HashMap<(u32, u64), String>,
    pub(crate) kernel: BTreeMap<u64, String>,
    /// Python code objects, by (pid, address).
    pub(crate) python: crate::python::PythonCodes,
    /// Files that are not the ones the recording was made with (another build id), or
    /// whose symbols could not be read: their frames are left unnamed rather than named
    /// wrong. One line each, to show the user.
    pub stale: Vec<String>,
}

/// Build ids of mapped files, by (pid, path): what the live run symbolized with.
pub type BuildIds = BTreeMap<(u32, String), String>;

impl Symbols {
    /// A user frame's name (`addr` as it appears in the stack).
    #[must_use]
    pub fn user(&self, pid: u32, addr: u64) -> Cow<'_, str> {
        self.user
            .get(&(pid, addr))
            .map_or_else(|| format!("[unknown] {addr:#x}").into(), Into::into)
    }

    /// A Python frame's name: `function (file:line)`; code objects the live run could not
    /// name (freed, or not code) are said to be unknown.
    #[must_use]
    pub fn python(&self, pid: u32, frame: crate::event::PyFrame) -> String {
        self.python.get(&(pid, frame.code)).map_or_else(
            || format!("[unknown python code {:#x}]", frame.code),
            |code| code.frame(frame),
        )
    }

    /// Whether the Python frames of `pid` come from CPython 3.10, where each is a call of
    /// the interpreter loop of its own.
    #[must_use]
    pub fn python_310(&self, pid: u32, py: &[crate::event::PyFrame]) -> bool {
        py.iter()
            .find_map(|f| self.python.get(&(pid, f.code)))
            .is_some_and(|c| c.v310)
    }

    /// A kernel frame's name.
    #[must_use]
    pub fn kernel(&self, addr: u64) -> Cow<'_, str> {
        self.kernel
            .get(&addr)
            .map_or_else(|| format!("[kernel] {addr:#x}").into(), Into::into)
    }
}

/// Kernel function names for `ips`, from a kallsyms text read twice (`reader` is rewound):
/// first every function's address, to find the function each address lies in, then the
/// names of those functions only. Of functions sharing an address, the greatest name.
#[must_use]
pub fn kernel_names(
    mut reader: impl std::io::BufRead + std::io::Seek,
    ips: &BTreeSet<u64>,
) -> Vec<(u64, String)> {
    use crate::procfs::{each_kallsyms_line, is_function};
    if ips.is_empty() {
        return Vec::new();
    }
    let mut addrs = Vec::new();
    each_kallsyms_line(&mut reader, |addr, kind, _| {
        if is_function(addr, kind) {
            addrs.push(addr);
        }
    });
    addrs.sort_unstable();
    addrs.dedup();
    let within: Vec<(u64, u64)> = ips
        .iter()
        .filter_map(|&ip| {
            let i = addrs.partition_point(|&a| a <= ip).checked_sub(1)?;
            Some((ip, addrs[i]))
        })
        .collect();
    drop(addrs);
    let mut names: BTreeMap<u64, String> =
        within.iter().map(|&(_, f)| (f, String::new())).collect();
    if reader.rewind().is_err() {
        return Vec::new();
    }
    each_kallsyms_line(&mut reader, |addr, kind, name| {
        if is_function(addr, kind)
            && let Some(kept) = names.get_mut(&addr)
            && name > kept.as_str()
        {
            name.clone_into(kept);
        }
    });
    within
        .into_iter()
        .filter_map(|(ip, f)| Some((ip, names.get(&f).filter(|n| !n.is_empty())?.clone())))
        .collect()
}

/// Every kernel address in `stacks`.
#[must_use]
pub fn kernel_addresses(stacks: &[StackKey]) -> BTreeSet<u64> {
    stacks
        .iter()
        .flat_map(|s| s.kstack.iter().copied())
        .collect()
}

/// Entries of a perf map file (`START SIZE NAME`, hex, one per line; the convention JITs
/// share with `perf`): (start, size, name), by start. Lines that do not parse are skipped.
#[must_use]
pub fn parse_perf_map(text: &str) -> Vec<(u64, u64, String)> {
    let hex = |s: &str| u64::from_str_radix(s.trim_start_matches("0x"), 16).ok();
    let mut out: Vec<(u64, u64, String)> = text
        .lines()
        .filter_map(|line| {
            let mut parts = line.splitn(3, ' ');
            let start = hex(parts.next()?)?;
            let size = hex(parts.next()?)?;
            let name = parts.next()?.trim();
            (!name.is_empty() && size > 0).then(|| (start, size, name.to_owned()))
        })
        .collect();
    out.sort_by_key(|e| e.0);
    out
}

/// The index of the JIT entry covering `addr`, from entries sorted by start.
fn jit_index(entries: &[(u64, u64, String)], addr: u64) -> Option<usize> {
    let i = entries.partition_point(|e| e.0 <= addr).checked_sub(1)?;
    let (start, size, _) = &entries[i];
    (addr < start.saturating_add(*size)).then_some(i)
}

/// The address to look up for the `i`-th frame (innermost first) of a user stack: outer
/// frames are return addresses, so the call instruction is just before them.
fn lookup_address(i: usize, addr: u64) -> u64 {
    if i == 0 { addr } else { addr.saturating_sub(1) }
}

/// The perf map entries of process `pid` that cover an address of its user stacks: read
/// from `/tmp/perf-N.map` in its mount namespace (N its pid there) while it runs, else from
/// this host's /tmp.
#[must_use]
pub fn jit_symbols(pid: u32, stacks: &[StackKey]) -> Vec<(u64, u64, String)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let ns_pid = status
        .lines()
        .find_map(|l| l.strip_prefix("NSpid:"))
        .and_then(|v| v.split_whitespace().last())
        .and_then(|v| v.parse::<u32>().ok())
        .unwrap_or(pid);
    let text = std::fs::read_to_string(readable(pid, &format!("/tmp/perf-{ns_pid}.map")))
        .or_else(|_| std::fs::read_to_string(format!("/tmp/perf-{pid}.map")));
    let Ok(text) = text else {
        return Vec::new();
    };
    let entries = parse_perf_map(&text);
    let mut used = BTreeSet::new();
    for s in stacks.iter().filter(|s| s.pid == pid) {
        for (i, addr) in s.ustack.iter().enumerate() {
            used.extend(jit_index(&entries, lookup_address(i, *addr)));
        }
    }
    used.into_iter().map(|j| entries[j].clone()).collect()
}

/// The file to read for `path` of process `pid`: through its root while it runs, else
/// the same path here.
fn readable(pid: u32, path: &str) -> PathBuf {
    let through_root = Path::new("/proc")
        .join(pid.to_string())
        .join("root")
        .join(path.trim_start_matches('/'));
    if through_root.exists() {
        through_root
    } else {
        PathBuf::from(path)
    }
}

/// Symbolizes every user frame of `stacks` (one blazesym pass per file) and takes the
/// kernel names as recorded.
#[must_use]
pub fn symbolize(
    header: &Header,
    stacks: &[StackKey],
    kernel: &BTreeMap<u64, String>,
    jit: &BTreeMap<u32, Vec<(u64, u64, String)>>,
    python: &crate::python::PythonCodes,
    build_ids: &BuildIds,
) -> Symbols {
    let mut user = HashMap::new();
    let mut stale = Vec::new();
    let maps = file_maps(header);
    let by_file = frames_by_file(&maps, stacks, jit, &mut user);
    // One file at a time, every process mapping it in turn, each with a symbolizer of its
    // own dropped after it: blazesym maps the files it reads, and the pages it touches
    // (symbol tables of libraries of hundreds of MB) count in the agent's resident memory
    // while they stay mapped; one symbolizer for the run kept every file's mapped at once.
    let mut by_path: Vec<_> = by_file.into_iter().collect();
    by_path.sort_by(|a, b| (&a.0.1, a.0.0).cmp(&(&b.0.1, b.0.0)));
    for file in by_path.chunk_by(|a, b| a.0.1 == b.0.1) {
        let symbolizer = Symbolizer::builder()
            .enable_code_info(false)
            .enable_inlined_fns(false)
            .build();
        for ((pid, path), addrs) in file {
            let offsets: Vec<u64> = addrs.iter().map(|(_, off)| *off).collect();
            let names = match (build_ids.get(&(*pid, path.clone())), build_id(*pid, path)) {
                (Some(then), now) if now.as_ref() != Some(then) => {
                    stale.push(format!(
                        "{path} (pid {pid}) is not the file the recording was made with \
                         (build id {then}, now {}): its frames are left unnamed",
                        now.as_deref().unwrap_or("unreadable")
                    ));
                    vec![None; offsets.len()]
                }
                _ => file_names(
                    &symbolizer,
                    *pid,
                    path,
                    &offsets,
                    &mut stale,
                    symtab::LARGE_SYMTAB_BYTES,
                ),
            };
            let base = Path::new(path).file_name().map_or(path.clone(), |n| {
                n.to_string_lossy()
                    .trim_start_matches('[')
                    .trim_end_matches(']')
                    .to_owned()
            });
            for ((addr, offset), name) in addrs.iter().zip(names) {
                let name = name.unwrap_or_else(|| format!("[{base}+{offset:#x}]"));
                user.insert((*pid, *addr), name);
            }
        }
    }
    Symbols {
        user,
        kernel: kernel.clone(),
        python: python.clone(),
        stale,
    }
}

/// Each target's file mappings, by start address.
fn file_maps(header: &Header) -> HashMap<u32, Vec<MapEntry>> {
    header
        .targets
        .iter()
        .map(|t| {
            let mut m: Vec<MapEntry> = parse_maps(&t.maps_text)
                .into_iter()
                .filter(|m| m.path.is_some())
                .collect();
            m.sort_by_key(|m| m.start);
            (t.pid, m)
        })
        .collect()
}

/// The user frames of `stacks` grouped by the file they lie in: (pid, path) → [(address as
/// in the stack, file offset)]. Frames in no file (JIT code) are named into `user` from the
/// perf maps in `jit`.
fn frames_by_file(
    maps: &HashMap<u32, Vec<MapEntry>>,
    stacks: &[StackKey],
    jit: &BTreeMap<u32, Vec<(u64, u64, String)>>,
    user: &mut HashMap<(u32, u64), String>,
) -> BTreeMap<(u32, String), Vec<(u64, u64)>> {
    let mut by_file: BTreeMap<(u32, String), Vec<(u64, u64)>> = BTreeMap::new();
    let mut seen = BTreeSet::new();
    for s in stacks {
        let entries = maps.get(&s.pid).map_or(&[][..], Vec::as_slice);
        for (i, addr) in s.ustack.iter().copied().enumerate() {
            if !seen.insert((s.pid, addr)) {
                continue;
            }
            let lookup = lookup_address(i, addr);
            let j = entries.partition_point(|m| m.start <= lookup);
            let Some(m) = j
                .checked_sub(1)
                .map(|j| &entries[j])
                .filter(|m| lookup < m.end)
            else {
                // Not in a file: JIT-compiled code, named by the target's perf map.
                if let Some(entries) = jit.get(&s.pid)
                    && let Some(j) = jit_index(entries, lookup)
                {
                    user.insert((s.pid, addr), entries[j].2.clone());
                }
                continue;
            };
            let path = m.path.clone().unwrap_or_default();
            by_file
                .entry((s.pid, path))
                .or_default()
                .push((addr, lookup - m.start + m.offset));
        }
    }
    by_file
}

/// The build id (hex) of file `path` of process `pid`, read as symbolization reads it.
fn build_id(pid: u32, path: &str) -> Option<String> {
    let id = blazesym::helper::read_elf_build_id(&readable(pid, path))
        .ok()
        .flatten()?;
    Some(hex(&id))
}

/// The build ids of the files the user frames of `stacks` lie in, for the recording: a
/// `report` elsewhere or after an upgrade then leaves frames of changed files unnamed
/// instead of naming them wrong.
#[must_use]
pub fn stack_build_ids(header: &Header, stacks: &[StackKey]) -> BuildIds {
    let maps = file_maps(header);
    frames_by_file(&maps, stacks, &BTreeMap::new(), &mut HashMap::new())
        .into_keys()
        .filter_map(|(pid, path)| build_id(pid, &path).map(|id| ((pid, path.clone()), id)))
        .collect()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().fold(String::new(), |mut hex, b| {
        use std::fmt::Write as _;
        let _ = write!(hex, "{b:02x}");
        hex
    })
}

/// Names of the functions at `offsets` of file `path` (as mapped by process `pid`), from
/// the cheapest table that has them: the file's own ELF symbols; then the symbol table of
/// its separate debug file (found by build id, as distributions install them: libc6-dbg),
/// looked up by virtual address; DWARF only for a file without such a debug file. DWARF
/// sections are often compressed: inflating libc's took a fifth of `report` on a small
/// recording, for the names the debug file's symbol table gives as well.
fn file_names(
    symbolizer: &Symbolizer,
    pid: u32,
    path: &str,
    offsets: &[u64],
    errors: &mut Vec<String>,
    large_symtab: u64,
) -> Vec<Option<String>> {
    // The kernel's own mappings ([vdso], [stack], [uprobes]: the page a uprobe runs the
    // probed instruction from) have no file to read: named by offset, without a warning.
    if path.starts_with('[') {
        return vec![None; offsets.len()];
    }
    let file = readable(pid, path);
    let mut failed: Option<String> = None;
    // A symbol table of `large_symtab` bytes or more is read here, through `pread`
    // (symtab.rs): mapped by blazesym, its pages counted in the agent's memory.
    let layout = read_elf(&file, |obj| (symtab::tables(obj), segments(obj)));
    let read_here = layout.as_ref().and_then(|(tables, segments)| {
        let tables = tables.filter(|t| t.symtab_bytes() >= large_symtab)?;
        let virt = to_virtual(segments, offsets);
        let names = std::fs::File::open(&file)
            .and_then(|f| symtab::names(&f, tables, &virt))
            .unwrap_or_else(|e| {
                failed.get_or_insert_with(|| e.to_string());
                vec![None; offsets.len()]
            });
        Some((names, tables.dwarf))
    });
    // Read here, and without DWARF to look in.
    let no_dwarf_here = read_here.as_ref().is_some_and(|(_, dwarf)| !dwarf);
    let mut lookup = |elf: PathBuf, dwarf: bool, input: Input<&[u64]>| -> Vec<Option<String>> {
        let mut source = Elf::new(elf);
        source.debug_syms = dwarf;
        let found = symbolizer
            .symbolize(&Source::Elf(source), input)
            .unwrap_or_else(|e| {
                failed.get_or_insert_with(|| format!("{e:#}"));
                Vec::new()
            });
        (0..input.as_inner_ref().len())
            .map(|i| match found.get(i) {
                Some(Symbolized::Sym(sym)) => Some(sym.name.to_string()),
                _ => None,
            })
            .collect()
    };
    let mut names = read_here.map_or_else(
        || lookup(file.clone(), false, Input::FileOffset(offsets)),
        |(names, _)| names,
    );
    let missing: Vec<usize> = (0..names.len()).filter(|i| names[*i].is_none()).collect();
    if missing.is_empty() {
        return names;
    }
    let wanted: Vec<u64> = missing.iter().map(|i| offsets[*i]).collect();
    let debug_file = blazesym::helper::read_elf_build_id(&file)
        .ok()
        .flatten()
        .map(|id| readable(pid, &build_id_path(&id)))
        .filter(|p| p.is_file());
    let virt = layout.map(|(_, segments)| to_virtual(&segments, &wanted));
    let more = match (debug_file, virt) {
        (Some(debug), Some(virt)) => lookup(debug, false, Input::VirtOffset(&virt)),
        // A file whose symbols were read here and that has no DWARF: blazesym would map
        // its symbol table again to find nothing more.
        _ if no_dwarf_here => vec![None; wanted.len()],
        _ => lookup(file, true, Input::FileOffset(&wanted)),
    };
    for (i, name) in missing.into_iter().zip(more) {
        names[i] = name;
    }
    if let Some(e) = failed {
        errors.push(format!(
            "cannot read the symbols of {path} (pid {pid}): {e}; its frames are named by file \
             offset"
        ));
    }
    names
}

/// Where distributions install the debug file of the binary with this build id.
fn build_id_path(id: &[u8]) -> String {
    let hex = hex(id);
    let (dir, rest) = hex.split_at(2.min(hex.len()));
    format!("/usr/lib/debug/.build-id/{dir}/{rest}.debug")
}

/// What `f` makes of the ELF file `path`, its headers read once (mapped; only the
/// headers are touched); `None` when the file is not an ELF object.
fn read_elf<T>(path: &Path, f: impl FnOnce(&object::File<'_>) -> T) -> Option<T> {
    let file = std::fs::File::open(path).ok()?;
    // SAFETY: a read-only map, used only within this call.
    let map = unsafe { memmap2::Mmap::map(&file) }.ok()?;
    let obj = object::File::parse(&*map).ok()?;
    Some(f(&obj))
}

/// A file's loadable segments: (file offset, size, address).
type Segments = Vec<(u64, u64, u64)>;

fn segments(obj: &object::File<'_>) -> Segments {
    use object::{Object as _, ObjectSegment as _};
    obj.segments()
        .map(|s| {
            let (start, size) = s.file_range();
            (start, size, s.address())
        })
        .collect()
}

/// The virtual addresses of file offsets (a loadable segment's address plus the offset
/// into it; `u64::MAX` outside every segment), as `discover` reads objects.
fn to_virtual(segments: &Segments, offsets: &[u64]) -> Vec<u64> {
    let virt = |offset: u64| {
        segments
            .iter()
            .find(|(start, size, _)| offset >= *start && offset - start < *size)
            .map_or(u64::MAX, |(start, _, address)| address + (offset - start))
    };
    offsets.iter().map(|o| virt(*o)).collect()
}

mod symtab;

#[cfg(test)]
mod tests;
