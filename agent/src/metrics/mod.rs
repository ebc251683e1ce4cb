//! `--metrics ADDR`: the run as Prometheus metrics, served over HTTP while tracing.
//!
//! Names follow Prometheus's conventions: the `nccltrace_` prefix, base units (seconds,
//! bytes), `_total` on counters. Label sets are bounded: per rank (`host`, `job_id`,
//! `rank`, `local_rank`), per category or NCCL operation, per NUMA node and InfiniBand
//! port; never a pid or a step number. `job_id` (not `job`, which Prometheus gives the
//! scrape job) comes from the rank's environment, else from the unique id of the first
//! communicator its `ncclCommInitRank` was seen to make (`nccl-` and 16 hex digits: two jobs
//! a daemon sees without a launcher's id stay apart); a label neither gives is left
//! empty, which Prometheus treats as absent.
//!
//! Per-rank series are updated by the attribution as steps become final (so they lag the
//! run by an epoch); node series (NUMA, InfiniBand) and the agent's own CPU and memory are
//! read from `/sys` and `/proc` at each scrape. A source the host does not have (no
//! InfiniBand, no NUMA) gives no series, never zeros.

pub mod http;
mod node;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};

use crate::attribute::Epoch;
use crate::event::{Event, Func, Library};
use crate::host::Host;
use crate::pipeline::Sink;

/// The address `--metrics` serves on when none is given: loopback only.
pub const DEFAULT_ADDR: &str = "127.0.0.1:9464";

/// The labels of one rank's series.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RankLabels {
    pub host: String,
    pub job_id: String,
    pub rank: String,
    pub local_rank: String,
}

/// A rank's labels and one more (a category, an operation).
type With = (RankLabels, [(&'static str, String); 1]);
type Seconds = Counter<f64, AtomicU64>;

/// Step-time histogram buckets: 0.5 ms to about 28 s, 1.5× apart.
fn step_buckets() -> Histogram {
    Histogram::new(exponential_buckets(0.000_5, 1.5, 28))
}

/// The `job_id` of a rank whose environment names no job: its communicator's unique id
/// (hashed to 64 bits as the recording keeps it), the same on every rank of the job.
#[must_use]
pub fn job_label(unique_id: u64) -> String {
    format!("nccl-{unique_id:016x}")
}

/// What scrapes read besides the per-rank series, set by the agent as it runs.
#[derive(Debug, Default)]
pub(crate) struct State {
    /// Events lost so far, by kind.
    pub lost: BTreeMap<String, u64>,
    /// Doctor findings present at attach: (id, severity).
    pub findings: Vec<(String, String)>,
    /// Processes traced now.
    pub targets: usize,
    /// The GPUs read through NVML, in the recording header's order.
    pub gpus: Vec<node::GpuSeries>,
}

/// The registry a scrape encodes, and the series the attribution updates.
pub struct Metrics {
    registry: Registry,
    step_seconds: Family<RankLabels, Histogram, fn() -> Histogram>,
    category_seconds: Family<With, Seconds>,
    nccl_calls: Family<With, Counter>,
    nccl_bytes: Family<With, Counter>,
    cuda_sync_wait: Family<RankLabels, Seconds>,
    wait_caused: Family<RankLabels, Seconds>,
    lateness: Family<RankLabels, Seconds>,
    matched: Family<RankLabels, Counter>,
    state: Arc<Mutex<State>>,
    /// Every process with series, its labels, and since when it is gone (`retire`).
    published: Mutex<HashMap<u32, (RankLabels, Option<std::time::Instant>)>>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Metrics {
    /// A registry with every series, node series read from `host` at each scrape.
    #[must_use]
    pub fn new(host: Host) -> Metrics {
        let mut registry = Registry::with_prefix("nccltrace");
        let step_seconds = Family::new_with_constructor(step_buckets as fn() -> Histogram);
        registry.register_with_unit(
            "step",
            "Wall time of each training step of the rank's training-loop thread",
            Unit::Seconds,
            step_seconds.clone(),
        );
        let category_seconds = Family::<With, Seconds>::default();
        registry.register_with_unit(
            "step_category",
            "Where the steps' wall time went, by category (a category the profile cannot \
             measure has no series)",
            Unit::Seconds,
            category_seconds.clone(),
        );
        let nccl_calls = Family::<With, Counter>::default();
        registry.register(
            "nccl_calls",
            "NCCL calls made by the rank's process, by operation",
            nccl_calls.clone(),
        );
        let nccl_bytes = Family::<With, Counter>::default();
        registry.register_with_unit(
            "nccl",
            "Bytes the rank contributed to NCCL calls that move data, by operation",
            Unit::Bytes,
            nccl_bytes.clone(),
        );
        let cuda_sync_wait = Family::<RankLabels, Seconds>::default();
        registry.register_with_unit(
            "cuda_sync_wait",
            "Time the rank's threads spent inside CUDA synchronize calls",
            Unit::Seconds,
            cuda_sync_wait.clone(),
        );
        let wait_caused = Family::<RankLabels, Seconds>::default();
        registry.register_with_unit(
            "collective_wait_caused",
            "Time the other ranks of the node spent waiting for this rank, the last to \
             arrive at a collective they all joined (the node's straggler causes the most)",
            Unit::Seconds,
            wait_caused.clone(),
        );
        let lateness = Family::<RankLabels, Seconds>::default();
        registry.register_with_unit(
            "collective_lateness",
            "Summed lateness of the rank's arrival at collectives behind the first rank of \
             the node (divide by nccltrace_collectives_matched_total for the mean)",
            Unit::Seconds,
            lateness.clone(),
        );
        let matched = Family::<RankLabels, Counter>::default();
        registry.register(
            "collectives_matched",
            "Collectives matched across the node's traced ranks",
            matched.clone(),
        );
        let state = Arc::new(Mutex::new(State::default()));
        registry.register_collector(Box::new(node::Collector {
            host,
            state: state.clone(),
        }));
        Metrics {
            registry,
            step_seconds,
            category_seconds,
            nccl_calls,
            nccl_bytes,
            cuda_sync_wait,
            wait_caused,
            lateness,
            matched,
            state,
            published: Mutex::new(HashMap::new()),
        }
    }

    /// Removes the series of ranks whose process has been gone for `grace` (and whose
    /// labels no running process shares: a rank restarted under the same labels keeps
    /// them); returns the label sets removed.
    pub fn retire(
        &self,
        alive: impl Fn(u32) -> bool,
        grace: std::time::Duration,
    ) -> Vec<RankLabels> {
        let Ok(mut published) = self.published.lock() else {
            return Vec::new();
        };
        let now = std::time::Instant::now();
        for (pid, (_, gone)) in published.iter_mut() {
            if gone.is_none() && !alive(*pid) {
                *gone = Some(now);
            }
        }
        let live: std::collections::HashSet<RankLabels> = published
            .values()
            .filter(|(_, gone)| gone.is_none())
            .map(|(l, _)| l.clone())
            .collect();
        let expired: Vec<u32> = published
            .iter()
            .filter(|(_, (_, gone))| gone.is_some_and(|t| now.duration_since(t) >= grace))
            .map(|(pid, _)| *pid)
            .collect();
        let mut removed = Vec::new();
        for pid in expired {
            let Some((labels, _)) = published.remove(&pid) else {
                continue;
            };
            if live.contains(&labels) || removed.contains(&labels) {
                continue;
            }
            self.remove_series(&labels);
            removed.push(labels);
        }
        removed
    }

    fn remove_series(&self, labels: &RankLabels) {
        self.step_seconds.remove(labels);
        for family in [&self.cuda_sync_wait, &self.wait_caused, &self.lateness] {
            family.remove(labels);
        }
        self.matched.remove(labels);
        for name in crate::attribute::categories::NAMES {
            self.category_seconds
                .remove(&(labels.clone(), [("category", name.to_owned())]));
        }
        for (func, _, _) in Func::ALL {
            let key = (labels.clone(), [("op", func.name().to_owned())]);
            self.nccl_calls.remove(&key);
            self.nccl_bytes.remove(&key);
        }
    }

    /// The exposition (OpenMetrics text, which Prometheus reads).
    #[must_use]
    pub fn encode(&self) -> String {
        let mut text = String::new();
        // Writing into a String does not fail.
        let _ = prometheus_client::encoding::text::encode(&mut text, &self.registry);
        text
    }

    pub(crate) fn with_state(&self, f: impl FnOnce(&mut State)) {
        if let Ok(mut state) = self.state.lock() {
            f(&mut state);
        }
    }

    /// Sets the events lost so far, by kind.
    pub fn set_lost(&self, lost: &BTreeMap<String, u64>) {
        self.with_state(|s| s.lost.clone_from(lost));
    }

    /// Sets the number of processes traced now.
    pub fn set_targets(&self, targets: usize) {
        self.with_state(|s| s.targets = targets);
    }

    /// Sets the doctor's findings (a gauge per finding id).
    pub fn set_findings(&self, report: &serde_json::Value) {
        let findings = report["findings"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|f| {
                Some((
                    f["id"].as_str()?.to_owned(),
                    f["severity"].as_str().unwrap_or("").to_lowercase(),
                ))
            })
            .collect();
        self.with_state(|s| s.findings = findings);
    }
}

/// The last final step, for the status line on a terminal (the numbers the metrics have).
#[derive(Debug, Default)]
pub struct LastStep {
    /// Steps so far, the last one's wall time (ns), its largest category and share.
    inner: Mutex<(u64, u64, Option<TopCategory>)>,
}

type TopCategory = (&'static str, f64);

impl LastStep {
    /// Counts an epoch's steps and keeps the last one's wall time and top category.
    pub fn epoch(&self, epoch: &Epoch) {
        let Some(last) = epoch.steps.last() else {
            return;
        };
        let top = last
            .categories
            .named()
            .into_iter()
            .filter_map(|(n, v)| Some((n, v?)))
            .max_by_key(|(_, v)| *v)
            .map(|(n, v)| (n, v as f64 / last.wall_ns.max(1) as f64));
        if let Ok(mut inner) = self.inner.lock() {
            inner.0 += epoch.steps.len() as u64;
            inner.1 = last.wall_ns;
            inner.2 = top;
        }
    }

    /// "N steps, last 2.61 ms (compute 78%)"; None before the first step.
    #[must_use]
    pub fn line(&self) -> Option<String> {
        let (steps, wall, top) = *self.inner.lock().ok()?;
        if steps == 0 {
            return None;
        }
        let top = top.map_or(String::new(), |(n, share)| {
            format!(" ({n} {:.0}%)", share * 100.0)
        });
        Some(format!(
            "{steps} steps, last {:.2} ms{top}",
            wall as f64 / 1e6
        ))
    }
}

/// The status line's sink: each epoch updates the shared [`LastStep`].
#[derive(Debug)]
pub struct StatusSink(pub Arc<LastStep>);

impl Sink for StatusSink {
    fn epoch(&mut self, epoch: &Epoch) {
        self.0.epoch(epoch);
    }
}

/// Feeds one aggregator's events and epochs into [`Metrics`]: NCCL and sync totals are
/// kept per process and published with each epoch, under labels fixed the first time a
/// process is published.
pub struct Feed {
    metrics: Arc<Metrics>,
    host: Host,
    hostname: String,
    labels: HashMap<u32, RankLabels>,
    /// Ranks given to ncclCommInitRank, by pid (preferred over the environment).
    init_ranks: BTreeMap<u32, i32>,
    /// The unique id of each pid's first communicator made while traced: its `job_id`
    /// where the environment names no job.
    init_ids: BTreeMap<u32, u64>,
    /// The traced processes, and the rank their environment gave when they were attached
    /// (as the recording keeps it).
    pids: Vec<u32>,
    env_ranks: BTreeMap<u32, (String, i32)>,
    /// Not yet published: per (pid, function) calls and bytes; per pid sync wait, ns.
    calls: HashMap<(u32, Func), (u64, u64)>,
    sync_ns: HashMap<u32, u64>,
    /// Each pid's cross-rank tallies as last published (they come as running totals).
    lateness: HashMap<u32, crate::attribute::ranks::Lateness>,
}

impl std::fmt::Debug for Feed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Feed").finish_non_exhaustive()
    }
}

impl Feed {
    /// A feed for the run `header` describes; `host` is where the targets' environment is
    /// read (for `local_rank` and `job_id`).
    #[must_use]
    pub fn new(metrics: Arc<Metrics>, host: Host, header: &crate::record::Header) -> Feed {
        let mut feed = Feed {
            metrics,
            host,
            hostname: header.hostname.clone(),
            labels: HashMap::new(),
            init_ranks: BTreeMap::new(),
            init_ids: BTreeMap::new(),
            pids: Vec::new(),
            env_ranks: BTreeMap::new(),
            calls: HashMap::new(),
            sync_ns: HashMap::new(),
            lateness: HashMap::new(),
        };
        for t in &header.targets {
            feed.target(t);
        }
        let gpus = header
            .gpus
            .iter()
            .enumerate()
            .map(|(i, g)| node::GpuSeries::new(&header.hostname, i, g))
            .collect();
        feed.metrics.with_state(|s| s.gpus = gpus);
        feed
    }

    /// The labels of `pid`'s series, fixed when first asked for.
    fn labels(&mut self, pid: u32) -> RankLabels {
        if let Some(l) = self.labels.get(&pid) {
            return l.clone();
        }
        let env = self.host.environ(pid);
        let var = |names: &[&str]| -> String {
            names
                .iter()
                .find_map(|n| env.iter().find(|(k, _)| k == n).map(|(_, v)| v.clone()))
                .unwrap_or_default()
        };
        // Numbered as the summary numbers the ranks, but for a rank read from its
        // communicator's memory (the summary's before pid order): pid order keeps the label
        // of independent one-rank jobs, each rank 0 of its own, apart.
        let rank = crate::attribute::ranks::identify(&self.pids, &self.init_ranks, &self.env_ranks)
            .into_iter()
            .find(|r| r.pid == pid)
            .map(|r| r.rank.to_string())
            .unwrap_or_default();
        let labels = RankLabels {
            host: self.hostname.clone(),
            job_id: self
                .host
                .env_job(pid)
                .map(|(_, v)| v)
                .or_else(|| Some(job_label(*self.init_ids.get(&pid)?)))
                .unwrap_or_default(),
            rank,
            local_rank: var(&[
                "LOCAL_RANK",
                "OMPI_COMM_WORLD_LOCAL_RANK",
                "SLURM_LOCALID",
                "MPI_LOCALRANKID",
            ]),
        };
        self.labels.insert(pid, labels.clone());
        if let Ok(mut published) = self.metrics.published.lock() {
            published.insert(pid, (labels.clone(), None));
        }
        labels
    }
}

impl Sink for Feed {
    /// A process traced from now on (`--follow`).
    fn target(&mut self, t: &crate::record::TargetInfo) {
        self.pids.push(t.pid);
        if let Some(r) = &t.env_rank {
            self.env_ranks.insert(t.pid, r.clone());
        }
    }

    /// Counts a call.
    fn event(&mut self, event: &Event) {
        if let Event::Gpu { ts_ns, reading, .. } = event {
            self.metrics.with_state(|s| {
                if let Some(g) = s.gpus.get_mut(reading.gpu as usize) {
                    g.read(*ts_ns, reading);
                }
            });
            return;
        }
        let Event::Call(c) = event else { return };
        let pid = c.task.tgid;
        match c.func.library() {
            Library::Nccl => {
                if let Some(rank) = c.rank()
                    && matches!(c.func, Func::CommInitRank | Func::CommInitRankConfig)
                {
                    self.init_ranks.entry(pid).or_insert(rank);
                    if let Some(id) = c.comm_id() {
                        self.init_ids.entry(pid).or_insert(id);
                    }
                }
                let entry = self.calls.entry((pid, c.func)).or_default();
                entry.0 += 1;
                if c.func.is_collective() {
                    entry.1 += c.bytes.unwrap_or(0);
                }
            }
            Library::Cuda => {
                *self.sync_ns.entry(pid).or_default() += c.end_ns.saturating_sub(c.start_ns);
            }
            Library::Marker | Library::Nvtx => {}
        }
    }

    /// Publishes an epoch's final steps and the calls counted so far.
    fn epoch(&mut self, epoch: &Epoch) {
        for step in &epoch.steps {
            let wall = step.wall_ns as f64 / 1e9;
            let per_rank: Vec<(u32, crate::attribute::Categories)> = if step.ranks.is_empty() {
                epoch
                    .detail
                    .rank_pid
                    .map(|pid| (pid, step.categories))
                    .into_iter()
                    .collect()
            } else {
                step.ranks.iter().map(|r| (r.pid, r.categories)).collect()
            };
            for (pid, categories) in per_rank {
                let labels = self.labels(pid);
                self.metrics
                    .step_seconds
                    .get_or_create(&labels)
                    .observe(wall);
                for (name, value) in categories.named() {
                    let Some(ns) = value else { continue };
                    self.metrics
                        .category_seconds
                        .get_or_create(&(labels.clone(), [("category", name.to_owned())]))
                        .inc_by(ns as f64 / 1e9);
                }
            }
        }
        for now in &epoch.lateness {
            let then = self.lateness.insert(now.pid, *now).unwrap_or_default();
            let labels = self.labels(now.pid);
            let seconds = |a: u64, b: u64| a.saturating_sub(b) as f64 / 1e9;
            let m = &self.metrics;
            m.wait_caused
                .get_or_create(&labels)
                .inc_by(seconds(now.caused_ns, then.caused_ns));
            m.lateness
                .get_or_create(&labels)
                .inc_by(seconds(now.behind_ns, then.behind_ns));
            m.matched
                .get_or_create(&labels)
                .inc_by(now.matched.saturating_sub(then.matched));
        }
        self.flush();
    }

    /// Publishes the calls counted since the last epoch.
    fn flush(&mut self) {
        let calls = std::mem::take(&mut self.calls);
        for ((pid, func), (n, bytes)) in calls {
            let key = (self.labels(pid), [("op", func.name().to_owned())]);
            self.metrics.nccl_calls.get_or_create(&key).inc_by(n);
            if func.is_collective() {
                self.metrics.nccl_bytes.get_or_create(&key).inc_by(bytes);
            }
        }
        let syncs = std::mem::take(&mut self.sync_ns);
        for (pid, ns) in syncs {
            let labels = self.labels(pid);
            self.metrics
                .cuda_sync_wait
                .get_or_create(&labels)
                .inc_by(ns as f64 / 1e9);
        }
    }
}
