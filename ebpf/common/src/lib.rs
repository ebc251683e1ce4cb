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
    /// An InfiniBand port's counters (`IbCountersEvent`): read by the agent from
    /// `/sys/class/infiniband/*/ports/*/counters` while tracing, beyond [`COUNT`] too.
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
unsafe impl Record for IbCountersEvent {}
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

/// Flags of [`SwitchEvent`].
pub mod switch_flags {
    /// The task switched out belongs to a target.
    pub const PREV_TARGET: u32 = 1;
    /// The task switched in belongs to a target.
    pub const NEXT_TARGET: u32 = 2;
}

/// A context switch touching a target thread. `hdr.tid`/`hdr.tgid` are the task switched
/// out when it is a target, else the task switched in.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SwitchEvent {
    pub hdr: Header,
    pub prev_tid: u32,
    pub next_tid: u32,
    /// `prev_state` as the tracepoint gives it (0: preempted while runnable).
    pub prev_state: i64,
    /// Thread group of the next task, when it is a target (else 0).
    pub next_tgid: u32,
    /// [`switch_flags`].
    pub flags: u32,
}
const _: () = assert!(core::mem::size_of::<SwitchEvent>() == 48);

/// A target thread woken. `hdr` is the woken thread; the waker is `waker_tid`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WakeupEvent {
    pub hdr: Header,
    pub waker_tid: u32,
    pub waker_tgid: u32,
    pub target_cpu: u32,
    pub _pad: u32,
}
const _: () = assert!(core::mem::size_of::<WakeupEvent>() == 40);

/// A target thread moved between CPUs. `hdr` is the migrated thread.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MigrateEvent {
    pub hdr: Header,
    pub orig_cpu: u32,
    pub dest_cpu: u32,
}
const _: () = assert!(core::mem::size_of::<MigrateEvent>() == 32);

/// A new task created by a target (`hdr` is the parent) or a target thread exiting
/// (`hdr` is the thread).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TaskEvent {
    pub hdr: Header,
    /// Fork: the child's tid. Exit: 0.
    pub child_tid: u32,
    /// Exit: nonzero when the whole thread group is dead. Fork: 0.
    pub group_dead: u32,
}
const _: () = assert!(core::mem::size_of::<TaskEvent>() == 32);

/// A user page fault in a target thread.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FaultEvent {
    pub hdr: Header,
    pub address: u64,
    pub ip: u64,
    pub error_code: u64,
}
const _: () = assert!(core::mem::size_of::<FaultEvent>() == 48);

/// `handle_mm_fault`'s `FAULT_FLAG_USER`: the fault came from user mode.
pub const FAULT_FLAG_USER: u32 = 1 << 6;

/// A user page fault of a target thread, timed from entry to return of `handle_mm_fault`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FaultTimeEvent {
    pub hdr: Header,
    pub start_ns: u64,
    pub address: u64,
    /// `handle_mm_fault`'s `FAULT_FLAG_*` and its `vm_fault_t` result, high half.
    pub flags: u32,
    pub result: u32,
}
const _: () = assert!(core::mem::size_of::<FaultTimeEvent>() == 48);

/// Pages migrated between nodes in a target thread's context (NUMA balancing, mbind...).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PageMigrationEvent {
    pub hdr: Header,
    pub succeeded: u64,
    pub failed: u64,
    pub mode: u32,
    pub reason: u32,
}
const _: () = assert!(core::mem::size_of::<PageMigrationEvent>() == 48);

/// A NUMA-balancing decision about a target task.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NumaTaskEvent {
    pub hdr: Header,
    /// One of [`numa_task`].
    pub subkind: u32,
    pub src_tid: u32,
    pub src_tgid: u32,
    pub src_cpu: i32,
    pub src_nid: i32,
    pub dst_tid: u32,
    pub dst_tgid: u32,
    pub dst_cpu: i32,
    pub dst_nid: i32,
    pub _pad: u32,
}
const _: () = assert!(core::mem::size_of::<NumaTaskEvent>() == 64);

/// A NUMA hinting fault: `task_numa_fault(last_cpupid, mem_node, pages, flags)` in the
/// faulting thread's context (the header's CPU is the one it ran on).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NumaHintEvent {
    pub hdr: Header,
    /// The node the page is on after the fault (its target, when it was migrated).
    pub mem_node: i32,
    /// Pages the fault stands for (1, or a huge page's).
    pub pages: i32,
    /// The kernel's `TNF_*` flags: [`numa_hint::LOCAL`], [`numa_hint::MIGRATED`], ...
    pub flags: i32,
    pub _pad: u32,
}
const _: () = assert!(core::mem::size_of::<NumaHintEvent>() == 40);

/// A load sampled by the PMU (PEBS load latency, AMD IBS), in the programs' record layout
/// so that recordings carry it like the rest (the header's CPU: `u16::MAX`, unknown).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemSampleEvent {
    pub hdr: Header,
    /// The load's latency in core cycles.
    pub weight: u32,
    pub _pad: u32,
    /// `perf_mem_data_src`: where the load was served from.
    pub data_src: u64,
}
const _: () = assert!(core::mem::size_of::<MemSampleEvent>() == 40);

/// A thread's node-load counters since they were opened (`node-loads`: its loads that DRAM
/// served, any node's; `node-load-misses`: those another node's DRAM served, as perf's
/// generic events map them on Intel), read by the agent
/// (the header's tgid and tid are the thread's, its CPU `u16::MAX`). Each count is already
/// scaled by the time the counter was enabled over the time it ran (the PMU multiplexes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodeLoadsEvent {
    pub hdr: Header,
    pub dram: u64,
    pub remote: u64,
    /// Nanoseconds the counters were enabled, and counting (less when multiplexed).
    pub enabled_ns: u64,
    pub running_ns: u64,
    /// [`node_loads`] flags.
    pub flags: u32,
    pub _pad: u32,
}
const _: () = assert!(core::mem::size_of::<NodeLoadsEvent>() == 64);

/// Flags of a [`NodeLoadsEvent`]. A thread's counts are written only when they moved
/// since its last record (and its last still reading first, where they start moving
/// again), so that a reading not written means "unchanged"; a full reading writes every
/// thread, so that every step up to it can be interpolated.
pub mod node_loads {
    /// Part of a full reading: every counted thread was written at this time.
    pub const FULL: u32 = 1;
}

/// Nodes a [`NumaPagesEvent`] has room for (a host with more adds the rest to the last).
pub const NUMA_PAGES_NODES: usize = 16;

/// A target's resident memory per NUMA node, read from `/proc/PID/numa_maps` (the header's
/// tgid and tid are the target's pid, its CPU `u16::MAX`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NumaPagesEvent {
    pub hdr: Header,
    /// Nodes filled in `kib`.
    pub nodes: u32,
    pub _pad: u32,
    /// Resident KiB on each node.
    pub kib: [u64; NUMA_PAGES_NODES],
}
const _: () = assert!(core::mem::size_of::<NumaPagesEvent>() == 160);

/// The counters of an InfiniBand port's `counters/` folder an [`IbCountersEvent`] carries,
/// in its order (the IBA's PortCounters and PortCountersExtended as Linux names them).
/// The two data counters count 4-byte words.
pub const IB_COUNTER_NAMES: [&str; 17] = [
    "port_xmit_data",
    "port_rcv_data",
    "port_xmit_packets",
    "port_rcv_packets",
    "port_xmit_discards",
    "port_xmit_wait",
    "port_rcv_errors",
    "symbol_error",
    "link_downed",
    "link_error_recovery",
    "port_rcv_remote_physical_errors",
    "port_rcv_switch_relay_errors",
    "port_xmit_constraint_errors",
    "port_rcv_constraint_errors",
    "local_link_integrity_errors",
    "excessive_buffer_overrun_errors",
    "VL15_dropped",
];

/// The first this many of [`IB_COUNTER_NAMES`] (data and packets) are read more often
/// than the rest.
pub const IB_FAST_COUNTERS: usize = 4;

/// One reading of an InfiniBand port's counters (the header's tgid and tid 0, its CPU
/// `u16::MAX`): `port` indexes the recording header's port list.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IbCountersEvent {
    pub hdr: Header,
    pub port: u32,
    /// Bit `i` set: `values[i]` was read (the port has [`IB_COUNTER_NAMES`]`[i]`).
    pub present: u32,
    pub values: [u64; IB_COUNTER_NAMES.len()],
}
const _: () = assert!(core::mem::size_of::<IbCountersEvent>() == 168);

/// `TNF_*` flags of `task_numa_fault` (include/linux/sched/numa_balancing.h).
pub mod numa_hint {
    /// The page was migrated to the faulting CPU's node.
    pub const MIGRATED: i32 = 0x01;
    /// The page was on the faulting CPU's node (a local access).
    pub const LOCAL: i32 = 0x08;
    /// Migrating it failed.
    pub const MIGRATE_FAIL: i32 = 0x10;
}

/// Kernel frames kept per sample.
pub const KSTACK_DEPTH: usize = 32;
/// User frames kept per sample.
pub const USTACK_DEPTH: usize = 64;

/// An on-CPU sample of a target thread. Only the first `kstack_len` / `ustack_len`
/// entries of the stacks are meaningful.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SampleEvent {
    pub hdr: Header,
    pub kstack_len: u32,
    pub ustack_len: u32,
    pub kstack: [u64; KSTACK_DEPTH],
    pub ustack: [u64; USTACK_DEPTH],
}
const _: () = assert!(core::mem::size_of::<SampleEvent>() == 800);

/// A stack record whose native frames are the thread's previous ones of the same kind
/// ([`kind::STACK_SAME`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StackSameEvent {
    pub hdr: Header,
    /// The kind of stack record it stands for: [`kind::OFFCPU`] or [`kind::CALL_STACK`].
    pub of: u32,
    pub _pad: u32,
}
const _: () = assert!(core::mem::size_of::<StackSameEvent>() == 32);

/// How long a thread's native stack is reused by [`kind::STACK_SAME`] records before it
/// is taken whole again (ns): bounds how long a recording window (or a reader that lost
/// the whole record) goes without it.
pub const STACK_REUSE_NS: u64 = 1_000_000_000;

/// The key a thread's native stack is reused under (per thread, by kind): where the
/// thread is and the innermost frame link (`STACK_SAME`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StackKey {
    /// The thread the slot holds (slots are indexed by tid modulo their count).
    pub tid: u32,
    pub _pad: u32,
    /// When the whole stack was taken.
    pub taken_ns: u64,
    pub ip: u64,
    pub sp: u64,
    pub bp: u64,
    /// The two words at `bp` (the caller's frame pointer and its return address), and
    /// at a call's entry the return address on top of the stack.
    pub words: [u64; 3],
}

/// Slots of the per-thread stack keys (a power of two).
pub const STACK_KEY_SLOTS: u32 = 4096;

/// Python frames kept per stack (innermost first, entry markers included).
pub const PY_DEPTH: usize = 40;

/// `PyStackEvent::codes` value marking the end of one run of the interpreter loop (an
/// entry frame: the frames after it were executed by an outer `_PyEval_EvalFrameDefault`).
pub const PY_ENTRY: u64 = 0;

/// The Python frames of one stack, innermost first: each frame's code object and how far
/// into it the frame's instruction pointer is (bytes from the code object's address);
/// `codes[i] == PY_ENTRY` marks an interpreter entry between frames.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PyStackEvent {
    pub hdr: Header,
    /// Frames in use.
    pub len: u32,
    /// Nonzero: the walk stopped at [`PY_DEPTH`] with frames left (the outermost are
    /// missing).
    pub truncated: u32,
    pub codes: [u64; PY_DEPTH],
    pub offsets: [u32; PY_DEPTH],
}
const _: () = assert!(core::mem::size_of::<PyStackEvent>() == 512);

/// The Python frames of one stack, innermost first, as [`PyStackEvent`] but every entry a
/// frame: bit `i` of `entries` says an interpreter entry (a `PY_ENTRY` marker) follows
/// frame `i` ([`kind::PY_FRAMES`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PyFramesEvent {
    pub hdr: Header,
    /// Frames in use.
    pub len: u32,
    /// Nonzero: the walk stopped at [`PY_DEPTH`] with frames left (the outermost are
    /// missing).
    pub truncated: u32,
    pub entries: u64,
    pub codes: [u64; PY_DEPTH],
    pub offsets: [u32; PY_DEPTH],
}
const _: () = assert!(core::mem::size_of::<PyFramesEvent>() == 520);

/// Where a CPython interpreter keeps what the frame walk reads (per target process,
/// `PY_LAYOUTS`; byte offsets, [`FIELD_ABSENT`] for a field the version lacks).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PyLayout {
    /// `PyThreadState` → `_PyCFrame *cframe` (3.11, 3.12), or → the current frame itself
    /// (3.13 `current_frame`, 3.10 `frame`).
    pub tstate_cframe: u32,
    /// `_PyCFrame` → `current_frame`; [`FIELD_ABSENT`] where the thread state points at
    /// the frame itself (3.13).
    pub cframe_current_frame: u32,
    /// `_PyInterpreterFrame` → `previous`.
    pub frame_previous: u32,
    /// `_PyInterpreterFrame` → the code object (`f_code`).
    pub frame_code: u32,
    /// `_PyInterpreterFrame` → the instruction pointer (`prev_instr`); 3.10: `f_lasti`, an
    /// index, reported minus the code object's address all the same (user space adds it
    /// back).
    pub frame_instr: u32,
    /// `_PyInterpreterFrame` → `owner` (a byte).
    pub frame_owner: u32,
    /// `_PyInterpreterFrame` → `is_entry` (a byte; 3.11 only).
    pub frame_is_entry: u32,
    /// The `owner` of the interpreter's entry shim frames (3.12: `FRAME_OWNED_BY_CSTACK`).
    pub owner_cstack: u32,
}
const _: () = assert!(core::mem::size_of::<PyLayout>() == 32);

/// Bytes of an interpreter frame the walk reads at once; every [`PyLayout`] frame field
/// lies inside them (3.10's `f_lasti` ends at 100).
pub const PY_FRAME_WINDOW: usize = 104;

/// Switches set by user space before load (read-only global `CONFIG`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Config {
    /// The stacks a target thread is off the CPU with ([`offcpu`]): none, user (and
    /// Python) frames, or kernel frames too.
    pub offcpu_stacks: u32,
    /// Stacks at the entry of traced calls: 0 none, 1 CUDA sync calls, 2 those and NCCL
    /// calls (`call_stacks` module).
    pub call_stacks: u32,
    /// Nonzero: read the stream argument of collectives (off the user stack,
    /// [`func::stack_args`]).
    pub streams: u32,
    /// Ring buffers in use (a power of two, at most [`RING_SHARDS`]): CPU `c` writes to
    /// buffer `c % shards`.
    pub shards: u32,
    /// Records are submitted without waking the reader (which polls on a timer) until this
    /// many bytes wait in the ring buffer; then the submit wakes it. 0: wake on every record.
    pub wakeup_bytes: u64,
    /// Nonzero: off-CPU stacks without kernel frames and call-entry stacks are written as
    /// [`kind::STACK_SAME`] where the thread's native stack is where it was last time.
    pub reuse_stacks: u32,
    /// Nonzero: the Python frames are walked by a `bpf_loop` callback (kernels ≥ 5.17),
    /// verified once; zero: by an unrolled loop, verified turn by turn on every path to it.
    pub py_loop: u32,
}
const _: () = assert!(core::mem::size_of::<Config>() == 32);

/// Values of `Config::offcpu_stacks`.
pub mod offcpu {
    pub const OFF: u32 = 0;
    /// User frames (and Python's): the blocking call is the innermost, in libc.
    pub const USER: u32 = 1;
    /// Kernel frames too: where in the kernel it blocked. The kernel stack's unwinding is
    /// most of a stack's cost (measured 2.7 of 4.6 µs a switch on the CPU machines).
    pub const KERNEL: u32 = 2;
}

/// The contract between the kernel programs and user space: the names of programs, maps and
/// globals, and the tracepoints with the program attached to each. The kernel side names
/// its functions and statics so (aya-ebpf's attributes take literals only); the agent
/// finds them by these constants, and a unit test of the agent checks that the embedded
/// object defines every one of them.
pub mod names;

/// The offset of a tracepoint field this kernel does not have (`sched_process_exit`'s
/// `group_dead`, new in 6.x): the program leaves the field at 0 instead of reading
/// whatever lies at offset 0 (`common_type`).
pub const FIELD_ABSENT: u32 = u32::MAX;

/// Field offsets of the tracepoints, read from tracefs `format` files by user space and
/// set as a read-only global before load: they differ between kernels (for example
/// `sched_migrate_task.comm` became `__data_loc`, shifting every field after it).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TpOffsets {
    pub switch_prev_pid: u32,
    pub switch_prev_state: u32,
    pub switch_next_pid: u32,
    pub wakeup_pid: u32,
    pub wakeup_target_cpu: u32,
    pub migrate_pid: u32,
    pub migrate_orig_cpu: u32,
    pub migrate_dest_cpu: u32,
    pub fork_child_pid: u32,
    pub exit_group_dead: u32,
    pub pages_succeeded: u32,
    pub pages_failed: u32,
    pub pages_mode: u32,
    pub pages_reason: u32,
    pub move_pid: u32,
    pub move_tgid: u32,
    pub move_src_cpu: u32,
    pub move_src_nid: u32,
    pub move_dst_cpu: u32,
    pub move_dst_nid: u32,
    /// `sched_swap_numa` and `sched_stick_numa` share one layout.
    pub swap_src_pid: u32,
    pub swap_src_tgid: u32,
    pub swap_src_cpu: u32,
    pub swap_src_nid: u32,
    pub swap_dst_pid: u32,
    pub swap_dst_tgid: u32,
    pub swap_dst_cpu: u32,
    pub swap_dst_nid: u32,
    /// Byte offsets in `struct task_struct` of `pid` and of the CPU it is on
    /// (`thread_info.cpu` on x86-64), from the kernel's BTF: the raw scheduler tracepoints
    /// get task pointers, not the format's fields. [`FIELD_ABSENT`] where not found (the
    /// tracepoints then run as formatted ones).
    pub task_pid: u32,
    pub task_cpu: u32,
}
const _: () = assert!(core::mem::size_of::<TpOffsets>() == 120);

#[cfg(feature = "user")]
mod pod {
    // SAFETY: every type here is #[repr(C)], made only of integers, with explicit padding,
    // so any bit pattern is valid.
    unsafe impl aya::Pod for super::TpOffsets {}
    unsafe impl aya::Pod for super::Config {}
    unsafe impl aya::Pod for super::PendingCall {}
    unsafe impl aya::Pod for super::PyLayout {}
}
