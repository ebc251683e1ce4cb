//! `nccltrace merge`: several hosts' recordings on one time axis.
//!
//! Each recording is read once for its collectives ([`read_input`]); every rank is aligned
//! with one reference rank ([`align`]), which gives each host's clock correction with its
//! error bound, and the pairing of collectives across hosts that the straggler verdict
//! needs. Each host's own outputs are then made by the same pipeline as `report`, one
//! host at a time (`hosts/<host>/`), and joined: trace.json on the aligned axis
//! ([`trace`]), summary.json and the words with the offsets and the cross-host straggler.

pub mod align;
mod hosts;
mod input;
mod steps;
pub mod trace;

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::Serialize;

use crate::attribute::ranks::{RankIdentity, Straggler};
use crate::record::TargetInfo;
use align::AlignError;

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
    /// past `KEEP` (32,768)).
    pub seen: BTreeMap<u32, Vec<Communicator>>,
    /// Past `KEEP` (32,768) collectives of a rank, one window in this many was kept.
    pub sampled: Option<u64>,
    /// Damage met while reading (the collectives before it are kept).
    pub damage: Option<String>,
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

pub use hosts::align_hosts;
pub use input::{Communicator, read_input, read_inputs, recording_path};
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
mod tests;
