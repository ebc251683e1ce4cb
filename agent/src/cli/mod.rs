//! The command line: clap types stop here and become validated settings.

mod attach;
mod doctor;
mod manual;
mod merge;
mod report;
mod snapshot;

use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{Parser, Subcommand};

use crate::Error;

/// eBPF tracing and profiling agent for distributed training: where each step's time went.
#[derive(Debug, Parser)]
#[command(name = "nccltrace", version, about)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Attach to running ranks and trace until they exit, --duration passes, or Ctrl-C.
    #[command(after_help = ATTACH_EXAMPLES)]
    Attach(attach::AttachArgs),
    /// Rebuild every output from a recording, without root.
    #[command(after_help = REPORT_EXAMPLES)]
    Report(report::ReportArgs),
    /// Join the recordings of several hosts on one time axis: clock offsets, one
    /// timeline, the straggler across hosts.
    #[command(after_help = MERGE_EXAMPLES)]
    Merge(merge::MergeArgs),
    /// Check GPU / NUMA / NIC placement of a rank and say how to fix it.
    #[command(after_help = DOCTOR_EXAMPLES)]
    Doctor(doctor::DoctorArgs),
    /// Capture the files `doctor` reads, to diagnose elsewhere with `doctor --root`.
    #[command(after_help = SNAPSHOT_EXAMPLES)]
    Snapshot(snapshot::SnapshotArgs),
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell).
    #[command(after_help = COMPLETIONS_EXAMPLES)]
    Completions(manual::CompletionsArgs),
    /// Write the man pages (as `cargo xtask man` does).
    #[command(hide = true)]
    Man(manual::ManArgs),
    /// The benchmarks' baseline: a bare uprobe/uretprobe pair on one function.
    #[command(hide = true)]
    BenchPair(BenchPairArgs),
}

const ATTACH_EXAMPLES: &str = "Examples:
  nccltrace attach --pid 12345                    trace one rank until it exits or Ctrl-C
  nccltrace attach --pid 12345 --duration 30s --out run1/
  nccltrace attach --all --duration 2m            every rank on this node
  nccltrace attach --pid 12345 --wait-for-nccl    a job still starting up
  nccltrace attach --pid 12345 --step-symbol train_step@train.so
  nccltrace attach --pid 12345 --profile minimal  the lightest probes

Outputs go to --out (default nccltrace-out/): summary.json, steps.json/.csv, flamegraphs,
trace.json (ui.perfetto.dev), doctor.json, recording.nctr (replay with `nccltrace report`).
Exit codes: 0 done, 1 runtime failure, 2 bad input, 128+N stopped at once by a second
signal N (the recording is kept and closed).";

const MERGE_EXAMPLES: &str = "Examples:
  nccltrace merge node1/ node2/ node3/ --out job42/    output folders of each node's agent
  nccltrace merge a.nctr b.nctr --clock-error 1ms      clocks known to agree within 1 ms

Outputs in --out (default nccltrace-merge/): trace.json (every rank of every host on the
reference host's clock), summary.json (offsets with error bounds, ranks, the straggler
across hosts), hosts/HOST/ (each host's own outputs, as `nccltrace report` makes them).
Exit codes: 0 done, 1 runtime failure, 2 bad input (recordings of different jobs, too few
collectives in common, an ambiguous pairing).";

const REPORT_EXAMPLES: &str = "Examples:
  nccltrace report run1/recording.nctr                     outputs into nccltrace-report/
  nccltrace report run1/recording.nctr --out run1 --force  rebuild them in place
  nccltrace report run1/recording.nctr --out w100 --step-window 100ms";

const DOCTOR_EXAMPLES: &str = "Examples:
  nccltrace doctor --pid 12345             the checklist for one rank
  nccltrace doctor --pid 12345 --json      as doctor.json
  nccltrace doctor --root snap/ --pid 12345  from a `nccltrace snapshot` made elsewhere

Exit code 2 when files it needs are unreadable (run as root): the findings are partial.";

const SNAPSHOT_EXAMPLES: &str = "Examples:
  nccltrace snapshot --pid 12345 -o snap/  then: nccltrace doctor --root snap/ --pid 12345";

const COMPLETIONS_EXAMPLES: &str = "Examples:
  nccltrace completions bash > /etc/bash_completion.d/nccltrace
  nccltrace completions zsh > \"${fpath[1]}/_nccltrace\"
  nccltrace completions fish > ~/.config/fish/completions/nccltrace.fish";

#[derive(Debug, clap::Args)]
struct BenchPairArgs {
    #[arg(long)]
    pid: u32,
    #[arg(long)]
    library: std::path::PathBuf,
    #[arg(long)]
    symbol: String,
}

impl Cli {
    /// Runs the chosen subcommand.
    pub fn run(self) -> Result<(), Error> {
        match self.command {
            Command::Attach(args) => attach::run(args),
            Command::Report(args) => report::run(args),
            Command::Merge(args) => merge::run(args),
            Command::Doctor(args) => doctor::run(args),
            Command::Snapshot(args) => snapshot::run(args),
            Command::Completions(args) => manual::run_completions(args),
            Command::Man(args) => manual::run_man(args),
            Command::BenchPair(args) => {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .map_err(Error::Runtime)?;
                let records = runtime.block_on(crate::source::baseline::bare_pair(
                    args.pid,
                    &args.library,
                    &args.symbol,
                ))?;
                println!("{{\"records\": {records}}}");
                Ok(())
            }
        }
    }
}

/// Parses durations such as `30s`, `500ms`, `2m`, `1h` or a bare number of seconds.
pub fn parse_duration(text: &str) -> Result<Duration, Error> {
    let invalid = || Error::InvalidArgument {
        what: "duration",
        value: text.to_owned(),
        expected: "a length of time above 0: 500ms, 30s, 2m, 1h (a bare number is seconds)",
    };
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let value: f64 = num.parse().map_err(|_| invalid())?;
    let secs = match unit.trim() {
        "" | "s" => value,
        "ms" => value / 1e3,
        "us" => value / 1e6,
        "m" | "min" => value * 60.0,
        "h" => value * 3600.0,
        _ => return Err(invalid()),
    };
    if !secs.is_finite() || secs <= 0.0 || secs > 1e9 {
        return Err(invalid());
    }
    Ok(Duration::from_secs_f64(secs))
}

/// When `--rotate` starts a new output folder: after a length of time, or once the
/// recording holds this many bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rotate {
    Every(Duration),
    Bytes(u64),
}

/// Parses `--rotate`: a length of time (`30m`, `1h`) or a size (`500MiB`, `1GiB`, `2G`).
pub fn parse_rotate(text: &str) -> Result<Rotate, Error> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let scale = match unit.trim() {
        "B" => Some(1.0),
        "K" | "KB" | "KiB" => Some(1024.0),
        "M" | "MB" | "MiB" => Some(1024.0 * 1024.0),
        "G" | "GB" | "GiB" => Some(1024.0 * 1024.0 * 1024.0),
        "T" | "TB" | "TiB" => Some(1024.0 * 1024.0 * 1024.0 * 1024.0),
        _ => None,
    };
    let Some(scale) = scale else {
        return parse_duration(t).map(Rotate::Every).map_err(|_| Error::InvalidArgument {
            what: "--rotate",
            value: text.to_owned(),
            expected: "a length of time (30m, 1h) or a recording size (500MiB, 1GiB) of at least \
                       1 MiB",
        });
    };
    let bytes = num.parse::<f64>().unwrap_or(0.0) * scale;
    if !bytes.is_finite() || bytes < 1024.0 * 1024.0 {
        return Err(Error::InvalidArgument {
            what: "--rotate",
            value: text.to_owned(),
            expected: "a recording size of at least 1 MiB (500MiB, 1GiB) or a length of time \
                       (30m, 1h)",
        });
    }
    Ok(Rotate::Bytes(bytes as u64))
}

/// A folder name for an output window starting at `t`: its UTC time, `20261203T161822Z`
/// (names sort as times do).
#[must_use]
pub fn utc_stamp(t: std::time::SystemTime) -> String {
    let secs = t
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let (days, rest) = (secs / 86_400, secs % 86_400);
    // Days since 1970-01-01 to a civil date (proleptic Gregorian), by 400-year eras.
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}{month:02}{day:02}T{:02}{:02}{:02}Z",
        rest / 3600,
        rest / 60 % 60,
        rest % 60
    )
}

/// The step rule from `--step-window` or `--step-nvtx`.
pub fn step_rule(
    window: Option<&str>,
    nvtx: Option<&str>,
) -> Result<crate::attribute::StepRule, Error> {
    use crate::attribute::{NvtxPattern, StepRule};
    Ok(match (window, nvtx) {
        (Some(w), _) => {
            let d = parse_duration(w)?;
            StepRule::Window(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
        }
        (None, Some(re)) => {
            StepRule::Nvtx(NvtxPattern::new(re).map_err(|why| Error::InvalidArgument {
                what: "--step-nvtx",
                value: format!("{re} ({why})"),
                expected: "a regular expression (regex syntax: `^train_step`, `forward|backward`)",
            })?)
        }
        (None, None) => StepRule::Auto,
    })
}

/// An output folder, made by this run unless it existed (`--force`). A folder this run
/// made is removed again when the run fails before [`OutDir::keep`] (nothing written into
/// it yet), so that the retry is not refused.
pub struct OutDir {
    pub path: PathBuf,
    /// The outermost folder this run made, while it may still be removed.
    made: Option<PathBuf>,
}

impl OutDir {
    /// Makes `dir`: refused when it exists unless `force`, and when it is a file.
    pub fn create(dir: &Path, force: bool) -> Result<OutDir, Error> {
        if let Ok(meta) = std::fs::metadata(dir) {
            if !meta.is_dir() {
                return Err(Error::OutputNotFolder {
                    path: dir.to_owned(),
                });
            }
            if !force {
                return Err(Error::OutputExists {
                    path: dir.to_owned(),
                });
            }
        }
        let made = dir
            .ancestors()
            .take_while(|a| !a.as_os_str().is_empty() && std::fs::symlink_metadata(a).is_err())
            .last()
            .map(Path::to_path_buf);
        std::fs::create_dir_all(dir).map_err(|source| Error::OutputFolder {
            path: dir.to_owned(),
            source,
        })?;
        Ok(OutDir {
            path: dir.to_owned(),
            made,
        })
    }

    /// Something of this run is in the folder now: it stays, whatever happens next.
    pub fn keep(&mut self) {
        self.made = None;
    }

    /// Moves the duty to remove the folder (if this run made it and nothing was kept) to
    /// the returned value; `self` keeps the path.
    #[must_use]
    pub fn take(&mut self) -> OutDir {
        OutDir {
            path: self.path.clone(),
            made: self.made.take(),
        }
    }
}

impl Drop for OutDir {
    fn drop(&mut self) {
        if let Some(made) = self.made.take() {
            let _ = std::fs::remove_dir_all(made);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    /// clap's own consistency checks on the command line.
    #[test]
    fn cli_is_consistent() {
        Cli::command().debug_assert();
    }

    /// Durations with units; nonsense is refused with the expected forms named.
    #[test]
    fn durations() {
        assert_eq!(parse_duration("30s").unwrap(), Duration::from_secs(30));
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert_eq!(parse_duration("1.5").unwrap(), Duration::from_millis(1500));
        for bad in ["", "abc", "-1s", "0", "5 parsecs"] {
            let err = parse_duration(bad).unwrap_err();
            assert!(err.to_string().contains("500ms"), "{bad}: {err}");
            assert_eq!(err.exit_code(), 2);
        }
    }

    /// `--rotate` takes a length of time or a size; too small or nonsense is refused.
    #[test]
    fn rotations() {
        assert_eq!(
            parse_rotate("1h").unwrap(),
            Rotate::Every(Duration::from_secs(3600))
        );
        assert_eq!(parse_rotate("1GiB").unwrap(), Rotate::Bytes(1 << 30));
        assert_eq!(parse_rotate("500M").unwrap(), Rotate::Bytes(500 << 20));
        for bad in ["", "1KiB", "lots", "-1h", "0"] {
            let err = parse_rotate(bad).unwrap_err();
            assert!(err.to_string().contains("1GiB"), "{bad}: {err}");
            assert_eq!(err.exit_code(), 2);
        }
    }

    #[test]
    fn stamps_are_utc_times() {
        let at = |s: u64| utc_stamp(std::time::UNIX_EPOCH + Duration::from_secs(s));
        assert_eq!(at(0), "19700101T000000Z");
        // 2026-12-03 16:18:22 UTC; 2024-02-29 (a leap day) 23:59:59.
        assert_eq!(at(1_796_314_702), "20261203T161822Z");
        assert_eq!(at(1_709_251_199), "20240229T235959Z");
    }
}
