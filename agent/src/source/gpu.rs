//! The GPUs the targets use, read through NVML on a thread of the agent's own: the
//! driver's `libnvidia-ml.so.1` loaded at run time (`NCCLTRACE_NVML` names another file),
//! started while the probes attach so that attaching takes no longer. Each GPU's
//! utilization samples (NVML keeps a buffer of them, each the share of the interval since
//! the one before in which a kernel ran), read every [`GPU_EVERY`]; clocks, temperature,
//! power, memory and clock-event reasons every [`GPU_STATE_EVERY`]. Each reading is a
//! `GPU_READING` record.

use std::ffi::OsString;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::time::{Duration, Instant};

use nccltrace_common::{GpuReadingEvent, gpu as bit, kind};
use nccltrace_core::record::GpuInfo;
use nvml_wrapper::Nvml;
use nvml_wrapper::enum_wrappers::device::{Clock, Sampling, TemperatureSensor};
use nvml_wrapper::enums::device::SampleValue;
use nvml_wrapper::error::NvmlError;

use super::{agent_record, host};

/// How often the utilization samples are read.
pub const GPU_EVERY: Duration = Duration::from_millis(100);
/// How often the clocks, power, temperature, memory and clock-event reasons are read.
const GPU_STATE_EVERY: Duration = Duration::from_secs(1);
/// How long stopping waits for the reader's last read.
const FINISH_WAIT: Duration = Duration::from_millis(500);
/// How long attaching waits for NVML to answer which GPUs there are.
const OPEN_WAIT: Duration = Duration::from_secs(3);

/// What the reader found: the GPUs it reads and how they were chosen, or why none.
pub type Found = Result<(Vec<GpuInfo>, String), String>;

/// The reader thread: what it found, then its records. Dropping it stops the thread.
pub(super) struct GpuReader {
    found: Option<Receiver<Found>>,
    pub records: Receiver<Vec<u8>>,
    stop: Sender<()>,
}

impl GpuReader {
    /// Starts the reader for the GPUs `pids` have open (every GPU where none has one).
    pub fn start(pids: Vec<u32>) -> GpuReader {
        let (found_tx, found) = channel();
        let (tx, records) = channel();
        let (stop, stopped) = channel::<()>();
        let spawned = std::thread::Builder::new()
            .name("nccltrace-gpu".to_owned())
            .spawn(move || {
                let opened = open(&pids);
                let (nvml, chosen) = match opened {
                    Ok((nvml, infos, how, chosen)) => {
                        let _ = found_tx.send(Ok((infos, how)));
                        (nvml, chosen)
                    }
                    Err(why) => {
                        let _ = found_tx.send(Err(why));
                        return;
                    }
                };
                read(&nvml, &chosen, &tx, &stopped);
            });
        if let Err(e) = spawned {
            log::warn!("cannot start the GPU reader: {e}");
        }
        GpuReader {
            found: Some(found),
            records,
            stop,
        }
    }

    /// Stops the reader: its last read (the samples since the one before) is handed on
    /// within [`FINISH_WAIT`], or left out.
    pub fn finish(self) -> Vec<Vec<u8>> {
        let GpuReader { records, stop, .. } = self;
        drop(stop);
        let until = Instant::now() + FINISH_WAIT;
        let mut out = Vec::new();
        while let Some(left) = until.checked_duration_since(Instant::now()) {
            match records.recv_timeout(left) {
                Ok(r) => out.push(r),
                Err(_) => break,
            }
        }
        out
    }

    /// The GPUs read and how they were chosen, or why none is: waits for NVML's answer
    /// up to [`OPEN_WAIT`]. Once.
    pub fn found(&mut self) -> Found {
        let Some(found) = self.found.take() else {
            return Err("asked twice".to_owned());
        };
        match found.recv_timeout(OPEN_WAIT) {
            Ok(found) => found,
            Err(RecvTimeoutError::Timeout) => Err(format!(
                "NVML did not answer within {} s",
                OPEN_WAIT.as_secs()
            )),
            Err(RecvTimeoutError::Disconnected) => Err("the GPU reader stopped".to_owned()),
        }
    }
}

/// NVML loaded and the GPUs chosen: (NVML, each GPU's identity, how they were chosen,
/// their NVML indices).
fn open(pids: &[u32]) -> Result<(Nvml, Vec<GpuInfo>, String, Vec<u32>), String> {
    let lib: OsString =
        std::env::var_os("NCCLTRACE_NVML").unwrap_or_else(|| "libnvidia-ml.so.1".into());
    let nvml = Nvml::builder().lib_path(&lib).init().map_err(|e| {
        format!(
            "NVML could not be opened ({}: {e}); no NVIDIA driver on this host?",
            lib.to_string_lossy()
        )
    })?;
    let count = nvml
        .device_count()
        .map_err(|e| format!("NVML counted no GPU: {e}"))?;
    let used = opened_minors(pids);
    let mut infos = Vec::new();
    let mut chosen = Vec::new();
    let mut all = Vec::new();
    for i in 0..count {
        let Ok(d) = nvml.device_by_index(i) else {
            continue;
        };
        let info = GpuInfo {
            name: d.name().unwrap_or_default(),
            uuid: d.uuid().unwrap_or_default(),
            minor: d.minor_number().ok(),
        };
        if info.minor.is_some_and(|m| used.contains(&m)) {
            infos.push(info.clone());
            chosen.push(i);
        }
        all.push((i, info));
    }
    let how = if chosen.is_empty() {
        infos = all.iter().map(|a| a.1.clone()).collect();
        chosen = all.iter().map(|a| a.0).collect();
        "every GPU: no target had a /dev/nvidiaN open when attached".to_owned()
    } else {
        format!("the GPUs the targets had open (/dev/nvidia{used:?})")
    };
    if chosen.is_empty() {
        return Err("NVML found no GPU".to_owned());
    }
    Ok((nvml, infos, how, chosen))
}

/// The N of every `/dev/nvidiaN` the processes have open.
fn opened_minors(pids: &[u32]) -> Vec<u32> {
    let mut minors = Vec::new();
    for pid in pids {
        let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            let Ok(to) = std::fs::read_link(fd.path()) else {
                continue;
            };
            let minor = to
                .to_str()
                .and_then(|p| p.strip_prefix("/dev/nvidia"))
                .and_then(|n| n.parse::<u32>().ok());
            if let Some(m) = minor.filter(|m| !minors.contains(m)) {
                minors.push(m);
            }
        }
    }
    minors.sort_unstable();
    minors
}

/// Reads the `chosen` GPUs until `stopped`, sending each reading as a record.
fn read(nvml: &Nvml, chosen: &[u32], tx: &Sender<Vec<u8>>, stopped: &Receiver<()>) {
    // Per GPU: the newest sample read (µs, CLOCK_REALTIME), and the utilization read at
    // the last poll where NVML keeps no samples.
    // The first sample read starts the series (its own interval began before).
    let mut last_seen: Vec<Option<u64>> = vec![None; chosen.len()];
    let mut polled: Vec<Option<u64>> = vec![None; chosen.len()];
    let mut state_at = Instant::now();
    let mut first = true;
    let mut last = false;
    loop {
        let state = first || state_at.elapsed() >= GPU_STATE_EVERY;
        if state {
            state_at = Instant::now();
        }
        first = false;
        // CLOCK_REALTIME µs to CLOCK_MONOTONIC ns.
        let mono = host::clock_ns(libc::CLOCK_MONOTONIC);
        let offset = host::clock_ns(libc::CLOCK_REALTIME) as i64 - mono as i64;
        let to_mono = |us: u64| (us as i64 * 1000 - offset).max(0) as u64;
        for (slot, &index) in chosen.iter().enumerate() {
            let Ok(d) = nvml.device_by_index(index) else {
                continue;
            };
            let gpu = u32::try_from(slot).unwrap_or(u32::MAX);
            let mut out = Vec::new();
            match d.samples(Sampling::GpuUtilization, last_seen[slot].unwrap_or(0)) {
                Ok(samples) => {
                    let mut samples: Vec<(u64, u32)> = samples
                        .into_iter()
                        .map(|s| (s.timestamp, percent(&s.value)))
                        .collect();
                    samples.sort_unstable();
                    if last_seen[slot].is_none() {
                        // Only the newest of those NVML kept from before: the start.
                        samples.drain(..samples.len().saturating_sub(1));
                    }
                    for (ts, pct) in samples {
                        let Some(prev) = last_seen[slot].filter(|p| ts > *p) else {
                            last_seen[slot] = last_seen[slot].max(Some(ts));
                            continue;
                        };
                        last_seen[slot] = Some(ts);
                        let mut r = reading(to_mono(ts), gpu);
                        r.present |= bit::BUSY;
                        (r.busy_from_ns, r.busy_pct) = (to_mono(prev), pct);
                        out.push(r);
                    }
                }
                // No sample newer than the last one read.
                Err(NvmlError::NotFound) => {}
                // No sample buffer: the utilization over NVML's last period, dated now
                // and taken as covering the time since the last poll.
                Err(_) => {
                    if let Ok(u) = d.utilization_rates() {
                        if let Some(from) = polled[slot] {
                            let mut r = reading(mono, gpu);
                            r.present |= bit::BUSY;
                            (r.busy_from_ns, r.busy_pct) = (from, u.gpu);
                            out.push(r);
                        }
                        polled[slot] = Some(mono);
                    }
                }
            }
            if state {
                out.push(state_reading(&d, gpu));
            }
            for r in out {
                if tx.send(crate::decode::as_bytes(&r)).is_err() {
                    return;
                }
            }
        }
        if last {
            return;
        }
        // Told to stop (or the agent gone): one more read, of the samples since.
        last = !matches!(
            stopped.recv_timeout(GPU_EVERY),
            Err(RecvTimeoutError::Timeout)
        );
    }
}

/// The GPU's clocks, temperature, power, clock-event reasons, memory used and compute
/// processes, as read now: those NVML answered.
fn state_reading(d: &nvml_wrapper::Device<'_>, gpu: u32) -> GpuReadingEvent {
    let mut r = reading(host::clock_ns(libc::CLOCK_MONOTONIC), gpu);
    let mut present = 0;
    let mut set = |b: u32, v: Option<u32>| {
        present |= if v.is_some() { b } else { 0 };
        v.unwrap_or(0)
    };
    r.sm_clock_mhz = set(bit::SM_CLOCK, d.clock_info(Clock::SM).ok());
    r.mem_clock_mhz = set(bit::MEM_CLOCK, d.clock_info(Clock::Memory).ok());
    r.temperature_c = set(bit::TEMPERATURE, d.temperature(TemperatureSensor::Gpu).ok());
    r.power_mw = set(bit::POWER, d.power_usage().ok());
    r.processes = set(bit::PROCESSES, d.running_compute_processes_count().ok());
    r.present |= present;
    if let Ok(t) = d.current_throttle_reasons() {
        r.present |= bit::THROTTLE;
        r.throttle = t.bits();
    }
    if let Ok(m) = d.memory_info() {
        r.present |= bit::MEMORY_USED;
        r.memory_used = m.used;
    }
    r
}

fn reading(ts_ns: u64, gpu: u32) -> GpuReadingEvent {
    GpuReadingEvent {
        hdr: agent_record(ts_ns, 0, 0, kind::GPU_READING),
        gpu,
        ..GpuReadingEvent::default()
    }
}

/// A utilization sample's value in percent.
fn percent(v: &SampleValue) -> u32 {
    let p = match *v {
        SampleValue::U32(p) => u64::from(p),
        SampleValue::U64(p) => p,
        SampleValue::I64(p) => p.max(0).unsigned_abs(),
        SampleValue::F64(p) => p.max(0.0) as u64,
    };
    u32::try_from(p.min(100)).unwrap_or(100)
}
