//! Scheduler records: context switches, wake-ups, migrations between CPUs, forks and exits of
//! target threads.

use crate::Header;

/// Flags of [`SwitchEvent`].
pub mod switch_flags {
    /// The task switched out belongs to a target.
    pub const PREV_TARGET: u32 = 1;
    /// The task switched in belongs to a target.
    pub const NEXT_TARGET: u32 = 2;
    /// The native off-CPU stack of the task switched out is its previous one's (format 6;
    /// before, a `STACK_SAME` record said so): where its Python frames, if any, were
    /// reused too, this flag stands for both records.
    pub const OFFCPU_SAME: u32 = 4;
    /// With [`OFFCPU_SAME`]: its off-CPU Python frames are its previous ones' too.
    pub const OFFCPU_PY_SAME: u32 = 8;
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
    /// [`crate::switch_flags`].
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
    /// The CPU the woken thread was to run on, before format 5; `u32::MAX` since (not
    /// read: nothing used it, and reading it cost the program a load from the woken
    /// task's `task_struct`, often another CPU's).
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
