//! Doctor: the seed's NUMA / GPU / NIC checklist, automated. `topology` reads what is
//! there (live host or a `snapshot` capture), `findings` says what is wrong and the fix.

pub mod findings;
pub mod topology;

use std::io::{self, Write};
use std::path::Path;

use serde::Serialize;

use crate::host::Host;
use findings::{Finding, Severity};
use topology::Topology;

/// `doctor.json`.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct Report {
    #[serde(flatten)]
    pub topology: Topology,
    pub findings: Vec<Finding>,
}

/// Diagnoses the host under `host` (and `pid` on it).
#[must_use]
pub fn diagnose(host: &Host, pid: Option<u32>) -> Report {
    let topology = topology::read(host, pid);
    let findings = findings::diagnose(&topology);
    Report { topology, findings }
}

/// Writes `doctor.json`.
pub fn write_json(report: &Report, out: &mut impl Write) -> io::Result<()> {
    serde_json::to_writer_pretty(&mut *out, report)?;
    writeln!(out)
}

/// Writes the health report for a terminal.
pub fn write_text(report: &Report, out: &mut impl Write) -> io::Result<()> {
    let t = &report.topology;
    writeln!(
        out,
        "nccltrace doctor: {} NUMA node(s), {} NVIDIA GPU(s), {} RDMA NIC(s), NUMA balancing {}",
        t.nodes.len(),
        t.gpus.len(),
        t.nics.len(),
        t.numa_balancing
            .map_or("unknown".to_owned(), |m| if m == 0 {
                "off".into()
            } else {
                format!("on ({m})")
            })
    )?;
    for g in &t.gpus {
        writeln!(
            out,
            "  GPU {} node {}{}{}",
            g.bus_id,
            g.numa_node,
            g.minor
                .map(|m| format!(" /dev/nvidia{m}"))
                .unwrap_or_default(),
            if g.used_by_target {
                " (used by the target)"
            } else {
                ""
            }
        )?;
    }
    if let Some(target) = &t.target {
        writeln!(
            out,
            "  target pid {} ({}): {} threads, GPUs {:?} ({}), NCCL {} {}",
            target.pid,
            target.comm,
            target.threads.len(),
            target.gpus,
            target.gpus_source,
            target.nccl_library.as_deref().unwrap_or("not mapped"),
            target.nccl_version.as_deref().unwrap_or("")
        )?;
    }
    if report.findings.is_empty() {
        writeln!(out, "  no findings")?;
    }
    for f in &report.findings {
        let tag = match f.severity {
            Severity::Error => "ERROR",
            Severity::Warn => "WARN ",
            Severity::Info => "info ",
        };
        writeln!(out, "  {tag} [{}] {}", f.id, f.summary)?;
        for e in &f.evidence {
            writeln!(out, "        {e}")?;
        }
        if let Some(fix) = &f.fix {
            writeln!(out, "        fix: {fix}")?;
        }
    }
    if !t.unreadable.is_empty() {
        writeln!(
            out,
            "  note: {} file(s) are there but this user may not read them (e.g. {}: \
             permission denied); the findings are partial: run as root",
            t.unreadable.len(),
            t.unreadable[0]
        )?;
    }
    if !t.missing.is_empty() {
        writeln!(
            out,
            "  note: {} expected file(s) were not there (e.g. {}); findings cover what was",
            t.missing.len(),
            t.missing[0]
        )?;
    }
    Ok(())
}

/// Snapshot failures.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("cannot write the snapshot file {path}: {source}")]
    Write {
        path: std::path::PathBuf,
        #[source]
        source: io::Error,
    },
}

/// Copies every file the doctor reads for `pid` into `out` (as `out/proc/...`,
/// `out/sys/...`; `/dev` fd links kept as links; the environment reduced to the variables
/// the doctor reports). Returns how many files were written, and the files this user may
/// not read (left out).
pub fn snapshot(
    host: &Host,
    pid: Option<u32>,
    out: &Path,
) -> Result<(usize, Vec<String>), SnapshotError> {
    let (topology, files, links) = topology::read_traced(host, pid);
    let write_err = |path: &Path| {
        let path = path.to_owned();
        move |source| SnapshotError::Write { path, source }
    };
    let mut n = 0;
    for rel in files {
        let dest = out.join(&rel);
        if let Some(parent) = dest.parent() {
            std::fs::create_dir_all(parent).map_err(write_err(parent))?;
        }
        let Ok(mut bytes) = std::fs::read(host.path(&rel)) else {
            continue;
        };
        if rel.ends_with("/environ") {
            let kept: Vec<&[u8]> = bytes
                .split(|b| *b == 0)
                .filter(|kv| {
                    let name = kv.split(|b| *b == b'=').next().unwrap_or_default();
                    topology::keep_env(&String::from_utf8_lossy(name))
                })
                .collect();
            bytes = kept.join(&0u8);
        }
        std::fs::write(&dest, bytes).map_err(write_err(&dest))?;
        n += 1;
    }
    for rel in links {
        let dest = out.join(&rel);
        if let (Ok(target), Some(parent)) = (std::fs::read_link(host.path(&rel)), dest.parent()) {
            std::fs::create_dir_all(parent).map_err(write_err(parent))?;
            let _ = std::fs::remove_file(&dest);
            std::os::unix::fs::symlink(target, &dest).map_err(write_err(&dest))?;
            n += 1;
        }
    }
    Ok((n, topology.unreadable))
}

#[cfg(test)]
mod tests {
    use super::findings::Severity;
    use super::*;

    /// A captured tree written file by file.
    struct Tree(tempfile::TempDir);

    impl Tree {
        fn new() -> Tree {
            Tree(tempfile::tempdir().unwrap())
        }
        fn file(&self, rel: &str, text: &str) -> &Tree {
            let p = self.0.path().join(rel);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
            self
        }
        fn link(&self, rel: &str, target: &str) -> &Tree {
            let p = self.0.path().join(rel);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::os::unix::fs::symlink(target, p).unwrap();
            self
        }
        fn host(&self) -> Host {
            Host::at(self.0.path())
        }
        fn gpu(&self, bus: &str, node: i32, minor: u32) -> &Tree {
            self.file(&format!("sys/bus/pci/devices/{bus}/vendor"), "0x10de\n")
                .file(&format!("sys/bus/pci/devices/{bus}/class"), "0x030200\n")
                .file(
                    &format!("sys/bus/pci/devices/{bus}/numa_node"),
                    &format!("{node}\n"),
                )
                .file(
                    &format!("proc/driver/nvidia/gpus/{bus}/information"),
                    &format!("Model: NVIDIA H200\nDevice Minor: {minor}\n"),
                )
        }
        fn thread(&self, pid: u32, tid: u32, name: &str, allowed: &str, last_cpu: u32) -> &Tree {
            let fields: Vec<String> = (0..35)
                .map(|i| {
                    if i == 34 {
                        last_cpu.to_string()
                    } else {
                        "0".into()
                    }
                })
                .collect();
            self.file(
                &format!("proc/{pid}/task/{tid}/status"),
                &format!("Name:\t{name}\nCpus_allowed_list:\t{allowed}\nMems_allowed_list:\t0-1\n"),
            )
            .file(
                &format!("proc/{pid}/task/{tid}/stat"),
                &format!("{tid} ({name}) S 1 {}", fields.join(" ")),
            )
        }
    }

    fn ids(report: &Report) -> Vec<&'static str> {
        report.findings.iter().map(|f| f.id).collect()
    }

    /// Field 39 of stat is the last CPU, whatever the comm holds.
    #[test]
    fn last_cpu_field() {
        let fields: Vec<String> = (0..35)
            .map(|i| if i == 34 { "7".into() } else { "0".into() })
            .collect();
        let stat = format!("42 (a) b) S 1 {}", fields.join(" "));
        assert_eq!(topology::last_cpu(&stat), Some(7));
        assert_eq!(
            topology::pages_per_node("7f00 default anon=3 N0=2 N1=1\n7f01 N1=5"),
            [(0, 2), (1, 6)].into()
        );
        // Damaged counts saturate (a fuzzer-found overflow).
        let huge = format!("N0={m} N0={m}", m = u64::MAX);
        assert_eq!(topology::pages_per_node(&huge), [(0, u64::MAX)].into());
    }

    /// One node, one GPU, the rank on it: nothing to fix.
    #[test]
    fn single_node_host_is_healthy() {
        let t = Tree::new();
        t.file("sys/devices/system/node/node0/cpulist", "0-7\n")
            .gpu("0000:19:00.0", 0, 0)
            .file("proc/sys/kernel/numa_balancing", "0\n")
            .file("proc/100/comm", "python3\n")
            .file("proc/100/status", "Name:\tpython3\nMems_allowed_list:\t0\n")
            .file("proc/100/numa_maps", "7f00 default anon=10 N0=10\n")
            .file(
                "proc/100/environ",
                "RANK=0\0SECRET_TOKEN=x\0NCCL_DEBUG=WARN\0",
            )
            .file("proc/100/maps", "")
            .link("proc/100/fd/5", "/dev/nvidia0");
        t.thread(100, 100, "python3", "0-7", 3);
        let report = diagnose(&t.host(), Some(100));
        assert!(report.findings.is_empty(), "{:?}", report.findings);
        let target = report.topology.target.as_ref().unwrap();
        assert_eq!(target.gpus, vec!["0000:19:00.0".to_owned()]);
        assert!(report.topology.gpus[0].used_by_target);
        assert!(
            !target.env.contains_key("SECRET_TOKEN"),
            "secrets are not kept"
        );
    }

    /// Two nodes × four GPUs, the rank on a node-1 GPU but running and allocating on node 0,
    /// NUMA balancing on, one IB port down and one slow, IB disabled in NCCL, verbose NCCL
    /// logging, a worker process on node 0: every finding, each with its fix.
    #[test]
    fn two_node_host_with_everything_wrong() {
        let t = Tree::new();
        t.file("sys/devices/system/node/node0/cpulist", "0-7\n")
            .file("sys/devices/system/node/node1/cpulist", "8-15\n")
            .file("proc/sys/kernel/numa_balancing", "1\n");
        for i in 0..8u32 {
            t.gpu(&format!("0000:{:02x}:00.0", 0x10 + i), i32::from(i >= 4), i);
        }
        for (hca, state, rate) in [
            ("mlx5_0", "1: DOWN", "200 Gb/sec (4X HDR)"),
            ("mlx5_1", "4: ACTIVE", "100 Gb/sec (4X EDR)"),
            ("mlx5_2", "4: ACTIVE", "200 Gb/sec (4X HDR)"),
        ] {
            let base = format!("sys/class/infiniband/{hca}");
            t.file(&format!("{base}/device/numa_node"), "0\n")
                .file(&format!("{base}/ports/1/state"), state)
                .file(
                    &format!("{base}/ports/1/phys_state"),
                    if state.contains("ACTIVE") {
                        "5: LinkUp"
                    } else {
                        "3: Disabled"
                    },
                )
                .file(&format!("{base}/ports/1/rate"), rate)
                .file(&format!("{base}/ports/1/link_layer"), "InfiniBand");
        }
        t.file("proc/200/comm", "python3\n")
            .file(
                "proc/200/status",
                "Name:\tpython3\nMems_allowed_list:\t0-1\n",
            )
            .file("proc/200/numa_maps", "7f00 default anon=100 N0=90 N1=10\n")
            .file(
                "proc/200/environ",
                "NCCL_IB_DISABLE=1\0NCCL_DEBUG=INFO\0LOCAL_RANK=5\0",
            )
            .file("proc/200/maps", "")
            .link("proc/200/fd/9", "/dev/nvidia5");
        t.thread(200, 200, "python3", "0-15", 2)
            .thread(200, 201, "pt_nccl_watchdg", "0-15", 9);
        let fields: Vec<String> = (0..35)
            .map(|i| if i == 34 { "1".into() } else { "0".into() })
            .collect();
        t.file(
            "proc/300/stat",
            &format!("300 (pt_data_worker) S 200 {}", fields.join(" ")),
        );
        let report = diagnose(&t.host(), Some(200));
        let found = ids(&report);
        for id in [
            "cpu_affinity_remote",
            "memory_remote",
            "numa_balancing_enabled",
            "ib_port_down",
            "nccl_ib_disabled",
            "nccl_debug_verbose",
            "gpu_nic_remote",
            "threads_unpinned",
            "dataloader_remote",
        ] {
            assert!(found.contains(&id), "{id} missing from {found:?}");
        }
        assert_eq!(
            found.iter().filter(|i| **i == "ib_port_down").count(),
            2,
            "down and slow"
        );
        let affinity = report
            .findings
            .iter()
            .find(|f| f.id == "cpu_affinity_remote")
            .unwrap();
        assert_eq!(affinity.severity, Severity::Error);
        assert!(
            affinity
                .fix
                .as_deref()
                .unwrap()
                .contains("taskset -apc 8-15 200")
        );
        let memory = report
            .findings
            .iter()
            .find(|f| f.id == "memory_remote")
            .unwrap();
        assert!(memory.summary.contains("90%"), "{}", memory.summary);
        assert!(
            report
                .findings
                .windows(2)
                .all(|w| w[0].severity >= w[1].severity)
        );
    }

    /// A GPU whose numa_node is -1 is reported, and no placement finding is guessed.
    #[test]
    fn gpu_without_numa_node() {
        let t = Tree::new();
        t.file("sys/devices/system/node/node0/cpulist", "0-3\n")
            .file("sys/devices/system/node/node1/cpulist", "4-7\n")
            .gpu("0000:19:00.0", -1, 0)
            .file("proc/sys/kernel/numa_balancing", "0\n")
            .file("proc/5/comm", "python3\n")
            .file("proc/5/numa_maps", "7f00 N0=1 N1=99\n")
            .link("proc/5/fd/3", "/dev/nvidia0");
        t.thread(5, 5, "python3", "0-7", 6);
        let found = ids(&diagnose(&t.host(), Some(5)));
        assert!(found.contains(&"gpu_numa_unknown"), "{found:?}");
        assert!(
            !found.contains(&"cpu_affinity_remote") && !found.contains(&"memory_remote"),
            "{found:?}"
        );
    }

    /// In a container the device files may be hidden: CUDA_VISIBLE_DEVICES names the GPU
    /// (PCI bus order), and the finding uses it.
    #[test]
    fn container_gpu_from_environment() {
        let t = Tree::new();
        t.file("sys/devices/system/node/node0/cpulist", "0-3\n")
            .file("sys/devices/system/node/node1/cpulist", "4-7\n")
            .gpu("0000:a0:00.0", 1, 1)
            .gpu("0000:10:00.0", 0, 0)
            .file("proc/7/comm", "python3\n")
            .file("proc/7/environ", "CUDA_VISIBLE_DEVICES=1\0")
            .file("proc/7/numa_maps", "7f00 N1=100\n");
        t.thread(7, 7, "python3", "0-3", 1);
        let report = diagnose(&t.host(), Some(7));
        let target = report.topology.target.as_ref().unwrap();
        assert_eq!(target.gpus, vec!["0000:a0:00.0".to_owned()]);
        assert!(target.gpus_source.contains("CUDA_VISIBLE_DEVICES"));
        assert!(ids(&report).contains(&"cpu_affinity_remote"));
    }

    /// A partial capture: findings for what is there, and the missing files listed.
    #[test]
    fn partial_tree() {
        let t = Tree::new();
        t.file("proc/sys/kernel/numa_balancing", "2\n")
            .file("proc/9/comm", "x\n");
        let report = diagnose(&t.host(), Some(9));
        assert_eq!(ids(&report), vec!["gpu_unknown", "numa_balancing_enabled"]);
        assert!(
            report
                .topology
                .missing
                .iter()
                .any(|m| m.contains("sys/devices/system/node"))
        );
        let mut text = Vec::new();
        write_text(&report, &mut text).unwrap();
        assert!(String::from_utf8(text).unwrap().contains("were not there"));
    }

    /// Live host: the doctor runs on this machine's own /proc and /sys, and a snapshot of
    /// it gives the same diagnosis offline.
    #[test]
    fn live_host_and_snapshot_agree() {
        // A quiet target: the test process's own threads come and go.
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pid = child.id();
        let live = diagnose(&Host::live(), Some(pid));
        assert!(
            !live.topology.nodes.is_empty()
                || live.topology.missing.iter().any(|m| m.contains("node"))
        );
        let dir = tempfile::tempdir().unwrap();
        let (n, _) = snapshot(&Host::live(), Some(pid), dir.path()).unwrap();
        assert!(n > 5);
        let offline = diagnose(&Host::at(dir.path()), Some(pid));
        assert_eq!(
            offline.topology.nodes,
            live.topology
                .nodes
                .iter()
                .map(|n| topology::Node {
                    numastat: offline
                        .topology
                        .nodes
                        .iter()
                        .find(|o| o.id == n.id)
                        .map(|o| o.numastat.clone())
                        .unwrap_or_default(),
                    ..n.clone()
                })
                .collect::<Vec<_>>()
        );
        assert_eq!(ids(&offline), ids(&live));
        assert_eq!(offline.topology.gpus, live.topology.gpus);
        assert_eq!(
            offline.topology.target.as_ref().map(|t| t.threads.len()),
            live.topology.target.as_ref().map(|t| t.threads.len())
        );
        let _ = child.kill();
        let _ = child.wait();
    }
}
