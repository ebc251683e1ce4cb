//! The user-side event model: what every stage after `decode` reads. Plain data, no kernel
//! types; NCCL and CUDA arguments already interpreted.

use serde::Serialize;

mod func;
pub use func::{Func, Library, datatype_name, datatype_size, redop_name};

/// One reading of a GPU through NVML: each figure `None` where it was not read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Serialize)]
pub struct GpuReading {
    /// Index in the recording header's `gpus`.
    pub gpu: u32,
    /// NVML's utilization sample: (since when, CLOCK_MONOTONIC ns; the share in percent
    /// of the time from then to the reading in which a kernel ran).
    pub busy: Option<(u64, u32)>,
    pub sm_clock_mhz: Option<u32>,
    pub mem_clock_mhz: Option<u32>,
    pub temperature_c: Option<u32>,
    pub power_mw: Option<u32>,
    /// NVML's clock-event (throttle) reason bits.
    pub throttle: Option<u64>,
    pub memory_used: Option<u64>,
    /// Processes with a compute context on the GPU.
    pub processes: Option<u32>,
}

impl GpuReading {
    /// As a GPU_READING record has it.
    #[must_use]
    pub fn of(e: &nccltrace_common::GpuReadingEvent) -> GpuReading {
        use nccltrace_common::gpu as bit;
        let has = |b: u32| e.present & b != 0;
        let get = |b: u32, v: u32| has(b).then_some(v);
        GpuReading {
            gpu: e.gpu,
            busy: has(bit::BUSY).then_some((e.busy_from_ns, e.busy_pct)),
            sm_clock_mhz: get(bit::SM_CLOCK, e.sm_clock_mhz),
            mem_clock_mhz: get(bit::MEM_CLOCK, e.mem_clock_mhz),
            temperature_c: get(bit::TEMPERATURE, e.temperature_c),
            power_mw: get(bit::POWER, e.power_mw),
            throttle: has(bit::THROTTLE).then_some(e.throttle),
            memory_used: has(bit::MEMORY_USED).then_some(e.memory_used),
            processes: get(bit::PROCESSES, e.processes),
        }
    }
}

/// Who an event is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Serialize)]
pub struct Task {
    pub tgid: u32,
    pub tid: u32,
    pub cpu: u16,
}

/// One Python frame of a stack: the code object executing and how far its instruction
/// pointer was from the code object's address, in bytes. `code == 0` marks an
/// interpreter entry: the frames after it ran in an outer call of the interpreter loop.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Serialize)]
pub struct PyFrame {
    pub code: u64,
    pub offset: u32,
}

impl PyFrame {
    /// Whether this is an interpreter-entry marker rather than a frame.
    #[must_use]
    pub fn is_entry(self) -> bool {
        self.code == nccltrace_common::PY_ENTRY
    }
}

/// A traced call, with entry and exit times and its interpreted arguments.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Call {
    pub task: Task,
    pub func: Func,
    pub start_ns: u64,
    /// The return's time; `start_ns` when the return was not traced.
    pub end_ns: u64,
    /// The return value; `None` when the call was traced at entry only
    /// (`call_returns = "needed"`).
    pub ret: Option<i32>,
    /// Elements (`count`, `sendcount` or `recvcount` as the API names it).
    pub count: Option<u64>,
    pub datatype: Option<u32>,
    /// `count` × element size: the bytes one rank contributes.
    pub bytes: Option<u64>,
    pub redop: Option<u32>,
    /// Root of a rooted collective, or peer of send/recv.
    pub peer: Option<i32>,
    pub comm: Option<u64>,
    pub stream: Option<u64>,
    /// What a communicator's creation or an NVTX range adds ([`Call::extra_mut`] sets it).
    #[serde(flatten)]
    pub extra: Option<Box<CallExtra>>,
    /// The Python frame the call was made from (`function (file:line)`), when its entry
    /// stack had Python frames.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub python: Option<String>,
}

/// What few calls of a run carry (a communicator's creation, an NVTX range), kept out of
/// line: a call is 160 bytes instead of 224. Every call of a run is copied a few times
/// on its way to trace.json (those copies were a tenth of the attribution's time on a
/// recording of 300,000 one-call steps).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct CallExtra {
    /// The communicator a CommInit*/CommSplit call created.
    pub new_comm: Option<u64>,
    /// Rank and size given to CommInitRank*.
    pub rank: Option<i32>,
    pub nranks: Option<i32>,
    /// The range name given to `nvtxRangePushA` (at most 55 bytes kept).
    pub message: Option<String>,
    /// The communicator a CommInitRank* call creates, named alike on every rank: a hash
    /// of the first 16 bytes of its ncclUniqueId.
    pub comm_id: Option<u64>,
}

impl Call {
    /// A call that returned 0, with no argument interpreted yet.
    #[must_use]
    pub fn new(task: Task, func: Func, start_ns: u64, end_ns: u64) -> Call {
        Call {
            task,
            func,
            start_ns,
            end_ns,
            ret: Some(0),
            count: None,
            datatype: None,
            bytes: None,
            redop: None,
            peer: None,
            comm: None,
            stream: None,
            extra: None,
            python: None,
        }
    }

    /// What a communicator's creation or an NVTX range adds, made when first set.
    pub fn extra_mut(&mut self) -> &mut CallExtra {
        self.extra.get_or_insert_default()
    }

    /// The communicator a CommInit*/CommSplit call created.
    #[must_use]
    pub fn new_comm(&self) -> Option<u64> {
        self.extra.as_ref().and_then(|e| e.new_comm)
    }

    /// The rank given to CommInitRank*.
    #[must_use]
    pub fn rank(&self) -> Option<i32> {
        self.extra.as_ref().and_then(|e| e.rank)
    }

    /// The size given to CommInitRank* or CommInitAll.
    #[must_use]
    pub fn nranks(&self) -> Option<i32> {
        self.extra.as_ref().and_then(|e| e.nranks)
    }

    /// The range name given to `nvtxRangePushA`.
    #[must_use]
    pub fn message(&self) -> Option<&str> {
        self.extra.as_ref().and_then(|e| e.message.as_deref())
    }

    /// The hash of the ncclUniqueId a CommInitRank* call was given.
    #[must_use]
    pub fn comm_id(&self) -> Option<u64> {
        self.extra.as_ref().and_then(|e| e.comm_id)
    }

    /// Whether the call's return was traced (its duration and return value are known).
    #[must_use]
    pub fn returned(&self) -> bool {
        self.ret.is_some()
    }

    #[must_use]
    pub fn duration_ns(&self) -> u64 {
        self.end_ns.saturating_sub(self.start_ns)
    }
}

/// Everything the kernel programs report, decoded.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub enum Event {
    Call(Call),
    Switch {
        ts_ns: u64,
        task: Task,
        prev_tid: u32,
        next_tid: u32,
        next_tgid: u32,
        prev_state: i64,
        prev_is_target: bool,
        next_is_target: bool,
        /// `Some(python)`: the task switched out left with the native frames of its
        /// previous off-CPU stack, and with its Python frames too where `python` (format 6;
        /// what one or two `StackSame` records said before).
        offcpu_same: Option<bool>,
    },
    Wakeup {
        ts_ns: u64,
        task: Task,
        waker_tid: u32,
        waker_tgid: u32,
    },
    Migrate {
        ts_ns: u64,
        task: Task,
        orig_cpu: i32,
        dest_cpu: i32,
    },
    Fork {
        ts_ns: u64,
        task: Task,
        child_tid: u32,
    },
    Exit {
        ts_ns: u64,
        task: Task,
        group_dead: bool,
    },
    Fault {
        ts_ns: u64,
        task: Task,
        address: u64,
        ip: u64,
        error_code: u64,
    },
    /// A user page fault timed by fentry/fexit on the fault handler.
    FaultTime {
        ts_ns: u64,
        task: Task,
        start_ns: u64,
        address: u64,
    },
    PageMigration {
        ts_ns: u64,
        task: Task,
        succeeded: u64,
        failed: u64,
        mode: u32,
        reason: u32,
    },
    NumaTask {
        ts_ns: u64,
        task: Task,
        kind: NumaTaskKind,
        src_cpu: i32,
        src_nid: i32,
        dst_cpu: i32,
        dst_nid: i32,
    },
    /// A NUMA-balancing hinting fault: the kernel's sample of one memory access of the
    /// thread, on the CPU `cpu`, to a page on `mem_node`.
    NumaHint {
        ts_ns: u64,
        task: Task,
        cpu: u16,
        mem_node: i32,
        pages: u32,
        /// The kernel found the page on the faulting CPU's node.
        local: bool,
        /// The kernel moved the page to the faulting CPU's node.
        migrated: bool,
    },
    /// A load of the thread sampled by the PMU: its latency in core cycles and where it
    /// was served from (`perf_mem_data_src`, see `crate::pmu::served`).
    MemSample {
        ts_ns: u64,
        task: Task,
        weight: u32,
        data_src: u64,
    },
    /// A reading of a thread's node-load counters since they were opened: its loads DRAM
    /// served (any node's) and those a remote node's served, scaled for multiplexing.
    NodeLoads {
        ts_ns: u64,
        task: Task,
        dram: u64,
        remote: u64,
        /// The counters ran for less than they were enabled (the counts are scaled up).
        multiplexed: bool,
        /// Part of a reading of every counted thread (between full readings, a thread
        /// whose counts stood still is not written).
        full: bool,
    },
    /// Where the target's resident memory is: KiB per NUMA node.
    NumaPages {
        ts_ns: u64,
        task: Task,
        kib: Vec<u64>,
    },
    /// A reading of an InfiniBand port's counters: (index in
    /// [`nccltrace_common::IB_COUNTER_NAMES`], value) of those the port has.
    IbCounters {
        ts_ns: u64,
        task: Task,
        /// Index in the recording header's `infiniband_ports`.
        port: u32,
        counters: Vec<(u8, u64)>,
    },
    /// A reading of a GPU through NVML (`nccltrace_common::GpuReadingEvent`, as read).
    Gpu {
        ts_ns: u64,
        task: Task,
        reading: GpuReading,
    },
    /// A communicator of the target, as read from its memory: its size and the target's
    /// rank in it (`None`: not read).
    CommSize {
        ts_ns: u64,
        task: Task,
        comm: u64,
        nranks: i32,
        rank: Option<i32>,
    },
    /// An on-CPU sample; stacks innermost frame first (kernel empty when the thread was in
    /// user mode).
    Sample {
        ts_ns: u64,
        task: Task,
        kstack: Vec<u64>,
        ustack: Vec<u64>,
    },
    /// The stacks a thread left the CPU with.
    OffCpu {
        ts_ns: u64,
        task: Task,
        kstack: Vec<u64>,
        ustack: Vec<u64>,
    },
    /// An off-CPU or call-entry stack record whose native frames are the thread's
    /// previous ones of that kind (`kind::STACK_SAME`); its Python frames came before it as
    /// for any stack record.
    StackSame {
        ts_ns: u64,
        task: Task,
        /// `kind::OFFCPU`, `kind::CALL_STACK` or `kind::PY_FRAMES`.
        of: u16,
        /// Of Python frames, which of the thread's kept walks they are: those of its
        /// `kind::CALL_STACK` or its `kind::OFFCPU` stacks, or 0 (recordings before format
        /// 5: one for both).
        with: u16,
    },
    /// The user stack at the entry of a traced call (made just after the call's start).
    CallStack {
        ts_ns: u64,
        task: Task,
        ustack: Vec<u64>,
    },
    /// The Python frames (innermost first) of the stack record that follows for the same
    /// thread with the same time.
    PyStack {
        ts_ns: u64,
        task: Task,
        frames: Vec<PyFrame>,
        /// Outer frames are missing (the walk's bound, or an unreadable frame).
        truncated: bool,
        /// What the thread's later `StackSame` records of Python frames with this `with`
        /// stand for: the walk of a call-entry (`kind::CALL_STACK`) or off-CPU
        /// (`kind::OFFCPU`) stack whose frames the kernel keyed, or before format 5 (0)
        /// of either.
        keyed: Option<u16>,
    },
}

/// What a NUMA-balancing tracepoint said.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum NumaTaskKind {
    Move,
    Swap,
    Stick,
}

impl Event {
    /// The task it is about.
    #[must_use]
    pub fn task(&self) -> Task {
        match self {
            Event::Call(c) => c.task,
            Event::Switch { task, .. }
            | Event::Wakeup { task, .. }
            | Event::Migrate { task, .. }
            | Event::Fork { task, .. }
            | Event::Exit { task, .. }
            | Event::Fault { task, .. }
            | Event::FaultTime { task, .. }
            | Event::PageMigration { task, .. }
            | Event::NumaTask { task, .. }
            | Event::NumaHint { task, .. }
            | Event::MemSample { task, .. }
            | Event::NodeLoads { task, .. }
            | Event::NumaPages { task, .. }
            | Event::CommSize { task, .. }
            | Event::IbCounters { task, .. }
            | Event::Gpu { task, .. }
            | Event::Sample { task, .. }
            | Event::OffCpu { task, .. }
            | Event::CallStack { task, .. }
            | Event::StackSame { task, .. }
            | Event::PyStack { task, .. } => *task,
        }
    }

    /// When it happened (a call: when it returned), CLOCK_MONOTONIC ns.
    #[must_use]
    pub fn ts_ns(&self) -> u64 {
        match self {
            Event::Call(c) => c.end_ns,
            Event::Switch { ts_ns, .. }
            | Event::Wakeup { ts_ns, .. }
            | Event::Migrate { ts_ns, .. }
            | Event::Fork { ts_ns, .. }
            | Event::Exit { ts_ns, .. }
            | Event::Fault { ts_ns, .. }
            | Event::FaultTime { ts_ns, .. }
            | Event::PageMigration { ts_ns, .. }
            | Event::NumaTask { ts_ns, .. }
            | Event::NumaHint { ts_ns, .. }
            | Event::MemSample { ts_ns, .. }
            | Event::NodeLoads { ts_ns, .. }
            | Event::NumaPages { ts_ns, .. }
            | Event::CommSize { ts_ns, .. }
            | Event::IbCounters { ts_ns, .. }
            | Event::Gpu { ts_ns, .. }
            | Event::Sample { ts_ns, .. }
            | Event::OffCpu { ts_ns, .. }
            | Event::CallStack { ts_ns, .. }
            | Event::StackSame { ts_ns, .. }
            | Event::PyStack { ts_ns, .. } => *ts_ns,
        }
    }

    /// The kernel record kind this came from (the index of `lost_by_kind`).
    #[must_use]
    pub fn kind_name(kind: u16) -> &'static str {
        use nccltrace_common::kind as k;
        match kind {
            k::CALL => "call",
            k::SWITCH => "sched_switch",
            k::WAKEUP => "sched_waking",
            k::MIGRATE => "sched_migrate_task",
            k::FORK => "sched_process_fork",
            k::EXIT => "sched_process_exit",
            k::FAULT => "page_fault_user",
            k::PAGE_MIGRATION => "mm_migrate_pages",
            k::NUMA_TASK => "numa_task",
            k::SAMPLE => "cpu_sample",
            k::OFFCPU => "offcpu_stack",
            k::FAULT_TIME => "fault_time",
            k::CALL_STACK => "call_stack",
            k::PY_STACK | k::PY_FRAMES => "python_stack",
            k::NUMA_HINT => "numa_hint_fault",
            k::MEM_SAMPLE => "mem_sample",
            k::NUMA_PAGES => "numa_pages",
            k::COMM_SIZE => "comm_size",
            k::IB_COUNTERS | k::IB_READING => "infiniband_counters",
            k::STACK_SAME => "stack_same",
            k::NODE_LOADS => "node_loads",
            k::GPU_READING => "gpu_reading",
            _ => "unknown",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Call, CallExtra, Event, Func, Task};

    /// Every call of a run is copied a few times on its way to trace.json: what few calls
    /// carry stays out of line, and a call (and so an event) no larger than 160 bytes.
    #[test]
    fn a_call_keeps_its_rare_fields_out_of_line() {
        assert!(
            size_of::<Call>() <= 160,
            "Call is {} bytes",
            size_of::<Call>()
        );
        assert!(
            size_of::<Event>() <= 160,
            "Event is {} bytes",
            size_of::<Event>()
        );
        let mut c = Call::new(Task::default(), Func::CommInitRank, 1, 2);
        assert_eq!(
            (c.rank(), c.nranks(), c.new_comm(), c.comm_id()),
            (None, None, None, None)
        );
        assert_eq!(c.message(), None);
        *c.extra_mut() = CallExtra {
            new_comm: Some(0xc0),
            rank: Some(3),
            nranks: Some(8),
            message: Some("fwd".into()),
            comm_id: Some(42),
        };
        assert_eq!(
            (c.rank(), c.nranks(), c.new_comm(), c.comm_id(), c.message()),
            (Some(3), Some(8), Some(0xc0), Some(42), Some("fwd"))
        );
    }
}
