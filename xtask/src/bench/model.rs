//! `cargo xtask bench --cost`: the agent's cost model against the wall clock, in many short
//! interleaved traced and untraced windows of one trainer.

use std::io::{BufRead as _, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};

use anyhow::{Context as _, bail};

use super::{json, median, wait_for};

/// `cargo xtask bench --cost`: the cost model (summary.json agent.bpf) against the wall
/// clock on the demo trainer, where the wall clock can resolve it: `pairs` interleaved
/// untraced / traced runs of 300 steps (default profile); the measured cost a step is the
/// traced mean step less the untraced one of the same pair, the predicted one the traced
/// run's `traced_total_per_step_ns`.
pub fn cost(root: &Path, pairs: usize, profile: &str) -> anyhow::Result<()> {
    if !crate::setup::is_root() {
        bail!("the benchmarks load eBPF programs: run `sudo -E cargo xtask bench --cost`");
    }
    if pairs < 3 {
        bail!("--pairs {pairs}: at least 3 pairs are needed for a median and its interval");
    }
    let fixtures = crate::build_fixtures(root)?;
    let (agent, work) = crate::release_agent(root, "bench-cost")?;
    let out = work.join("trainer");
    let (mut ratios, mut measured, mut predicted) = (Vec::new(), Vec::new(), Vec::new());
    for pair in 1..=pairs {
        let untraced = trainer_step_ns(&agent, &fixtures, &work, None, 300)?;
        let traced = trainer_step_ns(&agent, &fixtures, &work, Some((&out, profile)), 300)?;
        let summary: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("summary.json"))?)?;
        let bpf = &summary["agent"]["bpf"];
        let model = bpf["traced_total_per_step_ns"].as_f64().with_context(|| {
            format!(
                "no agent.bpf.traced_total_per_step_ns: {}",
                summary["agent"]
            )
        })?;
        eprintln!(
            "bench: pair {pair}/{pairs}: untraced {:.1} µs, traced {:.1} µs a step; predicted \
             cost {:.1} µs",
            untraced / 1e3,
            traced / 1e3,
            model / 1e3
        );
        ratios.push(traced / untraced);
        measured.push(traced - untraced);
        predicted.push(model);
    }
    let (low, high) = median_interval(&ratios);
    let (m, p) = (median(measured.clone()), median(predicted.clone()));
    let (m_low, m_high) = median_interval(&measured);
    println!(
        "\nnccltrace cost model on the demo trainer (profile {profile}, {pairs} interleaved pairs of 300-step runs)"
    );
    println!("| measure | value |");
    println!("| --- | --- |");
    println!(
        "| step time, traced / untraced: median (95% interval of the median) | {:.4} ({low:.4}–{high:.4}) |",
        median(ratios.clone())
    );
    println!(
        "| measured cost a step (traced − untraced step, median, 95% interval) | {:.1} µs ({:.1}–{:.1}) |",
        m / 1e3,
        m_low / 1e3,
        m_high / 1e3
    );
    println!(
        "| predicted cost a step (summary.json agent.bpf traced_total_per_step_ns, median) | {:.1} µs |",
        p / 1e3
    );
    println!("| predicted / measured | {:.2} |", p / m);
    Ok(())
}

/// The 95% interval of the median of `v` from order statistics (binomial, normal
/// approximation): distribution-free.
pub(super) fn median_interval(v: &[f64]) -> (f64, f64) {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len() as f64;
    let half = 1.96 * n.sqrt() / 2.0;
    let low = ((n / 2.0 - half).floor().max(0.0)) as usize;
    let high = ((n / 2.0 + half).ceil() as usize).min(v.len() - 1);
    (v[low], v[high])
}

/// Mean step wall time of the demo trainer (steps after the fifth), traced into
/// `(out, profile)` when given.
pub(super) fn trainer_step_ns(
    agent: &Path,
    fixtures: &Path,
    work: &Path,
    traced: Option<(&Path, &str)>,
    steps: u32,
) -> anyhow::Result<f64> {
    let go = work.join("trainer-go");
    let _ = std::fs::remove_file(&go);
    let mut trainer = Command::new(fixtures.join("trainer"))
        .args([
            "--steps",
            &steps.to_string(),
            "--compute-us",
            "2000",
            "--go-file",
        ])
        .arg(&go)
        .stdout(Stdio::piped())
        .spawn()
        .context("starting the trainer")?;
    let mut lines = BufReader::new(trainer.stdout.take().context("stdout")?).lines();
    lines.next().context("the trainer printed nothing")??;
    let mut agent_child = None;
    if let Some((out, profile)) = traced {
        let _ = std::fs::remove_dir_all(out);
        let mut a = Command::new(agent)
            .args([
                "attach",
                "--profile",
                profile,
                "--pid",
                &trainer.id().to_string(),
                "--out",
            ])
            .arg(out)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()?;
        let mut err = BufReader::new(a.stderr.take().context("stderr")?).lines();
        wait_for(&mut err, "attached to pid")?;
        std::thread::spawn(move || for _ in err {});
        agent_child = Some(a);
    }
    std::fs::write(&go, b"")?;
    let walls: Vec<f64> = lines
        .map_while(Result::ok)
        .filter(|l| l.starts_with("{\"step\""))
        .filter_map(|l| json(&l, "wall_ns"))
        .skip(5)
        .collect();
    trainer.wait()?;
    if let Some(mut a) = agent_child
        && !a.wait()?.success()
    {
        bail!("nccltrace failed on the trainer");
    }
    if walls.is_empty() {
        bail!("the trainer printed no steps");
    }
    Ok(walls.iter().sum::<f64>() / walls.len() as f64)
}
