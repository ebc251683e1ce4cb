//! A run that sees job after job (`--all --follow` left on a node): each job's steps are
//! its own rank's, found afresh.

use super::*;

/// A process of its own: its main thread.
fn of(pid: u32) -> Task {
    Task {
        tgid: pid,
        tid: pid,
        cpu: 0,
    }
}

/// The job of `pid`: its communicator made with unique id `id`, then steps of `step_ns`
/// in `[from, to)` (an all-reduce, then the sync that waits for it), then its exit.
fn job(pid: u32, id: u64, step_ns: u64, from: u64, to: u64) -> Vec<Event> {
    let mut init = Call::new(of(pid), Func::CommInitRank, from, from + 1_000);
    let extra = init.extra_mut();
    extra.nranks = Some(1);
    extra.rank = Some(0);
    extra.new_comm = Some(u64::from(pid));
    extra.comm_id = Some(id);
    let mut events = vec![Event::Call(init)];
    for t in (from + 1_000_000..to).step_by(usize::try_from(step_ns).unwrap()) {
        let mut c = Call::new(of(pid), Func::AllReduce, t + 100_000, t + 200_000);
        c.comm = Some(u64::from(pid));
        c.bytes = Some(4096);
        events.push(Event::Call(c));
        events.push(Event::Call(Call::new(
            of(pid),
            Func::CuStreamSynchronize,
            t + step_ns / 2,
            t + step_ns - 100_000,
        )));
    }
    events.push(Event::Exit {
        ts_ns: to + 2_000_000,
        task: of(pid),
        group_dead: true,
    });
    events
}

/// Both jobs' events, in time order, attributed at once and in epochs.
fn run(first: Vec<Event>, second: Vec<Event>, end: u64) -> Vec<StepsReport> {
    let mut events: Vec<Event> = first.into_iter().chain(second).collect();
    events.sort_by_key(Event::ts_ns);
    let mut h = header();
    let mut other = h.targets[0].clone();
    other.pid = 20;
    h.targets.push(other);
    [0, 50]
        .into_iter()
        .map(|epoch_events| {
            let mut tl = Timeline::new(&Setup::from(&h));
            tl.stream(StepRule::Auto, epoch_events);
            for e in &events {
                tl.push(e);
            }
            tl.finish(end, StepRule::Auto).0
        })
        .collect()
}

/// The steps of `job`, as (start, wall).
fn steps_of(report: &StepsReport, job: &JobReport) -> Vec<(u64, u64)> {
    report.steps[job.first_step..job.first_step + job.steps]
        .iter()
        .map(|s| (s.start_ns, s.wall_ns))
        .collect()
}

/// Regression (issue 52): under `--all --follow`, a first job of 10-ms steps ran and
/// exited, then a second job of 7-ms steps: steps.json held the first job's steps only,
/// the second job's time an idle stretch "after the last step" of the first's rank (the
/// rank was fixed for the run). Now the next job's rank is followed once the first's
/// exited, its steps found afresh and numbered on.
#[test]
fn jobs_in_sequence_each_get_their_steps() {
    let first = job(10, 0xaaaa, 10_000_000, 0, 1_000_000_000);
    let second = job(20, 0xbbbb, 7_000_000, 1_500_000_000, 2_500_000_000);
    for report in run(first, second, 3_000_000_000) {
        let jobs = &report.jobs;
        assert_eq!(jobs.len(), 2, "{jobs:#?}");
        assert_eq!((jobs[0].rank_pid, jobs[1].rank_pid), (10, 20), "{jobs:#?}");
        assert_eq!(jobs[0].period, Some(1));
        assert_eq!(jobs[1].period, Some(1));
        assert_eq!(
            jobs[0].job.as_deref(),
            Some("ncclUniqueId 0x000000000000aaaa")
        );
        assert_eq!(
            jobs[1].job.as_deref(),
            Some("ncclUniqueId 0x000000000000bbbb")
        );
        assert_eq!(jobs[0].exited_ns, Some(1_002_000_000));
        assert_eq!(jobs[1].exited_ns, Some(2_502_000_000));
        assert_eq!(jobs[1].first_step, jobs[0].steps);
        assert_eq!(jobs[0].steps + jobs[1].steps, report.steps.len());
        // 99 steps of the first job's 100 (the last one's end is its exit's idle), 142 of
        // the second's 143.
        assert!((98..=100).contains(&jobs[0].steps), "{jobs:#?}");
        assert!((141..=143).contains(&jobs[1].steps), "{jobs:#?}");
        for (job, wall) in [(&jobs[0], 10_000_000), (&jobs[1], 7_000_000)] {
            let steps = steps_of(&report, job);
            assert!(steps.iter().all(|s| s.1 == wall), "{steps:?}");
        }
        assert_eq!(report.rank_pid, Some(10));
        assert!(
            report.steps.iter().enumerate().all(|(i, s)| s.index == i),
            "indices run on"
        );
        // Between the jobs: idle, before the second's first step (not the first rank's
        // "after the last step" up to the run's end).
        let idle: Vec<(&str, u64, u64)> = report
            .idle
            .iter()
            .map(|i| (i.when, i.start_ns / 1_000_000, i.end_ns / 1_000_000))
            .collect();
        assert_eq!(
            idle,
            [
                ("before the first step", 1_002, 1_501),
                ("after the last step", 2_501, 3_000)
            ]
        );
    }
}

/// A second job that starts while the first runs is followed from the first's exit on: its
/// steps before then are counted as left out, not mixed among the first job's.
#[test]
fn a_job_started_during_another_is_followed_after_it() {
    let first = job(10, 0xaaaa, 10_000_000, 0, 1_000_000_000);
    let second = job(20, 0xbbbb, 7_000_000, 600_000_000, 2_000_000_000);
    for report in run(first, second, 2_500_000_000) {
        let jobs = &report.jobs;
        assert_eq!(jobs.len(), 2, "{jobs:#?}");
        let exit = jobs[0].exited_ns.unwrap();
        assert_eq!(jobs[1].followed_from_ns, exit);
        let steps = steps_of(&report, &jobs[1]);
        assert!(
            steps.iter().all(|s| s.0 >= exit && s.1 == 7_000_000),
            "{steps:?}"
        );
        // (2000 - 1002) / 7 steps after the exit, the first maybe cut by it.
        assert!((140..=143).contains(&steps.len()), "{}", steps.len());
        assert!(jobs[1].steps_left_out > 10, "{jobs:#?}");
        // The first job's steps are its own: none of 7 ms, and no rank of the other job
        // beside them.
        let first = steps_of(&report, &jobs[0]);
        assert!(first.iter().all(|s| s.1 == 10_000_000), "{first:?}");
        assert!(report.steps.iter().all(|s| s.ranks.is_empty()));
    }
}

/// The followed rank exits before the other rank of its job, which issues its last few
/// collectives after that exit: it is not the next job (no job of no steps).
#[test]
fn a_sibling_rank_finishing_is_not_the_next_job() {
    // Ranks 0 and 1 of one job (one unique id, two ranks), rank 1 started 20 ms later
    // (the busier rank until the first exit is followed: rank 0), its last five steps
    // after rank 0's exit.
    let mut first = job(10, 0xaaaa, 10_000_000, 0, 1_000_000_000);
    let mut sibling = job(11, 0xaaaa, 10_000_000, 20_000_000, 1_050_000_000);
    for (rank, events) in [(0, &mut first), (1, &mut sibling)] {
        for e in events.iter_mut() {
            if let Event::Call(c) = e
                && c.func == Func::CommInitRank
            {
                c.extra_mut().nranks = Some(2);
                c.extra_mut().rank = Some(rank);
            }
        }
    }
    let mut h = header();
    let mut other = h.targets[0].clone();
    other.pid = 11;
    h.targets.push(other);
    let mut events: Vec<Event> = first.into_iter().chain(sibling).collect();
    events.sort_by_key(Event::ts_ns);
    for epoch_events in [0, 50] {
        let mut tl = Timeline::new(&Setup::from(&h));
        tl.stream(StepRule::Auto, epoch_events);
        for e in &events {
            tl.push(e);
        }
        let report = tl.finish(1_500_000_000, StepRule::Auto).0;
        assert_eq!(report.jobs.len(), 1, "{:#?}", report.jobs);
        assert_eq!(report.jobs[0].rank_pid, 10, "epochs of {epoch_events}");
    }
}
