//! Tests of `trace`.

use super::*;
use crate::attribute::steps::Method;
use crate::attribute::{Categories, Methods, NcclCount};
use event::CallArgs;
use serde_json::Value;

/// A call slice's arguments with every field there, a Python line that needs
/// escaping among them: valid JSON with each value where it belongs.
#[test]
fn call_args_with_every_field() {
    let args = CallArgs {
        ret: Some(-3),
        bytes: Some(1 << 33),
        count: Some(7),
        datatype: Some("float32"),
        op: Some("sum"),
        peer_or_root: Some(-1),
        comm: Some(0xdead_beef),
        seq: Some(0),
        stream: Some(0x10),
        rank: Some(5),
        python: Some("step (\"train\".py:7)\n"),
    };
    let mut out = Vec::new();
    let mut o = Obj::new(&mut out).unwrap();
    args.write(&mut o).unwrap();
    o.end().unwrap();
    let v: Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(
        v,
        serde_json::json!({"ret": -3, "bytes": 1u64 << 33, "count": 7,
            "datatype": "float32", "op": "sum", "peer_or_root": -1,
            "comm": "0xdeadbeef", "seq": 0, "stream": "0x10", "rank": 5,
            "python": "step (\"train\".py:7)\n"})
    );
    let mut out = Vec::new();
    let mut o = Obj::new(&mut out).unwrap();
    CallArgs {
        ret: None,
        bytes: None,
        count: None,
        datatype: None,
        op: None,
        peer_or_root: None,
        comm: None,
        seq: None,
        stream: None,
        rank: None,
        python: None,
    }
    .write(&mut o)
    .unwrap();
    o.end().unwrap();
    assert_eq!(out, b"{}");
}

/// trace.json of a fixed timeline, against its golden file.
#[test]
fn trace_golden() {
    let (detail, _) = crate::render::fixture::detail();
    let run = RunInfo {
        processes: vec![(10, "trainer".into())],
        kernel: "6.18".into(),
        ..Default::default()
    };
    let categories = Categories {
        compute: 3_000_000,
        nccl_wait: 3_000_000,
        page_fault: 1_000_000,
        runqueue: 1_000_000,
        ..Categories::default()
    };
    let step = Step {
        nccl: NcclCount {
            collectives: 1,
            bytes: 4096,
        },
        faults: 3,
        migrations: 1,
        cross_node_migrations: 1,
        ..Step::new(0, 0, 8_000_000, categories)
    };
    let steps = StepsReport {
        clock: "",
        partial_steps_left_out: 0,
        epochs: 1,
        late_events_left_out: 0,
        method: Method::Auto,
        reason: String::new(),
        period: Some(1),
        rank_pid: Some(10),
        rank_tid: Some(10),
        jobs: Vec::new(),
        methods: Methods {
            gpu_wait: String::new(),
            nccl_wait: String::new(),
            page_fault: String::new(),
            remote_memory: String::new(),
            remote_memory_estimated: false,
            infiniband: String::new(),
            gpu: String::new(),
        },
        steps: vec![step],
        threads: vec![],
        other_offcpu_top_stacks: vec![],
        nccl_wait_top_stacks: Vec::new(),
        gpu_wait_top_stacks: Vec::new(),
        communicators: Vec::new(),
        idle: Vec::new(),
        workers: Vec::new(),
        one_rank_jobs: Vec::new(),
        // Regression (issue 18): the process was named "rank 0" (its position) while
        // summary.json said rank 3.
        ranks: vec![crate::attribute::ranks::RankReport {
            pid: 10,
            rank: 3,
            rank_source: "environment RANK".into(),
            nccl: crate::attribute::ranks::RankNccl {
                collectives: 1,
                bytes: 4096,
            },
            categories: Categories::default(),
            matched: None,
        }],
        straggler: None,
        stragglers_by_job: Vec::new(),
    };
    let mut out = Vec::new();
    write(&run, &detail, &steps, &mut out).unwrap();
    let text = String::from_utf8(out).unwrap();
    let parsed: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(
        parsed["traceEvents"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["cat"] == "nccl")
            .count(),
        1
    );
    assert!(text.contains("\"rank 3 (pid 10) trainer\""), "{text}");
    crate::render::golden("trace.json", &text);
}

/// The calls formatted on a second thread give the same file as written in one go, over
/// several epochs (collectives numbered across them) and with or without steps before
/// the calls (the first event has no comma before it).
#[test]
fn calls_formatted_aside_give_the_same_file() {
    let (detail, _) = crate::render::fixture::detail();
    assert!(!detail.calls.is_empty());
    let epoch = |k: u64| {
        let mut d = detail.clone();
        if k > 0 {
            // The threads' pieces once: the calls are what this is about.
            d.threads.clear();
        }
        d.calls = (0..PARALLEL as u64 + 7)
            .flat_map(|i| {
                detail.calls.iter().map(move |c| {
                    let mut c = c.clone();
                    c.start_ns += (k * 10_000 + i) * 1_000;
                    c.end_ns += (k * 10_000 + i) * 1_000;
                    c
                })
            })
            .collect();
        d
    };
    let steps = |n: usize| -> Vec<Step> {
        (0..n)
            .map(|i| {
                let categories = Categories {
                    compute: i as u64,
                    ..Categories::default()
                };
                Step::new(i, i as u64 * 1_000, (i as u64 + 1) * 1_000, categories)
            })
            .collect()
    };
    let run = RunInfo::default();
    // Few steps (the calls aside), thousands (half of them aside too), none with a
    // rank process (nothing before the calls).
    for (steps, rank_pid) in [
        (steps(3), None),
        (steps(3), Some(10)),
        (steps(2 * PARALLEL + 1), Some(10)),
    ] {
        let files: Vec<Vec<u8>> = [false, true]
            .into_iter()
            .map(|parallel| {
                let mut out = Vec::new();
                let mut t = TraceStream::new(&mut out, detail.first_ns).unwrap();
                t.parallel(parallel);
                for k in 0..3 {
                    t.epoch(&epoch(k), &steps, rank_pid).unwrap();
                }
                t.finish(&run, &[], detail.end_ns).unwrap();
                out
            })
            .collect();
        assert!(files[0].len() > 100_000, "{}", files[0].len());
        assert!(
            files[0] == files[1],
            "{} steps, rank_pid {rank_pid:?}",
            steps.len()
        );
        let parsed: Value = serde_json::from_slice(&files[0]).unwrap();
        let count = |cat: &str| {
            parsed["traceEvents"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|e| e["cat"] == cat)
                .count()
        };
        let calls = count("nccl");
        assert!(calls > 3 * PARALLEL, "{calls}");
        let written = if rank_pid.is_some() {
            3 * steps.len()
        } else {
            0
        };
        assert_eq!(count("step"), written);
    }
}
