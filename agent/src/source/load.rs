//! Loading the kernel programs: the object with this kernel's offsets and the profile's
//! switches, which programs a profile wants, their verification side by side, and where
//! attaching went (`Phases`).

use super::{
    BTreeMap, Ebpf, EbpfLoader, Instant, KProbe, PROGRAMS, Path, PerfEvent, Profile, ProgramError,
    RawTracePoint, SourceError, TracePoint, UProbe, is_eperm, kprobes_missing, missing_program,
    names, program_error, rings,
};
use nccltrace_common::run;

/// Ring buffers for this host (one per group of CPUs, see `rings`).
pub(super) fn ring_shards() -> u32 {
    // SAFETY: sysconf has no preconditions.
    let cpus = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_CONF) };
    rings::shards_for(usize::try_from(cpus).unwrap_or(1))
}

/// The first kernel with the `bpf_loop` helper.
const BPF_LOOP_SINCE: (u32, u32) = (5, 17);

/// How the kernel programs walk Python frames under `profile` on a kernel of release
/// `kernel` (major, minor; `None`: unknown): with a `bpf_loop` callback (true), or an
/// unrolled loop, and in words for summary.json (`None` without Python frames).
pub(super) fn python_walk(profile: &Profile, kernel: Option<(u32, u32)>) -> (bool, Option<String>) {
    if !profile.probes.python_frames {
        return (false, None);
    }
    let why_not = if profile.probes.python_loop {
        match kernel {
            Some(release) if release >= BPF_LOOP_SINCE => {
                return (true, Some("bpf_loop callback".to_owned()));
            }
            Some((major, minor)) => format!(
                "kernel {major}.{minor} has no bpf_loop (Linux {}.{}+)",
                BPF_LOOP_SINCE.0, BPF_LOOP_SINCE.1
            ),
            None => "kernel release unknown".to_owned(),
        }
    } else {
        "profile python_loop = false".to_owned()
    };
    (false, Some(format!("unrolled loop ({why_not})")))
}

/// Whether the scheduler's tracepoints run raw under `profile`, with the kernel BTF at
/// `btf` (setting the task offsets in `offsets`: [`FIELD_ABSENT`](nccltrace_common::FIELD_ABSENT)
/// where they do not), and in words for summary.json (`None` without scheduler probes).
pub(super) fn sched_tracepoints(
    profile: &Profile,
    btf: &Path,
    offsets: &mut nccltrace_common::TpOffsets,
) -> (bool, Option<String>) {
    offsets.task_pid = nccltrace_common::FIELD_ABSENT;
    offsets.task_cpu = nccltrace_common::FIELD_ABSENT;
    if !profile.probes.sched {
        return (false, None);
    }
    let why_not = if profile.probes.raw_tracepoints {
        match super::ktypes::task_fields(btf) {
            Ok(fields) => {
                offsets.task_pid = fields.pid;
                offsets.task_cpu = fields.cpu;
                return (
                    true,
                    Some(format!(
                        "raw tracepoints (struct task_struct: pid at byte {}, cpu at byte {}, \
                         from the kernel BTF)",
                        fields.pid, fields.cpu
                    )),
                );
            }
            Err(why) => why,
        }
    } else {
        "profile raw_tracepoints = false".to_owned()
    };
    (false, Some(format!("formatted tracepoints ({why_not})")))
}

/// The program attached to `tp`, and whether it is a raw tracepoint's: the raw
/// scheduler programs where `raw_sched`.
pub(super) fn tracepoint_program(tp: &names::Tracepoint, raw_sched: bool) -> (&'static str, bool) {
    match names::raw_sched_program(tp.event) {
        Some(program) if raw_sched => (program, true),
        _ => (tp.program, tp.raw),
    }
}

/// The host's largest pid plus one (/proc/sys/kernel/pid_max; Linux's default for 64-bit
/// hosts where unreadable): the `MAYBE` map's length, a byte a pid (4 MiB at most).
fn pid_max() -> u32 {
    const LIMIT: u32 = 4 << 20;
    std::fs::read_to_string("/proc/sys/kernel/pid_max")
        .ok()
        .and_then(|v| v.trim().parse::<u32>().ok())
        .map_or(LIMIT, |max| max.clamp(1, LIMIT))
}

/// This kernel's release (major, minor), as aya reads it (Debian's and Ubuntu's own
/// version strings included).
pub(super) fn kernel_release() -> Option<(u32, u32)> {
    let code = aya::util::KernelVersion::current().ok()?.code();
    Some((code >> 16, (code >> 8) & 0xff))
}

/// Loads the programs with this kernel's tracepoint offsets, the profile's switches and `shards`
/// ring buffers in use, the Python frames walked by `bpf_loop` where `py_loop`. The loader
/// reads the kernel BTF first (a phase of its own).
pub(super) fn load(
    offsets: &nccltrace_common::TpOffsets,
    profile: &Profile,
    shards: u32,
    py_loop: bool,
    phases: &mut Phases,
) -> Result<Ebpf, SourceError> {
    let mut loader = EbpfLoader::new();
    phases.mark("kernel BTF (aya's loader)");
    loader.override_global(names::OFFSETS, offsets, true);
    let config = nccltrace_common::Config {
        offcpu_stacks: match (
            profile.probes.offcpu_on(),
            profile.probes.offcpu_kernel_stacks,
        ) {
            (false, _) => nccltrace_common::offcpu::OFF,
            (true, false) => nccltrace_common::offcpu::USER,
            (true, true) => nccltrace_common::offcpu::KERNEL,
        },
        call_stacks: profile.probes.call_stacks.setting(),
        streams: u32::from(profile.probes.streams),
        shards,
        // Woken early at an eighth full; otherwise drained every `DRAIN_EVERY`.
        wakeup_bytes: u64::from(profile.ring_buffer_bytes() / shards / 8),
        reuse_stacks: u32::from(profile.probes.reuse_stacks),
        py_loop: u32::from(py_loop),
    };
    loader.override_global(names::CONFIG, &config, true);
    loader.map_max_entries(names::MAYBE, pid_max());
    rings::size(&mut loader, shards, profile.ring_buffer_bytes());
    loader.load(PROGRAMS).map_err(|e| {
        if is_eperm(&e) {
            SourceError::Permission {
                source: Box::new(e),
            }
        } else {
            SourceError::Load(Box::new(e))
        }
    })
}

/// Where attaching went: each phase's name and microseconds, in order.
pub(super) struct Phases {
    pub(super) last: Instant,
    pub(super) done: Vec<(String, u64)>,
}

impl Phases {
    pub(super) fn new(started: Instant) -> Phases {
        Phases {
            last: started,
            done: Vec::new(),
        }
    }

    /// Ends the phase that began at the previous mark.
    pub(super) fn mark(&mut self, name: &str) {
        let now = Instant::now();
        let us = u64::try_from(now.duration_since(self.last).as_micros()).unwrap_or(u64::MAX);
        self.done.push((name.to_owned(), us));
        self.last = now;
    }
}

/// Whether `profile` attaches the tracepoint `tp`.
pub(super) fn tracepoint_wanted(tp: &names::Tracepoint, profile: &Profile) -> bool {
    match tp.switch {
        names::Switch::PageFaults => profile.probes.page_faults,
        names::Switch::Numa => profile.probes.numa,
        names::Switch::Always => true,
        names::Switch::Sched => profile.probes.sched,
    }
}

/// A program type that loads with no arguments.
pub trait Loadable {
    fn load_into_kernel(&mut self) -> Result<(), ProgramError>;
    /// Already loaded (by `preload`).
    fn loaded(&self) -> bool;
}

macro_rules! loadable {
    ($($t:ty),*) => {$(
        impl Loadable for $t {
            fn load_into_kernel(&mut self) -> Result<(), ProgramError> {
                self.load()
            }
            fn loaded(&self) -> bool {
                self.fd().is_ok()
            }
        }
    )*};
}
loadable!(UProbe, TracePoint, RawTracePoint, PerfEvent, KProbe);

/// Loads the program `name` of `ebpf` into the kernel. A rejection by the verifier names
/// the program and the kernel release, with the verifier's output.
pub fn load_program<'e, P: Loadable>(
    ebpf: &'e mut Ebpf,
    name: &str,
) -> Result<&'e mut P, SourceError>
where
    &'e mut P: TryFrom<&'e mut aya::programs::Program, Error = ProgramError>,
{
    let prog: &mut P = typed_program(ebpf, name)?;
    if !prog.loaded() {
        prog.load_into_kernel()
            .map_err(|e| program_error(name, "-", e))?;
    }
    Ok(prog)
}

/// The programs `attach_all` will load under `profile` on this kernel (`available`: its
/// tracepoints).
pub(super) fn wanted_programs(
    profile: &Profile,
    available: &[&str],
    tracefs_root: &Path,
    raw_sched: bool,
) -> Vec<&'static str> {
    let mut wanted = names::UPROBE_PROGRAMS.to_vec();
    wanted.extend(
        names::TRACEPOINTS
            .iter()
            .filter(|tp| tracepoint_wanted(tp, profile) && available.contains(&tp.event))
            .map(|tp| tracepoint_program(tp, raw_sched).0),
    );
    if profile.sampling.hz > 0 {
        wanted.push(names::PERF_EVENT_CPU_CLOCK);
    }
    if kprobes_missing(tracefs_root).is_none() {
        if profile.probes.numa {
            wanted.push(names::KPROBE_TASK_NUMA_FAULT);
        }
        if profile.probes.offcpu_on() && profile.probes.offcpu_min_us > 0 {
            wanted.push(names::KPROBE_FINISH_TASK_SWITCH);
        }
    }
    wanted
}

/// Loads the `wanted` programs into the kernel at once, a thread each: the kernel verifies
/// them side by side (on the H200 those with stacks and the Python walk took 20–30 ms each,
/// one after another). A program that fails here is loaded again where it is attached,
/// which reports the verifier's refusal by name.
///
/// The uprobe programs are loaded here for uprobe-multi links where `maps` (the maps'
/// descriptors) were taken for that (`multi`), beside the others.
pub(super) fn preload(
    ebpf: &mut Ebpf,
    wanted: &[&str],
    maps: Option<&BTreeMap<String, std::os::fd::OwnedFd>>,
) -> super::UprobePrograms {
    use aya::programs::Program;
    std::thread::scope(|scope| {
        let uprobes = scope.spawn(|| super::UprobePrograms::load(maps));
        for (name, program) in ebpf.programs_mut() {
            if !wanted.contains(&name) || program.fd().is_ok() {
                continue;
            }
            if maps.is_some() && names::UPROBE_PROGRAMS.contains(&name) {
                continue;
            }
            scope.spawn(move || {
                let started = std::time::Instant::now();
                let loaded = match program {
                    Program::UProbe(p) => p.load(),
                    Program::TracePoint(p) => p.load(),
                    Program::RawTracePoint(p) => p.load(),
                    Program::PerfEvent(p) => p.load(),
                    Program::KProbe(p) => p.load(),
                    _ => Ok(()),
                };
                match loaded {
                    Ok(()) => log::debug!(
                        "{name} verified in {:?} ({} instructions processed)",
                        started.elapsed(),
                        program
                            .info()
                            .ok()
                            .and_then(|i| i.verified_instruction_count())
                            .unwrap_or(0)
                    ),
                    Err(e) => log::debug!("{name} not loaded ahead: {e}"),
                }
            });
        }
        uprobes
            .join()
            .unwrap_or(super::UprobePrograms::PerFunction { per_target: false })
    })
}

/// Each program's runs and run time (ns) as the programs counted them themselves in the
/// accounting's windows (`PROGRAM_COSTS`, every CPU summed; the uprobe programs loaded for
/// uprobe-multi links write there too). Programs that never ran in a window are left out.
pub(super) fn program_runs(ebpf: &Ebpf) -> super::ProgramRuns {
    let costs = ebpf
        .map(names::PROGRAM_COSTS)
        .and_then(|map| aya::maps::PerCpuArray::<_, u64>::try_from(map).ok());
    let Some(costs) = costs else {
        log::warn!(
            "the programs' own accounting ({}) cannot be read",
            names::PROGRAM_COSTS
        );
        return super::ProgramRuns::new();
    };
    let sum = |index: u32| -> u64 { costs.get(&index, 0).map_or(0, |v| v.iter().sum()) };
    (0..run::COUNT)
        .filter_map(|id| {
            let runs = sum(run::SLOTS * id);
            (runs > 0).then(|| {
                let name = run::PROGRAMS[id as usize].to_owned();
                (name, (runs, sum(run::SLOTS * id + 1)))
            })
        })
        .collect()
}

/// The program `name` of the object, as its type.
pub(super) fn typed_program<'e, P>(ebpf: &'e mut Ebpf, name: &str) -> Result<&'e mut P, SourceError>
where
    &'e mut P: TryFrom<&'e mut aya::programs::Program, Error = ProgramError>,
{
    ebpf.program_mut(name)
        .ok_or_else(|| missing_program(name))?
        .try_into()
        .map_err(|e| program_error(name, "-", e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_frames_are_walked_by_bpf_loop_from_5_17() {
        let mut profile = Profile::load("default").unwrap();
        assert!(profile.probes.python_frames && profile.probes.python_loop);
        assert_eq!(
            python_walk(&profile, Some((6, 1))),
            (true, Some("bpf_loop callback".to_owned()))
        );
        assert!(python_walk(&profile, Some((5, 17))).0);
        let (on, why) = python_walk(&profile, Some((5, 15)));
        assert!(!on);
        assert_eq!(
            why.as_deref(),
            Some("unrolled loop (kernel 5.15 has no bpf_loop (Linux 5.17+))")
        );
        assert!(!python_walk(&profile, Some((4, 18))).0);
        assert!(!python_walk(&profile, None).0);
        profile.probes.python_loop = false;
        assert_eq!(
            python_walk(&profile, Some((6, 18))),
            (
                false,
                Some("unrolled loop (profile python_loop = false)".to_owned())
            )
        );
        profile.probes.python_frames = false;
        assert_eq!(python_walk(&profile, Some((6, 18))), (false, None));
    }

    #[test]
    fn this_kernels_release_is_read() {
        let (major, minor) = kernel_release().expect("a release");
        let uname = crate::host::uname().0;
        assert!(
            uname.starts_with(&format!("{major}.{minor}."))
                || uname.starts_with(&format!("{major}.{minor}-")),
            "{uname} read as {major}.{minor}"
        );
    }
}
