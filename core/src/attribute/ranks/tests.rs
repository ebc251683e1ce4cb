//! Matching collectives across ranks, stragglers and lateness.

use super::*;
use crate::event::Func;

fn ranks(delays: &[u64]) -> BTreeMap<u32, Vec<Collective>> {
    delays
        .iter()
        .enumerate()
        .map(|(r, d)| {
            let c = (0..10u64)
                .map(|i| {
                    let t = i * 1_000_000 + d;
                    Collective {
                        func: Func::AllReduce,
                        bytes: 4,
                        start_ns: t,
                        end_ns: t + 1,
                        comm: 0,
                    }
                })
                .collect();
            (100 + r as u32, c)
        })
        .collect()
}

/// The rank that always arrives 300 µs late is the straggler, charged every wait.
/// A single rank's collectives are never matched: the matcher keeps only the last
/// MAX_PENDING of them (it held every one, growing for as long as the run).
#[test]
fn a_lone_rank_is_not_held_whole() {
    let mut m = Matcher::default();
    for i in 0..(MAX_PENDING as u64 + 10_000) {
        let c = Collective {
            func: Func::AllReduce,
            bytes: 4,
            start_ns: i,
            end_ns: i + 1,
            comm: 7,
        };
        m.add(100, &c);
    }
    assert!(m.matched().is_empty());
    assert_eq!(m.pending(), MAX_PENDING);
}

#[test]
fn late_rank_is_the_straggler() {
    let c = ranks(&[0, 300_000, 10_000]);
    let ids = identify(&[100, 101, 102], &BTreeMap::new(), &BTreeMap::new());
    let s = straggler(&c, &ids).unwrap();
    assert_eq!((s.pid, s.rank), (101, 1));
    assert!((s.share_of_waits - 1.0).abs() < 1e-9);
    assert_eq!(s.mean_lateness_ns, 300_000);
    assert_eq!(slowest_in(&lateness(&c, 100), 0, 3_000_000), Some(101));
    assert_eq!(straggler(&ranks(&[0]), &ids), None);
}

/// Three ranks whose stand-in collectives return once all three arrived; rank 1
/// arrives 3 ms late at each step's first. The probes were armed while ranks 0 and 2
/// waited in a step's first collective and rank 1 had not entered it: their first
/// traced collective is one later than rank 1's. Lined up by causality, rank 1 drops
/// its first and is the straggler, 3 ms late at one collective in four; matched by
/// position, every pair would be one off and rank 1 would arrive first throughout.
#[test]
fn a_rank_armed_one_collective_earlier_is_lined_up() {
    let ms = 1_000_000;
    let mut m = Matcher::default();
    for pid in [100, 101, 102] {
        let mut n = 0;
        for step in 0..30u64 {
            let t0 = step * 10 * ms;
            for k in 0..4u64 {
                // Everyone returns 50 µs after rank 1 arrives.
                let last = t0 + 3 * ms + k * 100_000;
                let arrival = if pid == 101 || k > 0 { last } else { t0 };
                n += 1;
                if pid != 101 && n == 1 {
                    continue;
                }
                let c = Collective {
                    func: Func::AllReduce,
                    bytes: 4096 * (k + 1),
                    start_ns: arrival,
                    end_ns: last + 50_000,
                    comm: 7 + u64::from(pid),
                };
                m.add(pid, &c);
            }
        }
    }
    let groups = m.matched();
    assert_eq!(groups.len(), 119);
    assert_eq!(m.alignment(101), Some(&Alignment::Causal { shift: 1 }));
    assert_eq!(m.alignment(102), Some(&Alignment::Causal { shift: 0 }));
    assert_eq!(m.alignment(100), Some(&Alignment::Reference));
    let ids = identify(&[100, 101, 102], &BTreeMap::new(), &BTreeMap::new());
    let s = m.straggler(&ids).unwrap();
    assert_eq!((s.pid, s.rank), (101, 1));
    assert!((s.share_of_waits - 1.0).abs() < 1e-9);
    assert_eq!(s.mean_lateness_ns, 3 * ms * 29 / 119);
}

/// Each communicator is lined up on its own: two ranks in step on their first one,
/// rank 1 arriving 3 ms late on the second, where rank 0 was caught one collective
/// later (it had entered the second communicator's first, rank 1 had not).
#[test]
fn each_communicator_lined_up() {
    let ms = 1_000_000;
    let coll = |t: u64, done: u64, bytes: u64, comm: u64| Collective {
        func: Func::AllReduce,
        bytes,
        start_ns: t,
        end_ns: done,
        comm,
    };
    let mut m = Matcher::default();
    for step in 0..30u64 {
        let t0 = step * 10 * ms;
        for (pid, comms) in [(100u32, (0xa, 0xb)), (101, (0xc, 0xd))] {
            for k in 0..2 {
                let t = t0 + k * 100_000;
                m.add(pid, &coll(t, t + 10_000, 4096, comms.0));
            }
            let (late, done) = (t0 + 8 * ms, t0 + 8 * ms + 10_000);
            if pid == 101 {
                m.add(pid, &coll(late, done, 64, comms.1));
            } else if step > 0 {
                m.add(pid, &coll(t0 + 5 * ms, done, 64, comms.1));
            }
        }
    }
    m.finishing();
    assert_eq!(m.matched().len(), 60 + 29);
    assert_eq!(m.aligned[&(101, 0)], Alignment::Causal { shift: 0 });
    assert_eq!(m.aligned[&(101, 1)], Alignment::Causal { shift: 1 });
    let ids = identify(&[100, 101], &BTreeMap::new(), &BTreeMap::new());
    let s = m.straggler(&ids).unwrap();
    assert_eq!((s.pid, s.mean_lateness_ns), (101, 3 * ms * 29 / 89));
}

/// An elastic restart: the job's ranks exit and new processes of the same job take
/// over. The new ranks are matched among themselves (while the old ones were kept,
/// their empty queues matched nothing ever again), lined up afresh.
#[test]
fn ranks_after_a_restart_are_matched() {
    let ms = 1_000_000;
    let coll = |t: u64, done: u64| Collective {
        func: Func::AllReduce,
        bytes: 4,
        start_ns: t,
        end_ns: done,
        comm: 1,
    };
    let mut m = Matcher::default();
    let generation = |m: &mut Matcher, pids: [u32; 2], from: u64, late: u64| {
        for i in 0..20u64 {
            let t = from + i * ms;
            m.add(pids[0], &coll(t, t + late + 10_000));
            m.add(pids[1], &coll(t + late, t + late + 10_000));
        }
    };
    generation(&mut m, [100, 101], 0, 300_000);
    assert_eq!(m.matched().len(), 20);
    m.exited(100);
    m.exited(101);
    // Rank 0 is now the late one.
    generation(&mut m, [201, 200], 100 * ms, 200_000);
    assert_eq!(m.matched().len(), 20);
    assert_eq!(m.alignment(201), Some(&Alignment::Causal { shift: 0 }));
    let ids = identify(&[100, 101, 200, 201], &BTreeMap::new(), &BTreeMap::new());
    let s = m.straggler(&ids).unwrap();
    // 20 × 300 µs caused by 101 against 20 × 200 µs by 200.
    assert_eq!(s.pid, 101);
    let behind: BTreeMap<u32, u64> = m.lateness().iter().map(|l| (l.pid, l.caused_ns)).collect();
    assert_eq!(behind[&200], 20 * 200_000);
}

/// With the CUDA syncs traced, a collective is seen complete when the first sync its
/// process began after it returns: until then the ranks are not lined up.
#[test]
fn completions_from_syncs() {
    let mut m = Matcher::default();
    m.syncs_probed();
    for pid in [100, 101] {
        for i in 0..align::PROBE as u64 {
            let t = i * 1_000_000;
            let c = Collective {
                func: Func::AllReduce,
                bytes: 4,
                start_ns: t,
                end_ns: t + 10,
                comm: 1,
            };
            m.add(pid, &c);
        }
    }
    assert!(m.matched().is_empty(), "completions not seen yet");
    for pid in [100, 101] {
        for i in 0..align::PROBE as u64 {
            let t = i * 1_000_000;
            m.synced(pid, t + 100, t + 500_000);
        }
    }
    assert_eq!(m.matched().len(), align::PROBE);
    assert_eq!(m.alignment(101), Some(&Alignment::Causal { shift: 0 }));
}

/// Two communicators whose collectives the ranks interleave differently (rank 1 issues
/// each one on its second communicator 7 ms late, after its next one on the first):
/// matched per communicator (by first-use order, the handles differing), rank 1 is
/// 0 ms late on the first and 7 ms on the second, 3.5 ms on average. Matched by
/// position instead, its lateness would mix the two.
#[test]
fn matched_per_communicator() {
    let coll = |t: u64, comm: u64| Collective {
        func: Func::AllReduce,
        bytes: 4,
        start_ns: t,
        end_ns: t + 1,
        comm,
    };
    let ms = 1_000_000;
    let mut r0 = Vec::new();
    let mut r1 = Vec::new();
    for i in 0..10 {
        r0.push(coll(i * 10 * ms, 0xa));
        r0.push(coll(i * 10 * ms + 5 * ms, 0xb));
        r1.push(coll(i * 10 * ms, 0xc));
        r1.push(coll(i * 10 * ms + 12 * ms, 0xd));
    }
    r1.sort_by_key(|c| c.start_ns);
    let c: BTreeMap<u32, Vec<Collective>> = [(100, r0), (101, r1)].into();
    let ids = identify(&[100, 101], &BTreeMap::new(), &BTreeMap::new());
    let s = straggler(&c, &ids).unwrap();
    assert_eq!(s.pid, 101);
    assert_eq!(s.mean_lateness_ns, 3_500_000);
}

/// Two jobs side by side (job b's collectives at three times job a's pace) and a lone
/// rank of a third: each job's ranks are matched among themselves, each job names its
/// own straggler with its own lateness, and no single straggler is named for all. The
/// lone rank is matched with nobody. Matched as one job, b's ranks drift whole
/// periods against a's.
#[test]
fn ranks_of_different_jobs_are_not_matched() {
    // Each call returns 10 µs after its job's last rank arrived (`done`).
    let coll = |t: u64, done: u64| Collective {
        func: Func::AllReduce,
        bytes: 4,
        start_ns: t,
        end_ns: done + 10_000,
        comm: 1,
    };
    let ms = 1_000_000;
    let mut m = Matcher::default();
    for (pid, job) in [(100, "a"), (101, "a"), (200, "b"), (201, "b"), (300, "c")] {
        m.job(pid, job);
    }
    for i in 0..20u64 {
        let (a, b) = (i * ms + 300_000, i * 3 * ms + 50_000);
        m.add(100, &coll(i * ms, a));
        m.add(101, &coll(a, a));
        m.add(200, &coll(b, b));
        m.add(201, &coll(i * 3 * ms, b));
        m.add(300, &coll(i * 7 * ms, i * 7 * ms));
    }
    let matched = m.matched();
    assert_eq!(matched.len(), 40);
    assert!(matched.iter().all(|a| {
        let pids: Vec<u32> = a.keys().copied().collect();
        pids == [100, 101] || pids == [200, 201]
    }));
    let ids = identify(
        &[100, 101, 200, 201, 300],
        &BTreeMap::new(),
        &BTreeMap::new(),
    );
    let all = m.stragglers(&ids);
    let got: Vec<(u32, u64, Option<&str>)> = all
        .iter()
        .map(|s| (s.pid, s.mean_lateness_ns, s.job.as_deref()))
        .collect();
    assert_eq!(got, [(101, 300_000, Some("a")), (200, 50_000, Some("b"))]);
    assert!(all.iter().all(|s| (s.share_of_waits - 1.0).abs() < 1e-9));
    assert_eq!(m.straggler(&ids), None);
    // One job with a straggler: it is the straggler.
    let mut one = Matcher::default();
    for i in 0..5u64 {
        one.add(100, &coll(i * ms, i * ms + 300_000));
        one.add(101, &coll(i * ms + 300_000, i * ms + 300_000));
    }
    // Too few to line up until the run ends.
    assert!(one.matched().is_empty());
    one.finishing();
    one.matched();
    assert!(matches!(
        one.alignment(101),
        Some(Alignment::ByOrder { .. })
    ));
    assert_eq!(
        one.straggler(&ids).map(|s| (s.pid, s.job)),
        Some((101, None))
    );
}

/// Arrivals handed to `record` directly (as `nccltrace merge` pairs them across hosts)
/// name a straggler as matched ones do: the merge's straggler was lost once the
/// stragglers were looked up among the pids given to `add` only.
#[test]
fn recorded_arrivals_name_the_straggler() {
    let mut m = Matcher::default();
    for i in 0..4u64 {
        m.record(&[(0, i * 1_000), (1, i * 1_000 + 300)].into());
    }
    let ids = identify(&[0, 1], &BTreeMap::new(), &BTreeMap::new());
    let s = m.straggler(&ids).unwrap();
    assert_eq!((s.pid, s.mean_lateness_ns, s.job), (1, 300, None));
}

/// CommInitRank beats the environment, which beats pid order.
#[test]
fn identities() {
    let init: BTreeMap<u32, i32> = [(7, 3)].into();
    let env: BTreeMap<u32, (String, i32)> =
        [(7, ("RANK".into(), 9)), (8, ("LOCAL_RANK".into(), 1))].into();
    let ids = identify(&[9, 8, 7], &init, &env);
    assert_eq!(
        ids[0],
        RankIdentity {
            pid: 7,
            rank: 3,
            rank_source: "ncclCommInitRank".into()
        }
    );
    assert_eq!(ids[1].rank_source, "environment LOCAL_RANK");
    assert_eq!((ids[2].rank, ids[2].rank_source.as_str()), (2, "pid order"));
}

/// Issue 51: processes are one job where they made communicators of one unique id, linked
/// through every group they share (ranks 0–3: tensor-parallel pairs {0,1} {2,3} and
/// data-parallel pairs {0,2} {1,3} are one job), and apart where they share none — even
/// where their environment names one job (two launches in one Slurm allocation). Each
/// job is matched on its own and names its own straggler.
#[test]
fn jobs_from_the_communicators_they_share() {
    let mut m = Matcher::default();
    for pid in [100, 101, 102, 103, 200, 201] {
        m.job(pid, "SLURM_JOB_ID=7");
    }
    for (pid, id) in [(100, 10), (101, 10), (102, 11), (103, 11)] {
        m.shares(pid, id);
    }
    for (pid, id) in [
        (100, 12),
        (102, 12),
        (101, 13),
        (103, 13),
        (200, 20),
        (201, 20),
    ] {
        m.shares(pid, id);
    }
    let names: BTreeSet<&str> = [100, 101, 102, 103].map(|p| m.job_of(p)).into();
    assert_eq!(
        names,
        BTreeSet::from(["SLURM_JOB_ID=7, ncclUniqueId 0x000000000000000a"])
    );
    assert_eq!(
        m.job_of(200),
        "SLURM_JOB_ID=7, ncclUniqueId 0x0000000000000014"
    );
    // The late rank of each: 101 (300 µs), 201 (50 µs); the jobs at different paces.
    let ms = 1_000_000;
    let coll = |t: u64| Collective {
        func: Func::AllReduce,
        bytes: 4,
        start_ns: t,
        end_ns: t + 400_000,
        comm: 1,
    };
    for i in 0..20u64 {
        for (pid, late) in [(100, 0), (101, 300_000), (102, 0), (103, 0)] {
            m.add(pid, &coll(i * ms + late));
        }
        m.add(200, &coll(i * 3 * ms));
        m.add(201, &coll(i * 3 * ms + 50_000));
    }
    m.finishing();
    let matched = m.matched();
    assert_eq!(matched.len(), 40);
    let ids = identify(
        &[100, 101, 102, 103, 200, 201],
        &BTreeMap::new(),
        &BTreeMap::new(),
    );
    let got: Vec<u32> = m.stragglers(&ids).iter().map(|s| s.pid).collect();
    assert_eq!(got, [101, 201]);
}
