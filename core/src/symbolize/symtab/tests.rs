//! The streaming reader against blazesym, on real files of this machine.

use super::*;
use blazesym::symbolize::{Input, Symbolized, Symbolizer, source};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// The symbol tables of the ELF file `path`.
fn tables_of(path: &Path) -> Tables {
    super::super::read_elf(path, tables).flatten().unwrap()
}

/// What names an address, as (symbol address, size, name).
type Named = Option<(u64, u64, String)>;

/// Every function, object and untyped symbol of `path` (both tables), demangled: by
/// (address, size) the names it has.
fn aliases(path: &Path) -> BTreeMap<(u64, u64), BTreeSet<String>> {
    use object::{Object as _, ObjectSymbol as _};
    let data = std::fs::read(path).unwrap();
    let obj = object::File::parse(&*data).unwrap();
    let mut by = BTreeMap::<(u64, u64), BTreeSet<String>>::new();
    for s in obj.symbols().chain(obj.dynamic_symbols()) {
        if let Ok(name) = s.name() {
            by.entry((s.address(), s.size()))
                .or_default()
                .insert(demangle(name));
        }
    }
    by
}

/// Addresses spread over the executable segments of `path`, and a few just outside.
fn addresses(path: &Path, n: u64) -> Vec<u64> {
    use object::{Object as _, ObjectSegment as _, SegmentFlags};
    let data = std::fs::read(path).unwrap();
    let obj = object::File::parse(&*data).unwrap();
    let mut out = vec![0, 1];
    for seg in obj.segments() {
        let exec = matches!(seg.flags(), SegmentFlags::Elf { p_flags } if p_flags & 1 != 0);
        if exec {
            let (start, size) = (seg.address(), seg.size());
            out.extend((0..n).map(|i| start + size * i / n + i % 7));
            out.push(start + size + 16);
        }
    }
    out
}

/// What blazesym names `addrs` with, as `Named`.
fn by_blazesym(path: &Path, addrs: &[u64]) -> Vec<Named> {
    let symbolizer = Symbolizer::builder()
        .enable_code_info(false)
        .enable_inlined_fns(false)
        .build();
    let mut elf = source::Elf::new(path);
    elf.debug_syms = false;
    let found = symbolizer
        .symbolize(&source::Source::Elf(elf), Input::VirtOffset(addrs))
        .unwrap();
    found
        .into_iter()
        .map(|s| match s {
            Symbolized::Sym(s) => Some((s.addr, s.size.unwrap_or(0) as u64, s.name.to_string())),
            Symbolized::Unknown(_) => None,
        })
        .collect()
}

/// What this reader names `addrs` with.
fn by_pread(path: &Path, addrs: &[u64]) -> Vec<Named> {
    let file = std::fs::File::open(path).unwrap();
    let t = tables_of(path);
    let mut sorted = addrs.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut found: BTreeMap<u64, (u64, u64, String)> = BTreeMap::new();
    let mut buf = Vec::new();
    for table in [t.symtab, t.dynsym].into_iter().flatten() {
        let at: Vec<u64> = sorted
            .iter()
            .copied()
            .filter(|a| !found.contains_key(a))
            .collect();
        for (a, sym) in at.iter().zip(lookup(&file, table, &at, &mut buf).unwrap()) {
            if let Some(s) = sym {
                let n = name(&file, table, s.name).unwrap().unwrap();
                found.insert(*a, (s.value, s.size, n));
            }
        }
    }
    addrs.iter().map(|a| found.get(a).cloned()).collect()
}

/// The same symbol as blazesym for every address (an alias of it where several names
/// share an address and a size), on files with a `.symtab` (this test binary, Rust) and
/// with only `.dynsym` (the system's libc, C); `names` gives the same names.
#[test]
fn as_blazesym_names_them() {
    let exe = std::env::current_exe().unwrap();
    let mut files = vec![exe];
    for libc in ["/lib/x86_64-linux-gnu/libc.so.6", "/usr/lib64/libc.so.6"] {
        if Path::new(libc).is_file() {
            files.push(libc.into());
            break;
        }
    }
    for path in &files {
        let addrs = addresses(path, 3000);
        let theirs = by_blazesym(path, &addrs);
        let ours = by_pread(path, &addrs);
        let alias = aliases(path);
        let (mut named, mut aliased) = (0, 0);
        for ((addr, t), o) in addrs.iter().zip(&theirs).zip(&ours) {
            match (t, o) {
                (None, None) => {}
                (Some((ta, ts, tn)), Some((oa, os, on))) => {
                    assert_eq!(
                        (ta, ts),
                        (oa, os),
                        "{}: {addr:#x}: {tn} / {on}",
                        path.display()
                    );
                    named += 1;
                    if tn != on {
                        let group = &alias[&(*oa, *os)];
                        assert!(
                            group.contains(tn) && group.contains(on),
                            "{}: {addr:#x}: {tn} / {on}: not aliases",
                            path.display()
                        );
                        aliased += 1;
                    }
                }
                _ => panic!("{}: {addr:#x}: blazesym {t:?}, here {o:?}", path.display()),
            }
        }
        assert!(named > addrs.len() / 4, "{}: {named} named", path.display());
        eprintln!(
            "{}: {named} named, {aliased} by another alias",
            path.display()
        );
        let file = std::fs::File::open(path).unwrap();
        let plain = names(&file, tables_of(path), &addrs).unwrap();
        let expected: Vec<Option<String>> = ours.iter().map(|o| o.clone().map(|o| o.2)).collect();
        assert_eq!(plain, expected);
    }
}

/// The two passes on a hand-made table: the highest address at or below wins even where
/// it covers nothing or is undefined (blazesym looks no further), the largest symbol
/// there first, a symbol of no size covers from its address in `.symtab`, only its own
/// in `.dynsym`; section symbols are not looked at.
#[test]
fn the_floor_symbol_names_an_address() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("syms");
    // (name offset, type, section, value, size)
    let syms: [(u32, u8, u16, u64, u64); 6] = [
        (1, 2, 1, 0x1000, 0x100), // big, at 0x1000..0x1100
        (5, 2, 1, 0x1000, 0x10),  // small alias start
        (9, 2, 1, 0x1080, 0x8),   // inside big: the floor from 0x1080 on
        (13, 0, 1, 0x2000, 0),    // no size
        (17, 2, 0, 0x3000, 0x10), // undefined
        (21, 3, 1, 0x4000, 0x10), // a section symbol: not a function
    ];
    let strs = b"\0big\0sml\0inn\0nos\0und\0sec\0";
    let mut bytes = Vec::new();
    for (n, kind, shndx, value, size) in syms {
        bytes.extend_from_slice(&n.to_le_bytes());
        bytes.push(kind);
        bytes.push(0);
        bytes.extend_from_slice(&shndx.to_le_bytes());
        bytes.extend_from_slice(&value.to_le_bytes());
        bytes.extend_from_slice(&size.to_le_bytes());
    }
    let syms_len = bytes.len() as u64;
    bytes.extend_from_slice(strs);
    std::fs::write(&path, &bytes).unwrap();
    let file = std::fs::File::open(&path).unwrap();
    let table = |dynamic| Table {
        syms: (0, syms_len),
        strs: (syms_len, strs.len() as u64),
        dynamic,
    };
    let addrs = [
        0xfff, 0x1000, 0x1008, 0x1050, 0x1084, 0x10a0, 0x2000, 0x2500, 0x3004, 0x4004,
    ];
    let named = |dynamic| -> Vec<Option<String>> {
        let t = Tables {
            symtab: Some(table(dynamic)),
            dynsym: None,
            dwarf: false,
        };
        names(&file, t, &addrs).unwrap()
    };
    // The names expected, `-` for none.
    let want = |w: &str| -> Vec<Option<String>> {
        w.split(' ')
            .map(|n| (n != "-").then(|| n.to_owned()))
            .collect()
    };
    assert_eq!(named(false), want("- big big big inn - nos nos - -"));
    assert_eq!(named(true), want("- big big big inn - nos - - -"));
}
