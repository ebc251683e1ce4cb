//! The `nccltrace` binary: parse, run, map errors to exit codes.

use std::process::ExitCode;

use clap::Parser as _;

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn"))
        .format_timestamp_micros()
        .init();
    let cli = nccltrace::cli::Cli::parse();
    match cli.run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            let message = err.to_string();
            nccltrace::note!("nccltrace: error: {message}");
            // Causes not already quoted in the message (verifier logs, syscall errors).
            let mut source = std::error::Error::source(&err);
            while let Some(cause) = source {
                let text = cause.to_string();
                if !message.contains(&text) {
                    nccltrace::note!("  caused by: {text}");
                }
                source = cause.source();
            }
            ExitCode::from(err.exit_code())
        }
    }
}
