//! What is there: NUMA nodes, GPUs, NICs, NUMA balancing and the target's placement, read
//! from `proc/` and `sys/` under a root (the live host, or a capture made by `snapshot`).
//! Every file that could not be read is listed in `missing`, so a partial capture gives
//! findings for what is there and a note for the rest.

pub use nccltrace_core::procfs::{last_cpu, pages_per_node};
use std::collections::BTreeMap;
use std::path::Path;

use serde::Serialize;

use crate::host::{Host, parse_cpu_list};

/// A NUMA node.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct Node {
    pub id: i32,
    pub cpus: Vec<u32>,
    /// `numastat` counters (numa_hit, numa_miss, local_node, other_node, ...).
    pub numastat: BTreeMap<String, u64>,
}

/// An NVIDIA GPU on the PCI bus.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct Gpu {
    pub bus_id: String,
    /// -1: the platform does not say.
    pub numa_node: i32,
    /// `/dev/nvidiaN` minor, from `proc/driver/nvidia/gpus/<bus>/information`.
    pub minor: Option<u32>,
    pub used_by_target: bool,
}

/// One port of an RDMA NIC.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct Port {
    pub port: String,
    pub state: String,
    pub phys_state: String,
    pub rate: String,
    pub link_layer: String,
}

impl Port {
    /// ACTIVE and LinkUp.
    #[must_use]
    pub fn is_up(&self) -> bool {
        self.state.contains("ACTIVE") && self.phys_state.contains("LinkUp")
    }

    /// Rate in Gb/s (`"200 Gb/sec (4X HDR)"` → 200).
    #[must_use]
    pub fn gbps(&self) -> Option<f64> {
        self.rate.split_whitespace().next()?.parse().ok()
    }
}

/// An RDMA NIC (`sys/class/infiniband/<hca>`).
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct Nic {
    pub name: String,
    pub numa_node: i32,
    pub ports: Vec<Port>,
}

/// One thread of the target.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct Thread {
    pub tid: u32,
    pub name: String,
    pub cpus_allowed: Vec<u32>,
    pub last_cpu: Option<u32>,
}

/// A child process (dataloader workers, compile workers).
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct Child {
    pub pid: u32,
    pub name: String,
    pub last_cpu: Option<u32>,
}

/// The traced process.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct Target {
    pub pid: u32,
    pub comm: String,
    pub threads: Vec<Thread>,
    pub mems_allowed: Vec<u32>,
    /// Resident pages per node, from `numa_maps`.
    pub pages_per_node: BTreeMap<i32, u64>,
    /// NCCL, CUDA, PyTorch and launcher variables from its environment.
    pub env: BTreeMap<String, String>,
    /// GPU bus ids it has open (`/dev/nvidiaN`), else from CUDA_VISIBLE_DEVICES/LOCAL_RANK.
    pub gpus: Vec<String>,
    /// How `gpus` was found.
    pub gpus_source: String,
    pub nccl_library: Option<String>,
    pub nccl_version: Option<String>,
    pub children: Vec<Child>,
}

/// Everything the doctor reads.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct Topology {
    pub nodes: Vec<Node>,
    pub gpus: Vec<Gpu>,
    pub nics: Vec<Nic>,
    pub numa_balancing: Option<u32>,
    pub target: Option<Target>,
    /// Files that were expected but were not there.
    pub missing: Vec<String>,
    /// Files that were there but this user may not read (permission denied): a diagnosis
    /// without them is partial; run as root.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unreadable: Vec<String>,
}

/// Environment variables worth reporting (never the whole environment: it holds secrets).
fn interesting_env(name: &str) -> bool {
    const PREFIXES: [&str; 5] = ["NCCL_", "CUDA_", "TORCH_", "PYTORCH_", "NVIDIA_"];
    const NAMES: [&str; 10] = [
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "OMP_NUM_THREADS",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "SLURM_PROCID",
        "SLURM_LOCALID",
        "PMI_RANK",
    ];
    PREFIXES.iter().any(|p| name.starts_with(p)) || NAMES.contains(&name)
}

struct Reader<'a> {
    host: &'a Host,
    missing: Vec<String>,
    unreadable: Vec<String>,
    /// Files read, and links followed: what `snapshot` copies.
    read: Vec<String>,
    links: Vec<String>,
}

impl Reader<'_> {
    fn read(&mut self, rel: &str) -> Option<String> {
        match std::fs::read_to_string(self.host.path(rel)) {
            Ok(text) => {
                self.read.push(rel.to_owned());
                Some(text)
            }
            Err(e) => {
                self.not_read(rel, &e);
                None
            }
        }
    }

    /// Files the user may not read are told apart from files that are not there.
    fn not_read(&mut self, rel: &str, e: &std::io::Error) {
        if e.kind() == std::io::ErrorKind::PermissionDenied {
            self.unreadable.push(rel.to_owned());
        } else {
            self.missing.push(rel.to_owned());
        }
    }

    fn read_opt(&mut self, rel: &str) -> Option<String> {
        match std::fs::read_to_string(self.host.path(rel)) {
            Ok(text) => {
                self.read.push(rel.to_owned());
                Some(text)
            }
            Err(e) => {
                if e.kind() == std::io::ErrorKind::PermissionDenied {
                    self.unreadable.push(rel.to_owned());
                }
                None
            }
        }
    }

    fn list(&mut self, rel: &str) -> Vec<String> {
        let dir = match std::fs::read_dir(self.host.path(rel)) {
            Ok(dir) => dir,
            Err(e) => {
                self.not_read(rel, &e);
                return Vec::new();
            }
        };
        let mut names: Vec<String> = dir
            .flatten()
            .filter_map(|e| e.file_name().to_str().map(str::to_owned))
            .collect();
        names.sort();
        names
    }
}

fn parse_int(text: &str) -> Option<i64> {
    let t = text.trim();
    t.strip_prefix("0x")
        .map_or_else(|| t.parse().ok(), |h| i64::from_str_radix(h, 16).ok())
}

/// The parent pid: field 4 of `stat`.
fn ppid(stat: &str) -> Option<u32> {
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_whitespace().nth(1)?.parse().ok()
}

fn status_field(status: &str, key: &str) -> Option<String> {
    status.lines().find_map(|l| {
        l.strip_prefix(key)?
            .strip_prefix(':')
            .map(|v| v.trim().to_owned())
    })
}

/// The NCCL version from a PyPI layout (`site-packages/nvidia/nccl/lib/libnccl.so.2` next
/// to `nvidia_nccl_cu12-2.28.9.dist-info`) or a versioned file name (`libnccl.so.2.28.9`).
fn nccl_version(root: &Path, library: &str) -> Option<String> {
    let name = Path::new(library).file_name()?.to_str()?;
    if let Some(v) = name
        .strip_prefix("libnccl.so.")
        .filter(|v| v.matches('.').count() >= 2)
    {
        return Some(v.to_owned());
    }
    let site = Path::new(library).ancestors().nth(4)?;
    let dir = root.join(site.strip_prefix("/").unwrap_or(site));
    std::fs::read_dir(dir).ok()?.flatten().find_map(|e| {
        let n = e.file_name().to_str()?.to_owned();
        let rest = n
            .strip_prefix("nvidia_nccl_cu")?
            .strip_suffix(".dist-info")?;
        Some(rest.split_once('-')?.1.to_owned())
    })
}

fn read_nodes(r: &mut Reader<'_>) -> Vec<Node> {
    let mut nodes = Vec::new();
    for name in r.list("sys/devices/system/node") {
        let Some(id) = name
            .strip_prefix("node")
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        let cpus = r
            .read(&format!("sys/devices/system/node/{name}/cpulist"))
            .map_or_else(Vec::new, |t| parse_cpu_list(&t));
        let numastat = r
            .read_opt(&format!("sys/devices/system/node/{name}/numastat"))
            .map(|t| crate::host::parse_numastat(&t).into_iter().collect())
            .unwrap_or_default();
        nodes.push(Node { id, cpus, numastat });
    }
    nodes.sort_by_key(|n| n.id);
    nodes
}

fn read_gpus(r: &mut Reader<'_>) -> Vec<Gpu> {
    let mut gpus = Vec::new();
    for bus in r.list("sys/bus/pci/devices") {
        let dir = format!("sys/bus/pci/devices/{bus}");
        let vendor = r
            .read_opt(&format!("{dir}/vendor"))
            .and_then(|v| parse_int(&v));
        let class = r
            .read_opt(&format!("{dir}/class"))
            .and_then(|v| parse_int(&v));
        // 0x10de: NVIDIA; class 0x0300xx VGA or 0x0302xx 3D controller.
        let is_gpu =
            vendor == Some(0x10de) && class.is_some_and(|c| matches!(c >> 8, 0x0300 | 0x0302));
        if !is_gpu {
            continue;
        }
        let numa_node = r
            .read(&format!("{dir}/numa_node"))
            .and_then(|v| parse_int(&v))
            .unwrap_or(-1) as i32;
        let minor = r
            .read_opt(&format!("proc/driver/nvidia/gpus/{bus}/information"))
            .and_then(|t| status_field(&t, "Device Minor"))
            .and_then(|v| v.parse().ok());
        gpus.push(Gpu {
            bus_id: bus,
            numa_node,
            minor,
            used_by_target: false,
        });
    }
    gpus
}

fn read_nics(r: &mut Reader<'_>) -> Vec<Nic> {
    let mut nics = Vec::new();
    let Ok(dir) = std::fs::read_dir(r.host.path("sys/class/infiniband")) else {
        return nics;
    };
    let mut names: Vec<String> = dir
        .flatten()
        .filter_map(|e| e.file_name().to_str().map(str::to_owned))
        .collect();
    names.sort();
    for name in names {
        let base = format!("sys/class/infiniband/{name}");
        let numa_node = r
            .read_opt(&format!("{base}/device/numa_node"))
            .and_then(|v| parse_int(&v))
            .unwrap_or(-1) as i32;
        let mut ports = Vec::new();
        for port in r.list(&format!("{base}/ports")) {
            let get = |r: &mut Reader<'_>, f: &str| {
                r.read(&format!("{base}/ports/{port}/{f}"))
                    .map(|s| s.trim().to_owned())
                    .unwrap_or_default()
            };
            ports.push(Port {
                state: get(r, "state"),
                phys_state: get(r, "phys_state"),
                rate: get(r, "rate"),
                link_layer: get(r, "link_layer"),
                port,
            });
        }
        nics.push(Nic {
            name,
            numa_node,
            ports,
        });
    }
    nics
}

#[allow(clippy::too_many_lines)] // one file after the other, in the order of the docs
fn read_target(r: &mut Reader<'_>, pid: u32, gpus: &mut [Gpu]) -> Option<Target> {
    let comm = r.read(&format!("proc/{pid}/comm"))?.trim().to_owned();
    let mut threads = Vec::new();
    for tid in r.list(&format!("proc/{pid}/task")) {
        let Ok(tid) = tid.parse::<u32>() else {
            continue;
        };
        let status = r
            .read(&format!("proc/{pid}/task/{tid}/status"))
            .unwrap_or_default();
        let stat = r
            .read(&format!("proc/{pid}/task/{tid}/stat"))
            .unwrap_or_default();
        threads.push(Thread {
            tid,
            name: status_field(&status, "Name").unwrap_or_default(),
            cpus_allowed: status_field(&status, "Cpus_allowed_list")
                .map(|l| parse_cpu_list(&l))
                .unwrap_or_default(),
            last_cpu: last_cpu(&stat),
        });
    }
    threads.sort_by_key(|t| t.tid);
    let status = r.read(&format!("proc/{pid}/status")).unwrap_or_default();
    let mems_allowed = status_field(&status, "Mems_allowed_list")
        .map(|l| parse_cpu_list(&l))
        .unwrap_or_default();
    let pages = r
        .read(&format!("proc/{pid}/numa_maps"))
        .map(|t| pages_per_node(&t))
        .unwrap_or_default();
    let env: BTreeMap<String, String> = r
        .read(&format!("proc/{pid}/environ"))
        .map(|t| {
            t.split('\0')
                .filter_map(|kv| kv.split_once('='))
                .filter(|(k, _)| interesting_env(k))
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect()
        })
        .unwrap_or_default();
    // GPUs it has open: /dev/nvidiaN, N the minor.
    let mut minors = Vec::new();
    for fd in r.list(&format!("proc/{pid}/fd")) {
        if let Ok(link) = std::fs::read_link(r.host.path(&format!("proc/{pid}/fd/{fd}"))) {
            let link = link.to_string_lossy();
            if link.starts_with("/dev/") {
                r.links.push(format!("proc/{pid}/fd/{fd}"));
            }
            if let Some(n) = link
                .strip_prefix("/dev/nvidia")
                .and_then(|n| n.parse::<u32>().ok())
            {
                minors.push(n);
            }
        }
    }
    let mut used: Vec<String> = gpus
        .iter()
        .filter(|g| g.minor.is_some_and(|m| minors.contains(&m)))
        .map(|g| g.bus_id.clone())
        .collect();
    let mut gpus_source = "open /dev/nvidiaN files".to_owned();
    if used.is_empty() {
        // CUDA_VISIBLE_DEVICES (indices) or LOCAL_RANK, in PCI bus order.
        let index = env
            .get("CUDA_VISIBLE_DEVICES")
            .and_then(|v| v.split(',').next()?.trim().parse::<usize>().ok())
            .map(|i| (i, "CUDA_VISIBLE_DEVICES (first index, PCI bus order)"))
            .or_else(|| {
                env.get("LOCAL_RANK")
                    .and_then(|v| v.parse().ok())
                    .map(|i| (i, "LOCAL_RANK (PCI bus order)"))
            });
        if let Some((i, how)) = index {
            let mut sorted: Vec<&Gpu> = gpus.iter().collect();
            sorted.sort_by(|a, b| a.bus_id.cmp(&b.bus_id));
            if let Some(g) = sorted.get(i) {
                used.push(g.bus_id.clone());
                how.clone_into(&mut gpus_source);
            }
        }
    }
    if used.is_empty() {
        "none found (no /dev/nvidiaN open, no CUDA_VISIBLE_DEVICES or LOCAL_RANK)"
            .clone_into(&mut gpus_source);
    }
    for g in gpus.iter_mut() {
        g.used_by_target = used.contains(&g.bus_id);
    }
    let maps = r.read(&format!("proc/{pid}/maps")).unwrap_or_default();
    let nccl_library = crate::source::discover::parse_maps(&maps)
        .into_iter()
        .filter_map(|m| m.path)
        .find(|p| {
            Path::new(p)
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("libnccl.so"))
        });
    let nccl_version = nccl_library
        .as_deref()
        .and_then(|l| nccl_version(&r.host.path(&format!("proc/{pid}/root")), l));
    let mut children = Vec::new();
    for entry in r.list("proc") {
        let Ok(child) = entry.parse::<u32>() else {
            continue;
        };
        let Some(stat) = r.read_opt(&format!("proc/{child}/stat")) else {
            continue;
        };
        if ppid(&stat) == Some(pid) {
            let name = stat
                .split_once('(')
                .and_then(|(_, s)| s.rsplit_once(')'))
                .map(|(n, _)| n.to_owned());
            children.push(Child {
                pid: child,
                name: name.unwrap_or_default(),
                last_cpu: last_cpu(&stat),
            });
        }
    }
    Some(Target {
        pid,
        comm,
        threads,
        mems_allowed,
        pages_per_node: pages,
        env,
        gpus: used,
        gpus_source,
        nccl_library,
        nccl_version,
        children,
    })
}

/// Reads the host (and the target, when given) under `host`'s root.
#[must_use]
pub fn read(host: &Host, pid: Option<u32>) -> Topology {
    read_traced(host, pid).0
}

/// As `read`, also returning the files read and the links followed.
#[must_use]
pub fn read_traced(host: &Host, pid: Option<u32>) -> (Topology, Vec<String>, Vec<String>) {
    let mut r = Reader {
        host,
        missing: Vec::new(),
        unreadable: Vec::new(),
        read: Vec::new(),
        links: Vec::new(),
    };
    let nodes = read_nodes(&mut r);
    let mut gpus = read_gpus(&mut r);
    let nics = read_nics(&mut r);
    let numa_balancing = r
        .read("proc/sys/kernel/numa_balancing")
        .and_then(|v| v.trim().parse().ok());
    let target = pid.and_then(|pid| read_target(&mut r, pid, &mut gpus));
    let mut missing = r.missing;
    missing.sort();
    missing.dedup();
    let mut unreadable = r.unreadable;
    unreadable.sort();
    unreadable.dedup();
    (
        Topology {
            nodes,
            gpus,
            nics,
            numa_balancing,
            target,
            missing,
            unreadable,
        },
        r.read,
        r.links,
    )
}

/// Whether an environment variable is kept in reports and snapshots.
#[must_use]
pub fn keep_env(name: &str) -> bool {
    interesting_env(name)
}
