//! Tests of `steps`.

use super::*;

/// Nearest-rank quantiles.
#[test]
fn quantiles() {
    let mut v: Vec<u64> = (1..=100).collect();
    assert_eq!(quantile(&mut v, 0.5), 50);
    assert_eq!(quantile(&mut v, 0.9), 90);
    assert_eq!(quantile(&mut v, 0.99), 99);
    assert_eq!(quantile(&mut [], 0.5), 0);
    assert_eq!(quantile(&mut [7], 0.99), 7);
}

fn step(index: usize, compute: u64, nccl_wait: u64) -> Step {
    let categories = Categories {
        compute,
        nccl_wait,
        ..Categories::default()
    };
    Step::new(index, 0, compute + nccl_wait, categories)
}

/// steps.json's rows are written by hand for speed: byte for byte what `Step`'s
/// `Serialize` writes, for every shape a field can take (a field added to `Step` and
/// not to the writer fails here).
#[test]
fn step_rows_as_serde_writes_them() {
    use crate::attribute::remote::{Basis, RemoteAccess};
    let plain = step(3, 2_000_000, 1_000_000);
    let mut full = step(u32::MAX as usize + 7, u64::MAX / 2, 12);
    full.start_ns = 17;
    full.categories.unmeasured.page_fault = true;
    full.categories.unmeasured.nccl_wait = true;
    full.categories.remote_memory = Some(99);
    full.page_fault_error_ns = Some(1_234);
    full.nccl = crate::attribute::NcclCount {
        collectives: 3,
        bytes: 1 << 40,
    };
    (full.faults, full.migrations, full.cross_node_migrations) = (1, 2, 3);
    (full.numa_page_migrations, full.numa_task_moves) = (4, 5);
    full.remote_access = Some(Box::new(RemoteAccess {
        pages: 10,
        remote_pages: 3,
        basis: Basis::StepHints,
        gap_ppm: Some(1234),
    }));
    full.remote_loads = Some(Box::new(crate::pmu::MeasuredStep {
        dram_samples: 8,
        remote_samples: 2,
        remote_cycles: 900,
    }));
    full.infiniband = Some(crate::attribute::IbStep(vec![(
        "mlx5_0/1".into(),
        vec![("transmit_bytes", 4096), ("symbol_error", 1)],
    )]));
    full.slowest_rank = Some(-1);
    full.ranks = vec![
        crate::attribute::StepRank {
            rank: 0,
            pid: 41,
            categories: plain.categories,
        },
        crate::attribute::StepRank {
            rank: i32::MAX,
            pid: u32::MAX,
            categories: full.categories,
        },
    ];
    let mut one_rank = plain.clone();
    one_rank.ranks.truncate(0);
    one_rank.slowest_rank = Some(2);
    for s in [plain, full, one_rank] {
        let mut ours = Vec::new();
        write_step(&mut ours, &s).unwrap();
        assert_eq!(
            String::from_utf8(ours).unwrap(),
            serde_json::to_string(&s).unwrap()
        );
    }
}

/// Past EXACT_STEPS the table's quantiles come from histograms: within 0.2% of the
/// exact ones, every bucket's middle within 0.2% of its values, and the slowest steps
/// still exact.
#[test]
fn quantiles_past_the_exact_steps_stay_within_their_bucket() {
    for v in [0, 1, 1023, 1024, 1025, 4_000_000, 123_456_789, u64::MAX / 3] {
        let mid = LogHistogram::value(LogHistogram::bucket(v));
        assert!(
            mid.abs_diff(v) as f64 <= v as f64 / 512.0 + 1.0,
            "{v} -> {mid}"
        );
    }
    let n = EXACT_STEPS + 5_000;
    // Deterministic spread of wall times: 1-5 ms, one slow step.
    let wall = |i: usize| 1_000_000 + (i as u64 * 7_919) % 4_000_000;
    let steps: Vec<Step> = (0..n)
        .map(|i| {
            let w = if i == 7_777 { 90_000_000 } else { wall(i) };
            step(i, w, w / 3)
        })
        .collect();
    let table = StepTable::of(&steps);
    assert!(table.approximate());
    let mut walls: Vec<u64> = steps.iter().map(|s| s.wall_ns).collect();
    for q in [0.5, 0.9, 0.99] {
        let exact = quantile(&mut walls, q);
        let approx = table.columns[0].quantile(q);
        assert!(
            approx.abs_diff(exact) as f64 <= exact as f64 * 0.002,
            "q{q}: {approx} vs {exact}"
        );
    }
    assert_eq!(
        (table.slowest[0].0, table.slowest[0].1),
        (steps[7_777].wall_ns, 7_777)
    );
    assert_eq!(table.len(), n);
}

/// Regression (issue 17): "#267 28.261 ms (nccl_wait 2.067 ms)" named a typical wait
/// while compute made the step slow. The cause is the category furthest above its
/// own median.
#[test]
fn slowest_step_names_its_excess() {
    let steps: Vec<Step> = (0..9)
        .map(|i| step(i, 3_000_000, 2_000_000))
        .chain([step(9, 25_000_000, 2_100_000)])
        .collect();
    let table = StepTable::of(&steps);
    let medians = table.category_medians();
    assert_eq!(table.slowest[0].1, 9);
    assert_eq!(
        StepTable::slowest_cause(&table.slowest[0].2, &medians),
        Some(("compute", 22_000_000))
    );
    let typical = StepTable::of(&steps[..1]);
    assert_eq!(
        StepTable::slowest_cause(&typical.slowest[0].2, &medians),
        None
    );
}

/// Regression (issue 17): "blocked most in:" showed only leaf kernel frames; the
/// innermost user frame comes first now.
#[test]
fn blocked_stack_names_the_user_frame() {
    let stack = "trainer 7 (main (rank));main;train_step;sched_setaffinity;\
                 entry_SYSCALL_64_[k];__x64_sys_sched_setaffinity_[k];stop_one_cpu_[k];\
                 wait_for_completion_[k];schedule_[k];[blocked]";
    assert_eq!(
        blocked_in(stack),
        "sched_setaffinity → stop_one_cpu_[k] > wait_for_completion_[k] > schedule_[k]"
    );
    assert_eq!(
        blocked_in("t 7;a_[k];b_[k];[blocked]"),
        "(no user frame captured) → a_[k] > b_[k]"
    );
}

/// A report of `steps` and nothing else.
fn report_of(steps: Vec<Step>) -> StepsReport {
    StepsReport {
        clock: "",
        partial_steps_left_out: 0,
        epochs: 1,
        late_events_left_out: 0,
        method: crate::attribute::steps::Method::Window,
        reason: String::new(),
        period: None,
        rank_pid: None,
        rank_tid: None,
        jobs: Vec::new(),
        methods: crate::attribute::Methods {
            gpu_wait: String::new(),
            nccl_wait: String::new(),
            page_fault: String::new(),
            remote_memory: String::new(),
            remote_memory_estimated: false,
            infiniband: String::new(),
            gpu: String::new(),
        },
        steps,
        threads: vec![],
        other_offcpu_top_stacks: vec![],
        nccl_wait_top_stacks: Vec::new(),
        gpu_wait_top_stacks: Vec::new(),
        communicators: Vec::new(),
        idle: Vec::new(),
        workers: Vec::new(),
        one_rank_jobs: Vec::new(),
        ranks: vec![],
        straggler: None,
        stragglers_by_job: Vec::new(),
    }
}

/// steps.csv: the header, from the category names written once, has as many columns
/// as every row; an unmeasured category is an empty cell, not 0.
#[test]
fn csv_columns_match_rows() {
    let mut one = step(0, 3_000_000, 2_000_000);
    one.categories.unmeasured.page_fault = true;
    let report = report_of(vec![one]);
    let mut out = Vec::new();
    write_csv(&report, &mut out).unwrap();
    let text = String::from_utf8(out).unwrap();
    let lines: Vec<Vec<&str>> = text.lines().map(|l| l.split(',').collect()).collect();
    assert_eq!(lines[0].len(), 20);
    assert_eq!(lines[1].len(), lines[0].len());
    let cell = |name: &str| lines[1][lines[0].iter().position(|c| *c == name).unwrap()];
    assert_eq!(cell("compute"), "3000000");
    assert_eq!(cell("nccl_wait"), "2000000");
    assert_eq!(cell("page_fault"), "");
    assert_eq!(cell("remote_memory"), "");
    // No hinting fault seen: no share (empty, not 0).
    assert_eq!(cell("remote_share"), "");
}

/// Several ranks on stdout: a line per rank (its collectives and its thread's largest
/// categories), then the straggler; ranks of several jobs get a straggler line per job and
/// no single one; ranks nobody waited for, "none".
#[test]
fn ranks_and_straggler_on_stdout() {
    use crate::attribute::align::{IN_ORDER, REFERENCE};
    use crate::attribute::ranks::{RankNccl, RankReport, Straggler};
    let steps: Vec<Step> = (0..4).map(|i| step(i, 3_000_000, 1_000_000)).collect();
    let rank = |rank: i32, pid: u32, compute: u64, nccl_wait: u64| RankReport {
        pid,
        rank,
        rank_source: "environment RANK".into(),
        nccl: RankNccl {
            collectives: 40,
            bytes: 4096,
        },
        categories: step(0, compute, nccl_wait).categories,
        matched: None,
    };
    let late = |pid: u32, job: Option<&str>| Straggler {
        rank: 1,
        pid,
        share_of_waits: 0.97,
        mean_lateness_ns: 312_000,
        job: job.map(str::to_owned),
    };
    let text = |report: &StepsReport| {
        let mut out = Vec::new();
        write_table(report, &StepTable::of(&report.steps), &mut out).unwrap();
        String::from_utf8(out).unwrap()
    };
    let mut report = report_of(steps);
    // One rank: no rank lines.
    report.ranks = vec![rank(0, 100, 3_000_000, 1_000_000)];
    assert!(!text(&report).contains("Ranks:"), "{}", text(&report));
    report.ranks.push(rank(1, 101, 3_900_000, 100_000));
    let none = text(&report);
    assert!(
        none.contains("straggler: none (no rank made another wait"),
        "{none}"
    );
    report.straggler = Some(late(101, None));
    let one = text(&report);
    assert!(one.contains("Ranks: 2"), "{one}");
    assert!(
        one.contains(
            "  rank 0 (pid 100, environment RANK): 40 collectives, 4096 bytes; over the run \
             compute 75.0%, \
             nccl_wait 25.0%"
        ),
        "{one}"
    );
    assert!(
        one.contains(
            "  straggler: rank 1 (pid 101): 97% of the waits at collectives, 0.312 ms late on \
             average"
        ),
        "{one}"
    );
    // How ranks were lined up: said where other than in plain order.
    report.ranks[0].matched = Some(REFERENCE.into());
    report.ranks[1].matched = Some(IN_ORDER.into());
    assert!(!text(&report).contains("    matched "), "{}", text(&report));
    report.ranks[1].matched = Some("in order from the first traced: none fits".into());
    assert!(
        text(&report).contains("    matched in order from the first traced: none fits\n"),
        "{}",
        text(&report)
    );
    report.straggler = None;
    report.stragglers_by_job = vec![late(101, Some("SLURM_JOB_ID=7")), late(201, None)];
    let two = text(&report);
    assert!(!two.contains("  straggler: "), "{two}");
    assert!(
        two.contains("  straggler of SLURM_JOB_ID=7: rank 1 (pid 101)"),
        "{two}"
    );
    assert!(
        two.contains("  straggler of unnamed job: rank 1 (pid 201)"),
        "{two}"
    );
}

/// Idle stretches are said on stdout beside the steps, with what the rank mostly did in
/// them, and are not rows of the table.
#[test]
fn idle_on_stdout_with_what_it_held() {
    let steps: Vec<Step> = (0..4).map(|i| step(i, 3_000_000, 1_000_000)).collect();
    let mut report = report_of(steps);
    let mut sleep = step(0, 0, 0).categories;
    sleep.compute = 500_000_000;
    sleep.other_offcpu = 1_500_000_000;
    report.idle = vec![crate::attribute::Idle {
        start_ns: 0,
        end_ns: 2_000_000_000,
        wall_ns: 2_000_000_000,
        when: "before the first step",
        categories: sleep,
        faults: 0,
        numa_page_migrations: 2048,
        collectives: 0,
        top_stacks: vec![crate::attribute::BlockingStack {
            stack: "main;load (train.py:12);time.sleep;clock_nanosleep;[blocked]".into(),
            total_ns: 1_400_000_000,
        }],
        stack_ns: std::collections::BTreeMap::new(),
    }];
    let mut out = Vec::new();
    write_table(&report, &StepTable::of(&report.steps), &mut out).unwrap();
    let text = String::from_utf8(out).unwrap();
    assert!(
        text.contains(
            "  idle, not a step: 2.000 s before the first step (no collectives; mostly \
             other_offcpu 75%; 2048 pages moved between NUMA nodes; steps.json idle)\n    most at: load (train.py:12) (1400.000 ms)\n"
        ),
        "{text}"
    );
    // A stretch of collectives that repeat as no step does is not called idle.
    report.idle[0].collectives = 37;
    report.idle[0].numa_page_migrations = 0;
    let mut out = Vec::new();
    write_table(&report, &StepTable::of(&report.steps), &mut out).unwrap();
    let text = String::from_utf8(out).unwrap();
    assert!(
        text.contains(
            "  not a step: 2.000 s before the first step (37 collectives that repeat as no \
             step does; mostly other_offcpu 75%; steps.json idle)\n"
        ),
        "{text}"
    );
}
