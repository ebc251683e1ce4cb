//! What a traced call's traps cost on this host (issue 22): the programs account their
//! own run time but not the uprobe and uretprobe traps around them. The entry
//! program, then the return program too, are attached to a function of the agent itself,
//! where they return at once (the agent is not a target), and the function is called a
//! few thousand times without and with them: the difference a call is the traps (plus the
//! early returns), for calls traced at entry only and for calls traced both ways.

use std::path::Path;
use std::time::Instant;

use aya::Ebpf;

use super::multi::{Probed, Site, UprobePrograms};
use super::{Link, names};

/// The function probed. It opens with `push rbp`, as NCCL's and the CUDA driver's
/// functions do (docs/design.md): the kernel emulates that instruction under the uprobe,
/// where most others (a compiler's choice here) are single-stepped out of line, a second
/// trap that the traced functions do not pay (15 µs a call here instead of 2).
#[unsafe(naked)]
#[unsafe(no_mangle)]
pub extern "C" fn nccltrace_trap_calibration(x: u64) -> u64 {
    core::arch::naked_asm!(
        "push rbp",
        "mov rbp, rsp",
        "lea rax, [rdi + 1]",
        "pop rbp",
        "ret",
    )
}

/// Calls a round; the fastest of the rounds counts (the least disturbed).
const CALLS: u32 = 2_000;
const ROUNDS: usize = 5;
/// Calls made with each set of probes attached: the entry program alone, then both.
pub(super) const CALLS_MADE: u64 = CALLS as u64 * ROUNDS as u64;

/// What a traced call's traps cost here, ns a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Traps {
    /// With the entry and return programs.
    pub pair_ns: u64,
    /// With the entry program alone (`call_returns = "needed"`).
    pub entry_ns: u64,
}

/// One round of calls, ns (the fastest of `ROUNDS` counts: the least disturbed).
fn timed_round() -> u64 {
    let started = Instant::now();
    let mut x = 0u64;
    for _ in 0..CALLS {
        x = nccltrace_trap_calibration(std::hint::black_box(x));
    }
    std::hint::black_box(x);
    started.elapsed().as_nanos() as u64
}

/// Where `address` (of this process) lies in its file: (file, offset), from
/// `/proc/self/maps`.
fn file_offset(address: u64) -> Option<(String, u64)> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    crate::procfs::parse_maps(&maps)
        .into_iter()
        .find(|m| (m.start..m.end).contains(&address))
        .and_then(|m| Some((m.path?, address - m.start + m.offset)))
}

/// The calibration, a round at a time (`step`), with the rings drained between rounds:
/// made at once, its ~30 ms of calls (and ~80 ms of sampled busy rounds) held the drain
/// long enough for a 4-MiB ring to fill at a million traced calls a second (the bench's
/// caller lost 6,000–20,000 records a run). Bare rounds, then rounds with the entry
/// program attached, then with the return program too; then the sampling clock's rounds
/// where wanted.
pub(super) struct Calibration {
    /// The probed function's file and offset, or why it was not found.
    site: Result<(String, u64), String>,
    /// 0: bare calls; 1: the entry program attached; 2: the return program too.
    calls_stage: usize,
    round: usize,
    fastest: u64,
    bare: u64,
    added: Vec<u64>,
    traps: Option<Result<Traps, String>>,
    /// The sampling clock's rounds: wanted, its event, the fastest rounds without and with.
    sampling: Option<Sampling>,
    sampling_result: Option<Result<u64, String>>,
}

/// What one interrupt of a sampling clock costs the thread it lands on here (the timer,
/// the perf overflow path; not the sampling program, which accounts its own run time),
/// ns: the clock enabled for every other round of a busy loop; the added time over the
/// interrupts the clock made.
struct Sampling {
    fd: Option<Result<std::os::fd::OwnedFd, String>>,
    round: usize,
    bare: u64,
    sampled: u64,
}

impl Calibration {
    /// A calibration of the traps, and of the sampling clock's interrupts if `sampling`.
    pub(super) fn new(sampling: bool) -> Calibration {
        Calibration {
            site: file_offset(nccltrace_trap_calibration as *const () as usize as u64)
                .ok_or_else(|| "the agent's own code is not in /proc/self/maps".to_owned()),
            calls_stage: 0,
            round: 0,
            fastest: u64::MAX,
            bare: 0,
            added: Vec::new(),
            traps: None,
            sampling: sampling.then_some(Sampling {
                fd: None,
                round: 0,
                bare: u64::MAX,
                sampled: u64::MAX,
            }),
            sampling_result: None,
        }
    }

    /// One round (a few milliseconds); true once every round is done. The probes it
    /// attaches stay attached (in `links`, released with the others).
    pub(super) fn step(
        &mut self,
        ebpf: &mut Ebpf,
        uprobes: &UprobePrograms,
        links: &mut Vec<Link>,
    ) -> bool {
        let site = self.site.clone();
        let mut attach = |program: &str| -> Result<(), String> {
            let (file, offset) = site.clone()?;
            let pid = std::num::NonZeroU32::new(std::process::id()).ok_or("no pid")?;
            let site = Site {
                offset,
                cookie: 0,
                returned: true,
            };
            let to = Probed {
                path: Path::new(&file),
                place: &file,
                pid: Some(pid),
            };
            uprobes
                .attach_one(ebpf, program, &to, &[&site], links)
                .map_err(|e| e.to_string())
        };
        self.step_with(&mut attach, timed_round)
    }

    /// `step`, attaching with `attach` and timing a round of calls with `round`.
    fn step_with(
        &mut self,
        attach: &mut dyn FnMut(&str) -> Result<(), String>,
        round: fn() -> u64,
    ) -> bool {
        if self.traps.is_none() {
            if let Err(why) = self.calls_round(attach, round) {
                self.traps = Some(Err(why));
            }
            return false;
        }
        let Some(sampling) = self.sampling.as_mut() else {
            return true;
        };
        if self.sampling_result.is_some() {
            return true;
        }
        match sampling.round() {
            Ok(false) => false,
            Ok(true) => {
                self.sampling_result = Some(sampling.result());
                true
            }
            Err(why) => {
                self.sampling_result = Some(Err(why));
                true
            }
        }
    }

    /// Every round at once (a run that ends before the calibration did).
    pub(super) fn finish(
        &mut self,
        ebpf: &mut Ebpf,
        uprobes: &UprobePrograms,
        links: &mut Vec<Link>,
    ) {
        while !self.step(ebpf, uprobes, links) {}
    }

    /// What a traced call's traps cost, and a sampling interrupt (where wanted), once done.
    pub(super) fn results(self) -> (Result<Traps, String>, Option<Result<u64, String>>) {
        (
            self.traps
                .unwrap_or_else(|| Err("the calibration did not finish".to_owned())),
            self.sampling_result,
        )
    }

    /// One round of calls of the current stage; at a stage's last, its figure.
    fn calls_round(
        &mut self,
        attach: &mut dyn FnMut(&str) -> Result<(), String>,
        round: fn() -> u64,
    ) -> Result<(), String> {
        if self.round == 0 && self.calls_stage > 0 {
            attach(names::UPROBE_PROGRAMS[self.calls_stage - 1])?;
        }
        self.fastest = self.fastest.min(round());
        self.round += 1;
        if self.round < ROUNDS {
            return Ok(());
        }
        let fastest = std::mem::replace(&mut self.fastest, u64::MAX);
        self.round = 0;
        if self.calls_stage == 0 {
            self.bare = fastest;
        } else if fastest <= self.bare {
            return Err(format!(
                "the probed calls were no slower ({fastest} ns against {} ns for {CALLS}): \
                 the probes did not fire",
                self.bare
            ));
        } else {
            self.added.push((fastest - self.bare) / u64::from(CALLS));
        }
        self.calls_stage += 1;
        if let [entry_ns, pair_ns] = self.added[..] {
            // Rounds vary: the pair never costs less than its entry part.
            self.traps = Some(Ok(Traps {
                pair_ns: pair_ns.max(entry_ns),
                entry_ns,
            }));
        }
        Ok(())
    }
}

/// The calibration's sampling clock: a period short enough that its interrupts slow a busy
/// loop by a few percent, at 20,000 a second, under the kernel's default sample-rate
/// limit (`kernel.perf_event_max_sample_rate`, 100,000).
const SAMPLING_PERIOD_NS: u64 = 50_000;
/// Busy-loop rounds without and with the clock, interleaved; the fastest of each counts.
const SAMPLING_ROUNDS: usize = 8;
/// Iterations of a round (about 5 ms here).
const SAMPLING_WORK: u64 = 2_000_000;

/// A fixed amount of CPU work; ns it took.
fn busy_round() -> u64 {
    let started = Instant::now();
    let mut x = 0u64;
    for i in 0..SAMPLING_WORK {
        x = std::hint::black_box(x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(i));
    }
    std::hint::black_box(x);
    started.elapsed().as_nanos() as u64
}

/// The calibration's clock: a cpu-clock event of this thread with no program and no ring,
/// disabled until a round enables it.
fn sampling_clock() -> Result<std::os::fd::OwnedFd, String> {
    use perf_event_open_sys::bindings as sys;
    use std::os::fd::FromRawFd as _;
    let mut attr = sys::perf_event_attr {
        type_: sys::PERF_TYPE_SOFTWARE,
        size: u32::try_from(std::mem::size_of::<sys::perf_event_attr>()).unwrap_or(0),
        config: u64::from(sys::PERF_COUNT_SW_CPU_CLOCK),
        ..sys::perf_event_attr::default()
    };
    attr.__bindgen_anon_1.sample_period = SAMPLING_PERIOD_NS;
    attr.set_disabled(1);
    attr.set_exclude_hv(1);
    // SAFETY: `attr` is a valid, fully initialised perf_event_attr of its own size; pid 0
    // and cpu -1 are this thread on any CPU.
    let fd = unsafe {
        perf_event_open_sys::perf_event_open(
            &raw mut attr,
            0,
            -1,
            -1,
            libc::c_ulong::from(sys::PERF_FLAG_FD_CLOEXEC),
        )
    };
    if fd < 0 {
        return Err(format!(
            "a cpu-clock sampling event could not be opened ({})",
            std::io::Error::last_os_error()
        ));
    }
    // SAFETY: a new descriptor the kernel just gave us, owned from here.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
}

impl Sampling {
    /// One busy round without the clock and one with it; true after the last.
    fn round(&mut self) -> Result<bool, String> {
        use std::os::fd::AsRawFd as _;
        let fd = self
            .fd
            .get_or_insert_with(sampling_clock)
            .as_ref()
            .map_err(Clone::clone)?
            .as_raw_fd();
        self.bare = self.bare.min(busy_round());
        // SAFETY: enabling and disabling an event this process owns.
        unsafe { perf_event_open_sys::ioctls::ENABLE(fd, 0) };
        self.sampled = self.sampled.min(busy_round());
        // SAFETY: as above.
        unsafe { perf_event_open_sys::ioctls::DISABLE(fd, 0) };
        self.round += 1;
        Ok(self.round >= SAMPLING_ROUNDS)
    }

    /// What one interrupt cost, from the fastest rounds without and with the clock.
    fn result(&self) -> Result<u64, String> {
        let (bare, sampled) = (self.bare, self.sampled);
        let interrupts = sampled / SAMPLING_PERIOD_NS;
        if sampled <= bare || interrupts == 0 {
            return Err(format!(
                "the sampled rounds were no slower ({sampled} ns against {bare} ns): the \
                 clock's interrupts were not seen"
            ));
        }
        let per = (sampled - bare) / interrupts;
        if per < MIN_INTERRUPT_NS {
            // No interrupt costs that little: the rounds' noise hid it (an emulated guest).
            return Err(format!(
                "the sampled rounds were only {} ns slower over {interrupts} interrupts, \
                 under {MIN_INTERRUPT_NS} ns each: below what this measurement resolves here",
                sampled - bare
            ));
        }
        Ok(per)
    }
}

/// The least a sampling interrupt is taken to cost: a smaller measured figure is noise.
const MIN_INTERRUPT_NS: u64 = 100;

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    thread_local! {
        /// Rounds of calls made, and programs attached, in this test's thread.
        static ROUNDS_MADE: Cell<u64> = const { Cell::new(0) };
        static ATTACHED: Cell<usize> = const { Cell::new(0) };
    }

    /// A round of calls: 1,000 ns a call bare, 700 more with the entry program, 1,200 more
    /// with both.
    fn round_of_calls() -> u64 {
        ROUNDS_MADE.with(|r| r.set(r.get() + 1));
        u64::from(CALLS) * (1_000 + [0, 700, 1_200][ATTACHED.with(Cell::get)])
    }

    fn unprobed_round() -> u64 {
        ROUNDS_MADE.with(|r| r.set(r.get() + 1));
        u64::from(CALLS) * 1_000
    }

    /// Steps to the end; the programs attached, in order, and the steps each made a round.
    fn run(calibration: &mut Calibration, round: fn() -> u64, count: bool) -> Vec<String> {
        let mut attached = Vec::new();
        let mut attach = |program: &str| {
            attached.push(program.to_owned());
            if count {
                ATTACHED.with(|a| a.set(a.get() + 1));
            }
            Ok(())
        };
        let mut steps = 0;
        while !calibration.step_with(&mut attach, round) {
            steps += 1;
            // One round of calls a step, never more: the rings are drained between two.
            assert_eq!(ROUNDS_MADE.with(Cell::get), steps);
        }
        attached
    }

    #[test]
    fn a_round_of_calls_a_step() {
        let mut calibration = Calibration::new(false);
        let attached = run(&mut calibration, round_of_calls, true);
        assert_eq!(ROUNDS_MADE.with(Cell::get), 3 * ROUNDS as u64);
        assert_eq!(attached, names::UPROBE_PROGRAMS.map(str::to_owned));
        let (traps, sampling) = calibration.results();
        assert_eq!(
            traps,
            Ok(Traps {
                pair_ns: 1_200,
                entry_ns: 700
            })
        );
        assert_eq!(sampling, None);
    }

    #[test]
    fn probes_that_never_fire_are_said_to() {
        let mut calibration = Calibration::new(false);
        let attached = run(&mut calibration, unprobed_round, false);
        // Stopped at the first probed stage's end.
        assert_eq!(ROUNDS_MADE.with(Cell::get), 2 * ROUNDS as u64);
        assert_eq!(attached.len(), 1);
        let (traps, _) = calibration.results();
        assert!(traps.unwrap_err().contains("the probes did not fire"));
    }
}
