//! What a traced call's traps cost on this host (issue 22): the kernel accounts the
//! programs' run time but not the uprobe and uretprobe traps around them. The entry
//! program, then the return program too, are attached to a function of the agent itself,
//! where they return at once (the agent is not a target), and the function is called a
//! few thousand times without and with them: the difference a call is the traps (plus the
//! early returns), for calls traced at entry only and for calls traced both ways.

use std::path::Path;
use std::time::Instant;

use aya::Ebpf;
use aya::programs::UProbe;
use aya::programs::uprobe::{UProbeAttachLocation, UProbeAttachPoint, UProbeScope};

use super::{Link, names, typed_program};

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
pub(super) fn calibrate(ebpf: &mut Ebpf, links: &mut Vec<Link>) -> Result<Traps, String> {
    let (file, offset) = file_offset(nccltrace_trap_calibration as *const () as usize as u64)
        .ok_or("the agent's own code is not in /proc/self/maps")?;
    let bare = fastest_round();
    let pid = std::num::NonZeroU32::new(std::process::id()).ok_or("no pid")?;
    let mut added = Vec::new();
    for program in [names::UPROBE_LIB_CALL, names::URETPROBE_LIB_CALL] {
        let prog: &mut UProbe = typed_program(ebpf, program).map_err(|e| e.to_string())?;
        let point = UProbeAttachPoint {
            location: UProbeAttachLocation::AbsoluteOffset(offset),
            cookie: Some(0),
        };
        let id = prog
            .attach(point, Path::new(&file), UProbeScope::OneProcess(pid))
            .map_err(|e| format!("{program} on {file}: {e}"))?;
        let link = prog.take_link(id).map_err(|e| e.to_string())?;
        links.push(Link::Uprobe(link));
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
