//! The PMU's memory sampler opened on the target's threads (`crate::pmu` says which
//! sampler and what the records mean): one perf event and mmap ring per thread, drained
//! by the session's loop into the record stream as `MEM_SAMPLE` records.

use perf_event_open_sys::bindings as sys;

use crate::pmu::{MemSample, MemSampler, SAMPLE_TYPE, parse_records};

/// Data pages of each thread's ring (64 KiB, 1,600 samples of 40 bytes): at most ~5,000
/// samples a second a thread, drained ten times a second.
const DATA_PAGES: usize = 16;

/// Every thread of the processes `pids`, as (thread, process): what [`PerThread`] opens on.
pub fn target_threads(
    host: &crate::host::Host,
    pids: impl IntoIterator<Item = u32>,
) -> Vec<(u32, u32)> {
    pids.into_iter()
        .flat_map(|pid| host.threads(pid).into_iter().map(move |tid| (tid, pid)))
        .collect()
}

/// What perf events opened on each target thread hold (`T`), and which threads were
/// tried, so that threads started later are opened once each (the kernel maps no ring of
/// an inherited per-thread event, and a group read of one covers the thread alone).
pub struct PerThread<T> {
    pub opened: Vec<T>,
    seen: std::collections::BTreeSet<u32>,
    /// Threads started later that the kernel refused.
    pub refused: u64,
}

impl<T> PerThread<T> {
    /// `open` on every thread of `tids` (thread, thread group); a thread that ended
    /// meanwhile is skipped.
    ///
    /// # Errors
    /// The first refusal, naming `what` and, for an event the PMU lacks, `missing`.
    pub fn open_all(
        tids: impl IntoIterator<Item = (u32, u32)>,
        mut open: impl FnMut(u32, u32) -> std::io::Result<T>,
        what: &str,
        missing: &str,
    ) -> Result<PerThread<T>, String> {
        let mut all = PerThread {
            opened: Vec::new(),
            seen: std::collections::BTreeSet::new(),
            refused: 0,
        };
        for (tid, tgid) in tids {
            all.seen.insert(tid);
            match open(tid, tgid) {
                Ok(item) => all.opened.push(item),
                Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {}
                Err(e) => {
                    let hint = match e.raw_os_error() {
                        Some(libc::EACCES | libc::EPERM) => {
                            " (needs CAP_PERFMON, or kernel.perf_event_paranoid ≤ 1)".to_owned()
                        }
                        Some(libc::ENOENT | libc::EOPNOTSUPP | libc::EINVAL) => {
                            format!(" ({missing})")
                        }
                        _ => String::new(),
                    };
                    return Err(format!(
                        "the kernel refused {what} on thread {tid}: {e}{hint}"
                    ));
                }
            }
        }
        Ok(all)
    }

    /// `open` on the threads of `tids` not tried before (started since).
    pub fn follow(
        &mut self,
        tids: impl IntoIterator<Item = (u32, u32)>,
        mut open: impl FnMut(u32, u32) -> std::io::Result<T>,
    ) {
        for (tid, tgid) in tids {
            if !self.seen.insert(tid) {
                continue;
            }
            match open(tid, tgid) {
                Ok(item) => self.opened.push(item),
                Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {}
                Err(_) => self.refused += 1,
            }
        }
    }
}

/// Sampling of the target's loads: one perf event and ring per thread, threads started
/// later added by [`Sampling::follow`].
pub struct Sampling {
    pub sampler: MemSampler,
    rings: PerThread<Ring>,
    /// Samples the kernel dropped on full rings, and rings whose records were damaged.
    pub lost: u64,
    pub damaged: u64,
}

struct Ring {
    fd: std::os::fd::OwnedFd,
    base: std::ptr::NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping belongs to the ring alone and is only touched through `&mut self`.
unsafe impl Send for Ring {}

impl Drop for Ring {
    fn drop(&mut self) {
        // SAFETY: `base`/`len` are the mapping made in `open_thread`, unmapped once.
        unsafe {
            libc::munmap(self.base.as_ptr().cast(), self.len);
        }
        let _ = &self.fd;
    }
}

impl Sampling {
    /// Opens `sampler` on every thread of `tids`.
    ///
    /// # Errors
    /// Why the kernel refused it (permissions, an event the CPU lacks), for the method.
    pub fn open(sampler: MemSampler, tids: &[(u32, u32)]) -> Result<Sampling, String> {
        let rings = PerThread::open_all(
            tids.iter().copied(),
            |tid, _| open_thread(&sampler, tid),
            &sampler.describe(),
            "the PMU does not offer this event with these sample fields",
        )?;
        Ok(Sampling {
            sampler,
            rings,
            lost: 0,
            damaged: 0,
        })
    }
}

fn open_thread(sampler: &MemSampler, tid: u32) -> std::io::Result<Ring> {
    use std::os::fd::{AsRawFd as _, FromRawFd as _};
    let mut attr = sys::perf_event_attr {
        type_: sampler.pmu_type,
        size: u32::try_from(std::mem::size_of::<sys::perf_event_attr>()).unwrap_or(0),
        config: sampler.config,
        sample_type: SAMPLE_TYPE,
        clockid: libc::CLOCK_MONOTONIC,
        ..sys::perf_event_attr::default()
    };
    attr.__bindgen_anon_1.sample_period = sampler.period;
    attr.__bindgen_anon_3.config1 = sampler.config1;
    attr.__bindgen_anon_2.wakeup_events = 0;
    attr.set_exclude_kernel(1);
    attr.set_exclude_hv(1);
    attr.set_use_clockid(1);
    attr.set_precise_ip(u64::from(sampler.precise_ip));
    let pid =
        libc::pid_t::try_from(tid).map_err(|_| std::io::Error::from_raw_os_error(libc::ESRCH))?;
    // SAFETY: `attr` is a valid, fully initialised perf_event_attr of its own size.
    let fd = unsafe {
        perf_event_open_sys::perf_event_open(
            &raw mut attr,
            pid,
            -1,
            -1,
            libc::c_ulong::from(sys::PERF_FLAG_FD_CLOEXEC),
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a new descriptor the kernel just gave us, owned from here.
    let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
    let page = 4096;
    let len = page * (1 + DATA_PAGES);
    // SAFETY: a shared read/write mapping of the event's ring, as perf_event_open(2) says.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            0,
        )
    };
    if base == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    let base =
        std::ptr::NonNull::new(base.cast::<u8>()).ok_or_else(std::io::Error::last_os_error)?;
    Ok(Ring { fd, base, len })
}

impl Sampling {
    /// Opens the sampler on the threads of `tids` not seen before (started since).
    pub fn follow(&mut self, tids: impl IntoIterator<Item = (u32, u32)>) {
        let sampler = &self.sampler;
        self.rings.follow(tids, |tid, _| open_thread(sampler, tid));
    }

    /// Threads started later that the kernel refused.
    #[must_use]
    pub fn refused(&self) -> u64 {
        self.rings.refused
    }

    /// Threads sampled.
    #[must_use]
    pub fn threads(&self) -> usize {
        self.rings.opened.len()
    }

    /// Takes every sample the rings hold.
    pub fn drain(&mut self, out: &mut Vec<MemSample>) {
        for ring in &mut self.rings.opened {
            let records = parse_records(&ring.take());
            out.extend(records.samples);
            self.lost += records.lost;
            self.damaged += u64::from(records.damaged);
        }
    }
}

impl Ring {
    /// The bytes between the reader's tail and the kernel's head, in order, and the tail
    /// moved past them.
    fn take(&mut self) -> Vec<u8> {
        // The mapping is page-aligned, so the header page is aligned for its struct.
        #[expect(
            clippy::cast_ptr_alignment,
            reason = "mmap returns a page-aligned address"
        )]
        let page = self.base.as_ptr().cast::<sys::perf_event_mmap_page>();
        // SAFETY: the first page of the mapping is the kernel's perf_event_mmap_page; the
        // head is read before the data (acquire) and the tail written after (release), as
        // perf_event_open(2) prescribes.
        unsafe {
            let head = std::ptr::read_volatile(&raw const (*page).data_head);
            std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
            let tail = std::ptr::read_volatile(&raw const (*page).data_tail);
            let (offset, size) = ((*page).data_offset as usize, (*page).data_size as usize);
            let data = self.base.as_ptr().add(offset);
            let mut out = Vec::with_capacity(head.saturating_sub(tail) as usize);
            let mut at = tail;
            while at < head && size > 0 {
                let i = (at % size as u64) as usize;
                let n = (size - i).min((head - at) as usize);
                out.extend_from_slice(std::slice::from_raw_parts(data.add(i), n));
                at += n as u64;
            }
            std::sync::atomic::fence(std::sync::atomic::Ordering::Release);
            std::ptr::write_volatile(&raw mut (*page).data_tail, head);
            out
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A thread that sends its id and spins until `stop`.
    fn spinner(
        stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
        tx: std::sync::mpsc::Sender<u32>,
    ) -> std::thread::JoinHandle<()> {
        std::thread::spawn(move || {
            // SAFETY: gettid has no preconditions.
            tx.send(unsafe { libc::gettid() } as u32).unwrap();
            let mut x = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
            }
        })
    }

    /// The live path on the real kernel, with the software cpu-clock event standing in
    /// for the PMU's sampler (no machine here has one): opened on a thread of this
    /// process, its ring drained, each record read with the memory sampler's layout —
    /// the thread, a CLOCK_MONOTONIC time inside the run, and a data source the kernel
    /// marks not available (so no load is counted).
    #[test]
    #[ignore = "needs root (or kernel.perf_event_paranoid <= 2): cargo xtask test"]
    fn rings_drained_on_the_real_kernel() {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (tx, rx) = std::sync::mpsc::channel();
        let spinning = spinner(stop.clone(), tx.clone());
        let first = rx.recv().unwrap();
        let software = MemSampler {
            pmu: "software".into(),
            pmu_type: sys::PERF_TYPE_SOFTWARE,
            config: u64::from(sys::PERF_COUNT_SW_CPU_CLOCK),
            config1: 0,
            // Every 100 µs of the thread's CPU time.
            period: 100_000,
            precise_ip: 0,
        };
        let before = crate::host::clock_ns(libc::CLOCK_MONOTONIC);
        let mut sampling = Sampling::open(software, &[(first, 0)]).unwrap();
        assert_eq!(sampling.threads(), 1);
        // A thread started later: `follow` adds it, once.
        let later = spinner(stop.clone(), tx);
        let second = rx.recv().unwrap();
        sampling.follow([(first, 0), (second, 0)]);
        sampling.follow([(second, 0)]);
        assert_eq!((sampling.threads(), sampling.refused()), (2, 0));
        let mut samples = Vec::new();
        for _ in 0..20 {
            std::thread::sleep(std::time::Duration::from_millis(10));
            sampling.drain(&mut samples);
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        spinning.join().unwrap();
        later.join().unwrap();
        let after = crate::host::clock_ns(libc::CLOCK_MONOTONIC);
        // ~200 ms spinning at one sample per 100 µs: hundreds; at least some.
        assert!(samples.len() >= 50, "{} samples", samples.len());
        assert_eq!((sampling.lost, sampling.damaged), (0, 0));
        for tid in [first, second] {
            assert!(
                samples.iter().filter(|s| s.tid == tid).count() >= 20,
                "thread {tid}"
            );
        }
        for s in &samples {
            assert_eq!(s.pid, std::process::id());
            assert!(
                (before..=after).contains(&s.time_ns),
                "{} not in {before}..{after}",
                s.time_ns
            );
            assert_eq!(crate::pmu::served(s.data_src), None, "{:#x}", s.data_src);
        }
        // A thread that does not exist is skipped, not an error; a refused event is.
        let none = Sampling::open(
            MemSampler {
                pmu_type: sys::PERF_TYPE_SOFTWARE,
                period: 100_000,
                ..sampling.sampler.clone()
            },
            &[(2_000_000_000, 0)],
        )
        .unwrap();
        assert_eq!(none.threads(), 0);
        let bogus = MemSampler {
            pmu_type: 0x7fff_0000,
            ..sampling.sampler.clone()
        };
        // SAFETY: gettid has no preconditions.
        let this = unsafe { libc::gettid() } as u32;
        let why = Sampling::open(bogus, &[(this, 0)]).err().unwrap();
        assert!(why.contains("the kernel refused"), "{why}");
    }
}
