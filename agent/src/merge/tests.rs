//! The merge's unit tests.

use super::hosts::counterpart;
use super::input::{KEEP, Reading, WINDOW_CAP, WINDOW_NS};
use super::*;
use crate::event::{Call, CallExtra, Func, Task};
use align::Kept;

fn call(func: Func, start: u64, end: u64, comm: u64) -> Call {
    Call {
        count: Some(1),
        datatype: Some(7),
        bytes: Some(4),
        comm: Some(comm),
        ..Call::new(Task::default(), func, start, end)
    }
}

/// Asynchronous collectives are seen complete when the next synchronisation returns;
/// ones never followed by one are left out; only the first-used communicator counts.
/// Without any synchronisation in the recording, the call's own end is its completion.
#[test]
fn completion_seen_at_the_next_sync() {
    let mut r = Reading::default();
    r.call(&call(Func::AllReduce, 10, 12, 0xa), 0);
    r.call(&call(Func::AllReduce, 20, 22, 0xb), 0);
    r.call(&call(Func::AllReduce, 30, 32, 0xa), 0);
    r.call(&call(Func::CuStreamSynchronize, 40, 90, 0), 0);
    r.call(&call(Func::AllReduce, 100, 102, 0xa), 0);
    let seen = r.finish().swap_remove(0).kept;
    assert_eq!(
        seen.iter()
            .map(|(i, s)| (i, s.arrival_ns, s.done_ns))
            .collect::<Vec<_>>(),
        [(0, 10, 90), (1, 30, 90)]
    );
    let mut r = Reading::default();
    r.call(&call(Func::AllReduce, 10, 12, 0xa), 0);
    assert_eq!(r.finish()[0].kept.get(0).unwrap().done_ns, 12);
}

/// A rank of 200 s at 1,000 collectives a second keeps at most KEEP of them, in whole
/// wall-clock windows (the first always), spread over the run: memory bounded at any
/// length, and every host keeps the same windows. A burst in one window keeps its
/// first WINDOW_CAP.
#[test]
fn long_runs_keep_windows() {
    let mut r = Reading::default();
    for i in 0..200_000u64 {
        let t = 5_000_000_000 + i * 1_000_000;
        r.call(&call(Func::AllReduce, t, t + 10, 0xa), 0);
    }
    assert_eq!(r.comms[0].2.every, 8);
    let kept = r.finish().swap_remove(0).kept;
    assert!(
        kept.len() <= KEEP && kept.len() > KEEP / 2,
        "{}",
        kept.len()
    );
    let windows: Vec<u64> = kept
        .runs
        .iter()
        .map(|(first, _)| (5_000_000_000 + *first as u64 * 1_000_000) / WINDOW_NS)
        .collect();
    assert_eq!(windows[0], 5);
    assert!(windows[1..].iter().all(|w| w % 8 == 0), "{windows:?}");
    assert!(kept.runs[1..].iter().all(|(_, run)| run.len() == 1000));
    assert_eq!(kept.get(3_000).map(|s| s.arrival_ns), Some(8_000_000_000));
    // 100,000 in one second: its first WINDOW_CAP.
    let mut r = Reading::default();
    for i in 0..100_000u64 {
        r.call(&call(Func::AllReduce, i * 10_000, i * 10_000 + 10, 0xa), 0);
    }
    assert_eq!(r.finish()[0].kept.len(), WINDOW_CAP);
}

/// Communicators are named by the unique id of the CommInitRank seen for them; a rank
/// is paired through the communicator of the reference's id, else its first-used, and
/// refused when its named communicators are all others.
#[test]
fn communicators_paired_by_unique_id() {
    let mut r = Reading::default();
    let init = |handle: u64, id: u64| Call {
        extra: Some(Box::new(CallExtra {
            new_comm: Some(handle),
            comm_id: Some(id),
            ..CallExtra::default()
        })),
        ..call(Func::CommInitRank, 1, 2, 0)
    };
    r.call(&init(0xb, 42), 0);
    r.call(&call(Func::AllReduce, 10, 12, 0xa), 0);
    r.call(&call(Func::AllReduce, 20, 22, 0xb), 0);
    let comms = r.finish();
    assert_eq!(
        comms.iter().map(|c| c.unique_id).collect::<Vec<_>>(),
        [None, Some(42)]
    );
    let named = |id| Communicator {
        unique_id: id,
        kept: Kept::default(),
    };
    assert_eq!(counterpart(&named(Some(42)), &comms), Ok(1));
    assert_eq!(counterpart(&named(None), &comms), Ok(0));
    assert_eq!(counterpart(&named(Some(7)), &comms), Ok(0));
    let other = [named(Some(9)), named(Some(42))];
    assert_eq!(
        counterpart(&named(Some(7)), &other),
        Err(AlignError::OtherCommunicator { id: 7 })
    );
}

/// A host's time on the merged axis: its wall clock, the offset, and the drift from
/// where the offset was measured.
#[test]
fn host_time_on_the_merged_axis() {
    let clock = HostClock {
        drift_ppm: 10.0,
        offset_at_unix_ns: 2_000_000_000,
        ..HostClock::fixed("b", -1_700_000)
    };
    assert_eq!(
        clock.to_merged(1_000_000_000, 1_000_000_000),
        2_000_000_000 - 1_700_000
    );
    // One second later: 10 µs of drift.
    assert_eq!(
        clock.to_merged(1_000_000_000, 2_000_000_000),
        3_000_000_000 - 1_700_000 + 10_000
    );
}

/// Two hosts' traces joined: times moved by each host's offset onto one axis whose 0 is
/// the earliest event, pids moved apart, process names prefixed with the host.
#[test]
fn traces_joined_on_one_axis() {
    let dir = tempfile::tempdir().unwrap();
    let host = |name: &str, zero: u64| {
        let path = dir.path().join(format!("{name}.json"));
        std::fs::write(
            &path,
            format!(
                "{{\"displayTimeUnit\":\"ns\",\"traceEvents\":[\n\
                 {{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":7,\"args\":{{\"name\":\"rank 0\"}}}},\n\
                 {{\"ph\":\"X\",\"name\":\"AllReduce\",\"pid\":7,\"tid\":8,\"ts\":1.5,\"dur\":2}}\n\
                 ],\"otherData\":{{\"monotonic_ns_at_0\":{zero}}}}}\n"
            ),
        )
        .unwrap();
        path
    };
    let (ta, tb) = (host("a", 1_000_000), host("b", 5_000_000));
    let (ca, cb) = (HostClock::fixed("a", 0), HostClock::fixed("b", -4_000_000));
    let parts = [
        trace::Part {
            trace: &ta,
            wall_ns: 0,
            clock: &ca,
        },
        trace::Part {
            trace: &tb,
            wall_ns: 0,
            clock: &cb,
        },
    ];
    let out = dir.path().join("trace.json");
    merge_traces(&out, &parts, &serde_json::json!({"reference": "a"})).unwrap();
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    let events = v["traceEvents"].as_array().unwrap();
    assert_eq!(events.len(), 4);
    // b's 0 is 5 ms on its clock, 1 ms on a's: both slices at 1.5 µs.
    assert_eq!(events[1]["ts"], 1.5);
    assert_eq!(events[3]["ts"], 1.5);
    assert_eq!(events[3]["pid"], trace::PID_SPAN + 7);
    assert_eq!(events[2]["args"]["name"], "b: rank 0");
    assert_eq!(v["otherData"]["reference"], "a");
}
