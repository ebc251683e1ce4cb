//! What a session reads beside the rings, as it drains them: each target's resident memory
//! per node, InfiniBand counters, the PMU's memory samples and node-load counters, and the
//! threads those follow.

use super::{Attached, Host, Instant, Sink, agent_record, host, kind, pmu};

impl Attached {
    /// Every [`host::NUMA_MAPS_EVERY`], where enabled: each target's resident memory per
    /// node as a `NUMA_PAGES` record.
    pub(super) fn read_resident(
        &mut self,
        sink: &mut impl Sink,
        host: &Host,
    ) -> Result<(), crate::Error> {
        if !self.resident
            || self
                .resident_read
                .is_some_and(|t| t.elapsed() < host::NUMA_MAPS_EVERY)
        {
            return Ok(());
        }
        self.resident_read = Some(Instant::now());
        for &pid in &self.pids {
            let Some(kib) = host.numa_maps_kib(pid) else {
                continue;
            };
            let mut record = nccltrace_common::NumaPagesEvent {
                hdr: agent_record(
                    host::clock_ns(libc::CLOCK_MONOTONIC),
                    pid,
                    pid,
                    kind::NUMA_PAGES,
                ),
                ..Default::default()
            };
            let room = record.kib.len();
            for (node, k) in kib.iter().enumerate() {
                record.kib[node.min(room - 1)] += k;
            }
            record.nodes = u32::try_from(kib.len().min(room)).unwrap_or(0);
            sink.record(&crate::decode::as_bytes(&record))?;
        }
        Ok(())
    }

    /// Every counter of the InfiniBand ports as `IB_READING` records, read now. The
    /// reading taken before the probes were attached goes first.
    fn read_infiniband(&mut self, sink: &mut impl Sink, host: &Host) -> Result<(), crate::Error> {
        let ports = &self.header.infiniband_ports;
        let now = ib_readings(host, ports, &mut self.ib_files, true);
        for (port, at, record) in std::mem::take(&mut self.ib_early).into_iter().chain(now) {
            if self.ib_written.newer(port, at) {
                sink.record(&record)?;
            }
        }
        Ok(())
    }

    /// Hands on the readings [`IbReader`] took since the last call; starts it at the
    /// first call where there are ports to read.
    pub(super) fn pull_infiniband(&mut self, sink: &mut impl Sink) -> Result<(), crate::Error> {
        let ports = &self.header.infiniband_ports;
        if ports.is_empty() {
            return Ok(());
        }
        let reader = self.ib_reader.get_or_insert_with(|| {
            IbReader::start(Host::live(), ports.clone(), self.ib_files.clone())
        });
        for (port, at, record) in reader.records.try_iter() {
            if self.ib_written.newer(port, at) {
                sink.record(&record)?;
            }
        }
        Ok(())
    }

    /// Hands on the GPU readings taken since the last call.
    pub(super) fn pull_gpu(&mut self, sink: &mut impl Sink) -> Result<(), crate::Error> {
        if let Some(reader) = &self.gpu_reader {
            for record in reader.records.try_iter() {
                sink.record(&record)?;
            }
        }
        Ok(())
    }

    /// Hands on the loads the PMU sampled since the last call, as `MEM_SAMPLE` records.
    pub(super) fn drain_mem(&mut self, sink: &mut impl Sink) -> Result<(), crate::Error> {
        let Some(mem) = self.mem.as_mut() else {
            return Ok(());
        };
        let mut samples = Vec::new();
        mem.drain(&mut samples);
        samples.sort_unstable_by_key(|s| s.time_ns);
        for s in samples {
            let record = nccltrace_common::MemSampleEvent {
                hdr: agent_record(s.time_ns, s.pid, s.tid, kind::MEM_SAMPLE),
                weight: s.weight,
                _pad: 0,
                data_src: s.data_src,
            };
            sink.record(&crate::decode::as_bytes(&record))?;
        }
        Ok(())
    }

    /// Every counter steps are interpolated between, in full: the InfiniBand ports', the
    /// node-load counters', the nodes' numastat (at the start and at the end).
    pub(super) fn read_counters(
        &mut self,
        sink: &mut impl Sink,
        host: &Host,
    ) -> Result<(), crate::Error> {
        self.read_infiniband(sink, host)?;
        self.read_node_loads(sink, true)?;
        sink.numastat(host::clock_ns(libc::CLOCK_MONOTONIC), host.numastat());
        Ok(())
    }

    /// Threads the targets started since: their loads sampled or counted too.
    pub(super) fn follow_threads(&mut self, host: &Host) {
        if self.mem.is_none() && self.counting.is_none() {
            return;
        }
        let threads = pmu::target_threads(host, self.pids.iter().copied());
        if let Some(mem) = self.mem.as_mut() {
            mem.follow(threads.iter().copied());
        }
        if let Some(counting) = self.counting.as_mut() {
            counting.follow(threads);
        }
    }

    /// Hands on a reading of every counted thread's node loads, as `NODE_LOADS` records.
    /// `full`: every thread, moved or not (each second and at the end); otherwise those
    /// whose counts moved.
    pub(super) fn read_node_loads(
        &mut self,
        sink: &mut impl Sink,
        full: bool,
    ) -> Result<(), crate::Error> {
        let Some(counting) = self.counting.as_mut() else {
            return Ok(());
        };
        let mut readings = Vec::new();
        let at = host::clock_ns(libc::CLOCK_MONOTONIC);
        counting.read(at, full, &mut readings);
        for (ts, r) in readings {
            let record = nccltrace_common::NodeLoadsEvent {
                hdr: agent_record(ts, r.tgid, r.tid, kind::NODE_LOADS),
                dram: r.dram,
                remote: r.remote,
                enabled_ns: r.enabled_ns,
                running_ns: r.running_ns,
                flags: if full && ts == at {
                    nccltrace_common::node_loads::FULL
                } else {
                    0
                },
                _pad: 0,
            };
            sink.record(&crate::decode::as_bytes(&record))?;
        }
        Ok(())
    }
}

/// A port's reading: (port index, when, its `IB_READING` record).
pub(super) type IbRecord = (u32, u64, Vec<u8>);

/// One reading of each port of `ports`: the data and packet counters, or all of them
/// (`full`). Which files a port has is looked up once, into `files` (one entry a port).
pub(super) fn ib_readings(
    host: &Host,
    ports: &[String],
    files: &mut Vec<Vec<(u8, String)>>,
    full: bool,
) -> Vec<IbRecord> {
    if files.len() != ports.len() {
        *files = ports
            .iter()
            .map(|port| host.ib_counter_files(port))
            .collect();
    }
    let mut records = Vec::new();
    for (index, files) in files.iter().enumerate() {
        let before = host::clock_ns(libc::CLOCK_MONOTONIC);
        let wanted = files
            .iter()
            .filter(|(i, _)| full || nccltrace_common::IB_FAST & (1u64 << i) != 0);
        let values: Vec<(u8, u64)> = wanted
            .filter_map(|(i, path)| Some((*i, host.ib_value(path)?)))
            .collect();
        if values.is_empty() {
            continue;
        }
        // Reading a port's counters may take a while (each file is a query of the
        // adapter): the reading is dated at its middle.
        let after = host::clock_ns(libc::CLOCK_MONOTONIC);
        let at = before + (after.saturating_sub(before)) / 2;
        let port = u32::try_from(index).unwrap_or(u32::MAX);
        records.push((port, at, crate::decode::ib_reading(at, port, &values)));
    }
    records
}

/// The InfiniBand ports read on a thread of their own, the data and packet counters every
/// [`super::IB_FAST_EVERY`] and all of them every [`super::IB_FULL_EVERY`]: a port's files
/// are queries of the adapter (of its firmware, for `counters/`), which must not hold up
/// the drain, and the drain's pauses (a round of the trap calibration) must not leave
/// steps without a reading. Dropping it stops the thread, without waiting for a read
/// under way (one that never returns must not keep the agent from exiting).
pub(super) struct IbReader {
    records: std::sync::mpsc::Receiver<IbRecord>,
    /// Dropped (with the reader) to stop the thread.
    _stop: std::sync::mpsc::Sender<()>,
}

impl IbReader {
    fn start(host: Host, ports: Vec<String>, mut files: Vec<Vec<(u8, String)>>) -> IbReader {
        let (tx, records) = std::sync::mpsc::channel();
        let (stop, stopped) = std::sync::mpsc::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("nccltrace-ib".to_owned())
            .spawn(move || {
                let mut full_at = Instant::now() + super::IB_FULL_EVERY;
                while let Err(std::sync::mpsc::RecvTimeoutError::Timeout) =
                    stopped.recv_timeout(super::IB_FAST_EVERY)
                {
                    let full = Instant::now() >= full_at;
                    if full {
                        full_at = Instant::now() + super::IB_FULL_EVERY;
                    }
                    for record in ib_readings(&host, &ports, &mut files, full) {
                        if tx.send(record).is_err() {
                            return;
                        }
                    }
                }
            });
        if let Err(e) = thread {
            log::warn!("cannot start the InfiniBand reader: {e}");
        }
        IbReader {
            records,
            _stop: stop,
        }
    }
}

/// Per port, the time of the newest reading written: the reader's readings come late, and
/// a window starts and ends with one read at once, so a port's readings are kept in time
/// order by leaving out any not newer than the last one written.
#[derive(Debug, Default)]
pub(super) struct IbWritten(Vec<u64>);

impl IbWritten {
    /// Whether a reading of `port` at `at` is newer than the last one written (and is
    /// now the last one).
    fn newer(&mut self, port: u32, at: u64) -> bool {
        let index = port as usize;
        if self.0.len() <= index {
            self.0.resize(index + 1, 0);
        }
        if at <= self.0[index] {
            return false;
        }
        self.0[index] = at;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each port's readings go out in time order, whatever order they come in.
    #[test]
    fn a_ports_readings_in_time_order() {
        let mut w = IbWritten::default();
        assert!(w.newer(0, 100));
        assert!(w.newer(1, 50), "ports are apart");
        assert!(!w.newer(0, 100), "the same reading twice");
        assert!(!w.newer(0, 90), "an older one, late");
        assert!(w.newer(0, 101));
        assert!(w.newer(3, 1));
    }

    /// The reader reads a port's data and packet counters every 100 ms and all of them
    /// every second, on its own, and stops when dropped.
    #[test]
    fn the_reader_reads_fast_and_full() {
        let dir = tempfile::tempdir().unwrap();
        let port = dir.path().join("sys/class/infiniband/mlx5_0/ports/1");
        for (folder, name, value) in [
            ("counters", "port_xmit_data", "1000"),
            ("counters", "symbol_error", "3"),
            ("hw_counters", "rnr_nak_retry_err", "2"),
        ] {
            std::fs::create_dir_all(port.join(folder)).unwrap();
            std::fs::write(port.join(folder).join(name), format!("{value}\n")).unwrap();
        }
        let host = Host::at(dir.path());
        let ports = host.ib_ports();
        assert_eq!(ports, ["mlx5_0/1"]);
        let reader = IbReader::start(host, ports, Vec::new());
        std::thread::sleep(std::time::Duration::from_millis(1500));
        let readings: Vec<IbRecord> = reader.records.try_iter().collect();
        drop(reader);
        let counters: Vec<Vec<(u8, u64)>> = readings
            .iter()
            .map(|(port, _, record)| {
                assert_eq!(*port, 0);
                match crate::decode::decode(record).unwrap() {
                    crate::event::Event::IbCounters { counters, .. } => counters,
                    other => panic!("{other:?}"),
                }
            })
            .collect();
        let name = |i: u8| nccltrace_common::IB_COUNTER_NAMES[usize::from(i)];
        let full: Vec<_> = counters.iter().filter(|c| c.len() == 3).collect();
        let fast: Vec<_> = counters.iter().filter(|c| c.len() == 1).collect();
        assert_eq!(full.len(), 1, "{counters:?}");
        assert!((5..=15).contains(&fast.len()), "{counters:?}");
        assert_eq!(name(fast[0][0].0), "port_xmit_data");
        assert_eq!(fast[0][0].1, 1000);
        let mut names: Vec<&str> = full[0].iter().map(|c| name(c.0)).collect();
        names.sort_unstable();
        assert_eq!(
            names,
            ["port_xmit_data", "rnr_nak_retry_err", "symbol_error"]
        );
        // In time order.
        assert!(readings.windows(2).all(|w| w[0].1 < w[1].1));
    }
}
