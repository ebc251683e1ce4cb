//! `cargo xtask man`: the man pages and shell completion scripts, made by the agent from its
//! own command-line definition, into `target/man/` and `target/completions/`.

use std::path::Path;
use std::process::Command;

use anyhow::{Context as _, bail};

pub fn run(root: &Path) -> anyhow::Result<()> {
    super::run(
        Command::new("cargo")
            .current_dir(root)
            .args(["build", "-q", "-p", "nccltrace"]),
    )?;
    let agent = root.join("target/debug/nccltrace");
    let man = root.join("target/man");
    super::run(Command::new(&agent).arg("man").arg("--out").arg(&man))?;
    let completions = root.join("target/completions");
    std::fs::create_dir_all(&completions)
        .with_context(|| format!("creating {}", completions.display()))?;
    for (shell, file) in [
        ("bash", "nccltrace.bash"),
        ("zsh", "_nccltrace"),
        ("fish", "nccltrace.fish"),
    ] {
        let out = Command::new(&agent)
            .args(["completions", shell])
            .output()
            .context("running nccltrace completions")?;
        if !out.status.success() || out.stdout.is_empty() {
            bail!("nccltrace completions {shell} failed: {out:?}");
        }
        let path = completions.join(file);
        std::fs::write(&path, out.stdout).with_context(|| format!("writing {}", path.display()))?;
    }
    eprintln!(
        "man pages in {} (man -l {}/nccltrace.1), completions in {}",
        man.display(),
        man.display(),
        completions.display()
    );
    Ok(())
}
