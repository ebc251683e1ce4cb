//! `nccltrace snapshot`: capture the files `doctor` reads, for a diagnosis elsewhere.

use std::path::PathBuf;

use crate::Error;
use crate::host::Host;

#[derive(Debug, clap::Args)]
pub struct SnapshotArgs {
    /// The rank to capture.
    #[arg(long, short)]
    pid: Option<u32>,
    /// Folder to write proc/ and sys/ into (refused if it exists, unless --force).
    #[arg(long, short)]
    out: PathBuf,
    /// Write into --out even if it exists.
    #[arg(long)]
    force: bool,
}

#[allow(clippy::needless_pass_by_value)] // the parsed arguments end here
pub fn run(args: SnapshotArgs) -> Result<(), Error> {
    let host = Host::live();
    if let Some(pid) = args.pid
        && !host.process_alive(pid)
    {
        return Err(Error::InvalidArgument {
            what: "--pid",
            value: pid.to_string(),
            expected: "a running process",
        });
    }
    let mut dir = super::OutDir::create(&args.out, args.force)?;
    let out = dir.path.clone();
    let (n, unreadable) =
        crate::doctor::snapshot(&host, args.pid, &out).map_err(|e| Error::Output {
            path: out.clone(),
            source: std::io::Error::other(e.to_string()),
        })?;
    dir.keep();
    if let Some(example) = unreadable.first() {
        return Err(Error::Unreadable {
            command: "snapshot",
            count: unreadable.len(),
            example: format!("/{example}"),
            consequence: format!("the {n} files in {} are a partial capture", out.display()),
        });
    }
    crate::note!(
        "nccltrace: {n} files captured in {}; diagnose with `nccltrace doctor --root {}{}`",
        out.display(),
        out.display(),
        args.pid.map(|p| format!(" --pid {p}")).unwrap_or_default()
    );
    Ok(())
}
