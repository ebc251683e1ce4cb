//! Writing a recording as the run goes: whole records only, a megabyte at a time, nothing
//! lost when the disk fills; the progress a follower reads up to.

use std::fs::File;
use std::io::{self, Write};
use std::path::Path;

use super::{FORMAT_VERSION, Header, MAGIC, MAX_RECORD, Meta, RecordError, TYPE_KERNEL, TYPE_META};

/// Writes a recording as the run goes. Records are gathered in memory and written a
/// megabyte at a time; the file only ever holds whole records: when a write fails (a full
/// disk) the file is cut back to the last whole record and the records not written stay
/// available through [`Writer::take_unwritten`], so nothing collected is lost.
pub struct Writer {
    file: File,
    buf: Vec<u8>,
    /// Bytes of whole records known to be in the file.
    durable: u64,
    records: u64,
    failed: bool,
    /// Published for a reader following the file as it is written ([`Follow`]).
    progress: std::sync::Arc<Progress>,
}

/// How far a recording being written holds whole records, and whether more will come:
/// what a [`super::Follow`] reader may read.
#[derive(Debug, Default)]
pub struct Progress {
    pub(super) durable: std::sync::atomic::AtomicU64,
    pub(super) closed: std::sync::atomic::AtomicBool,
}

impl Progress {
    /// Bytes of the recording written and flushed so far.
    #[must_use]
    pub fn durable(&self) -> u64 {
        self.durable.load(std::sync::atomic::Ordering::Acquire)
    }

    /// No more records will be read by followers (the rest of the run is handled
    /// otherwise, or the run is over): they end at what is in the file now.
    pub fn close(&self) {
        self.closed
            .store(true, std::sync::atomic::Ordering::Release);
    }
}

pub(super) const WRITE_CHUNK: usize = 1 << 20;

impl Writer {
    /// Creates `path` (which must not exist) and writes the header.
    pub fn create(path: &Path, header: &Header) -> Result<Writer, RecordError> {
        let file = File::options()
            .write(true)
            .create_new(true)
            .open(path)
            .map_err(|source| RecordError::Open {
                path: path.to_owned(),
                source,
            })?;
        let json = serde_json::to_vec(header).map_err(|e| RecordError::Write(e.into()))?;
        let mut buf = Vec::with_capacity(WRITE_CHUNK + 4096);
        buf.extend_from_slice(MAGIC);
        buf.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        buf.extend_from_slice(&(json.len() as u32).to_le_bytes());
        buf.extend_from_slice(&crc32fast::hash(&json).to_le_bytes());
        buf.extend_from_slice(&json);
        let mut w = Writer {
            file,
            buf,
            durable: 0,
            records: 0,
            failed: false,
            progress: std::sync::Arc::default(),
        };
        w.flush()?;
        Ok(w)
    }

    /// Writes the gathered records. On failure the file is cut back to its whole records
    /// and the writer refuses further writes; the records stay in [`Writer::take_unwritten`].
    pub fn flush(&mut self) -> Result<(), RecordError> {
        if self.failed {
            return Err(RecordError::Write(io::Error::other(
                "an earlier write of the recording failed",
            )));
        }
        if self.buf.is_empty() {
            return Ok(());
        }
        if let Err(e) = self.file.write_all(&self.buf) {
            self.failed = true;
            // Part of the chunk may have reached the file: drop it, so that the file ends
            // on a whole record. Shrinking a file works on a full disk.
            let _ = self.file.set_len(self.durable);
            let _ = io::Seek::seek(&mut self.file, io::SeekFrom::Start(self.durable));
            return Err(RecordError::Write(e));
        }
        self.durable += self.buf.len() as u64;
        self.buf.clear();
        self.progress
            .durable
            .store(self.durable, std::sync::atomic::Ordering::Release);
        Ok(())
    }

    /// What a reader following this recording ([`super::Follow`]) goes by.
    #[must_use]
    pub fn progress(&self) -> std::sync::Arc<Progress> {
        self.progress.clone()
    }

    fn write(&mut self, kind: u8, body: &[u8]) -> Result<(), RecordError> {
        self.write_parts(kind, &[body])
    }

    /// Writes one record whose body is `parts` one after another.
    fn write_parts(&mut self, kind: u8, parts: &[&[u8]]) -> Result<(), RecordError> {
        let mut hasher = crc32fast::Hasher::new();
        hasher.update(&[kind]);
        let mut len = 1;
        for part in parts {
            hasher.update(part);
            len += part.len();
        }
        self.buf.extend_from_slice(&(len as u32).to_le_bytes());
        self.buf.extend_from_slice(&hasher.finalize().to_le_bytes());
        self.buf.push(kind);
        for part in parts {
            self.buf.extend_from_slice(part);
        }
        self.records += 1;
        if self.buf.len() >= WRITE_CHUNK {
            self.flush()?;
        }
        Ok(())
    }

    /// Appends a kernel record as received, a stack record without its unused slots
    /// ([`crate::decode::compact`]).
    pub fn kernel(&mut self, bytes: &[u8]) -> Result<(), RecordError> {
        match crate::decode::compact(bytes) {
            Some(parts) => self.write_parts(TYPE_KERNEL, &parts),
            None => self.write(TYPE_KERNEL, bytes),
        }
    }

    /// Appends agent metadata. Symbol tables larger than a record may be are written as
    /// several records (the reader joins them); any other metadata that large is refused
    /// (the reader would take it for damage).
    pub fn meta(&mut self, meta: &Meta) -> Result<(), RecordError> {
        let json = serde_json::to_vec(meta).map_err(|e| RecordError::Write(e.into()))?;
        if json.len() < MAX_RECORD as usize {
            return self.write(TYPE_META, &json);
        }
        let halves = match meta {
            Meta::KernelSymbols { symbols } if symbols.len() > 1 => {
                let (a, b) = symbols.split_at(symbols.len() / 2);
                [
                    Meta::KernelSymbols {
                        symbols: a.to_vec(),
                    },
                    Meta::KernelSymbols {
                        symbols: b.to_vec(),
                    },
                ]
            }
            Meta::JitSymbols { pid, symbols } if symbols.len() > 1 => {
                let (a, b) = symbols.split_at(symbols.len() / 2);
                [
                    Meta::JitSymbols {
                        pid: *pid,
                        symbols: a.to_vec(),
                    },
                    Meta::JitSymbols {
                        pid: *pid,
                        symbols: b.to_vec(),
                    },
                ]
            }
            _ => {
                return Err(RecordError::TooLarge {
                    what: meta.kind(),
                    bytes: json.len(),
                });
            }
        };
        halves.iter().try_for_each(|half| self.meta(half))
    }

    /// Records written so far.
    #[must_use]
    pub fn records(&self) -> u64 {
        self.records
    }

    /// After a failed write: the records that are not in the file, in the recording's
    /// record framing (read them with [`super::Reader::records_only`]).
    pub fn take_unwritten(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.buf)
    }

    /// Writes everything gathered and waits until it is on disk.
    pub fn sync(&mut self) -> Result<(), RecordError> {
        self.flush()?;
        self.file.sync_data().map_err(RecordError::Write)
    }

    /// Flushes everything to disk.
    pub fn finish(mut self) -> Result<(), RecordError> {
        self.sync()
    }
}
