//! What user space sets before load: the switches (`CONFIG`) and the tracepoints' field
//! offsets (`TP_OFFSETS`).

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
    /// [`crate::func::stack_args`]).
    pub streams: u32,
    /// Ring buffers in use (a power of two, at most [`crate::RING_SHARDS`]): CPU `c` writes to
    /// buffer `c % shards`.
    pub shards: u32,
    /// Records are submitted without waking the reader (which polls on a timer) until this
    /// many bytes wait in the ring buffer; then the submit wakes it. 0: wake on every record.
    pub wakeup_bytes: u64,
    /// Nonzero: off-CPU stacks without kernel frames and call-entry stacks are written as
    /// [`crate::kind::STACK_SAME`] where the thread's native stack is where it was last time.
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
const _: () = assert!(core::mem::size_of::<TpOffsets>() == 116);
