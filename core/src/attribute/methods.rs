//! How each category was measured, or why not, in words (steps.json `methods`).

use std::fmt::Write as _;

use super::{Methods, Timeline, Unmeasured};

impl Timeline {
    /// How each category was measured, or why not.
    pub(super) fn methods(&self, unmeasured: Unmeasured) -> Methods {
        let nodes: std::collections::BTreeSet<i32> =
            self.cpu_nodes.iter().copied().filter(|n| *n >= 0).collect();
        let mut nccl_wait: String = if self.sync_probed {
            format!(
                "an upper bound: time inside CUDA sync calls (cuStreamSynchronize, \
                 cuEventSynchronize, cuCtxSynchronize and their _ptsz forms) while a \
                 collective of a communicator of more than one rank (or of unknown size) \
                 issued before them is outstanding, spinning or blocked, and inside NCCL calls \
                 that block the host. A sync waits for all work queued before it, compute \
                 kernels too: without the GPU's own counters the wait for compute queued \
                 before the collectives cannot be cut out of it. {}",
                self.comms.describe()
            )
        } else if unmeasured.nccl_wait_lower_bound {
            "a lower bound: no CUDA sync function was probed (the profile has cuda_sync \
                 off, or no libcuda was mapped), so only NCCL calls that block the host are \
                 seen; waits inside CUDA syncs count as compute (spinning) or other_offcpu \
                 (blocking). Use the default profile to measure them"
                .into()
        } else {
            "not measured: no CUDA sync function was probed (the profile has cuda_sync \
                 off, or no libcuda was mapped), so waits for NCCL cannot be told from other \
                 work: a spinning wait counts as compute, a blocking one as other_offcpu. Use \
                 the default profile to measure it"
                .into()
        };
        if self.entry_only_seen {
            nccl_wait.push_str(
                "; collectives, point-to-point calls and ncclGroupStart were traced at entry \
                 only (profile call_returns = \"needed\"): a host blocked inside one of them \
                 is not seen as nccl_wait",
            );
        }
        let gpu_wait = if self.sync_probed {
            let driver = if self.yield_ranges.is_empty() || self.sample_period_ns == 0 {
                "the driver's waits outside syncs (for room in a full launch queue) are not \
                 seen: no sched_yield in /proc/kallsyms, or sampling is off"
                    .to_owned()
            } else {
                format!(
                    "and, from on-CPU samples, time the CUDA driver spent yielding the CPU \
                     (in sched_yield called from libcuda) outside syncs: waiting for the GPU, \
                     for room in a full launch queue or in a synchronous copy ({} samples \
                     over the run), a sampling period each. A lower bound: the driver's \
                     polling between its yields stays compute; per step, gpu_wait_error_ns \
                     is two standard errors of the step's count plus one period",
                    self.driver_yields_seen
                )
            };
            format!(
                "time inside CUDA sync calls with no collective of a multi-rank communicator \
                 outstanding, spinning or blocked: the host waits for the GPU's own work \
                 (kernels, copies, collectives of one-rank communicators); {driver}"
            )
        } else {
            "not measured: no CUDA sync function was probed (the profile has cuda_sync off, or \
             no libcuda was mapped): a host spinning for the GPU counts as compute, one asleep \
             as other_offcpu. Use the default profile to measure it"
                .into()
        };
        Methods {
            gpu_wait,
            nccl_wait,
            page_fault: self.fault_method(),
            remote_memory: self.remote_method(nodes.len()),
            remote_memory_estimated: self.mem_khz.is_none()
                && nodes.len() > 1
                && self.numa_hints_seen + self.resident_seen + self.node_loads_seen > 0,
            infiniband: self.infiniband_method(),
            gpu: self.gpu_method(),
        }
    }

    /// How the steps' GPU shares were obtained, or why there are none.
    fn gpu_method(&self) -> String {
        let r = &self.gpu_read;
        if let Some(why) = &r.refused {
            return format!("not read: {why}");
        }
        let every = r
            .every_ms
            .map_or_else(|| "periodically".to_owned(), |ms| format!("every {ms} ms"));
        format!(
            "NVML's GPU utilization samples of {} GPU{} ({}), read {every}: each sample is the \
             share of the interval since the one before in which a kernel ran (not how many \
             SMs it used); a step's busy weighs the samples by how much of each lies inside \
             it, and from_ns..to_ns is the span they cover: wider than the step where NVML \
             samples less often than the steps come (every 200 ms on an H100), the share of \
             that window then, not of the step alone",
            r.gpus,
            if r.gpus == 1 { "" } else { "s" },
            r.chosen.as_deref().unwrap_or("as chosen at attach")
        )
    }

    /// How the steps' InfiniBand deltas were obtained, or why there are none.
    fn infiniband_method(&self) -> String {
        let ports = &self.infiniband.ports;
        if ports.is_empty() {
            return format!(
                "not read: {}",
                self.infiniband_refused
                    .as_deref()
                    .unwrap_or("no InfiniBand port was found")
            );
        }
        let every = self
            .infiniband_every_ms
            .map_or_else(|| "periodically".to_owned(), |ms| format!("every {ms} ms"));
        let mut text = format!(
            "estimated: the counters of port{} {} (node-wide: every process's traffic) read \
             {every}, each interpolated linearly at the step's start and end; traffic within \
             a reading interval is taken as even. port_xmit_data and port_rcv_data (4-byte \
             words) are given in bytes",
            if ports.len() == 1 { "" } else { "s" },
            ports.join(", "),
        );
        if self.infiniband.unknown_port > 0 {
            let _ = write!(
                text,
                "; {} readings named a port the recording does not list and were left out",
                self.infiniband.unknown_port
            );
        }
        text
    }

    /// `remote_memory` from the rank thread's counted loads.
    fn counted_method(&self, counters: &str, nodes: usize) -> String {
        let multiplexed = if self.node_loads_multiplexed > 0 {
            format!(
                "; {} of {} readings were of counters the PMU multiplexed (scaled by \
                 enabled / running time)",
                self.node_loads_multiplexed, self.node_loads_seen
            )
        } else {
            String::new()
        };
        if self.node_loads_seen == 0 {
            return format!(
                "not measured: {counters} were opened but no reading of a target thread came \
                 back"
            );
        }
        if nodes <= 1 {
            return format!(
                "not measured: the host has one NUMA node, so nothing is remote; loads were \
                 counted (by {counters}) and steps' remote_access has the counts{multiplexed}"
            );
        }
        format!(
            "estimated from the rank thread's loads counted by {counters}: per step, the \
             share of its DRAM loads a remote node served (the counts interpolated linearly \
             between readings at the step's start and end) × its on-CPU compute × (1 − \
             local/remote SLIT distance, averaged over the other nodes). Every load is \
             counted, none sampled; the time is an upper end (it assumes the on-CPU time is \
             bound by memory latency, and the SLIT ratio is the latency ratio){multiplexed}"
        )
    }

    /// How `remote_memory` was estimated, or why not.
    pub(super) fn remote_method(&self, nodes: usize) -> String {
        if let (Some(sampler), Some(khz)) = (&self.mem_sampler, self.mem_khz) {
            return format!(
                "measured by {sampler}: the rank thread's user loads sampled one in {} with \
                 their latency and data source; per step, Σ latency × {} of the samples a \
                 remote node's DRAM served, at {} MHz, out of nccl_wait for the samples taken \
                 while the thread spun waiting for NCCL and out of compute for the rest. An \
                 upper end: loads that overlap are each counted whole",
                crate::pmu::SAMPLE_PERIOD,
                crate::pmu::SAMPLE_PERIOD,
                khz / 1000
            );
        }
        if let Some(counters) = &self.node_counters {
            return self.counted_method(counters, nodes);
        }
        let no_pmu = match (&self.mem_sampler, &self.mem_sampling_refused) {
            (Some(sampler), _) => format!(
                "{sampler} was sampled, but the CPU's frequency is unknown (no cpufreq, no \
                 cpu MHz in /proc/cpuinfo), so its latencies cannot be turned into time"
            ),
            (None, Some(why)) => why.clone(),
            (None, None) => "no PMU memory sampler was opened".to_owned(),
        };
        let no_pmu = match &self.node_counting_refused {
            Some(why) => format!("{no_pmu}; no node-load counters either: {why}"),
            None => no_pmu,
        };
        let no_pmu = no_pmu.as_str();
        if nodes <= 1 {
            return format!(
                "not measured: the host has one NUMA node, so nothing is remote ({no_pmu})"
            );
        }
        if self.numa_hints_seen == 0 && self.resident_seen > 0 {
            let why = self
                .numa_maps_why
                .as_deref()
                .unwrap_or("NUMA balancing is off");
            return format!(
                "estimated from the target's resident pages per node (/proc/PID/numa_maps, \
                 read every {} s because {why}, so no access is sampled): the \
                 step's on-CPU compute × the share of those pages on other nodes than the \
                 rank thread's, each weighted by 1 − local/remote SLIT distance, from the \
                 latest reading before the step's end. A weaker proxy than hinting faults: \
                 it weighs every resident page the same, touched or not; an upper end as \
                 well (it assumes the on-CPU time is bound by memory latency). {no_pmu}",
                crate::procfs::NUMA_MAPS_EVERY.as_secs()
            );
        }
        if let Some(why) = &self.numa_hints_refused {
            return format!("not measured: NUMA hinting faults were not traced ({why}); {no_pmu}");
        }
        if self.numa_hints_seen == 0 {
            let why = if self.numa_balancing == Some(0) {
                "automatic NUMA balancing is off (kernel.numa_balancing = 0), so the kernel \
                 samples no memory accesses"
                    .to_owned()
            } else {
                format!(
                    "no NUMA hinting fault of a target thread was seen (kernel.numa_balancing \
                     = {}; the kernel scans a task's memory once a scan period, 1 s or more, \
                     after it has run for a while)",
                    self.numa_balancing
                        .map_or_else(|| "unknown".to_owned(), |v| v.to_string())
                )
            };
            return format!("not measured: {why}; {no_pmu}");
        }
        format!(
            "estimated from NUMA hinting faults (the kernel's own sample of memory accesses, \
             one per page per balancing scan): the step's on-CPU compute × the remote share \
             of the rank thread's hinting-fault pages (the step's own when it has {} or more, \
             else the latest scan's burst before its end, faults under {} ms apart, at most \
             {} pages) weighted by 1 − local/remote SLIT distance. \
             An upper end: it assumes the on-CPU time is bound by memory latency and the SLIT \
             ratio is the latency ratio. Null before the thread's first hinting fault; \
             {no_pmu}",
            super::remote::MIN_STEP_PAGES,
            super::remote::BURST_GAP_NS / 1_000_000,
            super::remote::WINDOW_PAGES
        )
    }

    /// How `page_fault` was measured, for `methods.page_fault`.
    pub(super) fn fault_method(&self) -> String {
        let why_not = self
            .fault_timing_refused
            .as_deref()
            .unwrap_or("fentry/fexit not tried");
        if self.faults_timed {
            let timed = "fentry/fexit on handle_mm_fault: each user fault of a target thread \
                         timed from the exception's entry (page_fault_user) to the handler's \
                         return, on the CPU or blocked inside it; the way out and back in \
                         between faults of one instruction, when shorter than the fault's time \
                         on the CPU, counted with them";
            if self.sample_period_ns > 0 {
                format!(
                    "{timed}; the return to user mode and the retried access, which no probe \
                     sees, estimated from on-CPU samples every {} µs on the instruction that \
                     just faulted, times the period",
                    self.sample_period_ns / 1000
                )
            } else {
                format!(
                    "{timed}; the return to user mode and the retried access are not counted \
                     (on-CPU sampling is off in this profile)"
                )
            }
        } else if self.sample_period_ns > 0 && self.fault_ranges.is_empty() {
            "not measured: the page-fault handler's addresses were not found in \
             /proc/kallsyms (unreadable, or kernel.kptr_restrict hides them), so samples in \
             it cannot be told; fault time stays in compute"
                .into()
        } else if self.sample_period_ns > 0 && self.fault_pairs_seen {
            format!(
                "in steps with {} or more faults back to back (consecutive faults of a thread \
                 at instructions at most {} bytes apart, under {} µs apart, with no switch \
                 between: a loop over fresh pages; the kernel's page_fault_user tracepoint \
                 counts them), measured between their entries, each gap the first fault's \
                 cost, and the step's other faults at the mean of its gaps; \
                 page_fault_error_ns is two standard errors of that mean times those faults. \
                 Elsewhere on-CPU samples every {} µs whose kernel stack is in the page-fault \
                 handler, times the period, page_fault_error_ns two standard errors of their \
                 count plus a period ({why_not})",
                super::MIN_PAIRS,
                super::BACK_TO_BACK_BYTES,
                super::BACK_TO_BACK_NS / 1000,
                self.sample_period_ns / 1000
            )
        } else if self.sample_period_ns > 0 {
            format!(
                "on-CPU samples every {} µs whose kernel stack is in the page-fault handler, \
                 times the period; page_fault_error_ns two standard errors of their count \
                 plus a period ({why_not})",
                self.sample_period_ns / 1000
            )
        } else {
            format!("not measured: on-CPU sampling is off in this profile ({why_not})")
        }
    }
}
