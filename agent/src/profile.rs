//! Profiles: `profiles/*.toml` presets saying which probes to attach and how large the
//! buffers are. The shipped ones are compiled in, so an installed binary has them.

use std::path::{Path, PathBuf};

use serde::Deserialize;

/// The profiles shipped with nccltrace, by name.
pub const SHIPPED: [(&str, &str); 3] = [
    ("default", include_str!("../../profiles/default.toml")),
    ("minimal", include_str!("../../profiles/minimal.toml")),
    ("full", include_str!("../../profiles/full.toml")),
];

/// Which probes to attach.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
#[allow(clippy::struct_excessive_bools)] // one switch per probe family, as the TOML has them
pub struct Probes {
    /// uprobes on the NCCL API.
    pub nccl: bool,
    /// uprobes on the CUDA driver's synchronisation calls.
    pub cuda_sync: bool,
    /// sched_switch, sched_waking, sched_migrate_task, fork and exit.
    pub sched: bool,
    /// exceptions:page_fault_user.
    pub page_faults: bool,
    /// migrate:mm_migrate_pages and sched_{move,swap,stick}_numa.
    pub numa: bool,
    /// Kernel and user stacks of target threads off the CPU.
    pub offcpu_stacks: bool,
    /// With `offcpu_stacks`: take them only for stretches off the CPU at least this long
    /// (µs), as the thread comes back; 0 (when not given): at every switch-out. Shorter
    /// stretches are counted with their time and drawn without a stack.
    #[serde(default)]
    pub offcpu_min_us: u64,
    /// With `offcpu_stacks`: kernel frames too (where in the kernel the thread blocked),
    /// not only user and Python frames (whose innermost is the blocking call, in libc).
    /// On when not given.
    #[serde(default = "yes")]
    pub offcpu_kernel_stacks: bool,
    /// User stacks at the entry of traced calls, so that waits are drawn by call site:
    /// "off", "sync" (CUDA sync calls) or "all" (and NCCL calls). Off when not given.
    #[serde(default)]
    pub call_stacks: CallStacks,
    /// Read each collective's CUDA stream (its seventh or eighth argument, on the user
    /// stack: about 100 ns more a call). Off when not given.
    #[serde(default)]
    pub streams: bool,
    /// Walk the Python frames of CPython targets (3.10 to 3.13) with every stack taken, so
    /// stacks name `function (file:line)` instead of the interpreter loop. Off when not
    /// given.
    #[serde(default)]
    pub python_frames: bool,
    /// With `python_frames`: walk them with a `bpf_loop` callback (Linux 5.17+), which the
    /// kernel verifies once, rather than an unrolled loop verified turn by turn on every
    /// path to it (most of the programs' verification, so of attaching). Kernels before
    /// 5.17 get the unrolled loop. On when not given.
    #[serde(default = "yes")]
    pub python_loop: bool,
    /// The scheduler's switch, wake-up and migration tracepoints as raw tracepoints
    /// (Linux 5.18+, with the kernel's BTF): the formatted ones build a record at every
    /// context switch and wake-up of the host, traced thread or not, before any program
    /// runs. On when not given.
    #[serde(default = "yes")]
    pub raw_tracepoints: bool,
    /// Off-CPU stacks without kernel frames and call-entry stacks: where a thread's native
    /// stack is where it was at its previous stack of that kind (same instruction, stack
    /// and frame pointers, and the innermost frame link, under a second ago), reuse those
    /// native frames instead of unwinding them again. Python frames are walked every
    /// time. Off when not given.
    #[serde(default)]
    pub reuse_stacks: bool,
    /// Which traced calls get a return probe: "all" (when not given), or "needed": only
    /// CUDA syncs, communicator creation and destruction and ncclGroupEnd
    /// (`nccltrace_common::func::return_needed`). The others are recorded at entry, one
    /// trap a call instead of two; their time inside NCCL, their result and any blocking
    /// inside them are not seen.
    #[serde(default)]
    pub call_returns: CallReturns,
    /// Attach the uprobes as one uprobe-multi link per file and program (Linux 6.6+)
    /// rather than one perf-event uprobe per function: registered at once, and released
    /// at the stop with one RCU grace period per link instead of one per function (each
    /// ~0.1 s, one after another). Kernels without them get one per function. On when not
    /// given.
    #[serde(default = "yes")]
    pub uprobe_multi: bool,
    /// Read the InfiniBand ports' counters (`/sys/class/infiniband`) while tracing, for
    /// each step's traffic and errors: the data and packet counters every 100 ms, all of
    /// them every second. The agent's work, not the target's. On when not given.
    #[serde(default = "yes")]
    pub infiniband: bool,
    /// Read the GPUs the targets use through NVML while tracing (utilization samples every
    /// 100 ms; clocks, power, temperature, memory and clock-event reasons every second),
    /// on a thread of the agent's own. On when not given.
    #[serde(default = "yes")]
    pub gpu: bool,
}

/// Which traced calls get a return probe.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum CallReturns {
    #[default]
    All,
    Needed,
}

impl CallReturns {
    /// Whether a call of function `id` gets its return probe.
    #[must_use]
    pub fn traced(self, id: u32) -> bool {
        self == CallReturns::All || nccltrace_common::func::return_needed(id)
    }
}

fn yes() -> bool {
    true
}

impl Probes {
    /// Off-CPU stacks are taken: they ride on the scheduler tracepoints.
    #[must_use]
    pub fn offcpu_on(&self) -> bool {
        self.offcpu_stacks && self.sched
    }
}

/// Which traced calls get their entry stack.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum CallStacks {
    #[default]
    Off,
    Sync,
    All,
}

impl CallStacks {
    /// The kernel program's setting (`Config::call_stacks`).
    #[must_use]
    pub fn setting(self) -> u32 {
        use nccltrace_common::call_stacks as c;
        match self {
            CallStacks::Off => c::OFF,
            CallStacks::Sync => c::SYNC,
            CallStacks::All => c::ALL,
        }
    }
}

/// Buffer sizes.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Buffers {
    /// Ring buffer size in MiB (rounded up to a power of two).
    pub ring_buffer_mib: u32,
}

/// On-CPU sampling.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Sampling {
    /// Samples per second of a target thread's CPU time (0: off). Page-fault time is
    /// measured from these.
    pub hz: u32,
    /// Where the sampling clocks run (`cpu` when the profile does not say).
    #[serde(default)]
    pub scope: SampleScope,
}

/// Where the on-CPU sampling clocks run.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum SampleScope {
    /// One clock per CPU, samples of other processes dropped in the kernel (as `perf record
    /// -a` and bpftrace's `profile:hz` do): every CPU is interrupted `hz` times a second,
    /// but a target thread's context switches and migrations cost nothing extra.
    #[default]
    Cpu,
    /// One clock per target thread, inherited by the threads it creates: no interrupts on
    /// other CPUs, but each switch and migration of a target thread stops and restarts its
    /// clock (about 30 µs a migration on a 2-vCPU VM, docs/benchmarks.md).
    Thread,
}

/// What the agent spends on measuring its own cost.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Cost {
    /// Milliseconds of each second the agent's programs count and time their own runs
    /// (1000: always; 0: never, `agent.bpf` null): while they do, each run of one costs
    /// two more clock reads. `bpf_stats_ms`, its name while the kernel's accounting
    /// (`kernel.bpf_stats_enabled`) did this, is still read (issue 59).
    #[serde(default = "Cost::default_timing_ms", alias = "bpf_stats_ms")]
    pub timing_ms: u32,
}

impl Cost {
    fn default_timing_ms() -> u32 {
        100
    }
}

impl Default for Cost {
    fn default() -> Cost {
        Cost {
            timing_ms: Cost::default_timing_ms(),
        }
    }
}

/// A parsed profile.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    #[serde(skip)]
    pub name: String,
    pub description: String,
    pub probes: Probes,
    pub sampling: Sampling,
    pub buffers: Buffers,
    /// `[cost]`, optional.
    #[serde(default)]
    pub cost: Cost,
}

/// A profile that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    #[error(
        "no profile named {name:?} and no such file: use one of default, minimal, full, \
         or the path of a TOML file"
    )]
    NotFound { name: String },
    #[error("cannot read profile {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("profile {name} is not valid: {source}")]
    Parse {
        name: String,
        #[source]
        source: Box<toml::de::Error>,
    },
    #[error("profile {name}: sampling hz must be at most 100000, found {value}")]
    SampleRate { name: String, value: u32 },
    #[error("profile {name}: ring_buffer_mib must be between 1 and 1024, found {value}")]
    RingBufferSize { name: String, value: u32 },
    #[error(
        "profile {name}: [cost] timing_ms (bpf_stats_ms before) must be between 0 (never) \
         and 1000 (always), found {value}"
    )]
    StatsWindow { name: String, value: u32 },
}

impl Profile {
    /// Parses a profile's TOML text.
    pub fn parse(name: &str, text: &str) -> Result<Profile, ProfileError> {
        let mut profile: Profile = toml::from_str(text).map_err(|source| ProfileError::Parse {
            name: name.to_owned(),
            source: Box::new(source),
        })?;
        name.clone_into(&mut profile.name);
        let mib = profile.buffers.ring_buffer_mib;
        if !(1..=1024).contains(&mib) {
            return Err(ProfileError::RingBufferSize {
                name: name.to_owned(),
                value: mib,
            });
        }
        if profile.cost.timing_ms > 1000 {
            return Err(ProfileError::StatsWindow {
                name: name.to_owned(),
                value: profile.cost.timing_ms,
            });
        }
        if profile.sampling.hz > 100_000 {
            return Err(ProfileError::SampleRate {
                name: name.to_owned(),
                value: profile.sampling.hz,
            });
        }
        Ok(profile)
    }

    /// A shipped profile by name, or a TOML file by path.
    pub fn load(name_or_path: &str) -> Result<Profile, ProfileError> {
        if let Some((name, text)) = SHIPPED.iter().find(|(n, _)| *n == name_or_path) {
            return Profile::parse(name, text);
        }
        let path = Path::new(name_or_path);
        if !path.exists() {
            return Err(ProfileError::NotFound {
                name: name_or_path.to_owned(),
            });
        }
        let text = std::fs::read_to_string(path).map_err(|source| ProfileError::Read {
            path: path.to_owned(),
            source,
        })?;
        Profile::parse(&path.display().to_string(), &text)
    }

    /// Overrides the sampling rate (`--sample-hz`).
    pub fn set_sample_hz(&mut self, hz: u32) -> Result<(), ProfileError> {
        if hz > 100_000 {
            return Err(ProfileError::SampleRate {
                name: self.name.clone(),
                value: hz,
            });
        }
        self.sampling.hz = hz;
        Ok(())
    }

    /// Ring buffer size in bytes: a power of two, as the kernel requires.
    #[must_use]
    pub fn ring_buffer_bytes(&self) -> u32 {
        (self.buffers.ring_buffer_mib << 20).next_power_of_two()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every shipped profile parses, and `minimal` leaves out what it says it does.
    #[test]
    fn shipped_profiles_load() {
        for (name, _) in SHIPPED {
            let p = Profile::load(name).unwrap();
            assert_eq!(p.name, name);
            assert!(p.probes.nccl, "{name} traces NCCL");
        }
        let min = Profile::load("minimal").unwrap();
        assert!(!min.probes.page_faults && !min.probes.cuda_sync && min.probes.sched);
    }

    /// Sampling clocks per CPU unless a profile asks for one per thread; a profile that
    /// leaves `scope` out samples per CPU; an unknown scope is named in the error.
    #[test]
    fn sampling_scope() {
        for (name, _) in SHIPPED {
            assert_eq!(
                Profile::load(name).unwrap().sampling.scope,
                SampleScope::Cpu
            );
        }
        let default = SHIPPED[0].1;
        let thread = Profile::parse(
            "t",
            &default.replace("scope = \"cpu\"", "scope = \"thread\""),
        );
        assert_eq!(thread.unwrap().sampling.scope, SampleScope::Thread);
        let left_out = Profile::parse("l", &default.replace("scope = \"cpu\"", ""));
        assert_eq!(left_out.unwrap().sampling.scope, SampleScope::Cpu);
        let err = Profile::parse("c", &default.replace("scope = \"cpu\"", "scope = \"core\""))
            .unwrap_err();
        assert!(err.to_string().contains("core"), "{err}");
    }

    /// Profiles from a file; typos and unknown names get errors naming the problem.
    #[test]
    fn profile_errors() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.toml");
        std::fs::write(
            &path,
            SHIPPED[0]
                .1
                .replace("numa = true", "numa = true\nnuma2 = 1"),
        )
        .unwrap();
        let err = Profile::load(path.to_str().unwrap()).unwrap_err();
        assert!(err.to_string().contains("numa2"), "{err}");
        let err = Profile::load("nope").unwrap_err();
        assert!(matches!(err, ProfileError::NotFound { .. }));
        std::fs::write(
            &path,
            SHIPPED[0]
                .1
                .replace("ring_buffer_mib = 8", "ring_buffer_mib = 0"),
        )
        .unwrap();
        assert!(matches!(
            Profile::load(path.to_str().unwrap()),
            Err(ProfileError::RingBufferSize { .. })
        ));
    }

    /// `[cost] timing_ms`: 100 in the shipped profiles and where a profile leaves the
    /// section out; 0 to 1000 taken; above, an error naming the key and the range. The old
    /// name, `bpf_stats_ms`, is read as the same key.
    #[test]
    fn accounting_windows() {
        for (name, _) in SHIPPED {
            assert_eq!(Profile::load(name).unwrap().cost.timing_ms, 100, "{name}");
        }
        let default = SHIPPED[0].1;
        let without = &default[..default.find("[cost]").unwrap()];
        assert_eq!(Profile::parse("w", without).unwrap().cost.timing_ms, 100);
        let with = |key: &str, ms: &str| {
            Profile::parse(
                "c",
                &default.replace("timing_ms = 100", &format!("{key} = {ms}")),
            )
        };
        assert_eq!(with("timing_ms", "0").unwrap().cost.timing_ms, 0);
        assert_eq!(with("timing_ms", "1000").unwrap().cost.timing_ms, 1000);
        assert_eq!(with("bpf_stats_ms", "250").unwrap().cost.timing_ms, 250);
        let err = with("timing_ms", "1001").unwrap_err();
        assert!(matches!(err, ProfileError::StatsWindow { value: 1001, .. }));
        assert!(err.to_string().contains("timing_ms"), "{err}");
    }
}
