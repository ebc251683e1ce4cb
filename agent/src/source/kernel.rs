//! Kernel-function probes: fault timing (fentry/fexit), NUMA hinting faults and the
//! switch-in kprobe that takes off-CPU stacks of long stretches, each with why not.

use super::{
    Btf, Ebpf, FEntry, FExit, KProbe, Link, Loadable, MapData, Path, ProgramError, SourceError,
    names, root_cause, typed_program,
};

/// The kernel function whose entry and return time a user page fault.
pub(super) const FAULT_FUNCTION: &str = "handle_mm_fault";

/// Times user page faults with fentry/fexit on the fault handler. Many kernels refuse
/// these programs (no BPF trampoline, or a policy): then why, and faults are measured by
/// sampling instead. Both links or neither.
pub(super) fn time_faults(
    ebpf: &mut Ebpf,
    btf: Result<Btf, String>,
) -> Result<(String, [Link; 2]), String> {
    let btf = btf?;
    let refused = |e: ProgramError| {
        format!(
            "the kernel refused fentry/fexit on {FAULT_FUNCTION} ({})",
            root_cause(&e)
        )
    };
    let missing = |e: SourceError| e.to_string();
    let entry: &mut FEntry = typed_program(ebpf, names::FENTRY_HANDLE_MM_FAULT).map_err(missing)?;
    entry.load(FAULT_FUNCTION, &btf).map_err(refused)?;
    let id = entry.attach().map_err(refused)?;
    let entry_link = entry.take_link(id).map_err(refused)?;
    let exit: &mut FExit = typed_program(ebpf, names::FEXIT_HANDLE_MM_FAULT).map_err(missing)?;
    exit.load(FAULT_FUNCTION, &btf).map_err(refused)?;
    let id = exit.attach().map_err(refused)?;
    let exit_link = exit.take_link(id).map_err(refused)?;
    Ok((
        format!("fentry/fexit on {FAULT_FUNCTION}"),
        [Link::FEntry(entry_link), Link::FExit(exit_link)],
    ))
}

/// The kernel function NUMA balancing calls for each hinting fault, in the faulting
/// thread's context (kernel/sched/fair.c; no tracepoint reports these faults).
pub(super) const NUMA_HINT_FUNCTION: &str = "task_numa_fault";

/// Why kprobes cannot be attached here, found before loading a program for one (the
/// verifier's work on a program with stacks is ~30 ms): a kernel without kprobes
/// (`CONFIG_KPROBES` unset) has neither the perf PMU nor tracefs's `kprobe_events`.
pub(super) fn kprobes_missing(tracefs_root: &Path) -> Option<String> {
    let pmu = Path::new("/sys/bus/event_source/devices/kprobe");
    (!pmu.exists() && !tracefs_root.join("kprobe_events").exists()).then(|| {
        format!(
            "this kernel has no kprobes (no {}, no kprobe_events in {})",
            pmu.display(),
            tracefs_root.display()
        )
    })
}

/// Traces NUMA hinting faults with a kprobe on [`NUMA_HINT_FUNCTION`]; why not, when the
/// kernel has no kprobes, no such function, or refuses the probe.
pub(super) fn trace_numa_hints(ebpf: &mut Ebpf, tracefs_root: &Path) -> Result<Link, String> {
    if let Some(why) = kprobes_missing(tracefs_root) {
        return Err(format!("no kprobe on {NUMA_HINT_FUNCTION}: {why}"));
    }
    attach_kprobe(ebpf, names::KPROBE_TASK_NUMA_FAULT, NUMA_HINT_FUNCTION)
}

/// Loads the kprobe `program` (unless loaded ahead) and attaches it to `function`; the
/// kernel's refusal, said.
pub(super) fn attach_kprobe(
    ebpf: &mut Ebpf,
    program: &str,
    function: &str,
) -> Result<Link, String> {
    let prog: &mut KProbe = typed_program(ebpf, program).map_err(|e| e.to_string())?;
    let refused = |e: ProgramError| {
        format!(
            "the kernel refused a kprobe on {function} ({})",
            root_cause(&e)
        )
    };
    if !prog.loaded() {
        prog.load().map_err(refused)?;
    }
    let id = prog.attach(function, 0).map_err(refused)?;
    prog.take_link(id).map(Link::KProbe).map_err(refused)
}

/// The kernel function a task runs first after a switch (kernel/sched/core.c), in its own
/// context: where off-CPU stacks of long stretches are taken. Compilers often rename it
/// (`finish_task_switch.isra.0`).
pub(super) const SWITCH_IN_FUNCTION: &str = "finish_task_switch";

/// Whether a kallsyms name is [`SWITCH_IN_FUNCTION`] (a compiler clone's suffix included).
pub(super) fn is_switch_in(name: &str) -> bool {
    name.strip_prefix(SWITCH_IN_FUNCTION)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with('.'))
}

/// What the agent reads of /proc/kallsyms.
#[derive(Default)]
pub(super) struct KernelSymbols {
    /// The fault handlers' address ranges.
    pub(super) fault_handlers: Vec<(u64, u64)>,
    /// The `sched_yield` system call's ([`YIELD_FUNCTIONS`]).
    pub(super) sched_yield: Vec<(u64, u64)>,
    /// The name it gives [`SWITCH_IN_FUNCTION`], if any.
    pub(super) switch_in: Option<String>,
}

/// From /proc/kallsyms, read a line at a time: [`KernelSymbols`].
pub(super) fn kernel_symbols() -> KernelSymbols {
    let Ok(file) = std::fs::File::open("/proc/kallsyms") else {
        return KernelSymbols::default();
    };
    let mut faults = crate::host::FunctionRanges::new(&FAULT_HANDLERS);
    let mut yields = crate::host::FunctionRanges::new(&YIELD_FUNCTIONS);
    let mut switch_in = None;
    crate::host::each_kallsyms_line(std::io::BufReader::new(file), |addr, kind, name| {
        faults.line(addr, kind, name);
        yields.line(addr, kind, name);
        if switch_in.is_none() && is_switch_in(name) {
            switch_in = Some(name.to_owned());
        }
    });
    KernelSymbols {
        fault_handlers: faults.finish(),
        sched_yield: yields.finish(),
        switch_in,
    }
}

/// Takes off-CPU stacks only for stretches of at least `min_ns`, as threads come back to
/// the CPU: attaches the switch-in program, then tells the switch-out program. The
/// description of how they are taken with the program's link, or why they stay at every
/// switch-out.
pub(super) fn offcpu_stacks_on_return(
    ebpf: &mut Ebpf,
    tracefs_root: &Path,
    symbol: Option<String>,
    min_ns: u64,
) -> Result<(String, Link), String> {
    let every = "taken at every switch-out";
    if let Some(why) = kprobes_missing(tracefs_root) {
        return Err(format!("{every}: {why}"));
    }
    let Some(symbol) = symbol else {
        return Err(format!(
            "{every}: no {SWITCH_IN_FUNCTION} in /proc/kallsyms to take them as threads come back"
        ));
    };
    let link = attach_kprobe(ebpf, names::KPROBE_FINISH_TASK_SWITCH, &symbol)
        .map_err(|why| format!("{every}: {why}"))?;
    let mut min: aya::maps::Array<&mut MapData, u64> = aya::maps::Array::try_from(
        ebpf.map_mut(names::OFFCPU_MIN)
            .ok_or_else(|| format!("{every}: the programs have no {} map", names::OFFCPU_MIN))?,
    )
    .map_err(|e| format!("{every}: {e}"))?;
    min.set(0, min_ns, 0).map_err(|e| format!("{every}: {e}"))?;
    let how = format!(
        "taken as threads come back to the CPU (kprobe on {symbol}), for stretches of {} µs \
         or more",
        min_ns / 1000
    );
    Ok((how, link))
}

/// Kernel functions on the user page-fault path: a sample whose kernel stack passes
/// through one of them was taken while handling a fault.
pub const FAULT_HANDLERS: [&str; 5] = [
    "asm_exc_page_fault",
    "exc_page_fault",
    "do_user_addr_fault",
    "handle_mm_fault",
    "__handle_mm_fault",
];

/// The `sched_yield` system call: the CUDA driver yields the CPU in it while it waits for
/// the GPU outside a sync (room in a full launch queue).
pub const YIELD_FUNCTIONS: [&str; 3] = [
    "do_sched_yield",
    "__x64_sys_sched_yield",
    "__ia32_sys_sched_yield",
];

#[cfg(test)]
mod tests {
    use super::*;

    /// The switch-in function under the names compilers give it, and not its neighbours.
    #[test]
    fn switch_in_names() {
        assert!(is_switch_in("finish_task_switch"));
        assert!(is_switch_in("finish_task_switch.isra.0"));
        assert!(!is_switch_in("finish_task_switch_irq"));
        assert!(!is_switch_in("__finish_task_switch"));
    }
}
