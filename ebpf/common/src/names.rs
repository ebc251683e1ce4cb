/// Entry and return of every traced library call.
pub const UPROBE_LIB_CALL: &str = "uprobe_lib_call";
pub const URETPROBE_LIB_CALL: &str = "uretprobe_lib_call";
/// The two uprobe programs, entry first: loaded and attached together.
pub const UPROBE_PROGRAMS: [&str; 2] = [UPROBE_LIB_CALL, URETPROBE_LIB_CALL];
/// On-CPU samples (a software cpu-clock perf event).
pub const PERF_EVENT_CPU_CLOCK: &str = "perf_event_cpu_clock";
/// Fault timing where the kernel permits fentry/fexit.
pub const FENTRY_HANDLE_MM_FAULT: &str = "fentry_handle_mm_fault";
pub const FEXIT_HANDLE_MM_FAULT: &str = "fexit_handle_mm_fault";
/// NUMA hinting faults (kprobe on `task_numa_fault`).
pub const KPROBE_TASK_NUMA_FAULT: &str = "kprobe_task_numa_fault";
/// Off-CPU stacks of long stretches, taken as the thread comes back (kprobe on
/// `finish_task_switch`, the first code a task runs after a switch).
pub const KPROBE_FINISH_TASK_SWITCH: &str = "kprobe_finish_task_switch";
/// Switch-out times of target threads while off-CPU stacks wait for the switch-in.
pub const OFF_SINCE: &str = "OFF_SINCE";
/// One `u64`: with `Config::offcpu_stacks`, 0 takes them as the thread leaves the CPU,
/// at every switch; otherwise as it comes back ([`KPROBE_FINISH_TASK_SWITCH`], in its
/// own context), only after stretches at least this long (ns), the record timed at the
/// switch-out. Set by user space once that program is attached (a map, not a global:
/// kernels without kprobes keep the stacks at every switch).
pub const OFFCPU_MIN: &str = "OFFCPU_MIN";

/// The ring buffers, one per group of CPUs.
pub const EVENTS: [&str; super::RING_SHARDS as usize] = [
    "EVENTS_0", "EVENTS_1", "EVENTS_2", "EVENTS_3", "EVENTS_4", "EVENTS_5", "EVENTS_6", "EVENTS_7",
];
pub const COUNTERS: &str = "COUNTERS";
/// Runs, timed runs and their nanoseconds of the timed programs for traced threads
/// ([`super::timed`]).
pub const TARGET_COSTS: &str = "TARGET_COSTS";
/// Every program's runs and their nanoseconds, counted by the program itself while
/// [`TIMING`] is set ([`super::run`]).
pub const PROGRAM_COSTS: &str = "PROGRAM_COSTS";
/// One `u32`: nonzero while the programs account their runs (user space's windows,
/// `Accounting`): every program counts and times its runs, and the timed programs their
/// runs for traced threads, only then.
pub const TIMING: &str = "TIMING";
pub const TARGETS: &str = "TARGETS";
/// One `u32`: nonzero from attach to the stop. The entry program of the uprobes made for
/// one target (which skip `TARGETS`) stops at 0: after the stop, while the links are
/// released, the target's calls write nothing (records nobody reads, lost once the ring
/// buffer is full).
pub const ARMED: &str = "ARMED";
pub const THREADS: &str = "THREADS";
/// One byte per pid ([`super::maybe`]): whether it may be a target thread or thread group,
/// looked at before `THREADS` and `TARGETS`. Sized by user space to the host's pid_max.
pub const MAYBE: &str = "MAYBE";
/// Python thread states of target threads (tid → `PyThreadState *`).
pub const PY_THREADS: &str = "PY_THREADS";
/// Python layouts of target processes (tgid → [`PyLayout`](super::PyLayout)).
pub const PY_LAYOUTS: &str = "PY_LAYOUTS";
/// Per-CPU scratch of the `bpf_loop` walk of Python frames (kernel side only).
pub const PY_WINDOW: &str = "PY_WINDOW";
/// Read-only globals set before load.
pub const CONFIG: &str = "CONFIG";
pub const OFFSETS: &str = "OFFSETS";

/// The scheduler's busiest tracepoints as raw tracepoints (their arguments, task
/// pointers), by event: the formatted tracepoint's work before a program runs (its record
/// built in a per-CPU buffer) is paid by every context switch and wake-up of the host,
/// traced or not. Used where the kernel's BTF gives `task_struct`'s offsets and
/// `sched_switch` passes `prev_state` (Linux 5.18+); the formatted ones otherwise.
pub const RAW_SCHED: [(&str, &str); 3] = [
    ("sched_switch", "raw_sched_switch"),
    ("sched_waking", "raw_sched_waking"),
    ("sched_migrate_task", "raw_sched_migrate_task"),
];

/// The raw program for tracepoint `event`, if it has one ([`RAW_SCHED`]).
#[must_use]
pub fn raw_sched_program(event: &str) -> Option<&'static str> {
    RAW_SCHED
        .iter()
        .find(|(e, _)| *e == event)
        .map(|(_, program)| *program)
}

/// Which profile switch turns a tracepoint on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Switch {
    /// `probes.sched`.
    Sched,
    /// `probes.page_faults`.
    PageFaults,
    /// `probes.numa`.
    Numa,
    /// Always: fork and exit keep the thread table right whatever the profile says.
    Always,
}

/// A tracepoint the agent attaches to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tracepoint {
    pub category: &'static str,
    pub event: &'static str,
    /// The program attached to it.
    pub program: &'static str,
    /// A raw tracepoint (its arguments, not the format's fields).
    pub raw: bool,
    pub switch: Switch,
}

const fn tp(
    category: &'static str,
    event: &'static str,
    program: &'static str,
    raw: bool,
    switch: Switch,
) -> Tracepoint {
    Tracepoint {
        category,
        event,
        program,
        raw,
        switch,
    }
}

/// Every tracepoint, with its program and switch.
pub const TRACEPOINTS: [Tracepoint; 10] = [
    tp(
        "sched",
        "sched_switch",
        "tracepoint_sched_switch",
        false,
        Switch::Sched,
    ),
    tp(
        "sched",
        "sched_waking",
        "tracepoint_sched_waking",
        false,
        Switch::Sched,
    ),
    tp(
        "sched",
        "sched_migrate_task",
        "tracepoint_sched_migrate_task",
        false,
        Switch::Sched,
    ),
    tp(
        "sched",
        "sched_process_fork",
        "tracepoint_sched_process_fork",
        false,
        Switch::Always,
    ),
    tp(
        "sched",
        "sched_process_exit",
        "tracepoint_sched_process_exit",
        false,
        Switch::Always,
    ),
    tp(
        "exceptions",
        "page_fault_user",
        "raw_page_fault_user",
        true,
        Switch::PageFaults,
    ),
    tp(
        "migrate",
        "mm_migrate_pages",
        "tracepoint_mm_migrate_pages",
        false,
        Switch::Numa,
    ),
    tp(
        "sched",
        "sched_move_numa",
        "tracepoint_sched_move_numa",
        false,
        Switch::Numa,
    ),
    tp(
        "sched",
        "sched_swap_numa",
        "tracepoint_sched_swap_numa",
        false,
        Switch::Numa,
    ),
    tp(
        "sched",
        "sched_stick_numa",
        "tracepoint_sched_stick_numa",
        false,
        Switch::Numa,
    ),
];
