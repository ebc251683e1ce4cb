//! Rows of the bench table measured apart from the main run: the stand-in Python rank,
//! `merge`, the agent's CPU seconds, attaching every probe of the default profile.

use std::io::{BufRead as _, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};

use super::{KillOnDrop, attached, caller, finish, json, libc_kill, median, wait_for};

/// The stand-in Python rank (Debian's python3.11, tests/fixtures/py_rank.py) traced for
/// 3 s by the default profile with each (line, replacement) of `changes` made (`tag` names
/// the run's files): the mean run time (ns) of the on-CPU sampling program and of the
/// call-entry program (which takes the CUDA sync's entry stack), from the kernel's own accounting (`kernel.bpf_stats_enabled`), read while
/// attached; and the Python frames per Python stack of the on-CPU flamegraph.
pub(super) fn python_stack_cost(
    root: &Path,
    agent: &Path,
    fixtures: &Path,
    work: &Path,
    tag: &str,
    changes: &[(&str, &str)],
) -> anyhow::Result<([f64; 2], f64)> {
    let profile = work.join(format!("python-{tag}.toml"));
    let mut text = std::fs::read_to_string(root.join("profiles/default.toml"))?;
    for (line, replacement) in changes {
        anyhow::ensure!(text.contains(line), "the default profile has no {line:?}");
        text = text.replace(line, replacement);
    }
    std::fs::write(&profile, text)?;
    let go = work.join("py-go");
    let _ = std::fs::remove_file(&go);
    let mut rank = Command::new("/usr/bin/python3.11")
        .arg(root.join("tests/fixtures/py_rank.py"))
        .arg(fixtures)
        .args(["100000"])
        .arg(&go)
        .env("FAKE_NCCL_US", "3000")
        .stdout(Stdio::piped())
        .spawn()?;
    // Killed however this ends: a rank left running is a process mapping NCCL.
    let _kill = KillOnDrop(rank.id());
    let mut lines = BufReader::new(rank.stdout.take().context("stdout")?).lines();
    wait_for(&mut lines, "ready")?;
    std::fs::write(&go, b"")?;
    let out = work.join(format!("python-{tag}"));
    // Each round writes afresh (the agent refuses a folder with outputs in it).
    let _ = std::fs::remove_dir_all(&out);
    std::fs::write("/proc/sys/kernel/bpf_stats_enabled", b"1")?;
    let (mut a, mut err) = attached(
        Command::new(agent)
            .args(["attach", "--duration", "4s", "--profile"])
            .arg(&profile)
            .args(["--pid", &rank.id().to_string(), "--out"])
            .arg(&out),
    )?;
    std::thread::sleep(Duration::from_secs(3));
    let shown = Command::new("bpftool")
        .args(["prog", "show", "-j"])
        .output()?;
    std::fs::write("/proc/sys/kernel/bpf_stats_enabled", b"0")?;
    for _ in err.by_ref() {}
    a.wait()?;
    libc_kill(rank.id(), 9);
    let _ = rank.wait();
    let progs: serde_json::Value = serde_json::from_slice(&shown.stdout)?;
    let per_run = |name: &str| -> f64 {
        let (mut ns, mut runs) = (0.0, 0.0);
        for p in progs.as_array().into_iter().flatten() {
            if p["name"].as_str().is_some_and(|n| n.starts_with(name)) {
                ns += p["run_time_ns"].as_f64().unwrap_or(0.0);
                runs += p["run_cnt"].as_f64().unwrap_or(0.0);
            }
        }
        if runs > 0.0 { ns / runs } else { f64::NAN }
    };
    // Program names (the kernel keeps 15 characters; bpftool may show BTF's whole name).
    let costs = [per_run("perf_event_cpu_"), per_run("uprobe_lib_call")];
    let frames_per_stack = python_frames_per_stack(&out.join("flamegraph-oncpu.folded"));
    Ok((costs, frames_per_stack))
}

/// Python frames per stack in a folded flamegraph (frames named `f (file:line)`).
pub(super) fn python_frames_per_stack(folded: &Path) -> f64 {
    let text = std::fs::read_to_string(folded).unwrap_or_default();
    let (mut frames, mut stacks) = (0usize, 0usize);
    for line in text.lines() {
        let n = line.split(';').filter(|f| f.contains(".py:")).count();
        if n > 0 {
            frames += n;
            stacks += 1;
        }
    }
    if stacks == 0 {
        0.0
    } else {
        frames as f64 / stacks as f64
    }
}

/// `nccltrace merge` of `recording` with a copy of itself: (seconds, peak RSS in KiB of the
/// whole process, from GNU time).
pub(super) fn merge_speed(
    agent: &Path,
    recording: &Path,
    work: &Path,
) -> anyhow::Result<(f64, u64)> {
    let copy = work.join("merge-copy.nctr");
    std::fs::copy(recording, &copy)?;
    let out = work.join("merge");
    let _ = std::fs::remove_dir_all(&out);
    let started = Instant::now();
    let run = Command::new("/usr/bin/time")
        .args(["-f", "%M"])
        .arg(agent)
        .arg("merge")
        .arg(recording)
        .arg(&copy)
        .args(["--clock-error", "1ms", "--out"])
        .arg(&out)
        .stdout(Stdio::null())
        .output()
        .context("/usr/bin/time (Debian's time, installed by cargo xtask setup)")?;
    let seconds = started.elapsed().as_secs_f64();
    let stderr = String::from_utf8_lossy(&run.stderr);
    if !run.status.success() {
        bail!("nccltrace merge failed: {stderr}");
    }
    let kb = stderr
        .lines()
        .last()
        .and_then(|l| l.trim().parse().ok())
        .context("no peak RSS from /usr/bin/time")?;
    Ok((seconds, kb))
}

/// User + system CPU seconds of a live process so far.
pub(super) fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    // utime and stime are fields 14 and 15 (1-based) of the whole line: 12 and 13 here.
    let ticks: f64 = [11, 12]
        .iter()
        .filter_map(|i| fields.get(*i).and_then(|v| v.parse::<f64>().ok()))
        .sum();
    ticks / 100.0
}

/// Attaches every probe of the default profile to an idle caller for a second: attach time
/// (median), the agent's peak RSS, and the whole command's wall time from start to exit
/// (median, s: the second traced, then the outputs and the kernel releasing the probes).
pub(super) fn attach_only(
    agent: &Path,
    fixtures: &Path,
    lib: &Path,
    go: &Path,
    work: &Path,
) -> anyhow::Result<(f64, u64, f64)> {
    let mut ms = Vec::new();
    let mut walls = Vec::new();
    let mut rss = 0u64;
    for round in 0..3 {
        let (child, lines) = caller(fixtures, lib, go)?;
        let out = work.join(format!("attach{round}"));
        let started = std::time::Instant::now();
        crate::run(
            Command::new(agent)
                .args(["attach", "--duration", "1s", "--pid"])
                .arg(child.id().to_string())
                .arg("--out")
                .arg(&out)
                .stdout(Stdio::null())
                .stderr(Stdio::null()),
        )?;
        walls.push(started.elapsed().as_secs_f64());
        finish(go, child, lines)?;
        let summary = std::fs::read_to_string(out.join("summary.json"))?;
        ms.push(json(&summary, "attach_ms").unwrap_or(0.0));
        rss = rss.max(json(&summary, "peak_rss_kb").unwrap_or(0.0) as u64);
    }
    Ok((median(ms), rss, median(walls)))
}
