//! steps.json of the merge: the reference rank's steps are the job's (global) steps; every
//! other host's step that overlaps one most on the merged axis gives its ranks'
//! categories for it, and the collectives matched across hosts name its slowest rank.

use std::io::{self, Write};
use std::path::Path;

use serde::Serialize;
use serde_json::Value;

use super::{HostClock, Merged};

/// One host's steps.json and clock.
pub struct HostSteps<'a> {
    pub steps: &'a Path,
    pub wall_ns: i64,
    pub clock: &'a HostClock,
}

/// A host's step on the merged axis, with its ranks' categories.
struct Placed {
    index: u64,
    start: i64,
    end: i64,
    ranks: Vec<Value>,
}

/// A host's steps on the merged axis. A host of one rank has no `ranks` in its steps: its
/// rank's categories are the step's.
fn placed(h: &HostSteps<'_>, merged: &Merged) -> io::Result<Vec<Placed>> {
    let text = std::fs::read(h.steps)?;
    let mut doc: Value = serde_json::from_slice(&text).map_err(io::Error::other)?;
    let alone = doc["rank_pid"].as_u64().and_then(|pid| {
        merged
            .ranks
            .iter()
            .find(|r| r.host == h.clock.host && u64::from(r.pid) == pid)
    });
    let steps = doc["steps"]
        .as_array_mut()
        .map(std::mem::take)
        .unwrap_or_default();
    Ok(steps
        .into_iter()
        .filter_map(|mut s| {
            let at = |k: &str| s[k].as_u64();
            let (start, end) = (at("start_ns")?, at("end_ns")?);
            Some(Placed {
                index: at("index")?,
                start: h.clock.to_merged(h.wall_ns, start),
                end: h.clock.to_merged(h.wall_ns, end),
                ranks: match (s["ranks"].as_array_mut().map(std::mem::take), alone) {
                    (Some(ranks), _) if !ranks.is_empty() => ranks,
                    (_, Some(r)) => vec![serde_json::json!({"rank": r.rank, "pid": r.pid,
                        "categories_ns": s["categories_ns"].take()})],
                    _ => Vec::new(),
                },
            })
        })
        .collect())
}

/// The step of `steps` (sorted) overlapping `[a, b)` most, from `from` on.
fn overlapping(steps: &[Placed], from: &mut usize, a: i64, b: i64) -> Option<usize> {
    while *from < steps.len() && steps[*from].end <= a {
        *from += 1;
    }
    let mut best: Option<(i64, usize)> = None;
    for (i, s) in steps.iter().enumerate().skip(*from) {
        if s.start >= b {
            break;
        }
        let overlap = s.end.min(b) - s.start.max(a);
        if overlap > 0 && best.is_none_or(|(o, _)| overlap > o) {
            best = Some((overlap, i));
        }
    }
    best.map(|(_, i)| i)
}

#[derive(Serialize)]
struct RankStep<'a> {
    host: &'a str,
    /// The host's own step (its steps.json index) that overlaps this one most.
    host_step: u64,
    #[serde(flatten)]
    rank: &'a Value,
}

#[derive(Serialize)]
struct GlobalStep<'a> {
    index: u64,
    start_unix_ns: i64,
    duration_ns: i64,
    ranks: Vec<RankStep<'a>>,
    /// The rank the matched collectives of this step waited for most.
    slowest: Option<Value>,
}

/// Writes `out` (steps.json) from the hosts' steps; `hosts[0]` is the reference. Returns
/// how many steps it holds.
pub fn merge_steps(out: &Path, hosts: &[HostSteps<'_>], merged: &Merged) -> io::Result<usize> {
    let placed = hosts
        .iter()
        .map(|h| placed(h, merged))
        .collect::<io::Result<Vec<_>>>()?;
    let Some((global, others)) = placed.split_first() else {
        return Ok(0);
    };
    let mut cursors = vec![0usize; others.len()];
    let mut w = io::BufWriter::with_capacity(1 << 20, std::fs::File::create(out)?);
    write!(
        w,
        "{{\"clock\":\"the reference host's wall clock, ns since the Unix epoch\",\
         \"reference\":{},\"steps\":[",
        Value::from(merged.reference.as_str())
    )?;
    for (n, g) in global.iter().enumerate() {
        let mut ranks: Vec<RankStep<'_>> = g
            .ranks
            .iter()
            .map(|r| RankStep {
                host: &hosts[0].clock.host,
                host_step: g.index,
                rank: r,
            })
            .collect();
        for (h, steps) in others.iter().enumerate() {
            if let Some(i) = overlapping(steps, &mut cursors[h], g.start, g.end) {
                ranks.extend(steps[i].ranks.iter().map(|r| RankStep {
                    host: &hosts[h + 1].clock.host,
                    host_step: steps[i].index,
                    rank: r,
                }));
            }
        }
        let slowest = crate::attribute::ranks::slowest_in(
            &merged.lateness,
            g.start.max(0) as u64,
            g.end.max(0) as u64,
        )
        .and_then(|id| merged.ranks.get(id as usize))
        .map(|r| serde_json::json!({"host": r.host, "rank": r.rank, "pid": r.pid}));
        let step = GlobalStep {
            index: g.index,
            start_unix_ns: g.start,
            duration_ns: g.end - g.start,
            ranks,
            slowest,
        };
        if n > 0 {
            w.write_all(b",")?;
        }
        w.write_all(b"\n")?;
        serde_json::to_writer(&mut w, &step)?;
    }
    w.write_all(b"\n]}\n")?;
    w.flush()?;
    Ok(global.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(index: u64, start: i64, end: i64) -> Placed {
        Placed {
            index,
            start,
            end,
            ranks: Vec::new(),
        }
    }

    /// Each global step takes the other host's step it overlaps most, skipping those
    /// wholly before it.
    #[test]
    fn most_overlapping_step() {
        let other = [step(7, 0, 90), step(8, 90, 210), step(9, 210, 300)];
        let mut from = 0;
        assert_eq!(overlapping(&other, &mut from, 100, 200), Some(1));
        assert_eq!(overlapping(&other, &mut from, 195, 300), Some(2));
        assert_eq!(from, 1);
        assert_eq!(overlapping(&other, &mut from, 400, 500), None);
    }
}
