//! Symbolizing kernel, JIT and file frames, on this process's own files and hand-made maps.

use super::*;

/// Perf map lines parse (bad ones skipped); an address not in any mapped file is named
/// by the entry covering it, a return address by the entry covering the call before it.
#[test]
fn jit_frames_from_perf_map() {
    let entries = parse_perf_map(
        "7f0000001000 20 py::train_step:/app/train.py\n\
         garbage\n\
         7f0000000000 10 py::<module>:/app/train.py\n\
         zz 10 bad\n",
    );
    assert_eq!(entries.len(), 2);
    assert_eq!(entries[0].2, "py::<module>:/app/train.py");
    let jit: BTreeMap<u32, Vec<(u64, u64, String)>> = [(1, entries)].into();
    let stacks = vec![StackKey {
        pid: 1,
        kstack: vec![],
        ustack: vec![0x7f00_0000_1005, 0x7f00_0000_1020, 0x7f00_0000_0400],
        py: vec![],
    }];
    let s = symbolize(
        &Header::default(),
        &stacks,
        &BTreeMap::new(),
        &jit,
        &BTreeMap::new(),
        &BTreeMap::new(),
    );
    assert_eq!(s.user(1, 0x7f00_0000_1005), "py::train_step:/app/train.py");
    // A return address just past the entry's end: the call was inside it.
    assert_eq!(s.user(1, 0x7f00_0000_1020), "py::train_step:/app/train.py");
    assert!(s.user(1, 0x7f00_0000_0400).starts_with("[unknown]"));
}

/// An address inside a function is named after it; one before the first is not.
#[test]
fn kernel_lookup() {
    let text =
        "ffffffff81000000 T start\nffffffff81000100 t exc_page_fault\nffffffff81000200 T after\n";
    let ips: BTreeSet<u64> = [0xffff_ffff_8100_0150, 0xffff_ffff_8000_0000].into();
    assert_eq!(
        kernel_names(std::io::Cursor::new(text), &ips),
        vec![(0xffff_ffff_8100_0150, "exc_page_fault".to_owned())]
    );
}

/// Read in two passes of the text (addresses, then the few names wanted): every
/// address named as when the text was held whole and sorted — of names sharing an
/// address the greatest, data symbols and hidden (zero) addresses never.
#[test]
fn kernel_lookup_two_passes() {
    let text = "ffffffff81000100 T b_name\nffffffff81000000 T start\n\
                ffffffff81000100 T a_alias\nffffffff81000180 D data\n\
                0000000000000000 T hidden\nffffffff81000200 t after [mod]\n";
    let ips: BTreeSet<u64> = [
        0xffff_ffff_8100_0010,
        0xffff_ffff_8100_0100,
        0xffff_ffff_8100_01f0,
        0xffff_ffff_8100_0300,
    ]
    .into();
    assert_eq!(
        kernel_names(std::io::Cursor::new(text), &ips),
        vec![
            (0xffff_ffff_8100_0010, "start".to_owned()),
            (0xffff_ffff_8100_0100, "b_name".to_owned()),
            (0xffff_ffff_8100_01f0, "b_name".to_owned()),
            (0xffff_ffff_8100_0300, "after".to_owned()),
        ]
    );
    assert!(kernel_names(std::io::Cursor::new(text), &BTreeSet::new()).is_empty());
}

/// Regression (issue 18): a file whose symbols cannot be read (gone, or not ELF) had its
/// frames named by offset with no word why; the reason is now said, once per file. The
/// kernel's mappings ([vdso], [uprobes]) have no file: named without a warning (every
/// attach warned about them).
#[test]
fn unreadable_symbols_are_said() {
    let dir = tempfile::tempdir().unwrap();
    let not_elf = dir.path().join("libnot-elf.so");
    std::fs::write(&not_elf, b"not an ELF file").unwrap();
    let header = Header {
        targets: vec![crate::record::TargetInfo {
            pid: 1,
            maps_text: format!(
                "100000000-100010000 r-xp 00000000 08:01 1 {}\n\
                 7fff00000000-7fff00002000 r-xp 00000000 00:00 0 [vdso]\n",
                not_elf.display()
            ),
            ..Default::default()
        }],
        ..Default::default()
    };
    let stacks = vec![StackKey {
        pid: 1,
        kstack: vec![],
        ustack: vec![0x1_0000_0100, 0x1_0000_0200, 0x7fff_0000_0010],
        py: vec![],
    }];
    let s = symbolize(
        &header,
        &stacks,
        &BTreeMap::new(),
        &BTreeMap::new(),
        &BTreeMap::new(),
        &BTreeMap::new(),
    );
    assert!(
        s.user(1, 0x1_0000_0100).starts_with("[libnot-elf.so+"),
        "{}",
        s.user(1, 0x1_0000_0100)
    );
    // A return address: named by the call instruction before it.
    assert_eq!(s.user(1, 0x7fff_0000_0010), "[vdso+0xf]");
    assert_eq!(s.stale.len(), 1, "{:?}", s.stale);
    assert!(
        s.stale[0].contains("cannot read the symbols of") && s.stale[0].contains("libnot-elf.so"),
        "{:?}",
        s.stale
    );
}

/// The virtual addresses of file offsets of the ELF file `path`.
fn virtual_addresses(path: &Path, offsets: &[u64]) -> Option<Vec<u64>> {
    read_elf(path, |obj| to_virtual(&segments(obj), offsets))
}

/// This test binary and the file offset of its `main`.
fn main_of_this_test() -> (PathBuf, u64) {
    use object::{Object as _, ObjectSegment as _, ObjectSymbol as _};
    let exe = std::env::current_exe().unwrap();
    let bytes = std::fs::read(&exe).unwrap();
    let obj = object::File::parse(&*bytes).unwrap();
    let main = obj.symbols().find(|s| s.name() == Ok("main")).unwrap();
    let at = main.address();
    let segment = obj
        .segments()
        .find(|s| (s.address()..s.address() + s.size()).contains(&at))
        .unwrap();
    let offset = at - segment.address() + segment.file_range().0;
    (exe, offset)
}

/// A file offset and the virtual address `virtual_addresses` gives for it name the same
/// function (the lookup in a separate debug file goes by virtual address); offsets
/// outside every segment and other files give none.
#[test]
fn virtual_address_of_a_file_offset() {
    let (exe, offset) = main_of_this_test();
    let virt = virtual_addresses(&exe, &[offset, u64::MAX / 2]).unwrap();
    assert_eq!(virt[1], u64::MAX);
    let virt = virt[0];
    let symbolizer = Symbolizer::new();
    let mut elf = Elf::new(&exe);
    elf.debug_syms = false;
    let by_virt = symbolizer
        .symbolize_single(&Source::Elf(elf), Input::VirtOffset(virt))
        .unwrap();
    assert_eq!(by_virt.as_sym().map(|s| s.name.as_ref()), Some("main"));
    let script = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(script.path(), "#!/bin/sh\n").unwrap();
    assert_eq!(virtual_addresses(script.path(), &[0]), None);
    assert_eq!(
        build_id_path(&[0x93, 0xac, 0x61]),
        "/usr/lib/debug/.build-id/93/ac61.debug"
    );
}

/// A file whose symbol table is read through `pread` (any size, here) has its frames,
/// given by file offset as the maps give them, named by that reader, and named where
/// blazesym names them: the system's libc (many aliases, on which the two readers pick
/// differently) every 4 KiB of its code, and this test binary's `main`.
#[test]
fn large_symbol_tables_read_here_name_as_blazesym() {
    use object::{Object as _, ObjectSegment as _};
    let libc = Path::new("/lib/x86_64-linux-gnu/libc.so.6");
    let bytes = std::fs::read(libc).unwrap();
    let obj = object::File::parse(&*bytes).unwrap();
    let mut offsets = Vec::new();
    for seg in obj.segments() {
        let (start, size) = seg.file_range();
        offsets.extend((start..start + size).step_by(4096).map(|o| o + 0x123));
    }
    let symbolizer = Symbolizer::builder()
        .enable_code_info(false)
        .enable_inlined_fns(false)
        .build();
    let pid = std::process::id();
    let mut errors = Vec::new();
    let mut both = |path: &str, offsets: &[u64]| {
        (
            file_names(&symbolizer, pid, path, offsets, &mut errors, 0),
            file_names(&symbolizer, pid, path, offsets, &mut errors, u64::MAX),
        )
    };
    let (exe, main_off) = main_of_this_test();
    let (main_here, _) = both(exe.to_str().unwrap(), &[main_off]);
    assert_eq!(main_here, [Some("main".to_owned())]);
    let (here, theirs) = both(libc.to_str().unwrap(), &offsets);
    assert!(errors.is_empty(), "{errors:?}");
    let virt = virtual_addresses(libc, &offsets).unwrap();
    let file = std::fs::File::open(libc).unwrap();
    let tables = read_elf(libc, symtab::tables).flatten().unwrap();
    let direct = symtab::names(&file, tables, &virt).unwrap();
    // The debug file's symbols (where libc6-dbg is installed) name what it left.
    for ((h, d), t) in here.iter().zip(&direct).zip(&theirs) {
        assert!(d.is_none() || h == d, "{h:?} / {d:?}");
        assert_eq!(h.is_some(), t.is_some(), "{h:?} / {t:?}");
    }
    let named = here.iter().filter(|n| n.is_some()).count();
    let differ = here.iter().zip(&theirs).filter(|(a, b)| a != b).count();
    assert!(named > 100, "{named} of {} named", offsets.len());
    // Without the reader the names would be blazesym's.
    assert!(differ > 0, "the same {named} names");
}

/// This test binary's own code symbolizes to a demangled Rust name through a fake
/// maps line covering the file.
#[test]
fn user_frames_from_maps() {
    let (exe, main_off) = main_of_this_test();
    let size = std::fs::metadata(&exe).unwrap().len();
    let header = Header {
        targets: vec![crate::record::TargetInfo {
            pid: 1,
            maps_text: format!(
                "100000000-{:x} r-xp 00000000 08:01 1 {}\n",
                0x1_0000_0000 + size,
                exe.display()
            ),
            ..Default::default()
        }],
        ..Default::default()
    };
    let stacks = vec![StackKey {
        pid: 1,
        kstack: vec![5],
        ustack: vec![0x1_0000_0000 + main_off],
        py: vec![],
    }];
    let kernel: BTreeMap<u64, String> = [(5, "schedule".to_owned())].into();
    let s = symbolize(
        &header,
        &stacks,
        &kernel,
        &BTreeMap::new(),
        &BTreeMap::new(),
        &BTreeMap::new(),
    );
    assert_eq!(s.user(1, 0x1_0000_0000 + main_off), "main");
    assert_eq!(s.kernel(5), "schedule");
    assert!(s.user(1, 7).starts_with("[unknown]"));
    assert!(s.stale.is_empty(), "{:?}", s.stale);
    // Regression (issue 18): recordings kept paths only, so a changed file was named
    // wrong. With the build id the live run recorded, the same file is named; another
    // build id leaves its frames unnamed, and says so.
    let ids = stack_build_ids(&header, &stacks);
    let path = exe.display().to_string();
    assert!(ids.contains_key(&(1, path.clone())), "{ids:?}");
    let with = |ids: &BuildIds| {
        let none = BTreeMap::new();
        symbolize(&header, &stacks, &kernel, &none, &BTreeMap::new(), ids)
    };
    let s = with(&ids);
    assert_eq!(s.user(1, 0x1_0000_0000 + main_off), "main");
    assert!(s.stale.is_empty());
    let other: BuildIds = [((1, path), "00ff".to_owned())].into();
    let s = with(&other);
    assert!(s.user(1, 0x1_0000_0000 + main_off).starts_with('['));
    assert!(s.stale[0].contains("build id 00ff"), "{:?}", s.stale);
}
