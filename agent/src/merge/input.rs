//! Reading each host's recording for its collectives, and the inputs together: labels,
//! one job.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::align::{Kept, Seen};
use super::{Input, MergeError, Skipped};
use crate::event::{Event, Func};
use crate::record::{RawRecord, Reader, RecordError};

/// CUDA calls in which the host waits for the GPU.
fn is_sync(f: Func) -> bool {
    matches!(
        f,
        Func::CuStreamSynchronize
            | Func::CuStreamSynchronizePtsz
            | Func::CuEventSynchronize
            | Func::CuCtxSynchronize
    )
}

/// Collectives kept per rank; past this, windows of them spread over the run.
pub(super) const KEEP: usize = 1 << 15;
/// Collectives kept of one window.
pub(super) const WINDOW_CAP: usize = KEEP / 8;
/// Width of a window of kept collectives, on the wall clock: every host keeps the same
/// windows (its clock is off by far less), so the kept collectives still pair up.
pub(super) const WINDOW_NS: u64 = 1_000_000_000;

/// Consecutive kept collectives of one window.
struct Run {
    first: usize,
    window: u64,
    seen: Vec<Seen>,
    /// The synchronisation end seen after each (0: none yet).
    synced: Vec<u64>,
}

/// One communicator's collectives while reading: every one up to [`KEEP`], then those of
/// every other window, every fourth… (the first window always), in memory bounded at any
/// run length.
#[derive(Default)]
pub(super) struct Sequence {
    runs: Vec<Run>,
    /// Index of the next collective.
    next: usize,
    /// The first collective not yet followed by a synchronisation.
    open_from: usize,
    kept: usize,
    /// Windows kept: those whose number is a multiple of this (0 or 1: all).
    pub(super) every: u64,
}

impl Sequence {
    fn keep(&mut self, c: &crate::event::Call, wall_ns: i64) {
        let i = self.next;
        self.next += 1;
        let window = u64::try_from(c.start_ns as i64 + wall_ns).unwrap_or(0) / WINDOW_NS;
        let head = self.runs.len() <= 1 && self.runs.first().is_none_or(|r| r.window == window);
        if !head && !window.is_multiple_of(self.every.max(1)) {
            return;
        }
        let seen = Seen {
            func: c.func,
            bytes: c.bytes.unwrap_or(0),
            arrival_ns: c.start_ns,
            done_ns: c.end_ns,
        };
        match self.runs.last_mut() {
            // A burst keeps its first WINDOW_CAP: memory stays bounded whatever the rate.
            Some(r) if r.window == window && r.seen.len() >= WINDOW_CAP => return,
            Some(r) if r.window == window && r.first + r.seen.len() == i => {
                r.seen.push(seen);
                r.synced.push(0);
            }
            _ => self.runs.push(Run {
                first: i,
                window,
                seen: vec![seen],
                synced: vec![0],
            }),
        }
        self.kept += 1;
        while self.kept > KEEP && self.runs.len() > 1 {
            self.every = self.every.max(1) * 2;
            let every = self.every;
            let mut n = 0;
            self.runs.retain(|r| {
                n += 1;
                n == 1 || r.window.is_multiple_of(every)
            });
            self.kept = self.runs.iter().map(|r| r.seen.len()).sum();
        }
    }

    /// A synchronisation of the process returned at `end_ns`: the collectives called before
    /// are seen complete then.
    fn synced(&mut self, end_ns: u64) {
        for run in self.runs.iter_mut().rev() {
            if run.first + run.seen.len() <= self.open_from {
                break;
            }
            for (n, s) in run.seen.iter().enumerate() {
                if run.first + n >= self.open_from && s.arrival_ns < end_ns {
                    run.synced[n] = end_ns;
                }
            }
        }
        self.open_from = self.next;
    }

    /// The collectives with their completion as seen: with CUDA synchronisations in the
    /// recording (`has_sync`) the call returns when the work is queued (NCCL's
    /// asynchronous calls), so completion is seen when a synchronisation after it returns
    /// (those never followed by one are left out); without any, the call itself waited
    /// for its peers.
    fn finish(self, has_sync: bool) -> Kept {
        let mut runs = Vec::new();
        for r in self.runs {
            if !has_sync {
                runs.push((r.first, r.seen));
                continue;
            }
            let mut cur: Option<(usize, Vec<Seen>)> = None;
            for (n, (s, synced)) in r.seen.into_iter().zip(r.synced).enumerate() {
                if synced == 0 {
                    runs.extend(cur.take());
                    continue;
                }
                let s = Seen {
                    done_ns: synced,
                    ..s
                };
                match &mut cur {
                    Some(c) => c.1.push(s),
                    None => cur = Some((r.first + n, vec![s])),
                }
            }
            runs.extend(cur);
        }
        Kept { runs }
    }
}

/// Communicators followed per process (in first-use order; later ones are not paired).
const MAX_COMMS: usize = 4;

/// One communicator of a rank: its name when its CommInitRank was seen, its collectives.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Communicator {
    /// [`crate::decode::unique_id`] of its ncclUniqueId, alike on every rank.
    pub unique_id: Option<u64>,
    pub kept: Kept,
}

/// Per process while reading: its communicators in first-use order, with the names the
/// CommInitRank calls seen gave them.
#[derive(Default)]
pub(super) struct Reading {
    pub(super) comms: Vec<(u64, Option<u64>, Sequence)>,
    /// Handle → unique id, from the CommInitRank calls seen.
    named: BTreeMap<u64, u64>,
    has_sync: bool,
}

impl Reading {
    pub(super) fn call(&mut self, c: &crate::event::Call, wall_ns: i64) {
        if let (Some(handle), Some(id)) = (c.new_comm(), c.comm_id()) {
            self.named.insert(handle, id);
        }
        if c.func.is_collective() {
            let handle = c.comm.unwrap_or(0);
            let k = match self.comms.iter().position(|(h, ..)| *h == handle) {
                Some(k) => k,
                None if self.comms.len() < MAX_COMMS => {
                    let id = self.named.get(&handle).copied();
                    self.comms.push((handle, id, Sequence::default()));
                    self.comms.len() - 1
                }
                None => return,
            };
            self.comms[k].2.keep(c, wall_ns);
        } else if is_sync(c.func) {
            self.has_sync = true;
            for (_, _, seq) in &mut self.comms {
                seq.synced(c.end_ns);
            }
        }
    }

    /// Its communicators in first-use order.
    pub(super) fn finish(self) -> Vec<Communicator> {
        let has_sync = self.has_sync;
        self.comms
            .into_iter()
            .map(|(_, unique_id, seq)| Communicator {
                unique_id,
                kept: seq.finish(has_sync),
            })
            .collect()
    }
}

/// Reads a recording's targets, rank identities and collectives.
pub fn read_input(path: &Path) -> Result<Input, RecordError> {
    let mut reader = Reader::open(path)?;
    let header = reader.header.clone();
    let mut targets = header.targets.clone();
    let mut procs: BTreeMap<u32, Reading> = BTreeMap::new();
    let mut init_ranks = BTreeMap::new();
    let wall_ns = header.clock.realtime_ns as i64 - header.clock.monotonic_ns as i64;
    let damage = loop {
        match reader.next_raw() {
            Ok(Some(RawRecord::Kernel(bytes))) => {
                // Probes are attached one function after another, and the clock reference
                // is taken once all are: calls before it may miss a function's calls.
                if let Ok(Event::Call(c)) = crate::decode::decode(bytes)
                    && c.start_ns >= header.clock.monotonic_ns
                {
                    if matches!(c.func, Func::CommInitRank | Func::CommInitRankConfig)
                        && let Some(rank) = c.rank()
                    {
                        init_ranks.insert(c.task.tgid, rank);
                    }
                    procs.entry(c.task.tgid).or_default().call(&c, wall_ns);
                }
            }
            Ok(Some(RawRecord::Meta(crate::record::Meta::Target { target }))) => {
                targets.push(*target);
            }
            Ok(Some(RawRecord::Meta(_))) => {}
            Ok(None) => break None,
            Err(e) => break Some(e.to_string()),
        }
    };
    let damage =
        damage.or_else(|| (reader.damage().regions > 0).then(|| reader.damage().to_string()));
    let pids: Vec<u32> = targets.iter().map(|t| t.pid).collect();
    let env_ranks: BTreeMap<u32, (String, i32)> = targets
        .iter()
        .filter_map(|t| Some((t.pid, t.env_rank.clone()?)))
        .collect();
    let ranks = crate::attribute::ranks::identify(&pids, &init_ranks, &env_ranks);
    Ok(Input {
        path: path.to_owned(),
        label: header.hostname.clone(),
        hostname: header.hostname.clone(),
        wall_ns,
        sampled: procs
            .values()
            .flat_map(|r| r.comms.iter().map(|c| c.2.every))
            .max()
            .filter(|e| *e > 1),
        targets,
        ranks,
        seen: procs
            .into_iter()
            .map(|(pid, r)| (pid, r.finish()))
            .collect(),
        damage,
    })
}

/// A recording named directly, or the `recording.nctr` in an output folder.
#[must_use]
pub fn recording_path(input: &Path) -> PathBuf {
    if input.is_dir() {
        input.join("recording.nctr")
    } else {
        input.to_owned()
    }
}

/// Unique host labels: the host name, with `#2`, `#3`… for the second and later agents of
/// one host.
fn label(inputs: &mut [Input]) {
    let mut count: BTreeMap<String, usize> = BTreeMap::new();
    for i in inputs {
        let n = count.entry(i.hostname.clone()).or_default();
        *n += 1;
        if *n > 1 {
            i.label = format!("{}#{n}", i.hostname);
        }
    }
}

/// The job a target belongs to, from its launcher's environment.
fn job(input: &Input) -> Option<String> {
    input
        .targets
        .iter()
        .find_map(|t| t.job.as_ref().map(|(var, v)| format!("{var}={v}")))
}

/// Reads the inputs, refusing mixed jobs; unreadable ones are skipped with the reason.
pub fn read_inputs(paths: &[PathBuf]) -> Result<(Vec<Input>, Vec<Skipped>), MergeError> {
    let mut inputs = Vec::new();
    let mut skipped = Vec::new();
    for p in paths {
        let path = recording_path(p);
        match read_input(&path) {
            Ok(i) if i.seen.values().flatten().all(|c| c.kept.is_empty()) => {
                skipped.push(Skipped {
                    recording: path,
                    reason: "no collectives recorded".into(),
                });
            }
            Ok(i) => inputs.push(i),
            Err(e) => skipped.push(Skipped {
                recording: path,
                reason: e.to_string(),
            }),
        }
    }
    if inputs.len() < 2 {
        return Err(MergeError::TooFew {
            given: paths.len(),
            usable: inputs.len(),
            skipped,
        });
    }
    label(&mut inputs);
    let jobs: Vec<(&Input, String)> = inputs.iter().filter_map(|i| Some((i, job(i)?))).collect();
    if let Some((a, a_job)) = jobs.first()
        && let Some((b, b_job)) = jobs.iter().find(|(_, j)| j != a_job)
    {
        return Err(MergeError::DifferentJobs {
            a: a.label.clone(),
            a_job: a_job.clone(),
            b: b.label.clone(),
            b_job: b_job.clone(),
        });
    }
    Ok((inputs, skipped))
}
