//! `cargo xtask soak`: the demo trainer at a high event rate for many minutes under
//! `nccltrace attach` (default profile), the agent's RSS sampled as it runs; every lost
//! event must be counted and reported; then the fuzz targets for longer than in `test`.

use std::io::{BufRead as _, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};

/// One GET of /metrics; true when it answered 200 with the step histogram.
fn scrape(addr: &str) -> bool {
    use std::io::{Read as _, Write as _};
    let Ok(mut s) = std::net::TcpStream::connect(addr) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
    let _ = write!(s, "GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n");
    let mut text = String::new();
    let _ = s.read_to_string(&mut text);
    text.starts_with("HTTP/1.1 200") && text.contains("nccltrace_step_seconds_count")
}

/// A `kB` figure of `/proc/PID/status` (`VmRSS:`, `VmHWM:`).
fn status_kb(pid: u32, key: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

#[allow(clippy::too_many_lines)] // one run start to end, then its table
pub fn run(root: &Path, minutes: u32, fuzz_seconds: u32, daemon: bool) -> anyhow::Result<()> {
    if !super::setup::is_root() {
        bail!("the soak test loads eBPF programs: run `sudo -E cargo xtask soak`");
    }
    let fixtures = super::build_fixtures(root)?;
    let (built, work) = super::release_agent(root, "soak")?;
    // A copy, so that the release binary can be rebuilt while a long soak runs.
    let agent = work.join("nccltrace");
    std::fs::copy(&built, &agent).with_context(|| format!("copying {}", built.display()))?;
    let go = work.join("go");
    // Short steps, many faults and collectives: tens of thousands of events a second.
    let mut trainer = Command::new(fixtures.join("trainer"))
        .args([
            "--steps",
            "100000000",
            "--compute-us",
            "300",
            "--fault-pages",
            "64",
        ])
        .arg("--go-file")
        .arg(&go)
        .stdout(Stdio::null())
        .spawn()
        .context("starting the trainer")?;
    let out = work.join("out");
    let _ = std::fs::remove_dir_all(&out);
    let mut a = Command::new(&agent);
    // The trainer may not have loaded NCCL yet when the agent starts.
    a.args([
        "attach",
        "--wait-for-nccl",
        "--duration",
        &format!("{minutes}m"),
        "--pid",
    ])
    .arg(trainer.id().to_string())
    .arg("--out")
    .arg(&out);
    if daemon {
        a.args(["--metrics", "127.0.0.1:0", "--rotate", "1m", "--keep", "3"]);
    }
    let mut a = a.stdout(Stdio::null()).stderr(Stdio::piped()).spawn()?;
    let stderr = BufReader::new(a.stderr.take().context("stderr")?);
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        for line in stderr.lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let started = Instant::now();
    let mut metrics = None;
    let mut before = Vec::new();
    loop {
        match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(line) if line.contains("attached to pid") => break,
            Ok(line) => {
                metrics = metrics
                    .or_else(|| Some(line.split("http://").nth(1)?.split('/').next()?.to_owned()));
                before.push(line);
            }
            Err(e) => {
                let _ = trainer.kill();
                let status = if matches!(e, std::sync::mpsc::RecvTimeoutError::Disconnected) {
                    format!("nccltrace ended ({}) before it attached", a.wait()?)
                } else {
                    let _ = a.kill();
                    "nccltrace did not attach within a minute".to_owned()
                };
                bail!("{status}; it said:\n{}", before.join("\n"));
            }
        }
    }
    let mut scrapes = (0u32, 0u32);
    std::fs::write(&go, b"")?;
    // RSS while tracing, and separately while the agent reads the recording back and
    // writes its outputs (after "tracing stopped").
    let mut samples: Vec<(f64, u64)> = Vec::new();
    let mut after: Vec<u64> = Vec::new();
    let mut said: Vec<String> = Vec::new();
    let mut hwm = 0u64;
    while a.try_wait()?.is_none() {
        std::thread::sleep(Duration::from_secs(1));
        said.extend(rx.try_iter());
        let stopped = said.iter().any(|l| l.contains("tracing stopped"));
        if let Some(addr) = metrics.as_deref()
            && !stopped
            && samples.len().is_multiple_of(10)
        {
            scrapes.0 += 1;
            scrapes.1 += u32::from(scrape(addr));
        }
        // The kernel updates the high-water mark lazily: a reading at the end can be lower
        // than one taken earlier (seen: 59.6 MB at the end, 61.1 MB an hour before).
        hwm = hwm.max(status_kb(a.id(), "VmHWM:").unwrap_or(0));
        if let Some(kb) = status_kb(a.id(), "VmRSS:") {
            let t = started.elapsed().as_secs_f64();
            if stopped {
                after.push(kb);
            } else {
                if samples.len().is_multiple_of(10) {
                    eprintln!(
                        "soak: {:>6.0} s  agent RSS {:>8.1} MB",
                        t,
                        kb as f64 / 1024.0
                    );
                }
                samples.push((t, kb));
            }
        }
    }
    let _ = trainer.kill();
    let _ = trainer.wait();
    said.extend(rx.try_iter());
    // The run's summary, or with --rotate each kept window's (events and losses added up
    // over the windows kept; the whole-process peak is the last window's).
    let mut summaries = vec![out.join("summary.json")];
    if daemon {
        summaries = std::fs::read_dir(&out)?
            .filter_map(|e| Some(e.ok()?.path().join("summary.json")))
            .filter(|p| p.exists())
            .collect();
        summaries.sort();
    }
    let texts = summaries
        .iter()
        .map(std::fs::read_to_string)
        .collect::<Result<Vec<_>, _>>()
        .context("the agent wrote no summary.json")?;
    let read = |summary: &str, key: &str| -> f64 {
        summary
            .split(&format!("\"{key}\": "))
            .nth(1)
            .and_then(|r| r.split([',', '\n', '}']).next())
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0.0)
    };
    let total = |key: &str| texts.iter().map(|t| read(t, key)).sum::<f64>();
    let value = |key: &str| texts.last().map_or(0.0, |t| read(t, key));
    let (events, lost) = (total("events"), total("lost_events"));
    let warned = said.iter().any(|l| l.contains("events lost"));
    // Growth per minute over the second half of the run (the first half includes warm-up).
    let half: Vec<&(f64, u64)> = samples
        .iter()
        .filter(|(t, _)| *t >= f64::from(minutes) * 30.0)
        .collect();
    let slope = match (half.first(), half.last()) {
        (Some(a), Some(b)) if b.0 > a.0 => {
            (b.1 as f64 - a.1 as f64) / 1024.0 / ((b.0 - a.0) / 60.0)
        }
        _ => 0.0,
    };
    let peak = samples.iter().map(|s| s.1).max().unwrap_or(0);
    let mode = if daemon {
        format!(
            ", --metrics scraped {} times ({} answered), --rotate 1m --keep 3: {} windows kept",
            scrapes.0,
            scrapes.1,
            texts.len()
        )
    } else {
        String::new()
    };
    println!("\nnccltrace soak ({minutes} min, demo trainer, default profile{mode})");
    println!("| measure | value |");
    println!("| --- | --- |");
    println!(
        "| events recorded{} | {events:.0} ({:.0}/s) |",
        if daemon { " (windows kept)" } else { "" },
        events / (f64::from(minutes) * 60.0).min(texts.len() as f64 * 60.0)
    );
    println!(
        "| events lost | {lost:.0} (reported during the run: {}) |",
        if lost == 0.0 {
            "none to report".into()
        } else {
            warned.to_string()
        }
    );
    println!(
        "| agent RSS, peak while tracing | {:.1} MB |",
        peak as f64 / 1024.0
    );
    println!("| agent RSS growth, second half | {slope:.1} MB/min |");
    let attributed = said
        .iter()
        .find_map(|l| l.split("attributed in ").nth(1))
        .unwrap_or("?");
    println!(
        "| after the run: finishing the attribution, writing outputs | {attributed}, RSS peak {:.1} MB (1 s samples) |",
        after.iter().max().copied().unwrap_or(0) as f64 / 1024.0
    );
    println!(
        "| agent peak RSS of the whole process, the end included (the largest VmHWM: read every second, and at the end into summary.json agent.peak_rss_kb) | {:.1} MB |",
        value("peak_rss_kb").max(hwm as f64) / 1024.0
    );
    if lost > 0.0 && !warned {
        bail!("{lost} events were lost without a warning during the run");
    }
    super::fuzz::run(root, fuzz_seconds)
}
