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
    /// The rank whose steps these are (steps.json's `rank_pid`).
    pub rank_pid: Option<u32>,
}

/// A host's step on the merged axis, with its ranks' categories.
struct Placed {
    index: u64,
    start: i64,
    end: i64,
    ranks: Vec<Value>,
}

/// A host's steps on the merged axis, read one at a time: steps.json as the pipeline
/// writes it holds one step a line (`render::steps::StepsJson`). A host of one rank has no
/// `ranks` in its steps: its rank's categories are the step's.
struct Reader<'a> {
    lines: io::Lines<io::BufReader<std::fs::File>>,
    host: &'a HostSteps<'a>,
    alone: Option<(i32, u32)>,
    inside: bool,
    done: bool,
}

impl<'a> Reader<'a> {
    /// Reads `host`'s steps; `alone`: (rank, pid) of a host of one rank.
    fn open(host: &'a HostSteps<'a>, alone: Option<(i32, u32)>) -> io::Result<Self> {
        Ok(Reader {
            lines: io::BufRead::lines(io::BufReader::new(std::fs::File::open(host.steps)?)),
            host,
            alone,
            inside: false,
            done: false,
        })
    }

    fn place(&self, mut s: Value) -> Option<Placed> {
        let at = |k: &str| s[k].as_u64();
        let (index, start, end) = (at("index")?, at("start_ns")?, at("end_ns")?);
        let h = self.host;
        let ranks = match (s["ranks"].as_array_mut().map(std::mem::take), self.alone) {
            (Some(ranks), _) if !ranks.is_empty() => ranks,
            (_, Some((rank, pid))) => vec![serde_json::json!({"rank": rank, "pid": pid,
                "categories_ns": s["categories_ns"].take()})],
            _ => Vec::new(),
        };
        Some(Placed {
            index,
            start: h.clock.to_merged(h.wall_ns, start),
            end: h.clock.to_merged(h.wall_ns, end),
            ranks,
        })
    }
}

impl Iterator for Reader<'_> {
    type Item = io::Result<Placed>;

    fn next(&mut self) -> Option<io::Result<Placed>> {
        while !self.done {
            let line = match self.lines.next()? {
                Ok(line) => line,
                Err(e) => return Some(Err(e)),
            };
            let line = line.trim();
            if !self.inside {
                // `"steps": [` opens the array (`"steps": [],` when there is none).
                if line.starts_with("\"steps\"") {
                    self.inside = true;
                    self.done = line.ends_with("],");
                }
                continue;
            }
            if line.starts_with(']') {
                self.done = true;
                break;
            }
            let step = line.trim_end_matches(',');
            match serde_json::from_str::<Value>(step) {
                Ok(v) => {
                    if let Some(p) = self.place(v) {
                        return Some(Ok(p));
                    }
                }
                Err(e) => return Some(Err(io::Error::other(e))),
            }
        }
        None
    }
}

/// Another host's steps near the current global step: those wholly before it dropped,
/// those starting before its end read.
struct Near<'a> {
    reader: std::iter::Peekable<Reader<'a>>,
    buf: std::collections::VecDeque<Placed>,
}

impl Near<'_> {
    /// The step overlapping `[a, b)` most.
    fn overlapping(&mut self, a: i64, b: i64) -> io::Result<Option<&Placed>> {
        while self.buf.front().is_some_and(|s| s.end <= a) {
            self.buf.pop_front();
        }
        while let Some(next) = self.reader.peek() {
            match next {
                Ok(s) if s.start >= b => break,
                _ => {
                    let s = self.reader.next().transpose()?;
                    self.buf.extend(s.filter(|s| s.end > a));
                }
            }
        }
        Ok(best(self.buf.iter(), a, b))
    }
}

/// Of `steps`, the one overlapping `[a, b)` most.
fn best<'s>(steps: impl Iterator<Item = &'s Placed>, a: i64, b: i64) -> Option<&'s Placed> {
    steps
        .map(|s| (s.end.min(b) - s.start.max(a), s))
        .filter(|(overlap, _)| *overlap > 0)
        .max_by_key(|(overlap, s)| (*overlap, std::cmp::Reverse(s.start)))
        .map(|(_, s)| s)
}

#[derive(Serialize)]
struct RankStep<'a> {
    host: &'a str,
    /// The host's own step (its steps.json index) that overlaps this one most.
    host_step: u64,
    #[serde(flatten)]
    rank: Value,
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
    let Some((reference, others)) = hosts.split_first() else {
        return Ok(0);
    };
    let alone = |host: &HostSteps<'_>| {
        host.rank_pid.and_then(|pid| {
            merged
                .ranks
                .iter()
                .find(|r| r.host == host.clock.host && r.pid == pid)
                .map(|r| (r.rank, r.pid))
        })
    };
    let mut near = others
        .iter()
        .map(|h| {
            Ok(Near {
                reader: Reader::open(h, alone(h))?.peekable(),
                buf: std::collections::VecDeque::new(),
            })
        })
        .collect::<io::Result<Vec<_>>>()?;
    let mut w = io::BufWriter::with_capacity(1 << 20, std::fs::File::create(out)?);
    write!(
        w,
        "{{\"clock\":\"the reference host's wall clock, ns since the Unix epoch\",\
         \"reference\":{},\"steps\":[",
        Value::from(merged.reference.as_str())
    )?;
    let mut count = 0;
    for g in Reader::open(reference, alone(reference))? {
        let g = g?;
        let mut ranks: Vec<RankStep<'_>> = g
            .ranks
            .iter()
            .map(|r| RankStep {
                host: &reference.clock.host,
                host_step: g.index,
                rank: r.clone(),
            })
            .collect();
        for (h, n) in others.iter().zip(&mut near) {
            if let Some(s) = n.overlapping(g.start, g.end)? {
                ranks.extend(s.ranks.iter().map(|r| RankStep {
                    host: &h.clock.host,
                    host_step: s.index,
                    rank: r.clone(),
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
        if count > 0 {
            w.write_all(b",")?;
        }
        w.write_all(b"\n")?;
        serde_json::to_writer(&mut w, &step)?;
        count += 1;
    }
    w.write_all(b"\n]}\n")?;
    w.flush()?;
    Ok(count)
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

    /// Each global step takes the other host's step it overlaps most.
    #[test]
    fn most_overlapping_step() {
        let other = [step(7, 0, 90), step(8, 90, 210), step(9, 210, 300)];
        assert_eq!(best(other.iter(), 100, 200).map(|s| s.index), Some(8));
        assert_eq!(best(other.iter(), 195, 300).map(|s| s.index), Some(9));
        assert_eq!(best(other.iter(), 400, 500).map(|s| s.index), None);
    }

    /// The steps.json the pipeline writes is read one step at a time, every step in
    /// order, moved onto the merged axis; a host of one rank gets its rank's entry.
    #[test]
    fn reads_the_steps_the_pipeline_writes() {
        let dir = tempfile::tempdir().unwrap();
        let rec = dir.path().join("r.nctr");
        let xz = std::process::Command::new("xz")
            .arg("-dc")
            .arg(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../tests/data/h200/allreduce.nctr.xz"
            ))
            .output()
            .expect("xz (Debian's xz-utils)");
        std::fs::write(&rec, xz.stdout).unwrap();
        let out = dir.path().join("o");
        std::fs::create_dir(&out).unwrap();
        let rule = crate::attribute::StepRule::Auto;
        let mut outputs =
            crate::pipeline::replay_into(&rec, rule, crate::pipeline::EPOCH_EVENTS, &out).unwrap();
        crate::pipeline::write_outputs(&out, &mut outputs, &mut io::sink()).unwrap();
        let doc: Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("steps.json")).unwrap())
                .unwrap();
        let whole = doc["steps"].as_array().unwrap();
        assert!(whole.len() > 100);
        let clock = HostClock::fixed("h", 5);
        let path = out.join("steps.json");
        let host = HostSteps {
            steps: &path,
            wall_ns: 1_000,
            clock: &clock,
            rank_pid: outputs.steps.rank_pid,
        };
        let read: Vec<Placed> = Reader::open(&host, Some((3, 77)))
            .unwrap()
            .collect::<io::Result<_>>()
            .unwrap();
        assert_eq!(read.len(), whole.len());
        for (p, s) in read.iter().zip(whole) {
            assert_eq!(Some(p.index), s["index"].as_u64());
            assert_eq!(p.start, s["start_ns"].as_i64().unwrap() + 1_005);
            assert_eq!(p.ranks[0]["rank"], 3);
            assert_eq!(p.ranks[0]["categories_ns"], s["categories_ns"]);
        }
    }
}
