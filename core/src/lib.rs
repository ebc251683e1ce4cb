//! nccltrace's pure core: everything after the kernel, the same on a live run and on
//! `nccltrace report` — the event model and its decoding, the recording format, attribution
//! (steps, categories, ranks), the outputs (summary, steps, trace, flamegraphs) and
//! symbolization from what the recording carries, and the parsers of the /proc, /sys and
//! tracefs texts the agent reads.
//!
//! No eBPF and no root here: the `nccltrace` crate (cli, `source`, `doctor`, `host`)
//! loads the programs and feeds this crate; the fuzz targets and `report` need only this.

pub mod attribute;
pub mod decode;
pub mod event;
pub mod nccl_code;
pub mod pipeline;
pub mod pmu;
pub mod procfs;
pub mod python;
pub mod record;
pub mod render;
pub mod summary;
pub mod symbolize;

/// As `eprintln!`, but a closed stderr (`nccltrace … 2>&1 | head`) is ignored instead of
/// panicking: what is still to be written to files must not be lost for a message.
#[macro_export]
macro_rules! note {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}
