//! Attaching to a target: uprobes on its libraries, sampling clocks, its threads in the
//! maps, and what the recording keeps about it.

use super::*;

/// The libraries to probe in `t` under `profile`, and the probes as the recording lists them.
pub(super) fn target_libs<'t>(
    t: &'t Target,
    profile: &Profile,
) -> (Vec<&'t FoundLibrary>, Vec<ProbeInfo>) {
    let mut libs: Vec<&FoundLibrary> = Vec::new();
    if profile.probes.nccl {
        libs.push(&t.nccl);
    }
    if profile.probes.cuda_sync {
        libs.extend(t.cuda.iter());
    }
    libs.extend(t.marker.iter());
    libs.extend(t.nvtx.iter());
    let probes = libs
        .iter()
        .flat_map(|lib| {
            lib.sites.iter().map(|site| ProbeInfo {
                func: site.func.name().to_owned(),
                symbol: site.symbol.clone(),
                library: lib.path.clone(),
                file_offset: site.file_offset,
                past_endbr64: site.past_endbr64,
            })
        })
        .collect();
    (libs, probes)
}

/// A file's identity: probes are per file, whatever the number of processes mapping it.
pub(super) fn inode(path: &Path) -> (u64, u64) {
    std::fs::metadata(path).map_or((0, 0), |m| (m.dev(), m.ino()))
}

/// Attaches the entry and return programs (loaded) to every site of `lib` for the target
/// `pid`, the return program only where `returns` wants it (the entry program then writes
/// the record, told by its cookie), unless that is done already (`probed`: device, inode
/// and the process probed, 0 for every process).
///
/// Probes made for one target (uprobe-multi links; per-function uprobes when there is
/// one target, `UprobePrograms::scope_for`): the kernel writes the breakpoints into
/// that process only, so the other processes mapping the file (the untraced ranks of a
/// node) never trap, and the programs, told by the cookie, skip the target check.
/// Otherwise per-function uprobes are made once per file for every process (the
/// programs keep the targets' calls): each costs a grace period under a kernel-wide
/// mutex to release, so per target they would multiply.
pub(super) fn probe_library(
    ebpf: &mut Ebpf,
    uprobes: &UprobePrograms,
    lib: &FoundLibrary,
    pid: u32,
    returns: CallReturns,
    probed: &mut Vec<(u64, u64, u32)>,
    links: &mut Vec<Link>,
) -> Result<(), SourceError> {
    let scope = NonZeroU32::new(pid).filter(|_| uprobes.per_target());
    let (dev, ino) = inode(&lib.host_path);
    let key = (dev, ino, scope.map_or(0, NonZeroU32::get));
    if (dev, ino) != (0, 0) && probed.contains(&key) {
        return Ok(());
    }
    probed.push(key);
    let in_target = if scope.is_some() {
        nccltrace_common::func::IN_TARGET
    } else {
        0
    };
    let sites: Vec<Site> = lib
        .sites
        .iter()
        .map(|site| {
            let func = site.func.id();
            let returned = returns.traced(func);
            let entry_only = if returned {
                0
            } else {
                nccltrace_common::func::ENTRY_ONLY
            };
            Site {
                offset: site.file_offset,
                cookie: u64::from(func | entry_only | in_target),
                returned,
            }
        })
        .collect();
    uprobes.attach(ebpf, &lib.host_path, &lib.path, &sites, scope, links)
}

/// One software cpu-clock event per online CPU (`SampleScope::Cpu`); the program keeps the
/// samples of target threads only.
pub(super) fn sample_cpus(
    ebpf: &mut Ebpf,
    period_ns: u64,
    links: &mut Vec<Link>,
) -> Result<(), SourceError> {
    let name = names::PERF_EVENT_CPU_CLOCK;
    let prog: &mut PerfEvent = typed_program(ebpf, name)?;
    let cpus = aya::util::online_cpus().map_err(|(path, source)| SourceError::OnlineCpus {
        path: path.to_owned(),
        source,
    })?;
    for cpu in cpus {
        let scope = PerfEventScope::AllProcessesOneCpu { cpu };
        attach_clock(prog, scope, period_ns, false, links)
            .map_err(|e| program_error(name, &format!("CPU {cpu}"), e))?;
    }
    Ok(())
}

/// Attaches the sampling program to one software cpu-clock event of `scope`.
pub(super) fn attach_clock(
    prog: &mut PerfEvent,
    scope: PerfEventScope,
    period_ns: u64,
    inherit: bool,
    links: &mut Vec<Link>,
) -> Result<(), ProgramError> {
    let config = PerfEventConfig::Software(SoftwareEvent::CpuClock);
    let id = prog.attach(config, scope, SamplePolicy::Period(period_ns), inherit)?;
    links.push(Link::Perf(prog.take_link(id)?));
    Ok(())
}

/// One software cpu-clock event per thread of `pid`, inherited by threads it creates
/// (`SampleScope::Thread`).
pub(super) fn sample_threads(
    ebpf: &mut Ebpf,
    host: &Host,
    pid: u32,
    period_ns: u64,
    links: &mut Vec<Link>,
) -> Result<(), SourceError> {
    let name = names::PERF_EVENT_CPU_CLOCK;
    let prog: &mut PerfEvent = typed_program(ebpf, name)?;
    for tid in host.threads(pid) {
        let scope = PerfEventScope::OneProcess {
            pid: tid,
            cpu: None,
        };
        match attach_clock(prog, scope, period_ns, true, links) {
            Ok(()) => {}
            // The thread exited between listing and attaching.
            Err(_) if !host.path(&format!("proc/{pid}/task/{tid}")).exists() => {}
            Err(e) => {
                return Err(program_error(
                    name,
                    &format!("thread {tid} of pid {pid}"),
                    e,
                ));
            }
        }
    }
    Ok(())
}

/// What the recording keeps about a target.
pub(super) fn target_info(
    host: &Host,
    t: &Target,
    probes: Vec<ProbeInfo>,
    python: Option<crate::python::PythonInfo>,
) -> TargetInfo {
    let launcher = host.launcher(t.pid);
    TargetInfo {
        python,
        pid: t.pid,
        comm: t.comm.clone(),
        cmdline: host.cmdline(t.pid),
        nccl_library: Some(t.nccl.path.clone()),
        cuda_library: t.cuda.as_ref().map(|c| c.path.clone()),
        probes,
        maps: t.maps.clone(),
        threads: host.thread_names(t.pid),
        env_rank: launcher.rank,
        job: launcher.job,
        rendezvous: launcher.rendezvous,
        world_size: launcher.world_size,
        parent_pid: host.parent_pid(t.pid),
        comm_fields: Some(super::comms::fields(&t.nccl.host_path)),
        maps_text: std::fs::read_to_string(host.path(&format!("proc/{}/maps", t.pid)))
            .unwrap_or_default(),
    }
}

/// Adds `t`'s threads to `THREADS`.
pub(super) fn register_threads(
    ebpf: &mut Ebpf,
    host: &Host,
    t: &Target,
) -> Result<(), SourceError> {
    let tids = host.threads(t.pid);
    // The bits first: a program that finds no bit looks no further.
    let mut maybe: aya::maps::Array<_, u8> = aya::maps::Array::try_from(
        ebpf.map_mut(names::MAYBE)
            .ok_or_else(|| missing_map(names::MAYBE))?,
    )
    .map_err(map_error(names::MAYBE))?;
    let marks = std::iter::once((t.pid, nccltrace_common::maybe::PROCESS)).chain(
        tids.iter()
            .map(|tid| (*tid, nccltrace_common::maybe::THREAD)),
    );
    for (pid, bit) in marks {
        // A pid past the map's end (pid_max raised since) has no byte: the programs then
        // look it up in the hash maps.
        if let Ok(bits) = maybe.get(&pid, 0) {
            maybe
                .set(pid, bits | bit, 0)
                .map_err(map_error(names::MAYBE))?;
        }
    }
    let mut threads: BpfHashMap<_, u32, u32> = BpfHashMap::try_from(
        ebpf.map_mut(names::THREADS)
            .ok_or_else(|| missing_map(names::THREADS))?,
    )
    .map_err(map_error(names::THREADS))?;
    for tid in tids {
        threads
            .insert(tid, t.pid, 0)
            .map_err(map_error(names::THREADS))?;
    }
    Ok(())
}
