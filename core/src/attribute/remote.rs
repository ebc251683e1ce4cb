//! `remote_memory`, estimated from what the kernel itself samples: NUMA balancing's
//! hinting faults. Every scan period (≥ 1 s by default) the kernel unmaps a range of each
//! task's pages; the next access to each page faults, and `task_numa_fault` is told
//! whether the page was on the faulting CPU's node. Those faults are a sample of the
//! thread's memory accesses, one per page per scan (a page touched once weighs as much as
//! one touched a million times).
//!
//! A step's remote share is the remote fraction of the rank thread's hinting-fault pages
//! in the step, or, where the step saw fewer than [`MIN_STEP_PAGES`], of the latest burst
//! before its end (the faults come in bursts, one per scan; a window of the latest 64
//! pages alone read a far-bound trainer as 84–86% remote in a guest run). Its
//! estimated stall is the step's on-CPU compute × Σ pages × (1 − local/remote SLIT
//! distance) / Σ pages: what the on-CPU time would shrink by were every sampled access
//! local, if the thread were bound by memory latency and the SLIT ratio were the latency
//! ratio — an upper end: a thread bound by arithmetic stalls less (docs/attribution.md).

use serde::Serialize;

/// A step with at least this many hinting-fault pages is estimated from its own.
pub const MIN_STEP_PAGES: u64 = 16;
/// Otherwise from the latest burst before its end: faults less than this apart, ...
pub const BURST_GAP_NS: u64 = 50_000_000;
/// ... and at most this many pages of it.
pub const WINDOW_PAGES: u64 = 4096;
/// Hinting faults kept from before an epoch's cut, per thread, for the next steps'
/// windows.
pub const CONTEXT_HINTS: usize = 4096;

/// One hinting fault of a thread.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hint {
    pub ts_ns: u64,
    pub pages: u32,
    pub local: bool,
    /// 1 − d(cpu node, cpu node) / d(cpu node, page node), in thousandths (0 when
    /// local); `None` where the SLIT distances or the CPU's node are unknown.
    pub gap_milli: Option<u16>,
}

impl Hint {
    /// A fault on `cpu` to a page on `mem_node`, with the host's CPU → node map and SLIT.
    #[must_use]
    pub fn new(
        ts_ns: u64,
        pages: u32,
        local: bool,
        cpu: u16,
        mem_node: i32,
        cpu_nodes: &[i32],
        distances: &[Vec<u32>],
    ) -> Hint {
        let gap_milli = if local {
            Some(0)
        } else {
            let node = super::node_of(cpu_nodes, i32::from(cpu));
            let d = |a: i32, b: i32| -> Option<u32> {
                distances
                    .get(usize::try_from(a).ok()?)?
                    .get(usize::try_from(b).ok()?)
                    .copied()
            };
            match (d(node, node), d(node, mem_node)) {
                // A remote page the kernel migrated to this node at this fault (it reports
                // the page's new node): the node it came from is not said, so the gap is
                // the average from this node (before, these counted in the share with no
                // stall: a guest run read share 1.0 and remote_memory 0).
                _ if mem_node == node && node >= 0 => usize::try_from(node)
                    .ok()
                    .and_then(|n| remote_gaps(distances).get(n).copied().flatten()),
                (Some(near), Some(far)) if far >= near && far > 0 => {
                    u16::try_from(1000 - u64::from(near) * 1000 / u64::from(far)).ok()
                }
                _ => None,
            }
        };
        Hint {
            ts_ns,
            pages,
            local,
            gap_milli,
        }
    }
}

/// What a step's remote share was taken from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Basis {
    /// The step's own hinting faults.
    StepHints,
    /// The latest hinting faults before the step's end.
    LatestHints,
    /// The target's resident pages per node (`/proc/PID/numa_maps`), NUMA balancing being
    /// off: no access is sampled, so every resident page weighs the same.
    ResidentPages,
    /// The thread's own loads, counted by the PMU (`node-loads`, `node-load-misses`):
    /// every DRAM load, not a sample; interpolated between the agent's readings.
    CountedLoads,
}

/// The remote share a step's estimate rests on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteAccess {
    /// Hinting-fault pages counted, and those remote.
    pub pages: u64,
    pub remote_pages: u64,
    /// What the share was taken from.
    pub basis: Basis,
    /// Σ pages × gap / Σ pages, in millionths; `None`: a distance was unknown.
    pub gap_ppm: Option<u64>,
}

impl RemoteAccess {
    /// The remote fraction of the sampled accesses.
    #[must_use]
    pub fn share(&self) -> f64 {
        self.remote_pages as f64 / self.pages.max(1) as f64
    }

    /// The estimated stall within `compute_ns` of on-CPU time.
    #[must_use]
    pub fn stall_ns(&self, compute_ns: u64) -> Option<u64> {
        let ppm = self.gap_ppm?;
        u64::try_from(u128::from(compute_ns) * u128::from(ppm) / 1_000_000).ok()
    }
}

impl Serialize for RemoteAccess {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap as _;
        let mut map = serializer.serialize_map(Some(4))?;
        map.serialize_entry("share", &((self.share() * 1e4).round() / 1e4))?;
        let (pages, remote, from) = match self.basis {
            Basis::StepHints => (
                "hint_fault_pages",
                "remote_pages",
                "this step's hinting faults",
            ),
            Basis::LatestHints => (
                "hint_fault_pages",
                "remote_pages",
                "the latest hinting faults before the step's end",
            ),
            Basis::ResidentPages => (
                "resident_pages",
                "remote_pages",
                "the target's resident pages per node (numa_maps)",
            ),
            Basis::CountedLoads => (
                "dram_loads",
                "remote_loads",
                "the thread's loads counted by the PMU (node-loads, node-load-misses)",
            ),
        };
        map.serialize_entry(pages, &self.pages)?;
        map.serialize_entry(remote, &self.remote_pages)?;
        map.serialize_entry("from", from)?;
        map.end()
    }
}

/// The remote share of a step `[a, b)` from a thread's hinting faults (sorted by time);
/// `None` while fewer than [`MIN_STEP_PAGES`] pages have faulted.
#[must_use]
pub fn estimate(hints: &[Hint], a: u64, b: u64) -> Option<RemoteAccess> {
    let lo = hints.partition_point(|h| h.ts_ns < a);
    let hi = hints.partition_point(|h| h.ts_ns < b).max(lo);
    let own: u64 = hints[lo..hi].iter().map(|h| u64::from(h.pages)).sum();
    let (used, basis) = if own >= MIN_STEP_PAGES {
        (&hints[lo..hi], Basis::StepHints)
    } else {
        // The latest burst before the step's end (more than one if it is a handful).
        let mut pages = 0;
        let mut from = hi;
        while from > 0 && pages < WINDOW_PAGES {
            let gap = hints
                .get(from)
                .filter(|_| from < hi)
                .map_or(0, |later| later.ts_ns - hints[from - 1].ts_ns);
            if pages >= MIN_STEP_PAGES && gap > BURST_GAP_NS {
                break;
            }
            from -= 1;
            pages += u64::from(hints[from].pages);
        }
        (&hints[from..hi], Basis::LatestHints)
    };
    let pages: u64 = used.iter().map(|h| u64::from(h.pages)).sum();
    // A handful of faults is no sample: one stray remote page would read as 100%.
    if pages < MIN_STEP_PAGES {
        return None;
    }
    let remote_pages = used
        .iter()
        .filter(|h| !h.local)
        .map(|h| u64::from(h.pages))
        .sum();
    let gap_ppm = used
        .iter()
        .map(|h| {
            h.gap_milli
                .map(|g| u64::from(h.pages) * u64::from(g) * 1000)
        })
        .sum::<Option<u64>>()
        .map(|sum| sum / pages);
    Some(RemoteAccess {
        pages,
        remote_pages,
        basis,
        gap_ppm,
    })
}

/// Where a target's resident memory was, seen from one of its threads: read from
/// `/proc/PID/numa_maps` while NUMA balancing is off (no hinting faults to sample from).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Resident {
    pub ts_ns: u64,
    /// Resident memory, and that on another node than the thread's, in 4-KiB pages.
    pub pages: u64,
    pub remote_pages: u64,
    /// Σ pages × (1 − d(node, node) / d(node, page node)) / Σ pages, in millionths;
    /// `None`: a distance was unknown.
    pub gap_ppm: Option<u64>,
}

impl Resident {
    /// `kib[n]`: the target's resident KiB on node n; `node`: the thread's node.
    #[must_use]
    pub fn new(ts_ns: u64, kib: &[u64], node: i32, distances: &[Vec<u32>]) -> Option<Resident> {
        let node = usize::try_from(node).ok()?;
        let pages: u64 = kib.iter().sum::<u64>() / 4;
        if pages == 0 {
            return None;
        }
        let remote_pages = kib
            .iter()
            .enumerate()
            .filter(|(n, _)| *n != node)
            .map(|(_, k)| k / 4)
            .sum();
        let row = distances.get(node);
        let gap_ppm = kib
            .iter()
            .enumerate()
            .map(|(n, k)| {
                if n == node || *k == 0 {
                    return Some(0);
                }
                let (near, far) = (u64::from(*row?.get(node)?), u64::from(*row?.get(n)?));
                (far >= near && far > 0).then(|| k / 4 * (1_000_000 - near * 1_000_000 / far))
            })
            .sum::<Option<u64>>()
            .map(|sum| sum / pages);
        Some(Resident {
            ts_ns,
            pages,
            remote_pages,
            gap_ppm,
        })
    }
}

/// A step ending at `b`, from the latest resident-pages reading before it (sorted by
/// time).
#[must_use]
pub fn from_resident(resident: &[Resident], b: u64) -> Option<RemoteAccess> {
    let r = resident[..resident.partition_point(|r| r.ts_ns < b)].last()?;
    Some(RemoteAccess {
        pages: r.pages,
        remote_pages: r.remote_pages,
        basis: Basis::ResidentPages,
        gap_ppm: r.gap_ppm,
    })
}

/// A reading of a thread's node-load counters: its DRAM loads and remote ones since the
/// counters were opened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoadReading {
    pub ts_ns: u64,
    pub dram: u64,
    pub remote: u64,
}

/// The latency gap of a remote load from each node: 1 − d(node, node) / d(node, other),
/// averaged over the other nodes (the counters do not say which node served), in
/// thousandths; `None` where the distances do not say.
#[must_use]
pub fn remote_gaps(distances: &[Vec<u32>]) -> Vec<Option<u16>> {
    distances
        .iter()
        .enumerate()
        .map(|(node, row)| {
            let near = u64::from(*row.get(node)?);
            let gaps: Vec<u64> = row
                .iter()
                .enumerate()
                .filter(|(n, _)| *n != node)
                .map(|(_, far)| u64::from(*far))
                .filter(|far| *far >= near && *far > 0)
                .map(|far| 1000 - near * 1000 / far)
                .collect();
            let n = u64::try_from(gaps.len()).ok().filter(|n| *n > 0)?;
            u16::try_from(gaps.iter().sum::<u64>() / n).ok()
        })
        .collect()
}

/// The counts of `readings` (sorted by time) at `t`, interpolated linearly between the
/// readings around it; `None` outside them.
fn loads_at(readings: &[LoadReading], t: u64) -> Option<(u64, u64)> {
    let after = readings.partition_point(|r| r.ts_ns < t);
    let next = readings.get(after)?;
    if next.ts_ns == t {
        return Some((next.dram, next.remote));
    }
    let prev = readings[..after].last()?;
    let lerp = |v0: u64, v1: u64| {
        // Scaled counts of a multiplexed counter may dip: taken as flat.
        let grown = v1.saturating_sub(v0);
        let part =
            u128::from(grown) * u128::from(t - prev.ts_ns) / u128::from(next.ts_ns - prev.ts_ns);
        v0 + u64::try_from(part).unwrap_or(grown)
    };
    Some((lerp(prev.dram, next.dram), lerp(prev.remote, next.remote)))
}

/// A step `[a, b)` from the thread's counted loads: its DRAM loads and the remote share of
/// them, at the latency gap `gap_milli` of the thread's node ([`remote_gaps`]); `None`
/// where the readings do not cover the step.
#[must_use]
pub fn counted(
    readings: &[LoadReading],
    a: u64,
    b: u64,
    gap_milli: Option<u16>,
) -> Option<RemoteAccess> {
    let (dram_a, remote_a) = loads_at(readings, a)?;
    let (dram_b, remote_b) = loads_at(readings, b)?;
    let pages = dram_b.saturating_sub(dram_a);
    let remote_pages = remote_b.saturating_sub(remote_a).min(pages);
    Some(RemoteAccess {
        pages,
        remote_pages,
        basis: Basis::CountedLoads,
        gap_ppm: gap_milli.map(|g| {
            u64::try_from(
                u128::from(remote_pages) * u128::from(g) * 1000 / u128::from(pages.max(1)),
            )
            .unwrap_or(0)
        }),
    })
}

/// Drops the readings before `until` but the latest of them (a later step interpolates
/// from it).
pub fn trim_loads(readings: &mut Vec<LoadReading>, until: u64) {
    let before = readings.partition_point(|r| r.ts_ns <= until);
    readings.drain(..before.saturating_sub(1));
}

#[cfg(test)]
mod tests {
    use super::*;

    const SLIT: [[u32; 2]; 2] = [[10, 20], [20, 10]];

    fn slit() -> Vec<Vec<u32>> {
        SLIT.iter().map(|r| r.to_vec()).collect()
    }

    /// A fault at `ts` from CPU 0 (node 0) to a page on `node`.
    fn hint(ts_ns: u64, node: i32) -> Hint {
        Hint::new(ts_ns, 1, node == 0, 0, node, &[0, 1], &slit())
    }

    #[test]
    fn distance_gap_from_the_slit() {
        assert_eq!(hint(0, 1).gap_milli, Some(500));
        assert_eq!(hint(0, 0).gap_milli, Some(0));
        // 10 vs 21 (a common two-socket SLIT): 1 − 10/21.
        let far = Hint::new(0, 1, false, 0, 1, &[0, 1], &[vec![10, 21], vec![21, 10]]);
        assert_eq!(far.gap_milli, Some(524));
        // Remote, then migrated to the CPU's node at the fault (the kernel reports the
        // new node): the gap from the CPU's node to the others.
        let migrated = Hint::new(0, 1, false, 0, 0, &[0, 1], &slit());
        assert_eq!(migrated.gap_milli, Some(500));
        // No distances, or a CPU of unknown node: no gap, and so no stall estimate.
        assert_eq!(Hint::new(0, 1, false, 0, 1, &[0, 1], &[]).gap_milli, None);
        assert_eq!(
            Hint::new(0, 1, false, 7, 1, &[0, 1], &slit()).gap_milli,
            None
        );
    }

    #[test]
    fn a_step_with_enough_faults_uses_its_own() {
        // 20 remote faults in [100, 200), 40 local ones before.
        let mut hints: Vec<Hint> = (0..40).map(|i| hint(i, 0)).collect();
        hints.extend((0..20).map(|i| hint(100 + i, 1)));
        let r = estimate(&hints, 100, 200).unwrap();
        assert_eq!(r.basis, Basis::StepHints);
        assert_eq!((r.pages, r.remote_pages), (20, 20));
        assert!((r.share() - 1.0).abs() < 1e-9);
        // All remote at distance 20 vs 10: half the on-CPU time.
        assert_eq!(r.stall_ns(10_000), Some(5_000));
    }

    #[test]
    fn a_quiet_step_uses_the_latest_burst() {
        // 48 local then 16 remote faults long before, none in the step: one burst.
        let mut hints: Vec<Hint> = (0..48).map(|i| hint(i, 0)).collect();
        hints.extend((0..16).map(|i| hint(50 + i, 1)));
        hints.extend((0..8).map(|i| hint(1000 + i, 1))); // after the step: not used
        let r = estimate(&hints, 500, 600).unwrap();
        assert_eq!(r.basis, Basis::LatestHints);
        assert_eq!((r.pages, r.remote_pages), (64, 16));
        assert!((r.share() - 0.25).abs() < 1e-9);
        assert_eq!(r.stall_ns(1_000_000), Some(125_000));
        // Before the first fault: nothing to estimate from; nor from a handful.
        assert_eq!(estimate(&hints[48..], 0, 40), None);
        assert_eq!(estimate(&hints[..8], 100, 200), None);
        // A local-only window: share 0, stall 0 (measured as none, not unknown).
        let r = estimate(&hints[..48], 100, 200).unwrap();
        assert_eq!((r.remote_pages, r.stall_ns(1_000)), (0, Some(0)));
    }

    #[test]
    fn unknown_distance_keeps_the_share_but_not_the_stall() {
        let hints = [Hint::new(5, 32, false, 0, 1, &[0, 1], &[])];
        let r = estimate(&hints, 0, 10).unwrap();
        assert_eq!((r.share(), r.stall_ns(1_000)), (1.0, None));
        let json = serde_json::to_value(r).unwrap();
        assert_eq!(json["share"], 1.0);
        assert_eq!(json["hint_fault_pages"], 32);
        assert_eq!(json["from"], "this step's hinting faults");
    }

    #[test]
    fn resident_pages_seen_from_the_threads_node() {
        // 3 GiB on node 1, 1 GiB on node 0, the thread on node 0, SLIT 10/20.
        let kib = [1 << 20, 3 << 20];
        let r = Resident::new(100, &kib, 0, &slit()).unwrap();
        assert_eq!((r.pages, r.remote_pages), (1 << 20, 3 << 18));
        // Three quarters remote at half the time each: 375,000 ppm.
        assert_eq!(r.gap_ppm, Some(375_000));
        // From node 1 the same memory is a quarter remote.
        let from_1 = Resident::new(100, &kib, 1, &slit()).unwrap();
        assert_eq!(from_1.remote_pages, 1 << 18);
        // No distances: the share, no stall; no node or nothing resident: nothing.
        assert_eq!(Resident::new(100, &kib, 0, &[]).unwrap().gap_ppm, None);
        assert_eq!(Resident::new(100, &kib, -1, &slit()), None);
        assert_eq!(Resident::new(100, &[0, 0], 0, &slit()), None);
        // A step takes the latest reading before its end.
        let later = Resident::new(300, &[4 << 20, 0], 0, &slit()).unwrap();
        let readings = [r, later];
        assert_eq!(from_resident(&readings, 50), None);
        let step = from_resident(&readings, 200).unwrap();
        assert!((step.share() - 0.75).abs() < 1e-9);
        assert_eq!(step.stall_ns(1_000_000), Some(375_000));
        assert_eq!(from_resident(&readings, 400).unwrap().remote_pages, 0);
        let json = serde_json::to_value(step).unwrap();
        assert_eq!(json["resident_pages"], 1 << 20);
        assert_eq!(
            json["from"],
            "the target's resident pages per node (numa_maps)"
        );
    }

    /// Regression: a window of the latest 64 pages read a far-bound trainer as 84–86%
    /// remote in a guest run (the tail of a scan's burst, where local pages can gather);
    /// the whole burst is its scan's sample. An older burst is not mixed in once the
    /// latest has enough pages.
    #[test]
    fn the_window_is_the_whole_latest_burst() {
        let ms = 1_000_000;
        // An old burst, all local, a second before.
        let mut hints: Vec<Hint> = (0..100).map(|i| hint(i * 1000, 0)).collect();
        // The latest: 1000 remote pages, then 20 local ones at its end.
        let start = 1000 * ms;
        hints.extend((0..1000).map(|i| hint(start + i * 10_000, 1)));
        hints.extend((0..20).map(|i| hint(start + 10 * ms + i * 10_000, 0)));
        let r = estimate(&hints, 2000 * ms, 2100 * ms).unwrap();
        assert_eq!((r.pages, r.remote_pages), (1020, 1000));
        assert!(r.share() > 0.97, "{}", r.share());
        // A burst of a handful reaches back to the one before.
        let few = [hint(0, 1), hint(1, 1), hint(2, 1), hint(3, 1)];
        let mut sparse: Vec<Hint> = (0..16).map(|i| hint(i, 0)).collect();
        sparse.extend(few.iter().map(|h| Hint {
            ts_ns: h.ts_ns + 500 * ms,
            ..*h
        }));
        let r = estimate(&sparse, 600 * ms, 700 * ms).unwrap();
        assert_eq!((r.pages, r.remote_pages), (20, 4));
    }

    /// Readings every 10 ms of a thread on node 0 making 1,000 DRAM loads a ms, a quarter
    /// of them remote from 20 ms on.
    fn load_readings() -> Vec<LoadReading> {
        let ms = 1_000_000;
        (0..6u64)
            .map(|i| {
                let t = i * 10;
                let remote = t.saturating_sub(20) * 250;
                LoadReading {
                    ts_ns: t * ms,
                    dram: t * 1000,
                    remote,
                }
            })
            .collect()
    }

    #[test]
    fn counted_loads_are_interpolated_at_the_steps_ends() {
        let ms = 1_000_000;
        let r = load_readings();
        let gap = remote_gaps(&slit())[0];
        assert_eq!(gap, Some(500));
        // [25, 45) ms: 20,000 loads, 5,000 remote.
        let step = counted(&r, 25 * ms, 45 * ms, gap).unwrap();
        assert_eq!(step.basis, Basis::CountedLoads);
        assert_eq!((step.pages, step.remote_pages), (20_000, 5_000));
        assert!((step.share() - 0.25).abs() < 1e-9);
        // A quarter remote at half the time each: an eighth of the on-CPU time.
        assert_eq!(step.stall_ns(8_000_000), Some(1_000_000));
        // [5, 15) ms: all local, a stall of 0 (measured none, not unknown).
        let early = counted(&r, 5 * ms, 15 * ms, gap).unwrap();
        assert_eq!((early.pages, early.remote_pages), (10_000, 0));
        assert_eq!(early.stall_ns(1_000), Some(0));
        // Outside the readings: nothing, whichever end.
        assert_eq!(counted(&r, 45 * ms, 55 * ms, gap), None);
        assert_eq!(counted(&r[1..], 5 * ms, 15 * ms, gap), None);
        let json = serde_json::to_value(step).unwrap();
        assert_eq!(json["dram_loads"], 20_000);
        assert_eq!(json["remote_loads"], 5_000);
        assert_eq!(json["share"], 0.25);
        assert!(json.get("remote_pages").is_none());
    }

    #[test]
    fn counted_loads_without_distances_keep_the_share() {
        let at = |ts_ns, dram, remote| LoadReading {
            ts_ns,
            dram,
            remote,
        };
        let r = [at(0, 0, 0), at(100, 1000, 500)];
        let step = counted(&r, 0, 100, None).unwrap();
        assert_eq!((step.share(), step.stall_ns(1_000)), (0.5, None));
        // No distances, or one node (none other to be remote from): no gap.
        assert_eq!(remote_gaps(&[]), []);
        assert_eq!(remote_gaps(&[vec![10]]), [None]);
        // Three nodes at 20 and 30 from node 0: the gaps 500 and 666 averaged.
        let three = vec![vec![10, 20, 30], vec![20, 10, 20], vec![30, 20, 10]];
        assert_eq!(remote_gaps(&three), [Some(583), Some(500), Some(583)]);
        // A multiplexed counter's scaled count that dips reads as flat, not as a wrap.
        let dip = [at(0, 0, 0), at(100, 1000, 100), at(200, 990, 100)];
        assert_eq!(counted(&dip, 100, 200, Some(500)).unwrap().pages, 0);
    }

    #[test]
    fn trimming_the_loads_keeps_the_reading_before_the_cut() {
        let ms = 1_000_000;
        let mut r = load_readings();
        let before = counted(&r, 35 * ms, 45 * ms, Some(500));
        trim_loads(&mut r, 35 * ms);
        assert_eq!(r.len(), 3, "the readings at 30, 40 and 50 ms");
        assert_eq!(counted(&r, 35 * ms, 45 * ms, Some(500)), before);
    }
}
