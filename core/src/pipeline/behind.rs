//! A file written behind: writes fill a buffer in memory, and a full buffer is handed to a
//! thread of the file's own, which copies it into the kernel while the next one fills.
//! On a run of one-call steps trace.json is 155 MB, and its thread spent two fifths of its
//! time in `write(2)` (the page cache's copy and allocation): that part now runs beside
//! the formatting, where the host has more than two CPUs.

use std::fs::File;
use std::io::{self, Write};
use std::sync::mpsc::{Receiver, Sender, SyncSender};

/// Bytes a buffer holds before it is handed on. Three at most exist: one filling, one
/// queued, one being written (768 KiB in all, less than the 1 MiB `BufWriter` before).
const BUFFER: usize = 1 << 18;

enum Msg {
    Data(Vec<u8>),
    /// Everything handed before is written: the first error met, if any.
    Flush(Sender<io::Result<()>>),
}

/// Whether the host has CPUs to spare for helper threads (more than two): on two, they
/// only take turns with the pipeline's own.
pub(crate) fn spare_cpus() -> bool {
    std::thread::available_parallelism().map_or(1, usize::from) > 2
}

/// An output file: written behind where the host has CPUs to spare for it, else through
/// a buffer on the writing thread itself. On two CPUs the extra thread only took turns
/// with the others: `report` of one-call steps took 222 ms written behind against 212 ms
/// (this VM, 8 runs each).
pub(crate) enum OutputFile {
    Behind(WriteBehind),
    Here(io::BufWriter<File>),
}

impl OutputFile {
    /// `file`, written behind by a thread named after `name` where more than two CPUs
    /// are available.
    pub(crate) fn new(file: File, name: &str) -> io::Result<OutputFile> {
        Ok(if spare_cpus() {
            OutputFile::Behind(WriteBehind::create(file, name)?)
        } else {
            OutputFile::Here(io::BufWriter::with_capacity(1 << 20, file))
        })
    }
}

impl Write for OutputFile {
    #[inline]
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        match self {
            OutputFile::Behind(w) => w.write(data),
            OutputFile::Here(w) => w.write(data),
        }
    }

    #[inline]
    fn write_all(&mut self, data: &[u8]) -> io::Result<()> {
        match self {
            OutputFile::Behind(w) => w.write_all(data),
            OutputFile::Here(w) => w.write_all(data),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            OutputFile::Behind(w) => w.flush(),
            OutputFile::Here(w) => w.flush(),
        }
    }
}

/// A file written by a thread of its own ([`WriteBehind::create`]).
pub(crate) struct WriteBehind {
    buf: Vec<u8>,
    to: Option<SyncSender<Msg>>,
    /// Buffers written and handed back, for reuse.
    back: Receiver<Vec<u8>>,
    buffers: usize,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl WriteBehind {
    /// Writes `file` on a thread named `name`. Fails only when no thread can be started.
    pub(crate) fn create(file: File, name: &str) -> io::Result<WriteBehind> {
        let (to, from) = std::sync::mpsc::sync_channel::<Msg>(1);
        let (give_back, back) = std::sync::mpsc::channel();
        let thread = std::thread::Builder::new()
            .name(format!("nccltrace-{name}"))
            .spawn(move || write_all_handed(file, &from, &give_back))?;
        Ok(WriteBehind {
            buf: Vec::with_capacity(BUFFER),
            to: Some(to),
            back,
            buffers: 1,
            thread: Some(thread),
        })
    }

    /// Hands the buffer on and takes an empty one: one handed back, a new one while there
    /// are fewer than three, else the next handed back.
    fn hand(&mut self) -> io::Result<()> {
        let next = match self.back.try_recv() {
            Ok(b) => b,
            Err(_) if self.buffers < 3 => {
                self.buffers += 1;
                Vec::with_capacity(BUFFER)
            }
            Err(_) => self.back.recv().map_err(|_| stopped())?,
        };
        let full = std::mem::replace(&mut self.buf, next);
        self.send(Msg::Data(full))
    }

    fn send(&self, msg: Msg) -> io::Result<()> {
        self.to
            .as_ref()
            .ok_or_else(stopped)?
            .send(msg)
            .map_err(|_| stopped())
    }
}

/// The writing thread's loop: each buffer written whole and handed back; after an error
/// nothing more is written, and each flush answers with it.
fn write_all_handed(mut file: File, from: &Receiver<Msg>, give_back: &Sender<Vec<u8>>) {
    let mut failed: Option<io::Error> = None;
    for msg in from {
        match msg {
            Msg::Data(mut buf) => {
                if failed.is_none()
                    && let Err(e) = file.write_all(&buf)
                {
                    failed = Some(e);
                }
                buf.clear();
                // The file is being dropped when nobody takes it back.
                let _ = give_back.send(buf);
            }
            Msg::Flush(reply) => {
                let result = match &failed {
                    Some(e) => Err(io::Error::new(e.kind(), e.to_string())),
                    None => Ok(()),
                };
                let _ = reply.send(result);
            }
        }
    }
    crate::procfs::log_thread_cpu();
}

fn stopped() -> io::Error {
    io::Error::other("the file's writing thread stopped")
}

impl Write for WriteBehind {
    #[inline]
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        self.write_all(data)?;
        Ok(data.len())
    }

    #[inline]
    fn write_all(&mut self, data: &[u8]) -> io::Result<()> {
        if self.buf.len() + data.len() > BUFFER && !self.buf.is_empty() {
            self.hand()?;
        }
        self.buf.extend_from_slice(data);
        Ok(())
    }

    /// Waits until everything written so far is in the file; the first error the writing
    /// thread met, if any.
    fn flush(&mut self) -> io::Result<()> {
        if !self.buf.is_empty() {
            self.hand()?;
        }
        let (reply, answer) = std::sync::mpsc::channel();
        self.send(Msg::Flush(reply))?;
        answer.recv().map_err(|_| stopped())?
    }
}

impl Drop for WriteBehind {
    /// Writes what is left and waits for the thread (errors are for [`Write::flush`]).
    fn drop(&mut self) {
        if !self.buf.is_empty() {
            let _ = self.hand();
        }
        drop(self.to.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};

    /// Pieces of every size, across many buffers, reach the file whole and in order by
    /// the time flush returns; a file that cannot be written says so at flush.
    #[test]
    fn what_is_written_is_in_the_file_at_flush() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out");
        let mut w = super::WriteBehind::create(std::fs::File::create(&path).unwrap(), "t").unwrap();
        let mut expected = Vec::new();
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        while expected.len() < 5 * super::BUFFER {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let piece: Vec<u8> = (0..(x % 3000) as usize)
                .map(|i| (i as u64 ^ x) as u8)
                .collect();
            w.write_all(&piece).unwrap();
            expected.extend_from_slice(&piece);
        }
        w.flush().unwrap();
        let mut got = Vec::new();
        std::fs::File::open(&path)
            .unwrap()
            .read_to_end(&mut got)
            .unwrap();
        assert!(
            got == expected,
            "{} bytes written, {} read",
            expected.len(),
            got.len()
        );
        w.write_all(b"tail").unwrap();
        drop(w);
        assert_eq!(std::fs::read(&path).unwrap().len(), expected.len() + 4);

        // Read-only: every write fails, and flush says so.
        let ro = std::fs::File::open(&path).unwrap();
        let mut w = super::WriteBehind::create(ro, "t").unwrap();
        w.write_all(&[1; 100]).unwrap();
        assert!(w.flush().is_err());
    }
}
