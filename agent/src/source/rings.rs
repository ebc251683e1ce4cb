//! The ring buffers the programs write to, one per group of CPUs (`EVENTS_0`…), drained
//! together: each pass takes what every buffer holds and hands it on in time order.
//!
//! One buffer shared by every CPU was the limit on a 16-core host: the programs fight over
//! its reservation lock (the return program took 162 ns with one calling process and
//! 4.9 µs with fourteen). With a buffer per group of CPUs, records of different CPUs sit in
//! different buffers; a pass merges them by their timestamp (the first field of every
//! record), so the recording stays in time order as the attribution needs. What a pass can
//! leave out of order is what was written while it ran, the same sub-millisecond slack a
//! single buffer has (its writers take the time after reserving space).

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
    /// One pass's records (copied out to be put in order when there are several buffers).
    bytes: Vec<u8>,
    index: Vec<(u64, usize, usize)>,
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
            bytes: Vec::new(),
            index: Vec::new(),
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
    /// had more than its share left.
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
        self.bytes.clear();
        self.index.clear();
        for ring in &mut self.buffers {
            let mut taken = 0;
            while taken < share {
                let Some(item) = ring.next() else { break };
                let ts = item
                    .get(..8)
                    .map_or(0, |b| u64::from_le_bytes(b.try_into().unwrap_or_default()));
                self.index.push((ts, self.bytes.len(), item.len()));
                self.bytes.extend_from_slice(&item);
                taken += 1;
            }
            more |= taken == share;
        }
        // Stable: records of one buffer with equal times keep their order.
        self.index.sort_by_key(|(ts, _, _)| *ts);
        for &(_, start, len) in &self.index {
            sink.record(&self.bytes[start..start + len])?;
        }
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
}
