//! The aggregator's totals and epochs on hand-made events.

use super::*;
use crate::event::{Call, Task};

/// Totals from a damaged recording saturate instead of overflowing: the fuzzer found
/// two calls whose byte counts add past u64::MAX (a panic with overflow checks on).
#[test]
fn totals_saturate() {
    let mut agg = Aggregator::new(Header::default());
    for func in [Func::AllReduce, Func::AllReduce, Func::CuStreamSynchronize] {
        agg.push(&Event::Call(Call {
            bytes: Some(u64::MAX - 1),
            comm: Some(1),
            ..Call::new(
                Task {
                    tgid: 1,
                    tid: 1,
                    cpu: 0,
                },
                func,
                0,
                u64::MAX,
            )
        }));
    }
    let out = agg.finish(StepRule::Auto);
    assert_eq!(out.summary.nccl.bytes, u64::MAX);
    assert_eq!(
        out.summary.nccl.by_op["AllReduce"].enqueue_ns,
        Some(u64::MAX)
    );
}

/// summary.json `memory.numastat_pages`: each node's counters from the first reading
/// to the last; null with a single reading or none, never zeros made up.
#[test]
fn numastat_from_first_to_last_reading() {
    let reading = |hit: u64, other: u64| Meta::Numastat {
        at_ns: 0,
        nodes: vec![
            (
                0,
                vec![("numa_hit".into(), hit), ("other_node".into(), other)],
            ),
            (1, vec![("numa_hit".into(), 7)]),
        ],
    };
    let numastat = |readings: Vec<Meta>| {
        let mut agg = Aggregator::new(Header::default());
        for r in readings {
            agg.meta(r);
        }
        agg.finish(StepRule::Auto).summary.memory.numastat_pages
    };
    assert_eq!(numastat(vec![]), None);
    assert_eq!(numastat(vec![reading(100, 5)]), None);
    let both = numastat(vec![reading(100, 5), reading(150, 9), reading(400, 2)]).unwrap();
    assert_eq!(both["node0"]["numa_hit"], 300);
    // A counter that went back (5 → 2) is left out, not made 0.
    assert!(!both["node0"].contains_key("other_node"));
    assert_eq!(both["node1"]["numa_hit"], 0);
}

/// Issue 22: where the kernel counted the programs in windows, the call programs on
/// probes made for the targets take their runs from the recording's calls (every call
/// record and the lost ones for the entry program, the returned ones for the return
/// program); with no window between the two readings the cost is null and says so.
#[test]
fn call_runs_from_the_recording() {
    let entry = nccltrace_common::names::UPROBE_LIB_CALL;
    let ret = nccltrace_common::names::URETPROBE_LIB_CALL;
    let reading = |at_ns: u64, accounted_ns: u64, runs: u64| {
        Meta::ProgramStats(crate::record::ProgramReading {
            at_ns,
            accounted_ns: Some(accounted_ns),
            programs: vec![
                (entry.into(), runs, runs * 300),
                (ret.into(), runs, runs * 500),
            ],
            ..crate::record::ProgramReading::default()
        })
    };
    let run = |last: Meta| {
        let mut agg = Aggregator::new(Header::default());
        agg.meta(reading(1_000, 0, 0));
        let task = Task {
            tgid: 1,
            tid: 1,
            cpu: 0,
        };
        for (i, returned) in [true, true, false].into_iter().enumerate() {
            let start = 2_000 + i as u64 * 1_000;
            agg.push(&Event::Call(Call {
                ret: returned.then_some(0),
                ..Call::new(task, Func::AllReduce, start, start + 100)
            }));
        }
        agg.meta(last);
        agg.meta(Meta::End {
            end_monotonic_ns: 4_000_000_000,
            reason: "every target exited".into(),
            lost_by_kind: BTreeMap::from([("call".to_owned(), 2)]),
            counters: BTreeMap::new(),
            attach_ns: 0,
            agent_peak_rss_kb: 0,
        });
        agg.finish(StepRule::Auto).summary.agent
    };
    // A quarter of the run counted: 10 runs of each in the windows.
    let agent = run(reading(4_000_001_000, 1_000_000_000, 10));
    let bpf = agent.bpf.unwrap();
    assert_eq!(bpf.accounted_share, Some(0.25));
    let runs = |name: &str| bpf.programs.iter().find(|p| p.name == name).unwrap().runs;
    assert_eq!(runs(entry), 3 + 2);
    assert_eq!(runs(ret), 2);
    // No window between the readings.
    let agent = run(reading(4_000_001_000, 0, 0));
    assert!(agent.bpf.is_none());
    let why = agent.bpf_unmeasured.unwrap();
    assert!(why.contains("no window"), "{why}");
}
