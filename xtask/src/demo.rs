//! `cargo xtask demo`: the main job on the bundled demo trainer — start it, attach,
//! let it finish, print what nccltrace saw beside what the trainer says it did.

use std::io::{BufRead as _, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};

pub fn run(root: &Path) -> anyhow::Result<()> {
    if !super::setup::is_root() {
        bail!("nccltrace loads eBPF programs and needs root: run `sudo -E cargo xtask demo`");
    }
    let fixtures = super::build_fixtures(root)?;
    super::run(Command::new("cargo").current_dir(root).args([
        "build",
        "--release",
        "-p",
        "nccltrace",
    ]))?;
    let agent = root.join("target/release/nccltrace");
    let out = root.join("target/demo");
    let go = fixtures.join("demo.go");
    let _ = std::fs::remove_file(&go);

    eprintln!("demo: starting the demo trainer (40 steps)");
    let mut trainer = Command::new(fixtures.join("trainer"))
        .args(["--steps", "40", "--compute-us", "3000", "--go-file"])
        .arg(&go)
        .stdout(Stdio::piped())
        .spawn()
        .context("starting the demo trainer")?;
    let mut lines = BufReader::new(trainer.stdout.take().context("trainer stdout")?).lines();
    lines.next().context("the trainer printed nothing")??;

    eprintln!(
        "demo: nccltrace attach --pid {} --out {}",
        trainer.id(),
        out.display()
    );
    let mut agent = Command::new(&agent)
        .args(["attach", "--force", "--pid"])
        .arg(trainer.id().to_string())
        .arg("--out")
        .arg(&out)
        .stderr(Stdio::piped())
        .spawn()
        .context("starting nccltrace")?;
    let mut agent_err = BufReader::new(agent.stderr.take().context("agent stderr")?).lines();
    let started = Instant::now();
    loop {
        let Some(line) = agent_err.next() else {
            bail!("nccltrace exited before attaching")
        };
        let line = line?;
        eprintln!("{line}");
        if line.contains("attached to pid") {
            break;
        }
        if started.elapsed() > Duration::from_secs(60) {
            bail!("nccltrace did not attach within 60 s");
        }
    }
    std::fs::write(&go, b"").context("releasing the trainer")?;
    let truth = lines
        .map_while(Result::ok)
        .find(|l| l.contains("\"total\""))
        .unwrap_or_default();
    trainer.wait()?;
    for line in agent_err.map_while(Result::ok) {
        eprintln!("{line}");
    }
    let status = agent.wait()?;
    if !status.success() {
        bail!("nccltrace failed: {status}");
    }
    eprintln!("demo: the trainer's own count: {truth}");
    eprintln!("demo: outputs in {}", out.display());
    Ok(())
}
