//! `nccltrace completions SHELL` and the man pages (`cargo xtask man`): both made from the
//! command-line definition itself, so they cannot drift from it.

use std::io::Write;
use std::path::{Path, PathBuf};

use clap::CommandFactory as _;

use crate::Error;

#[derive(Debug, clap::Args)]
pub struct CompletionsArgs {
    /// The shell to complete for.
    shell: clap_complete::Shell,
}

#[derive(Debug, clap::Args)]
pub struct ManArgs {
    /// Folder to write nccltrace.1 and one page per subcommand into (made if missing).
    #[arg(long, short)]
    out: PathBuf,
}

/// Writes the completion script for `shell` to `out`.
pub fn completions(shell: clap_complete::Shell, out: &mut dyn Write) {
    clap_complete::generate(shell, &mut super::Cli::command(), "nccltrace", out);
}

#[allow(clippy::needless_pass_by_value)] // the parsed arguments end here
pub fn run_completions(args: CompletionsArgs) -> Result<(), Error> {
    let mut text = Vec::new();
    completions(args.shell, &mut text);
    match std::io::stdout().lock().write_all(&text) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(Error::Output {
            path: PathBuf::from("(standard output)"),
            source: e,
        }),
        _ => Ok(()),
    }
}

/// Writes `nccltrace.1` and `nccltrace-SUBCOMMAND.1` (the visible subcommands) into `dir`;
/// returns the files written.
pub fn man_pages(dir: &Path) -> Result<Vec<PathBuf>, Error> {
    let output = |path: &Path| {
        let path = path.to_owned();
        move |source| Error::Output { path, source }
    };
    std::fs::create_dir_all(dir).map_err(output(dir))?;
    let cmd = super::Cli::command();
    let mut pages = vec![("nccltrace".to_owned(), cmd.clone())];
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        let name = format!("nccltrace-{}", sub.get_name());
        pages.push((name.clone(), sub.clone().name(name)));
    }
    let mut written = Vec::new();
    for (name, page) in pages {
        let path = dir.join(format!("{name}.1"));
        let mut roff = Vec::new();
        clap_mangen::Man::new(page)
            .render(&mut roff)
            .map_err(output(&path))?;
        std::fs::write(&path, roff).map_err(output(&path))?;
        written.push(path);
    }
    Ok(written)
}

#[allow(clippy::needless_pass_by_value)] // the parsed arguments end here
pub fn run_man(args: ManArgs) -> Result<(), Error> {
    for path in man_pages(&args.out)? {
        crate::note!("nccltrace: wrote {}", path.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Completion scripts name every visible subcommand and attach's options; the man
    /// pages are roff with a page per subcommand, examples included.
    #[test]
    fn completions_and_man_pages() {
        for shell in [
            clap_complete::Shell::Bash,
            clap_complete::Shell::Zsh,
            clap_complete::Shell::Fish,
        ] {
            let mut out = Vec::new();
            completions(shell, &mut out);
            let text = String::from_utf8(out).unwrap();
            for word in ["attach", "report", "doctor", "snapshot", "pid", "step-nvtx"] {
                assert!(text.contains(word), "{shell}: no {word}");
            }
        }
        let dir = tempfile::tempdir().unwrap();
        let pages = man_pages(dir.path()).unwrap();
        let names: Vec<String> = pages
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        for name in ["nccltrace.1", "nccltrace-attach.1", "nccltrace-report.1"] {
            assert!(names.contains(&name.to_owned()), "{names:?}");
        }
        let attach = std::fs::read_to_string(dir.path().join("nccltrace-attach.1")).unwrap();
        assert!(attach.contains(".TH nccltrace-attach 1"), "{attach}");
        assert!(attach.contains("\\-\\-wait\\-for\\-nccl"));
        assert!(attach.contains("Examples"), "examples in the page");
    }
}
