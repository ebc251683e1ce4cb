//! Where the record stage meets the attribution: what a recording's header tells the
//! attribution before the first event ([`crate::attribute::Setup`]), and a process the
//! recording adds while the run goes, and what trace.json says of the run
//! ([`crate::render::trace::RunInfo`]).

use crate::attribute::{Setup, Target};
use crate::event::{Func, Library};
use crate::record::{Header, TargetInfo};
use crate::render::trace::RunInfo;

impl From<&TargetInfo> for Target {
    fn from(t: &TargetInfo) -> Target {
        Target {
            pid: t.pid,
            threads: t.threads.clone(),
            env_rank: t.env_rank.clone(),
            world_size: t.world_size.clone(),
            parent_pid: t.parent_pid,
            // Whether a CUDA sync function was probed.
            syncs_probed: t
                .probes
                .iter()
                .any(|p| Func::from_name(&p.func).is_some_and(|f| f.library() == Library::Cuda)),
            job: t.job_key(),
            cuda_text: t
                .cuda_library
                .as_deref()
                .map(|lib| crate::procfs::executable_ranges(&t.maps_text, lib))
                .unwrap_or_default(),
        }
    }
}

impl From<&Header> for Setup {
    fn from(h: &Header) -> Setup {
        Setup {
            start_ns: h.clock.monotonic_ns,
            cpu_nodes: h.cpu_nodes.clone(),
            node_distances: h.node_distances.clone(),
            fault_handler_ranges: h.fault_handler_ranges.clone(),
            sched_yield_ranges: h.sched_yield_ranges.clone(),
            sample_period_ns: h.sample_period_ns,
            offcpu_min_ns: h.offcpu_min_ns,
            targets: h.targets.iter().map(Target::from).collect(),
            faults_timed: h.fault_timing.is_some(),
            fault_timing_refused: h.fault_timing_refused.clone(),
            numa_balancing: h.numa_balancing,
            numa_hints_refused: h.numa_hints_refused.clone(),
            numa_maps_why: h.numa_maps_why.clone(),
            mem_sampler: h.mem_sampler.clone(),
            mem_sampling_refused: h.mem_sampling_refused.clone(),
            cpu_khz: h.cpu_khz,
            node_counters: h.node_counters.clone(),
            node_counting_refused: h.node_counting_refused.clone(),
            infiniband_ports: h.infiniband_ports.clone(),
            infiniband_every_ms: h.infiniband_every_ms,
            infiniband_refused: h.infiniband_refused.clone(),
            gpu_read: crate::attribute::GpuRead {
                gpus: h.gpus.len(),
                every_ms: h.gpu_every_ms,
                chosen: h.gpus_chosen.clone(),
                refused: h.gpu_refused.clone(),
            },
        }
    }
}

impl From<&Header> for RunInfo {
    fn from(h: &Header) -> RunInfo {
        RunInfo {
            realtime_ns: h.clock.realtime_ns,
            kernel: h.kernel_release.clone(),
            host: h.hostname.clone(),
            agent_version: h.agent_version.clone(),
            processes: h.targets.iter().map(|t| (t.pid, t.comm.clone())).collect(),
        }
    }
}
