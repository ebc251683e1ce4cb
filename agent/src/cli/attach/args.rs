//! `nccltrace attach`'s flags and their checks: the settings a run goes by.

use std::path::PathBuf;
use std::time::Duration;

use crate::profile::Profile;
use crate::{Error, host, source};

#[derive(Debug, clap::Args)]
#[allow(clippy::struct_excessive_bools)] // command-line flags
pub struct AttachArgs {
    /// Process ids of the ranks (comma-separated, or repeat the flag).
    #[arg(long, short, required_unless_present = "all", value_delimiter = ',')]
    pid: Vec<u32>,
    /// Every process on the host that maps NCCL (in libnccl or linked into another
    /// library).
    #[arg(long, conflicts_with = "pid")]
    all: bool,
    /// With --all: also attach to processes that load NCCL later (elastic restarts, new
    /// ranks), until --duration or Ctrl-C; the run does not end when the targets exit.
    #[arg(long, requires = "all")]
    follow: bool,
    /// Folder for the outputs (refused if it exists, unless --force).
    #[arg(long, short, default_value = "nccltrace-out")]
    out: PathBuf,
    /// Stop after this long (500ms, 30s, 2m, 1h; a bare number is seconds); it also bounds
    /// --wait-for-nccl. Default: until the targets exit or Ctrl-C.
    #[arg(long, short, allow_hyphen_values = true)]
    duration: Option<String>,
    /// Probe preset: default, minimal, full, or a TOML file.
    #[arg(long, default_value = "default")]
    profile: String,
    /// Write into --out even if it exists.
    #[arg(long)]
    force: bool,
    /// Cut steps into fixed windows (100ms, 1s) instead of finding them.
    #[arg(long)]
    step_window: Option<String>,
    /// On-CPU samples per second of a target thread's CPU time (overrides the profile; 0: off).
    #[arg(long)]
    sample_hz: Option<u32>,
    /// If a target has not loaded NCCL yet, wait until it does (or exits), then attach.
    #[arg(long)]
    wait_for_nccl: bool,
    /// Steps start at each call of this function (SYMBOL or SYMBOL@LIBRARY).
    #[arg(long, conflicts_with = "step_window")]
    step_symbol: Option<String>,
    /// Steps start at each NVTX range pushed with a name matching this regular expression
    /// (nvtxRangePushA of libnvToolsExt or another library exporting it).
    #[arg(long, conflicts_with_all = ["step_window", "step_symbol"])]
    step_nvtx: Option<String>,
    /// Attribute (steps, categories, flamegraphs, trace) only the last N events of the
    /// run; totals count every event, and `nccltrace report` attributes the whole
    /// recording. 0: the whole run (memory stays bounded either way: the run is attributed
    /// in epochs as it is read).
    #[arg(long, default_value_t = 0)]
    max_attributed_events: u64,
    /// Attribute in epochs of at least this many events (0: the whole run at once). For
    /// tests and for checking that epochs do not change the outputs.
    #[arg(long, hide = true, default_value_t = crate::pipeline::EPOCH_EVENTS)]
    epoch_events: u64,
    /// Serve Prometheus metrics on this address while tracing (per-rank step times and
    /// categories, NCCL calls and bytes, lost events, NUMA and InfiniBand counters). Alone:
    /// 127.0.0.1:9464, loopback only; 0.0.0.0:PORT serves every interface. Port 0 picks a
    /// free port (printed).
    #[arg(long, value_name = "ADDR", num_args = 0..=1, default_missing_value = crate::metrics::DEFAULT_ADDR)]
    metrics: Option<String>,
    /// Cut the run into windows, each a complete output folder named by its UTC start
    /// time under --out: after a length of time (1h) or once the recording holds a size
    /// (1GiB). For an agent left running: tracing goes on across windows.
    #[arg(long, value_name = "TIME|SIZE")]
    rotate: Option<String>,
    /// With --rotate: keep only the newest N windows (0: all).
    #[arg(long, value_name = "N", requires = "rotate", default_value_t = 0)]
    keep: usize,
    /// How long the series of a rank whose process is gone stay served (a restarted rank
    /// with the same labels keeps them).
    #[arg(long, hide = true, default_value = "5m", requires = "metrics")]
    metrics_grace: String,
}

/// Validated attach settings.
pub(super) struct Settings {
    pub(super) pids: Vec<u32>,
    pub(super) out: crate::cli::OutDir,
    pub(super) duration: Option<Duration>,
    pub(super) profile: Profile,
    pub(super) step_rule: crate::attribute::StepRule,
    pub(super) wait_for_nccl: bool,
    pub(super) step_symbol: Option<String>,
    pub(super) step_nvtx: Option<String>,
    pub(super) follow: bool,
    pub(super) max_attributed_events: u64,
    pub(super) epoch_events: u64,
    /// Bound before anything is traced (`--metrics`), and how long a gone rank's series
    /// stay.
    pub(super) metrics: Option<std::net::TcpListener>,
    pub(super) metrics_grace: Duration,
    pub(super) rotate: Option<crate::cli::Rotate>,
    pub(super) keep: usize,
}

impl AttachArgs {
    pub(super) fn validate(self) -> Result<Settings, Error> {
        let duration = self
            .duration
            .as_deref()
            .map(crate::cli::parse_duration)
            .transpose()?;
        // clap's `requires` counts a flag's default (false) as given: checked here.
        if self.follow && !self.all {
            return Err(Error::InvalidArgument {
                what: "--follow",
                value: "without --all".into(),
                expected: "--all --follow (attach to every process that maps NCCL, now and later)",
            });
        }
        let mut profile = Profile::load(&self.profile)?;
        if let Some(hz) = self.sample_hz {
            profile.set_sample_hz(hz)?;
        }
        let step_rule =
            crate::cli::step_rule(self.step_window.as_deref(), self.step_nvtx.as_deref())?;
        let mut pids = if self.all {
            let found = source::processes_with_nccl(&host::Host::live());
            if found.is_empty() && !self.follow {
                return Err(Error::InvalidArgument {
                    what: "--all",
                    value: "no process maps NCCL".into(),
                    expected: "a running job that has initialised NCCL (or use --pid with --wait-for-nccl)",
                });
            }
            crate::note!(
                "nccltrace: --all found {} process(es) mapping NCCL: {found:?}",
                found.len()
            );
            found
        } else {
            self.pid
        };
        pids.sort_unstable();
        pids.dedup();
        if let Some(zero) = pids.iter().find(|p| **p == 0) {
            return Err(Error::InvalidArgument {
                what: "pid",
                value: zero.to_string(),
                expected: "a process id above 0",
            });
        }
        let rotate = self
            .rotate
            .as_deref()
            .map(crate::cli::parse_rotate)
            .transpose()?;
        if let Some(crate::cli::Rotate::Every(d)) = rotate
            && d < Duration::from_secs(1)
        {
            return Err(Error::InvalidArgument {
                what: "--rotate",
                value: self.rotate.unwrap_or_default(),
                expected: "windows of at least 1s (windows are named by the second they start)",
            });
        }
        let metrics = self
            .metrics
            .as_deref()
            .map(crate::metrics::http::bind)
            .transpose()?;
        // Last: a folder is made only for a command that is otherwise valid.
        let out = crate::cli::OutDir::create(&self.out, self.force)?;
        Ok(Settings {
            pids,
            out,
            duration,
            profile,
            step_rule,
            wait_for_nccl: self.wait_for_nccl,
            step_symbol: self.step_symbol,
            step_nvtx: self.step_nvtx,
            follow: self.follow,
            max_attributed_events: self.max_attributed_events,
            epoch_events: self.epoch_events,
            metrics,
            metrics_grace: crate::cli::parse_duration(&self.metrics_grace)?,
            rotate,
            keep: self.keep,
        })
    }
}
