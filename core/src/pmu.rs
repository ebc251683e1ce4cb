//! `remote_memory`, measured: PMU memory sampling, as `perf mem` does it. Intel's PEBS
//! load-latency event (`mem-loads`, every Nth load slower than `ldlat` cycles) and AMD's
//! IBS op sampling write, per sampled load, the thread, the time, the load's latency in
//! core cycles (`PERF_SAMPLE_WEIGHT`) and where it was served from
//! (`PERF_SAMPLE_DATA_SRC`: cache level, local or remote DRAM). A step's remote-memory
//! stall is then Σ latency × period over the rank thread's remote-DRAM samples in the
//! step, converted to time at the CPU's base frequency — an upper end, since loads that
//! overlap are each counted whole.
//!
//! Here: which sampler the host has (or why none: most VMs have no PMU), the records'
//! layout and their classification, and a step's figure from its samples.

use std::path::Path;

use perf_event_open_sys::bindings as sys;

/// Where the kernel lists its PMUs.
pub const DEVICES: &str = "/sys/bus/event_source/devices";

/// The load-latency threshold in core cycles (perf mem's default): a local DRAM load
/// takes ~80–100 ns, far above it, so every DRAM load qualifies.
pub const LDLAT_CYCLES: u64 = 30;

/// One sampled load in this many qualifying loads: a memory-bound thread makes ~10⁸ a
/// second, so at most ~5,000 samples a second a thread (a PEBS sample costs about a
/// microsecond: under 0.5% at that rate).
pub const SAMPLE_PERIOD: u64 = 20_000;

/// What the samples carry: thread, time, latency, data source.
pub const SAMPLE_TYPE: u64 = sys::PERF_SAMPLE_TID as u64
    | sys::PERF_SAMPLE_TIME as u64
    | sys::PERF_SAMPLE_WEIGHT as u64
    | sys::PERF_SAMPLE_DATA_SRC as u64;

/// The hardware sampler of memory loads this host offers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemSampler {
    /// `cpu` / `cpu_core` (Intel PEBS) or `ibs_op` (AMD IBS).
    pub pmu: String,
    /// `perf_event_attr.type`, `config` and `config1` of the event.
    pub pmu_type: u32,
    pub config: u64,
    pub config1: u64,
    /// One sample in this many events ([`SAMPLE_PERIOD`] loads).
    pub period: u64,
    /// `perf_event_attr.precise_ip`: 2 for PEBS, 0 for IBS (precise by nature).
    pub precise_ip: u8,
}

impl MemSampler {
    /// How the samples are taken, for `methods.remote_memory`.
    #[must_use]
    pub fn describe(&self) -> String {
        match self.pmu.as_str() {
            "ibs_op" => "AMD IBS op sampling (ibs_op)".to_owned(),
            "cpu" | "cpu_core" => format!(
                "Intel PEBS load latency ({}/mem-loads, ldlat={LDLAT_CYCLES})",
                self.pmu
            ),
            other => format!("the {other} PMU's event {:#x}", self.config),
        }
    }
}

/// The memory sampler under `devices` (`/sys/bus/event_source/devices`), or why there
/// is none.
///
/// # Errors
/// The reason no sampler can be opened, naming what the host lacks.
pub fn detect(devices: &Path) -> Result<MemSampler, String> {
    for pmu in ["cpu_core", "cpu"] {
        let dir = devices.join(pmu);
        let Ok(event) = std::fs::read_to_string(dir.join("events/mem-loads")) else {
            continue;
        };
        let pmu_type = read_type(&dir)?;
        let (config, config1) = encode(&dir, event.trim())?;
        return Ok(MemSampler {
            pmu: pmu.to_owned(),
            pmu_type,
            config,
            config1,
            period: SAMPLE_PERIOD,
            precise_ip: 2,
        });
    }
    let ibs = devices.join("ibs_op");
    if ibs.is_dir() {
        return Ok(MemSampler {
            pmu: "ibs_op".to_owned(),
            pmu_type: read_type(&ibs)?,
            config: 0,
            config1: 0,
            period: SAMPLE_PERIOD,
            precise_ip: 0,
        });
    }
    let mut present: Vec<String> = std::fs::read_dir(devices)
        .map_err(|e| format!("no PMU: cannot list {}: {e}", devices.display()))?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    present.sort();
    let why = if present.iter().any(|p| p == "cpu" || p == "cpu_core") {
        "the CPU's PMU has no mem-loads event (no PEBS load latency on this CPU, or the \
         hypervisor hides it)"
    } else {
        "the kernel registered no hardware CPU PMU (usual in a VM without a virtual PMU; \
         dmesg says \"no PMU driver, software events only\")"
    };
    Err(format!(
        "no PMU memory sampling: {} has neither cpu/events/mem-loads (Intel PEBS) nor \
         ibs_op (AMD IBS), only {}; {why}",
        devices.display(),
        present.join(", ")
    ))
}

fn read_type(dir: &Path) -> Result<u32, String> {
    let path = dir.join("type");
    std::fs::read_to_string(&path)
        .ok()
        .and_then(|t| t.trim().parse().ok())
        .ok_or_else(|| format!("no PMU memory sampling: {} is unreadable", path.display()))
}

/// `config` and `config1` of an event string such as `event=0xcd,umask=0x1,ldlat=3`,
/// each term placed where the PMU's `format/<term>` file says (`config:0-7`,
/// `config1:0-15`); `ldlat` is set to [`LDLAT_CYCLES`].
fn encode(dir: &Path, event: &str) -> Result<(u64, u64), String> {
    let mut config = [0u64; 2];
    let mut terms: Vec<(String, u64)> = Vec::new();
    for term in event.split(',').map(str::trim).filter(|t| !t.is_empty()) {
        let (name, value) = term.split_once('=').unwrap_or((term, "1"));
        let value = parse_number(value)
            .ok_or_else(|| format!("no PMU memory sampling: {event:?} has a bad term {term:?}"))?;
        terms.push((name.to_owned(), value));
    }
    if dir.join("format/ldlat").is_file() {
        terms.retain(|(n, _)| n != "ldlat");
        terms.push(("ldlat".to_owned(), LDLAT_CYCLES));
    }
    for (name, value) in terms {
        let path = dir.join("format").join(&name);
        let format = std::fs::read_to_string(&path)
            .map_err(|e| format!("no PMU memory sampling: {} ({e})", path.display()))?;
        let (field, ranges) = format
            .trim()
            .split_once(':')
            .ok_or_else(|| format!("no PMU memory sampling: {} says {format:?}", path.display()))?;
        let slot = match field {
            "config" => 0,
            "config1" => 1,
            _ => {
                return Err(format!(
                    "no PMU memory sampling: {name} goes in {field}, which nccltrace does not set"
                ));
            }
        };
        let mut rest = value;
        for range in ranges.split(',') {
            let (lo, hi) = range.split_once('-').unwrap_or((range, range));
            let (Ok(lo), Ok(hi)) = (lo.parse::<u32>(), hi.parse::<u32>()) else {
                return Err(format!(
                    "no PMU memory sampling: {} says {format:?}",
                    path.display()
                ));
            };
            if hi < lo || hi > 63 {
                return Err(format!(
                    "no PMU memory sampling: {} says {format:?}",
                    path.display()
                ));
            }
            let width = hi - lo + 1;
            let mask = if width == 64 {
                u64::MAX
            } else {
                (1u64 << width) - 1
            };
            config[slot] |= (rest & mask) << lo;
            rest = rest.checked_shr(width).unwrap_or(0);
        }
    }
    Ok((config[0], config[1]))
}

fn parse_number(s: &str) -> Option<u64> {
    match s.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => s.parse().ok(),
    }
}

/// One sampled load.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemSample {
    pub pid: u32,
    pub tid: u32,
    pub time_ns: u64,
    /// The load's latency in core cycles.
    pub weight: u32,
    pub data_src: u64,
}

/// Where a sampled load was served from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Served {
    /// A cache (any level, local or a remote node's), or the fill buffer.
    Cache,
    LocalDram,
    RemoteDram,
    /// The PMU did not say (or an I/O / uncached access).
    Unknown,
}

/// The level of a sampled access from its `perf_mem_data_src`; `None` when it was not a
/// load.
#[must_use]
pub fn served(data_src: u64) -> Option<Served> {
    let field = |shift: u32, bits: u32| (data_src >> shift) & ((1 << bits) - 1);
    let op = field(sys::PERF_MEM_OP_SHIFT, 5);
    if op & u64::from(sys::PERF_MEM_OP_LOAD) == 0 {
        return None;
    }
    let lvl = field(sys::PERF_MEM_LVL_SHIFT, 14);
    let lvl_num = field(sys::PERF_MEM_LVLNUM_SHIFT, 4);
    let remote = field(sys::PERF_MEM_REMOTE_SHIFT, 1) == u64::from(sys::PERF_MEM_REMOTE_REMOTE);
    let has = |bit: u32| lvl & u64::from(bit) != 0;
    // The newer encoding (level number + remote bit) where the PMU fills it, else the
    // older level bits.
    if lvl_num == u64::from(sys::PERF_MEM_LVLNUM_RAM) {
        return Some(if remote {
            Served::RemoteDram
        } else {
            Served::LocalDram
        });
    }
    if (1..=u64::from(sys::PERF_MEM_LVLNUM_L4)).contains(&lvl_num)
        || lvl_num == u64::from(sys::PERF_MEM_LVLNUM_ANY_CACHE)
        || lvl_num == u64::from(sys::PERF_MEM_LVLNUM_LFB)
        || lvl_num == u64::from(sys::PERF_MEM_LVLNUM_L2_MHB)
    {
        return Some(Served::Cache);
    }
    Some(if !has(sys::PERF_MEM_LVL_HIT) {
        Served::Unknown
    } else if has(sys::PERF_MEM_LVL_REM_RAM1) || has(sys::PERF_MEM_LVL_REM_RAM2) {
        Served::RemoteDram
    } else if has(sys::PERF_MEM_LVL_LOC_RAM) {
        Served::LocalDram
    } else if has(sys::PERF_MEM_LVL_L1)
        || has(sys::PERF_MEM_LVL_LFB)
        || has(sys::PERF_MEM_LVL_L2)
        || has(sys::PERF_MEM_LVL_L3)
        || has(sys::PERF_MEM_LVL_REM_CCE1)
        || has(sys::PERF_MEM_LVL_REM_CCE2)
    {
        Served::Cache
    } else {
        Served::Unknown
    })
}

/// What a perf ring's records held.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Records {
    pub samples: Vec<MemSample>,
    /// Samples the kernel dropped because the ring was full (`PERF_RECORD_LOST`).
    pub lost: u64,
    /// Records too short for their type: the stream is damaged from there on.
    pub damaged: bool,
}

/// The records of a perf ring's data, read in order (`perf_event_header` then the
/// body), for events opened with [`SAMPLE_TYPE`]; other record types are skipped.
#[must_use]
pub fn parse_records(mut data: &[u8]) -> Records {
    let mut out = Records::default();
    while data.len() >= 8 {
        let kind = u32::from_ne_bytes([data[0], data[1], data[2], data[3]]);
        let size = usize::from(u16::from_ne_bytes([data[6], data[7]]));
        if size < 8 || size > data.len() {
            out.damaged = true;
            break;
        }
        let body = &data[8..size];
        let u64_at = |at: usize| -> Option<u64> {
            Some(u64::from_ne_bytes(body.get(at..at + 8)?.try_into().ok()?))
        };
        match kind {
            sys::PERF_RECORD_SAMPLE => {
                // pid, tid (u32 each), time, weight, data_src: the order of the
                // sample_type bits.
                let sample = (|| {
                    let pid = u32::from_ne_bytes(body.get(0..4)?.try_into().ok()?);
                    let tid = u32::from_ne_bytes(body.get(4..8)?.try_into().ok()?);
                    let weight = u64_at(16)?;
                    Some(MemSample {
                        pid,
                        tid,
                        time_ns: u64_at(8)?,
                        // The latency is the weight's low 32 bits (var1_dw of the
                        // weight struct on CPUs that fill more).
                        weight: u32::try_from(weight & u64::from(u32::MAX)).unwrap_or(u32::MAX),
                        data_src: u64_at(24)?,
                    })
                })();
                let Some(sample) = sample else {
                    out.damaged = true;
                    break;
                };
                out.samples.push(sample);
            }
            sys::PERF_RECORD_LOST => out.lost += u64_at(8).unwrap_or(0),
            _ => {}
        }
        data = &data[size..];
    }
    out
}

/// A step's remote-memory figure from the rank thread's samples.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MeasuredStep {
    /// Sampled loads served from DRAM, and those from a remote node's.
    pub dram_samples: u64,
    pub remote_samples: u64,
    /// Σ latency × period of the remote-DRAM samples, in core cycles.
    pub remote_cycles: u64,
}

impl MeasuredStep {
    /// The remote fraction of the sampled DRAM loads.
    #[must_use]
    pub fn share(&self) -> Option<f64> {
        (self.dram_samples > 0).then(|| self.remote_samples as f64 / self.dram_samples as f64)
    }

    /// The stall in ns at `khz` (the CPU's base frequency).
    #[must_use]
    pub fn stall_ns(&self, khz: u64) -> Option<u64> {
        (khz > 0).then(|| {
            u64::try_from(u128::from(self.remote_cycles) * 1_000_000 / u128::from(khz))
                .unwrap_or(u64::MAX)
        })
    }
}

impl serde::Serialize for MeasuredStep {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap as _;
        let mut map = serializer.serialize_map(Some(4))?;
        map.serialize_entry("dram_samples", &self.dram_samples)?;
        map.serialize_entry("remote_samples", &self.remote_samples)?;
        map.serialize_entry("share", &self.share().map(|s| (s * 1e4).round() / 1e4))?;
        map.serialize_entry("remote_cycles", &self.remote_cycles)?;
        map.end()
    }
}

/// The samples (sorted by time) of `[a, b)`, each standing for `period` loads.
#[must_use]
pub fn measure(samples: &[MemSample], a: u64, b: u64, period: u64) -> MeasuredStep {
    measure_where(samples, a, b, period, |_| true)
}

/// [`measure`] over the samples `keep` chooses.
#[must_use]
pub fn measure_where(
    samples: &[MemSample],
    a: u64,
    b: u64,
    period: u64,
    keep: impl Fn(&MemSample) -> bool,
) -> MeasuredStep {
    let lo = samples.partition_point(|s| s.time_ns < a);
    let hi = samples.partition_point(|s| s.time_ns < b).max(lo);
    let mut step = MeasuredStep::default();
    for s in samples[lo..hi].iter().filter(|s| keep(s)) {
        match served(s.data_src) {
            Some(Served::LocalDram) => step.dram_samples += 1,
            Some(Served::RemoteDram) => {
                step.dram_samples += 1;
                step.remote_samples += 1;
                step.remote_cycles += u64::from(s.weight) * period;
            }
            _ => {}
        }
    }
    step
}

/// The CPU's base frequency in kHz: cpufreq's `base_frequency` (intel_pstate), else
/// `cpuinfo_max_freq`, else /proc/cpuinfo's `cpu MHz`.
#[must_use]
pub fn cpu_khz() -> Option<u64> {
    let cpufreq = Path::new("/sys/devices/system/cpu/cpu0/cpufreq");
    ["base_frequency", "cpuinfo_max_freq"]
        .iter()
        .find_map(|f| {
            std::fs::read_to_string(cpufreq.join(f))
                .ok()?
                .trim()
                .parse()
                .ok()
        })
        .or_else(|| {
            let info = std::fs::read_to_string("/proc/cpuinfo").ok()?;
            let mhz: f64 = info
                .lines()
                .find(|l| l.starts_with("cpu MHz"))?
                .split(':')
                .nth(1)?
                .trim()
                .parse()
                .ok()?;
            Some((mhz * 1000.0) as u64)
        })
}

#[cfg(test)]
mod tests;
