//! Step detection: where each training step starts and ends, from the recording alone.
//!
//! Automatic rule (documented in docs/attribution.md): a rank issues the same sequence of
//! collectives, (op, bytes), once per step. The smallest period `p` with `seq[i] ==
//! seq[i + p]` for at least 90% of positions is the step's sequence. Its *anchor* is the
//! collective (told apart by its predecessor too) with the longest median idle gap before
//! it: the step's compute happens there. A step starts where the last CUDA sync before an
//! anchor returned (or, without such a sync, where the anchor starts) and ends where the
//! next step starts; the last step ends at the return of the last sync after its
//! collectives.

use serde::Serialize;

use crate::event::Func;

/// How steps were found.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Method {
    Auto,
    Symbol,
    Nvtx,
    Window,
}

/// One collective, as step detection sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Collective {
    pub func: Func,
    pub bytes: u64,
    pub start_ns: u64,
    pub end_ns: u64,
    /// The communicator handle as this process sees it (0: unknown).
    pub comm: u64,
}

/// Step boundaries and how they were found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Detected {
    pub method: Method,
    pub reason: String,
    /// Collectives per step (auto).
    pub period: Option<usize>,
    /// `[start, end)` of each step.
    pub bounds: Vec<(u64, u64)>,
}

/// Share of positions that must repeat for a period to be accepted.
const MIN_MATCH: f64 = 0.9;
/// Longest period considered.
const MAX_PERIOD: usize = 4096;

type Key = (Func, u64);

/// Most recent entries the period search looks at: enough for thousands of steps, and it
/// keeps the search linear on long runs (and past the warm-up).
const PERIOD_WINDOW: usize = 16_384;

/// The smallest period of `seq`, if one repeats at least twice.
#[must_use]
pub fn find_period<T: PartialEq>(seq: &[T]) -> Option<usize> {
    let seq = &seq[seq.len().saturating_sub(PERIOD_WINDOW)..];
    let n = seq.len();
    (1..=(n / 2).min(MAX_PERIOD)).find(|&p| {
        let matches = (0..n - p).filter(|&i| seq[i] == seq[i + p]).count();
        matches as f64 >= MIN_MATCH * (n - p) as f64
    })
}

/// The middle value (the upper of the two for an even count), 0 for none: selected, not
/// sorted (sorting an epoch's gaps was a twentieth of its attribution with one-call steps).
fn median(values: &mut [u64]) -> u64 {
    if values.is_empty() {
        return 0;
    }
    let mid = values.len() / 2;
    *values.select_nth_unstable(mid).1
}

/// Finds steps from a rank's collectives (all its threads, sorted by start) and its
/// training-loop thread's CUDA sync calls (`(start, end)`, sorted by start).
#[must_use]
pub fn detect(collectives: &[Collective], syncs: &[(u64, u64)]) -> Option<Detected> {
    // A thread's syncs arrive in order; `last_sync_end` relies on it.
    let sorted;
    let syncs = if syncs.is_sorted() {
        syncs
    } else {
        sorted = {
            let mut v = syncs.to_vec();
            v.sort_unstable();
            v
        };
        &sorted
    };
    by_syncs(collectives, syncs).or_else(|| by_gaps(collectives, syncs))
}

/// The return of the last sync in `(lo, hi]`.
fn last_sync_end(syncs: &[(u64, u64)], lo: u64, hi: u64) -> Option<u64> {
    // Syncs are in start order (one thread's calls): only those starting in [lo, hi).
    let first = syncs.partition_point(|(s, _)| *s < lo);
    syncs[first..]
        .iter()
        .take_while(|(s, _)| *s < hi)
        .filter(|(_, e)| *e <= hi)
        .map(|(_, e)| *e)
        .max()
}

/// Steps from the syncs between collectives: most loops wait on the GPU once a step
/// (`loss.item()`), which splits the collectives into segments. The repeating unit of
/// segments (usually one) is the step. This also finds steps whose collectives repeat with
/// a shorter period than the step (six layers' weight and bias all-reduced in turn).
fn by_syncs(collectives: &[Collective], syncs: &[(u64, u64)]) -> Option<Detected> {
    // (first collective, sync return before it) of each segment.
    let mut segments: Vec<(usize, u64)> = Vec::new();
    for i in 1..collectives.len() {
        if let Some(end) = last_sync_end(syncs, collectives[i - 1].end_ns, collectives[i].start_ns)
        {
            segments.push((i, end));
        }
    }
    if segments.len() < 3 {
        return None;
    }
    let symbols: Vec<Vec<Key>> = segments
        .iter()
        .enumerate()
        .map(|(k, &(first, _))| {
            let next = segments.get(k + 1).map_or(collectives.len(), |s| s.0);
            collectives[first..next]
                .iter()
                .map(|c| (c.func, c.bytes))
                .collect()
        })
        .collect();
    let per_step = find_period(&symbols)?;
    // Phase: the segment with the longest median idle gap before it starts a step.
    let phase = (0..per_step)
        .max_by_key(|&r| {
            let mut gaps: Vec<u64> = segments
                .iter()
                .skip(r)
                .step_by(per_step)
                .map(|&(i, _)| {
                    collectives[i]
                        .start_ns
                        .saturating_sub(collectives[i - 1].end_ns)
                })
                .collect();
            median(&mut gaps)
        })
        .unwrap_or(0);
    let mut starts: Vec<u64> = segments
        .iter()
        .skip(phase)
        .step_by(per_step)
        .map(|&(_, end)| end)
        .collect();
    let last = collectives.last()?;
    if let Some(final_sync) = syncs.iter().rev().find(|(s, _)| *s >= last.end_ns) {
        starts.push(final_sync.1);
    }
    let bounds: Vec<(u64, u64)> = starts
        .windows(2)
        .filter(|w| w[1] > w[0])
        .map(|w| (w[0], w[1]))
        .collect();
    if bounds.len() < 2 {
        return None;
    }
    let calls = symbols[phase..]
        .iter()
        .take(per_step)
        .map(Vec::len)
        .sum::<usize>();
    Some(Detected {
        method: Method::Auto,
        reason: format!(
            "the rank waits on the GPU between its collectives in a repeating pattern \
             ({per_step} sync-separated group(s), {calls} collectives a step); steps cut at \
             the return of that CUDA sync"
        ),
        period: Some(calls),
        bounds,
    })
}

/// A collective's key after the one before it (none for the first).
type Pair = (Option<Key>, Key);

/// Steps from the repeating collective sequence alone, cut at the longest idle gap.
fn by_gaps(collectives: &[Collective], syncs: &[(u64, u64)]) -> Option<Detected> {
    let seq: Vec<Key> = collectives.iter().map(|c| (c.func, c.bytes)).collect();
    let period = find_period(&seq)?;
    // Anchor: the (previous key, key) pair with the longest median gap before it, among
    // pairs occurring about once per period.
    // Each pair's gaps in a slot found by hashing (the tree's lookup was most of the
    // detection on a run of one-call steps), but for the pair of the collective before:
    // with a period of one call, every pair is the same. The anchor chosen below does not
    // depend on the order.
    let mut slot_of: std::collections::HashMap<Pair, usize, foldhash::fast::FixedState> =
        std::collections::HashMap::default();
    let mut gaps: Vec<(Pair, Vec<u64>)> = Vec::new();
    let mut last: Option<(Pair, usize)> = None;
    for i in 0..collectives.len() {
        let pair = (i.checked_sub(1).map(|j| seq[j]), seq[i]);
        let gap = i.checked_sub(1).map_or(0, |j| {
            collectives[i]
                .start_ns
                .saturating_sub(collectives[j].end_ns)
        });
        let slot = match last {
            Some((p, slot)) if p == pair => slot,
            _ => *slot_of.entry(pair).or_insert_with(|| {
                gaps.push((pair, Vec::new()));
                gaps.len() - 1
            }),
        };
        last = Some((pair, slot));
        gaps[slot].1.push(gap);
    }
    let periods = collectives.len() / period;
    let anchor = gaps
        .iter_mut()
        .filter(|(_, g)| g.len() <= periods + 1 && g.len() + 1 >= periods)
        .map(|(k, g)| (median(g), *k))
        .max()?
        .1;
    let anchors: Vec<usize> = (0..collectives.len())
        .filter(|&i| (i.checked_sub(1).map(|j| seq[j]), seq[i]) == anchor)
        .collect();
    // The return of the last sync in (previous collective's end, anchor's start].
    let boundary = |i: usize| -> Option<u64> {
        let lo = i.checked_sub(1).map_or(0, |j| collectives[j].end_ns);
        let hi = collectives[i].start_ns;
        last_sync_end(syncs, lo, hi).or((i > 0).then_some(hi))
    };
    let mut starts: Vec<u64> = anchors.iter().filter_map(|&i| boundary(i)).collect();
    // The last step ends at the last sync after its collectives.
    if let (Some(&last), Some(final_sync)) = (anchors.last(), syncs.last())
        && final_sync.0 >= collectives[last].start_ns
    {
        starts.push(final_sync.1);
    }
    starts.dedup();
    let bounds: Vec<(u64, u64)> = starts
        .windows(2)
        .filter(|w| w[1] > w[0])
        .map(|w| (w[0], w[1]))
        .collect();
    if bounds.is_empty() {
        return None;
    }
    Some(Detected {
        method: Method::Auto,
        reason: format!(
            "the rank's collectives repeat every {period} calls ({} occurrences); steps cut \
             at the return of the CUDA sync before the collective {} of {} bytes",
            anchors.len(),
            anchor.1.0.name(),
            anchor.1.1
        ),
        period: Some(period),
        bounds,
    })
}

/// Steps between consecutive entries into the `--step-symbol` function (each step starts
/// at an entry and ends at the next).
#[must_use]
pub fn by_marker(entries: &[u64]) -> Option<Detected> {
    let mut starts = entries.to_vec();
    starts.sort_unstable();
    starts.dedup();
    let bounds: Vec<(u64, u64)> = starts.windows(2).map(|w| (w[0], w[1])).collect();
    (!bounds.is_empty()).then(|| Detected {
        method: Method::Symbol,
        reason: format!(
            "--step-symbol: {} entries into the marker function; each step runs from one entry \
             to the next",
            starts.len()
        ),
        period: None,
        bounds,
    })
}

/// Steps from NVTX range pushes whose name matched `pattern`: each step runs from one
/// matching push to the next.
#[must_use]
pub fn by_nvtx(pushes: &[u64], pattern: &str) -> Option<Detected> {
    by_marker(pushes).map(|d| Detected {
        method: Method::Nvtx,
        reason: format!(
            "--step-nvtx {pattern:?}: {} NVTX ranges pushed with a matching name; each step \
             runs from one push to the next",
            d.bounds.len() + 1
        ),
        ..d
    })
}

/// At most this many windows: a span that would need more (a recording whose clock is
/// damaged, or a tiny `--step-window` over days) gets wider windows, and says so.
pub const MAX_WINDOWS: u64 = 100_000;

/// Fixed windows of `width_ns` over `[start, end)`.
#[must_use]
pub fn windows(start: u64, end: u64, width_ns: u64, mut reason: String) -> Detected {
    let span = end.saturating_sub(start);
    let mut width = width_ns.max(1);
    if span / width >= MAX_WINDOWS {
        width = span.div_ceil(MAX_WINDOWS).max(1);
        reason = format!("{reason} (widened to {width} ns: at most {MAX_WINDOWS} windows)");
    }
    let mut bounds = Vec::new();
    let mut t = start;
    while t < end {
        let next = t.saturating_add(width).min(end);
        bounds.push((t, next));
        t = next;
    }
    Detected {
        method: Method::Window,
        reason,
        period: None,
        bounds,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A synthetic rank: per step, `compute` ns idle, then the ops (each 10 µs), then a
    /// 1 ms sync.
    fn rank(steps: usize, ops: &[(Func, u64)], compute: u64) -> (Vec<Collective>, Vec<(u64, u64)>) {
        let (mut colls, mut syncs, mut t) = (Vec::new(), Vec::new(), 1_000u64);
        for _ in 0..steps {
            t += compute;
            for &(func, bytes) in ops {
                colls.push(Collective {
                    func,
                    bytes,
                    start_ns: t,
                    end_ns: t + 10_000,
                    comm: 0,
                });
                t += 12_000;
            }
            syncs.push((t, t + 1_000_000));
            t += 1_000_000;
        }
        (colls, syncs)
    }

    const OPS: [(Func, u64); 4] = [
        (Func::AllReduce, 4096),
        (Func::AllReduce, 4096),
        (Func::AllReduce, 8192),
        (Func::Broadcast, 64),
    ];

    /// The period is the number of collectives per step, even with a repeated op inside.
    #[test]
    fn period_of_a_step() {
        let (c, _) = rank(10, &OPS, 5_000_000);
        let seq: Vec<Key> = c.iter().map(|c| (c.func, c.bytes)).collect();
        assert_eq!(find_period(&seq), Some(4));
        assert_eq!(find_period(&seq[..3]), None);
    }

    /// Steps start where the previous step's sync returned: N steps run give N-1 complete
    /// steps (the first has no sync before it), each as long as a step.
    #[test]
    fn steps_cut_at_syncs() {
        let (c, s) = rank(10, &OPS, 5_000_000);
        let d = detect(&c, &s).unwrap();
        assert_eq!(d.method, Method::Auto);
        assert_eq!(d.period, Some(4));
        assert_eq!(d.bounds.len(), 9);
        for (a, b) in &d.bounds {
            assert_eq!(b - a, 5_000_000 + 4 * 12_000 + 1_000_000);
        }
        assert_eq!(d.bounds[0].0, s[0].1);
        assert_eq!(d.bounds.last().unwrap().1, s.last().unwrap().1);
    }

    /// Warm-up steps with other collectives and an extra collective in one step do not
    /// change the period or lose more than one step.
    #[test]
    fn robust_to_warmup_and_extras() {
        let (mut c, s) = rank(30, &OPS, 3_000_000);
        // An extra collective in step 12, in its compute phase.
        let at = 12 * 4;
        let t = c[at].start_ns - 1_000_000;
        c.insert(
            at,
            Collective {
                func: Func::AllGather,
                bytes: 1,
                start_ns: t,
                end_ns: t + 5,
                comm: 0,
            },
        );
        // Two warm-up broadcasts long before.
        for k in 0..2 {
            c.insert(
                0,
                Collective {
                    func: Func::Broadcast,
                    bytes: 999,
                    start_ns: k,
                    end_ns: k + 1,
                    comm: 0,
                },
            );
        }
        c.sort_by_key(|c| c.start_ns);
        let d = detect(&c, &s).unwrap();
        assert_eq!(d.period, Some(4));
        assert!(
            (28..=30).contains(&d.bounds.len()),
            "{} steps",
            d.bounds.len()
        );
    }

    /// Weight and bias all-reduced in turn for six layers: the key sequence repeats every
    /// 2 calls, but the sync once a step gives 12 collectives a step.
    #[test]
    fn step_longer_than_key_period() {
        let ops: Vec<(Func, u64)> = (0..6)
            .flat_map(|_| [(Func::AllReduce, 16_777_216), (Func::AllReduce, 8192)])
            .collect();
        let (c, s) = rank(20, &ops, 2_000_000);
        let seq: Vec<Key> = c.iter().map(|c| (c.func, c.bytes)).collect();
        assert_eq!(find_period(&seq), Some(2));
        let d = detect(&c, &s).unwrap();
        assert_eq!(d.period, Some(12));
        assert_eq!(d.bounds.len(), 19);
        assert!(d.reason.contains("sync"), "{}", d.reason);
    }

    /// Nothing repeats: no steps (the caller falls back to windows).
    #[test]
    fn nothing_repeats() {
        let c: Vec<Collective> = (0..10)
            .map(|i| Collective {
                func: Func::AllReduce,
                bytes: i,
                start_ns: i * 10,
                end_ns: i * 10 + 1,
                comm: 0,
            })
            .collect();
        assert_eq!(detect(&c, &[]), None);
        let w = windows(0, 250, 100, "test".into());
        assert_eq!(w.bounds, vec![(0, 100), (100, 200), (200, 250)]);
    }

    /// A damaged clock (found by the fuzzer: a recording spanning 2^64 ns) gives at most
    /// MAX_WINDOWS windows, covering the span, instead of exhausting memory.
    #[test]
    fn windows_are_bounded() {
        let d = windows(5, u64::MAX, 1_000_000_000, "x".into());
        assert!(d.bounds.len() as u64 <= MAX_WINDOWS);
        assert_eq!(d.bounds.first().unwrap().0, 5);
        assert_eq!(d.bounds.last().unwrap().1, u64::MAX);
        assert!(d.reason.contains("widened"));
        let d = windows(0, 10_000, 1000, "y".into());
        assert_eq!(d.bounds.len(), 10);
        assert_eq!(d.reason, "y");
    }

    /// The selected median is the sorted one: odd and even counts, repeats, none.
    #[test]
    fn median_is_the_sorted_middle() {
        let mut x = 7u64;
        for n in [0usize, 1, 2, 3, 10, 101, 1000] {
            let v: Vec<u64> = (0..n)
                .map(|_| {
                    x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                    (x >> 33) % 50
                })
                .collect();
            let mut sorted = v.clone();
            sorted.sort_unstable();
            let want = sorted.get(n / 2).copied().unwrap_or(0);
            assert_eq!(median(&mut v.clone()), want, "{v:?}");
        }
    }
}
