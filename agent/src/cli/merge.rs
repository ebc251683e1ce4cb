//! `nccltrace merge REC… --out DIR`: the recordings of several hosts on one time axis,
//! with each host's clock offset and the straggler across hosts.

use std::path::PathBuf;

use serde_json::json;

use crate::Error;
use crate::merge::{self, Merged};

#[derive(Debug, clap::Args)]
pub struct MergeArgs {
    /// Recordings (recording.nctr) or the output folders that hold them, one per host or
    /// agent.
    #[arg(required = true, num_args = 1..)]
    recordings: Vec<PathBuf>,
    /// Folder for the merged outputs (refused if it exists, unless --force).
    #[arg(long, short, default_value = "nccltrace-merge")]
    out: PathBuf,
    /// Write into --out even if it exists.
    #[arg(long)]
    force: bool,
    /// What the hosts' wall clocks may differ by (NTP on one network: a few ms). Collectives
    /// are paired wherever the clocks put them; this only chooses among pairings that line
    /// up alike (steps that repeat exactly): say less if the clocks are better.
    #[arg(long, default_value = "10ms")]
    clock_error: String,
    /// Cut each host's steps into fixed windows (100ms, 1s) instead of finding them.
    #[arg(long)]
    step_window: Option<String>,
    /// Steps start at each NVTX range pushed with a matching name.
    #[arg(long, conflicts_with = "step_window")]
    step_nvtx: Option<String>,
}

#[allow(clippy::needless_pass_by_value)] // the parsed arguments end here
pub fn run(args: MergeArgs) -> Result<(), Error> {
    let rule = super::step_rule(args.step_window.as_deref(), args.step_nvtx.as_deref())?;
    let clock_error = super::parse_duration(&args.clock_error)?;
    let clock_error_ns = u64::try_from(clock_error.as_nanos()).unwrap_or(u64::MAX);
    let (inputs, skipped) = merge::read_inputs(&args.recordings)?;
    let mut merged = merge::align_hosts(&inputs, skipped, clock_error_ns)?;
    let mut out = super::OutDir::create(&args.out, args.force)?;
    let output = |path: PathBuf, source: std::io::Error| Error::Output { path, source };
    let mut parts = Vec::new();
    for host in &merged.hosts {
        let Some(input) = inputs.iter().find(|i| i.label == host.host) else {
            continue;
        };
        let dir = out.path.join("hosts").join(&host.host);
        std::fs::create_dir_all(&dir).map_err(|e| output(dir.clone(), e))?;
        let mut outputs = crate::pipeline::replay_into(
            &input.path,
            rule.clone(),
            crate::pipeline::EPOCH_EVENTS,
            &dir,
        )?;
        out.keep();
        let text = dir.join("summary.txt");
        let mut words = std::fs::File::create(&text).map_err(|e| output(text.clone(), e))?;
        crate::pipeline::write_outputs(&dir, &mut outputs, &mut words)
            .and(crate::pipeline::write_summary(&dir, &outputs.summary))
            .map_err(|(path, source)| output(path, source))?;
        for r in merged.ranks.iter_mut().filter(|r| r.host == host.host) {
            r.categories_ns = outputs
                .summary
                .ranks
                .iter()
                .find(|s| s.pid == r.pid)
                .map(|s| s.categories);
        }
        parts.push((
            dir.join("trace.json"),
            input.wall_ns,
            host.clone(),
            outputs.steps.rank_pid,
        ));
    }
    let other = json!({
        "clock": "the reference host's wall clock (CLOCK_REALTIME at its attach, carried on by \
                  its CLOCK_MONOTONIC); ts 0 is the earliest event",
        "reference": merged.reference,
        "hosts": merged.hosts,
        "pid_of_host_n": format!("n × {} + the host's pid", merge::trace::PID_SPAN),
    });
    let trace_parts: Vec<merge::trace::Part<'_>> = parts
        .iter()
        .map(|(trace, wall_ns, clock, _)| merge::trace::Part {
            trace,
            wall_ns: *wall_ns,
            clock,
        })
        .collect();
    let trace = out.path.join("trace.json");
    merge::merge_traces(&trace, &trace_parts, &other).map_err(|e| output(trace.clone(), e))?;
    // The reference host first: its steps are the job's.
    let steps_paths: Vec<PathBuf> = parts
        .iter()
        .map(|(t, ..)| t.with_file_name("steps.json"))
        .collect();
    let mut hosts: Vec<merge::HostSteps<'_>> = parts
        .iter()
        .zip(&steps_paths)
        .map(|((_, wall_ns, clock, rank_pid), steps)| merge::HostSteps {
            steps,
            wall_ns: *wall_ns,
            clock,
            rank_pid: *rank_pid,
        })
        .collect();
    hosts.sort_by_key(|h| h.clock.host != merged.reference);
    let steps = out.path.join("steps.json");
    merge::merge_steps(&steps, &hosts, &merged).map_err(|e| output(steps.clone(), e))?;
    write_summary(&out.path, &merged)?;
    match merge::write_text(&merged, &mut std::io::stdout().lock()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            Err(output(PathBuf::from("(standard output)"), e))
        }
        _ => Ok(()),
    }
}

fn write_summary(dir: &std::path::Path, merged: &Merged) -> Result<(), Error> {
    let path = dir.join("summary.json");
    let text =
        serde_json::to_vec_pretty(&json!({ "merge": merged })).map_err(|e| Error::Output {
            path: path.clone(),
            source: e.into(),
        })?;
    std::fs::write(&path, text).map_err(|source| Error::Output { path, source })
}
