//! Reading a recording back, a finished one or one being written ([`Follow`]): every
//! record checked, damage skipped and counted.

use std::fs::File;
use std::io::{self, BufRead, BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use super::{
    FORMAT_VERSION, Header, MAGIC, MAX_HEADER, MAX_RECORD, Meta, OLDEST_FORMAT_VERSION, Progress,
    Record, RecordError, TYPE_KERNEL, TYPE_META,
};

/// A recording read while it is written: reads stop at the last whole record the writer
/// flushed and wait (polling every 20 ms) for more, until the writer's [`Progress`] is
/// closed; then the end of what was written is the end of the file.
pub struct Follow {
    file: File,
    pos: u64,
    progress: std::sync::Arc<Progress>,
}

impl Follow {
    /// A reader of the recording at `path` being written with `progress`.
    pub fn open(
        path: &Path,
        progress: std::sync::Arc<Progress>,
    ) -> Result<Reader<BufReader<Follow>>, RecordError> {
        let file = File::open(path).map_err(|source| RecordError::Open {
            path: path.to_owned(),
            source,
        })?;
        let follow = Follow {
            file,
            pos: 0,
            progress: progress.clone(),
        };
        let mut reader = Reader::new(BufReader::with_capacity(1 << 16, follow), path)?;
        reader.follow = Some(progress);
        Ok(reader)
    }
}

impl Read for Follow {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        use std::sync::atomic::Ordering::Acquire;
        loop {
            // Closed is read first: the durable length read after it is final.
            let closed = self.progress.closed.load(Acquire);
            let durable = self.progress.durable.load(Acquire);
            if durable > self.pos {
                let n = usize::try_from(durable - self.pos)
                    .unwrap_or(usize::MAX)
                    .min(buf.len());
                let got = self.file.read(&mut buf[..n])?;
                self.pos += got as u64;
                if got > 0 || n == 0 {
                    return Ok(got);
                }
            }
            if closed {
                return Ok(0);
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
}

impl Seek for Follow {
    fn seek(&mut self, to: SeekFrom) -> io::Result<u64> {
        self.pos = self.file.seek(to)?;
        Ok(self.pos)
    }
}

/// Whether `bytes` do not match their stored CRC-32. Under the fuzzer (`cfg(fuzzing)`)
/// checksums are not checked, so that mutated inputs reach the decoder behind them.
pub(super) fn checksum_differs(bytes: &[u8], crc: u32) -> bool {
    // The CPU's CRC support found once, not at every record (a fifth of the checksum's
    // cost on records of tens of bytes).
    static NEW: std::sync::LazyLock<crc32fast::Hasher> =
        std::sync::LazyLock::new(crc32fast::Hasher::new);
    if cfg!(fuzzing) {
        return false;
    }
    let mut hasher = NEW.clone();
    hasher.update(bytes);
    hasher.finalize() != crc
}

/// Reads a recording back.
pub struct Reader<R> {
    input: R,
    path: PathBuf,
    offset: u64,
    /// The current record's payload when it was copied (reused).
    payload: Vec<u8>,
    /// Bytes of the input's buffer the record last returned lies in, consumed at the
    /// next read.
    consume: usize,
    damage: Damage,
    pub header: Header,
    /// When the recording is read while it is written ([`Follow`]): how far it is.
    follow: Option<std::sync::Arc<Progress>>,
}

/// Damaged stretches a reader skipped to resume at the next whole record.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Damage {
    /// How many damaged stretches.
    pub regions: u64,
    /// Bytes skipped over them.
    pub bytes: u64,
    /// Where the first began (offset in the file), and what was expected there.
    pub first: Option<(u64, String)>,
}

impl std::fmt::Display for Damage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} damaged stretch(es) skipped, {} bytes in all (the records in them are lost)",
            self.regions, self.bytes
        )?;
        if let Some((offset, expected)) = &self.first {
            write!(
                f,
                "; the first at offset {offset}, where {expected} was expected"
            )?;
        }
        Ok(())
    }
}

/// Candidate starts examined per read while looking for the next whole record: with a
/// window of twice this (plus a prefix), a record of the largest size starting at any
/// candidate lies whole in the window.
pub(super) const SCAN_STEP: usize = MAX_RECORD as usize;

impl Reader<BufReader<File>> {
    /// Opens `path` and reads its header.
    pub fn open(path: &Path) -> Result<Self, RecordError> {
        let file = File::open(path).map_err(|source| RecordError::Open {
            path: path.to_owned(),
            source,
        })?;
        Reader::new(BufReader::with_capacity(1 << 20, file), path)
    }
}

/// Reads up to `buf.len()` bytes; returns how many were there (short at end of file).
pub(super) fn read_full(input: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut filled = 0;
    while filled < buf.len() {
        match input.read(&mut buf[filled..]) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(filled)
}

impl<R: BufRead> Reader<R> {
    /// Reads the header from `input`; `path` is only used in messages.
    pub fn new(mut input: R, path: &Path) -> Result<Self, RecordError> {
        let open_err = |source| RecordError::Open {
            path: path.to_owned(),
            source,
        };
        let damaged = |offset: u64, expected: &str| RecordError::Damaged {
            path: path.to_owned(),
            offset,
            expected: expected.to_owned(),
        };
        let mut fixed = [0u8; 20];
        let got = read_full(&mut input, &mut fixed).map_err(open_err)?;
        if got == 0 {
            return Err(RecordError::Empty {
                path: path.to_owned(),
            });
        }
        if got < 8 || &fixed[..8] != MAGIC {
            return Err(RecordError::Foreign {
                path: path.to_owned(),
            });
        }
        if got < 20 {
            return Err(damaged(
                got as u64,
                "a 20-byte file header (file is truncated)",
            ));
        }
        let version = u32::from_le_bytes(fixed[8..12].try_into().unwrap_or_default());
        if !(OLDEST_FORMAT_VERSION..=FORMAT_VERSION).contains(&version) {
            return Err(RecordError::Version {
                path: path.to_owned(),
                version,
            });
        }
        let len = u32::from_le_bytes(fixed[12..16].try_into().unwrap_or_default());
        let crc = u32::from_le_bytes(fixed[16..20].try_into().unwrap_or_default());
        if len > MAX_HEADER {
            return Err(damaged(12, "a header length below 64 MiB"));
        }
        let mut json = vec![0u8; len as usize];
        if read_full(&mut input, &mut json).map_err(open_err)? < json.len() {
            return Err(damaged(
                20,
                &format!("a {len}-byte header (file is truncated)"),
            ));
        }
        if checksum_differs(&json, crc) {
            return Err(damaged(20, "a header matching its checksum"));
        }
        let header: Header = serde_json::from_slice(&json)
            .map_err(|e| damaged(20, &format!("a valid JSON header ({e})")))?;
        Ok(Reader {
            input,
            path: path.to_owned(),
            offset: 20 + u64::from(len),
            payload: Vec::new(),
            consume: 0,
            damage: Damage::default(),
            header,
            follow: None,
        })
    }

    /// Reads bare records (no file header) from `input`, as [`super::Writer::take_unwritten`]
    /// gives them; `header` is the recording's.
    pub fn records_only(input: R, path: &Path, header: Header) -> Self {
        Reader {
            input,
            path: path.to_owned(),
            offset: 0,
            payload: Vec::new(),
            consume: 0,
            damage: Damage::default(),
            header,
            follow: None,
        }
    }

    /// True when the next record is not written yet and reading it would wait for the
    /// writer (a recording followed as it is written, caught up); false otherwise.
    #[must_use]
    pub fn would_wait(&self) -> bool {
        use std::sync::atomic::Ordering::Acquire;
        self.follow
            .as_ref()
            .is_some_and(|p| !p.closed.load(Acquire) && p.durable.load(Acquire) <= self.offset)
    }

    /// The damaged stretches skipped so far.
    #[must_use]
    pub fn damage(&self) -> &Damage {
        &self.damage
    }
}

impl<R: BufRead + Seek> Reader<R> {
    /// The next record; `Ok(None)` at a clean end of file.
    pub fn next_record(&mut self) -> Result<Option<Record>, RecordError> {
        Ok(self.next_raw()?.map(|r| match r {
            RawRecord::Kernel(bytes) => Record::Kernel(bytes.to_vec()),
            RawRecord::Meta(meta) => Record::Meta(meta),
        }))
    }

    /// As [`Reader::next_record`], a kernel record borrowed from the reader's buffer (no
    /// allocation per record; no copy when the record lies whole in the input's buffer).
    /// Past a damaged record, reading resumes at the next whole one (counted in
    /// [`Reader::damage`]); damage with no whole record after it (a cut file) is the error.
    pub fn next_raw(&mut self) -> Result<Option<RawRecord<'_>>, RecordError> {
        let located = loop {
            let start = self.offset;
            let expected = match self.locate() {
                Err(RecordError::Damaged { expected, .. }) => expected,
                other => break other?,
            };
            let resynced = self.resync(start + 1);
            let Some(found) = resynced.map_err(|source| RecordError::Open {
                path: self.path.clone(),
                source,
            })?
            else {
                return Err(RecordError::Damaged {
                    path: self.path.clone(),
                    offset: start,
                    expected,
                });
            };
            self.damage.regions += 1;
            self.damage.bytes += found - start;
            self.damage.first.get_or_insert((start, expected));
        };
        let Some(located) = located else {
            return Ok(None);
        };
        Ok(Some(match located {
            Located::Meta(meta) => RawRecord::Meta(meta),
            Located::Copied => RawRecord::Kernel(&self.payload[1..]),
            Located::InBuffer { len } => {
                // The record was not consumed yet: this returns the same buffer, unread.
                let buffered = self.input.fill_buf().map_err(|source| RecordError::Open {
                    path: self.path.clone(),
                    source,
                })?;
                RawRecord::Kernel(&buffered[9..8 + len])
            }
        }))
    }

    /// Finds the first offset at or after `from` where a whole record lies (its length in
    /// range, its checksum matching, a known type, valid metadata) and positions the input
    /// there. `None`: no such record before the end.
    fn resync(&mut self, from: u64) -> io::Result<Option<u64>> {
        self.consume = 0;
        let mut base = from;
        let mut window: Vec<u8> = Vec::with_capacity(2 * SCAN_STEP + 8);
        loop {
            self.input.seek(SeekFrom::Start(base))?;
            window.resize(2 * SCAN_STEP + 8, 0);
            let got = read_full(&mut self.input, &mut window)?;
            window.truncate(got);
            let candidates = got.min(SCAN_STEP);
            for i in 0..candidates {
                if whole_record_at(&window[i..]) {
                    let found = base + i as u64;
                    self.input.seek(SeekFrom::Start(found))?;
                    self.offset = found;
                    return Ok(Some(found));
                }
            }
            if got <= SCAN_STEP {
                return Ok(None);
            }
            base += SCAN_STEP as u64;
        }
    }
}

/// Whether `bytes` open with a whole, valid record.
pub(super) fn whole_record_at(bytes: &[u8]) -> bool {
    let Some(prefix) = bytes.get(..8) else {
        return false;
    };
    let len = u32::from_le_bytes(prefix[..4].try_into().unwrap_or_default());
    let crc = u32::from_le_bytes(prefix[4..].try_into().unwrap_or_default());
    if !(1..=MAX_RECORD).contains(&len) {
        return false;
    }
    let Some(payload) = bytes.get(8..8 + len as usize) else {
        return false;
    };
    !checksum_differs(payload, crc)
        && parse_payload(payload, crc, |_| RecordError::Write(io::Error::other(""))).is_ok()
}

impl<R: BufRead> Reader<R> {
    /// Checks the next record as it lies (damage is an error) and moves past it; a kernel
    /// record's bytes stay where [`Located`] says.
    fn locate(&mut self) -> Result<Option<Located>, RecordError> {
        self.input.consume(std::mem::take(&mut self.consume));
        let start = self.offset;
        let damaged = |expected: String| RecordError::Damaged {
            path: self.path.clone(),
            offset: start,
            expected,
        };
        let open = |source| RecordError::Open {
            path: self.path.clone(),
            source,
        };
        // (length, checksum) of a record lying whole in the input's buffer.
        let whole = {
            let buffered = self.input.fill_buf().map_err(open)?;
            if buffered.is_empty() {
                return Ok(None);
            }
            let field =
                |at: usize| u32::from_le_bytes(buffered[at..at + 4].try_into().unwrap_or_default());
            (buffered.len() >= 8)
                .then(|| (field(0), field(4)))
                .filter(|(len, _)| {
                    (1..=MAX_RECORD).contains(len) && buffered.len() - 8 >= *len as usize
                })
        };
        if let Some((len, crc)) = whole {
            self.offset += 8 + u64::from(len);
            self.consume = 8 + len as usize;
            // The buffer is not empty, so this returns it again without reading.
            let buffered = self.input.fill_buf().map_err(open)?;
            return Ok(
                parse_payload(&buffered[8..8 + len as usize], crc, damaged)?.map(|r| match r {
                    RawRecord::Kernel(_) => Located::InBuffer { len: len as usize },
                    RawRecord::Meta(meta) => Located::Meta(meta),
                }),
            );
        }
        // A record across the end of the input's buffer (or a damaged length): copied.
        let mut prefix = [0u8; 8];
        let got = read_full(&mut self.input, &mut prefix).map_err(open)?;
        if got < 8 {
            return Err(damaged(
                "an 8-byte record prefix (file is truncated)".into(),
            ));
        }
        let len = u32::from_le_bytes(prefix[..4].try_into().unwrap_or_default());
        let crc = u32::from_le_bytes(prefix[4..].try_into().unwrap_or_default());
        if len == 0 || len > MAX_RECORD {
            return Err(damaged(format!(
                "a record length between 1 and {MAX_RECORD}, found {len}"
            )));
        }
        self.payload.resize(len as usize, 0);
        let got = read_full(&mut self.input, &mut self.payload).map_err(open)?;
        if got < self.payload.len() {
            return Err(damaged(format!(
                "a {len}-byte record, found {got} (file is truncated)"
            )));
        }
        self.offset += 8 + u64::from(len);
        Ok(
            parse_payload(&self.payload, crc, damaged)?.map(|r| match r {
                RawRecord::Kernel(_) => Located::Copied,
                RawRecord::Meta(meta) => Located::Meta(meta),
            }),
        )
    }
}

/// Where a checked record lies.
pub(super) enum Located {
    /// Whole in the input's buffer, `len` payload bytes after the 8-byte prefix.
    InBuffer {
        len: usize,
    },
    /// In the reader's own payload buffer.
    Copied,
    Meta(Meta),
}

/// A record's payload (after its length and checksum): checked against `crc`, then its
/// type byte and the body.
pub(super) fn parse_payload(
    payload: &[u8],
    crc: u32,
    damaged: impl Fn(String) -> RecordError,
) -> Result<Option<RawRecord<'_>>, RecordError> {
    if checksum_differs(payload, crc) {
        return Err(damaged("a record matching its checksum".into()));
    }
    let (kind, body) = (payload[0], &payload[1..]);
    match kind {
        TYPE_KERNEL => Ok(Some(RawRecord::Kernel(body))),
        TYPE_META => serde_json::from_slice(body)
            .map(|m| Some(RawRecord::Meta(m)))
            .map_err(|e| damaged(format!("valid metadata JSON ({e})"))),
        other => Err(damaged(format!("record type 1 or 2, found {other}"))),
    }
}

/// One record read back, a kernel record borrowed from the reader.
#[derive(Debug, PartialEq, Eq)]
pub enum RawRecord<'a> {
    Kernel(&'a [u8]),
    Meta(Meta),
}
