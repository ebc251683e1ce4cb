//! `nccltrace merge`: several hosts' recordings on one time axis.
//!
//! Each recording is read once for its collectives ([`read_input`]); every rank is aligned
//! with one reference rank ([`align`]), which gives each host's clock correction with its
//! error bound, and the pairing of collectives across hosts that the straggler verdict
//! needs. Each host's own outputs are then made by the same pipeline as `report`, one
//! host at a time (`hosts/<host>/`), and joined: trace.json on the aligned axis
//! ([`trace`]), summary.json and the words with the offsets and the cross-host straggler.

pub mod align;
mod steps;
pub mod trace;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::attribute::ranks::{Matcher, RankIdentity, Straggler};
use crate::event::{Event, Func};
use crate::record::{RawRecord, Reader, RecordError, TargetInfo};
use align::{AlignError, Alignment, Kept, Seen};

/// Why recordings could not be merged.
#[derive(Debug, thiserror::Error)]
pub enum MergeError {
    #[error(
        "merge needs the recordings of at least two hosts (or agents); {usable} usable of \
         {given} given{}",
        reasons(skipped)
    )]
    TooFew {
        given: usize,
        usable: usize,
        skipped: Vec<Skipped>,
    },
    #[error("{a} and {b} are different jobs ({a_job} vs {b_job}): merge the recordings of one job")]
    DifferentJobs {
        a: String,
        a_job: String,
        b: String,
        b_job: String,
    },
    #[error(
        "host {host}, rank {rank}: {source}. Pass --clock-error with what the hosts' wall \
         clocks may really differ by (smaller than half a step), e.g. --clock-error 1ms"
    )]
    Ambiguous {
        host: String,
        rank: i32,
        #[source]
        source: AlignError,
    },
}

impl MergeError {
    /// Every merge error is about the input the user gave.
    #[must_use]
    pub fn is_bad_input(&self) -> bool {
        true
    }
}

fn reasons(skipped: &[Skipped]) -> String {
    use std::fmt::Write as _;
    skipped.iter().fold(String::new(), |mut out, s| {
        let _ = write!(out, "; {}: {}", s.recording.display(), s.reason);
        out
    })
}

/// A recording left out of the merge, and why.
#[derive(Clone, Debug, Serialize)]
pub struct Skipped {
    pub recording: PathBuf,
    pub reason: String,
}

/// What the user asked for.
#[derive(Clone, Debug)]
pub struct Options {
    pub inputs: Vec<PathBuf>,
    /// What the hosts' wall clocks may differ by.
    pub clock_error_ns: u64,
    pub rule: crate::attribute::StepRule,
}

/// One recording, read for what the alignment needs.
#[derive(Debug)]
pub struct Input {
    pub path: PathBuf,
    /// The host's name, made unique among the inputs.
    pub label: String,
    pub hostname: String,
    /// realtime − monotonic at attach: the wall clock's word on this host's clock.
    pub wall_ns: i64,
    pub targets: Vec<TargetInfo>,
    pub ranks: Vec<RankIdentity>,
    /// Per pid: its communicators in first-use order, with their collectives (in windows
    /// past [`KEEP`]).
    pub seen: BTreeMap<u32, Vec<Communicator>>,
    /// Past [`KEEP`] collectives of a rank, one window in this many was kept.
    pub sampled: Option<u64>,
    /// Damage met while reading (the collectives before it are kept).
    pub damage: Option<String>,
}

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
const KEEP: usize = 1 << 15;
/// Collectives kept of one window.
const WINDOW_CAP: usize = KEEP / 8;
/// Width of a window of kept collectives, on the wall clock: every host keeps the same
/// windows (its clock is off by far less), so the kept collectives still pair up.
const WINDOW_NS: u64 = 1_000_000_000;

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
struct Sequence {
    runs: Vec<Run>,
    /// Index of the next collective.
    next: usize,
    /// The first collective not yet followed by a synchronisation.
    open_from: usize,
    kept: usize,
    /// Windows kept: those whose number is a multiple of this (0 or 1: all).
    every: u64,
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
struct Reading {
    comms: Vec<(u64, Option<u64>, Sequence)>,
    /// Handle → unique id, from the CommInitRank calls seen.
    named: BTreeMap<u64, u64>,
    has_sync: bool,
}

impl Reading {
    fn call(&mut self, c: &crate::event::Call, wall_ns: i64) {
        if let (Some(handle), Some(id)) = (c.new_comm, c.comm_id) {
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
    fn finish(self) -> Vec<Communicator> {
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
                        && let Some(rank) = c.rank
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

/// One rank in the merge.
#[derive(Clone, Debug, Serialize)]
pub struct MergedRank {
    pub host: String,
    pub pid: u32,
    pub rank: i32,
    pub rank_source: String,
    /// Which of its communicators was paired with the reference rank's: the one of the
    /// same unique id (its ncclCommInitRank seen), or its first-used.
    pub communicator: String,
    /// Collectives paired with the reference rank's.
    pub collectives_matched: usize,
    /// Its training-loop thread's categories over the run, from its host's summary.
    pub categories_ns: Option<crate::attribute::Categories>,
    /// Why it was left out of the cross-host matching.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unmatched: Option<String>,
}

/// One host's clock, as the merge puts it on the reference's.
#[derive(Clone, Debug, Serialize)]
pub struct HostClock {
    pub host: String,
    pub hostname: String,
    pub recording: PathBuf,
    /// Added to this host's wall-clock times to put them on the reference host's, at
    /// `offset_at_unix_ns`.
    pub offset_ns: i64,
    /// The offset lies within ± this.
    pub error_bound_ns: u64,
    pub drift_ppm: f64,
    pub offset_at_unix_ns: u64,
    /// The interval causality alone allows (the waits on collectives cannot end before
    /// the last rank arrived).
    pub causal_interval_ns: (i64, i64),
    pub collectives_matched: usize,
    /// Pairs left out because one side lost a call (their calls or sizes differ).
    pub collectives_mismatched: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub damage: Option<String>,
}

/// The straggler across hosts.
#[derive(Clone, Debug, Serialize)]
pub struct CrossStraggler {
    pub host: String,
    #[serde(flatten)]
    pub straggler: Straggler,
}

/// What the alignment found: every host's clock, the ranks, the straggler.
#[derive(Debug, Serialize)]
pub struct Merged {
    pub reference: String,
    pub method: &'static str,
    pub clock_error_assumed_ns: u64,
    pub hosts: Vec<HostClock>,
    pub ranks: Vec<MergedRank>,
    pub straggler: Option<CrossStraggler>,
    /// Collectives every merged rank reached, matched across hosts.
    pub collectives_matched_all_ranks: u64,
    /// Set when a rank had more collectives than are kept: which windows of the run the
    /// offsets, the straggler and the steps' slowest ranks come from.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sampled: Option<String>,
    pub skipped: Vec<Skipped>,
    /// Per collective all ranks reached, by the reference rank's arrival (merged axis):
    /// (that arrival, the rank arriving last as an index into `ranks`, how late).
    #[serde(skip)]
    pub lateness: Vec<(u64, u32, u64)>,
}

const METHOD: &str = "collectives paired per communicator (first-used) by calls and sizes; \
    each host's offset is the median difference of the ends of the waits on them, bounded by \
    causality (no wait ends before the last rank arrived) and the central 90% of the differences";

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
fn counterpart(r: &Communicator, x: &[Communicator]) -> Result<usize, AlignError> {
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
                .and_then(|k| align::align(&r.kept, &x[k].kept, guess, error));
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

/// The merge in words.
pub fn write_text(m: &Merged, out: &mut impl std::io::Write) -> std::io::Result<()> {
    writeln!(
        out,
        "nccltrace merge: {} hosts on {}'s clock",
        m.hosts.len(),
        m.reference
    )?;
    for h in &m.hosts {
        writeln!(
            out,
            "  {:<24} offset {:+10.3} ms ± {:.3} ms, drift {:+.2} ppm, {} collectives paired{}",
            h.host,
            h.offset_ns as f64 / 1e6,
            h.error_bound_ns as f64 / 1e6,
            h.drift_ppm,
            h.collectives_matched,
            if h.collectives_mismatched > 0 {
                format!(
                    " ({} left out: a call lost on one side)",
                    h.collectives_mismatched
                )
            } else {
                String::new()
            }
        )?;
    }
    for r in m.ranks.iter().filter(|r| r.unmatched.is_some()) {
        writeln!(
            out,
            "  left out: {} rank {} (pid {}): {}",
            r.host,
            r.rank,
            r.pid,
            r.unmatched.as_deref().unwrap_or_default()
        )?;
    }
    for s in &m.skipped {
        writeln!(out, "  skipped: {}: {}", s.recording.display(), s.reason)?;
    }
    if let Some(sampled) = &m.sampled {
        writeln!(out, "  sampled: {sampled}")?;
    }
    match &m.straggler {
        Some(s) => writeln!(
            out,
            "straggler across hosts: {} rank {} (pid {}): {:.0}% of the waits, {:.3} ms late \
             on average over {} collectives all ranks reached",
            s.host,
            s.straggler.rank,
            s.straggler.pid,
            s.straggler.share_of_waits * 100.0,
            s.straggler.mean_lateness_ns as f64 / 1e6,
            m.collectives_matched_all_ranks
        ),
        None if m.collectives_matched_all_ranks == 0 => writeln!(
            out,
            "straggler across hosts: none (no collective that every rank reached)"
        ),
        None => writeln!(
            out,
            "straggler across hosts: none (no rank made the others wait)"
        ),
    }
}

pub use steps::{HostSteps, merge_steps};
pub use trace::merge_traces;

#[cfg(test)]
impl HostClock {
    /// A host whose clock is `offset_ns` off the reference's, without drift.
    pub(crate) fn fixed(host: &str, offset_ns: i64) -> HostClock {
        HostClock {
            host: host.into(),
            hostname: host.into(),
            recording: PathBuf::new(),
            offset_ns,
            error_bound_ns: 0,
            drift_ppm: 0.0,
            offset_at_unix_ns: 0,
            causal_interval_ns: (0, 0),
            collectives_matched: 0,
            collectives_mismatched: 0,
            damage: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{Call, Task};

    fn call(func: Func, start: u64, end: u64, comm: u64) -> Call {
        Call {
            count: Some(1),
            datatype: Some(7),
            bytes: Some(4),
            comm: Some(comm),
            ..Call::new(Task::default(), func, start, end)
        }
    }

    /// Asynchronous collectives are seen complete when the next synchronisation returns;
    /// ones never followed by one are left out; only the first-used communicator counts.
    /// Without any synchronisation in the recording, the call's own end is its completion.
    #[test]
    fn completion_seen_at_the_next_sync() {
        let mut r = Reading::default();
        r.call(&call(Func::AllReduce, 10, 12, 0xa), 0);
        r.call(&call(Func::AllReduce, 20, 22, 0xb), 0);
        r.call(&call(Func::AllReduce, 30, 32, 0xa), 0);
        r.call(&call(Func::CuStreamSynchronize, 40, 90, 0), 0);
        r.call(&call(Func::AllReduce, 100, 102, 0xa), 0);
        let seen = r.finish().swap_remove(0).kept;
        assert_eq!(
            seen.iter()
                .map(|(i, s)| (i, s.arrival_ns, s.done_ns))
                .collect::<Vec<_>>(),
            [(0, 10, 90), (1, 30, 90)]
        );
        let mut r = Reading::default();
        r.call(&call(Func::AllReduce, 10, 12, 0xa), 0);
        assert_eq!(r.finish()[0].kept.get(0).unwrap().done_ns, 12);
    }

    /// A rank of 200 s at 1,000 collectives a second keeps at most KEEP of them, in whole
    /// wall-clock windows (the first always), spread over the run: memory bounded at any
    /// length, and every host keeps the same windows. A burst in one window keeps its
    /// first WINDOW_CAP.
    #[test]
    fn long_runs_keep_windows() {
        let mut r = Reading::default();
        for i in 0..200_000u64 {
            let t = 5_000_000_000 + i * 1_000_000;
            r.call(&call(Func::AllReduce, t, t + 10, 0xa), 0);
        }
        assert_eq!(r.comms[0].2.every, 8);
        let kept = r.finish().swap_remove(0).kept;
        assert!(
            kept.len() <= KEEP && kept.len() > KEEP / 2,
            "{}",
            kept.len()
        );
        let windows: Vec<u64> = kept
            .runs
            .iter()
            .map(|(first, _)| (5_000_000_000 + *first as u64 * 1_000_000) / WINDOW_NS)
            .collect();
        assert_eq!(windows[0], 5);
        assert!(windows[1..].iter().all(|w| w % 8 == 0), "{windows:?}");
        assert!(kept.runs[1..].iter().all(|(_, run)| run.len() == 1000));
        assert_eq!(kept.get(3_000).map(|s| s.arrival_ns), Some(8_000_000_000));
        // 100,000 in one second: its first WINDOW_CAP.
        let mut r = Reading::default();
        for i in 0..100_000u64 {
            r.call(&call(Func::AllReduce, i * 10_000, i * 10_000 + 10, 0xa), 0);
        }
        assert_eq!(r.finish()[0].kept.len(), WINDOW_CAP);
    }

    /// Communicators are named by the unique id of the CommInitRank seen for them; a rank
    /// is paired through the communicator of the reference's id, else its first-used, and
    /// refused when its named communicators are all others.
    #[test]
    fn communicators_paired_by_unique_id() {
        let mut r = Reading::default();
        let init = |handle: u64, id: u64| Call {
            new_comm: Some(handle),
            comm_id: Some(id),
            ..call(Func::CommInitRank, 1, 2, 0)
        };
        r.call(&init(0xb, 42), 0);
        r.call(&call(Func::AllReduce, 10, 12, 0xa), 0);
        r.call(&call(Func::AllReduce, 20, 22, 0xb), 0);
        let comms = r.finish();
        assert_eq!(
            comms.iter().map(|c| c.unique_id).collect::<Vec<_>>(),
            [None, Some(42)]
        );
        let named = |id| Communicator {
            unique_id: id,
            kept: Kept::default(),
        };
        assert_eq!(counterpart(&named(Some(42)), &comms), Ok(1));
        assert_eq!(counterpart(&named(None), &comms), Ok(0));
        assert_eq!(counterpart(&named(Some(7)), &comms), Ok(0));
        let other = [named(Some(9)), named(Some(42))];
        assert_eq!(
            counterpart(&named(Some(7)), &other),
            Err(AlignError::OtherCommunicator { id: 7 })
        );
    }

    /// A host's time on the merged axis: its wall clock, the offset, and the drift from
    /// where the offset was measured.
    #[test]
    fn host_time_on_the_merged_axis() {
        let clock = HostClock {
            drift_ppm: 10.0,
            offset_at_unix_ns: 2_000_000_000,
            ..HostClock::fixed("b", -1_700_000)
        };
        assert_eq!(
            clock.to_merged(1_000_000_000, 1_000_000_000),
            2_000_000_000 - 1_700_000
        );
        // One second later: 10 µs of drift.
        assert_eq!(
            clock.to_merged(1_000_000_000, 2_000_000_000),
            3_000_000_000 - 1_700_000 + 10_000
        );
    }

    /// Two hosts' traces joined: times moved by each host's offset onto one axis whose 0 is
    /// the earliest event, pids moved apart, process names prefixed with the host.
    #[test]
    fn traces_joined_on_one_axis() {
        let dir = tempfile::tempdir().unwrap();
        let host = |name: &str, zero: u64| {
            let path = dir.path().join(format!("{name}.json"));
            std::fs::write(
                &path,
                format!(
                    "{{\"displayTimeUnit\":\"ns\",\"traceEvents\":[\n\
                     {{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":7,\"args\":{{\"name\":\"rank 0\"}}}},\n\
                     {{\"ph\":\"X\",\"name\":\"AllReduce\",\"pid\":7,\"tid\":8,\"ts\":1.5,\"dur\":2}}\n\
                     ],\"otherData\":{{\"monotonic_ns_at_0\":{zero}}}}}\n"
                ),
            )
            .unwrap();
            path
        };
        let (ta, tb) = (host("a", 1_000_000), host("b", 5_000_000));
        let (ca, cb) = (HostClock::fixed("a", 0), HostClock::fixed("b", -4_000_000));
        let parts = [
            trace::Part {
                trace: &ta,
                wall_ns: 0,
                clock: &ca,
            },
            trace::Part {
                trace: &tb,
                wall_ns: 0,
                clock: &cb,
            },
        ];
        let out = dir.path().join("trace.json");
        merge_traces(&out, &parts, &serde_json::json!({"reference": "a"})).unwrap();
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
        let events = v["traceEvents"].as_array().unwrap();
        assert_eq!(events.len(), 4);
        // b's 0 is 5 ms on its clock, 1 ms on a's: both slices at 1.5 µs.
        assert_eq!(events[1]["ts"], 1.5);
        assert_eq!(events[3]["ts"], 1.5);
        assert_eq!(events[3]["pid"], trace::PID_SPAN + 7);
        assert_eq!(events[2]["args"]["name"], "b: rank 0");
        assert_eq!(v["otherData"]["reference"], "a");
    }
}
