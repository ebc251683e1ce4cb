//! A step's GPU, as NVML saw it. The agent reads each GPU the targets use while tracing
//! (`gpu_reading` records): NVML's utilization samples, each the share of its interval
//! (from the sample before it to itself) in which a kernel ran, and the clocks, power,
//! temperature, memory and clock-event (throttle) reasons. A step's `busy` is the
//! samples' shares weighed by how much of each interval lies inside the step; the
//! interval the samples cover (`from_ns`..`to_ns`) says how far that is the step's own
//! figure: a step shorter than NVML's sampling period gets the share of the window around
//! it.

use crate::event::GpuReading;
use serde::Serialize;

/// The utilization samples of the run's GPUs, trimmed as steps are attributed.
#[derive(Debug, Default)]
pub(crate) struct Readings {
    /// Per GPU (the records' index): (from, to, percent busy), in time order.
    busy: Vec<Vec<(u64, u64, u32)>>,
}

/// One GPU's share of a step.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct GpuStep {
    /// Index in summary.json's `gpus`.
    pub gpu: u32,
    /// The share of the time a kernel ran, in thousandths; written as a ratio, 0 to 1.
    #[serde(serialize_with = "ratio")]
    pub busy: u32,
    /// The samples it comes from, and the interval they cover (CLOCK_MONOTONIC ns): wider
    /// than the step where NVML samples less often than the steps come.
    pub samples: u32,
    pub from_ns: u64,
    pub to_ns: u64,
}

#[expect(
    clippy::trivially_copy_pass_by_ref,
    reason = "serde's serialize_with passes a reference"
)]
fn ratio<S: serde::Serializer>(per_mille: &u32, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(f64::from(*per_mille) / 1000.0)
}

impl Readings {
    /// A reading made at `to`.
    pub fn add(&mut self, to: u64, r: &GpuReading) {
        let Some((from, pct)) = r.busy else {
            return;
        };
        let gpu = r.gpu as usize;
        if gpu >= 64 || to <= from {
            return;
        }
        if self.busy.len() <= gpu {
            self.busy.resize(gpu + 1, Vec::new());
        }
        let v = &mut self.busy[gpu];
        // Records come in time order per GPU; a late one is put in its place.
        let at = v.partition_point(|s| s.1 <= to);
        v.insert(at, (from, to, pct.min(100)));
    }

    /// Each GPU's share of `[a, b)`, where samples overlap it.
    pub fn step(&self, a: u64, b: u64) -> Vec<GpuStep> {
        let mut out = Vec::new();
        for (gpu, v) in self.busy.iter().enumerate() {
            let lo = v.partition_point(|s| s.1 <= a);
            let (mut weight, mut busy, mut n, mut from, mut to) = (0u64, 0f64, 0u32, u64::MAX, 0);
            for &(f, t, pct) in v[lo..].iter().take_while(|s| s.0 < b) {
                let overlap = t.min(b).saturating_sub(f.max(a));
                if overlap == 0 {
                    continue;
                }
                weight += overlap;
                busy += overlap as f64 * f64::from(pct) / 100.0;
                n += 1;
                from = from.min(f);
                to = to.max(t);
            }
            if weight > 0 {
                out.push(GpuStep {
                    gpu: u32::try_from(gpu).unwrap_or(u32::MAX),
                    busy: (busy / weight as f64 * 1000.0).round() as u32,
                    samples: n,
                    from_ns: from,
                    to_ns: to,
                });
            }
        }
        out
    }

    /// Drops the samples that ended before `until`.
    pub fn trim(&mut self, until: u64) {
        for v in &mut self.busy {
            let before = v.partition_point(|s| s.1 <= until);
            v.drain(..before);
        }
    }
}

/// `samples` with each GPU's neighbours joined two by two (their shares weighed by their
/// lengths).
fn coarser(mut samples: Vec<GpuSample>) -> Vec<GpuSample> {
    samples.sort_unstable();
    let mut out: Vec<GpuSample> = Vec::with_capacity(samples.len() / 2 + 1);
    let mut pending: Option<GpuSample> = None;
    for s in samples {
        match pending.take() {
            Some(p) if p.0 == s.0 => {
                let (lp, ls) = (p.2.saturating_sub(p.1), s.2.saturating_sub(s.1));
                let pct = (u64::from(p.3) * lp + u64::from(s.3) * ls) / (lp + ls).max(1);
                out.push((p.0, p.1, s.2, u32::try_from(pct).unwrap_or(100)));
            }
            Some(p) => {
                out.push(p);
                pending = Some(s);
            }
            None => pending = Some(s),
        }
    }
    out.extend(pending);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(r: &mut Readings, from: u64, to: u64, pct: u32) {
        let reading = GpuReading {
            busy: Some((from, pct)),
            ..GpuReading::default()
        };
        r.add(to, &reading);
    }

    /// A step across two samples gets their shares weighed by its overlap with each; one
    /// inside a sample gets that sample's share and its whole interval.
    #[test]
    fn steps_weigh_the_samples_they_overlap() {
        let mut r = Readings::default();
        sample(&mut r, 0, 100, 100);
        sample(&mut r, 100, 200, 0);
        sample(&mut r, 200, 300, 50);
        let s = r.step(50, 200);
        assert_eq!(s.len(), 1);
        assert_eq!(s[0].busy, 333, "{s:?}");
        assert_eq!((s[0].samples, s[0].from_ns, s[0].to_ns), (2, 0, 200));
        let s = r.step(210, 220);
        assert_eq!((s[0].busy, s[0].samples, s[0].from_ns), (500, 1, 200));
        assert!(r.step(300, 400).is_empty());
        r.trim(200);
        assert_eq!(r.step(0, 400)[0].samples, 1);
    }

    /// Past the samples kept, neighbours join two by two, their shares weighed.
    #[test]
    fn samples_kept_for_the_trace_stay_bounded() {
        assert_eq!(
            coarser(vec![
                (0, 0, 10, 100),
                (1, 0, 10, 50),
                (0, 10, 40, 0),
                (0, 40, 50, 80)
            ]),
            vec![(0, 0, 40, 25), (0, 40, 50, 80), (1, 0, 10, 50)]
        );
        let mut t = Totals::default();
        let busy = |from: u64| GpuReading {
            busy: Some((from, 50)),
            ..GpuReading::default()
        };
        for i in 0..(MAX_SAMPLES as u64 + 10) {
            t.add(i * 10 + 10, &busy(i * 10));
        }
        let kept = t.take_samples();
        assert!(kept.len() <= MAX_SAMPLES / 2 + 11, "{}", kept.len());
        assert_eq!(kept.first().map(|s| s.1), Some(0));
        assert!(kept.iter().all(|s| s.3 == 50));
    }
}

/// NVML's clock-event (throttle) reasons, by bit.
pub const CLOCK_EVENT_REASONS: [(u64, &str); 9] = [
    (0x1, "gpu_idle"),
    (0x2, "applications_clocks_setting"),
    (0x4, "sw_power_cap"),
    (0x8, "hw_slowdown"),
    (0x10, "sync_boost"),
    (0x20, "sw_thermal_slowdown"),
    (0x40, "hw_thermal_slowdown"),
    (0x80, "hw_power_brake_slowdown"),
    (0x100, "display_clock_setting"),
];

/// The run's figures of one GPU (summary.json's `gpus.read`).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct GpuTotal {
    pub index: u32,
    pub name: String,
    pub uuid: String,
    /// The share of the sampled time a kernel ran, 0 to 1 (`None`: no sample).
    pub busy: Option<f64>,
    pub busy_samples: u64,
    /// The time the samples cover, ns.
    pub sampled_ns: u64,
    pub sm_clock_mhz_min: Option<u32>,
    pub sm_clock_mhz_max: Option<u32>,
    pub power_w_mean: Option<f64>,
    pub temperature_c_max: Option<u32>,
    pub memory_used_bytes_max: Option<u64>,
    /// The most processes NVML listed on the GPU at once (every job's, not only the
    /// targets').
    pub processes_max: Option<u32>,
    /// Every clock-event (throttle) reason any reading had, by NVML's names (`None`: not
    /// read).
    pub clock_event_reasons: Option<Vec<&'static str>>,
}

/// The run's GPU readings, summed as they arrive, and the utilization samples for
/// trace.json's counter tracks.
#[derive(Debug, Default)]
pub(crate) struct Totals {
    gpus: Vec<Acc>,
    samples: Vec<GpuSample>,
}

/// One utilization sample: (GPU, from, to, percent busy), CLOCK_MONOTONIC ns.
pub type GpuSample = (u32, u64, u64, u32);

/// Samples kept for the trace; past this, neighbours of a GPU are joined two by two
/// (a run of hours keeps its shape at half the resolution, and so on).
const MAX_SAMPLES: usize = 200_000;

#[derive(Clone, Debug, Default)]
struct Acc {
    busy_ns: f64,
    sampled_ns: u64,
    samples: u64,
    sm: Option<(u32, u32)>,
    power: (u64, u64),
    temperature: Option<u32>,
    memory: Option<u64>,
    processes: Option<u32>,
    throttle: Option<u64>,
}

impl Totals {
    /// A reading made at `to`.
    pub fn add(&mut self, to: u64, r: &GpuReading) {
        let gpu = r.gpu as usize;
        if gpu >= 64 {
            return;
        }
        if self.gpus.len() <= gpu {
            self.gpus.resize(gpu + 1, Acc::default());
        }
        let a = &mut self.gpus[gpu];
        if let Some((from, pct)) = r.busy.filter(|(from, _)| *from < to) {
            a.busy_ns += (to - from) as f64 * f64::from(pct.min(100)) / 100.0;
            a.sampled_ns += to - from;
            a.samples += 1;
            if self.samples.len() >= MAX_SAMPLES {
                self.samples = coarser(std::mem::take(&mut self.samples));
            }
            self.samples.push((r.gpu, from, to, pct.min(100)));
        }
        if let Some(mhz) = r.sm_clock_mhz {
            let (lo, hi) = a.sm.unwrap_or((mhz, mhz));
            a.sm = Some((lo.min(mhz), hi.max(mhz)));
        }
        if let Some(mw) = r.power_mw {
            a.power = (a.power.0 + u64::from(mw), a.power.1 + 1);
        }
        a.temperature = a.temperature.max(r.temperature_c);
        a.memory = a.memory.max(r.memory_used);
        a.processes = a.processes.max(r.processes);
        if let Some(t) = r.throttle {
            a.throttle = Some(a.throttle.unwrap_or(0) | t);
        }
    }

    /// The utilization samples kept, by GPU and time.
    pub fn take_samples(&mut self) -> Vec<GpuSample> {
        let mut v = std::mem::take(&mut self.samples);
        v.sort_unstable();
        v
    }

    /// Each GPU of `gpus` (the recording header's) with its figures.
    pub fn report(&self, gpus: &[crate::record::GpuInfo]) -> Vec<GpuTotal> {
        gpus.iter()
            .enumerate()
            .map(|(i, info)| {
                let a = self.gpus.get(i).cloned().unwrap_or_default();
                GpuTotal {
                    index: u32::try_from(i).unwrap_or(u32::MAX),
                    name: info.name.clone(),
                    uuid: info.uuid.clone(),
                    busy: (a.sampled_ns > 0)
                        .then(|| (a.busy_ns / a.sampled_ns as f64 * 1000.0).round() / 1000.0),
                    busy_samples: a.samples,
                    sampled_ns: a.sampled_ns,
                    sm_clock_mhz_min: a.sm.map(|s| s.0),
                    sm_clock_mhz_max: a.sm.map(|s| s.1),
                    power_w_mean: (a.power.1 > 0)
                        .then(|| (a.power.0 as f64 / a.power.1 as f64).round() / 1000.0),
                    temperature_c_max: a.temperature,
                    memory_used_bytes_max: a.memory,
                    processes_max: a.processes,
                    clock_event_reasons: a.throttle.map(|t| {
                        CLOCK_EVENT_REASONS
                            .iter()
                            .filter(|(bit, _)| t & bit != 0)
                            .map(|(_, name)| *name)
                            .collect()
                    }),
                }
            })
            .collect()
    }
}
