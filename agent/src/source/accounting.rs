//! The kernel's accounting of the programs' run time (`BPF_ENABLE_STATS`), on for part of
//! each second.
//!
//! While it is on, every eBPF program run on the host (the agent's and any other tool's)
//! reads the scheduler clock twice more: ~100 ns a traced call on a KVM guest, whose
//! scheduler clock is the paravirtual one (docs/benchmarks.md). So the agent keeps it on
//! for a window of each second (profile `[cost] bpf_stats_ms`, 100 by default) and scales
//! what the kernel counted to the whole run: the runs and run time in `summary.json`
//! `agent.bpf` are then estimates (the call programs' runs excepted, which are the
//! recording's calls), and `accounted_share` says over what share of the run they were
//! counted. The first window is from the loading to the first second's tick (a run shorter
//! than that is counted whole); the trap calibration (`traps`) runs outside the windows.

use std::os::fd::OwnedFd;

use aya::maps::{Array, MapData};

use crate::host;

/// Whether the kernel is accounting, since when, and for how long it did.
pub struct Accounting {
    /// Held open while on (the kernel counts while any such descriptor is open).
    fd: Option<OwnedFd>,
    /// CLOCK_MONOTONIC when the open window began, and when it is to close (`None`: the
    /// first, at the first second's tick).
    since_ns: u64,
    until_ns: Option<u64>,
    /// Closed windows' time since the start.
    closed_ns: u64,
    /// How long a window lasts (ns); `None`: never closed (on for the whole run).
    window_ns: Option<u64>,
    /// Whether this second's window was opened.
    opened_this_second: bool,
    /// Why the kernel does not account at all (the first enable was refused).
    pub refused: Option<String>,
    /// The programs' switch (`names::TIMING`): they time their runs for traced threads
    /// while it is set, as the kernel accounts; they count them always.
    timing: Array<MapData, u32>,
}

/// How much before its end a window may close, at the tick closest to it.
const TICK_SLACK_NS: u64 = 50_000_000;

/// When in each second the window opens, after the agent's once-a-second work.
const WINDOW_AT: std::time::Duration = std::time::Duration::from_millis(400);

impl Accounting {
    /// Turns the accounting on (before any probe is attached) for windows of `ms_a_second`
    /// each second (1000 or more: always on), the programs' `timing` switch with it.
    pub fn start(ms_a_second: u32, timing: Array<MapData, u32>) -> Accounting {
        let window_ns = (ms_a_second < 1000).then(|| u64::from(ms_a_second) * 1_000_000);
        let enabled = if ms_a_second == 0 {
            Err("turned off by the profile ([cost] bpf_stats_ms = 0)".to_owned())
        } else {
            enable()
        };
        let mut accounting = match enabled {
            Ok(fd) => Accounting {
                fd: Some(fd),
                since_ns: now(),
                until_ns: None,
                closed_ns: 0,
                window_ns,
                opened_this_second: true,
                refused: None,
                timing,
            },
            Err(why) => Accounting {
                fd: None,
                since_ns: 0,
                until_ns: None,
                closed_ns: 0,
                window_ns,
                opened_this_second: true,
                refused: Some(why),
                timing,
            },
        };
        accounting.switch_timing();
        accounting
    }

    /// Sets the programs' timing switch to whether the kernel accounts now. A failed
    /// write leaves the programs timing as before: the scaled figures stay right.
    fn switch_timing(&mut self) {
        let on = u32::from(self.is_on());
        if let Err(e) = self.timing.set(0, on, 0) {
            log::warn!("cannot switch the programs' self-timing to {on}: {e}");
        }
    }

    /// Whether the kernel accounts the programs at all in this run.
    pub fn available(&self) -> bool {
        self.refused.is_none()
    }

    /// Whether it is accounting now.
    fn is_on(&self) -> bool {
        self.fd.is_some()
    }

    /// At each 100-ms tick, `into_second` after the agent's once-a-second work: closes a
    /// window that has lasted its time, and opens the second's window `WINDOW_AT` into
    /// it (one attempt a second). Not next to that work: on a host with few CPUs the agent's reading of every
    /// program and /proc file preempts the traced threads inside the programs, and the
    /// kernel counts the time they wait as the programs' (measured: 500–900 ns a run
    /// there, 220–350 elsewhere in the second).
    pub fn tick(&mut self, into_second: std::time::Duration) {
        let Some(window) = self.window_ns else {
            return;
        };
        if self.is_on() {
            // Half a tick early rather than a tick late: the window is checked every ~100 ms.
            if self
                .until_ns
                .is_some_and(|until| now() + TICK_SLACK_NS >= until)
            {
                self.close();
            }
        } else if !self.opened_this_second && into_second >= WINDOW_AT {
            // One attempt a second: a refusal is logged once, not at every tick.
            self.open(window);
            self.opened_this_second = true;
        }
    }

    /// At the agent's once-a-second work: the first window (the attach and the first
    /// second of tracing, all of a short run) closes; the next may open.
    pub fn new_second(&mut self) {
        if self.until_ns.is_none() {
            self.pause();
        }
        self.opened_this_second = false;
    }

    /// Opens a window for `window_ns`, if none is open.
    fn open(&mut self, window_ns: u64) {
        if !self.available() || self.is_on() {
            return;
        }
        match enable() {
            Ok(fd) => {
                self.fd = Some(fd);
                self.since_ns = now();
                self.until_ns = Some(self.since_ns + window_ns);
                self.switch_timing();
            }
            // Counted in no window: the scaled figures stay right, from fewer windows.
            Err(why) => log::warn!("{why}"),
        }
    }

    /// Where the kernel counts in windows, closes the open one: the first at the first
    /// second's tick, and any before the trap calibration, so that the traps are timed as
    /// most of the job's calls pay them (an open window adds two clock reads to every run,
    /// ~70 ns a trap here) and the calibration's runs are not counted. Always on, they are
    /// counted, and left out by the caller.
    pub fn pause(&mut self) {
        if self.window_ns.is_some() {
            self.close();
            // Not the first window any more.
            self.until_ns.get_or_insert(self.since_ns);
        }
    }

    /// Closes the open window.
    fn close(&mut self) {
        if self.fd.take().is_some() {
            self.closed_ns += now().saturating_sub(self.since_ns);
            self.switch_timing();
        }
    }

    /// The time accounted since the start, the open window's so far included.
    pub fn accounted_ns(&self) -> u64 {
        let open = if self.is_on() {
            now().saturating_sub(self.since_ns)
        } else {
            0
        };
        self.closed_ns + open
    }
}

impl std::fmt::Debug for Accounting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Accounting")
            .field("on", &self.is_on())
            .field("accounted_ns", &self.accounted_ns())
            .field("refused", &self.refused)
            .finish_non_exhaustive()
    }
}

fn now() -> u64 {
    host::clock_ns(libc::CLOCK_MONOTONIC)
}

fn enable() -> Result<OwnedFd, String> {
    aya::sys::enable_stats(aya::sys::Stats::RunTime).map_err(|e| {
        format!(
            "the kernel refused to account the programs' run time (BPF_ENABLE_STATS: {e}; \
             it needs Linux 5.8 and CAP_SYS_ADMIN)"
        )
    })
}
