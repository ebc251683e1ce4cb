//! Series read at each scrape: the node's NUMA allocation counters and InfiniBand ports,
//! the agent's own CPU and memory, and what the agent sets as it runs (lost events, doctor
//! findings, targets).

use std::sync::{Arc, Mutex};

use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric as _};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Unit;

use super::State;
use crate::host::Host;

#[derive(Debug)]
pub(super) struct Collector {
    pub host: Host,
    pub state: Arc<Mutex<State>>,
}

type Labels = Vec<(&'static str, String)>;

/// One metric family of counters or gauges (`f64` values), written only when it has
/// samples.
fn family(
    encoder: &mut DescriptorEncoder,
    kind: MetricType,
    name: &str,
    help: &str,
    unit: Option<&Unit>,
    samples: &[(Labels, f64)],
) -> Result<(), std::fmt::Error> {
    if samples.is_empty() {
        return Ok(());
    }
    let mut family = encoder.encode_descriptor(name, help, unit, kind)?;
    for (labels, value) in samples {
        let metric = family.encode_family(labels)?;
        match kind {
            MetricType::Counter => ConstCounter::new(*value).encode(metric)?,
            _ => ConstGauge::new(*value).encode(metric)?,
        }
    }
    Ok(())
}

/// The node's NUMA allocation counters (`numa_hit`, `numa_miss`, …), in pages, per node.
pub(super) fn numastat(host: &Host) -> Vec<(Labels, f64)> {
    host.numastat()
        .into_iter()
        .flat_map(|(node, counters)| {
            counters.into_iter().map(move |(stat, value)| {
                (
                    vec![("node", node.to_string()), ("stat", stat)],
                    value as f64,
                )
            })
        })
        .collect()
}

/// An InfiniBand port's readings.
#[derive(Debug, Default, PartialEq)]
pub(super) struct IbPorts {
    /// 1 when the port is ACTIVE.
    pub up: Vec<(Labels, f64)>,
    pub rate_bytes: Vec<(Labels, f64)>,
    /// Data moved, bytes (the port counts 4-byte words).
    pub data_bytes: Vec<(Labels, f64)>,
    /// Every other counter of `counters/`, by name.
    pub counters: Vec<(Labels, f64)>,
    /// Every counter of the adapter's `hw_counters/`, by name.
    pub hw_counters: Vec<(Labels, f64)>,
}

/// Files of `hw_counters/` that are settings, not counts.
const HW_SETTINGS: [&str; 1] = ["lifespan"];

/// Every port of every InfiniBand device under `sys/class/infiniband`.
pub(super) fn infiniband(host: &Host) -> IbPorts {
    let mut out = IbPorts::default();
    for name in host.ib_ports() {
        let dir = Host::ib_port_dir(&name);
        let (device, port) = name.split_once('/').unwrap_or((&name, ""));
        let labels = vec![("device", device.to_owned()), ("port", port.to_owned())];
        if let Some(state) = host.read(&format!("{dir}/state")) {
            // "4: ACTIVE"
            let active = state.split(':').nth(1).map(str::trim) == Some("ACTIVE");
            out.up.push((labels.clone(), f64::from(u8::from(active))));
        }
        // "200 Gb/sec (4X HDR)"
        if let Some(gbits) = host
            .read(&format!("{dir}/rate"))
            .and_then(|r| r.split_whitespace().next()?.parse::<f64>().ok())
        {
            out.rate_bytes.push((labels.clone(), gbits * 1e9 / 8.0));
        }
        // `counters/` (the IBA PortCounters: data moved in a family of its own), then the
        // adapter's `hw_counters/` (its settings left out).
        for (folder, pma) in [("counters", true), ("hw_counters", false)] {
            for counter in host.list(&format!("{dir}/{folder}")) {
                if !pma && HW_SETTINGS.contains(&counter.as_str()) {
                    continue;
                }
                let Some(value) = host.ib_value(&format!("{dir}/{folder}/{counter}")) else {
                    continue;
                };
                let direction = match (pma, counter.as_str()) {
                    (true, "port_xmit_data") => Some("transmit"),
                    (true, "port_rcv_data") => Some("receive"),
                    _ => None,
                };
                let mut l = labels.clone();
                if let Some(d) = direction {
                    l.push(("direction", d.to_owned()));
                    out.data_bytes.push((l, value as f64 * 4.0));
                } else {
                    l.push(("counter", counter));
                    let family = if pma {
                        &mut out.counters
                    } else {
                        &mut out.hw_counters
                    };
                    family.push((l, value as f64));
                }
            }
        }
    }
    out
}

/// The agent's CPU time (s) and resident and peak memory (bytes).
fn agent_self(host: &Host) -> Option<(f64, f64, f64)> {
    let pid = std::process::id();
    let stat = host.read(&format!("proc/{pid}/stat"))?;
    // After the command name (which may hold spaces): state is field 3, utime 14, stime 15.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks: f64 = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    // SAFETY: a plain sysconf query.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    let bytes = |key: &str| Some(host.status_kb(pid, key)? as f64 * 1024.0);
    Some((ticks / hz, bytes("VmRSS")?, bytes("VmHWM")?))
}

impl prometheus_client::collector::Collector for Collector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        self.agent(&mut encoder)?;
        let gpus = self
            .state
            .lock()
            .map(|s| s.gpus.clone())
            .unwrap_or_default();
        gpu_series(&gpus, &mut encoder)?;
        node(&self.host, &mut encoder)
    }
}

/// One GPU's series as last read through NVML (DCGM's figures, in Prometheus units).
#[derive(Clone, Debug, Default)]
pub(crate) struct GpuSeries {
    labels: Labels,
    /// NVML's last utilization sample, 0 to 1.
    utilization: Option<f64>,
    /// Σ busy share × sample interval, and Σ interval, seconds.
    busy_s: f64,
    sampled_s: f64,
    sm_clock_hz: Option<f64>,
    power_w: Option<f64>,
    temperature_c: Option<f64>,
    memory_used: Option<f64>,
    processes: Option<f64>,
    /// Clock-event (throttle) reason bits of the last reading.
    reasons: Option<u64>,
}

impl GpuSeries {
    pub fn new(host: &str, index: usize, g: &crate::record::GpuInfo) -> GpuSeries {
        GpuSeries {
            labels: vec![
                ("host", host.to_owned()),
                ("gpu", index.to_string()),
                ("uuid", g.uuid.clone()),
                ("name", g.name.clone()),
            ],
            ..GpuSeries::default()
        }
    }

    /// A reading made at `at` (CLOCK_MONOTONIC ns).
    pub fn read(&mut self, at: u64, r: &crate::event::GpuReading) {
        if let Some((from, pct)) = r.busy.filter(|(from, _)| *from < at) {
            let share = f64::from(pct.min(100)) / 100.0;
            let s = (at - from) as f64 / 1e9;
            self.utilization = Some(share);
            self.busy_s += share * s;
            self.sampled_s += s;
        }
        let set = |v: &mut Option<f64>, x: Option<f64>| {
            if x.is_some() {
                *v = x;
            }
        };
        set(
            &mut self.sm_clock_hz,
            r.sm_clock_mhz.map(|m| f64::from(m) * 1e6),
        );
        set(&mut self.power_w, r.power_mw.map(|m| f64::from(m) / 1e3));
        set(&mut self.temperature_c, r.temperature_c.map(f64::from));
        set(&mut self.memory_used, r.memory_used.map(|b| b as f64));
        set(&mut self.processes, r.processes.map(f64::from));
        if r.throttle.is_some() {
            self.reasons = r.throttle;
        }
    }
}

/// A GPU family: name, help, unit and its value of a GPU.
type GpuFamily<'a> = (
    &'a str,
    &'a str,
    Option<Unit>,
    &'a dyn Fn(&GpuSeries) -> Option<f64>,
);

/// The GPUs' series: utilization, busy time, clocks, power, temperature, memory and
/// clock-event reasons, per GPU.
fn gpu_series(gpus: &[GpuSeries], e: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
    let each = |f: &dyn Fn(&GpuSeries) -> Option<f64>| -> Vec<(Labels, f64)> {
        gpus.iter()
            .filter_map(|g| Some((g.labels.clone(), f(g)?)))
            .collect()
    };
    let gauges: [GpuFamily; 7] = [
        (
            "gpu_utilization_ratio",
            "Share of NVML's last sampling period in which a kernel ran (DCGM_FI_DEV_GPU_UTIL / 100)",
            None,
            &|g| g.utilization,
        ),
        (
            "gpu_sm_clock",
            "SM clock (DCGM_FI_DEV_SM_CLOCK)",
            Some(Unit::Other("hertz".into())),
            &|g| g.sm_clock_hz,
        ),
        (
            "gpu_power",
            "Power drawn (DCGM_FI_DEV_POWER_USAGE)",
            Some(Unit::Other("watts".into())),
            &|g| g.power_w,
        ),
        (
            "gpu_temperature",
            "GPU temperature (DCGM_FI_DEV_GPU_TEMP)",
            Some(Unit::Celsius),
            &|g| g.temperature_c,
        ),
        (
            "gpu_memory_used",
            "Frame-buffer memory used (DCGM_FI_DEV_FB_USED)",
            Some(Unit::Bytes),
            &|g| g.memory_used,
        ),
        (
            "gpu_processes",
            "Processes with a compute context on the GPU, of any job (NVML)",
            None,
            &|g| g.processes,
        ),
        (
            "gpu_sampled",
            "Time NVML's utilization samples covered since the agent started reading",
            Some(Unit::Seconds),
            &|g| (g.sampled_s > 0.0).then_some(g.sampled_s),
        ),
    ];
    for (name, help, unit, f) in gauges {
        let kind = if name == "gpu_sampled" {
            MetricType::Counter
        } else {
            MetricType::Gauge
        };
        family(e, kind, name, help, unit.as_ref(), &each(f))?;
    }
    family(
        e,
        MetricType::Counter,
        "gpu_busy",
        "Time a kernel ran by NVML's utilization samples (busy share × interval)",
        Some(&Unit::Seconds),
        &each(&|g| (g.sampled_s > 0.0).then_some(g.busy_s)),
    )?;
    let reasons: Vec<(Labels, f64)> = gpus
        .iter()
        .filter_map(|g| Some((g, g.reasons?)))
        .flat_map(|(g, bits)| {
            crate::attribute::CLOCK_EVENT_REASONS
                .iter()
                .map(move |(bit, name)| {
                    let mut l = g.labels.clone();
                    l.push(("reason", (*name).to_owned()));
                    (l, if bits & bit != 0 { 1.0 } else { 0.0 })
                })
        })
        .collect();
    family(
        e,
        MetricType::Gauge,
        "gpu_clock_event_reason",
        "1 while NVML reports this clock-event (throttle) reason (DCGM_FI_DEV_CLOCK_THROTTLE_REASONS)",
        None,
        &reasons,
    )
}

impl Collector {
    /// The agent's own series: CPU, memory, lost events, targets, doctor findings.
    fn agent(&self, e: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
        if let Some((cpu, rss, peak)) = agent_self(&self.host) {
            let none = || vec![(Vec::new(), 0.0)];
            let one = |v: f64| {
                let mut s = none();
                s[0].1 = v;
                s
            };
            family(
                e,
                MetricType::Counter,
                "agent_cpu",
                "CPU time of the agent process",
                Some(&Unit::Seconds),
                &one(cpu),
            )?;
            family(
                e,
                MetricType::Gauge,
                "agent_resident_memory",
                "Resident memory of the agent process",
                Some(&Unit::Bytes),
                &one(rss),
            )?;
            family(
                e,
                MetricType::Gauge,
                "agent_peak_resident_memory",
                "Peak resident memory of the agent process",
                Some(&Unit::Bytes),
                &one(peak),
            )?;
        }
        let (lost, findings, targets) = match self.state.lock() {
            Ok(s) => (s.lost.clone(), s.findings.clone(), s.targets),
            Err(_) => Default::default(),
        };
        let lost: Vec<(Labels, f64)> = lost
            .into_iter()
            .map(|(kind, n)| (vec![("kind", kind)], n as f64))
            .collect();
        family(
            e,
            MetricType::Counter,
            "lost_events",
            "Events the kernel programs could not hand over (ring buffer full), by kind",
            None,
            &lost,
        )?;
        family(
            e,
            MetricType::Gauge,
            "targets",
            "Processes traced now",
            None,
            &[(Vec::new(), targets as f64)],
        )?;
        let findings: Vec<(Labels, f64)> = findings
            .into_iter()
            .map(|(id, severity)| (vec![("id", id), ("severity", severity)], 1.0))
            .collect();
        family(
            e,
            MetricType::Gauge,
            "doctor_finding",
            "1 for each placement problem the doctor found at attach",
            None,
            &findings,
        )?;
        Ok(())
    }
}

/// The node's series: NUMA allocation counters and InfiniBand ports.
fn node(host: &Host, e: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
    family(
        e,
        MetricType::Counter,
        "numa_pages",
        "NUMA allocation counters of the node (numastat), in pages",
        None,
        &numastat(host),
    )?;
    let ib = infiniband(host);
    family(
        e,
        MetricType::Gauge,
        "infiniband_port_up",
        "1 when the InfiniBand port is ACTIVE",
        None,
        &ib.up,
    )?;
    family(
        e,
        MetricType::Gauge,
        "infiniband_port_rate",
        "Link rate of the InfiniBand port",
        Some(&Unit::Other("bytes_per_second".into())),
        &ib.rate_bytes,
    )?;
    family(
        e,
        MetricType::Counter,
        "infiniband_port_data",
        "Data through the InfiniBand port",
        Some(&Unit::Bytes),
        &ib.data_bytes,
    )?;
    family(
        e,
        MetricType::Counter,
        "infiniband_port_counter",
        "The InfiniBand port's other counters (errors, discards, packets), by name",
        None,
        &ib.counters,
    )?;
    family(
        e,
        MetricType::Counter,
        "infiniband_port_hw_counter",
        "The adapter's own counters of the port (hw_counters: packets, retransmissions, \
         congestion notifications), by name",
        None,
        &ib.hw_counters,
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(root: &std::path::Path, rel: &str, text: &str) {
        let path = root.join(rel);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    }

    /// NUMA and InfiniBand series from a sysfs tree; none without it.
    #[test]
    #[allow(clippy::float_cmp)] // exact small integers
    fn node_series_from_sysfs() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let host = Host::at(root);
        assert!(numastat(&host).is_empty());
        assert_eq!(infiniband(&host), IbPorts::default());
        write(
            root,
            "sys/devices/system/node/node1/numastat",
            "numa_hit 10\nnuma_miss 3\n",
        );
        write(
            root,
            "sys/devices/system/node/node0/numastat",
            "numa_hit 7\n",
        );
        let numa = numastat(&host);
        assert_eq!(numa.len(), 3);
        assert_eq!(
            numa[0],
            (vec![("node", "0".into()), ("stat", "numa_hit".into())], 7.0)
        );
        assert_eq!(numa[2].1, 3.0);
        let port = "sys/class/infiniband/mlx5_0/ports/1";
        write(root, &format!("{port}/state"), "4: ACTIVE\n");
        write(root, &format!("{port}/rate"), "200 Gb/sec (4X HDR)\n");
        write(root, &format!("{port}/counters/port_xmit_data"), "1000\n");
        write(root, &format!("{port}/counters/port_rcv_errors"), "2\n");
        write(root, &format!("{port}/hw_counters/np_cnp_sent"), "9\n");
        write(root, &format!("{port}/hw_counters/lifespan"), "12\n");
        write(
            root,
            "sys/class/infiniband/mlx5_1/ports/1/state",
            "1: DOWN\n",
        );
        let ib = infiniband(&host);
        assert_eq!(ib.up.iter().map(|s| s.1).collect::<Vec<_>>(), [1.0, 0.0]);
        assert_eq!(ib.rate_bytes[0].1, 25e9);
        assert_eq!(ib.data_bytes[0].1, 4000.0);
        assert!(
            ib.data_bytes[0]
                .0
                .contains(&("direction", "transmit".into()))
        );
        assert_eq!(ib.counters.len(), 1);
        assert!(
            ib.counters[0]
                .0
                .contains(&("counter", "port_rcv_errors".into()))
        );
        // hw_counters/ in a family of its own, its settings left out.
        assert_eq!(ib.hw_counters.len(), 1);
        assert_eq!(ib.hw_counters[0].1, 9.0);
        assert!(
            ib.hw_counters[0]
                .0
                .contains(&("counter", "np_cnp_sent".into()))
        );
    }
}
