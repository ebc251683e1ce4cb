//! The cargo fuzz targets in `fuzz/`: a short run in `cargo xtask test`, a longer one in
//! `cargo xtask soak`. Seeds come from the stored H200 recordings, so the fuzzer starts
//! from real records; the corpus lives in `target/fuzz-corpus` between runs.

use std::path::Path;
use std::process::Command;

use anyhow::Context as _;

/// The targets (fuzz/fuzz_targets/*.rs).
pub const TARGETS: [&str; 2] = ["recording", "proc_parsers"];

/// Runs each target for `seconds`.
pub fn run(root: &Path, seconds: u32) -> anyhow::Result<()> {
    super::setup::cargo_fuzz()?;
    for target in TARGETS {
        let corpus = root.join("target/fuzz-corpus").join(target);
        std::fs::create_dir_all(&corpus)
            .with_context(|| format!("creating {}", corpus.display()))?;
        if target == "recording" {
            seed_recordings(root, &corpus)?;
        }
        eprintln!("fuzz: {target} for {seconds} s");
        super::run(
            Command::new("cargo")
                .current_dir(root)
                .args(["+nightly", "fuzz", "run", "--sanitizer", "none", target])
                .arg(&corpus)
                .args([
                    "--",
                    &format!("-max_total_time={seconds}"),
                    "-max_len=65536",
                    // A unit this slow is a hang worth a report.
                    "-timeout=30",
                    // The decoder's salvage warnings would drown libFuzzer's own lines.
                    "-close_fd_mask=2",
                    "-print_final_stats=1",
                ]),
        )?;
    }
    Ok(())
}

/// The first 64 KiB of each stored recording (a damaged tail is part of what is tested).
fn seed_recordings(root: &Path, corpus: &Path) -> anyhow::Result<()> {
    for entry in std::fs::read_dir(root.join("tests/data/h200"))? {
        let path = entry?.path();
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        let Some(stem) = name.strip_suffix(".nctr.xz") else {
            continue;
        };
        let seed = corpus.join(format!("seed-{stem}"));
        if seed.exists() {
            continue;
        }
        let out = Command::new("xz")
            .arg("-dc")
            .arg(&path)
            .output()
            .context("xz (cargo xtask setup installs xz-utils)")?;
        std::fs::write(&seed, &out.stdout[..out.stdout.len().min(65536)])?;
    }
    Ok(())
}
