//! `--rotate`: the run cut into windows, each a complete output folder, the oldest pruned.

use super::*;

/// What a window of the run needs besides its folder: the same for every window.
pub(super) struct WindowPlan<'a> {
    pub(super) settings: &'a Settings,
    pub(super) doctor: Option<&'a serde_json::Value>,
    pub(super) metrics: Option<&'a SharedMetrics>,
    pub(super) last_step: &'a std::sync::Arc<crate::metrics::LastStep>,
}

impl WindowPlan<'_> {
    /// Starts recording into `dir` (made if missing; an old recording there replaced),
    /// attributed live.
    pub(super) fn open(&self, dir: &std::path::Path, header: &Header) -> Result<LiveSink, Error> {
        let folder = |source| Error::OutputFolder {
            path: dir.to_owned(),
            source,
        };
        std::fs::create_dir_all(dir).map_err(folder)?;
        let rec_path = dir.join("recording.nctr");
        if rec_path.exists() {
            std::fs::remove_file(&rec_path).map_err(|source| Error::Output {
                path: rec_path.clone(),
                source,
            })?;
        }
        let mut writer = Writer::create(&rec_path, header)?;
        if let Some(report) = self.doctor {
            writer.meta(&Meta::Doctor {
                report: report.clone(),
            })?;
        }
        let settings = self.settings;
        let progress = writer.progress();
        let mut sink = LiveSink {
            store: Store::Disk(writer),
            path: rec_path,
            header: header.clone(),
            rule: settings.step_rule.clone(),
            epoch_events: settings.epoch_events,
            out: dir.to_owned(),
            live: None,
            progress,
            metrics: self.metrics.cloned(),
            metrics_grace: settings.metrics_grace,
            rotate: settings.rotate,
            started: Instant::now(),
            last_step: self.last_step.clone(),
            nccl_calls: 0,
            records: 0,
            status: std::io::stderr().is_terminal(),
            last: (Instant::now(), 0),
        };
        if settings.max_attributed_events == 0 {
            sink.attribute_live();
        }
        Ok(sink)
    }

    /// The folder of a window starting now: a new one under --out with --rotate, else
    /// --out itself.
    pub(super) fn folder(&self) -> PathBuf {
        let root = &self.settings.out.path;
        match self.settings.rotate {
            Some(_) => root.join(super::super::utc_stamp(std::time::SystemTime::now())),
            None => root.clone(),
        }
    }
}

/// Lost events by kind, and the other counters, as the programs count them.
pub(super) type Counts = (BTreeMap<String, u64>, BTreeMap<String, u64>);

/// Lost events and counters `now` since `base` (the last window's end), and `base` moved
/// on.
pub(super) fn window_counts(now: Counts, base: &mut Counts) -> Counts {
    let since = |now: &BTreeMap<String, u64>, then: &BTreeMap<String, u64>| {
        now.iter()
            .map(|(k, v)| {
                (
                    k.clone(),
                    v.saturating_sub(then.get(k).copied().unwrap_or(0)),
                )
            })
            .collect::<BTreeMap<_, _>>()
    };
    let delta = (since(&now.0, &base.0), since(&now.1, &base.1));
    *base = now;
    delta
}

/// Ends a window while tracing goes on into the next: its closing record now, its
/// outputs on a thread of their own (the drain must not pause for them).
pub(super) fn end_window(
    mut sink: LiveSink,
    end: &Meta,
    dir: PathBuf,
    settings: &Settings,
) -> std::thread::JoinHandle<()> {
    sink.close(end);
    let (rule, limit) = (settings.step_rule.clone(), settings.max_attributed_events);
    std::thread::spawn(move || {
        let (agg, writer) = sink.finish(limit);
        let mut outputs = agg.finish(rule);
        let (written, write_end) = write_everything(&dir, &mut outputs, writer);
        if let Err((path, e)) = written {
            crate::note!("nccltrace: warning: cannot write {}: {e}", path.display());
        }
        if let Err(e) = write_end {
            crate::note!("nccltrace: warning: {e}");
        }
        drop(outputs);
        crate::host::release_free_memory();
        crate::note!("nccltrace: window complete in {}", dir.display());
    })
}

/// With `--keep N`: removes the oldest complete windows (their summary.json written)
/// beyond N. Only folders named as windows are touched.
pub(super) fn prune_windows(root: &std::path::Path, keep: usize, current: &std::path::Path) {
    if keep == 0 {
        return;
    }
    let is_window =
        |name: &str| name.len() == 16 && name.as_bytes()[8] == b'T' && name.ends_with('Z');
    let mut windows: Vec<PathBuf> = host::Host::at(root)
        .list("")
        .into_iter()
        .filter(|n| is_window(n))
        .map(|n| root.join(n))
        .collect();
    windows.sort();
    let mut excess = windows.len().saturating_sub(keep);
    for w in windows {
        if excess == 0 {
            break;
        }
        if w != current && w.join("summary.json").exists() {
            if let Err(e) = std::fs::remove_dir_all(&w) {
                crate::note!(
                    "nccltrace: warning: cannot remove old window {}: {e}",
                    w.display()
                );
            }
            excess -= 1;
        }
    }
}

/// The windows of a run: the one being recorded, and those still being finished.
pub(super) struct Windows {
    pub(super) sink: LiveSink,
    pub(super) out: PathBuf,
    pub(super) base: Counts,
    pub(super) finishing: Vec<std::thread::JoinHandle<()>>,
}

impl Windows {
    /// Starts the next window; the current one is finished on a thread. If the next
    /// cannot be started, the current one goes on.
    pub(super) fn rotate(&mut self, plan: &WindowPlan<'_>, attached: &mut source::Attached) {
        let next_dir = plan.folder();
        match plan.open(&next_dir, &attached.header) {
            Ok(next) => {
                let reason = source::StopReason::Rotate.to_string();
                let end = end_record(attached, reason, Some(&mut self.base));
                let done = std::mem::replace(&mut self.sink, next);
                attached.new_window();
                let dir = std::mem::replace(&mut self.out, next_dir);
                self.finishing.retain(|t| !t.is_finished());
                self.finishing
                    .push(end_window(done, &end, dir, plan.settings));
                prune_windows(&plan.settings.out.path, plan.settings.keep, &self.out);
            }
            Err(e) => {
                crate::note!(
                    "nccltrace: warning: cannot start the next window ({e}); this one goes on"
                );
                self.sink.started = Instant::now();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `--keep 2`: the oldest complete windows go; the current one, one still being
    /// written (no summary.json yet) and other folders stay.
    #[test]
    fn prune_keeps_the_newest_complete_windows() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let names = [
            "20261203T100000Z",
            "20261203T110000Z",
            "20261203T120000Z",
            "20261203T130000Z",
        ];
        for (i, n) in names.iter().enumerate() {
            std::fs::create_dir(root.join(n)).unwrap();
            // The newest but one is still being finished; the newest is current.
            if i < 2 {
                std::fs::write(root.join(n).join("summary.json"), "{}").unwrap();
            }
        }
        std::fs::create_dir(root.join("mine")).unwrap();
        prune_windows(root, 2, &root.join(names[3]));
        let mut left = host::Host::at(root).list("");
        left.sort();
        assert_eq!(left, ["20261203T120000Z", "20261203T130000Z", "mine"]);
        // 0 keeps everything.
        prune_windows(root, 0, &root.join(names[3]));
        assert_eq!(host::Host::at(root).list("").len(), 3);
    }
}
