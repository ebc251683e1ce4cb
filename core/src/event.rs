//! The user-side event model: what every stage after `decode` reads. Plain data, no kernel
//! types; NCCL and CUDA arguments already interpreted.

use serde::Serialize;

/// A traced library function, named as users know it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub enum Func {
    AllReduce,
    AllGather,
    ReduceScatter,
    Broadcast,
    Bcast,
    Reduce,
    AlltoAll,
    Gather,
    Scatter,
    Send,
    Recv,
    GroupStart,
    GroupEnd,
    CommInitRank,
    CommInitRankConfig,
    CommInitAll,
    CommSplit,
    CommDestroy,
    CommAbort,
    CuStreamSynchronize,
    CuStreamSynchronizePtsz,
    CuEventSynchronize,
    CuCtxSynchronize,
    /// The function named by `--step-symbol`.
    StepMarker,
    /// `nvtxRangePushA` of an NVTX library (`--step-nvtx`).
    NvtxRangePushA,
}

/// Which library a function lives in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Library {
    Nccl,
    Cuda,
    /// The step marker (`--step-symbol`), in whatever object defines it.
    Marker,
    /// NVTX range pushes (`--step-nvtx`), in libnvToolsExt or whatever object exports them.
    Nvtx,
}

impl Func {
    /// Every traced function with its id (the BPF cookie) and the symbols that define it,
    /// strong name first. NCCL exports `pnccl*` and weak `nccl*` aliases at one address.
    pub const ALL: [(Func, u32, &'static [&'static str]); 25] = {
        use nccltrace_common::func as f;
        [
            (
                Func::AllReduce,
                f::NCCL_ALL_REDUCE,
                &["pncclAllReduce", "ncclAllReduce"],
            ),
            (
                Func::AllGather,
                f::NCCL_ALL_GATHER,
                &["pncclAllGather", "ncclAllGather"],
            ),
            (
                Func::ReduceScatter,
                f::NCCL_REDUCE_SCATTER,
                &["pncclReduceScatter", "ncclReduceScatter"],
            ),
            (
                Func::Broadcast,
                f::NCCL_BROADCAST,
                &["pncclBroadcast", "ncclBroadcast"],
            ),
            (Func::Bcast, f::NCCL_BCAST, &["pncclBcast", "ncclBcast"]),
            (Func::Reduce, f::NCCL_REDUCE, &["pncclReduce", "ncclReduce"]),
            (
                Func::AlltoAll,
                f::NCCL_ALLTOALL,
                &["pncclAlltoAll", "ncclAlltoAll"],
            ),
            (Func::Gather, f::NCCL_GATHER, &["pncclGather", "ncclGather"]),
            (
                Func::Scatter,
                f::NCCL_SCATTER,
                &["pncclScatter", "ncclScatter"],
            ),
            (Func::Send, f::NCCL_SEND, &["pncclSend", "ncclSend"]),
            (Func::Recv, f::NCCL_RECV, &["pncclRecv", "ncclRecv"]),
            (
                Func::GroupStart,
                f::NCCL_GROUP_START,
                &["pncclGroupStart", "ncclGroupStart"],
            ),
            (
                Func::GroupEnd,
                f::NCCL_GROUP_END,
                &["pncclGroupEnd", "ncclGroupEnd"],
            ),
            (
                Func::CommInitRank,
                f::NCCL_COMM_INIT_RANK,
                &["pncclCommInitRank", "ncclCommInitRank"],
            ),
            (
                Func::CommInitRankConfig,
                f::NCCL_COMM_INIT_RANK_CONFIG,
                &["pncclCommInitRankConfig", "ncclCommInitRankConfig"],
            ),
            (
                Func::CommInitAll,
                f::NCCL_COMM_INIT_ALL,
                &["pncclCommInitAll", "ncclCommInitAll"],
            ),
            (
                Func::CommSplit,
                f::NCCL_COMM_SPLIT,
                &["pncclCommSplit", "ncclCommSplit"],
            ),
            (
                Func::CommDestroy,
                f::NCCL_COMM_DESTROY,
                &["pncclCommDestroy", "ncclCommDestroy"],
            ),
            (
                Func::CommAbort,
                f::NCCL_COMM_ABORT,
                &["pncclCommAbort", "ncclCommAbort"],
            ),
            (
                Func::CuStreamSynchronize,
                f::CU_STREAM_SYNCHRONIZE,
                &["cuStreamSynchronize"],
            ),
            (
                Func::CuStreamSynchronizePtsz,
                f::CU_STREAM_SYNCHRONIZE_PTSZ,
                &["cuStreamSynchronize_ptsz"],
            ),
            (
                Func::CuEventSynchronize,
                f::CU_EVENT_SYNCHRONIZE,
                &["cuEventSynchronize"],
            ),
            (
                Func::CuCtxSynchronize,
                f::CU_CTX_SYNCHRONIZE,
                &["cuCtxSynchronize"],
            ),
            (Func::StepMarker, f::STEP_MARKER, &["step_marker"]),
            (
                Func::NvtxRangePushA,
                f::NVTX_RANGE_PUSH_A,
                &["nvtxRangePushA"],
            ),
        ]
    };

    /// The function with this id, if the id is known.
    #[must_use]
    pub fn from_id(id: u32) -> Option<Func> {
        Self::ALL
            .iter()
            .find(|(_, i, _)| *i == id)
            .map(|(f, _, _)| *f)
    }

    /// The function with this output name ([`Func::name`]).
    #[must_use]
    pub fn from_name(name: &str) -> Option<Func> {
        Self::ALL
            .iter()
            .map(|(f, _, _)| *f)
            .find(|f| f.name() == name)
    }

    /// The id used as BPF cookie and in recordings.
    #[must_use]
    pub fn id(self) -> u32 {
        Self::ALL
            .iter()
            .find(|(f, _, _)| *f == self)
            .map_or(0, |(_, i, _)| *i)
    }

    /// Symbols that define this function, strong name first.
    #[must_use]
    pub fn symbols(self) -> &'static [&'static str] {
        Self::ALL
            .iter()
            .find(|(f, _, _)| *f == self)
            .map_or(&[], |(_, _, s)| s)
    }

    #[must_use]
    pub fn library(self) -> Library {
        let id = self.id();
        if id == nccltrace_common::func::NVTX_RANGE_PUSH_A {
            Library::Nvtx
        } else if id >= nccltrace_common::func::STEP_MARKER {
            Library::Marker
        } else if id >= nccltrace_common::func::FIRST_CUDA {
            Library::Cuda
        } else {
            Library::Nccl
        }
    }

    /// The name used in outputs: NCCL functions without their `nccl` prefix, CUDA ones as
    /// the driver spells them.
    #[must_use]
    pub fn name(self) -> &'static str {
        let strong = self.symbols()[0];
        match self.library() {
            Library::Nccl => &strong["pnccl".len()..],
            Library::Cuda | Library::Marker | Library::Nvtx => strong,
        }
    }

    /// Collectives and point-to-point calls that move data.
    #[must_use]
    pub fn is_collective(self) -> bool {
        matches!(
            self,
            Func::AllReduce
                | Func::AllGather
                | Func::ReduceScatter
                | Func::Broadcast
                | Func::Bcast
                | Func::Reduce
                | Func::AlltoAll
                | Func::Gather
                | Func::Scatter
                | Func::Send
                | Func::Recv
        )
    }
}

/// NCCL's `ncclDataType_t`, with element sizes.
#[must_use]
pub fn datatype_size(datatype: u32) -> Option<u64> {
    // nccl.h: Int8/Char=0, Uint8=1, Int32=2, Uint32=3, Int64=4, Uint64=5, Float16=6,
    // Float32=7, Float64=8, Bfloat16=9, Float8e4m3=10, Float8e5m2=11.
    Some(match datatype {
        0 | 1 | 10 | 11 => 1,
        6 | 9 => 2,
        2 | 3 | 7 => 4,
        4 | 5 | 8 => 8,
        _ => return None,
    })
}

/// NCCL's `ncclDataType_t` name.
#[must_use]
pub fn datatype_name(datatype: u32) -> &'static str {
    match datatype {
        0 => "int8",
        1 => "uint8",
        2 => "int32",
        3 => "uint32",
        4 => "int64",
        5 => "uint64",
        6 => "float16",
        7 => "float32",
        8 => "float64",
        9 => "bfloat16",
        10 => "float8e4m3",
        11 => "float8e5m2",
        _ => "unknown",
    }
}

/// NCCL's `ncclRedOp_t` name.
#[must_use]
pub fn redop_name(op: u32) -> &'static str {
    match op {
        0 => "sum",
        1 => "prod",
        2 => "max",
        3 => "min",
        4 => "avg",
        _ => "custom",
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
    /// The Python frame the call was made from (`function (file:line)`), when its entry
    /// stack had Python frames.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub python: Option<String>,
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
            new_comm: None,
            rank: None,
            nranks: None,
            message: None,
            comm_id: None,
            python: None,
        }
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
    },
    Wakeup {
        ts_ns: u64,
        task: Task,
        waker_tid: u32,
        waker_tgid: u32,
        target_cpu: i32,
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
        /// `kind::OFFCPU` or `kind::CALL_STACK`.
        of: u16,
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
            | Event::IbCounters { task, .. }
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
            | Event::IbCounters { ts_ns, .. }
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
            k::IB_COUNTERS => "infiniband_counters",
            k::STACK_SAME => "stack_same",
            k::NODE_LOADS => "node_loads",
            _ => "unknown",
        }
    }
}
