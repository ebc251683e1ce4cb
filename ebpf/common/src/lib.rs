//! Shared definitions: every record the kernel programs emit, the ids they use and the
//! settings user space hands them before load. Both sides compile this one crate, so an
//! event is defined exactly once.
//!
//! Rules: `#[repr(C)]`, no `bool`, explicit padding, a size assertion per type; ids are
//! append-only so old recordings stay readable.
#![no_std]

/// Event kinds, the first field every record carries (`Header::kind`). Append-only.
pub mod kind {
    /// A traced library call (NCCL or CUDA), entry and exit paired in the kernel.
    pub const CALL: u16 = 1;
    /// `sched:sched_switch` where the previous or next task belongs to a target.
    pub const SWITCH: u16 = 2;
    /// `sched:sched_waking` of a target thread. `sched_waking` fires in the waker's
    /// context; `sched_wakeup` may fire on the wakee's CPU from an IPI (remote wakeups),
    /// where `current` is whatever ran there, often the idle task.
    pub const WAKEUP: u16 = 3;
    /// `sched:sched_migrate_task` of a target thread.
    pub const MIGRATE: u16 = 4;
    /// `sched:sched_process_fork` from a target.
    pub const FORK: u16 = 5;
    /// `sched:sched_process_exit` of a target thread.
    pub const EXIT: u16 = 6;
    /// `exceptions:page_fault_user` in a target thread.
    pub const FAULT: u16 = 7;
    /// `migrate:mm_migrate_pages` run in a target thread's context.
    pub const PAGE_MIGRATION: u16 = 8;
    /// `sched:sched_{move,swap,stick}_numa` involving a target.
    pub const NUMA_TASK: u16 = 9;
    /// An on-CPU sample (software cpu-clock perf event) of a target thread, with stacks.
    pub const SAMPLE: u16 = 10;
    /// A target thread's stacks while off the CPU (`SampleEvent` layout): taken as it
    /// leaves, or as it comes back (`names::OFFCPU_MIN`); the header's time is the
    /// switch-out either way.
    pub const OFFCPU: u16 = 11;
    /// A target thread's user page fault timed by fentry/fexit on `handle_mm_fault`, where
    /// the kernel permits those programs (`FaultTimeEvent`; the header's time is the end).
    pub const FAULT_TIME: u16 = 12;
    /// A target thread's user stack at the entry of a traced call (`SampleEvent` layout,
    /// no kernel frames), made just after the call's start time was taken.
    pub const CALL_STACK: u16 = 13;
    /// The Python frames a target thread was executing (`PyStackEvent`), written just
    /// before the `SAMPLE`, `OFFCPU` or `CALL_STACK` record they belong to, with the same
    /// header time.
    pub const PY_STACK: u16 = 14;
    /// A NUMA-balancing hinting fault of a target thread (`task_numa_fault`, kprobe): the
    /// kernel's own sample of one of its memory accesses, local or remote
    /// (`NumaHintEvent`).
    pub const NUMA_HINT: u16 = 15;
    /// A load sampled by the PMU's memory sampler (`MemSampleEvent`): made by the agent
    /// from the sampler's perf ring, not by the programs, so beyond [`COUNT`] (no kernel
    /// loss counter: the agent counts the sampler's own losses).
    pub const MEM_SAMPLE: u16 = 16;
    /// Where a target's resident memory is, per NUMA node (`NumaPagesEvent`): made by the
    /// agent from `/proc/PID/numa_maps` while NUMA balancing is off, beyond [`COUNT`] too.
    pub const NUMA_PAGES: u16 = 17;
    /// An InfiniBand port's `counters/` (`IbCountersEvent`), as recordings before
    /// [`IB_READING`] have them: decoded, no longer written.
    pub const IB_COUNTERS: u16 = 18;
    /// The native stack a target thread was written with last time (`StackSameEvent`),
    /// for an `OFFCPU` or `CALL_STACK` record: the thread is at the same instruction,
    /// stack pointer and frame pointer, with the same two words at its frame pointer
    /// (the innermost frame link and return address), and that stack was taken less than
    /// [`crate::STACK_REUSE_NS`] ago. Its Python frames are walked as always
    /// (a `PY_STACK` record before it). A lost one counts under the kind it stands for.
    pub const STACK_SAME: u16 = 19;
    /// The Python frames a target thread was executing (`PyFramesEvent`), as `PY_STACK`
    /// with the interpreter-entry markers as a bit mask beside the frames instead of
    /// entries among them (one write a frame: the walk's loop verifies in about three
    /// quarters of the instructions). Lost ones count under `PY_STACK`.
    pub const PY_FRAMES: u16 = 20;
    /// A reading of a target thread's node-load counters (`NodeLoadsEvent`): made by the
    /// agent from per-thread perf counters where the PMU counts loads by the node that
    /// served them but samples none, beyond [`COUNT`] too.
    pub const NODE_LOADS: u16 = 21;
    /// A reading of an InfiniBand port's counters (`IbReadingEvent` and its values):
    /// read by the agent from `/sys/class/infiniband/*/ports/*/{counters,hw_counters}`
    /// while tracing, beyond [`COUNT`] too.
    pub const IB_READING: u16 = 22;
    /// What a communicator of a target is (`CommSizeEvent`): its size and the target's rank
    /// in it, read by the agent from the communicator's memory where the offsets
    /// `ncclCommCount` and `ncclCommUserRank` load them from were found, beyond [`COUNT`]
    /// too.
    pub const COMM_SIZE: u16 = 23;
    /// A reading of a GPU the targets use (`GpuReadingEvent`), through NVML, made by the
    /// agent while tracing, beyond [`COUNT`] too.
    pub const GPU_READING: u16 = 24;
    /// One past the largest kind: the size of per-kind tables.
    pub const COUNT: usize = 16;
}

/// Indices into the per-CPU `COUNTERS` array. Ids below `kind::COUNT` count events of that
/// kind lost because the ring buffer was full. Append-only.
pub mod counter {
    /// A uretprobe found no matching entry (attached mid-call, or the pending map was full).
    pub const UNPAIRED_RETURN: u32 = 16;
    /// The pending-call map was full at entry.
    pub const PENDING_FULL: u32 = 17;
    /// The target-thread map was full when a new thread appeared.
    pub const THREADS_FULL: u32 = 18;
    /// Reading a call's stack arguments or out-pointer failed.
    pub const READ_FAILED: u32 = 19;
    /// The fault-start map was full at a fault's entry (that fault is not timed).
    pub const FAULT_START_FULL: u32 = 20;
    /// Off-CPU stretches of target threads shorter than `names::OFFCPU_MIN`: no stacks
    /// taken for them.
    pub const OFFCPU_SHORT: u32 = 21;
    /// Their nanoseconds off the CPU, in all.
    pub const OFFCPU_SHORT_NS: u32 = 22;
    /// Size of the array.
    pub const COUNT: u32 = 32;

    /// The name summary.json gives each counter above `kind::COUNT`.
    #[must_use]
    pub const fn name(id: u32) -> Option<&'static str> {
        match id {
            UNPAIRED_RETURN => Some("unpaired_returns"),
            PENDING_FULL => Some("pending_map_full"),
            THREADS_FULL => Some("thread_map_full"),
            READ_FAILED => Some("argument_reads_failed"),
            FAULT_START_FULL => Some("fault_start_map_full"),
            OFFCPU_SHORT => Some("offcpu_stacks_skipped_short"),
            OFFCPU_SHORT_NS => Some("offcpu_stacks_skipped_short_ns"),
            _ => None,
        }
    }
}

/// The programs that time their runs for traced threads (`TARGET_COSTS`: at `SLOTS * id`
/// the runs, then the runs timed and their nanoseconds, from just after the target check
/// to the program's end), so that the agent can tell what the traced threads pay from
/// what every run costs (the kernel's own run-time accounting counts every run, on every
/// CPU). Every run is counted; runs are timed only while `names::TIMING` is set (the
/// kernel's accounting windows).
pub mod timed {
    /// Values a program has in `TARGET_COSTS`: runs, runs timed, their nanoseconds.
    pub const SLOTS: u32 = 3;
    pub const UPROBE_LIB_CALL: u32 = 0;
    pub const URETPROBE_LIB_CALL: u32 = 1;
    pub const SCHED_SWITCH: u32 = 2;
    pub const SCHED_WAKING: u32 = 3;
    pub const PAGE_FAULT_USER: u32 = 4;
    pub const FENTRY_HANDLE_MM_FAULT: u32 = 5;
    pub const FEXIT_HANDLE_MM_FAULT: u32 = 6;
    pub const PERF_EVENT_CPU_CLOCK: u32 = 7;
    pub const KPROBE_FINISH_TASK_SWITCH: u32 = 8;
    /// Programs timed.
    pub const COUNT: u32 = 9;
    /// Each id's program name.
    pub const PROGRAMS: [&str; COUNT as usize] = [
        super::names::UPROBE_LIB_CALL,
        super::names::URETPROBE_LIB_CALL,
        "tracepoint_sched_switch",
        "tracepoint_sched_waking",
        "raw_page_fault_user",
        super::names::FENTRY_HANDLE_MM_FAULT,
        super::names::FEXIT_HANDLE_MM_FAULT,
        super::names::PERF_EVENT_CPU_CLOCK,
        super::names::KPROBE_FINISH_TASK_SWITCH,
    ];
}

/// Every program's own accounting of its runs (`PROGRAM_COSTS`: at `SLOTS * id` the runs
/// and their nanoseconds, from the program's first instruction to its last), counted while
/// `names::TIMING` is set (user space's windows), instead of the kernel's run-time
/// accounting: turning that on and off (`BPF_ENABLE_STATS`, `kernel.bpf_stats_enabled`)
/// flips a static key in every BPF program's entry path on the host and rewrites kernel
/// text each time (issue 59). Ids are the index of each program's name in [`run::PROGRAMS`].
pub mod run {
    /// Values a program has in `PROGRAM_COSTS`: runs, their nanoseconds.
    pub const SLOTS: u32 = 2;
    pub const UPROBE_LIB_CALL: u32 = 0;
    pub const URETPROBE_LIB_CALL: u32 = 1;
    pub const TRACEPOINT_SCHED_SWITCH: u32 = 2;
    pub const RAW_SCHED_SWITCH: u32 = 3;
    pub const KPROBE_FINISH_TASK_SWITCH: u32 = 4;
    pub const TRACEPOINT_SCHED_WAKING: u32 = 5;
    pub const RAW_SCHED_WAKING: u32 = 6;
    pub const TRACEPOINT_SCHED_MIGRATE_TASK: u32 = 7;
    pub const RAW_SCHED_MIGRATE_TASK: u32 = 8;
    pub const TRACEPOINT_SCHED_PROCESS_FORK: u32 = 9;
    pub const TRACEPOINT_SCHED_PROCESS_EXIT: u32 = 10;
    pub const RAW_PAGE_FAULT_USER: u32 = 11;
    pub const FENTRY_HANDLE_MM_FAULT: u32 = 12;
    pub const FEXIT_HANDLE_MM_FAULT: u32 = 13;
    pub const KPROBE_TASK_NUMA_FAULT: u32 = 14;
    pub const TRACEPOINT_MM_MIGRATE_PAGES: u32 = 15;
    pub const TRACEPOINT_SCHED_MOVE_NUMA: u32 = 16;
    pub const TRACEPOINT_SCHED_SWAP_NUMA: u32 = 17;
    pub const TRACEPOINT_SCHED_STICK_NUMA: u32 = 18;
    pub const PERF_EVENT_CPU_CLOCK: u32 = 19;
    /// Programs that account their runs.
    pub const COUNT: u32 = 20;
    /// Each id's program name (the function's name in the object).
    pub const PROGRAMS: [&str; COUNT as usize] = [
        super::names::UPROBE_LIB_CALL,
        super::names::URETPROBE_LIB_CALL,
        "tracepoint_sched_switch",
        "raw_sched_switch",
        super::names::KPROBE_FINISH_TASK_SWITCH,
        "tracepoint_sched_waking",
        "raw_sched_waking",
        "tracepoint_sched_migrate_task",
        "raw_sched_migrate_task",
        "tracepoint_sched_process_fork",
        "tracepoint_sched_process_exit",
        "raw_page_fault_user",
        super::names::FENTRY_HANDLE_MM_FAULT,
        super::names::FEXIT_HANDLE_MM_FAULT,
        super::names::KPROBE_TASK_NUMA_FAULT,
        "tracepoint_mm_migrate_pages",
        "tracepoint_sched_move_numa",
        "tracepoint_sched_swap_numa",
        "tracepoint_sched_stick_numa",
        super::names::PERF_EVENT_CPU_CLOCK,
    ];
}

/// Bits of a pid's byte in the `MAYBE` map. An array load decides for the tasks of
/// everything else on the host (a bit not set: not a target), sparing them the hash
/// lookups of `THREADS` and `TARGETS`, which decide where a bit is set. Each bit is set
/// before the hash map's entry it stands for and never cleared: a stale one only sends a
/// task to the hash lookup.
pub mod maybe {
    /// A thread of a target (an entry in `THREADS`), or was once.
    pub const THREAD: u8 = 1;
    /// A target thread group (an entry in `TARGETS`), or was once.
    pub const PROCESS: u8 = 2;
}

/// Subkinds of [`NumaTaskEvent`].
pub mod numa_task {
    /// `sched_move_numa`: a task moved to another node.
    pub const MOVE: u32 = 1;
    /// `sched_swap_numa`: two tasks swapped nodes.
    pub const SWAP: u32 = 2;
    /// `sched_stick_numa`: a preferred-node move that did not happen.
    pub const STICK: u32 = 3;
}

/// The traced library functions. A probe's BPF cookie is its function id. Append-only.
pub mod func;

/// Values of [`Config::call_stacks`].
pub mod call_stacks {
    pub const OFF: u32 = 0;
    pub const SYNC: u32 = 1;
    pub const ALL: u32 = 2;

    /// Whether a call of function `id` gets its entry stack under `setting`.
    #[must_use]
    pub const fn wanted(setting: u32, id: u32) -> bool {
        if id >= super::func::FIRST_CUDA && id < super::func::STEP_MARKER {
            setting >= SYNC
        } else if id < super::func::FIRST_CUDA {
            setting >= ALL
        } else {
            false
        }
    }
}

/// Maximum arguments captured per call (six in registers, two from the stack).
pub const MAX_ARGS: usize = 8;

/// Ring buffers the programs declare (`EVENTS_0`…); user space uses a power of two of them.
pub const RING_SHARDS: u32 = 8;

/// The value of an argument slot the entry program did not read (a stream left out by
/// [`func::stack_args`]); no stream or communicator handle has it.
pub const NOT_READ: u64 = u64::MAX;

/// A record whose bytes both sides copy as they are: `#[repr(C)]`, every byte a field
/// (padding is explicit `_pad` fields; each type's size is asserted right below it), no
/// pointers, beginning with its [`Header`] (the kernel side reads a record's time there).
/// `decode::as_bytes` takes only these, so no type with implicit padding can leak
/// uninitialised bytes into a recording.
///
/// # Safety
///
/// Implement only for such types.
pub unsafe trait Record: Copy {}

// SAFETY: each is #[repr(C)] with explicit padding; the size assertions below each type
// equal the sum of its fields.
unsafe impl Record for Header {}
unsafe impl Record for CallEvent {}
unsafe impl Record for SwitchEvent {}
unsafe impl Record for WakeupEvent {}
unsafe impl Record for MigrateEvent {}
unsafe impl Record for TaskEvent {}
unsafe impl Record for FaultEvent {}
unsafe impl Record for FaultTimeEvent {}
unsafe impl Record for PageMigrationEvent {}
unsafe impl Record for NumaTaskEvent {}
unsafe impl Record for NumaHintEvent {}
unsafe impl Record for MemSampleEvent {}
unsafe impl Record for NumaPagesEvent {}
unsafe impl Record for CommSizeEvent {}
unsafe impl Record for IbCountersEvent {}
unsafe impl Record for IbReadingEvent {}
unsafe impl Record for GpuReadingEvent {}
unsafe impl Record for NodeLoadsEvent {}
unsafe impl Record for StackSameEvent {}
unsafe impl Record for SampleEvent {}
unsafe impl Record for PyStackEvent {}
unsafe impl Record for PyFramesEvent {}

/// The start of every record.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Header {
    /// `bpf_ktime_get_ns` (CLOCK_MONOTONIC) when the record was made.
    pub ts_ns: u64,
    /// Thread group of the task the record is about.
    pub tgid: u32,
    /// Thread the record is about.
    pub tid: u32,
    /// One of [`kind`].
    pub kind: u16,
    /// CPU the program ran on.
    pub cpu: u16,
    pub _pad: u32,
}
const _: () = assert!(core::mem::size_of::<Header>() == 24);

/// A library call. `hdr.ts_ns` is the return time.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CallEvent {
    pub hdr: Header,
    /// Entry time.
    pub start_ns: u64,
    /// One of [`func`].
    pub func: u32,
    /// Return value (ncclResult_t / CUresult).
    pub ret: i32,
    /// Raw arguments in ABI order; `func::nargs` says how many are meaningful.
    pub args: [u64; MAX_ARGS],
    /// For calls that create a communicator: the handle written through the out pointer.
    pub out: u64,
}
const _: () = assert!(core::mem::size_of::<CallEvent>() == 112);

/// What a uprobe remembers until the matching uretprobe fires.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct PendingCall {
    pub start_ns: u64,
    pub args: [u64; MAX_ARGS],
}
const _: () = assert!(core::mem::size_of::<PendingCall>() == 72);

/// Slots of calls in flight, one per `tid % CALL_SLOTS`: the common case pairs an entry
/// with its return through an array slot instead of a hash map; nested calls and threads
/// whose slot is taken fall back to the hash map.
pub const CALL_SLOTS: u32 = 16384;

/// A call in flight in its thread's slot. `owner` is `tid << 32 | function id`, 0 when
/// free; it is claimed with a compare-and-swap, so two threads sharing a slot never write
/// it together.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CallSlot {
    pub owner: u64,
    pub call: PendingCall,
}
const _: () = assert!(core::mem::size_of::<CallSlot>() == 80);

/// The contract between the kernel programs and user space: the names of programs, maps and
/// globals, and the tracepoints with the program attached to each. The kernel side names
/// its functions and statics so (aya-ebpf's attributes take literals only); the agent
/// finds them by these constants, and a unit test of the agent checks that the embedded
/// object defines every one of them.
pub mod names;

mod comm;
mod config;
mod memory;
mod sched;
mod stacks;
pub use comm::*;
pub use config::*;
pub use memory::*;
pub use sched::*;
pub use stacks::*;

#[cfg(feature = "user")]
mod pod {
    // SAFETY: every type here is #[repr(C)], made only of integers, with explicit padding,
    // so any bit pattern is valid.
    unsafe impl aya::Pod for super::TpOffsets {}
    unsafe impl aya::Pod for super::Config {}
    unsafe impl aya::Pod for super::PendingCall {}
    unsafe impl aya::Pod for super::PyLayout {}
}
