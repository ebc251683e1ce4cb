//! Finding NCCL and the CUDA driver in a target: its memory maps, then the ELF symbols of
//! each mapped object, read through a memory map of the file (the PyPI libnccl.so.2 is
//! ~473 MB; only its symbol tables are touched).

pub use nccltrace_core::procfs::{MapEntry, mapped_files, maps_added, parse_maps};
use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use object::{Object, ObjectSection, ObjectSymbol, SectionIndex};

use crate::event::{Func, Library};

/// Failure reading an object file's symbols.
#[derive(Debug, thiserror::Error)]
pub enum SymbolError {
    #[error("cannot open {path}: {source}")]
    Open {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not an ELF object: {source}")]
    Parse {
        path: PathBuf,
        #[source]
        source: object::Error,
    },
}

/// A symbol found in an object, with the file offset a uprobe needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resolved {
    pub symbol: String,
    pub address: u64,
    /// The symbol's own offset in the file.
    pub file_offset: u64,
    /// Where an entry uprobe goes: `file_offset`, or past an `endbr64` there
    /// (see `entry_offset`).
    pub entry_offset: u64,
}

/// `endbr64`: what functions built with `-fcf-protection` (CET; Ubuntu's and Fedora's
/// compilers by default) begin with.
const ENDBR64: [u8; 4] = [0xf3, 0x0f, 0x1e, 0xfa];

/// Where the entry uprobe of the function at `file_offset` of `image` goes: past an
/// `endbr64`. The kernel does not emulate `endbr64` under a uprobe but single-steps it out
/// of line, a second trap: 12.5–15.5 µs a traced call on the 2-vCPU VM against 2.0 µs on
/// the instruction after it (docs/benchmarks.md). `endbr64` changes no register and not
/// the stack, so the arguments and the return address are where they were at the entry.
#[must_use]
pub fn entry_offset(image: &[u8], file_offset: u64) -> u64 {
    let start = usize::try_from(file_offset).ok();
    match start.and_then(|s| image.get(s..s.checked_add(ENDBR64.len())?)) {
        Some(first) if first == ENDBR64 => file_offset + ENDBR64.len() as u64,
        _ => file_offset,
    }
}

/// Which symbol tables to search.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tables {
    /// `.dynsym` only: small, and where a shared library's API lives.
    Dynamic,
    /// `.dynsym` and `.symtab`: also finds NCCL linked statically and hidden.
    All,
}

/// Resolves `names` in the ELF file at `path`, reading it through a memory map.
pub fn resolve(
    path: &Path,
    names: &[&str],
    tables: Tables,
) -> Result<BTreeMap<String, Resolved>, SymbolError> {
    let file = File::open(path).map_err(|source| SymbolError::Open {
        path: path.to_owned(),
        source,
    })?;
    // SAFETY: the mapping is read-only and private; a library replaced under us would at
    // worst give wrong symbols, which the kernel then refuses to probe.
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|source| SymbolError::Open {
        path: path.to_owned(),
        source,
    })?;
    let obj = object::File::parse(&*map).map_err(|source| SymbolError::Parse {
        path: path.to_owned(),
        source,
    })?;
    let mut found = BTreeMap::new();
    let mut visit = |sym: object::Symbol<'_, '_>| {
        if sym.is_undefined() || sym.kind() != object::SymbolKind::Text {
            return;
        }
        let Ok(name) = sym.name() else { return };
        if !names.contains(&name) || found.contains_key(name) {
            return;
        }
        let Some(index) = sym.section_index() else {
            return;
        };
        if let Some(file_offset) = file_offset(&obj, index, sym.address()) {
            found.insert(
                name.to_owned(),
                Resolved {
                    symbol: name.to_owned(),
                    address: sym.address(),
                    file_offset,
                    entry_offset: entry_offset(&map, file_offset),
                },
            );
        }
    };
    obj.dynamic_symbols().for_each(&mut visit);
    if tables == Tables::All {
        obj.symbols().for_each(&mut visit);
    }
    Ok(found)
}

/// The machine code of the first of `names` that `path` defines in its dynamic symbols (at
/// most `max` bytes of it), read through a memory map.
pub fn function_code(
    path: &Path,
    names: &[&str],
    max: usize,
) -> Result<Option<Vec<u8>>, SymbolError> {
    let file = File::open(path).map_err(|source| SymbolError::Open {
        path: path.to_owned(),
        source,
    })?;
    // SAFETY: as in `resolve`.
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|source| SymbolError::Open {
        path: path.to_owned(),
        source,
    })?;
    let obj = object::File::parse(&*map).map_err(|source| SymbolError::Parse {
        path: path.to_owned(),
        source,
    })?;
    for name in names {
        let Some(sym) = obj.dynamic_symbols().find(|s| {
            !s.is_undefined() && s.kind() == object::SymbolKind::Text && s.name() == Ok(name)
        }) else {
            continue;
        };
        let Some(start) = sym
            .section_index()
            .and_then(|index| file_offset(&obj, index, sym.address()))
            .and_then(|o| usize::try_from(o).ok())
        else {
            continue;
        };
        let len = usize::try_from(sym.size()).unwrap_or(max).min(max);
        if let Some(code) = map.get(start..start.saturating_add(len)) {
            return Ok(Some(code.to_vec()));
        }
    }
    Ok(None)
}

/// `address - section address + section file offset`: what the kernel's uprobe wants.
fn file_offset(obj: &object::File<'_>, index: SectionIndex, address: u64) -> Option<u64> {
    let section = obj.section_by_index(index).ok()?;
    let (offset, _) = section.file_range()?;
    address.checked_sub(section.address())?.checked_add(offset)
}

/// One probe to attach: a function at an offset of a library.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProbeSite {
    pub func: Func,
    pub symbol: String,
    /// Where the entry and return probes go (`Resolved::entry_offset`).
    pub file_offset: u64,
    /// The function opens with `endbr64` and the probes sit past it.
    pub past_endbr64: bool,
}

/// A library found in the target, with the probe sites it defines.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FoundLibrary {
    /// The path as the target sees it.
    pub path: String,
    /// The path from here (through `/proc/PID/root`).
    pub host_path: PathBuf,
    pub sites: Vec<ProbeSite>,
}

/// Probe sites for `library`'s functions, one per address: `ncclX` is a weak alias of
/// `pnccl X`, and probing both would count every call twice.
#[must_use]
pub fn probe_sites(symbols: &BTreeMap<String, Resolved>, library: Library) -> Vec<ProbeSite> {
    let mut sites: Vec<ProbeSite> = Vec::new();
    for (func, _, names) in Func::ALL.iter().filter(|(f, _, _)| f.library() == library) {
        let Some(resolved) = names.iter().find_map(|n| symbols.get(*n)) else {
            continue;
        };
        if sites.iter().any(|s| s.file_offset == resolved.entry_offset) {
            continue;
        }
        sites.push(ProbeSite {
            func: *func,
            symbol: resolved.symbol.clone(),
            file_offset: resolved.entry_offset,
            past_endbr64: resolved.entry_offset != resolved.file_offset,
        });
    }
    sites
}

/// The symbol that marks a library as NCCL, or as the CUDA driver.
fn marker(library: Library) -> &'static [&'static str] {
    match library {
        Library::Nccl => &["ncclAllReduce", "pncclAllReduce"],
        Library::Cuda => &["cuStreamSynchronize"],
        Library::Marker => &[],
        Library::Nvtx => &["nvtxRangePushA"],
    }
}

fn all_symbols(library: Library) -> Vec<&'static str> {
    Func::ALL
        .iter()
        .filter(|(f, _, _)| f.library() == library)
        .flat_map(|(_, _, names)| names.iter().copied())
        .collect()
}

/// Finds the object defining `library`'s marker symbol among `files` (paths as the target
/// sees them, read under `root`), by symbol, not by file name: NCCL may be linked into
/// another library. Dynamic symbol tables first, then full ones.
#[must_use]
pub fn find_library(root: &Path, files: &[String], library: Library) -> Option<FoundLibrary> {
    for tables in [Tables::Dynamic, Tables::All] {
        for path in files {
            let host_path = root.join(path.trim_start_matches('/'));
            let Ok(found) = resolve(&host_path, marker(library), tables) else {
                continue;
            };
            if found.is_empty() {
                continue;
            }
            let Ok(symbols) = resolve(&host_path, &all_symbols(library), tables) else {
                continue;
            };
            return Some(FoundLibrary {
                path: path.clone(),
                host_path,
                sites: probe_sites(&symbols, library),
            });
        }
    }
    None
}

/// Finds the function `symbol` for `--step-symbol`: in the mapped object whose path is
/// `library` or ends with `/library` when given, else in every mapped object (the
/// executable first), dynamic symbols first.
#[must_use]
pub fn find_marker(
    root: &Path,
    files: &[String],
    symbol: &str,
    library: Option<&str>,
) -> Option<FoundLibrary> {
    let candidates: Vec<&String> = files
        .iter()
        .filter(|f| library.is_none_or(|l| f.as_str() == l || f.ends_with(&format!("/{l}"))))
        .collect();
    for tables in [Tables::Dynamic, Tables::All] {
        for path in &candidates {
            let host_path = root.join(path.trim_start_matches('/'));
            let Ok(found) = resolve(&host_path, &[symbol], tables) else {
                continue;
            };
            if let Some(r) = found.get(symbol) {
                return Some(FoundLibrary {
                    path: (*path).clone(),
                    host_path,
                    sites: vec![ProbeSite {
                        func: Func::StepMarker,
                        symbol: symbol.to_owned(),
                        file_offset: r.entry_offset,
                        past_endbr64: r.entry_offset != r.file_offset,
                    }],
                });
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Regression (issue 18): libraries loaded after attach had no maps in the recording,
    /// so their frames stayed unnamed. The maps read at the end add what is new, and
    /// nothing that overlaps what the stacks taken before meant.
    #[test]
    fn later_mappings_are_added() {
        let then = "1000-2000 r-xp 00000000 08:01 5 /usr/lib/libc.so.6\n";
        let now = "1000-2000 r-xp 00000000 08:01 5 /usr/lib/libc.so.6\n\
                   1800-2800 r-xp 00000000 08:01 6 /opt/overlap.so\n\
                   3000-4000 r-xp 00000000 08:01 7 /opt/libcudnn.so.9\n\
                   5000-6000 rw-p 00000000 00:00 0\n";
        assert_eq!(
            maps_added(then, now),
            "3000-4000 r-xp 00000000 08:01 7 /opt/libcudnn.so.9\n"
        );
        assert_eq!(maps_added(then, then), "");
    }

    /// Lines of a real maps file, including anonymous, special and deleted mappings.
    #[test]
    fn parses_maps() {
        let text = "\
55d0c0a00000-55d0c0a01000 r--p 00000000 08:01 1234 /usr/bin/python3.12
7f1e00000000-7f1e00100000 r-xp 00010000 08:01 5678     /opt/lib/libnccl.so.2
7f1e00100000-7f1e00200000 rw-p 00000000 00:00 0
7f1e00200000-7f1e00300000 r-xp 00000000 08:01 99 /tmp/x (deleted)
7fff00000000-7fff00001000 r-xp 00000000 00:00 0                          [vdso]
7f1e00400000-7f1e00500000 rw-s 00000000 00:05 77 /dev/nvidia0
garbage line
";
        let maps = parse_maps(text);
        assert_eq!(maps.len(), 6);
        assert_eq!(maps[1].offset, 0x10000);
        assert_eq!(maps[1].path.as_deref(), Some("/opt/lib/libnccl.so.2"));
        assert_eq!(maps[2].path, None);
        assert_eq!(
            mapped_files(&maps),
            vec![
                "/usr/bin/python3.12".to_owned(),
                "/opt/lib/libnccl.so.2".to_owned()
            ]
        );
    }

    /// Symbols of this very test binary resolve to file offsets inside the file, and a
    /// missing file or a non-ELF file gives an error, not a panic.
    #[test]
    fn resolves_own_symbols() {
        let exe = std::env::current_exe().unwrap();
        let found = resolve(&exe, &["main"], Tables::All).unwrap();
        let main = &found["main"];
        assert!(main.file_offset < std::fs::metadata(&exe).unwrap().len());
        assert!(resolve(Path::new("/nonexistent"), &["x"], Tables::All).is_err());
        let dir = tempfile::tempdir().unwrap();
        let junk = dir.path().join("junk.so");
        std::fs::write(&junk, b"not an elf file at all").unwrap();
        assert!(matches!(
            resolve(&junk, &["x"], Tables::All),
            Err(SymbolError::Parse { .. })
        ));
    }

    /// An entry probe goes past an `endbr64` and nowhere else: not past other
    /// instructions, not out of the image.
    #[test]
    fn entry_past_endbr64() {
        let image = [0x90, 0xf3, 0x0f, 0x1e, 0xfa, 0x55, 0x55, 0xf3, 0x0f, 0x1e];
        assert_eq!(entry_offset(&image, 1), 5, "endbr64");
        assert_eq!(entry_offset(&image, 0), 0, "nop");
        assert_eq!(entry_offset(&image, 5), 5, "push");
        assert_eq!(
            entry_offset(&image, 7),
            7,
            "endbr64 cut off by the end of the image"
        );
        assert_eq!(entry_offset(&image, 100), 100, "past the end");
        assert_eq!(entry_offset(&image, u64::MAX), u64::MAX, "far past the end");
    }

    /// Strong and weak names at one address give one probe site, under the strong name.
    #[test]
    fn one_site_per_address() {
        let mut symbols = BTreeMap::new();
        for (name, off) in [
            ("pncclAllReduce", 0x100),
            ("ncclAllReduce", 0x100),
            ("ncclSend", 0x200),
        ] {
            symbols.insert(
                name.to_owned(),
                Resolved {
                    symbol: name.to_owned(),
                    address: off,
                    file_offset: off,
                    entry_offset: off,
                },
            );
        }
        let sites = probe_sites(&symbols, Library::Nccl);
        assert_eq!(sites.len(), 2);
        assert_eq!(sites[0].symbol, "pncclAllReduce");
        assert_eq!(sites[1].func, Func::Send);
    }
}
