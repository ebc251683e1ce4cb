//! The PMU's node-load counters on the target's threads, where it counts loads by the
//! node that served them but samples none (`crate::pmu` has the sampler): per thread a
//! group of two counting events, `node-loads` (user loads DRAM served, any node's) and
//! `node-load-misses` (those a remote node's DRAM served), read together by the session's
//! loop at every drain and handed on as `NODE_LOADS` records. Attribution interpolates
//! them at each step's ends (`attribute::remote::counted`).

use std::os::fd::{AsRawFd, FromRawFd as _, OwnedFd};

use perf_event_open_sys::bindings as sys;

/// Which two events count a thread's DRAM loads and its remote ones.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeEvents {
    pub type_: u32,
    pub dram: u64,
    pub remote: u64,
    /// For the header and the methods.
    pub description: String,
}

/// `NCCLTRACE_NODE_COUNTERS=software-faults` puts two software events in their place, on
/// the same code path: the thread's user page faults for its DRAM loads and its minor
/// faults for its remote ones. For the tests (no machine here has a PMU): the counts are
/// then checked against the fault tracepoint's.
pub const STAND_IN_ENV: &str = "NCCLTRACE_NODE_COUNTERS";

impl NodeEvents {
    /// perf's generic `node-loads` and `node-load-misses` (on Intel, demand reads served
    /// by any DRAM, and by a remote node's), or the software stand-in the environment asks
    /// for.
    ///
    /// # Errors
    /// An unknown stand-in name.
    pub fn chosen() -> Result<NodeEvents, String> {
        Self::chosen_from(std::env::var(STAND_IN_ENV).ok().as_deref())
    }

    fn chosen_from(stand_in: Option<&str>) -> Result<NodeEvents, String> {
        match stand_in {
            None | Some("" | "pmu") => {
                let cache = |result: u32| {
                    u64::from(sys::PERF_COUNT_HW_CACHE_NODE)
                        | u64::from(sys::PERF_COUNT_HW_CACHE_OP_READ) << 8
                        | u64::from(result) << 16
                };
                Ok(NodeEvents {
                    type_: sys::PERF_TYPE_HW_CACHE,
                    dram: cache(sys::PERF_COUNT_HW_CACHE_RESULT_ACCESS),
                    remote: cache(sys::PERF_COUNT_HW_CACHE_RESULT_MISS),
                    description: "the PMU's node-loads and node-load-misses counters, per \
                                  thread, user mode"
                        .to_owned(),
                })
            }
            Some("software-faults") => Ok(NodeEvents {
                type_: sys::PERF_TYPE_SOFTWARE,
                dram: u64::from(sys::PERF_COUNT_SW_PAGE_FAULTS),
                remote: u64::from(sys::PERF_COUNT_SW_PAGE_FAULTS_MIN),
                description: format!(
                    "a software stand-in ({STAND_IN_ENV}=software-faults: page faults for \
                     DRAM loads, minor faults for remote ones), per thread, user mode"
                ),
            }),
            Some(other) => Err(format!(
                "{STAND_IN_ENV}={other} is not a known stand-in (\"software-faults\", or unset \
                 for the PMU's node-load counters)"
            )),
        }
    }
}

/// One thread's counters: the group's leader counts DRAM loads, its member remote ones.
struct Counter {
    tid: u32,
    tgid: u32,
    leader: OwnedFd,
    _member: OwnedFd,
    held: Held,
}

/// What of a thread's readings is written: a reading whose counts moved, and the last
/// still one before it (so that the interpolation starts where they started moving);
/// every reading of a full one. A reading not written means "unchanged since the last".
#[derive(Clone, Copy, Debug, Default)]
struct Held {
    last: Option<(u64, Reading)>,
    written: bool,
}

impl Held {
    fn next(&mut self, at: u64, reading: Reading, full: bool, out: &mut Vec<(u64, Reading)>) {
        let moved = self
            .last
            .is_none_or(|(_, l)| (l.dram, l.remote) != (reading.dram, reading.remote));
        if moved
            && !self.written
            && let Some(still) = self.last
        {
            out.push(still);
        }
        self.written = moved || full;
        if self.written {
            out.push((at, reading));
        }
        self.last = Some((at, reading));
    }
}

/// A reading of one thread's counters, scaled for multiplexing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reading {
    pub tid: u32,
    pub tgid: u32,
    pub dram: u64,
    pub remote: u64,
    pub enabled_ns: u64,
    pub running_ns: u64,
}

/// The node-load counters of the target's threads.
pub struct Counting {
    pub events: NodeEvents,
    counters: super::pmu::PerThread<Counter>,
}

impl Counting {
    /// Opens the counters on every thread of `tids` (thread, thread group).
    ///
    /// # Errors
    /// Why the kernel refused them (no PMU, an event the CPU lacks, permissions).
    pub fn open(events: NodeEvents, tids: &[(u32, u32)]) -> Result<Counting, String> {
        let counters = super::pmu::PerThread::open_all(
            tids.iter().copied(),
            |tid, tgid| open_thread(&events, tid, tgid),
            &events.description,
            "no PMU, or one that does not count loads by node: most VMs have none",
        )?;
        Ok(Counting { events, counters })
    }

    /// Threads started later that the kernel refused.
    #[must_use]
    pub fn refused(&self) -> u64 {
        self.counters.refused
    }

    /// Opens the counters on the threads of `tids` not seen before (started since).
    pub fn follow(&mut self, tids: impl IntoIterator<Item = (u32, u32)>) {
        let events = &self.events;
        self.counters
            .follow(tids, |tid, tgid| open_thread(events, tid, tgid));
    }

    /// Threads counted.
    #[must_use]
    pub fn threads(&self) -> usize {
        self.counters.opened.len()
    }

    /// Every thread's counts at `at`, each with the time it stands for: those that moved
    /// (`full`: all). A thread that exited keeps its final counts; one whose counters
    /// cannot be read is left out of this reading.
    pub fn read(&mut self, at: u64, full: bool, out: &mut Vec<(u64, Reading)>) {
        for c in &mut self.counters.opened {
            // nr, time enabled, time running, then one value per event of the group.
            let mut words = [0u64; 5];
            // SAFETY: reads at most the buffer's size into it.
            let n = unsafe {
                libc::read(
                    c.leader.as_raw_fd(),
                    words.as_mut_ptr().cast(),
                    std::mem::size_of_val(&words),
                )
            };
            if n < 40 || words[0] != 2 {
                continue;
            }
            let (enabled, running) = (words[1], words[2]);
            let scale = |v: u64| {
                if running == 0 || running >= enabled {
                    v
                } else {
                    u64::try_from(u128::from(v) * u128::from(enabled) / u128::from(running))
                        .unwrap_or(u64::MAX)
                }
            };
            let reading = Reading {
                tid: c.tid,
                tgid: c.tgid,
                dram: scale(words[3]),
                remote: scale(words[4]),
                enabled_ns: enabled,
                running_ns: running,
            };
            c.held.next(at, reading, full, out);
        }
    }
}

fn open_thread(events: &NodeEvents, tid: u32, process: u32) -> std::io::Result<Counter> {
    let pid =
        libc::pid_t::try_from(tid).map_err(|_| std::io::Error::from_raw_os_error(libc::ESRCH))?;
    // Counting from 0 as of now: the reading the first one interpolates from (steps
    // under way between the open and the first read included).
    let opened = crate::host::clock_ns(libc::CLOCK_MONOTONIC);
    let leader = open_event(events, events.dram, pid, None)?;
    let member = open_event(events, events.remote, pid, Some(&leader))?;
    let zero = Reading {
        tid,
        tgid: process,
        dram: 0,
        remote: 0,
        enabled_ns: 0,
        running_ns: 0,
    };
    Ok(Counter {
        tid,
        tgid: process,
        leader,
        _member: member,
        held: Held {
            last: Some((opened, zero)),
            written: false,
        },
    })
}

fn open_event(
    events: &NodeEvents,
    config: u64,
    pid: libc::pid_t,
    leader: Option<&OwnedFd>,
) -> std::io::Result<OwnedFd> {
    let mut attr = sys::perf_event_attr {
        type_: events.type_,
        size: u32::try_from(std::mem::size_of::<sys::perf_event_attr>()).unwrap_or(0),
        config,
        read_format: u64::from(
            sys::PERF_FORMAT_GROUP
                | sys::PERF_FORMAT_TOTAL_TIME_ENABLED
                | sys::PERF_FORMAT_TOTAL_TIME_RUNNING,
        ),
        ..sys::perf_event_attr::default()
    };
    attr.set_exclude_kernel(1);
    attr.set_exclude_hv(1);
    let group = leader.map_or(-1, AsRawFd::as_raw_fd);
    // SAFETY: `attr` is a valid, fully initialised perf_event_attr of its own size.
    let fd = unsafe {
        perf_event_open_sys::perf_event_open(
            &raw mut attr,
            pid,
            -1,
            group,
            libc::c_ulong::from(sys::PERF_FLAG_FD_CLOEXEC),
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a new descriptor the kernel just gave us, owned from here.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The live path on the real kernel with the software stand-in: a thread of this
    /// process counted, and its page faults (touching fresh pages) seen by the counters.
    #[test]
    #[ignore = "needs root (or kernel.perf_event_paranoid <= 2): cargo xtask test"]
    fn counters_read_on_the_real_kernel() {
        let events = NodeEvents {
            type_: sys::PERF_TYPE_SOFTWARE,
            dram: u64::from(sys::PERF_COUNT_SW_PAGE_FAULTS),
            remote: u64::from(sys::PERF_COUNT_SW_PAGE_FAULTS_MIN),
            description: "software stand-in".into(),
        };
        let (tx, rx) = std::sync::mpsc::channel();
        let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
        let worker = std::thread::spawn(move || {
            // SAFETY: gettid has no preconditions.
            tx.send(unsafe { libc::gettid() } as u32).unwrap();
            go_rx.recv().unwrap();
            // 256 fresh pages, each touched once: a minor fault each (no huge page,
            // which would fault 512 at once: a run with THP counted 249).
            let len = 256 * 4096;
            // SAFETY: a fresh private anonymous mapping, written within its length and
            // unmapped once.
            unsafe {
                let base = libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                );
                assert_ne!(base, libc::MAP_FAILED);
                libc::madvise(base, len, libc::MADV_NOHUGEPAGE);
                for page in 0..256 {
                    std::ptr::write_volatile(base.cast::<u8>().add(page * 4096), 1);
                }
                libc::munmap(base, len);
            }
        });
        let tid = rx.recv().unwrap();
        let mut counting = Counting::open(events, &[(tid, std::process::id())]).unwrap();
        assert_eq!(counting.threads(), 1);
        let mut readings = Vec::new();
        counting.read(1, true, &mut readings);
        assert_eq!(
            readings.last().map(|r| r.0),
            Some(1),
            "a full reading writes it"
        );
        go_tx.send(()).unwrap();
        worker.join().unwrap();
        readings.clear();
        counting.read(2, false, &mut readings);
        let (at, r) = readings[0];
        assert_eq!(at, 2);
        assert_eq!((r.tid, r.tgid), (tid, std::process::id()));
        assert!(r.dram >= 256, "{r:?}");
        assert!(r.remote >= 256 && r.remote <= r.dram, "{r:?}");
        assert!(r.enabled_ns > 0 && r.running_ns > 0, "{r:?}");
    }

    #[test]
    fn still_readings_are_written_where_the_counts_move_again() {
        let reading = |dram| Reading {
            tid: 1,
            tgid: 1,
            dram,
            remote: 0,
            enabled_ns: 0,
            running_ns: 0,
        };
        let mut held = Held::default();
        let mut out = Vec::new();
        // Written: the first; still at 20 and 30 (not written); moved at 40: the still
        // reading at 30, then 40; still at 50; a full reading at 60 writes it anyway.
        for (at, dram, full) in [
            (10, 5, false),
            (20, 5, false),
            (30, 5, false),
            (40, 9, false),
            (50, 9, false),
            (60, 9, true),
            (70, 9, false),
        ] {
            held.next(at, reading(dram), full, &mut out);
        }
        let written: Vec<(u64, u64)> = out.iter().map(|(at, r)| (*at, r.dram)).collect();
        assert_eq!(written, [(10, 5), (30, 5), (40, 9), (60, 9)]);
    }

    #[test]
    fn an_unknown_stand_in_is_named() {
        let err = NodeEvents::chosen_from(Some("bogus")).unwrap_err();
        assert!(
            err.contains("bogus") && err.contains("software-faults"),
            "{err}"
        );
        assert_eq!(
            NodeEvents::chosen_from(None).unwrap().type_,
            sys::PERF_TYPE_HW_CACHE
        );
    }
}
