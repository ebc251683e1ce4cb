//! Function names from a large ELF symbol table, read with `pread` a chunk at a time
//! instead of mapped.
//!
//! blazesym maps the file and touches the whole symbol table to index it, and the names
//! it returns: on the H100 host, naming frames of PyTorch's `libtorch_cpu.so` (13 MB of
//! `.symtab`, 80 MB of `.strtab`) put 23 MB of that library's pages in the agent's
//! resident memory, and the node daemon's peak went over 70 MB. Read through `pread`, the
//! pages stay in the page cache, outside the agent's memory; the agent holds one chunk
//! and its answers.
//!
//! The names are the ones blazesym gives (`tests::as_blazesym_names_them`): for an
//! address, the symbols of the highest address at or below it (functions, objects and
//! untyped ones) are tried largest first, and the first that is defined and covers it
//! names it (a symbol of no size covers every address from its own in `.symtab`, only its
//! own in `.dynsym`); `.dynsym` is asked where `.symtab` names nothing. Symbols of equal
//! address and size (aliases) are told apart by nothing: blazesym's pick among them
//! depends on its sort, this one takes the first in the table.

use std::io;
use std::os::unix::fs::FileExt as _;

/// `.symtab` from this size on is read here, smaller ones by blazesym.
pub(super) const LARGE_SYMTAB_BYTES: u64 = 4 << 20;

/// Bytes read at a time.
const CHUNK: usize = 1 << 20;

/// One ELF64 symbol's size in the table.
const SYM_BYTES: usize = 24;

/// A symbol table and its string table: (offset, size) in the file.
#[derive(Clone, Copy, Debug)]
pub(super) struct Table {
    syms: (u64, u64),
    strs: (u64, u64),
    /// `.dynsym` (a symbol of no size covers only its own address).
    dynamic: bool,
}

/// A file's symbol tables, and whether it has DWARF.
#[derive(Clone, Copy, Debug)]
pub(super) struct Tables {
    pub(super) symtab: Option<Table>,
    pub(super) dynsym: Option<Table>,
    pub(super) dwarf: bool,
}

/// The file's `.symtab` and `.dynsym` (each with its string table), where it is a
/// little-endian ELF64 file; read from its section headers.
pub(super) fn tables(obj: &object::File<'_>) -> Option<Tables> {
    use object::{Object as _, ObjectSection as _};
    if !obj.is_64() || !obj.is_little_endian() || obj.format() != object::BinaryFormat::Elf {
        return None;
    }
    let range = |name: &str| {
        let s = obj.section_by_name(name)?;
        s.file_range().filter(|(_, size)| *size > 0)
    };
    let table = |syms: &str, strs: &str, dynamic| {
        Some(Table {
            syms: range(syms)?,
            strs: range(strs)?,
            dynamic,
        })
    };
    Some(Tables {
        symtab: table(".symtab", ".strtab", false),
        dynsym: table(".dynsym", ".dynstr", true),
        dwarf: range(".debug_info").is_some(),
    })
}

impl Tables {
    /// `.symtab`'s size in bytes.
    pub(super) fn symtab_bytes(&self) -> u64 {
        self.symtab.map_or(0, |t| t.syms.1)
    }
}

/// One symbol as the lookup needs it.
#[derive(Clone, Copy, Debug)]
struct Sym {
    name: u32,
    /// Defined in a section of the file (not `SHN_UNDEF`).
    defined: bool,
    value: u64,
    size: u64,
}

/// Calls `each` with every function, object or untyped symbol of `table`, in table order.
fn each_symbol(
    file: &std::fs::File,
    table: Table,
    buf: &mut Vec<u8>,
    mut each: impl FnMut(Sym),
) -> io::Result<()> {
    const STT_NOTYPE: u8 = 0;
    const STT_OBJECT: u8 = 1;
    const STT_FUNC: u8 = 2;
    const STT_GNU_IFUNC: u8 = 10;
    let (start, len) = table.syms;
    let len = len - len % SYM_BYTES as u64;
    let per_chunk = (CHUNK / SYM_BYTES * SYM_BYTES) as u64;
    let mut at = 0;
    while at < len {
        let n = per_chunk.min(len - at) as usize;
        buf.resize(n, 0);
        file.read_exact_at(buf, start + at)?;
        for s in buf.chunks_exact(SYM_BYTES) {
            let word = |r: std::ops::Range<usize>| {
                let mut b = [0u8; 8];
                b[..r.len()].copy_from_slice(&s[r]);
                u64::from_le_bytes(b)
            };
            let kind = s[4] & 0xf;
            if matches!(kind, STT_NOTYPE | STT_OBJECT | STT_FUNC | STT_GNU_IFUNC) {
                each(Sym {
                    name: word(0..4) as u32,
                    defined: word(6..8) != 0,
                    value: word(8..16),
                    size: word(16..24),
                });
            }
        }
        at += n as u64;
    }
    Ok(())
}

/// What one address found in a table: the highest symbol address at or below it, and
/// the symbol of that address that names it (largest first).
#[derive(Clone, Copy, Default)]
struct Found {
    floor: Option<u64>,
    sym: Option<Sym>,
}

/// The symbols of `table` that name `addrs` (sorted, without duplicates): two passes,
/// one for each address's highest symbol address at or below it, one for the symbol.
fn lookup(
    file: &std::fs::File,
    table: Table,
    addrs: &[u64],
    buf: &mut Vec<u8>,
) -> io::Result<Vec<Option<Sym>>> {
    debug_assert!(addrs.windows(2).all(|w| w[0] < w[1]));
    let mut found = vec![Found::default(); addrs.len()];
    // A symbol at `value` is the floor candidate of every address from it on: noted at
    // the first such address, carried to the later ones below.
    each_symbol(file, table, buf, |s| {
        let i = addrs.partition_point(|a| *a < s.value);
        if let Some(f) = found.get_mut(i) {
            f.floor = Some(f.floor.map_or(s.value, |v| v.max(s.value)));
        }
    })?;
    let mut floor = None;
    for f in &mut found {
        floor = floor.max(f.floor);
        f.floor = floor;
    }
    each_symbol(file, table, buf, |s| {
        // The addresses whose floor is this symbol's address: a run, floors rising.
        let first = found.partition_point(|f| f.floor < Some(s.value));
        for (f, addr) in found[first..].iter_mut().zip(&addrs[first..]) {
            if f.floor != Some(s.value) {
                break;
            }
            let covers = match (s.size, table.dynamic) {
                (0, false) => true,
                (0, true) => *addr == s.value,
                (size, _) => *addr - s.value < size,
            };
            let larger = f.sym.is_none_or(|kept| s.size > kept.size);
            if s.defined && covers && larger {
                f.sym = Some(s);
            }
        }
    })?;
    Ok(found.into_iter().map(|f| f.sym).collect())
}

/// The name at `offset` of the string table, demangled as blazesym demangles it.
fn name(file: &std::fs::File, table: Table, offset: u32) -> io::Result<Option<String>> {
    let (start, len) = table.strs;
    let mut bytes = Vec::new();
    let mut at = u64::from(offset);
    let mut piece = [0u8; 256];
    while at < len {
        let n = piece.len().min((len - at) as usize);
        file.read_exact_at(&mut piece[..n], start + at)?;
        if let Some(end) = piece[..n].iter().position(|b| *b == 0) {
            bytes.extend_from_slice(&piece[..end]);
            return Ok(String::from_utf8(bytes).ok().map(|n| demangle(&n)));
        }
        bytes.extend_from_slice(&piece[..n]);
        at += n as u64;
    }
    Ok(None)
}

/// Rust's demangling first, then C++'s, else the name as it is (blazesym's order).
fn demangle(name: &str) -> String {
    if let Ok(d) = rustc_demangle::try_demangle(name) {
        return format!("{d:#}");
    }
    cpp_demangle::Symbol::new(name)
        .ok()
        .and_then(|s| s.demangle().ok())
        .unwrap_or_else(|| name.to_owned())
}

/// Names of the functions at virtual addresses `addrs` of the file `path` opened as
/// `file`, from `.symtab`, then `.dynsym` for what it left unnamed.
pub(super) fn names(
    file: &std::fs::File,
    tables: Tables,
    addrs: &[u64],
) -> io::Result<Vec<Option<String>>> {
    let mut sorted: Vec<u64> = addrs.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut names: Vec<Option<String>> = vec![None; sorted.len()];
    let mut buf = Vec::new();
    for table in [tables.symtab, tables.dynsym].into_iter().flatten() {
        let wanted: Vec<usize> = (0..sorted.len()).filter(|i| names[*i].is_none()).collect();
        if wanted.is_empty() {
            break;
        }
        let at: Vec<u64> = wanted.iter().map(|i| sorted[*i]).collect();
        for (i, sym) in wanted.into_iter().zip(lookup(file, table, &at, &mut buf)?) {
            if let Some(sym) = sym {
                names[i] = name(file, table, sym.name)?;
            }
        }
    }
    Ok(addrs
        .iter()
        .map(|a| sorted.binary_search(a).ok().and_then(|i| names[i].clone()))
        .collect())
}

#[cfg(test)]
mod tests;
