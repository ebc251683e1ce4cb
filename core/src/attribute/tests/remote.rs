//! `remote_memory` per step: measured from PMU samples, estimated from resident pages and
//! from counted loads, carved out of the categories it overlaps.

use super::*;

/// [`header`] of a host whose PMU sampled loads (PEBS), at 2 GHz.
fn pebs_header() -> Header {
    Header {
        mem_sampler: Some("Intel PEBS load latency (cpu/mem-loads, ldlat=30)".into()),
        mem_sampling_refused: None,
        cpu_khz: Some(2_000_000),
        ..header()
    }
}

/// Where the PMU sampled loads, `remote_memory` is measured from the rank thread's
/// remote-DRAM samples (latency × period at the CPU's frequency), carved out of
/// compute, and labelled measured; samples pushed out of time order land in their step.
#[test]
fn remote_memory_measured_from_pmu_samples() {
    use nccltrace_common::kind;
    let mut tl = Timeline::new(&Setup::from(&pebs_header()));
    tl.push(&call(Func::AllReduce, 100, 200));
    // perf_mem_data_src: a load served by DRAM, remote or local (level number + bit).
    let dram = |remote: u64| 2 | (13 << 33) | (remote << 37);
    let sample = |ts_ns, remote, weight| Event::MemSample {
        ts_ns,
        task: task(10),
        weight,
        data_src: dram(remote),
    };
    for e in [
        sample(13_000_000, 0, 300),
        sample(3_000_000, 1, 100),
        sample(2_000_000, 1, 100),
        sample(4_000_000, 1, 100),
        sample(12_000_000, 0, 300),
    ] {
        tl.push(&e);
    }
    let (report, _) = tl.finish(20_000_000, StepRule::Window(10_000_000));
    assert_eq!(report.steps.len(), 2);
    let (far, near) = (&report.steps[0], &report.steps[1]);
    // 3 samples × 100 cycles × 20,000 loads each at 2 GHz: 3 ms.
    assert_eq!(far.categories.remote_memory, Some(3_000_000));
    assert_eq!(far.categories.compute + 3_000_000, far.wall_ns);
    let loads = far.remote_loads.as_deref().unwrap();
    assert_eq!((loads.dram_samples, loads.remote_samples), (3, 3));
    // Local DRAM only: measured as none, not unknown.
    assert_eq!(near.categories.remote_memory, Some(0));
    assert_eq!(near.remote_loads.as_deref().unwrap().share(), Some(0.0));
    assert!(!report.methods.remote_memory_estimated);
    assert!(
        report
            .methods
            .remote_memory
            .starts_with("measured by Intel PEBS"),
        "{}",
        report.methods.remote_memory
    );
    assert_eq!(Event::kind_name(kind::MEM_SAMPLE), "mem_sample");
    // No sampler: not measured, and the reason the host gave.
    let mut h = header();
    h.mem_sampling_refused = Some("no PMU memory sampling: only software".into());
    let mut tl = Timeline::new(&Setup::from(&h));
    tl.push(&call(Func::AllReduce, 100, 200));
    tl.push(&sample(3_000_000, 1, 500));
    let (report, _) = tl.finish(20_000_000, StepRule::Window(10_000_000));
    assert_eq!(report.steps[0].categories.remote_memory, None);
    assert!(report.steps[0].remote_loads.is_none());
    assert!(
        report
            .methods
            .remote_memory
            .contains("no PMU memory sampling: only software"),
        "{}",
        report.methods.remote_memory
    );
}

/// Issue 23: a measured remote load the rank thread stalled on while it spun in a CUDA
/// sync waiting for NCCL is carved out of `nccl_wait`, not out of compute; the step's
/// categories still sum to its wall time.
#[test]
fn remote_loads_while_waiting_for_nccl_come_out_of_nccl_wait() {
    let mut tl = Timeline::new(&Setup::from(&pebs_header()));
    let remote_dram = 2 | (13 << 33) | (1 << 37);
    let sample = |ts_ns| Event::MemSample {
        ts_ns,
        task: task(10),
        weight: 50,
        data_src: remote_dram,
    };
    // The all-reduce issued at 1 ms, the sync spinning 2..8 ms: nccl_wait 6 ms.
    for e in [
        call(Func::AllReduce, 1_000_000, 1_100_000),
        sample(500_000),
        sample(4_000_000),
        sample(5_000_000),
        call(Func::CuStreamSynchronize, 2_000_000, 8_000_000),
    ] {
        tl.push(&e);
    }
    let (report, _) = tl.finish(10_000_000, StepRule::Window(10_000_000));
    let c = &report.steps[0].categories;
    // Each sample: 50 cycles × 20,000 loads at 2 GHz = 0.5 ms.
    assert_eq!(c.remote_memory, Some(1_500_000));
    assert_eq!(c.nccl_wait, 6_000_000 - 1_000_000);
    assert_eq!(c.compute, 4_000_000 - 500_000);
    assert_eq!(c.total(), 10_000_000);
}

/// With NUMA balancing off, the share comes from where the process's memory is
/// (numa_maps readings) seen from the node the rank thread runs on, the latest reading
/// before each step's end; labelled an estimate with that method.
#[test]
fn remote_memory_estimated_from_resident_pages() {
    let mut h = header();
    h.node_distances = vec![vec![10, 20], vec![20, 10]];
    h.numa_balancing = Some(0);
    let mut tl = Timeline::new(&Setup::from(&h));
    // The rank thread runs on CPU 0 (node 0) from the start.
    tl.push(&switch(50, false, 0));
    tl.push(&call(Func::AllReduce, 100, 200));
    let pages = |ts_ns, kib: Vec<u64>| Event::NumaPages {
        ts_ns,
        task: task(10),
        kib,
    };
    // Three quarters on node 1, then all moved to node 0.
    tl.push(&pages(1_000_000, vec![1 << 20, 3 << 20]));
    tl.push(&pages(12_000_000, vec![4 << 20, 0]));
    let (report, _) = tl.finish(20_000_000, StepRule::Window(10_000_000));
    assert_eq!(report.steps.len(), 2);
    let (far, near) = (&report.steps[0], &report.steps[1]);
    let share = far.remote_access.as_deref().unwrap().share();
    assert!((share - 0.75).abs() < 1e-9, "{share}");
    // Three quarters remote at SLIT 10/20: 37.5% of the on-CPU time.
    let c = &far.categories;
    let remote = c.remote_memory.unwrap();
    assert_eq!(remote, (c.compute + remote) * 375 / 1000);
    assert_eq!(near.remote_access.as_deref().unwrap().remote_pages, 0);
    assert_eq!(near.categories.remote_memory, Some(0));
    assert!(report.methods.remote_memory_estimated);
    assert!(
        report
            .methods
            .remote_memory
            .starts_with("estimated from the target's resident pages"),
        "{}",
        report.methods.remote_memory
    );
}

/// Issue 23: where the PMU counts loads by node (no sampler), each step's share is the
/// rank thread's counted remote loads over its DRAM loads, interpolated between the
/// readings (which come in out of order with the rest), and its estimated stall is carved
/// out of compute at the SLIT gap of the thread's node.
#[test]
fn remote_memory_estimated_from_counted_loads() {
    use nccltrace_common::kind;
    let mut h = header();
    h.node_distances = vec![vec![10, 20], vec![20, 10]];
    h.node_counters = Some("the PMU's node-loads and node-load-misses counters".into());
    let mut tl = Timeline::new(&Setup::from(&h));
    // The rank thread runs on CPU 0 (node 0) from the start.
    tl.push(&switch(50, false, 0));
    tl.push(&call(Func::AllReduce, 100, 200));
    // 1,000 DRAM loads a ms; remote: all of them for the first 10 ms, none after.
    let reading = |ms: u64| Event::NodeLoads {
        ts_ns: ms * 1_000_000,
        task: task(10),
        dram: ms * 1000,
        remote: ms.min(10) * 1000,
        multiplexed: false,
        full: true,
    };
    for ms in [5, 0, 10, 15, 20] {
        tl.push(&reading(ms));
    }
    let (report, _) = tl.finish(20_000_000, StepRule::Window(10_000_000));
    assert_eq!(report.steps.len(), 2);
    let (far, near) = (&report.steps[0], &report.steps[1]);
    let access = far.remote_access.as_deref().unwrap();
    assert_eq!((access.pages, access.remote_pages), (10_000, 10_000));
    // All remote at SLIT 10/20: half the on-CPU time.
    let c = &far.categories;
    let remote = c.remote_memory.unwrap();
    assert_eq!(remote, c.compute, "half remote stall, half compute");
    assert_eq!(c.total(), far.wall_ns);
    assert_eq!(near.remote_access.as_deref().unwrap().remote_pages, 0);
    assert_eq!(near.categories.remote_memory, Some(0));
    assert!(report.methods.remote_memory_estimated);
    assert!(
        report
            .methods
            .remote_memory
            .starts_with("estimated from the rank thread's loads counted by the PMU's"),
        "{}",
        report.methods.remote_memory
    );
    assert_eq!(Event::kind_name(kind::NODE_LOADS), "node_loads");
    // A reading of a multiplexed pair is said in the method.
    let mut tl = Timeline::new(&Setup::from(&h));
    tl.push(&switch(50, false, 0));
    tl.push(&call(Func::AllReduce, 100, 200));
    for ms in [0, 10] {
        tl.push(&Event::NodeLoads {
            ts_ns: ms * 1_000_000,
            task: task(10),
            dram: ms * 1000,
            remote: 0,
            multiplexed: ms == 10,
            full: true,
        });
    }
    let (report, _) = tl.finish(10_000_000, StepRule::Window(10_000_000));
    assert!(
        report.methods.remote_memory.contains("1 of 2 readings"),
        "{}",
        report.methods.remote_memory
    );
}

/// Regression (issue 18): summing categories dropped `remote_memory`.
#[test]
fn sums_keep_remote_memory() {
    let mut sum = Categories::default();
    for remote in [Some(5), None, Some(7)] {
        sum.add(&Categories {
            remote_memory: remote,
            ..Categories::default()
        });
    }
    assert_eq!(sum.remote_memory, Some(12));
}
