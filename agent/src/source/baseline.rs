//! The benchmarks' baseline (`nccltrace bench-pair`, hidden): the bare uprobe/uretprobe
//! pair of the kernel programs on one function, one 8-byte record per call with the
//! default wake-up, drained until the target exits. What the agent's own probes cost is
//! compared with this in the same run (`cargo xtask bench`).

use std::path::Path;
use std::time::Duration;

use aya::maps::RingBuf;
use aya::programs::UProbe;
use aya::programs::uprobe::{UProbeAttachLocation, UProbeAttachPoint, UProbeScope};
use tokio::io::unix::AsyncFd;

use super::{PROGRAMS, SourceError, discover, load_program, map_error, missing_map, program_error};
use crate::host::Host;

/// Attaches the pair to `symbol` in `library` for `pid`; returns the records drained by
/// the time `pid` exits.
pub async fn bare_pair(pid: u32, library: &Path, symbol: &str) -> Result<u64, crate::Error> {
    let site = discover::resolve(library, &[symbol], discover::Tables::Dynamic)
        .ok()
        .and_then(|mut found| found.remove(symbol))
        .ok_or_else(|| crate::Error::InvalidArgument {
            what: "--library",
            value: format!("{} ({symbol})", library.display()),
            expected: "an ELF library exporting --symbol",
        })?;
    let mut ebpf = aya::EbpfLoader::new()
        .load(PROGRAMS)
        .map_err(|e| SourceError::Load(Box::new(e)))?;
    let place = format!("{}:{symbol}", library.display());
    for name in ["bench_entry", "bench_return"] {
        let prog: &mut UProbe = load_program(&mut ebpf, name)?;
        let point = UProbeAttachPoint {
            location: UProbeAttachLocation::AbsoluteOffset(site.file_offset),
            cookie: None,
        };
        let scope = UProbeScope::OneProcess(std::num::NonZeroU32::new(pid).ok_or(
            crate::Error::InvalidArgument {
                what: "--pid",
                value: pid.to_string(),
                expected: "a running process",
            },
        )?);
        prog.attach(point, library, scope)
            .map_err(|e| program_error(name, &place, e))?;
    }
    let ring = RingBuf::try_from(
        ebpf.take_map(nccltrace_common::names::EVENTS[0])
            .ok_or_else(|| missing_map(nccltrace_common::names::EVENTS[0]))?,
    )
    .map_err(map_error(nccltrace_common::names::EVENTS[0]))?;
    // SAFETY: the RingBuf owns its map fd, open until the AsyncFd that owns it is dropped.
    let mut ring = unsafe { AsyncFd::register_with_interest(ring, tokio::io::Interest::READABLE) }
        .map_err(|e| SourceError::Drain(e.into()))?;
    crate::note!("nccltrace bench-pair: attached to pid {pid} at {place}");
    let host = Host::live();
    let mut records = 0u64;
    let mut poll = tokio::time::interval(Duration::from_millis(100));
    loop {
        while ring.get_mut().next().is_some() {
            records += 1;
        }
        tokio::select! {
            guard = ring.readable_mut() => guard.map_err(SourceError::Drain)?.clear_ready(),
            _ = poll.tick() => if !host.process_alive(pid) {
                break;
            },
        }
    }
    while ring.get_mut().next().is_some() {
        records += 1;
    }
    Ok(records)
}
