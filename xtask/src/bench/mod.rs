//! `cargo xtask bench`: the agent's cost, measured beside its baselines in one run, on the
//! real libnccl.so.2 of the nvidia-nccl-cu12 wheel (docs/benchmarks.md).

use std::io::{BufRead as _, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};

mod model;
mod rows;

pub use model::cost;
use model::trainer_step_ns;
use rows::{attach_only, cpu_seconds, merge_speed, python_stack_cost};

const CALLS: &str = "300000";
/// Calls made before the timed ones where a row is the agent's steady state: past its
/// first second, whose programs' cost the kernel counts in full.
const STEADY_AFTER_MS: u32 = 1500;
/// Rounds of the per-call measurements (each runs them all, one after the other).
const PER_CALL_ROUNDS: usize = 5;

fn json(line: &str, key: &str) -> Option<f64> {
    let rest = line.split(&format!("\"{key}\": ")).nth(1)?;
    rest.split([',', '}']).next()?.trim().parse().ok()
}

/// Starts the caller, waiting at `go`; returns it after its ready line.
fn caller(
    fixtures: &Path,
    lib: &Path,
    go: &Path,
) -> anyhow::Result<(Child, std::io::Lines<BufReader<std::process::ChildStdout>>)> {
    caller_after(fixtures, lib, go, 0)
}

/// As [`caller`], its timed calls made after `warmup_ms` of calls: a tracer's steady
/// state (nccltrace counts its programs' cost for the whole first second, then in windows
/// of 100 ms a second).
fn caller_after(
    fixtures: &Path,
    lib: &Path,
    go: &Path,
    warmup_ms: u32,
) -> anyhow::Result<(Child, std::io::Lines<BufReader<std::process::ChildStdout>>)> {
    let _ = std::fs::remove_file(go);
    let mut child = on_cpu(fixtures.join("nccl_caller"), CALLER_CPU);
    if warmup_ms > 0 {
        child.env("NCCL_CALLER_WARMUP_MS", warmup_ms.to_string());
    }
    let mut child = child
        .arg(lib)
        .arg(CALLS)
        .arg(go)
        .stdout(Stdio::piped())
        .spawn()
        .context("starting nccl_caller")?;
    let mut lines = BufReader::new(child.stdout.take().context("stdout")?).lines();
    lines.next().context("nccl_caller printed nothing")??;
    Ok((child, lines))
}

/// The per-call rows run the caller on one CPU and the tracer on another (where there are
/// two): on this 2-vCPU VM a tracer's threads otherwise share the caller's CPU now and
/// then, and that run's calls take twice as long (seen: 1.0 and 2.0 µs a call from one
/// run to the next, and bursts within one). The rows are the traced thread's own cost;
/// the agent's CPU has its own row.
const CALLER_CPU: &str = "0";
const TRACER_CPU: &str = "1";

/// Before a per-call measurement: everything written flushed. The traced runs write
/// hundreds of MB (each call is its own step): left to pile up in new folders, the kernel's
/// writeback (and, on a disk mounted with `discard`, the freeing of removed files) ran
/// beside later rounds and held the caller (seen: 1.2–2.0 µs a call where it is 1.0).
fn settle() -> anyhow::Result<()> {
    super::run(&mut Command::new("sync"))
}

/// Removes `out` (the previous round's outputs) and flushes, before the run that writes
/// there. Writing over them (`--force`) freed the old files' blocks while the agent traced:
/// it fell behind and lost 75k–246k events in three of three runs by hand, none in about
/// twenty with the folder removed first (this VM, its disk mounted with `discard`).
fn fresh(out: &Path) -> anyhow::Result<()> {
    let _ = std::fs::remove_dir_all(out);
    settle()
}

/// `program` kept on `cpu` (`taskset`) where the host has more than one CPU.
fn on_cpu(program: impl AsRef<std::ffi::OsStr>, cpu: &str) -> Command {
    if std::thread::available_parallelism().map_or(1, usize::from) < 2 {
        return Command::new(program);
    }
    let mut command = Command::new("taskset");
    command.args(["-c", cpu]).arg(program);
    command
}

/// Releases the caller and returns its ns per call.
fn finish(
    go: &Path,
    mut child: Child,
    lines: std::io::Lines<BufReader<std::process::ChildStdout>>,
) -> anyhow::Result<f64> {
    std::fs::write(go, b"")?;
    let last = lines.map_while(Result::ok).last().unwrap_or_default();
    child.wait()?;
    json(&last, "ns_per_call").with_context(|| format!("nccl_caller said {last:?}"))
}

fn wait_for(
    lines: &mut impl Iterator<Item = std::io::Result<String>>,
    needle: &str,
) -> anyhow::Result<()> {
    let started = Instant::now();
    for line in lines {
        let line = line?;
        if line.contains(needle) {
            return Ok(());
        }
        if started.elapsed() > Duration::from_secs(60) {
            break;
        }
    }
    bail!("never saw {needle:?}")
}

/// Untraced/traced pairs of demo trainer runs for the step-time ratio.
const TRAINER_PAIRS: usize = 8;

/// Starts `cmd` (an nccltrace command that attaches) and waits for its "attached to pid"
/// line: the child and the rest of its stderr.
fn attached(
    cmd: &mut Command,
) -> anyhow::Result<(Child, std::io::Lines<BufReader<std::process::ChildStderr>>)> {
    let mut child = cmd.stdout(Stdio::null()).stderr(Stdio::piped()).spawn()?;
    let mut err = BufReader::new(child.stderr.take().context("stderr")?).lines();
    wait_for(&mut err, "attached to pid")?;
    Ok((child, err))
}

/// Kills a process (SIGKILL) when dropped.
struct KillOnDrop(u32);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        libc_kill(self.0, 9);
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[allow(clippy::too_many_lines)] // one measurement after the other, then the table
pub fn run(root: &Path) -> anyhow::Result<()> {
    if !super::setup::is_root() {
        bail!("the benchmarks load eBPF programs: run `sudo -E cargo xtask bench`");
    }
    if Command::new("bpftrace").arg("--version").output().is_err() {
        eprintln!("bench: installing Debian's bpftrace for the baseline");
        super::run(
            Command::new("apt-get")
                .args(["install", "-y", "-q", "bpftrace"])
                .env("DEBIAN_FRONTEND", "noninteractive"),
        )?;
    }
    let lib = super::setup::real_nccl()?;
    let fixtures = super::build_fixtures(root)?;
    let (agent, work) = super::release_agent(root, "bench")?;
    let go = work.join("go");

    let mut bare = Vec::new();
    let mut pair = Vec::new();
    let mut traced = Vec::new();
    let mut entries_only = Vec::new();
    let mut entries_lost = Vec::new();
    let mut bpftrace = Vec::new();
    let mut entry_floor = Vec::new();
    // The minimal profile with collectives traced at entry only (issue 22).
    let entries_profile = work.join("minimal-entries.toml");
    std::fs::write(
        &entries_profile,
        std::fs::read_to_string(root.join("profiles/minimal.toml"))?
            .replace("call_returns = \"all\"", "call_returns = \"needed\""),
    )?;
    let mut cpu_at_200k = Vec::new();
    let mut rss_traced_kb = 0u64;
    let mut recording = PathBuf::new();
    let mut events = 0.0;
    for _ in 0..PER_CALL_ROUNDS {
        settle()?;
        // Bare call.
        let (child, lines) = caller(&fixtures, &lib, &go)?;
        bare.push(finish(&go, child, lines)?);
        // The bare probe pair: nothing at entry, an 8-byte record at return.
        let (child, lines) = caller(&fixtures, &lib, &go)?;
        let (mut b, _err) = attached(
            on_cpu(&agent, TRACER_CPU)
                .args(["bench-pair", "--symbol", "ncclAllReduce", "--pid"])
                .arg(child.id().to_string())
                .arg("--library")
                .arg(&lib),
        )?;
        pair.push(finish(&go, child, lines)?);
        b.wait()?;
        // nccltrace, minimal profile (NCCL and scheduler probes).
        let (child, lines) = caller(&fixtures, &lib, &go)?;
        let out = work.join("run");
        fresh(&out)?;
        let (mut a, mut err) = attached(
            on_cpu(&agent, TRACER_CPU)
                .args(["attach", "--force", "--profile", "minimal", "--pid"])
                .arg(child.id().to_string())
                .arg("--out")
                .arg(&out),
        )?;
        let cpu0 = cpu_seconds(a.id());
        let started = Instant::now();
        traced.push(finish(&go, child, lines)?);
        let (cpu, wall) = (cpu_seconds(a.id()) - cpu0, started.elapsed().as_secs_f64());
        for _ in err.by_ref() {}
        if !a.wait()?.success() {
            bail!("nccltrace failed");
        }
        let summary = std::fs::read_to_string(out.join("summary.json"))?;
        rss_traced_kb = rss_traced_kb.max(json(&summary, "peak_rss_kb").unwrap_or(0.0) as u64);
        events = json(&summary, "events").unwrap_or(0.0);
        // Agent CPU while draining, scaled to 200k events/s.
        cpu_at_200k.push(cpu / wall * 200_000.0 / (events / wall).max(1.0) * 100.0);
        recording = out.join("recording.nctr");
        // The same, collectives traced at entry only, in the agent's steady state.
        let entries_out = work.join("entries");
        fresh(&entries_out)?;
        let (child, lines) = caller_after(&fixtures, &lib, &go, STEADY_AFTER_MS)?;
        let (mut a, err) = attached(
            on_cpu(&agent, TRACER_CPU)
                .args(["attach", "--force", "--profile"])
                .arg(&entries_profile)
                .arg("--pid")
                .arg(child.id().to_string())
                .arg("--out")
                .arg(&entries_out),
        )?;
        entries_only.push(finish(&go, child, lines)?);
        for _ in err {}
        if !a.wait()?.success() {
            bail!("nccltrace (collectives at entry only) failed");
        }
        // A run whose agent fell behind (a full ring buffer) measures the agent, not the
        // probes: said beside the round.
        let summary = std::fs::read_to_string(entries_out.join("summary.json"))?;
        entries_lost.push(json(&summary, "lost_events").unwrap_or(f64::NAN));
        // bpftrace: entry/exit latency histogram of the same function.
        let l = lib.display();
        bpftrace.push(bpftrace_cost(
            &fixtures,
            &lib,
            &go,
            &format!(
                "uprobe:{l}:ncclAllReduce {{ @s[tid] = nsecs; }} \
                 uretprobe:{l}:ncclAllReduce /@s[tid]/ {{ @lat = hist(nsecs - @s[tid]); delete(@s[tid]); }}"
            ),
        )?);
        // The floor of any uprobe tracer: an entry probe that only counts.
        entry_floor.push(bpftrace_cost(
            &fixtures,
            &lib,
            &go,
            &format!("uprobe:{l}:ncclAllReduce {{ @n = count(); }}"),
        )?);
    }
    // Attach alone, every probe of the default profile, on the idle caller.
    let (attach_ms, attach_rss_kb, attach_wall_s) =
        attach_only(&agent, &fixtures, &lib, &go, &work)?;
    // What the scheduler probes cost processes nobody traces.
    let (switch_bare, switch_raw, switch_formatted) =
        untraced_switches(&agent, &fixtures, &lib, &go, &work, root)?;
    // The demo trainer, untraced and traced (default profile), interleaved; report on a
    // long recording of it with the full profile.
    // Step times vary ±1% from run to run here (timer wake-ups on a VM), untraced too: the
    // ratio is the median of several pairs.
    let mut ratios = Vec::new();
    let (mut untraced_step, mut traced_step) = (0.0, 0.0);
    for _ in 0..TRAINER_PAIRS {
        untraced_step = trainer_step_ns(&agent, &fixtures, &work, None, 300)?;
        traced_step = trainer_step_ns(
            &agent,
            &fixtures,
            &work,
            Some((&work.join("trainer"), "default")),
            300,
        )?;
        ratios.push(traced_step / untraced_step);
    }
    let (ratio_low, ratio_high) = (
        ratios.iter().copied().fold(f64::INFINITY, f64::min),
        ratios.iter().copied().fold(0.0, f64::max),
    );
    let long = work.join("trainer-full");
    trainer_step_ns(&agent, &fixtures, &work, Some((&long, "full")), 2000)?;
    let (trainer_events, trainer_report_s) = report_speed(
        &agent,
        &long.join("recording.nctr"),
        &work.join("report-trainer"),
    )?;
    let (_, caller_report_s) = report_speed(&agent, &recording, &work.join("report-caller"))?;
    let (merge_s, merge_kb) = merge_speed(&agent, &long.join("recording.nctr"), &work)?;
    // Python frames walked by bpf_loop, by the unrolled loop, and off, interleaved, three
    // of each: medians.
    let (mut on, mut unrolled, mut off) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..3 {
        on.push(python_stack_cost(
            root,
            &agent,
            &fixtures,
            &work,
            "on",
            &[],
        )?);
        unrolled.push(python_stack_cost(
            root,
            &agent,
            &fixtures,
            &work,
            "unrolled",
            &[("python_loop = true", "python_loop = false")],
        )?);
        off.push(python_stack_cost(
            root,
            &agent,
            &fixtures,
            &work,
            "off",
            &[("python_frames = true", "python_frames = false")],
        )?);
    }
    let med = |runs: &[([f64; 2], f64)], i: usize| median(runs.iter().map(|r| r.0[i]).collect());
    let python_on = (
        [med(&on, 0), med(&on, 1)],
        median(on.iter().map(|r| r.1).collect()),
    );
    let python_unrolled = [med(&unrolled, 0), med(&unrolled, 1)];
    let python_off = [med(&off, 0), med(&off, 1)];

    let (bare, pair, traced, bpftrace) =
        (median(bare), median(pair), median(traced), median(bpftrace));
    let added = traced - bare;
    let entries_rounds: Vec<String> = entries_only
        .iter()
        .zip(&entries_lost)
        .map(|(ns, lost)| format!("{:.0} ({lost:.0} lost)", ns - bare))
        .collect();
    // The rounds whose agent lost no record: one that fell behind ran beside its own
    // disk writes (each call its own step, ~500 MB a run here), and its calls with them.
    let clean: Vec<f64> = entries_only
        .iter()
        .zip(&entries_lost)
        .filter(|(_, lost)| **lost == 0.0)
        .map(|(ns, _)| *ns)
        .collect();
    let clean_rounds = clean.len();
    let added_entries = if clean.is_empty() {
        median(entries_only)
    } else {
        median(clean)
    } - bare;
    println!(
        "\nnccltrace bench ({CALLS} ncclAllReduce(NULL comm) calls into the real libnccl.so.2, median of {PER_CALL_ROUNDS} rounds)"
    );
    println!("| measure | nccltrace | baseline | target |");
    println!("| --- | --- | --- | --- |");
    println!("| bare call | | {bare:.0} ns | |");
    println!(
        "| added cost per traced call | {added:.0} ns ({:.2}× the bare pair) | bare probe pair: {:.0} ns; bpftrace 0.17 histogram: {:.0} ns | ≤ 1.15× the bare pair, below bpftrace |",
        added / (pair - bare),
        pair - bare,
        bpftrace - bare
    );
    println!(
        "| added cost per traced call, minimal profile with `call_returns = \"needed\"` (collectives at entry only), steady state (after 1.5 s of calls) | {added_entries:.0} ns ({:.2}× bpftrace; median of {}; rounds {} ns) | bpftrace 0.17 histogram: {:.0} ns | ≤ 0.5× bpftrace (issue 22) |",
        added_entries / (bpftrace - bare),
        if clean_rounds == 0 {
            format!("all {PER_CALL_ROUNDS} rounds, every one lost records")
        } else {
            format!("the {clean_rounds} of {PER_CALL_ROUNDS} rounds that lost no record")
        },
        entries_rounds.join(", "),
        bpftrace - bare
    );
    println!(
        "| added cost per traced call, minimal profile (entry and return) | {:.2}× bpftrace | | |",
        added / (bpftrace - bare)
    );
    let floor = median(entry_floor) - bare;
    println!(
        "| an entry uprobe that only counts (bpftrace `count()`): the floor of a traced entry | | {floor:.0} ns ({:.2}× bpftrace's histogram) | |",
        floor / (bpftrace - bare)
    );
    println!("| attach, all probes, 473 MB library | {attach_ms:.0} ms | | ≤ 250 ms |");
    println!(
        "| context switches of processes nobody traces, agent attached elsewhere (default \
         profile): added a round trip of `pingpong` (two processes on one CPU: 2 switches \
         and 2 wake-ups) | raw scheduler tracepoints: +{:.0} ns | formatted tracepoints \
         (`raw_tracepoints = false`): +{:.0} ns; no agent: {switch_bare:.0} ns | |",
        switch_raw - switch_bare,
        switch_formatted - switch_bare
    );
    println!(
        "| `attach --duration 1s` on it, start to exit (outputs, probes released) | \
         {attach_wall_s:.2} s | | |"
    );
    println!(
        "| agent peak RSS, attach and a short run, the end included (default profile) | {:.1} MB | | ≤ 64 MB |",
        attach_rss_kb as f64 / 1024.0
    );
    println!(
        "| agent peak RSS of the whole run tracing {CALLS} calls (the end included) | {:.1} MB | | ≤ 64 MB (issue 18) |",
        rss_traced_kb as f64 / 1024.0
    );
    println!(
        "| demo trainer step, traced / untraced (default profile, median of {TRAINER_PAIRS} interleaved pairs of 300-step runs) | {:.3} (pairs {ratio_low:.3}–{ratio_high:.3}; last pair {:.3} ms / {:.3} ms) | | ≤ 1.02 |",
        median(ratios),
        traced_step / 1e6,
        untraced_step / 1e6
    );
    println!(
        "| agent CPU at 200k events/s | {:.1}% of a CPU | | |",
        median(cpu_at_200k)
    );
    println!(
        "| report, demo trainer recording (2000 steps, full profile) | {:.2} M events/s ({trainer_events:.0} events in {trainer_report_s:.2} s) | | ≥ 5 M/s (issue 18) |",
        trainer_events / trainer_report_s / 1e6
    );
    println!(
        "| report, caller recording ({events:.0} events, each call its own step) | {:.2} M events/s ({caller_report_s:.2} s) | | ≥ 2 M/s (issue 18) |",
        events / caller_report_s / 1e6
    );
    println!(
        "| merge, the trainer recording with a copy of itself as a second host ({:.0} events) | {:.2} M events/s ({merge_s:.2} s), peak RSS {:.1} MB | | |",
        2.0 * trainer_events,
        2.0 * trainer_events / merge_s / 1e6,
        merge_kb as f64 / 1024.0
    );
    for (what, i) in [("on-CPU sample", 0), ("CUDA sync entry stack", 1)] {
        println!(
            "| {what} of a CPython 3.11 thread, BPF program time per run (bpf_stats), python_frames on (bpf_loop walk) / on (unrolled walk, kernels before 5.17) / off | {:.0} ns / {:.0} ns / {:.0} ns (+{:.0} ns / +{:.0} ns, {:.1} Python frames a stack) | | |",
            python_on.0[i],
            python_unrolled[i],
            python_off[i],
            python_on.0[i] - python_off[i],
            python_unrolled[i] - python_off[i],
            python_on.1
        );
    }
    Ok(())
}

/// The pipe ping-pong of two untraced processes on one CPU (`pingpong`, ns a round trip),
/// without the agent, with it attached to the idle caller (default profile: raw scheduler
/// tracepoints where the kernel has them), and with a copy of the profile with
/// `raw_tracepoints = false`; interleaved, three rounds, medians.
fn untraced_switches(
    agent: &Path,
    fixtures: &Path,
    lib: &Path,
    go: &Path,
    work: &Path,
    root: &Path,
) -> anyhow::Result<(f64, f64, f64)> {
    let formatted = work.join("formatted.toml");
    std::fs::write(
        &formatted,
        std::fs::read_to_string(root.join("profiles/default.toml"))?
            .replace("raw_tracepoints = true", "raw_tracepoints = false"),
    )?;
    let pingpong = || -> anyhow::Result<f64> {
        let out = Command::new(fixtures.join("pingpong"))
            .arg("100000")
            .output()?;
        let text = String::from_utf8_lossy(&out.stdout);
        json(&text, "ns_per_round_trip").with_context(|| format!("pingpong said {text:?}"))
    };
    let (mut bare, mut raw, mut formatted_ns) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..3 {
        bare.push(pingpong()?);
        for (profile, into) in [
            (std::ffi::OsStr::new("default"), &mut raw),
            (formatted.as_os_str(), &mut formatted_ns),
        ] {
            let (child, lines) = caller(fixtures, lib, go)?;
            let out = work.join("switches");
            fresh(&out)?;
            let (mut a, err) = attached(
                on_cpu(agent, TRACER_CPU)
                    .args(["attach", "--force", "--profile"])
                    .arg(profile)
                    .arg("--pid")
                    .arg(child.id().to_string())
                    .arg("--out")
                    .arg(&out),
            )?;
            into.push(pingpong()?);
            libc_kill(a.id(), 2);
            for _ in err {}
            a.wait()?;
            finish(go, child, lines)?;
        }
    }
    Ok((median(bare), median(raw), median(formatted_ns)))
}

/// `nccltrace report` on `recording`: (events, seconds).
fn report_speed(agent: &Path, recording: &Path, out: &Path) -> anyhow::Result<(f64, f64)> {
    // The median of 5 reports, each into a fresh folder (one run moved by ±30% here).
    let mut times = Vec::new();
    for _ in 0..5 {
        let _ = std::fs::remove_dir_all(out);
        let started = Instant::now();
        super::run(
            Command::new(agent)
                .arg("report")
                .arg(recording)
                .arg("--out")
                .arg(out)
                .stdout(Stdio::null()),
        )?;
        times.push(started.elapsed().as_secs_f64());
    }
    let summary = std::fs::read_to_string(out.join("summary.json"))?;
    Ok((json(&summary, "events").unwrap_or(0.0), median(times)))
}

/// ns per call of the caller while bpftrace runs `script` on it.
fn bpftrace_cost(fixtures: &Path, lib: &Path, go: &Path, script: &str) -> anyhow::Result<f64> {
    let (child, lines) = caller(fixtures, lib, go)?;
    let mut b = on_cpu("bpftrace", TRACER_CPU)
        .args(["-p", &child.id().to_string(), "-e", script])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()?;
    let mut out_lines = BufReader::new(b.stdout.take().context("stdout")?).lines();
    wait_for(&mut out_lines, "Attaching")?;
    std::thread::sleep(Duration::from_millis(500));
    let ns = finish(go, child, lines)?;
    libc_kill(b.id(), 2);
    let _ = b.wait();
    Ok(ns)
}

/// Sends `sig` to `pid`, quietly: the process may have exited already.
fn libc_kill(pid: u32, sig: i32) {
    let _ = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .stderr(Stdio::null())
        .status();
}
