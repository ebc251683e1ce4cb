//! `nccltrace doctor`: the placement checklist, live or from a snapshot.

use std::path::PathBuf;

use crate::Error;
use crate::host::Host;

#[derive(Debug, clap::Args)]
pub struct DoctorArgs {
    /// The rank to check (its threads, memory, GPUs and environment).
    #[arg(long, short)]
    pid: Option<u32>,
    /// Read DIR/proc and DIR/sys (a `nccltrace snapshot`) instead of the live host.
    #[arg(long)]
    root: Option<PathBuf>,
    /// Print doctor.json instead of the report.
    #[arg(long)]
    json: bool,
}

#[allow(clippy::needless_pass_by_value)] // the parsed arguments end here
pub fn run(args: DoctorArgs) -> Result<(), Error> {
    let host = match &args.root {
        Some(root) if !root.join("proc").is_dir() && !root.join("sys").is_dir() => {
            return Err(Error::InvalidArgument {
                what: "--root",
                value: root.display().to_string(),
                expected: "a folder holding proc/ and sys/ (made by `nccltrace snapshot`)",
            });
        }
        Some(root) => Host::at(root),
        None => Host::live(),
    };
    if let Some(pid) = args.pid
        && !host.path(&format!("proc/{pid}")).is_dir()
    {
        return Err(Error::InvalidArgument {
            what: "--pid",
            value: pid.to_string(),
            expected: "a running process (or one captured in --root)",
        });
    }
    let report = crate::doctor::diagnose(&host, args.pid);
    let stdout = &mut std::io::stdout().lock();
    let written = if args.json {
        crate::doctor::write_json(&report, stdout)
    } else {
        crate::doctor::write_text(&report, stdout)
    };
    match written {
        // `doctor | head`: the reader went away; nothing is lost.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {}
        other => other.map_err(|source| Error::Output {
            path: PathBuf::from("-"),
            source,
        })?,
    }
    let unreadable = &report.topology.unreadable;
    if let Some(example) = unreadable.first() {
        return Err(Error::Unreadable {
            command: "doctor",
            count: unreadable.len(),
            example: format!("/{example}"),
            consequence: "the findings above are partial".into(),
        });
    }
    Ok(())
}
