//! `nccltrace report REC --out DIR`: every output again, from a recording, without root.

use std::path::PathBuf;

use crate::Error;

#[derive(Debug, clap::Args)]
pub struct ReportArgs {
    /// A recording.nctr written by `nccltrace attach`.
    recording: PathBuf,
    /// Folder for the outputs.
    #[arg(long, short)]
    out: PathBuf,
    /// Write into --out even if it exists.
    #[arg(long)]
    force: bool,
}

#[allow(clippy::needless_pass_by_value)] // the parsed arguments end here
pub fn run(args: ReportArgs) -> Result<(), Error> {
    let summary = crate::pipeline::replay(&args.recording)?;
    let out = super::prepare_output(&args.out, args.force)?;
    crate::pipeline::write_outputs(&out, &summary, &mut std::io::stdout().lock()).map_err(
        |source| Error::Output {
            path: out.clone(),
            source,
        },
    )
}
