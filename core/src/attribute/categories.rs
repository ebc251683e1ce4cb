//! The categories a thread's time is cut into (`docs/attribution.md`): their names,
//! written once here, the per-step sums, and which a run could not measure.

use serde::Serialize;

/// The category names in output order (JSON keys, CSV columns, table rows, trace args).
pub const NAMES: [&str; 8] = [
    "compute",
    "gpu_wait",
    "nccl_wait",
    "page_fault",
    "remote_memory",
    "cpu_migration",
    "runqueue",
    "other_offcpu",
];

/// Time per category, in ns. Serialized as a map of the eight names, a category the
/// profile could not measure as `null` (never 0).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Categories {
    pub compute: u64,
    /// Inside a CUDA sync with no collective of a multi-rank communicator outstanding:
    /// the host waits for the GPU's own work.
    pub gpu_wait: u64,
    pub nccl_wait: u64,
    pub page_fault: u64,
    /// Always `None` here: no PMU on these machines, see `remote_memory` in the report.
    pub remote_memory: Option<u64>,
    pub cpu_migration: u64,
    pub runqueue: u64,
    pub other_offcpu: u64,
    /// Which of the others the profile could not measure.
    pub unmeasured: Unmeasured,
}

/// Categories a run could not measure (the reason is in the report's `methods`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Unmeasured {
    /// No CUDA sync probe was attached and no NCCL call blocked the host: waits for NCCL
    /// cannot be told apart.
    pub nccl_wait: bool,
    /// No CUDA sync probe was attached, but NCCL calls blocked the host: `nccl_wait` holds
    /// those, a lower bound.
    pub nccl_wait_lower_bound: bool,
    /// No on-CPU sampling and no fault timing: fault time stays in `compute`.
    pub page_fault: bool,
}

impl Unmeasured {
    /// No CUDA sync probe was attached: where the host waited for the GPU is not seen
    /// (spinning reads `compute`, sleeping `other_offcpu`).
    #[must_use]
    pub fn gpu_wait(&self) -> bool {
        self.nccl_wait || self.nccl_wait_lower_bound
    }
}

impl Serialize for Categories {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap as _;
        let named = self.named();
        let mut map = serializer.serialize_map(Some(named.len()))?;
        for (name, value) in named {
            map.serialize_entry(name, &value)?;
        }
        map.end()
    }
}

impl Categories {
    /// Category names and values, in output order.
    #[must_use]
    pub fn named(&self) -> [(&'static str, Option<u64>); 8] {
        let values = [
            Some(self.compute),
            (!self.unmeasured.gpu_wait()).then_some(self.gpu_wait),
            (!self.unmeasured.nccl_wait).then_some(self.nccl_wait),
            (!self.unmeasured.page_fault).then_some(self.page_fault),
            self.remote_memory,
            Some(self.cpu_migration),
            Some(self.runqueue),
            Some(self.other_offcpu),
        ];
        std::array::from_fn(|i| (NAMES[i], values[i]))
    }

    #[must_use]
    pub fn total(&self) -> u64 {
        self.named().iter().filter_map(|(_, v)| *v).sum()
    }

    pub(crate) fn add(&mut self, other: &Categories) {
        self.unmeasured = other.unmeasured;
        // Measured once a PMU is there: a sum of the steps that have it.
        self.remote_memory = match (self.remote_memory, other.remote_memory) {
            (Some(a), Some(b)) => Some(a.saturating_add(b)),
            (a, b) => a.or(b),
        };
        self.compute += other.compute;
        self.gpu_wait += other.gpu_wait;
        self.nccl_wait += other.nccl_wait;
        self.page_fault += other.page_fault;
        self.cpu_migration += other.cpu_migration;
        self.runqueue += other.runqueue;
        self.other_offcpu += other.other_offcpu;
    }
}

/// One category, for pieces of a thread's time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Cat {
    Compute,
    GpuWait,
    NcclWait,
    PageFault,
    CpuMigration,
    Runqueue,
    OtherOffcpu,
}

impl Cat {
    /// The name used in outputs.
    #[must_use]
    pub fn name(self) -> &'static str {
        NAMES[match self {
            Cat::Compute => 0,
            Cat::GpuWait => 1,
            Cat::NcclWait => 2,
            Cat::PageFault => 3,
            Cat::CpuMigration => 5,
            Cat::Runqueue => 6,
            Cat::OtherOffcpu => 7,
        }]
    }
}

impl Categories {
    pub(crate) fn slot(&mut self, cat: Cat) -> &mut u64 {
        match cat {
            Cat::Compute => &mut self.compute,
            Cat::GpuWait => &mut self.gpu_wait,
            Cat::NcclWait => &mut self.nccl_wait,
            Cat::PageFault => &mut self.page_fault,
            Cat::CpuMigration => &mut self.cpu_migration,
            Cat::Runqueue => &mut self.runqueue,
            Cat::OtherOffcpu => &mut self.other_offcpu,
        }
    }
}
