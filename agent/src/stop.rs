//! Stop requests: the signals that end a run, with a wrapper's repeats folded into one.
//!
//! `timeout -s INT`, `srun` and shells forward a signal both to the agent and to its
//! process group, so one request arrives two or three times within milliseconds. The first
//! signal stops tracing; any signal within [`REPEAT_WINDOW`] of it is the same request. A
//! signal after that is a user insisting: the agent exits at once, but only after the
//! recording's closing record is on disk (it is written as soon as tracing stops), and it
//! prints the command that rebuilds the outputs from the recording.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};

/// Signals this close to the first one are the same request (a wrapper's copy).
pub const REPEAT_WINDOW: Duration = Duration::from_secs(1);

/// How long a forced exit waits for the closing record to reach the disk.
const CLOSE_WAIT: Duration = Duration::from_secs(10);

/// What a forced exit needs to know of the run.
#[derive(Default)]
struct Shared {
    /// Set once the recording exists: from then on a forced exit closes it first.
    tracing: AtomicBool,
    /// Set once the recording holds its closing record.
    closed: AtomicBool,
    /// The command that rebuilds every output from the recording.
    rebuild: Mutex<Option<String>>,
    /// Set once every output is written: a forced exit then is a success.
    outputs_complete: AtomicBool,
}

/// Watches SIGINT, SIGTERM and SIGHUP for the rest of the process's life.
pub struct Stop {
    first: tokio::sync::watch::Receiver<Option<&'static str>>,
    shared: Arc<Shared>,
}

/// The signal's name as the summary's stop reason says it.
fn name(signal: i32) -> &'static str {
    match signal {
        SIGINT => "SIGINT",
        SIGTERM => "SIGTERM",
        _ => "SIGHUP",
    }
}

/// The exit code of a process ended by `signal` (named as [`Stop::requested`] names it):
/// 128 + its number, as shells report it.
#[must_use]
pub fn exit_code(signal: &str) -> u8 {
    let number = match signal {
        "SIGINT" => SIGINT,
        "SIGTERM" => SIGTERM,
        _ => SIGHUP,
    };
    128 + number as u8
}

impl Stop {
    /// Takes over the three signals (their default action, ending the process, no longer
    /// applies) and starts the thread that judges them.
    pub fn install() -> std::io::Result<Stop> {
        let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGHUP])?;
        let (tx, first) = tokio::sync::watch::channel(None);
        let shared = Arc::new(Shared::default());
        let watched = Arc::clone(&shared);
        std::thread::Builder::new()
            .name("nccltrace-signals".into())
            .spawn(move || {
                let mut first_at: Option<Instant> = None;
                for signal in signals.forever() {
                    match first_at {
                        None => {
                            first_at = Some(Instant::now());
                            let _ = tx.send(Some(name(signal)));
                        }
                        Some(at) if at.elapsed() < REPEAT_WINDOW => {}
                        Some(_) => forced_exit(&watched, signal),
                    }
                }
            })?;
        Ok(Stop { first, shared })
    }

    /// Resolves with the first signal's name.
    pub async fn requested(&mut self) -> &'static str {
        loop {
            if let Some(name) = *self.first.borrow_and_update() {
                return name;
            }
            if self.first.changed().await.is_err() {
                // The watching thread is gone: no signal will come.
                std::future::pending::<()>().await;
            }
        }
    }

    /// The signal that asked the run to stop, if one did.
    #[must_use]
    pub fn signalled(&self) -> Option<&'static str> {
        *self.first.borrow()
    }

    /// The recording exists: a forced exit from now on waits for its closing record.
    pub fn tracing_started(&self) {
        self.shared.tracing.store(true, Ordering::SeqCst);
    }

    /// The recording holds its closing record; `rebuild` is the command that makes every
    /// output from it.
    pub fn recording_closed(&self, rebuild: String) {
        if let Ok(mut slot) = self.shared.rebuild.lock() {
            *slot = Some(rebuild);
        }
        self.shared.closed.store(true, Ordering::SeqCst);
    }

    /// Every output is written: a signal from now on ends the process with success.
    pub fn outputs_complete(&self) {
        self.shared.outputs_complete.store(true, Ordering::SeqCst);
    }
}

/// A signal well after the first: exit now, once the recording is closed.
fn forced_exit(shared: &Shared, signal: i32) -> ! {
    if shared.outputs_complete.load(Ordering::SeqCst) {
        crate::note!(
            "nccltrace: {} again: exiting; every output was already written (the kernel \
             finishes releasing the probes as the process ends)",
            name(signal)
        );
        std::process::exit(0);
    }
    if !shared.tracing.load(Ordering::SeqCst) {
        crate::note!(
            "nccltrace: {} again: stopped before tracing began; nothing was traced",
            name(signal)
        );
        std::process::exit(128 + signal);
    }
    let waited = Instant::now();
    if !shared.closed.load(Ordering::SeqCst) {
        crate::note!(
            "nccltrace: {} again: closing the recording first",
            name(signal)
        );
    }
    while !shared.closed.load(Ordering::SeqCst) && waited.elapsed() < CLOSE_WAIT {
        std::thread::sleep(Duration::from_millis(10));
    }
    let rebuild = shared.rebuild.lock().ok().and_then(|r| r.clone());
    if let (true, Some(cmd)) = (shared.closed.load(Ordering::SeqCst), rebuild) {
        crate::note!(
            "nccltrace: stopped at once by a second {}: the recording is complete, the other \
             outputs are not; rebuild them with:\n  {cmd}",
            name(signal)
        );
    } else {
        crate::note!(
            "nccltrace: stopped at once by a second {}; the recording could not be closed \
             within {} s: `nccltrace report` reads the records it holds",
            name(signal),
            CLOSE_WAIT.as_secs()
        );
    }
    std::process::exit(128 + signal);
}

/// `text` as one shell word.
#[must_use]
pub fn shell_word(text: &str) -> String {
    let plain = !text.is_empty()
        && text
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "/._-+=:,@%".contains(c));
    if plain {
        text.to_owned()
    } else {
        format!("'{}'", text.replace('\'', r"'\''"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Paths are quoted for the shell only when they need it, and quotes survive.
    #[test]
    fn shell_words() {
        assert_eq!(shell_word("run1/recording.nctr"), "run1/recording.nctr");
        assert_eq!(shell_word("my run/r.nctr"), "'my run/r.nctr'");
        assert_eq!(shell_word("it's"), r"'it'\''s'");
        assert_eq!(shell_word(""), "''");
    }
}
