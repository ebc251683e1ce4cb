//! Each host's clock on the reference's, and the straggler across hosts.

use std::collections::BTreeMap;

use super::align::{self, AlignError, Alignment};
use super::input::{Communicator, KEEP};
use super::{CrossStraggler, HostClock, Input, METHOD, MergeError, Merged, MergedRank, Skipped};
use crate::attribute::ranks::{Matcher, RankIdentity, Straggler};

/// The rank every other is aligned with: on the host with the most ranks, its lowest rank
/// with collectives enough.
fn reference(inputs: &[Input]) -> (usize, u32) {
    let usable = |i: &Input| {
        i.ranks
            .iter()
            .filter(|r| {
                i.seen
                    .get(&r.pid)
                    .and_then(|c| c.first())
                    .is_some_and(|c| c.kept.len() >= align::MIN_MATCHED)
            })
            .min_by_key(|r| r.rank)
            .map(|r| r.pid)
    };
    inputs
        .iter()
        .enumerate()
        .filter_map(|(n, i)| Some((n, usable(i)?, i.ranks.len())))
        .max_by_key(|(n, _, ranks)| (*ranks, std::cmp::Reverse(*n)))
        .map_or((0, 0), |(n, pid, _)| (n, pid))
}

/// How far apart two ranks of one host may see the same collective complete.
const SAME_CLOCK_NS: u64 = 1_000_000;

/// One rank's pairing with the reference, on the way to the host's clock.
struct RankFit {
    input: usize,
    pid: u32,
    /// Which of its communicators (first-use order) is paired with the reference's.
    comm: usize,
    fit: Result<Alignment, AlignError>,
}

/// Of `x`'s communicators, the one to pair with the reference rank's first-used `r`: the
/// one of the same unique id when both CommInitRank calls were seen, else its first-used.
pub(super) fn counterpart(r: &Communicator, x: &[Communicator]) -> Result<usize, AlignError> {
    if let Some(id) = r.unique_id {
        if let Some(k) = x.iter().position(|c| c.unique_id == Some(id)) {
            return Ok(k);
        }
        if x.first().is_some_and(|c| c.unique_id.is_some()) {
            return Err(AlignError::OtherCommunicator { id });
        }
    }
    if x.is_empty() {
        Err(AlignError::TooFew {
            matched: 0,
            needed: align::MIN_MATCHED,
        })
    } else {
        Ok(0)
    }
}

/// Aligns every host's clock with the reference's and finds the straggler across hosts.
pub fn align_hosts(
    inputs: &[Input],
    mut skipped: Vec<Skipped>,
    clock_error_ns: u64,
) -> Result<Merged, MergeError> {
    let given = inputs.len() + skipped.len();
    let (ri, rpid) = reference(inputs);
    let empty = Communicator::default();
    let r = inputs[ri]
        .seen
        .get(&rpid)
        .and_then(|c| c.first())
        .unwrap_or(&empty);
    let mut fits = Vec::new();
    for (n, input) in inputs.iter().enumerate() {
        let guess = input.wall_ns - inputs[ri].wall_ns;
        // The reference host's own ranks share its clock: only their pairing is looked for.
        let error = if n == ri {
            SAME_CLOCK_NS
        } else {
            clock_error_ns
        };
        for (pid, x) in &input.seen {
            let error = if n == ri && *pid == rpid { 0 } else { error };
            let comm = counterpart(r, x);
            let fit = comm
                .clone()
                .and_then(|k| align::align(&r.kept, &x[k].kept, guess, error, n != ri));
            if let Err(source @ AlignError::Ambiguous { .. }) = &fit {
                return Err(MergeError::Ambiguous {
                    host: input.label.clone(),
                    rank: rank_of(input, *pid).0,
                    source: source.clone(),
                });
            }
            fits.push(RankFit {
                input: n,
                pid: *pid,
                comm: comm.unwrap_or(0),
                fit,
            });
        }
    }
    let mut hosts = Vec::new();
    let mut ranks = Vec::new();
    for (n, input) in inputs.iter().enumerate() {
        let mine: Vec<&RankFit> = fits.iter().filter(|f| f.input == n).collect();
        let good: Vec<&Alignment> = mine.iter().filter_map(|f| f.fit.as_ref().ok()).collect();
        for f in &mine {
            let (rank, rank_source) = rank_of(input, f.pid);
            let comm = input.seen.get(&f.pid).and_then(|c| c.get(f.comm));
            ranks.push(MergedRank {
                host: input.label.clone(),
                pid: f.pid,
                rank,
                rank_source,
                communicator: match comm.and_then(|c| c.unique_id) {
                    Some(id) => format!("unique id {id:#018x} (its ncclCommInitRank seen)"),
                    None => "first used (its ncclCommInitRank not seen)".into(),
                },
                collectives_matched: f.fit.as_ref().map_or(0, |a| a.matched),
                categories_ns: None,
                unmatched: f.fit.as_ref().err().map(ToString::to_string),
            });
        }
        let Some(clock) = host_clock(input, &good, n == ri, inputs[ri].wall_ns) else {
            let why = mine.iter().find_map(|f| f.fit.as_ref().err()).map_or_else(
                || "no rank with collectives".to_owned(),
                ToString::to_string,
            );
            skipped.push(Skipped {
                recording: input.path.clone(),
                reason: format!(
                    "its collectives do not line up with {}'s: {why}",
                    inputs[ri].label
                ),
            });
            continue;
        };
        hosts.push(clock);
    }
    if hosts.len() < 2 {
        return Err(MergeError::TooFew {
            given,
            usable: hosts.len(),
            skipped,
        });
    }
    let (straggler, all, lateness) = straggler(inputs, (ri, rpid), &fits, &hosts, &ranks);
    Ok(Merged {
        reference: inputs[ri].label.clone(),
        method: METHOD,
        clock_error_assumed_ns: clock_error_ns,
        hosts,
        ranks,
        straggler,
        collectives_matched_all_ranks: all,
        sampled: inputs.iter().filter_map(|i| i.sampled).max().map(|every| {
            format!(
                "past {KEEP} collectives a rank, only those in 1-s wall-clock windows whose \
                 number is a multiple of {every} are kept (and the first window)"
            )
        }),
        skipped,
        lateness,
    })
}

fn rank_of(input: &Input, pid: u32) -> (i32, String) {
    input
        .ranks
        .iter()
        .find(|r| r.pid == pid)
        .map_or((-1, "unknown".into()), |r| (r.rank, r.rank_source.clone()))
}

/// A host's clock from its ranks' alignments: the median correction, the widest bound
/// (the reference host: 0 by definition).
fn host_clock(
    input: &Input,
    good: &[&Alignment],
    is_ref: bool,
    ref_wall: i64,
) -> Option<HostClock> {
    let mut sorted: Vec<&&Alignment> = good.iter().collect();
    sorted.sort_by_key(|a| a.correction_ns);
    let mid = **sorted.get(sorted.len() / 2)?;
    let matched = good.iter().map(|a| a.matched).max().unwrap_or(0);
    let at = (mid.at_ns as i64 + ref_wall) as u64;
    Some(if is_ref {
        HostClock {
            host: input.label.clone(),
            hostname: input.hostname.clone(),
            recording: input.path.clone(),
            offset_ns: 0,
            error_bound_ns: 0,
            drift_ppm: 0.0,
            offset_at_unix_ns: at,
            causal_interval_ns: (0, 0),
            collectives_matched: matched,
            collectives_mismatched: good.iter().map(|a| a.mismatched).max().unwrap_or(0),
            damage: input.damage.clone(),
        }
    } else {
        HostClock {
            host: input.label.clone(),
            hostname: input.hostname.clone(),
            recording: input.path.clone(),
            offset_ns: mid.correction_ns,
            error_bound_ns: good.iter().map(|a| a.bound_ns).max().unwrap_or(0),
            drift_ppm: mid.drift_ppm,
            offset_at_unix_ns: at,
            causal_interval_ns: mid.causal_ns,
            collectives_matched: matched,
            collectives_mismatched: good.iter().map(|a| a.mismatched).max().unwrap_or(0),
            damage: input.damage.clone(),
        }
    })
}

impl HostClock {
    /// A time of this host (its monotonic clock) on the merged axis (the reference's
    /// wall clock).
    #[must_use]
    pub fn to_merged(&self, wall_ns: i64, t: u64) -> i64 {
        let wall = t as i64 + wall_ns;
        let drift = self.drift_ppm * 1e-6 * (wall as f64 - self.offset_at_unix_ns as f64);
        wall + self.offset_ns + drift.round() as i64
    }
}

/// Feeds every merged rank's collectives, paired through the reference and on the merged
/// axis, to the straggler matcher: (the straggler, collectives all ranks reached).
fn straggler(
    inputs: &[Input],
    reference: (usize, u32),
    fits: &[RankFit],
    hosts: &[HostClock],
    ranks: &[MergedRank],
) -> (Option<CrossStraggler>, u64, Vec<(u64, u32, u64)>) {
    let usable: Vec<(usize, &RankFit, &Alignment, &HostClock)> = fits
        .iter()
        .enumerate()
        .filter_map(|(id, f)| {
            let host = hosts.iter().find(|h| h.host == inputs[f.input].label)?;
            Some((id, f, f.fit.as_ref().ok()?, host))
        })
        .collect();
    let ids: Vec<RankIdentity> = usable
        .iter()
        .map(|(id, ..)| RankIdentity {
            pid: *id as u32,
            rank: ranks[*id].rank,
            rank_source: ranks[*id].rank_source.clone(),
        })
        .collect();
    let reference_id = usable
        .iter()
        .find(|(_, f, _, _)| (f.input, f.pid) == reference)
        .map_or(0, |(id, ..)| *id as u32);
    let empty = Communicator::default();
    let r = inputs[reference.0]
        .seen
        .get(&reference.1)
        .and_then(|c| c.first())
        .unwrap_or(&empty);
    // Every collective of the reference that every rank kept, its arrivals on the merged
    // axis.
    let mut m = Matcher::default();
    let mut lateness = Vec::new();
    let mut all = 0;
    for (j, _) in r.kept.iter() {
        let arrivals: BTreeMap<u32, u64> = usable
            .iter()
            .filter_map(|(id, f, a, host)| {
                let input = &inputs[f.input];
                let s = input
                    .seen
                    .get(&f.pid)?
                    .get(f.comm)?
                    .kept
                    .get(usize::try_from(j as i64 + a.shift).ok()?)?;
                let at = host.to_merged(input.wall_ns, s.arrival_ns);
                Some((*id as u32, u64::try_from(at).ok()?))
            })
            .collect();
        if arrivals.len() < usable.len().max(2) {
            continue;
        }
        m.record(&arrivals);
        lateness.extend(crate::attribute::ranks::late_entry(&arrivals, reference_id));
        all += 1;
    }
    lateness.sort_unstable();
    let straggler = m.straggler(&ids).map(|s| {
        let r = &ranks[s.pid as usize];
        CrossStraggler {
            host: r.host.clone(),
            straggler: Straggler { pid: r.pid, ..s },
        }
    });
    (straggler, all, lateness)
}
