//! The ring buffers the programs write to, one per group of CPUs (`EVENTS_0`…), drained
//! together: each pass takes what every buffer holds and hands it on in time order.
//!
//! One buffer shared by every CPU was the limit on a 16-core host: the programs fight over
//! its reservation lock (the return program took 162 ns with one calling process and
//! 4.9 µs with fourteen). With a buffer per group of CPUs, records of different CPUs sit in
//! different buffers; a pass merges them by their timestamp (the first field of every
//! record), so the recording stays in time order as the attribution needs.
//!
//! The merge looks at each buffer's oldest record and hands on the oldest of them. A
//! buffer found empty can still receive records older than another buffer's oldest (a
//! writer took its time before the reader looked, or the reader was preempted on a busy
//! host: CI saw 1.1 ms). An empty buffer therefore has a watermark: the time the pass
//! began, less a margin for writers that took the time but had not yet committed. A record
//! newer than an empty buffer's watermark waits, in its own buffer, for a later pass; the
//! last pass hands on everything.

use std::os::fd::{AsFd as _, AsRawFd as _, FromRawFd as _, OwnedFd};

use aya::Ebpf;
use aya::maps::{MapData, RingBuf};
use nccltrace_common::RING_SHARDS;
use tokio::io::unix::AsyncFd;

use super::{Sink, SourceError, map_error, missing_map};

/// The map names, in shard order.
const NAMES: [&str; RING_SHARDS as usize] = nccltrace_common::names::EVENTS;

/// Ring buffers to use on a host of `cpus` CPUs: the largest power of two up to both.
#[must_use]
pub fn shards_for(cpus: usize) -> u32 {
    let cpus = u32::try_from(cpus.clamp(1, RING_SHARDS as usize)).unwrap_or(1);
    1 << cpus.ilog2()
}

/// Sizes every buffer before load: `total` bytes split between the `shards` in use, the
/// others one page (declared by the programs, never written).
pub fn size(loader: &mut aya::EbpfLoader<'_>, shards: u32, total: u32) {
    for (i, name) in NAMES.iter().enumerate() {
        let bytes = if (i as u32) < shards {
            (total / shards).max(4096)
        } else {
            4096
        };
        loader.map_max_entries(name, bytes);
    }
}

/// The buffers in use, readable as one.
pub struct Rings {
    buffers: Vec<RingBuf<MapData>>,
    /// An epoll instance watching every buffer: readable when the programs wake the reader.
    ready: AsyncFd<OwnedFd>,
    /// Records copied out to be put in order when there are several buffers.
    merge: Merge,
}

/// Where the records of one buffer come from ([`RingBuf`]; a queue in the tests).
trait Queue {
    /// Copies the oldest record into `out` and takes it out; false when there is none.
    fn pop_into(&mut self, out: &mut Vec<u8>) -> bool;
}

impl Queue for RingBuf<MapData> {
    fn pop_into(&mut self, out: &mut Vec<u8>) -> bool {
        let Some(item) = self.next() else {
            return false;
        };
        out.clear();
        out.extend_from_slice(&item);
        true
    }
}

/// Several buffers merged in time order (see the module's text): each buffer's oldest
/// record not yet handed on is copied out (its head), the oldest head goes next. What
/// must wait for a later pass waits in its buffer, so the merge holds one record a buffer
/// whatever the pass: copying a pass's records out to sort them had held up to 16,384
/// records, 3 to 6 MB once a burst had passed through.
#[derive(Default)]
struct Merge {
    heads: Vec<Head>,
}

#[derive(Default)]
struct Head {
    bytes: Vec<u8>,
    /// The head's time; None: no head (its buffer was empty when last looked at).
    ts: Option<u64>,
}

/// How long before a buffer was found empty a writer may have taken its record's time
/// without having committed it yet (the programs run for microseconds).
const COMMIT_SLACK_NS: u64 = 200_000;

impl Merge {
    /// Hands on about `budget` records of `queues` in time order (all of them when it is
    /// `usize::MAX`, the last pass); true when the budget ran out first. A head newer than
    /// an empty buffer's watermark (`now` when it was found empty, less the slack) could
    /// still be preceded by a record that buffer has yet to receive: the pass ends there,
    /// unless it is the last. `now` is CLOCK_MONOTONIC, the records' clock.
    fn drain<Q: Queue>(
        &mut self,
        queues: &mut [Q],
        sink: &mut impl Sink,
        budget: usize,
        mut now: impl FnMut() -> u64,
    ) -> Result<bool, crate::Error> {
        self.heads.resize_with(queues.len(), Head::default);
        let last_pass = budget == usize::MAX;
        // Read before the buffers: a buffer found empty later was empty then too.
        let mut watermark = now().saturating_sub(COMMIT_SLACK_NS);
        let mut looked_again = false;
        for _ in 0..budget {
            let mut lowest_empty = u64::MAX;
            let mut next: Option<(usize, u64)> = None;
            for (i, (queue, head)) in queues.iter_mut().zip(&mut self.heads).enumerate() {
                if head.ts.is_none() {
                    if !queue.pop_into(&mut head.bytes) {
                        lowest_empty = watermark;
                        continue;
                    }
                    head.ts = Some(record_time(&head.bytes));
                }
                let ts = head.ts.unwrap_or_default();
                // Equal times: the lower buffer first, as the stable sort did.
                if next.is_none_or(|(_, t)| ts < t) {
                    next = Some((i, ts));
                }
            }
            let Some((i, ts)) = next else {
                return Ok(false);
            };
            if !last_pass && ts > lowest_empty {
                // The empty buffers looked at once more, with a newer watermark.
                if looked_again {
                    return Ok(false);
                }
                looked_again = true;
                watermark = now().saturating_sub(COMMIT_SLACK_NS);
                continue;
            }
            let head = &mut self.heads[i];
            sink.record(&head.bytes)?;
            head.ts = None;
        }
        Ok(true)
    }
}

/// A record's time: its first field.
fn record_time(record: &[u8]) -> u64 {
    record
        .get(..8)
        .map_or(0, |b| u64::from_le_bytes(b.try_into().unwrap_or_default()))
}

impl Rings {
    /// Takes the first `shards` buffers out of `ebpf`.
    pub fn take(ebpf: &mut Ebpf, shards: u32) -> Result<Rings, SourceError> {
        let mut buffers = Vec::new();
        for name in &NAMES[..shards as usize] {
            let map = ebpf.take_map(name).ok_or_else(|| missing_map(name))?;
            buffers.push(RingBuf::try_from(map).map_err(map_error(name))?);
        }
        // SAFETY: plain syscalls; the returned descriptor is owned from here on.
        let epoll = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if epoll < 0 {
            return Err(SourceError::Drain(std::io::Error::last_os_error()));
        }
        // SAFETY: a fresh descriptor no one else owns.
        let epoll = unsafe { OwnedFd::from_raw_fd(epoll) };
        for ring in &buffers {
            let fd = ring.as_fd().as_raw_fd();
            let mut event = libc::epoll_event {
                events: libc::EPOLLIN as u32,
                u64: 0,
            };
            // SAFETY: both descriptors are open; `event` outlives the call.
            if unsafe {
                libc::epoll_ctl(epoll.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &raw mut event)
            } < 0
            {
                return Err(SourceError::Drain(std::io::Error::last_os_error()));
            }
        }
        // SAFETY: the OwnedFd stays open and unchanged until the AsyncFd owning it drops.
        let ready =
            unsafe { AsyncFd::register_with_interest(epoll, tokio::io::Interest::READABLE) }
                .map_err(|e| SourceError::Drain(e.into()))?;
        Ok(Rings {
            buffers,
            ready,
            merge: Merge::default(),
        })
    }

    /// Waits until the programs wake the reader.
    pub async fn readable(&mut self) -> Result<(), SourceError> {
        let mut guard = self
            .ready
            .readable_mut()
            .await
            .map_err(SourceError::Drain)?;
        // Empty the epoll instance's ready list (the buffers are drained next).
        let mut events = [libc::epoll_event { events: 0, u64: 0 }; 8];
        // SAFETY: the descriptor is open; `events` has room for its length.
        unsafe {
            libc::epoll_wait(
                guard.get_inner().as_raw_fd(),
                events.as_mut_ptr(),
                events.len() as i32,
                0,
            );
        }
        guard.clear_ready();
        Ok(())
    }

    /// Hands at most `budget` records to `sink`, in time order; true when the budget ran
    /// out first. With `budget` `usize::MAX` (the last pass) nothing is held back.
    pub fn drain(&mut self, sink: &mut impl Sink, budget: usize) -> Result<bool, crate::Error> {
        if let [ring] = self.buffers.as_mut_slice() {
            // One buffer: already in order, handed on without a copy.
            for _ in 0..budget {
                let Some(item) = ring.next() else {
                    return Ok(false);
                };
                sink.record(&item)?;
            }
            return Ok(true);
        }
        self.merge.drain(&mut self.buffers, sink, budget, || {
            // The programs stamp records with `bpf_ktime_get_ns`: CLOCK_MONOTONIC.
            crate::host::clock_ns(libc::CLOCK_MONOTONIC)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A power of two of buffers, never more than the CPUs nor than the programs declare.
    #[test]
    fn shard_counts() {
        let got: Vec<u32> = [0, 1, 2, 3, 4, 6, 8, 16, 128]
            .iter()
            .map(|c| shards_for(*c))
            .collect();
        assert_eq!(got, [1, 1, 2, 2, 4, 4, 8, 8, 8]);
    }

    #[derive(Default)]
    struct Times(Vec<u64>);

    impl Sink for Times {
        fn record(&mut self, bytes: &[u8]) -> Result<(), crate::Error> {
            self.0.push(record_time(bytes));
            Ok(())
        }
        fn target_added(&mut self, _: &super::super::TargetInfo) {}
        fn tick(&mut self, _: &std::collections::BTreeMap<String, u64>, _: usize) {}
    }

    /// A buffer's records, oldest first.
    #[derive(Default)]
    struct Fifo(std::collections::VecDeque<Vec<u8>>);

    impl Queue for Fifo {
        fn pop_into(&mut self, out: &mut Vec<u8>) -> bool {
            let Some(r) = self.0.pop_front() else {
                return false;
            };
            *out = r;
            true
        }
    }

    impl Fifo {
        fn write(&mut self, times: &[u64]) {
            for ts in times {
                let mut r = ts.to_le_bytes().to_vec();
                r.extend_from_slice(b"payload");
                self.0.push_back(r);
            }
        }
    }

    /// A record newer than an empty buffer's watermark waits in its buffer for the pass
    /// that can put it in order; the last pass hands on everything.
    #[test]
    fn records_an_empty_buffer_may_still_precede_wait() {
        // Times in the slack's units past it: `at(n)` is n (the clock reads at(n) + slack).
        const S: u64 = COMMIT_SLACK_NS;
        let (mut merge, mut out) = (Merge::default(), Times::default());
        let mut q = [Fifo::default(), Fifo::default()];
        q[0].write(&[10, 30, 40, 50]);
        // Buffer 1, empty at 25 + S, may still receive records from 25 on.
        assert!(!merge.drain(&mut q, &mut out, 100, || 25 + S).unwrap());
        assert_eq!(out.0, [10]);
        // 30 is the head; what follows it is still in its buffer.
        assert_eq!(q[0].0.len(), 2);
        // Written while the first pass ran, older than the head.
        q[1].write(&[26, 60]);
        assert!(!merge.drain(&mut q, &mut out, 100, || 55 + S).unwrap());
        assert_eq!(out.0, [10, 26, 30, 40, 50]);
        q[0].write(&[58]);
        assert!(!merge.drain(&mut q, &mut out, usize::MAX, || 0).unwrap());
        assert_eq!(out.0, [10, 26, 30, 40, 50, 58, 60]);
        assert!(merge.heads.iter().all(|h| h.ts.is_none()));
        assert!(q.iter().all(|q| q.0.is_empty()));
    }

    /// The budget ends a pass with the rest left in the buffers, in order for the next.
    #[test]
    fn a_pass_stops_at_its_budget() {
        let (mut merge, mut out) = (Merge::default(), Times::default());
        let mut q = [Fifo::default(), Fifo::default(), Fifo::default()];
        q[0].write(&[1, 4, 7]);
        q[1].write(&[2, 5, 8]);
        q[2].write(&[3, 6, 9]);
        assert!(merge.drain(&mut q, &mut out, 4, || u64::MAX).unwrap());
        assert_eq!(out.0, [1, 2, 3, 4]);
        assert!(!merge.drain(&mut q, &mut out, 100, || u64::MAX).unwrap());
        assert_eq!(out.0, (1..=9).collect::<Vec<_>>());
    }
}
