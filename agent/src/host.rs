//! Facts about the host and its processes, read from `proc/` and `sys/` under a root (the
//! live host is `/`; a capture made by `snapshot` is any folder).

pub use nccltrace_core::procfs::{
    FunctionRanges, NUMA_MAPS_EVERY, each_kallsyms_line, kallsyms_ranges, missing_capabilities,
    numa_maps_fields, numa_maps_unscanned, parse_cpu_list, parse_numastat,
};
use std::path::{Path, PathBuf};

/// Where the InfiniBand devices are.
const IB: &str = "sys/class/infiniband";

/// A place to read `proc/` and `sys/` from.
#[derive(Clone, Debug)]
pub struct Host {
    root: PathBuf,
}

impl Default for Host {
    fn default() -> Self {
        Host {
            root: PathBuf::from("/"),
        }
    }
}

impl Host {
    /// The live host.
    #[must_use]
    pub fn live() -> Host {
        Host::default()
    }

    /// A captured tree.
    #[must_use]
    pub fn at(root: &Path) -> Host {
        Host {
            root: root.to_owned(),
        }
    }

    /// Path of `rel` (such as `proc/1/maps`) under this root.
    #[must_use]
    pub fn path(&self, rel: &str) -> PathBuf {
        self.root.join(rel)
    }

    /// The text of `rel`, if it can be read.
    #[must_use]
    pub fn read(&self, rel: &str) -> Option<String> {
        std::fs::read_to_string(self.path(rel)).ok()
    }

    /// The names in folder `rel`, sorted; none if it cannot be read.
    #[must_use]
    pub fn list(&self, rel: &str) -> Vec<String> {
        let Ok(dir) = std::fs::read_dir(self.path(rel)) else {
            return Vec::new();
        };
        let mut names: Vec<String> = dir
            .flatten()
            .filter_map(|e| e.file_name().to_str().map(str::to_owned))
            .collect();
        names.sort();
        names
    }

    /// Each NUMA node's allocation counters (`sys/devices/system/node/nodeN/numastat`,
    /// pages): (node, (counter, value)), nodes whose file reads.
    #[must_use]
    pub fn numastat(&self) -> Vec<(u32, Vec<(String, u64)>)> {
        self.numa_nodes()
            .into_iter()
            .filter_map(|node| {
                let text = self.read(&format!("sys/devices/system/node/node{node}/numastat"))?;
                Some((node, parse_numastat(&text)))
            })
            .collect()
    }

    /// Every port of every InfiniBand device (`sys/class/infiniband`) as `device/port`, in
    /// order.
    #[must_use]
    pub fn ib_ports(&self) -> Vec<String> {
        self.list(IB)
            .into_iter()
            .flat_map(|d| {
                self.list(&format!("{IB}/{d}/ports"))
                    .into_iter()
                    .map(move |p| format!("{d}/{p}"))
            })
            .collect()
    }

    /// The folder of an InfiniBand port (`device/port`, from [`Host::ib_ports`]).
    #[must_use]
    pub fn ib_port_dir(port: &str) -> String {
        let (device, port) = port.split_once('/').unwrap_or((port, ""));
        format!("{IB}/{device}/ports/{port}")
    }

    /// The number a counter file (a path from [`Host::ib_counter_files`]) holds.
    #[must_use]
    pub fn ib_value(&self, path: &str) -> Option<u64> {
        self.read(path)?.trim().parse().ok()
    }

    /// The files of an InfiniBand port (`device/port`) that hold the counters of
    /// [`nccltrace_common::IB_COUNTER_NAMES`]: (index, path), each from `counters/` where
    /// the port has it there, else from `hw_counters/`.
    #[must_use]
    pub fn ib_counter_files(&self, port: &str) -> Vec<(u8, String)> {
        let dir = Self::ib_port_dir(port);
        let (pma, hw) = (
            self.list(&format!("{dir}/counters")),
            self.list(&format!("{dir}/hw_counters")),
        );
        let has = |names: &[String], name: &str| names.iter().any(|n| n == name);
        nccltrace_common::IB_COUNTER_NAMES
            .iter()
            .enumerate()
            .filter_map(|(i, name)| {
                let folder = if has(&pma, name) {
                    "counters"
                } else if has(&hw, name) {
                    "hw_counters"
                } else {
                    return None;
                };
                Some((u8::try_from(i).ok()?, format!("{dir}/{folder}/{name}")))
            })
            .collect()
    }

    /// The NUMA nodes the kernel has (`sys/devices/system/node/nodeN`), in order.
    #[must_use]
    pub fn numa_nodes(&self) -> Vec<u32> {
        let mut nodes: Vec<u32> = self
            .list("sys/devices/system/node")
            .iter()
            .filter_map(|n| n.strip_prefix("node")?.parse().ok())
            .collect();
        nodes.sort_unstable();
        nodes
    }

    /// The environment `pid` was started with (`/proc/PID/environ`); empty if unreadable.
    #[must_use]
    pub fn environ(&self, pid: u32) -> Vec<(String, String)> {
        self.read(&format!("proc/{pid}/environ"))
            .unwrap_or_default()
            .split('\0')
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect()
    }

    /// `/proc/PID` exists and is not a zombie.
    #[must_use]
    pub fn process_alive(&self, pid: u32) -> bool {
        let state = self
            .stat_fields(pid)
            .and_then(|f| f.first().and_then(|s| s.chars().next()));
        !matches!(state, Some('Z' | 'X') | None)
    }

    /// The fields of `/proc/PID/stat` after the parenthesised comm (which may itself hold
    /// ')'): the state first.
    fn stat_fields(&self, pid: u32) -> Option<Vec<String>> {
        let stat = self.read(&format!("proc/{pid}/stat"))?;
        let (_, rest) = stat.rsplit_once(')')?;
        Some(rest.split_whitespace().map(str::to_owned).collect())
    }

    /// The process's parent (`/proc/PID/stat`'s fourth field).
    #[must_use]
    pub fn parent_pid(&self, pid: u32) -> Option<u32> {
        self.stat_fields(pid)?.get(1)?.parse().ok()
    }

    /// Peak resident memory (`VmHWM` in status), in KiB.
    #[must_use]
    pub fn peak_rss_kb(&self, pid: u32) -> Option<u64> {
        self.status_kb(pid, "VmHWM")
    }

    /// A `kB` figure of `/proc/PID/status` (`VmRSS`, `VmHWM`, …).
    #[must_use]
    pub fn status_kb(&self, pid: u32, key: &str) -> Option<u64> {
        let status = self.read(&format!("proc/{pid}/status"))?;
        let line = status
            .lines()
            .find(|l| l.strip_prefix(key).is_some_and(|r| r.starts_with(':')))?;
        line.split_whitespace().nth(1)?.parse().ok()
    }

    /// The process name.
    #[must_use]
    pub fn comm(&self, pid: u32) -> String {
        self.read(&format!("proc/{pid}/comm"))
            .map(|s| s.trim().to_owned())
            .unwrap_or_default()
    }

    /// The command line, split at NULs.
    #[must_use]
    pub fn cmdline(&self, pid: u32) -> Vec<String> {
        self.read(&format!("proc/{pid}/cmdline"))
            .map(|s| {
                s.split('\0')
                    .filter(|a| !a.is_empty())
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Thread ids of a process.
    #[must_use]
    pub fn threads(&self, pid: u32) -> Vec<u32> {
        let Ok(dir) = std::fs::read_dir(self.path(&format!("proc/{pid}/task"))) else {
            return Vec::new();
        };
        let mut tids: Vec<u32> = dir
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
            .collect();
        tids.sort_unstable();
        tids
    }

    /// What the process's launcher says of it in its environment (`/proc/PID/environ`,
    /// read once): its rank, its job and its job's rendezvous.
    #[must_use]
    pub fn launcher(&self, pid: u32) -> Launcher {
        let vars = self.environ(pid);
        Launcher {
            rank: env_rank(&vars),
            job: env_job(&vars),
            rendezvous: env_rendezvous(&vars),
            world_size: env_world_size(&vars),
        }
    }

    /// The job a launcher started the process in (see [`Launcher::job`]).
    #[must_use]
    pub fn env_job(&self, pid: u32) -> Option<(String, String)> {
        env_job(&self.environ(pid))
    }

    /// Thread ids with their names.
    #[must_use]
    pub fn thread_names(&self, pid: u32) -> Vec<(u32, String)> {
        self.threads(pid)
            .into_iter()
            .map(|tid| {
                let name = self
                    .read(&format!("proc/{pid}/task/{tid}/comm"))
                    .map(|s| s.trim().to_owned())
                    .unwrap_or_default();
                (tid, name)
            })
            .collect()
    }

    /// NUMA node of each CPU, indexed by CPU number; -1 where unknown. One node with every
    /// online CPU when the kernel has no NUMA nodes.
    #[must_use]
    pub fn cpu_nodes(&self) -> Vec<i32> {
        let online = self
            .read("sys/devices/system/cpu/online")
            .map(|s| parse_cpu_list(&s));
        let ncpu = online
            .as_ref()
            .and_then(|c| c.iter().max())
            .map_or(0, |m| *m as usize + 1);
        let mut nodes = vec![-1; ncpu];
        let Ok(dir) = std::fs::read_dir(self.path("sys/devices/system/node")) else {
            return vec![0; ncpu];
        };
        for entry in dir.flatten() {
            let name = entry.file_name();
            let Some(node) = name.to_str().and_then(|n| n.strip_prefix("node")) else {
                continue;
            };
            let Ok(node) = node.parse::<i32>() else {
                continue;
            };
            let Ok(list) = std::fs::read_to_string(entry.path().join("cpulist")) else {
                continue;
            };
            for cpu in parse_cpu_list(&list) {
                let cpu = cpu as usize;
                if cpu >= nodes.len() {
                    nodes.resize(cpu + 1, -1);
                }
                nodes[cpu] = node;
            }
        }
        nodes
    }

    /// The SLIT distance between NUMA nodes (`node_distances[a][b]`, 10 = local), from
    /// `/sys/devices/system/node/nodeN/distance`; empty when the kernel lists no nodes.
    #[must_use]
    pub fn node_distances(&self) -> Vec<Vec<u32>> {
        let mut rows = Vec::new();
        for node in 0.. {
            let Some(text) = self.read(&format!("sys/devices/system/node/node{node}/distance"))
            else {
                break;
            };
            rows.push(
                text.split_whitespace()
                    .filter_map(|d| d.parse().ok())
                    .collect(),
            );
        }
        rows
    }

    /// The policy NUMA balancing does not scan that holds most of `pid`'s resident memory,
    /// with its KiB ([`numa_maps_unscanned`]).
    #[must_use]
    pub fn numa_maps_unscanned(&self, pid: u32) -> Option<(String, u64)> {
        numa_maps_unscanned(&self.read(&format!("proc/{pid}/numa_maps"))?)
    }

    /// The resident KiB of process `pid` on each NUMA node, from its numa_maps; `None`
    /// when unreadable (the process ended).
    #[must_use]
    pub fn numa_maps_kib(&self, pid: u32) -> Option<Vec<u64>> {
        Some(parse_numa_maps(
            &self.read(&format!("proc/{pid}/numa_maps"))?,
        ))
    }
}

/// Resident KiB per node of a numa_maps text (damaged counts saturate).
#[must_use]
pub fn parse_numa_maps(text: &str) -> Vec<u64> {
    let mut kib: Vec<u64> = Vec::new();
    for (node, pages, page_kib) in numa_maps_fields(text) {
        if node >= 4096 {
            continue;
        }
        if kib.len() <= node {
            kib.resize(node + 1, 0);
        }
        kib[node] = kib[node].saturating_add(pages.saturating_mul(page_kib));
    }
    kib
}

/// The running kernel's release and the host name.
#[must_use]
pub fn uname() -> (String, String) {
    // SAFETY: utsname is plain data; uname fills it.
    let mut u: libc::utsname = unsafe { std::mem::zeroed() };
    // SAFETY: u is a valid, writable utsname.
    if unsafe { libc::uname(&raw mut u) } != 0 {
        return (String::new(), String::new());
    }
    let field = |f: &[libc::c_char]| {
        let bytes: Vec<u8> = f
            .iter()
            .take_while(|c| **c != 0)
            .map(|c| *c as u8)
            .collect();
        String::from_utf8_lossy(&bytes).into_owned()
    };
    (field(&u.release), field(&u.nodename))
}

/// Reads a clock in nanoseconds.
#[must_use]
pub fn clock_ns(clock: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: ts is valid and writable.
    unsafe { libc::clock_gettime(clock, &raw mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Hands the memory the process has freed back to the system. glibc keeps freed memory in
/// per-thread arenas: the loading's threads (the kernel BTF parsed, the programs verified)
/// left ~12 MB of it, and each window's (attribution, trace writer, finishing) would leave
/// the process a little larger at every window (the 4-minute daemon soak grew 9 MB/min
/// without this).
pub fn release_free_memory() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim only returns free pages of the allocator to the kernel.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// What a launcher put in a process's environment about it ([`Host::launcher`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Launcher {
    /// Its rank: (variable, value), the first of RANK, OMPI_COMM_WORLD_RANK, SLURM_PROCID,
    /// PMI_RANK, LOCAL_RANK that is set.
    pub rank: Option<(String, i32)>,
    /// Its job: (variable, value), the first of SLURM_JOB_ID, TORCHELASTIC_RUN_ID,
    /// PBS_JOBID, LSB_JOBID, JOB_ID that is set.
    pub job: Option<(String, String)>,
    /// Where its job met to start: `MASTER_ADDR:MASTER_PORT` where both are set
    /// (torch.distributed's `env://`, set by torchrun and most launchers).
    pub rendezvous: Option<String>,
    /// Its job's size: (variable, value), the first of WORLD_SIZE, OMPI_COMM_WORLD_SIZE,
    /// SLURM_NTASKS, PMI_SIZE that is set above 0.
    pub world_size: Option<(String, i32)>,
}

/// The value of `name` in environment `vars`.
fn env_var<'a>(vars: &'a [(String, String)], name: &str) -> Option<&'a str> {
    vars.iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
}

fn env_rank(vars: &[(String, String)]) -> Option<(String, i32)> {
    [
        "RANK",
        "OMPI_COMM_WORLD_RANK",
        "SLURM_PROCID",
        "PMI_RANK",
        "LOCAL_RANK",
    ]
    .iter()
    .find_map(|name| Some(((*name).to_owned(), env_var(vars, name)?.parse().ok()?)))
}

fn env_world_size(vars: &[(String, String)]) -> Option<(String, i32)> {
    [
        "WORLD_SIZE",
        "OMPI_COMM_WORLD_SIZE",
        "SLURM_NTASKS",
        "PMI_SIZE",
    ]
    .iter()
    .find_map(|name| {
        let n: i32 = env_var(vars, name)?.parse().ok()?;
        (n > 0).then(|| ((*name).to_owned(), n))
    })
}

fn env_job(vars: &[(String, String)]) -> Option<(String, String)> {
    [
        "SLURM_JOB_ID",
        "TORCHELASTIC_RUN_ID",
        "PBS_JOBID",
        "LSB_JOBID",
        "JOB_ID",
    ]
    .iter()
    .find_map(|name| Some(((*name).to_owned(), env_var(vars, name)?.to_owned())))
}

fn env_rendezvous(vars: &[(String, String)]) -> Option<String> {
    Some(format!(
        "{}:{}",
        env_var(vars, "MASTER_ADDR")?,
        env_var(vars, "MASTER_PORT")?
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Function ranges end at the next symbol; data symbols and zeroed (hidden) addresses
    /// are ignored.
    #[test]
    fn kallsyms() {
        let text = "ffffffff81000100 T exc_page_fault\nffffffff81000000 T other\n\
                    ffffffff81000180 t next_fn\n0000000000000000 T hidden\n\
                    ffffffff82000000 D some_data\n";
        assert_eq!(
            kallsyms_ranges(text.as_bytes(), &["exc_page_fault", "hidden"]),
            vec![(0xffff_ffff_8100_0100, 0xffff_ffff_8100_0180)]
        );
    }

    /// CPU lists as the kernel writes them.
    #[test]
    fn cpu_lists() {
        assert_eq!(parse_cpu_list("0-3,8,10-11\n"), vec![0, 1, 2, 3, 8, 10, 11]);
        assert_eq!(parse_cpu_list(""), Vec::<u32>::new());
        assert_eq!(parse_cpu_list("x,2"), vec![2]);
    }

    /// A captured tree: nodes, threads, comm and zombie detection come from files.
    #[test]
    fn captured_tree() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let mk = |rel: &str, text: &str| {
            let p = root.join(rel);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        };
        mk("sys/devices/system/cpu/online", "0-3\n");
        mk("sys/devices/system/node/node0/cpulist", "0-1\n");
        mk("sys/devices/system/node/node1/cpulist", "2-3\n");
        mk("proc/42/stat", "42 (py (x)) S 1 2 3");
        mk("proc/43/stat", "43 (dead) Z 1 2 3");
        mk("proc/42/comm", "python3\n");
        mk("proc/42/task/42/stat", "");
        mk("proc/42/task/50/stat", "");
        let host = Host::at(root);
        assert_eq!(host.cpu_nodes(), vec![0, 0, 1, 1]);
        assert!(host.process_alive(42));
        assert!(!host.process_alive(43));
        assert!(!host.process_alive(44));
        // The parent after a comm that holds ") ".
        assert_eq!(host.parent_pid(42), Some(1));
        assert_eq!(host.parent_pid(44), None);
        assert_eq!(host.comm(42), "python3");
        assert_eq!(host.threads(42), vec![42, 50]);
    }

    /// What a launcher says of a process, from one read of its environment: the first
    /// rank variable that parses, the first job variable set, the rendezvous only where
    /// both halves are set, the first job size above 0.
    #[test]
    fn launcher_from_the_environment() {
        let dir = tempfile::tempdir().unwrap();
        let write = |pid: u32, vars: &[&str]| {
            let p = dir.path().join(format!("proc/{pid}/environ"));
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, vars.join("\0")).unwrap();
        };
        write(
            7,
            &[
                "RANK=x",
                "SLURM_PROCID=3",
                "LOCAL_RANK=1",
                "JOB_ID=j",
                "TORCHELASTIC_RUN_ID=r1",
                "MASTER_ADDR=10.0.0.1",
                "MASTER_PORT=29500",
                "WORLD_SIZE=0",
                "SLURM_NTASKS=16",
            ],
        );
        write(8, &["MASTER_PORT=29500"]);
        let host = Host::at(dir.path());
        assert_eq!(
            host.launcher(7),
            Launcher {
                rank: Some(("SLURM_PROCID".into(), 3)),
                job: Some(("TORCHELASTIC_RUN_ID".into(), "r1".into())),
                rendezvous: Some("10.0.0.1:29500".into()),
                // WORLD_SIZE=0 parses but sizes no job: the next variable set counts.
                world_size: Some(("SLURM_NTASKS".into(), 16)),
            }
        );
        assert_eq!(host.env_job(7), host.launcher(7).job);
        assert_eq!(host.launcher(8), Launcher::default());
        assert_eq!(host.launcher(9), Launcher::default());
    }

    /// A port's counters from `counters/`, those it lacks there from `hw_counters/`
    /// (soft-RoCE has only these), names nccltrace does not know left out.
    #[test]
    fn infiniband_counter_files_from_both_folders() {
        let dir = tempfile::tempdir().unwrap();
        let port = "sys/class/infiniband/rxe0/ports/1";
        for (file, value) in [
            ("counters/port_xmit_data", "10"),
            ("counters/link_downed", "1"),
            ("hw_counters/link_downed", "2"),
            ("hw_counters/sent_pkts", "30"),
            ("hw_counters/lifespan", "12"),
        ] {
            let p = dir.path().join(port).join(file);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, format!("{value}\n")).unwrap();
        }
        let host = Host::at(dir.path());
        let files = host.ib_counter_files("rxe0/1");
        let with = |f: &str| format!("{port}/{f}");
        assert_eq!(
            files,
            [
                (0, with("counters/port_xmit_data")),
                (8, with("counters/link_downed")),
                (17, with("hw_counters/sent_pkts")),
            ]
        );
        let values: Vec<_> = files.iter().map(|(_, p)| host.ib_value(p)).collect();
        assert_eq!(values, [Some(10), Some(1), Some(30)]);
        assert!(host.ib_counter_files("mlx5_0/1").is_empty());
    }

    #[test]
    fn capabilities_from_status() {
        let root = "Name:\tx\nCapEff:\t000001ffffffffff\n";
        assert!(missing_capabilities(root).is_empty());
        let nobody = "CapEff:\t0000000000000000\n";
        assert_eq!(
            missing_capabilities(nobody),
            ["CAP_BPF", "CAP_PERFMON", "CAP_SYS_PTRACE"]
        );
        // CAP_SYS_ADMIN and CAP_SYS_PTRACE only, as before CAP_BPF existed.
        let admin = format!("CapEff:\t{:016x}\n", (1u64 << 21) | (1u64 << 19));
        assert!(missing_capabilities(&admin).is_empty());
    }

    /// numa_maps as the kernel writes it: pages per node, huge pages in their own size,
    /// lines without resident pages.
    #[test]
    fn resident_kib_per_node_from_numa_maps() {
        let text = "\
00400000 default file=/usr/bin/trainer mapped=3 N0=3 kernelpagesize_kB=4
7f0000000000 bind:1 anon=4096 dirty=4096 N1=4096 kernelpagesize_kB=4
7f1000000000 default anon=10 dirty=10 N0=6 N1=4 kernelpagesize_kB=4
7f2000000000 default huge anon=2 dirty=2 N1=2 kernelpagesize_kB=2048
7ffd00000000 default stack anon=3 dirty=3 N0=3 kernelpagesize_kB=4
7f3000000000 default
";
        assert_eq!(parse_numa_maps(text), [48, 16_384 + 16 + 4096]);
        assert!(parse_numa_maps("").is_empty());
        // Damaged counts saturate rather than overflow.
        let huge = format!("N0={m} N0={m} kernelpagesize_kB=2048", m = u64::MAX);
        assert_eq!(parse_numa_maps(&huge), [u64::MAX]);
        // This process's own, read live: something resident somewhere.
        let own = Host::live().numa_maps_kib(std::process::id()).unwrap();
        assert!(own.iter().sum::<u64>() > 0, "{own:?}");
    }
}
