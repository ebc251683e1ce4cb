//! What is wrong, and the fix: rules over a `Topology`. Ids are stable (docs/doctor.md).

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

use super::topology::{Target, Topology};

/// How bad a finding is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    Info,
    Warn,
    Error,
}

/// One finding.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct Finding {
    pub id: &'static str,
    pub severity: Severity,
    pub summary: String,
    pub evidence: Vec<String>,
    pub fix: Option<String>,
}

fn cpu_list(cpus: &[u32]) -> String {
    let mut out = Vec::new();
    let mut i = 0;
    while i < cpus.len() {
        let start = cpus[i];
        let mut end = start;
        while i + 1 < cpus.len() && cpus[i + 1] == end + 1 {
            i += 1;
            end = cpus[i];
        }
        out.push(if start == end {
            start.to_string()
        } else {
            format!("{start}-{end}")
        });
        i += 1;
    }
    out.join(",")
}

/// The NUMA node of each CPU.
fn cpu_nodes(t: &Topology) -> BTreeMap<u32, i32> {
    t.nodes
        .iter()
        .flat_map(|n| n.cpus.iter().map(move |c| (*c, n.id)))
        .collect()
}

/// The one node every thread of the target may run on (`Cpus_allowed_list`), if there is
/// one.
fn threads_node(nodes: &BTreeMap<u32, i32>, target: &Target) -> Option<i32> {
    let mut allowed = target
        .threads
        .iter()
        .flat_map(|th| th.cpus_allowed.iter())
        .map(|c| nodes.get(c).copied());
    let first = allowed.next()??;
    allowed.all(|n| n == Some(first)).then_some(first)
}

/// Most of the rank's resident pages off `home` (`where_` says what `home` is).
fn memory_remote(target: &Target, home: i32, where_: &str) -> Option<Finding> {
    let total: u64 = target.pages_per_node.values().sum();
    let local = target.pages_per_node.get(&home).copied().unwrap_or(0);
    (total > 0 && local * 2 < total).then(|| Finding {
        id: "memory_remote",
        severity: if local * 5 < total {
            Severity::Error
        } else {
            Severity::Warn
        },
        summary: format!(
            "{:.0}% of the rank's resident pages are off {where_} node {home}",
            100.0 * (total - local) as f64 / total as f64
        ),
        evidence: vec![format!(
            "proc/{}/numa_maps: pages per node {:?}",
            target.pid, target.pages_per_node
        )],
        fix: Some(format!(
            "launch with numactl --membind={home} (or migratepages {} all {home} to move it now)",
            target.pid
        )),
    })
}

/// The nodes of the target's GPUs (known ones only).
fn gpu_nodes(t: &Topology, target: &Target) -> BTreeSet<i32> {
    t.gpus
        .iter()
        .filter(|g| target.gpus.contains(&g.bus_id) && g.numa_node >= 0)
        .map(|g| g.numa_node)
        .collect()
}

/// All findings for this topology.
#[must_use]
pub fn diagnose(t: &Topology) -> Vec<Finding> {
    let mut out = Vec::new();
    let multi_node = t.nodes.len() > 1;
    if let Some(mode) = t.numa_balancing.filter(|m| *m != 0) {
        out.push(Finding {
            id: "numa_balancing_enabled",
            severity: if multi_node {
                Severity::Warn
            } else {
                Severity::Info
            },
            summary: format!(
                "automatic NUMA balancing is on (mode {mode}): it migrates pages and tasks under \
                 a running job{}",
                if multi_node {
                    ""
                } else {
                    " (this host has one node, so it has nothing to move)"
                }
            ),
            evidence: vec![format!("proc/sys/kernel/numa_balancing = {mode}")],
            fix: Some("sysctl -w kernel.numa_balancing=0".into()),
        });
    }
    for g in t.gpus.iter().filter(|g| g.numa_node < 0 && multi_node) {
        out.push(Finding {
            id: "gpu_numa_unknown",
            severity: Severity::Info,
            summary: format!(
                "GPU {} has no NUMA node in sysfs: placement checks skip it",
                g.bus_id
            ),
            evidence: vec![format!("sys/bus/pci/devices/{}/numa_node = -1", g.bus_id)],
            fix: Some(
                "check the BIOS ACPI SRAT/_PXM settings; the platform does not report it".into(),
            ),
        });
    }
    ib_findings(t, &mut out);
    if let Some(target) = &t.target {
        target_findings(t, target, &mut out);
    }
    out.sort_by(|a, b| b.severity.cmp(&a.severity).then(a.id.cmp(b.id)));
    out
}

fn ib_findings(t: &Topology, out: &mut Vec<Finding>) {
    let best = t
        .nics
        .iter()
        .flat_map(|n| &n.ports)
        .filter(|p| p.is_up())
        .filter_map(super::topology::Port::gbps)
        .fold(0.0, f64::max);
    for nic in &t.nics {
        for p in &nic.ports {
            let file = format!("sys/class/infiniband/{}/ports/{}", nic.name, p.port);
            if !p.is_up() {
                out.push(Finding {
                    id: "ib_port_down",
                    severity: Severity::Error,
                    summary: format!("{} port {} is not ACTIVE/LinkUp", nic.name, p.port),
                    evidence: vec![
                        format!("{file}/state = {}", p.state),
                        format!("{file}/phys_state = {}", p.phys_state),
                    ],
                    fix: Some(format!(
                        "ibstat {} {}; check the cable and the switch port",
                        nic.name, p.port
                    )),
                });
            } else if p.gbps().is_some_and(|r| r < best) {
                out.push(Finding {
                    id: "ib_port_down",
                    severity: Severity::Warn,
                    summary: format!(
                        "{} port {} runs at {} while others run at {best} Gb/s",
                        nic.name, p.port, p.rate
                    ),
                    evidence: vec![format!("{file}/rate = {}", p.rate)],
                    fix: Some(format!(
                        "ibstat {} {}; reseat or replace the cable, check the switch port speed",
                        nic.name, p.port
                    )),
                });
            }
        }
    }
}

fn target_findings(t: &Topology, target: &Target, out: &mut Vec<Finding>) {
    let env = |k: &str| target.env.get(k).map(String::as_str);
    let any_ib_up = t.nics.iter().any(|n| {
        n.ports
            .iter()
            .any(|p| p.is_up() && p.link_layer == "InfiniBand")
    });
    if env("NCCL_IB_DISABLE") == Some("1") && any_ib_up {
        out.push(Finding {
            id: "nccl_ib_disabled",
            severity: Severity::Warn,
            summary:
                "NCCL_IB_DISABLE=1 while an InfiniBand port is active: NCCL falls back to sockets"
                    .into(),
            evidence: vec![format!("proc/{}/environ: NCCL_IB_DISABLE=1", target.pid)],
            fix: Some("unset NCCL_IB_DISABLE in the job's environment".into()),
        });
    }
    if let Some(level) =
        env("NCCL_DEBUG").filter(|l| matches!(l.to_ascii_uppercase().as_str(), "INFO" | "TRACE"))
    {
        out.push(Finding {
            id: "nccl_debug_verbose",
            severity: Severity::Info,
            summary: format!(
                "NCCL_DEBUG={level} is set: verbose NCCL logging costs time in production"
            ),
            evidence: vec![format!("proc/{}/environ: NCCL_DEBUG={level}", target.pid)],
            fix: Some("NCCL_DEBUG=WARN (or unset it) once the job is healthy".into()),
        });
    }
    if target.gpus.is_empty() {
        out.push(Finding {
            id: "gpu_unknown",
            severity: Severity::Info,
            summary: format!(
                "no GPU found for pid {}: {}",
                target.pid, target.gpus_source
            ),
            evidence: vec![],
            fix: None,
        });
    }
    let nodes = cpu_nodes(t);
    let gpu_nodes = gpu_nodes(t, target);
    let Some(&home) = gpu_nodes.iter().next() else {
        // No GPU to place the rank by: its memory against the node its threads are bound
        // to, where they all are.
        if let Some(home) = threads_node(&nodes, target).filter(|_| t.nodes.len() > 1) {
            out.extend(memory_remote(target, home, "the node its threads run on,"));
        }
        return;
    };
    if !t.nodes.iter().any(|n| n.id == home) || t.nodes.len() < 2 {
        return;
    }
    let home_cpus: Vec<u32> = t
        .nodes
        .iter()
        .filter(|n| n.id == home)
        .flat_map(|n| n.cpus.iter().copied())
        .collect();
    let fix_cpus = format!(
        "taskset -apc {} {}   # or launch with: numactl --cpunodebind={home} --membind={home} <command>",
        cpu_list(&home_cpus),
        target.pid
    );
    // Threads allowed on, or last seen on, other nodes.
    let mut allowed_remote = Vec::new();
    let mut ran_remote = Vec::new();
    for th in &target.threads {
        if th
            .cpus_allowed
            .iter()
            .any(|c| nodes.get(c).is_some_and(|n| *n != home))
        {
            allowed_remote.push(th);
        }
        if let Some(node) = th
            .last_cpu
            .and_then(|c| nodes.get(&c))
            .filter(|n| **n != home)
        {
            ran_remote.push((th, *node));
        }
    }
    if !ran_remote.is_empty() || !allowed_remote.is_empty() {
        let mut evidence: Vec<String> = ran_remote
            .iter()
            .take(8)
            .map(|(th, n)| {
                format!(
                    "thread {} ({}) last ran on CPU {} (node {n})",
                    th.tid,
                    th.name,
                    th.last_cpu.unwrap_or(0)
                )
            })
            .collect();
        evidence.push(format!(
            "{} of {} threads may run outside node {home} (Cpus_allowed_list in proc/{}/task/*/status)",
            allowed_remote.len(),
            target.threads.len(),
            target.pid
        ));
        out.push(Finding {
            id: "cpu_affinity_remote",
            severity: if ran_remote.is_empty() { Severity::Warn } else { Severity::Error },
            summary: format!(
                "the rank's GPU is on node {home}, but {} of its threads last ran on another node and {} may",
                ran_remote.len(),
                allowed_remote.len()
            ),
            evidence,
            fix: Some(fix_cpus.clone()),
        });
    }
    out.extend(memory_remote(target, home, "its GPU's node"));
    let nic_nodes: BTreeSet<i32> = t
        .nics
        .iter()
        .filter(|n| n.numa_node >= 0 && n.ports.iter().any(super::topology::Port::is_up))
        .map(|n| n.numa_node)
        .collect();
    if !nic_nodes.is_empty() && !nic_nodes.contains(&home) {
        let on: Vec<String> = t
            .nics
            .iter()
            .map(|n| format!("{} on node {}", n.name, n.numa_node))
            .collect();
        out.push(Finding {
            id: "gpu_nic_remote",
            severity: Severity::Warn,
            summary: format!("no active NIC on the GPU's node {home}: NCCL traffic crosses the inter-socket link"),
            evidence: on,
            fix: Some("place the rank on a GPU with a NIC on its node, or set NCCL_IB_HCA to the nearest HCA".into()),
        });
    }
    if target
        .threads
        .iter()
        .all(|th| th.cpus_allowed.len() == nodes.len())
        && allowed_remote.len() == target.threads.len()
    {
        out.push(Finding {
            id: "threads_unpinned",
            severity: Severity::Info,
            summary: "the rank's threads may run on every CPU of every node".into(),
            evidence: vec![format!("Cpus_allowed_list covers all {} CPUs", nodes.len())],
            fix: Some(fix_cpus),
        });
    }
    let remote_children: Vec<String> = target
        .children
        .iter()
        .filter_map(|c| {
            let node = c.last_cpu.and_then(|cpu| nodes.get(&cpu))?;
            (*node != home).then(|| format!("child {} ({}) last ran on node {node}", c.pid, c.name))
        })
        .collect();
    if !remote_children.is_empty() {
        out.push(Finding {
            id: "dataloader_remote",
            severity: Severity::Warn,
            summary: format!(
                "{} child processes (dataloader workers?) run off the GPU's node {home}",
                remote_children.len()
            ),
            evidence: remote_children,
            fix: Some(format!(
                "pin workers in worker_init_fn: os.sched_setaffinity(0, {{{}}})",
                cpu_list(&home_cpus)
            )),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CPU lists are written back the way the kernel writes them.
    #[test]
    fn cpu_lists_round_trip() {
        assert_eq!(cpu_list(&[0, 1, 2, 3, 8, 10, 11]), "0-3,8,10-11");
        assert_eq!(cpu_list(&[]), "");
    }
}
