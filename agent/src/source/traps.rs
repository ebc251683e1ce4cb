//! What a traced call's traps cost on this host (issue 22): the kernel accounts the
//! programs' run time but not the uprobe and uretprobe traps around them. The entry
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

fn fastest_round() -> u64 {
    (0..ROUNDS)
        .map(|_| {
            let started = Instant::now();
            let mut x = 0u64;
            for _ in 0..CALLS {
                x = nccltrace_trap_calibration(std::hint::black_box(x));
            }
            std::hint::black_box(x);
            started.elapsed().as_nanos() as u64
        })
        .min()
        .unwrap_or(0)
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

/// The added time of one call with the entry program alone, then with the entry and
/// return programs attached; the probes stay attached (in `links`, released with the
/// others).
pub(super) fn calibrate(
    ebpf: &mut Ebpf,
    uprobes: &UprobePrograms,
    links: &mut Vec<Link>,
) -> Result<Traps, String> {
    let (file, offset) = file_offset(nccltrace_trap_calibration as *const () as usize as u64)
        .ok_or("the agent's own code is not in /proc/self/maps")?;
    let bare = fastest_round();
    let pid = std::num::NonZeroU32::new(std::process::id()).ok_or("no pid")?;
    let mut added = Vec::new();
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
    for program in names::UPROBE_PROGRAMS {
        uprobes
            .attach_one(ebpf, program, &to, &[&site], links)
            .map_err(|e| e.to_string())?;
        let probed = fastest_round();
        if probed <= bare {
            return Err(format!(
                "the probed calls were no slower ({probed} ns against {bare} ns for {CALLS}): \
                 the probes did not fire"
            ));
        }
        added.push((probed - bare) / u64::from(CALLS));
    }
    let (entry_ns, pair_ns) = (added[0], added[1]);
    // Rounds vary: the pair never costs less than its entry part.
    Ok(Traps {
        pair_ns: pair_ns.max(entry_ns),
        entry_ns,
    })
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

/// What one interrupt of a sampling clock costs the thread it lands on here (the timer,
/// the perf overflow path; not the sampling program, whose run time the kernel accounts),
/// ns: a cpu-clock event of this thread with no program and no ring, enabled for every
/// other round of a busy loop; the added time over the interrupts the clock made.
pub(super) fn calibrate_sampling() -> Result<u64, String> {
    use perf_event_open_sys::bindings as sys;
    use std::os::fd::{AsRawFd as _, FromRawFd as _};
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
    let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
    let (mut bare, mut sampled) = (u64::MAX, u64::MAX);
    for _ in 0..SAMPLING_ROUNDS {
        bare = bare.min(busy_round());
        // SAFETY: enabling and disabling an event this process owns.
        unsafe { perf_event_open_sys::ioctls::ENABLE(fd.as_raw_fd(), 0) };
        sampled = sampled.min(busy_round());
        // SAFETY: as above.
        unsafe { perf_event_open_sys::ioctls::DISABLE(fd.as_raw_fd(), 0) };
    }
    let interrupts = sampled / SAMPLING_PERIOD_NS;
    if sampled <= bare || interrupts == 0 {
        return Err(format!(
            "the sampled rounds were no slower ({sampled} ns against {bare} ns): the clock's \
             interrupts were not seen"
        ));
    }
    let per = (sampled - bare) / interrupts;
    if per < MIN_INTERRUPT_NS {
        // No interrupt costs that little: the rounds' noise hid it (an emulated guest).
        return Err(format!(
            "the sampled rounds were only {} ns slower over {interrupts} interrupts, under \
             {MIN_INTERRUPT_NS} ns each: below what this measurement resolves here",
            sampled - bare
        ));
    }
    Ok(per)
}

/// The least a sampling interrupt is taken to cost: a smaller measured figure is noise.
const MIN_INTERRUPT_NS: u64 = 100;
