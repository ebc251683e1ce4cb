//! `attach`: everything in order, from tracefs and the kernel object to the header.

use super::*;

/// What attaching needs before it knows its targets — tracefs, the object loaded with this
/// kernel's offsets and the profile's switches, every program the profile wants verified —
/// made on a thread of its own from the command's start, beside finding the targets and
/// the doctor's report (on the H200 those took 37–67 ms, the loading and verification
/// 110–145 ms).
pub struct Prepared {
    started: Instant,
    profile: Profile,
    thread: std::thread::JoinHandle<Result<Ready, SourceError>>,
}

impl Prepared {
    /// Starts preparing for `profile`.
    #[must_use]
    pub fn start(profile: &Profile) -> Prepared {
        let started = Instant::now();
        let for_thread = profile.clone();
        let thread = std::thread::spawn(move || prepare(&for_thread, started));
        Prepared {
            started,
            profile: profile.clone(),
            thread,
        }
    }
}

/// What [`Prepared`] made.
struct Ready {
    tracefs_root: std::path::PathBuf,
    available: Vec<&'static str>,
    shards: u32,
    kallsyms: std::thread::JoinHandle<KernelSymbols>,
    btf: Option<std::thread::JoinHandle<Result<Btf, String>>>,
    ebpf: Ebpf,
    uprobes: UprobePrograms,
    warm: Option<multi::Warm>,
    phases: Phases,
    /// How the programs walk Python frames (`python_walk`).
    python_walk: Option<String>,
    /// Whether the scheduler's tracepoints run raw, and in words (`sched_tracepoints`).
    raw_sched: bool,
    sched_tracepoints: Option<String>,
}

fn prepare(profile: &Profile, started: Instant) -> Result<Ready, SourceError> {
    let tracefs_root = tracefs::ensure_mounted()?;
    let (mut offsets, available) = tracefs::offsets(&tracefs_root)?;
    let (raw_sched, sched_tracepoints) = sched_tracepoints(
        profile,
        std::path::Path::new(super::ktypes::VMLINUX_BTF),
        &mut offsets,
    );
    let shards = ring_shards();
    let mut phases = Phases::new(started);
    // Read beside the loading (tens of ms), a line at a time: /proc/kallsyms for the fault
    // handlers' ranges and the switch-in kprobe's symbol.
    let kallsyms = std::thread::spawn(kernel_symbols);
    phases.mark("tracefs");
    let (py_loop, python_walk) = python_walk(profile, kernel_release());
    let mut ebpf = load(&offsets, profile, shards, py_loop, &mut phases)?;
    // The kernel BTF for fentry, parsed beside the verification: after the loader has
    // dropped its own copy (the file read whole and parsed is ~12 MB here; two at once
    // were a third of the agent's peak memory).
    let btf = profile.probes.page_faults.then(|| {
        std::thread::spawn(|| {
            Btf::from_sys_fs().map_err(|e| format!("no kernel BTF ({})", root_cause(&e)))
        })
    });
    // Before any map is taken out of `ebpf`: the uprobe programs loaded for uprobe-multi
    // links refer to them all.
    let map_fds =
        (profile.probes.uprobe_multi && multi::supported()).then(|| multi::map_fds(&ebpf));
    phases.mark("maps and object");
    // The first uprobe registration's grace period, paid beside the verification.
    let warm = map_fds.as_ref().and_then(|_| multi::Warm::start());
    let uprobes = preload(
        &mut ebpf,
        &wanted_programs(profile, &available, &tracefs_root, raw_sched),
        map_fds.as_ref(),
    );
    drop(map_fds);
    phases.mark("programs verified (in parallel)");
    Ok(Ready {
        tracefs_root,
        available,
        shards,
        kallsyms,
        btf,
        ebpf,
        uprobes,
        warm,
        phases,
        python_walk,
        raw_sched,
        sched_tracepoints,
    })
}

/// Loads the programs and attaches everything `profile` asks for to `targets`.
/// Must run inside a tokio runtime (the ring buffer is registered with it). A target that
/// exits meanwhile makes whatever failed (its files vanish from /proc/PID/root) a
/// [`SourceError::ExitedDuringAttach`].
pub fn attach(targets: &[Target], profile: &Profile) -> Result<Attached, SourceError> {
    attach_prepared(Prepared::start(profile), targets)
}

/// As [`attach`], with what `prepared` made meanwhile, under the profile it was started
/// for. The attach time is counted from `prepared`'s start.
pub fn attach_prepared(prepared: Prepared, targets: &[Target]) -> Result<Attached, SourceError> {
    attach_all(prepared, targets).map_err(|e| {
        let host = Host::live();
        match targets.iter().find(|t| !host.process_alive(t.pid)) {
            Some(t) => SourceError::ExitedDuringAttach { pid: t.pid },
            None => e,
        }
    })
}

#[allow(clippy::too_many_lines)] // one straight sequence: load, fill maps, attach, take maps
fn attach_all(prepared: Prepared, targets: &[Target]) -> Result<Attached, SourceError> {
    let (started, profile) = (prepared.started, &prepared.profile);
    let host = Host::live();
    let Ready {
        tracefs_root,
        available,
        shards,
        kallsyms,
        btf,
        mut ebpf,
        mut uprobes,
        warm,
        mut phases,
        python_walk,
        raw_sched,
        sched_tracepoints,
    } = prepared
        .thread
        .join()
        .unwrap_or_else(|panic| std::panic::resume_unwind(panic))?;
    // What of discovery and the doctor's report was left once the programs were ready.
    phases.mark("discovery and doctor (beside the loading)");
    // The programs count and time their runs while a window is open (their own cost,
    // `summary.json` agent.bpf).
    let timing = aya::maps::Array::try_from(
        ebpf.take_map(names::TIMING)
            .ok_or_else(|| missing_map(names::TIMING))?,
    )
    .map_err(map_error(names::TIMING))?;
    let accounting = accounting::Accounting::start(profile.cost.timing_ms, timing);
    let bpf_stats_refused = accounting.refused.clone();
    // The programs are loaded and not attached yet: every count starts from zero here.
    let baseline = accounting
        .available()
        .then(|| crate::record::ProgramReading {
            at_ns: host::clock_ns(libc::CLOCK_MONOTONIC),
            accounted_ns: Some(0),
            ..crate::record::ProgramReading::default()
        });

    let logger = match aya_log::EbpfLogger::init(&mut ebpf) {
        Ok(logger) => Some(logger),
        Err(e) => {
            log::warn!("eBPF diagnostics unavailable: {e}");
            None
        }
    };
    let mut map_targets: BpfHashMap<MapData, u32, u32> = BpfHashMap::try_from(
        ebpf.take_map(names::TARGETS)
            .ok_or_else(|| missing_map(names::TARGETS))?,
    )
    .map_err(map_error(names::TARGETS))?;
    for t in targets {
        map_targets
            .insert(t.pid, 1, 0)
            .map_err(map_error(names::TARGETS))?;
    }
    for t in targets {
        register_threads(&mut ebpf, &host, t)?;
    }
    let mut armed: aya::maps::Array<MapData, u32> = aya::maps::Array::try_from(
        ebpf.take_map(names::ARMED)
            .ok_or_else(|| missing_map(names::ARMED))?,
    )
    .map_err(map_error(names::ARMED))?;
    armed.set(0, 1, 0).map_err(map_error(names::ARMED))?;
    phases.mark("targets and threads");
    // NVML answers while the probes attach.
    let mut gpu_reader = profile
        .probes
        .gpu
        .then(|| super::gpu::GpuReader::start(targets.iter().map(|t| t.pid).collect()));
    let mut py_targets = python::PyTargets::new();
    let mut py_infos = BTreeMap::new();
    if profile.probes.python_frames {
        for t in targets {
            if let Some(info) = python::start(&mut ebpf, &host, t.pid, &mut py_targets)? {
                py_infos.insert(t.pid, info);
            }
        }
    }

    phases.mark("python");
    // The InfiniBand ports, whose counters the session reads: read once before any probe
    // is attached, so that the steps traced while attaching lie between two readings.
    let (infiniband_ports, infiniband_refused) = if profile.probes.infiniband {
        let ports = host.ib_ports();
        let why = ports
            .is_empty()
            .then(|| "no InfiniBand port under /sys/class/infiniband".to_owned());
        (ports, why)
    } else {
        let why = "the profile has infiniband off".to_owned();
        (Vec::new(), Some(why))
    };
    let mut ib_files = Vec::new();
    let ib_early = super::readings::ib_readings(&host, &infiniband_ports, &mut ib_files, true);
    let mut links = Vec::new();
    let infos: Vec<(&Target, Vec<&FoundLibrary>, Vec<ProbeInfo>)> = targets
        .iter()
        .map(|t| {
            let (libs, probes) = target_libs(t, profile);
            (t, libs, probes)
        })
        .collect();
    // Probes per target where the kernel makes uprobe-multi links, or where there is one
    // target; otherwise one probe per file, whatever the number of targets
    // (`probe_library` says why).
    uprobes.scope_for(targets.len());
    let mut probed: Vec<(u64, u64, u32)> = Vec::new();
    for (t, libs, _) in &infos {
        for lib in libs {
            probe_library(
                &mut ebpf,
                &uprobes,
                lib,
                t.pid,
                profile.probes.call_returns,
                &mut probed,
                &mut links,
            )?;
        }
    }

    if let Some(warm) = warm {
        log::debug!("{} throwaway uprobes kept registration warm", warm.stop());
    }
    phases.mark("uprobes");
    for tp in names::TRACEPOINTS {
        if !tracepoint_wanted(&tp, profile) || !available.contains(&tp.event) {
            continue;
        }
        let place = format!("{}:{}", tp.category, tp.event);
        let (name, raw) = tracepoint_program(&tp, raw_sched);
        if raw {
            let prog: &mut RawTracePoint = load_program(&mut ebpf, name)?;
            let id = prog
                .attach(tp.event)
                .map_err(|e| program_error(name, &place, e))?;
            let link = prog
                .take_link(id)
                .map_err(|e| program_error(name, &place, e))?;
            links.push(Link::RawTracepoint(link));
            continue;
        }
        let prog: &mut TracePoint = load_program(&mut ebpf, name)?;
        let id = prog
            .attach(tp.category, tp.event)
            .map_err(|e| program_error(name, &place, e))?;
        let link = prog
            .take_link(id)
            .map_err(|e| program_error(name, &place, e))?;
        links.push(Link::Tracepoint(link));
    }

    phases.mark("tracepoints");
    let (fault_timing, fault_timing_refused) = if profile.probes.page_faults {
        let btf = btf.map_or_else(
            || Err("the kernel BTF was not read".to_owned()),
            |t| {
                t.join()
                    .unwrap_or_else(|_| Err("reading the kernel BTF panicked".to_owned()))
            },
        );
        match time_faults(&mut ebpf, btf) {
            Ok((how, pair)) => {
                links.extend(pair);
                (Some(how), None)
            }
            Err(why) => (None, Some(why)),
        }
    } else {
        (None, Some("page faults are off in this profile".to_owned()))
    };

    phases.mark("fault timing");
    let kernel::KernelSymbols {
        fault_handlers: fault_handler_ranges,
        sched_yield: sched_yield_ranges,
        switch_in,
    } = kallsyms.join().unwrap_or_default();
    phases.mark("kallsyms (the rest of its reading)");
    // Off-CPU stacks: which frames, and when they are taken.
    let min_ns = profile.probes.offcpu_min_us.saturating_mul(1000);
    let offcpu_on = profile.probes.offcpu_on();
    let (when, offcpu_min_ns) = if offcpu_on && min_ns > 0 {
        match offcpu_stacks_on_return(&mut ebpf, &tracefs_root, switch_in, min_ns) {
            Ok((how, link)) => {
                links.push(link);
                (how, min_ns)
            }
            Err(why) => (why, 0),
        }
    } else {
        ("taken at every switch-out".to_owned(), 0)
    };
    let frames = if profile.probes.offcpu_kernel_stacks {
        "kernel, user and Python frames"
    } else {
        "user and Python frames, no kernel frames (profile offcpu_kernel_stacks = false)"
    };
    let offcpu_stacks = offcpu_on.then(|| format!("{frames}, {when}"));

    phases.mark("off-CPU kprobe");
    let numa_hints_refused = if profile.probes.numa {
        match trace_numa_hints(&mut ebpf, &tracefs_root) {
            Ok(link) => {
                links.push(link);
                None
            }
            Err(why) => Some(why),
        }
    } else {
        Some("the profile has numa off".to_owned())
    };

    phases.mark("NUMA kprobe");
    // The PMU's memory sampler on every thread of the targets, where the host has one.
    let tids = if profile.probes.numa {
        pmu::target_threads(&host, targets.iter().map(|t| t.pid))
    } else {
        Vec::new()
    };
    let (mem, mem_sampling_refused) = if profile.probes.numa {
        match crate::pmu::detect(std::path::Path::new(crate::pmu::DEVICES))
            .and_then(|s| pmu::Sampling::open(s, &tids))
        {
            Ok(s) => (Some(s), None),
            Err(why) => (None, Some(why)),
        }
    } else {
        (None, Some("the profile has numa off".to_owned()))
    };

    // Where there is no sampler, the PMU's node-load counters on the same threads.
    let (counting, node_counting_refused) = if mem.is_none() && profile.probes.numa {
        match counting::NodeEvents::chosen().and_then(|e| counting::Counting::open(e, &tids)) {
            Ok(c) => (Some(c), None),
            Err(why) => (None, Some(why)),
        }
    } else {
        (None, None)
    };
    phases.mark("PMU sampler");
    let mut sample_period_ns = 0;
    if profile.sampling.hz > 0 {
        sample_period_ns = 1_000_000_000 / u64::from(profile.sampling.hz);
        let name = names::PERF_EVENT_CPU_CLOCK;
        load_program::<PerfEvent>(&mut ebpf, name)?;
        match profile.sampling.scope {
            SampleScope::Cpu => sample_cpus(&mut ebpf, sample_period_ns, &mut links)?,
            SampleScope::Thread => {
                for t in targets {
                    sample_threads(&mut ebpf, &host, t.pid, sample_period_ns, &mut links)?;
                }
            }
        }
    }
    phases.mark("sampling clocks");

    // The loading's freed memory returned before the ring buffers are mapped (they count
    // in the process's memory, twice their size: the kernel maps their data twice).
    host::release_free_memory();
    let rings = rings::Rings::take(&mut ebpf, shards)?;
    let counters = PerCpuArray::try_from(
        ebpf.take_map(names::COUNTERS)
            .ok_or_else(|| missing_map(names::COUNTERS))?,
    )
    .map_err(map_error(names::COUNTERS))?;
    let target_costs = PerCpuArray::try_from(
        ebpf.take_map(names::TARGET_COSTS)
            .ok_or_else(|| missing_map(names::TARGET_COSTS))?,
    )
    .map_err(map_error(names::TARGET_COSTS))?;

    // Without hinting faults, where the targets' memory is tells the remote share.
    let node_distances = host.node_distances();
    let numa_balancing: Option<u32> = host
        .read("proc/sys/kernel/numa_balancing")
        .and_then(|v| v.trim().parse().ok());
    // Or where a target's memory is under a policy balancing does not scan (issue 52: a
    // rank started under `numactl --membind` read `remote_memory` null every step).
    let numa_maps_why = if !profile.probes.numa || node_distances.len() <= 1 {
        None
    } else if numa_balancing == Some(0) {
        Some("NUMA balancing is off (kernel.numa_balancing = 0)".to_owned())
    } else if let Some(why) = &numa_hints_refused {
        Some(format!("NUMA hinting faults are not traced ({why})"))
    } else {
        targets.iter().find_map(|t| {
            let (policy, kib) = host.numa_maps_unscanned(t.pid)?;
            Some(format!(
                "pid {}'s memory is under the policy {policy} ({} MiB resident), which NUMA \
                 balancing does not scan",
                t.pid,
                kib / 1024
            ))
        })
    };
    let resident = numa_maps_why.is_some();
    let (kernel_release, hostname) = host::uname();
    let mut header = Header {
        format_version: FORMAT_VERSION,
        agent_version: env!("CARGO_PKG_VERSION").to_owned(),
        kernel_release,
        hostname,
        clock: ClockRef {
            monotonic_ns: host::clock_ns(libc::CLOCK_MONOTONIC),
            realtime_ns: host::clock_ns(libc::CLOCK_REALTIME),
        },
        cpu_nodes: host.cpu_nodes(),
        profile: profile.name.clone(),
        targets: infos
            .into_iter()
            .map(|(t, _, probes)| {
                let py = py_infos.remove(&t.pid);
                target_info(&host, t, probes, py)
            })
            .collect(),
        sample_period_ns,
        fault_handler_ranges,
        sched_yield_ranges,
        page_faults_off: !profile.probes.page_faults,
        step_nvtx: None,
        fault_timing,
        fault_timing_refused,
        node_distances,
        numa_balancing,
        numa_maps_every_s: resident.then_some(host::NUMA_MAPS_EVERY.as_secs()),
        numa_maps_why,
        numa_hints_refused,
        mem_sampler: mem.as_ref().map(|m| m.sampler.describe()),
        mem_sampling_refused,
        cpu_khz: mem.as_ref().and_then(|_| crate::pmu::cpu_khz()),
        node_counters: counting.as_ref().map(|c| {
            format!(
                "{}, read every {} ms",
                c.events.description,
                super::DRAIN_EVERY.as_millis()
            )
        }),
        node_counting_refused,
        bpf_stats_refused,
        offcpu_stacks,
        offcpu_min_ns,
        attach_phases_us: Vec::new(),
        uprobes: Some(uprobes.describe().to_owned()),
        python_walk,
        sched_tracepoints,
        infiniband_every_ms: (!infiniband_ports.is_empty())
            .then(|| u64::try_from(IB_FAST_EVERY.as_millis()).unwrap_or(u64::MAX)),
        infiniband_ports,
        infiniband_refused,
        gpus: Vec::new(),
        gpu_every_ms: None,
        gpus_chosen: None,
        gpu_refused: None,
    };
    let found = gpu_reader.as_mut().map_or_else(
        || Err("the profile has gpu off".to_owned()),
        super::gpu::GpuReader::found,
    );
    match found {
        Ok((gpus, how)) => {
            header.gpus = gpus;
            header.gpus_chosen = Some(how);
            header.gpu_every_ms =
                Some(u64::try_from(super::gpu::GPU_EVERY.as_millis()).unwrap_or(0));
            header.gpu_refused = None;
        }
        Err(why) => {
            header.gpu_refused = Some(why);
            gpu_reader = None;
        }
    }
    phases.mark("maps and header");
    header.attach_phases_us = phases.done;
    Ok(Attached {
        comms: comms::CommSizes::new(&header.targets),
        accounting,
        target_costs,
        traps: None,
        sampling_cost: None,
        calibration: None,
        raw_sched,
        armed,
        baseline,
        calibration_runs: BTreeMap::new(),
        mem,
        counting,
        resident,
        resident_read: None,
        ib_files,
        ib_early,
        ib_reader: None,
        gpu_reader,
        ib_written: super::readings::IbWritten::default(),
        ebpf: Some(ebpf),
        uprobes,
        links,
        logger,
        targets: map_targets,
        stopped_ns: None,
        rings,
        counters,
        header,
        pids: targets.iter().map(|t| t.pid).collect(),
        attach_time: started.elapsed(),
        profile: profile.clone(),
        probed,
        follow: None,
        python: py_targets,
    })
}
