//! The recording's tests: written, read back, cut, damaged and followed.

use std::fs::File;
use std::io::BufReader;
use std::path::Path;

use super::*;

fn header() -> Header {
    Header {
        format_version: FORMAT_VERSION,
        kernel_release: "6.18".into(),
        cpu_nodes: vec![0, 0],
        targets: vec![TargetInfo {
            pid: 7,
            comm: "trainer".into(),
            ..Default::default()
        }],
        ..Default::default()
    }
}

fn write_sample(dir: &Path) -> PathBuf {
    let path = dir.join("r.nctr");
    let mut w = Writer::create(&path, &header()).unwrap();
    w.kernel(&[1, 2, 3]).unwrap();
    w.kernel(&[4; 100]).unwrap();
    w.meta(&Meta::End {
        end_monotonic_ns: 5,
        reason: "target exited".into(),
        lost_by_kind: BTreeMap::new(),
        counters: BTreeMap::new(),
        attach_ns: 0,
        agent_peak_rss_kb: 0,
    })
    .unwrap();
    w.finish().unwrap();
    path
}

fn read_all(path: &Path) -> Result<Vec<Record>, RecordError> {
    let mut r = Reader::open(path)?;
    let mut out = Vec::new();
    while let Some(rec) = r.next_record()? {
        out.push(rec);
    }
    Ok(out)
}

/// What is written comes back identical, header and records.
#[test]
fn round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_sample(dir.path());
    assert_eq!(Reader::open(&path).unwrap().header, header());
    let recs = read_all(&path).unwrap();
    assert_eq!(recs.len(), 3);
    assert_eq!(recs[0], Record::Kernel(vec![1, 2, 3]));
    assert!(matches!(recs[2], Record::Meta(Meta::End { .. })));
}

/// Truncation anywhere is reported with an offset; the records before it still read.
#[test]
fn truncated_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_sample(dir.path());
    let full = std::fs::read(&path).unwrap();
    for cut in [full.len() - 1, full.len() - 60, 30, 19, 5] {
        std::fs::write(&path, &full[..cut]).unwrap();
        match read_all(&path) {
            Err(RecordError::Damaged { .. } | RecordError::Foreign { .. }) => {}
            other => panic!("cut at {cut}: {other:?}"),
        }
    }
    std::fs::write(&path, &full[..full.len() - 1]).unwrap();
    let mut r = Reader::open(&path).unwrap();
    assert!(r.next_record().unwrap().is_some());
    assert!(r.next_record().unwrap().is_some());
    let err = r.next_record().unwrap_err();
    assert!(err.to_string().contains("offset"), "{err}");
}

/// Records are read in place when they lie whole in the input's buffer and copied when
/// they cross its end: every buffer size gives the same records, and damage is found
/// either way.
#[test]
fn records_across_buffer_edges() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_sample(dir.path());
    let expected = read_all(&path).unwrap();
    let read_with = |capacity: usize| -> Result<Vec<Record>, RecordError> {
        let file = BufReader::with_capacity(capacity, File::open(&path).unwrap());
        let mut r = Reader::new(file, &path)?;
        let mut out = Vec::new();
        while let Some(rec) = r.next_record()? {
            out.push(rec);
        }
        Ok(out)
    };
    for capacity in [1, 7, 8, 9, 13, 30, 64, 4096] {
        assert_eq!(
            read_with(capacity).unwrap(),
            expected,
            "buffer of {capacity}"
        );
    }
    let mut bytes = std::fs::read(&path).unwrap();
    let n = bytes.len();
    bytes[n - 10] ^= 0xff;
    std::fs::write(&path, &bytes).unwrap();
    for capacity in [7, 4096] {
        assert!(matches!(
            read_with(capacity),
            Err(RecordError::Damaged { .. })
        ));
    }
}

/// A flipped byte in a record fails its checksum; empty and foreign files are named.
#[test]
fn damaged_empty_foreign() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_sample(dir.path());
    let mut bytes = std::fs::read(&path).unwrap();
    let n = bytes.len();
    bytes[n - 10] ^= 0xff;
    std::fs::write(&path, &bytes).unwrap();
    assert!(matches!(read_all(&path), Err(RecordError::Damaged { .. })));
    std::fs::write(&path, b"").unwrap();
    assert!(matches!(read_all(&path), Err(RecordError::Empty { .. })));
    std::fs::write(&path, b"{\"not\": \"a recording\"}").unwrap();
    assert!(matches!(read_all(&path), Err(RecordError::Foreign { .. })));
}

/// Regression (issue 17): one damaged byte in the middle dropped every record after it.
/// Now reading resumes at the next whole record, whatever was damaged (a payload byte,
/// a length, a checksum) and however the input is buffered, and the skipped stretch
/// is counted; several megabytes of garbage are crossed too.
#[test]
fn resumes_after_damage_in_the_middle() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("r.nctr");
    let mut w = Writer::create(&path, &header()).unwrap();
    let mut starts = Vec::new();
    let header_len = std::fs::metadata(&path).unwrap().len() as usize;
    let mut at = header_len;
    for i in 0..100u32 {
        let body = vec![(i % 251) as u8; 10 + (i as usize * 37) % 300];
        starts.push(at);
        at += 8 + 1 + body.len();
        w.kernel(&body).unwrap();
    }
    w.finish().unwrap();
    let clean = std::fs::read(&path).unwrap();
    let read_with = |bytes: &[u8], capacity: usize| {
        let mut r = Reader::new(
            BufReader::with_capacity(capacity, io::Cursor::new(bytes)),
            &path,
        )
        .unwrap();
        let mut out = Vec::new();
        while let Some(rec) = r.next_record().unwrap() {
            out.push(rec);
        }
        (out, r.damage().clone())
    };
    // Record 50's payload, its length field, its checksum.
    for (what, at) in [
        ("payload", starts[50] + 12),
        ("length", starts[50] + 2),
        ("crc", starts[50] + 5),
    ] {
        let mut bytes = clean.clone();
        bytes[at] ^= 0x5a;
        for capacity in [7, 64, 4096, 1 << 20] {
            let (records, damage) = read_with(&bytes, capacity);
            assert_eq!(records.len(), 99, "{what}, buffer {capacity}");
            assert_eq!(damage.regions, 1, "{what}");
            assert_eq!(damage.bytes as usize, starts[51] - starts[50], "{what}");
            assert_eq!(damage.first.as_ref().unwrap().0 as usize, starts[50]);
            let expected = Record::Kernel(vec![51; 10 + (51 * 37) % 300]);
            assert_eq!(records[50], expected, "{what}: the record after resumes");
        }
    }
    // 3 MiB of garbage between records 20 and 21.
    let mut bytes = clean[..starts[21]].to_vec();
    bytes.extend((0..3 << 20).map(|i: u32| (i.wrapping_mul(2_654_435_761) >> 13) as u8));
    bytes.extend_from_slice(&clean[starts[21]..]);
    let (records, damage) = read_with(&bytes, 1 << 20);
    assert_eq!(records.len(), 100);
    assert_eq!((damage.regions, damage.bytes), (1, 3 << 20));
}

/// Regression (issue 18): the writer did not enforce the record limit the reader does,
/// so a large symbol table made `report` stop at "damaged". Symbol tables over the
/// limit are split over several records and read back whole; other metadata that
/// large is refused with its size.
#[test]
fn large_symbol_tables_are_split() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("r.nctr");
    let mut w = Writer::create(&path, &header()).unwrap();
    let symbols: Vec<(u64, String)> = (0..60_000u64)
        .map(|i| {
            (
                0xffff_ffff_8100_0000 + i * 16,
                format!("kernel_function_number_{i}"),
            )
        })
        .collect();
    w.meta(&Meta::KernelSymbols {
        symbols: symbols.clone(),
    })
    .unwrap();
    let huge = Meta::Target {
        target: Box::new(TargetInfo {
            maps_text: "x".repeat(MAX_RECORD as usize),
            ..TargetInfo::default()
        }),
    };
    let err = w.meta(&huge).unwrap_err();
    assert!(err.to_string().contains("target record"), "{err}");
    w.finish().unwrap();
    let mut back = Vec::new();
    let mut parts = 0;
    for rec in read_all(&path).unwrap() {
        if let Record::Meta(Meta::KernelSymbols { symbols }) = rec {
            parts += 1;
            back.extend(symbols);
        }
    }
    assert!(parts > 1, "{parts} records");
    assert_eq!(back, symbols);
}

/// Stack and Python stack records are kept without their unused slots, and decode to the
/// same events as the ring buffer's whole records; a stack with every slot in use, and
/// any other record, is kept as it came. A compact record cut short is refused.
#[test]
fn stack_records_kept_compact() {
    use crate::decode::{as_bytes, decode};
    use nccltrace_common::{
        KSTACK_DEPTH, PY_DEPTH, PY_ENTRY, PyFramesEvent, PyStackEvent, SampleEvent, USTACK_DEPTH,
        kind,
    };
    let hdr = |kind| nccltrace_common::Header {
        ts_ns: 9,
        tgid: 7,
        tid: 8,
        kind,
        cpu: 1,
        _pad: 0,
    };
    let stack = |kind, k: usize, u: usize| {
        let mut e = SampleEvent {
            hdr: hdr(kind),
            kstack_len: k as u32,
            ustack_len: u as u32,
            kstack: [0xdead; KSTACK_DEPTH],
            ustack: [0xbeef; USTACK_DEPTH],
        };
        for (i, f) in e.kstack[..k].iter_mut().enumerate() {
            *f = 0xffff_0000 + i as u64;
        }
        for (i, f) in e.ustack[..u].iter_mut().enumerate() {
            *f = 0x4000 + i as u64;
        }
        as_bytes(&e)
    };
    let mut py = PyStackEvent {
        hdr: hdr(kind::PY_STACK),
        len: 2,
        truncated: 1,
        codes: [0x77; PY_DEPTH],
        offsets: [5; PY_DEPTH],
    };
    py.codes[..2].copy_from_slice(&[0x1000, 0x2000]);
    py.offsets[..2].copy_from_slice(&[10, 20]);
    // The same frames with an entry marker after the first, as a bit (PY_FRAMES).
    let mut frames = PyFramesEvent {
        hdr: hdr(kind::PY_FRAMES),
        len: 2,
        truncated: 1,
        entries: 0b1,
        codes: [0x77; PY_DEPTH],
        offsets: [5; PY_DEPTH],
    };
    frames.codes[..2].copy_from_slice(&[0x1000, 0x2000]);
    frames.offsets[..2].copy_from_slice(&[10, 20]);
    let records = [
        (stack(kind::OFFCPU, 2, 3), 32 + 8 * 5),
        (stack(kind::SAMPLE, 0, 6), 32 + 8 * 6),
        (stack(kind::CALL_STACK, 0, 0), 32),
        (stack(kind::SAMPLE, KSTACK_DEPTH, USTACK_DEPTH), 800),
        (as_bytes(&py), 32 + 12 * 2),
        (vec![4; 100], 100),
        (as_bytes(&frames), 40 + 12 * 2),
    ];
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("r.nctr");
    let mut w = Writer::create(&path, &header()).unwrap();
    for (bytes, _) in &records {
        w.kernel(bytes).unwrap();
    }
    w.finish().unwrap();
    let back: Vec<Vec<u8>> = read_all(&path)
        .unwrap()
        .into_iter()
        .filter_map(|r| match r {
            Record::Kernel(bytes) => Some(bytes),
            Record::Meta(_) => None,
        })
        .collect();
    assert_eq!(back.len(), records.len());
    for ((whole, kept_len), kept) in records.iter().zip(&back) {
        assert_eq!(kept.len(), *kept_len);
        assert_eq!(decode(kept), decode(whole));
    }
    assert!(matches!(
        decode(&back[0]).unwrap(),
        crate::event::Event::OffCpu { ref kstack, ref ustack, .. }
            if kstack == &[0xffff_0000, 0xffff_0001] && ustack == &[0x4000, 0x4001, 0x4002]
    ));
    assert_eq!(back[5], vec![4; 100]);
    let crate::event::Event::PyStack {
        frames, truncated, ..
    } = decode(&back[6]).unwrap()
    else {
        panic!("not a Python stack")
    };
    let codes: Vec<u64> = frames.iter().map(|f| f.code).collect();
    assert_eq!(codes, vec![0x1000, PY_ENTRY, 0x2000]);
    assert!(truncated);
    assert!(decode(&back[6][..back[6].len() - 4]).is_err());
    // Cut short of the frames its lengths promise.
    assert!(decode(&back[0][..back[0].len() - 8]).is_err());
    assert!(decode(&back[4][..back[4].len() - 4]).is_err());
}

/// A recording of a newer format than this reader knows is refused by its version, with
/// the fix; every older version from the oldest is read.
#[test]
fn format_versions_read_and_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_sample(dir.path());
    let bytes = std::fs::read(&path).unwrap();
    let with_version = |v: u32| {
        let mut b = bytes.clone();
        b[8..12].copy_from_slice(&v.to_le_bytes());
        let p = dir.path().join(format!("v{v}.nctr"));
        std::fs::write(&p, b).unwrap();
        p
    };
    for v in OLDEST_FORMAT_VERSION..=FORMAT_VERSION {
        assert!(Reader::open(&with_version(v)).is_ok(), "version {v}");
    }
    let newer = FORMAT_VERSION + 1;
    let Err(e) = Reader::open(&with_version(newer)) else {
        panic!("version {newer} read")
    };
    let text = e.to_string();
    assert!(
        text.contains(&format!("format version {newer}"))
            && text.contains("use the nccltrace that made it"),
        "{text}"
    );
    assert!(e.is_bad_input());
}
