//! The ring buffers the programs write to, one per group of CPUs (`EVENTS_0`…), drained
//! together: each pass takes what every buffer holds and hands it on in time order.
//!
//! One buffer shared by every CPU was the limit on a 16-core host: the programs fight over
//! its reservation lock (the return program took 162 ns with one calling process and
//! 4.9 µs with fourteen). With a buffer per group of CPUs, records of different CPUs sit in
//! different buffers; a pass merges them by their timestamp (the first field of every
//! record), so the recording stays in time order as the attribution needs.
//!
//! A pass reads the buffers one after the other, so a buffer read early can still receive
//! records older than the newest of a buffer read later (the pass was slow, or preempted
//! on a busy host: CI saw 1.1 ms). Each buffer therefore has a watermark: the time before
//! it was read (less a margin for writers that took the time but had not yet committed)
//! when it was read to the end, else the time of the last record taken from it. A pass
//! hands on what is no newer than the lowest watermark and holds the rest for the next
//! pass; the last pass hands on everything.

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

/// Records of several buffers put in time order across passes (see the module's text).
#[derive(Default)]
struct Merge {
    /// This pass's records, the held ones first: (time, start in `bytes`, length).
    bytes: Vec<u8>,
    index: Vec<(u64, usize, usize)>,
    /// Records newer than a pass's watermark, handed on by a later pass.
    held_bytes: Vec<u8>,
    held_index: Vec<(u64, usize, usize)>,
}

/// How long before a buffer was found empty a writer may have taken its record's time
/// without having committed it yet (the programs run for microseconds).
const COMMIT_SLACK_NS: u64 = 200_000;

impl Merge {
    /// Starts a pass with the records the last one held.
    fn start(&mut self) {
        self.bytes.clear();
        self.index.clear();
        std::mem::swap(&mut self.bytes, &mut self.held_bytes);
        std::mem::swap(&mut self.index, &mut self.held_index);
    }

    fn push(&mut self, item: &[u8]) -> u64 {
        let ts = item
            .get(..8)
            .map_or(0, |b| u64::from_le_bytes(b.try_into().unwrap_or_default()));
        self.index.push((ts, self.bytes.len(), item.len()));
        self.bytes.extend_from_slice(item);
        ts
    }

    /// Hands on, in time order, the records no newer than `watermark` (all of them when
    /// `None`) and holds the others.
    fn finish(&mut self, watermark: Option<u64>, sink: &mut impl Sink) -> Result<(), crate::Error> {
        // Stable: records of one buffer with equal times keep their order.
        self.index.sort_by_key(|(ts, _, _)| *ts);
        let ready = watermark.map_or(self.index.len(), |w| {
            self.index.partition_point(|(ts, _, _)| *ts <= w)
        });
        for &(_, start, len) in &self.index[..ready] {
            sink.record(&self.bytes[start..start + len])?;
        }
        self.held_bytes.clear();
        self.held_index.clear();
        for &(ts, start, len) in &self.index[ready..] {
            self.held_index.push((ts, self.held_bytes.len(), len));
            self.held_bytes
                .extend_from_slice(&self.bytes[start..start + len]);
        }
        Ok(())
    }
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

    /// Hands at most about `budget` records to `sink`, in time order; true when a buffer
    /// had more than its share left. With `budget` `usize::MAX` (the last pass) nothing is
    /// held back.
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
        let share = (budget / self.buffers.len()).max(1);
        let mut more = false;
        let mut watermark = u64::MAX;
        self.merge.start();
        for ring in &mut self.buffers {
            // The programs stamp records with `bpf_ktime_get_ns`: CLOCK_MONOTONIC.
            let before =
                crate::host::clock_ns(libc::CLOCK_MONOTONIC).saturating_sub(COMMIT_SLACK_NS);
            let (mut taken, mut last) = (0, 0);
            while taken < share {
                let Some(item) = ring.next() else { break };
                last = self.merge.push(&item);
                taken += 1;
            }
            let full = taken == share;
            more |= full;
            watermark = watermark.min(if full { last } else { before });
        }
        let last_pass = budget == usize::MAX;
        self.merge.finish((!last_pass).then_some(watermark), sink)?;
        Ok(more)
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
            self.0
                .push(u64::from_le_bytes(bytes[..8].try_into().unwrap()));
            Ok(())
        }
        fn target_added(&mut self, _: &super::super::TargetInfo) {}
        fn tick(&mut self, _: &std::collections::BTreeMap<String, u64>, _: usize) {}
    }

    fn record(ts: u64) -> Vec<u8> {
        let mut r = ts.to_le_bytes().to_vec();
        r.extend_from_slice(b"payload");
        r
    }

    /// Records newer than the watermark wait for the pass that can put them in order;
    /// the last pass hands on everything.
    #[test]
    fn passes_hold_what_a_slower_buffer_may_still_precede() {
        let (mut merge, mut out) = (Merge::default(), Times::default());
        merge.start();
        for ts in [10, 30, 20, 50] {
            merge.push(&record(ts));
        }
        merge.finish(Some(25), &mut out).unwrap();
        assert_eq!(out.0, [10, 20]);
        // Written while the first pass ran, older than what it held.
        merge.start();
        for ts in [26, 60] {
            merge.push(&record(ts));
        }
        merge.finish(Some(55), &mut out).unwrap();
        assert_eq!(out.0, [10, 20, 26, 30, 50]);
        merge.start();
        merge.push(&record(58));
        merge.finish(None, &mut out).unwrap();
        assert_eq!(out.0, [10, 20, 26, 30, 50, 58, 60]);
        assert!(merge.held_index.is_empty() && merge.held_bytes.is_empty());
    }
}
