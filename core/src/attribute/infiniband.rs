//! A step's InfiniBand traffic and errors, per port. The agent reads the ports' counters
//! while tracing (`infiniband_counters` records): the data and packet counters often, all
//! of them (a full reading) less often. Each counter's value at a step's start and end is
//! interpolated linearly between the readings of it around that time, and the step gets
//! the difference. An estimate: traffic within a reading interval is taken as even, and the
//! counters are the port's (every process on the node), not the rank's.

use nccltrace_common::IB_COUNTER_NAMES;
use serde::ser::{Serialize, SerializeMap, Serializer};

/// The readings of the run's ports, trimmed as steps are attributed.
#[derive(Debug, Default)]
pub(crate) struct Readings {
    /// `device/port`, indexed by the records' port.
    pub ports: Vec<String>,
    /// Per port, in time order.
    by_port: Vec<Port>,
    /// Readings naming a port the header does not list.
    pub unknown_port: u64,
}

#[derive(Clone, Debug, Default)]
struct Port {
    readings: Vec<Reading>,
    /// Every counter any reading of the port had (bit `i`: [`IB_COUNTER_NAMES`]`[i]`).
    seen: u64,
}

#[derive(Clone, Copy, Debug)]
struct Reading {
    ts_ns: u64,
    /// Bit `i`: `values[i]` was read.
    present: u64,
    /// Every counter the port had so far was read.
    full: bool,
    values: [u64; IB_COUNTER_NAMES.len()],
}

impl Reading {
    fn has(&self, i: usize) -> bool {
        self.present & (1u64 << i) != 0
    }
}

/// A step's deltas per port: (`device/port`, (counter, value)), the data counters in
/// bytes as `transmit_bytes` and `receive_bytes`, the rest by the port's own names.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct IbStep(pub Vec<(String, Vec<(&'static str, u64)>)>);

impl Serialize for IbStep {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        struct Counters<'a>(&'a [(&'static str, u64)]);
        impl Serialize for Counters<'_> {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                let mut m = s.serialize_map(Some(self.0.len()))?;
                for (name, value) in self.0 {
                    m.serialize_entry(name, value)?;
                }
                m.end()
            }
        }
        let mut m = s.serialize_map(Some(self.0.len()))?;
        for (port, counters) in &self.0 {
            m.serialize_entry(port, &Counters(counters))?;
        }
        m.end()
    }
}

/// The name a counter has in a step: the data counters (4-byte words) become bytes.
fn step_name(i: usize) -> (&'static str, u64) {
    match IB_COUNTER_NAMES[i] {
        "port_xmit_data" => ("transmit_bytes", 4),
        "port_rcv_data" => ("receive_bytes", 4),
        name => (name, 1),
    }
}

impl Readings {
    #[must_use]
    pub fn new(ports: Vec<String>) -> Readings {
        Readings {
            by_port: vec![Port::default(); ports.len()],
            ports,
            unknown_port: 0,
        }
    }

    /// One reading of `port`: (index in [`IB_COUNTER_NAMES`], value).
    pub fn add(&mut self, ts_ns: u64, port: u32, counters: &[(u8, u64)]) {
        let Some(port) = self.by_port.get_mut(port as usize) else {
            self.unknown_port += 1;
            return;
        };
        let mut r = Reading {
            ts_ns,
            present: 0,
            full: false,
            values: [0; IB_COUNTER_NAMES.len()],
        };
        for &(i, v) in counters {
            if let Some(slot) = r.values.get_mut(usize::from(i)) {
                *slot = v;
                r.present |= 1u64 << i;
            }
        }
        port.seen |= r.present;
        r.full = r.present == port.seen;
        port.readings.push(r);
    }

    /// Sorts the readings by time (the agent writes them in order; a recording joined
    /// from windows may not).
    pub fn sort(&mut self) {
        for p in &mut self.by_port {
            if !p.readings.is_sorted_by_key(|r| r.ts_ns) {
                p.readings.sort_by_key(|r| r.ts_ns);
            }
        }
    }

    /// The latest time every counter of every port can be interpolated at (the oldest of
    /// the ports' latest full readings); `None` without readings.
    pub fn horizon(&self) -> Option<u64> {
        self.by_port
            .iter()
            .filter_map(|p| p.readings.iter().rfind(|r| r.full).map(|r| r.ts_ns))
            .min()
    }

    /// Counter `i` of `readings` at `t`, interpolated; `None` outside the readings, or
    /// where the counter went back (reset) or was not read on both sides.
    fn at(readings: &[Reading], i: usize, t: u64) -> Option<u64> {
        let after = readings.partition_point(|r| r.ts_ns < t);
        let next = readings[after..].iter().find(|r| r.has(i))?;
        if next.ts_ns == t {
            return Some(next.values[i]);
        }
        let prev = readings[..after].iter().rev().find(|r| r.has(i))?;
        let (v0, v1) = (prev.values[i], next.values[i]);
        let grown = v1.checked_sub(v0)?;
        let span = next.ts_ns - prev.ts_ns;
        let part = u128::from(grown) * u128::from(t - prev.ts_ns) / u128::from(span);
        Some(v0 + u64::try_from(part).unwrap_or(grown))
    }

    /// Each counter of `readings` from `a` to `b`, by its step name.
    fn delta(readings: &[Reading], a: u64, b: u64) -> Vec<(&'static str, u64)> {
        (0..IB_COUNTER_NAMES.len())
            .filter_map(|i| {
                let delta = Self::at(readings, i, b)?.checked_sub(Self::at(readings, i, a)?)?;
                let (name, unit) = step_name(i);
                Some((name, delta.saturating_mul(unit)))
            })
            .collect()
    }

    /// Per port, what `span` (the port's readings) gives; ports without any left out.
    fn per_port(&self, span: impl Fn(&[Reading]) -> Option<(u64, u64)>) -> Option<IbStep> {
        let out: Vec<_> = self
            .ports
            .iter()
            .zip(&self.by_port)
            .filter_map(|(port, p)| {
                let (a, b) = span(&p.readings)?;
                let counters = Self::delta(&p.readings, a, b);
                (!counters.is_empty()).then(|| (port.clone(), counters))
            })
            .collect();
        (!out.is_empty()).then_some(IbStep(out))
    }

    /// The step `[a, b)`'s deltas per port; `None` without any port read around it.
    pub fn step(&self, a: u64, b: u64) -> Option<IbStep> {
        self.per_port(|_| Some((a, b)))
    }

    /// Each port's deltas from its first full reading to its last (the run's, where only
    /// those are kept: [`Readings::keep_ends`]).
    pub fn totals(&self) -> Option<IbStep> {
        self.per_port(|r| {
            let first = r.iter().find(|r| r.full)?;
            let last = r.iter().rfind(|r| r.full)?;
            Some((first.ts_ns, last.ts_ns))
        })
    }

    /// Keeps each port's earliest and latest full readings only (by time: readings of
    /// windows joined out of order keep the right ends).
    pub fn keep_ends(&mut self) {
        for p in &mut self.by_port {
            let r = &mut p.readings;
            let full = || r.iter().filter(|r| r.full);
            let (Some(&first), Some(&last)) = (
                full().min_by_key(|r| r.ts_ns),
                full().max_by_key(|r| r.ts_ns),
            ) else {
                continue;
            };
            r.clear();
            r.push(first);
            if last.ts_ns != first.ts_ns {
                r.push(last);
            }
        }
    }

    /// Drops the readings steps ending after `until` no longer need: those before the
    /// last full reading at or before it.
    pub fn trim(&mut self, until: u64) {
        for p in &mut self.by_port {
            let r = &mut p.readings;
            let before = r.partition_point(|r| r.ts_ns <= until);
            if let Some(keep_from) = r[..before].iter().rposition(|r| r.full) {
                r.drain(..keep_from);
            }
        }
    }

    /// Readings held (bounded by the trims).
    #[cfg(test)]
    pub fn held(&self) -> usize {
        self.by_port.iter().map(|p| p.readings.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn readings() -> Readings {
        let mut r = Readings::new(vec!["mlx5_0/1".into(), "mlx5_1/1".into()]);
        // Port 0: 1,000 words a ms transmitted, 10 received; a symbol error at 150 ms.
        for ms in [0u64, 100, 200, 300] {
            let errors = u64::from(ms >= 200);
            r.add(
                ms * 1_000_000,
                0,
                &[(0, ms * 1000), (1, ms * 10), (7, errors)],
            );
        }
        // Port 1 read only from 100 ms on, without its receive counter.
        for ms in [100u64, 200, 300] {
            r.add(ms * 1_000_000, 1, &[(0, 7 * ms)]);
        }
        r
    }

    fn get(step: &IbStep, port: &str, name: &str) -> Option<u64> {
        let (_, counters) = step.0.iter().find(|(p, _)| p == port)?;
        counters.iter().find(|(n, _)| *n == name).map(|c| c.1)
    }

    #[test]
    fn a_step_gets_the_interpolated_difference_in_bytes() {
        let r = readings();
        // 50–150 ms: 100 ms of 1,000 words a ms = 400,000 bytes; 1,000 words received.
        let step = r.step(50_000_000, 150_000_000).unwrap();
        assert_eq!(get(&step, "mlx5_0/1", "transmit_bytes"), Some(400_000));
        assert_eq!(get(&step, "mlx5_0/1", "receive_bytes"), Some(4_000));
        // The error came between 100 and 200 ms: half of it is spread here; rounding down.
        assert_eq!(get(&step, "mlx5_0/1", "symbol_error"), Some(0));
        // Port 1 had no reading before 100 ms: not in this step.
        assert_eq!(get(&step, "mlx5_1/1", "transmit_bytes"), None);
        let step = r.step(100_000_000, 300_000_000).unwrap();
        assert_eq!(get(&step, "mlx5_0/1", "symbol_error"), Some(1));
        assert_eq!(get(&step, "mlx5_1/1", "transmit_bytes"), Some(7 * 200 * 4));
        assert_eq!(get(&step, "mlx5_1/1", "receive_bytes"), None);
        // Past the last reading: nothing to interpolate from.
        assert_eq!(r.step(250_000_000, 350_000_000), None);
        assert_eq!(r.horizon(), Some(300_000_000));
    }

    #[test]
    fn counters_read_less_often_interpolate_between_their_own_readings() {
        let mut r = Readings::new(vec!["d/1".into()]);
        // Full readings at 0 and 1,000 ms; the data counter alone every 100 ms between.
        r.add(0, 0, &[(0, 0), (7, 0)]);
        for ms in 1..10u64 {
            r.add(ms * 100_000_000, 0, &[(0, ms * 100)]);
        }
        r.add(1_000_000_000, 0, &[(0, 1000), (7, 10)]);
        let step = r.step(450_000_000, 550_000_000).unwrap();
        assert_eq!(get(&step, "d/1", "transmit_bytes"), Some(400));
        assert_eq!(get(&step, "d/1", "symbol_error"), Some(1));
        assert_eq!(r.horizon(), Some(1_000_000_000));
        // Trimmed at 500 ms, the full reading at 0 stays for the errors.
        r.trim(500_000_000);
        assert_eq!(r.held(), 11);
        assert_eq!(r.step(450_000_000, 550_000_000), Some(step));
        r.trim(1_000_000_000);
        assert_eq!(r.held(), 1);
    }

    #[test]
    fn a_counter_that_went_back_is_left_out() {
        let mut r = Readings::new(vec!["d/1".into()]);
        r.add(0, 0, &[(0, 500), (2, 10)]);
        r.add(100, 0, &[(0, 20), (2, 30)]);
        let step = r.step(0, 100).unwrap();
        assert_eq!(get(&step, "d/1", "transmit_bytes"), None);
        assert_eq!(get(&step, "d/1", "port_xmit_packets"), Some(20));
        r.add(5, 7, &[(0, 1)]);
        assert_eq!(r.unknown_port, 1);
    }

    #[test]
    fn trimming_keeps_what_later_steps_need() {
        let mut r = readings();
        let before = r.step(210_000_000, 290_000_000);
        r.trim(210_000_000);
        assert_eq!(r.held(), 4, "the readings at 200 and 300 ms of each port");
        assert_eq!(r.step(210_000_000, 290_000_000), before);
        assert!(before.is_some());
    }

    #[test]
    fn the_run_totals_are_first_to_last_reading() {
        let mut r = readings();
        r.keep_ends();
        assert_eq!(r.held(), 4);
        let totals = r.totals().unwrap();
        assert_eq!(
            get(&totals, "mlx5_0/1", "transmit_bytes"),
            Some(300 * 1000 * 4)
        );
        assert_eq!(get(&totals, "mlx5_0/1", "symbol_error"), Some(1));
        assert_eq!(
            get(&totals, "mlx5_1/1", "transmit_bytes"),
            Some(7 * 200 * 4)
        );
        assert_eq!(Readings::new(vec!["d/1".into()]).totals(), None);
        // Out of time order, trimmed after each as the summary does: the same ends.
        let mut late = Readings::new(vec!["d/1".into()]);
        for ms in [200u64, 0, 300, 100] {
            late.add(ms * 1_000_000, 0, &[(0, ms)]);
            late.keep_ends();
        }
        let totals = late.totals().unwrap();
        assert_eq!(get(&totals, "d/1", "transmit_bytes"), Some(300 * 4));
    }

    #[test]
    fn steps_serialize_as_maps_of_ports() {
        let step = readings().step(100_000_000, 200_000_000).unwrap();
        let json = serde_json::to_value(&step).unwrap();
        assert_eq!(json["mlx5_0/1"]["transmit_bytes"], 400_000);
        assert_eq!(json["mlx5_1/1"]["transmit_bytes"], 2_800);
    }
}
