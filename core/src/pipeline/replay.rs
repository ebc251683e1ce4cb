//! Reading a recording back: a thread reads and decodes records in batches while the
//! caller attributes them.

use std::io;
use std::path::Path;

use super::{Aggregator, Outputs};
use crate::attribute::StepRule;
use crate::decode;
use crate::event::Event;
use crate::record::{self, Meta, RawRecord, Reader};

/// A record read back and decoded, as the reading thread hands it over.
enum Decoded {
    Event(Event),
    Undecodable,
    Meta(Meta),
    /// Damaged stretches skipped in the middle: just before the end (or the damaged tail).
    Skipped(record::Damage),
    /// The damaged tail: the last item.
    Damaged(record::RecordError),
    /// The reader has caught up with a recording being written (the end of a batch sent
    /// before it was full).
    CaughtUp,
}

impl Aggregator {
    /// Adds every record `reader` has left. A damaged tail is reported on stderr and the
    /// input marked incomplete; the complete records before it are kept.
    pub fn feed<R: io::BufRead + io::Seek + Send>(&mut self, reader: &mut Reader<R>) {
        self.feed_last(reader, 0);
    }

    /// As [`Aggregator::feed`], attributing only the kernel records after the first `skip`
    /// (those are counted in the totals): memory bounded by what is attributed.
    ///
    /// Reading, checking and decoding run on a thread of their own, a batch of records
    /// ahead of the attribution (on the 5.3 M-event soak recording they are half the
    /// work before the outputs).
    pub fn feed_last<R: io::BufRead + io::Seek + Send>(
        &mut self,
        reader: &mut Reader<R>,
        skip: u64,
    ) {
        let (full_tx, full_rx) = std::sync::mpsc::sync_channel::<Vec<Decoded>>(2);
        let (empty_tx, empty_rx) = std::sync::mpsc::channel::<Vec<Decoded>>();
        std::thread::scope(|scope| {
            let read = move || {
                let started = std::time::Instant::now();
                decode_batches(reader, &full_tx, &empty_rx);
                log::debug!("records read and decoded in {:?}", started.elapsed());
                crate::procfs::log_thread_cpu();
            };
            // Spawning fails only when the system is out of threads or memory.
            if let Err(e) = std::thread::Builder::new()
                .name("nccltrace-read".into())
                .spawn_scoped(scope, read)
            {
                self.incomplete(format!(
                    "cannot start the reading thread ({e}): no record was read; \
                     `nccltrace report` reads the recording again"
                ));
            }
            let mut seen = 0u64;
            for mut batch in full_rx {
                // Events are read where they lie and dropped by the reading thread when
                // it refills the batch (moving and freeing them was a quarter of this
                // thread's work on the trainer recording).
                for item in &mut batch {
                    match item {
                        Decoded::Event(event) => {
                            seen += 1;
                            if seen <= skip {
                                self.count(event);
                            } else {
                                if seen == skip + 1 && skip > 0 {
                                    self.timeline.start_at(event.ts_ns());
                                    self.window = Some((skip, event.ts_ns()));
                                }
                                self.push(event);
                            }
                        }
                        Decoded::Undecodable => {
                            seen += 1;
                            self.undecodable += 1;
                        }
                        Decoded::CaughtUp => self.caught_up(),
                        // Taken, leaving a placeholder nothing reads.
                        Decoded::Meta(_) | Decoded::Skipped(_) | Decoded::Damaged(_) => {
                            self.rare(std::mem::replace(item, Decoded::CaughtUp));
                        }
                    }
                }
                // The reader may have stopped; then the batch is dropped here.
                let _ = empty_tx.send(batch);
            }
        });
    }
}

impl Aggregator {
    /// A record other than an event: the recording's metadata, or damage.
    fn rare(&mut self, item: Decoded) {
        match item {
            Decoded::Meta(meta) => self.meta(meta),
            Decoded::Skipped(damage) => {
                crate::note!(
                    "nccltrace: warning: the recording is damaged: {damage}; the records \
                     around them are kept"
                );
                self.damaged = Some(damage);
            }
            Decoded::Damaged(e) => {
                crate::note!("nccltrace: warning: {e}; keeping the complete records before it");
                self.incomplete(e.to_string());
            }
            Decoded::Event(_) | Decoded::Undecodable | Decoded::CaughtUp => {}
        }
    }
}

/// Records per batch handed from the reading thread to the attribution. Each record is
/// held as a decoded event (~150 bytes), and up to five batches are in flight (two
/// waiting, one being read, one being filled, one coming back): 4,096 a batch made these
/// the largest part of a node daemon's heap (7.3 MB of 17.7 at its peak, two windows
/// overlapping at a rotation); at 1,024 `report` is as fast.
const BATCH: usize = 1024;

/// Reads and decodes every record `reader` has left, in batches sent to `full`; batches
/// come back through `empty` to be refilled. Stops at the end, at damage, or when the
/// receiver is gone.
fn decode_batches<R: io::BufRead + io::Seek>(
    reader: &mut Reader<R>,
    full: &std::sync::mpsc::SyncSender<Vec<Decoded>>,
    empty: &std::sync::mpsc::Receiver<Vec<Decoded>>,
) {
    loop {
        let mut batch = empty.try_recv().map_or_else(
            |_| Vec::with_capacity(BATCH),
            |mut b| {
                b.clear();
                b
            },
        );
        let mut done = false;
        while batch.len() < BATCH {
            // Followed live and caught up: what is read so far goes now, not when the
            // batch is full (a quiet run would hold its last steps back).
            if !batch.is_empty() && reader.would_wait() {
                batch.push(Decoded::CaughtUp);
                break;
            }
            match reader.next_raw() {
                Ok(Some(RawRecord::Kernel(bytes))) => {
                    let item = decode::decode(bytes).map_or(Decoded::Undecodable, Decoded::Event);
                    batch.push(item);
                }
                Ok(Some(RawRecord::Meta(meta))) => batch.push(Decoded::Meta(meta)),
                Ok(None) => done = true,
                Err(e) => {
                    if reader.damage().regions > 0 {
                        batch.push(Decoded::Skipped(reader.damage().clone()));
                    }
                    batch.push(Decoded::Damaged(e));
                    done = true;
                    break;
                }
            }
            if done {
                if reader.damage().regions > 0 {
                    batch.push(Decoded::Skipped(reader.damage().clone()));
                }
                break;
            }
        }
        if full.send(batch).is_err() || done {
            return;
        }
    }
}

/// Why a recording could not be replayed.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error(transparent)]
    Record(#[from] record::RecordError),
    /// An output file in the folder the replay streams into.
    #[error("cannot write output {}: {source}", path.display())]
    Output {
        path: std::path::PathBuf,
        #[source]
        source: io::Error,
    },
}

/// Replays a recording through the pipeline. A damaged tail is reported on stderr and
/// the complete records before it are kept.
pub fn replay(path: &Path, rule: StepRule, epoch_events: u64) -> Result<Outputs, ReplayError> {
    replay_from(Reader::open(path)?, rule, epoch_events, None)
}

/// As [`replay`], writing the outputs into `dir` as the recording is attributed
/// ([`super::Streamer`]); [`super::write_outputs`] completes them.
pub fn replay_into(
    path: &Path,
    rule: StepRule,
    epoch_events: u64,
    dir: &Path,
) -> Result<Outputs, ReplayError> {
    let reader = Reader::open(path)?;
    replay_from(reader, rule, epoch_events, Some(dir))
}

/// Events per attribution epoch: the run is attributed in stretches of at least this many
/// events as it is read (see `attribute::epoch`).
pub const EPOCH_EVENTS: u64 = 1 << 12;

/// As [`replay`], from any reader (the fuzzer feeds it bytes), streaming the outputs into
/// `dir` when given.
pub fn replay_from<R: io::BufRead + io::Seek + Send>(
    mut reader: Reader<R>,
    mut rule: StepRule,
    epoch_events: u64,
    dir: Option<&Path>,
) -> Result<Outputs, ReplayError> {
    // A recording made with --step-nvtx is cut the same way unless told otherwise.
    if rule == StepRule::Auto
        && let Some(pattern) = reader.header.step_nvtx.as_deref()
        && let Ok(pattern) = crate::attribute::NvtxPattern::new(pattern)
    {
        rule = StepRule::Nvtx(pattern);
    }
    let started = std::time::Instant::now();
    let mut agg = Aggregator::new(reader.header.clone());
    agg.stream(rule.clone(), epoch_events);
    if let Some(dir) = dir {
        agg.stream_into(dir)
            .map_err(|(path, source)| ReplayError::Output { path, source })?;
    }
    agg.feed(&mut reader);
    log::debug!("read and decoded in {:?}", started.elapsed());
    let started = std::time::Instant::now();
    let outputs = agg.finish(rule);
    log::debug!("attributed in {:?}", started.elapsed());
    Ok(outputs)
}
