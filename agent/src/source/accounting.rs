//! The programs' accounting of their own runs (`PROGRAM_COSTS`), on for part of each
//! second.
//!
//! Each program counts and times its runs while the `TIMING` switch (a map value) is set:
//! two clock reads and two per-CPU adds a run. So the agent sets it for a window of each
//! second (profile `[cost] timing_ms`, 100 by default) and scales what the programs counted
//! to the whole run: the runs and run time in `summary.json` `agent.bpf` are then estimates
//! (the call programs' runs excepted, which are the recording's calls), and
//! `accounted_share` says over what share of the run they were counted. The first window
//! is from the loading to the first second's tick (a run shorter than that is counted
//! whole); the trap calibration (`traps`) runs outside the windows.
//!
//! The kernel's own accounting (`BPF_ENABLE_STATS`, `kernel.bpf_stats_enabled`) is not
//! used: each time it is turned on or off the kernel flips a static key in the entry path
//! of every BPF program of the host (`__bpf_prog_enter*` of every trampoline among them),
//! rewriting kernel text while other CPUs run it — ten times a second under a job, for
//! every program on the host, other tools' included. In the 6.12 guest (QEMU, two vCPUs)
//! that flip under the fault handler's trampoline panicked the kernel (issue 59,
//! docs/design.md).

use aya::maps::{Array, MapData};

use nccltrace_common::names;

use crate::host;

/// Whether the programs account their runs, since when, and for how long they did.
pub struct Accounting {
    /// Whether the switch is on.
    on: bool,
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
    /// Why the programs do not account at all (the profile turned it off, or the switch
    /// could not be set).
    pub refused: Option<String>,
    /// The programs' switch (`names::TIMING`): every program counts and times its runs
    /// while it is set, and the timed ones their runs for traced threads (those they count
    /// always).
    timing: Array<MapData, u32>,
}

/// How much before its end a window may close, at the tick closest to it.
const TICK_SLACK_NS: u64 = 50_000_000;

/// When in each second the window opens, after the agent's once-a-second work.
const WINDOW_AT: std::time::Duration = std::time::Duration::from_millis(400);

impl Accounting {
    /// Turns the accounting on (before any probe is attached) for windows of `ms_a_second`
    /// each second (1000 or more: always on).
    pub fn start(ms_a_second: u32, timing: Array<MapData, u32>) -> Accounting {
        let window_ns = (ms_a_second < 1000).then(|| u64::from(ms_a_second) * 1_000_000);
        let mut accounting = Accounting {
            on: false,
            since_ns: 0,
            until_ns: None,
            closed_ns: 0,
            window_ns,
            opened_this_second: true,
            refused: (ms_a_second == 0)
                .then(|| "turned off by the profile ([cost] timing_ms = 0)".to_owned()),
            timing,
        };
        if accounting.refused.is_none() {
            if let Err(why) = accounting.switch(true) {
                accounting.refused = Some(why);
            } else {
                accounting.since_ns = now();
            }
        }
        accounting
    }

    /// Sets the programs' switch. A failed write leaves them as before.
    fn switch(&mut self, on: bool) -> Result<(), String> {
        self.timing.set(0, u32::from(on), 0).map_err(|e| {
            format!(
                "the programs' accounting switch ({}) could not be set: {e}",
                names::TIMING
            )
        })?;
        self.on = on;
        Ok(())
    }

    /// Whether the programs are accounted at all in this run.
    pub fn available(&self) -> bool {
        self.refused.is_none()
    }

    /// Whether it is accounting now.
    fn is_on(&self) -> bool {
        self.on
    }

    /// At each 100-ms tick, `into_second` after the agent's once-a-second work: closes a
    /// window that has lasted its time, and opens the second's window `WINDOW_AT` into
    /// it (one attempt a second). Not next to that work: on a host with few CPUs the agent's reading of every
    /// program and /proc file preempts the traced threads inside the programs, and the
    /// programs count the time they wait as their own (measured: 500–900 ns a run
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
        match self.switch(true) {
            Ok(()) => {
                self.since_ns = now();
                self.until_ns = Some(self.since_ns + window_ns);
            }
            // Counted in no window: the scaled figures stay right, from fewer windows.
            Err(why) => log::warn!("{why}"),
        }
    }

    /// Where the programs count in windows, closes the open one: the first at the first
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

    /// Closes the open window. A switch that cannot be turned off leaves the window open:
    /// the programs go on counting, and the accounted time with them.
    fn close(&mut self) {
        if !self.is_on() {
            return;
        }
        let until = now();
        match self.switch(false) {
            Ok(()) => self.closed_ns += until.saturating_sub(self.since_ns),
            Err(why) => log::warn!("{why}"),
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
