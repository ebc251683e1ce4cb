//! `cargo xtask bench`: the agent's cost, measured beside its baselines in one run, on the
//! real libnccl.so.2 of the nvidia-nccl-cu12 wheel (docs/benchmarks.md).

use std::io::{BufRead as _, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};

const CALLS: &str = "300000";

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
    let _ = std::fs::remove_file(go);
    let mut child = Command::new(fixtures.join("nccl_caller"))
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
    super::run(Command::new("cargo").current_dir(root).args([
        "build",
        "--release",
        "-q",
        "-p",
        "nccltrace",
    ]))?;
    let agent = root.join("target/release/nccltrace");
    let work = root.join("target/bench");
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work)?;
    let go = work.join("go");

    let mut bare = Vec::new();
    let mut traced = Vec::new();
    let mut bpftrace = Vec::new();
    let mut attach_ms = Vec::new();
    let mut rss_kb = 0u64;
    let mut recording = PathBuf::new();
    for round in 0..3 {
        // Bare call.
        let (child, lines) = caller(&fixtures, &lib, &go)?;
        bare.push(finish(&go, child, lines)?);
        // nccltrace, minimal profile (NCCL and scheduler probes).
        let (child, lines) = caller(&fixtures, &lib, &go)?;
        let out = work.join(format!("run{round}"));
        let mut a = Command::new(&agent)
            .args([
                "attach",
                "--profile",
                "minimal",
                "--pid",
                &child.id().to_string(),
                "--out",
            ])
            .arg(&out)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()?;
        let mut err = BufReader::new(a.stderr.take().context("stderr")?).lines();
        wait_for(&mut err, "attached to pid")?;
        traced.push(finish(&go, child, lines)?);
        for _ in err.by_ref() {}
        if !a.wait()?.success() {
            bail!("nccltrace failed");
        }
        let summary = std::fs::read_to_string(out.join("summary.json"))?;
        attach_ms.push(json(&summary, "attach_ms").unwrap_or(0.0));
        rss_kb = rss_kb.max(json(&summary, "peak_rss_kb").unwrap_or(0.0) as u64);
        recording = out.join("recording.nctr");
        // bpftrace: entry/exit latency histogram of the same function.
        let (child, lines) = caller(&fixtures, &lib, &go)?;
        let l = lib.display();
        let script = format!(
            "uprobe:{l}:ncclAllReduce {{ @s[tid] = nsecs; }} \
             uretprobe:{l}:ncclAllReduce /@s[tid]/ {{ @lat = hist(nsecs - @s[tid]); delete(@s[tid]); }}"
        );
        let mut b = Command::new("bpftrace")
            .args(["-p", &child.id().to_string(), "-e", &script])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()?;
        let mut out_lines = BufReader::new(b.stdout.take().context("stdout")?).lines();
        wait_for(&mut out_lines, "Attaching")?;
        std::thread::sleep(Duration::from_millis(500));
        bpftrace.push(finish(&go, child, lines)?);
        libc_kill(b.id(), 2);
        let _ = b.wait();
    }
    // report throughput on the last recording.
    let summary = std::fs::read_to_string(recording.with_file_name("summary.json"))?;
    let events = json(&summary, "events").unwrap_or(0.0);
    let started = Instant::now();
    super::run(
        Command::new(&agent)
            .arg("report")
            .arg(&recording)
            .arg("--out")
            .arg(work.join("report"))
            .stdout(Stdio::null()),
    )?;
    let report_s = started.elapsed().as_secs_f64();

    let (bare, traced, bpftrace) = (median(bare), median(traced), median(bpftrace));
    println!(
        "\nnccltrace bench ({CALLS} ncclAllReduce(NULL comm) calls into the real libnccl.so.2, median of 3 rounds)"
    );
    println!("| measure | nccltrace | baseline | target |");
    println!("| --- | --- | --- | --- |");
    println!("| bare call | | {bare:.0} ns | |");
    println!(
        "| added cost per traced call | {:.0} ns | bpftrace 0.17 histogram: {:.0} ns | below bpftrace |",
        traced - bare,
        bpftrace - bare
    );
    println!(
        "| attach, all probes, 473 MB library | {:.0} ms | | ≤ 250 ms |",
        median(attach_ms)
    );
    println!(
        "| agent peak RSS | {:.1} MB | | ≤ 64 MB |",
        rss_kb as f64 / 1024.0
    );
    println!(
        "| report | {:.2} M events/s ({events:.0} events in {report_s:.2} s) | | ≥ 2 M/s |",
        events / report_s / 1e6
    );
    Ok(())
}

fn libc_kill(pid: u32, sig: i32) {
    let _ = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status();
}
