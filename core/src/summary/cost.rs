//! The agent's own cost: the eBPF programs' run time between two readings of the kernel's
//! accounting, the traps around the calls and the sampling interrupts, per step.

use serde::Serialize;

use crate::record::ProgramReading as Reading;

/// How the programs' cost is measured.
pub const BPF_COST_METHOD: &str = "each program's own accounting of its runs (a count and two \
    clock reads a run, from its first instruction to its last, into a per-CPU map; the \
    kernel's run-time accounting, kernel.bpf_stats_enabled, is never turned on: it rewrites \
    kernel text under every BPF program of the host), from when tracing started to when it \
    stopped, all CPUs. Program time only: the uprobe and uretprobe traps around it and the \
    sampling interrupt are not in it. traced_*: the part spent in runs for traced threads, an \
    estimate: each hot program counts its runs for traced threads and times them from the \
    target check on (while the programs account: the timed runs' mean for every run), and \
    every run is charged the mean cost of what comes before that check; programs that \
    do not time themselves (rare ones) are counted whole. Where the programs accounted only \
    in windows (profile [cost] timing_ms, 100 ms of each second by default: accounting costs \
    every run two clock reads), runs and run times are what they counted scaled by the \
    run's time over the windows' (accounted_share): estimates";

/// What a program added between two readings: (runs, ns).
fn delta(then: &[(String, u64, u64)], name: &str, runs: u64, ns: u64) -> (u64, u64) {
    let (r0, t0) = then
        .iter()
        .find(|(n, _, _)| n == name)
        .map_or((0, 0), |(_, r, t)| (*r, *t));
    (runs.saturating_sub(r0), ns.saturating_sub(t0))
}

/// The time between two readings, and how much of it the kernel counted in (`None`: all).
struct Windows {
    span: u64,
    accounted: Option<u64>,
}

impl Windows {
    fn partial(&self) -> bool {
        self.accounted.is_some_and(|windows| windows < self.span)
    }

    /// What the kernel counted in its windows, for the whole span.
    fn scale(&self, value: u64) -> u64 {
        match self.accounted {
            Some(windows) if self.partial() => {
                u64::try_from(u128::from(value) * u128::from(self.span) / u128::from(windows))
                    .unwrap_or(u64::MAX)
            }
            _ => value,
        }
    }

    /// One program's cost from what the kernel `counted` (runs, ns) and, for a program
    /// that times itself, its `traced` runs and their ns from the target check on.
    fn program(
        &self,
        name: &str,
        (counted, counted_ns): (u64, u64),
        traced: Option<(u64, u64)>,
        calls: CallRuns,
    ) -> Option<ProgramCost> {
        if counted == 0 {
            return None;
        }
        // A call program that does not time itself runs for the targets only: its runs
        // are the recording's calls, each at the windows' mean cost.
        let exact = match name {
            _ if traced.is_some() || !self.partial() => None,
            nccltrace_common::names::UPROBE_LIB_CALL => Some(calls.entries),
            nccltrace_common::names::URETPROBE_LIB_CALL => Some(calls.returns),
            _ => None,
        };
        let (runs, run_time_ns) = match exact {
            Some(runs) => (runs, runs.saturating_mul(counted_ns / counted)),
            None => (self.scale(counted), self.scale(counted_ns)),
        };
        if runs == 0 {
            return None;
        }
        // Every run pays the part before the target check; traced runs pay the rest, which
        // they time themselves.
        let traced_ns = traced.map_or(run_time_ns, |(traced_runs, timed_ns)| {
            let before_check = run_time_ns.saturating_sub(timed_ns) / runs;
            timed_ns
                .saturating_add(traced_runs.saturating_mul(before_check))
                .min(run_time_ns)
        });
        Some(ProgramCost {
            name: name.to_owned(),
            runs,
            run_time_ns,
            ns_per_run: run_time_ns / runs,
            per_step_ns: None,
            traced_runs: traced.map(|(r, _)| r),
            traced_ns,
            traced_per_step_ns: None,
        })
    }
}

/// The traced calls a recording has between two readings of the programs' run time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CallRuns {
    /// Every call the entry program ran for: the call records, and those lost.
    pub entries: u64,
    /// The calls whose return was traced (the return program's runs).
    pub returns: u64,
}

/// The eBPF programs' run time over the traced run, as they account it themselves.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct BpfCost {
    pub method: &'static str,
    /// The share of the run the programs were accounted in (the windows' time over the run's):
    /// below 1, every run count and run time here is scaled up from the windows; absent
    /// for older recordings, accounted throughout.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub accounted_share: Option<f64>,
    /// Every program's run time, all CPUs.
    pub cpu_ns: u64,
    /// `cpu_ns` over the time it was accounted in: the share of one CPU.
    pub cpu_share: f64,
    /// `cpu_ns` per step found, and over the steps' wall time (null without steps).
    pub per_step_ns: Option<u64>,
    pub step_share: Option<f64>,
    /// The part of `cpu_ns` spent in runs for the traced threads (estimated: see
    /// `method`), and the same per step and over the steps' wall time.
    pub traced_ns: u64,
    pub traced_per_step_ns: Option<u64>,
    pub traced_step_share: Option<f64>,
    /// The uprobe and uretprobe traps of the traced calls, not in any program's run time:
    /// what a call's traps cost on this host (measured once while tracing), times the
    /// traced calls; null with the reason when not measured.
    pub trap_ns_per_call: Option<u64>,
    /// The traps of a call traced at entry only (`call_returns = "needed"`): its uprobe
    /// alone; `traps_ns` charges it to the calls no return program ran for.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub entry_trap_ns: Option<u64>,
    pub traps_ns: Option<u64>,
    pub traps_per_step_ns: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub traps_unmeasured: Option<String>,
    /// The sampling clock's interrupts in the traced threads, not in the sampling
    /// program's run time: what one interrupt costs the thread it lands on here (the timer
    /// and the perf overflow path, measured once while tracing), times the traced
    /// threads' samples (the sampling program's traced runs). 0 without samples; null with
    /// the reason when not measured.
    pub sample_interrupt_ns: Option<u64>,
    pub sampling_ns: Option<u64>,
    pub sampling_per_step_ns: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sampling_unmeasured: Option<String>,
    /// Programs, traps and sampling interrupts in the traced threads, per step and over
    /// the steps' wall time: the run's whole cost, its start-up and idle stretches
    /// included.
    pub traced_total_per_step_ns: Option<u64>,
    pub traced_total_step_share: Option<f64>,
    /// The same cost split between the steps and the rest of the run (the processes'
    /// start-up, idle stretches, the stretch between two jobs), an estimate: each reading
    /// interval's cost (a second) spread evenly over it, the steps' part of it in them.
    /// Null without two readings, steps or cost.
    pub in_steps_ns: Option<u64>,
    pub outside_steps_ns: Option<u64>,
    /// `in_steps_ns` per step and over the steps' wall time: what tracing costs a step.
    pub in_steps_per_step_ns: Option<u64>,
    pub in_steps_step_share: Option<f64>,
    /// Heaviest first; programs that never ran are left out.
    pub programs: Vec<ProgramCost>,
}

/// One program's runs and run time over the traced run.
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct ProgramCost {
    pub name: String,
    pub runs: u64,
    pub run_time_ns: u64,
    pub ns_per_run: u64,
    /// `run_time_ns` per step found (null without steps).
    pub per_step_ns: Option<u64>,
    /// Runs for traced threads, and their share of `run_time_ns` (estimated; a program
    /// that does not time itself: all of it).
    pub traced_runs: Option<u64>,
    pub traced_ns: u64,
    pub traced_per_step_ns: Option<u64>,
}

impl BpfCost {
    /// The cost between two `program_stats` readings (cumulative per program), each
    /// (at_ns, programs); none when they are not apart in time. `calls`: the traced calls
    /// the recording has between them, which give the call programs' runs exactly where
    /// the kernel counted in windows and the probes were made for the targets.
    #[must_use]
    pub fn between(first: &Reading, last: &Reading, calls: CallRuns) -> Option<BpfCost> {
        let span = last.at_ns.checked_sub(first.at_ns).filter(|s| *s > 0)?;
        let accounted = match (first.accounted_ns, last.accounted_ns) {
            (Some(from), Some(to)) => Some(to.checked_sub(from).filter(|a| *a > 0)?.min(span)),
            _ => None,
        };
        let windows = Windows { span, accounted };
        let mut programs: Vec<ProgramCost> = last
            .programs
            .iter()
            .filter_map(|(name, runs, time)| {
                let counted = delta(&first.programs, name, *runs, *time);
                let traced = last
                    .traced
                    .iter()
                    .find(|(n, _, _)| n == name)
                    .map(|(_, r, t)| delta(&first.traced, name, *r, *t));
                windows.program(name, counted, traced, calls)
            })
            .collect();
        programs.sort_by(|a, b| b.run_time_ns.cmp(&a.run_time_ns).then(a.name.cmp(&b.name)));
        let sum =
            |f: fn(&ProgramCost) -> u64| programs.iter().map(f).fold(0u64, u64::saturating_add);
        let cpu_ns = sum(|p| p.run_time_ns);
        let traced_ns = sum(|p| p.traced_ns);
        let traced_runs = |name: &str| {
            programs
                .iter()
                .find(|p| p.name == name)
                .map_or(0, |p| p.traced_runs.unwrap_or(p.runs))
        };
        let calls = traced_runs(nccltrace_common::names::UPROBE_LIB_CALL);
        // Calls traced at entry only (no return program ran for them) paid one trap.
        let entry_only =
            calls.saturating_sub(traced_runs(nccltrace_common::names::URETPROBE_LIB_CALL));
        let trap_ns_per_call = last.trap_ns.or(first.trap_ns);
        let entry_trap_ns = last.entry_trap_ns.or(first.entry_trap_ns);
        let traps_ns = trap_ns_per_call.map(|pair| {
            let entry = entry_trap_ns.unwrap_or(pair);
            (calls - entry_only)
                .saturating_mul(pair)
                .saturating_add(entry_only.saturating_mul(entry))
        });
        let samples = traced_runs(nccltrace_common::names::PERF_EVENT_CPU_CLOCK);
        let sample_interrupt_ns = last.sample_interrupt_ns.or(first.sample_interrupt_ns);
        let sampling_ns = if samples == 0 {
            Some(0)
        } else {
            sample_interrupt_ns.map(|ns| samples.saturating_mul(ns))
        };
        let sampling_unmeasured = sampling_ns.is_none().then(|| {
            last.sample_interrupt_refused
                .clone()
                .or_else(|| first.sample_interrupt_refused.clone())
                .unwrap_or_else(|| "not measured by the agent that made the recording".to_owned())
        });
        Some(BpfCost {
            method: BPF_COST_METHOD,
            accounted_share: accounted.map(|windows| windows as f64 / span as f64),
            cpu_ns,
            cpu_share: cpu_ns as f64 / span as f64,
            per_step_ns: None,
            step_share: None,
            traced_ns,
            traced_per_step_ns: None,
            traced_step_share: None,
            trap_ns_per_call,
            entry_trap_ns,
            traps_ns,
            traps_per_step_ns: None,
            traps_unmeasured: trap_ns_per_call.is_none().then(|| {
                last.trap_refused.clone().unwrap_or_else(|| {
                    "not measured by the agent that made the recording".to_owned()
                })
            }),
            sample_interrupt_ns,
            sampling_ns,
            sampling_per_step_ns: None,
            sampling_unmeasured,
            traced_total_per_step_ns: None,
            traced_total_step_share: None,
            in_steps_ns: None,
            outside_steps_ns: None,
            in_steps_per_step_ns: None,
            in_steps_step_share: None,
            programs,
        })
    }

    /// The traced total (programs, traps, sampling interrupts).
    fn traced_total(&self) -> u64 {
        self.traced_ns
            .saturating_add(self.traps_ns.unwrap_or(0))
            .saturating_add(self.sampling_ns.unwrap_or(0))
    }

    /// Splits the traced total between the steps and the rest as `split` found them.
    pub fn split(&mut self, split: &CostSplit) {
        let (inside, outside) = (split.inside, split.outside);
        if inside + outside <= 0.0 {
            return;
        }
        let total = self.traced_total();
        let in_steps = (total as f64 * inside / (inside + outside)).round() as u64;
        self.in_steps_ns = Some(in_steps);
        self.outside_steps_ns = Some(total.saturating_sub(in_steps));
    }

    /// Sets the per-step figures from the steps found and their summed wall time.
    pub fn per_step(&mut self, steps: usize, wall_ns: u64) {
        if steps == 0 || wall_ns == 0 {
            return;
        }
        let per = |ns: u64| ns / steps as u64;
        self.per_step_ns = Some(per(self.cpu_ns));
        self.step_share = Some(self.cpu_ns as f64 / wall_ns as f64);
        self.traced_per_step_ns = Some(per(self.traced_ns));
        self.traced_step_share = Some(self.traced_ns as f64 / wall_ns as f64);
        self.traps_per_step_ns = self.traps_ns.map(per);
        self.sampling_per_step_ns = self.sampling_ns.map(per);
        let total = self.traced_total();
        self.traced_total_per_step_ns = Some(per(total));
        self.traced_total_step_share = Some(total as f64 / wall_ns as f64);
        self.in_steps_per_step_ns = self.in_steps_ns.map(per);
        self.in_steps_step_share = self.in_steps_ns.map(|ns| ns as f64 / wall_ns as f64);
        for p in &mut self.programs {
            p.per_step_ns = Some(per(p.run_time_ns));
            p.traced_per_step_ns = Some(per(p.traced_ns));
        }
    }
}

/// Bins of the traced records' times, for [`CostSplit`].
const BIN_NS: u64 = 10_000_000;
/// Bins kept at most (an hour's): the intervals not yet settled span an epoch or two.
const MAX_BINS: usize = 360_000;

/// The agent's cost between consecutive readings of the programs' run time (a second
/// apart), spread over each interval by where the traced records fell in it (10-ms bins:
/// each record is a run of a program for a traced thread), and the part of each bin the
/// steps cover: what [`BpfCost::split`] divides the run's cost by. What no later step can
/// reach is settled as epochs end, so memory stays bounded on a run of any length.
#[derive(Debug, Default)]
pub struct CostSplit {
    /// The last reading, and the call records up to it.
    last: Option<(Reading, CallRuns)>,
    /// Intervals not settled: (start, end, cost in ns).
    pending: std::collections::VecDeque<(u64, u64, u64)>,
    /// Bins from `first_bin` (its index, time / [`BIN_NS`]) on: (records, ns covered by
    /// steps).
    bins: std::collections::VecDeque<(u32, u64)>,
    first_bin: u64,
    /// Settled cost inside steps and outside them, in ns.
    inside: f64,
    outside: f64,
}

impl CostSplit {
    /// A reading of the programs' run time, `calls` the call records so far.
    pub fn reading(&mut self, reading: &Reading, calls: CallRuns) {
        if let Some((last, then)) = &self.last {
            let between = CallRuns {
                entries: calls.entries.saturating_sub(then.entries),
                returns: calls.returns.saturating_sub(then.returns),
            };
            if let Some(cost) = BpfCost::between(last, reading, between) {
                self.pending
                    .push_back((last.at_ns, reading.at_ns, cost.traced_total()));
            }
        }
        self.last = Some((reading.clone(), calls));
    }

    /// The bin of `ts`, made where it is not yet (None before the first kept one, or
    /// beyond [`MAX_BINS`] after it: a damaged record's time).
    fn bin(&mut self, ts: u64) -> Option<&mut (u32, u64)> {
        let index = ts / BIN_NS;
        if self.bins.is_empty() {
            self.first_bin = index;
        }
        let at = usize::try_from(index.checked_sub(self.first_bin)?).ok()?;
        if at >= MAX_BINS {
            return None;
        }
        if at >= self.bins.len() {
            self.bins.resize(at + 1, (0, 0));
        }
        self.bins.get_mut(at)
    }

    /// A traced record at `ts`.
    pub fn record(&mut self, ts: u64) {
        if let Some(bin) = self.bin(ts) {
            bin.0 = bin.0.saturating_add(1);
        }
    }

    /// Steps, in time order: each covers the part of the bins it overlaps.
    pub fn steps(&mut self, steps: impl IntoIterator<Item = (u64, u64)>) {
        for (a, b) in steps {
            // Within the bins kept.
            let first = self.first_bin.saturating_mul(BIN_NS);
            let last =
                (self.first_bin.saturating_add(self.bins.len() as u64)).saturating_mul(BIN_NS);
            let (mut t, b) = (a.max(first), b.min(last));
            while t < b {
                let end = (t / BIN_NS).saturating_add(1).saturating_mul(BIN_NS);
                let covered = b.min(end) - t;
                let Some(bin) = self.bin(t) else { break };
                bin.1 += covered;
                t = end;
            }
        }
    }

    /// Settles the intervals that end by `until` (no step to come reaches them).
    pub fn settle(&mut self, until: u64) {
        while let Some(&(a, b, cost)) = self.pending.front() {
            if b > until {
                break;
            }
            self.pending.pop_front();
            // The interval's bins, by their records (by time where it has none).
            let (from, to) = (a / BIN_NS, b.div_ceil(BIN_NS));
            let (mut records, mut weighed, mut covered) = (0.0, 0.0, 0.0);
            for index in from.max(self.first_bin)..to {
                let Some(&(n, ns)) = usize::try_from(index - self.first_bin)
                    .ok()
                    .and_then(|i| self.bins.get(i))
                else {
                    break;
                };
                let share = (ns as f64 / BIN_NS as f64).min(1.0);
                records += f64::from(n);
                weighed += f64::from(n) * share;
                covered += share;
            }
            let span = (to - from).max(1) as f64;
            let share = if records > 0.0 {
                weighed / records
            } else {
                covered / span
            };
            self.inside += cost as f64 * share;
            self.outside += cost as f64 * (1.0 - share);
        }
        // Bins before any interval still to settle or to come (the next begins at the last
        // reading; without readings, none) are done with.
        let keep = self
            .pending
            .front()
            .map(|p| p.0)
            .or(self.last.as_ref().map(|l| l.0.at_ns))
            .unwrap_or(until)
            .min(until)
            / BIN_NS;
        while self.first_bin < keep && !self.bins.is_empty() {
            self.bins.pop_front();
            self.first_bin += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::summary::AgentStats;

    /// The cost is what each program added between the two readings, heaviest first;
    /// programs that did not run are left out, one loaded since counts from zero, and
    /// the per-step figures divide by the steps and their wall time.
    #[test]
    fn program_cost_between_two_readings() {
        let first = reading(
            1_000_000_000,
            &[
                ("uprobe_lib_call", 10, 5_000),
                ("b", 4, 4_000),
                ("idle", 3, 300),
            ],
            &[("b", 1, 900)],
        );
        let mut last = reading(
            3_000_000_000,
            &[
                ("uprobe_lib_call", 110, 105_000),
                ("b", 1_004, 2_004_000),
                ("idle", 3, 300),
                ("new", 2, 1_000),
            ],
            // b: 100 of its 1,000 runs were for traced threads, 1,000,900 - 900 ns of them
            // after the target check.
            &[("b", 101, 1_000_900)],
        );
        // Without the traps measured: programs only, and why.
        let cost = BpfCost::between(&first, &last, CallRuns::default()).unwrap();
        assert_eq!(cost.traps_ns, None);
        assert!(cost.traps_unmeasured.is_some());
        last.trap_ns = Some(1_500);
        let mut cost = BpfCost::between(&first, &last, CallRuns::default()).unwrap();
        assert_eq!(cost.traps_unmeasured, None);
        let names: Vec<&str> = cost.programs.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(names, ["b", "uprobe_lib_call", "new"]);
        assert_eq!(cost.cpu_ns, 2_000_000 + 100_000 + 1_000);
        assert_eq!(cost.programs[0].ns_per_run, 2_000);
        // b: the 1,000,000 ns untimed spread over 1,000 runs is 1,000 ns before the check
        // each; its 100 traced runs: 1,000,000 timed + 100 × 1,000. The other two do not
        // time themselves here: counted whole.
        assert_eq!(cost.programs[0].traced_runs, Some(100));
        assert_eq!(cost.programs[0].traced_ns, 1_100_000);
        assert_eq!(cost.programs[1].traced_runs, None);
        assert_eq!(cost.traced_ns, 1_100_000 + 100_000 + 1_000);
        assert!((cost.cpu_share - 2_101_000.0 / 2e9).abs() < 1e-12);
        assert_eq!(cost.per_step_ns, None);
        cost.per_step(100, 1_000_000_000);
        assert_eq!(cost.per_step_ns, Some(21_010));
        assert_eq!(cost.traced_per_step_ns, Some(12_010));
        // 100 calls entered (the entry program's runs) × 1,500 ns of traps.
        assert_eq!(cost.traps_ns, Some(150_000));
        assert_eq!(cost.traced_total_per_step_ns, Some(13_510));
        assert_eq!(cost.programs[1].per_step_ns, Some(1_000));
        assert!((cost.step_share.unwrap() - 0.002_101).abs() < 1e-9);
        // Readings at one moment give nothing, not a share of zero.
        assert!(BpfCost::between(&last, &last, CallRuns::default()).is_none());
        // 40 of the 100 calls traced at entry only (`call_returns = "needed"`): the return
        // program ran for 60; those 40 paid the entry trap alone.
        let mut mixed = last.clone();
        mixed
            .programs
            .push(("uretprobe_lib_call".into(), 60, 6_000));
        mixed.traced.push(("uretprobe_lib_call".into(), 60, 5_000));
        mixed.entry_trap_ns = Some(600);
        let cost_mixed = BpfCost::between(&first, &mixed, CallRuns::default()).unwrap();
        assert_eq!(cost_mixed.traps_ns, Some(60 * 1_500 + 40 * 600));
        assert_eq!(cost_mixed.entry_trap_ns, Some(600));
        let text = cost_line(cost);
        assert!(
            text.starts_with(
                "agent cost: 13.5 µs a step in the traced threads (0.14% of step time, \
                 estimated: programs 12.0 µs, uprobe traps 1.5 µs), 21.0 µs of programs on all \
                 CPUs (1.05 ms of CPU a second) — programs in the traced threads: b 11.0 µs, \
                 uprobe_lib_call 1.0 µs, new 0.0 µs\n"
            ),
            "{text}"
        );
        let mut text = Vec::new();
        let agent = AgentStats {
            bpf_unmeasured: Some("refused".into()),
            ..AgentStats::default()
        };
        crate::render::summary::write_cost(&agent, &mut text).unwrap();
        assert_eq!(
            String::from_utf8(text).unwrap(),
            "agent cost: not measured (refused)\n"
        );
    }

    /// A run's cost split by where its records fell (issue 52): a first second of start-up
    /// (900 records, no step), then a second whose second half is steps (100 records in
    /// each half): none of the first interval's cost and half of the second's are the
    /// steps'.
    #[test]
    fn cost_split_by_records_in_steps() {
        let calls = CallRuns::default();
        let at = |s: u64, ns: u64| reading(s, &[("b", ns / 1_000, ns)], &[("b", ns / 1_000, ns)]);
        let mut split = CostSplit::default();
        split.reading(&at(0, 0), calls);
        for i in 0..900 {
            split.record(i * 1_000_000);
        }
        split.reading(&at(1_000_000_000, 9_000_000), calls);
        for i in 0..200 {
            split.record(1_000_000_000 + i * 5_000_000);
        }
        split.reading(&at(2_000_000_000, 11_000_000), calls);
        // Steps over [1.5 s, 2 s), in two epochs; the first settles nothing past 1.6 s.
        split.steps([(1_500_000_000, 1_600_000_000)]);
        split.settle(1_600_000_000);
        assert!(split.inside == 0.0 && (split.outside - 9_000_000.0).abs() < 1.0);
        split.steps([(1_600_000_000, 2_000_000_000)]);
        split.settle(u64::MAX);
        // The second interval cost 2,000,000 ns, half of its records in the steps.
        assert!((split.inside - 1_000_000.0).abs() < 1.0, "{split:?}");
        assert!((split.outside - 10_000_000.0).abs() < 1.0, "{split:?}");
        let mut cost = BpfCost::between(&at(0, 0), &at(2_000_000_000, 11_000_000), calls).unwrap();
        cost.split(&split);
        cost.per_step(50, 500_000_000);
        assert_eq!(cost.in_steps_ns, Some(1_000_000));
        assert_eq!(cost.outside_steps_ns, Some(10_000_000));
        assert_eq!(cost.in_steps_per_step_ns, Some(20_000));
        assert_eq!(cost.traced_total_per_step_ns, Some(220_000));
        // Bins no interval is left to reach are dropped.
        assert!(
            split.bins.len() <= 1 && split.pending.is_empty(),
            "{split:?}"
        );
        // Without readings (accounting off), records are kept no longer than an epoch.
        let mut none = CostSplit::default();
        for i in 0..1_000 {
            none.record(i * 1_000_000);
        }
        none.settle(900_000_000);
        assert_eq!(none.bins.len(), 10, "{none:?}");
    }

    /// The stdout line of `cost`.
    fn cost_line(cost: BpfCost) -> String {
        let mut text = Vec::new();
        let agent = AgentStats {
            bpf: Some(cost),
            ..AgentStats::default()
        };
        crate::render::summary::write_cost(&agent, &mut text).unwrap();
        String::from_utf8(text).unwrap()
    }

    /// A reading of (program, runs, ns) on all CPUs and in traced threads.
    fn reading(at_ns: u64, programs: &[(&str, u64, u64)], traced: &[(&str, u64, u64)]) -> Reading {
        let own = |v: &[(&str, u64, u64)]| -> Vec<(String, u64, u64)> {
            v.iter()
                .map(|(n, r, t)| ((*n).to_owned(), *r, *t))
                .collect()
        };
        Reading {
            at_ns,
            programs: own(programs),
            traced: own(traced),
            ..Reading::default()
        }
    }

    /// Issue 22: the sampling clock's interrupts in the traced threads, charged at what
    /// one costs here: the traced samples (the sampling program's traced runs) × that;
    /// counted in the traced total and the stdout line; unmeasured, null with the reason.
    #[test]
    fn sampling_interrupts_counted() {
        let clock = nccltrace_common::names::PERF_EVENT_CPU_CLOCK;
        let first = reading(0, &[(clock, 0, 0)], &[(clock, 0, 0)]);
        // 1,000 samples on all CPUs, 200 of them in traced threads.
        let mut last = reading(
            1_000_000_000,
            &[(clock, 1_000, 500_000)],
            &[(clock, 200, 150_000)],
        );
        last.trap_ns = Some(1_000);
        last.sample_interrupt_refused = Some("the clock's interrupts were not seen".into());
        let cost = BpfCost::between(&first, &last, CallRuns::default()).unwrap();
        assert_eq!(cost.sampling_ns, None);
        let text = cost_line(cost);
        assert!(
            text.ends_with(
                "; the sampling interrupt is not counted (the clock's interrupts were not \
                 seen)\n"
            ),
            "{text}"
        );
        last.sample_interrupt_ns = Some(2_500);
        let mut cost = BpfCost::between(&first, &last, CallRuns::default()).unwrap();
        assert_eq!(cost.sampling_ns, Some(200 * 2_500));
        assert_eq!(cost.sampling_unmeasured, None);
        cost.per_step(10, 100_000_000);
        assert_eq!(cost.sampling_per_step_ns, Some(50_000));
        // Programs in the traced threads: 150,000 timed + 200 × 350 before the check (the
        // untimed 350,000 ns over 1,000 runs); no traps without calls.
        assert_eq!(cost.traced_ns, 220_000);
        assert_eq!(
            cost.traced_total_per_step_ns,
            Some((220_000 + 500_000) / 10)
        );
        let text = cost_line(cost);
        assert!(
            text.contains("uprobe traps 0.0 µs, sampling interrupts 50.0 µs)"),
            "{text}"
        );
        assert!(!text.contains("not counted"), "{text}");
    }

    /// Counted in windows (profile `[cost] timing_ms`): what the programs counted is
    /// scaled by the run's time over the windows', and said (`accounted_share`, the stdout
    /// line); the call programs on probes made for the targets (not timing themselves)
    /// take their runs from the recording's calls, at the windows' mean cost; a program
    /// timing itself keeps its exact traced runs. No window between the readings: no cost.
    #[test]
    fn counted_in_windows() {
        let entry = nccltrace_common::names::UPROBE_LIB_CALL;
        let ret = nccltrace_common::names::URETPROBE_LIB_CALL;
        let mut first = reading(0, &[], &[("switch", 0, 0)]);
        first.accounted_ns = Some(0);
        // 4 s, 1 of them counted.
        let mut last = reading(
            4_000_000_000,
            &[
                (entry, 1_000, 300_000),
                (ret, 900, 450_000),
                ("switch", 500, 100_000),
            ],
            &[("switch", 2_000, 200_000)],
        );
        last.accounted_ns = Some(1_000_000_000);
        let calls = CallRuns {
            entries: 4_100,
            returns: 3_700,
        };
        let cost = BpfCost::between(&first, &last, calls).unwrap();
        assert_eq!(cost.accounted_share, Some(0.25));
        let program = |name: &str| cost.programs.iter().find(|p| p.name == name).unwrap();
        assert_eq!(program(entry).runs, 4_100);
        assert_eq!(program(entry).run_time_ns, 4_100 * 300);
        assert_eq!(program(ret).runs, 3_700);
        assert_eq!(program(ret).run_time_ns, 3_700 * 500);
        // Scaled ×4; its traced runs (counted by the program itself, always) as they are.
        let switch = program("switch");
        assert_eq!((switch.runs, switch.run_time_ns), (2_000, 400_000));
        assert_eq!(switch.traced_runs, Some(2_000));
        // All of the traced runs at the scaled mean: capped at the scaled whole.
        assert_eq!(switch.traced_ns, 400_000);
        assert!(cost.method.contains("accounted_share"));
        let text = cost_line(cost);
        assert!(
            text.ends_with(
                "; programs counted 25% of the run, scaled (profile [cost] timing_ms)\n"
            ),
            "{text}"
        );
        // Counted throughout (`accounted_ns` as long as the run): as read, and the
        // recording's calls are not used.
        last.accounted_ns = Some(4_000_000_000);
        let whole = BpfCost::between(&first, &last, calls).unwrap();
        assert_eq!(whole.accounted_share, Some(1.0));
        let entry_cost = whole.programs.iter().find(|p| p.name == entry).unwrap();
        assert_eq!(entry_cost.runs, 1_000);
        assert!(!cost_line(whole).contains("scaled"));
        // Older recordings say nothing: counted throughout.
        first.accounted_ns = None;
        assert_eq!(
            BpfCost::between(&first, &last, calls)
                .unwrap()
                .accounted_share,
            None
        );
        // No window between the two readings.
        first.accounted_ns = Some(4_000_000_000);
        assert!(BpfCost::between(&first, &last, calls).is_none());
    }
}
