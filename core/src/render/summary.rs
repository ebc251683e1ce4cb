//! `summary.json` and the same summary in words.

use std::io::{self, Write};

use crate::summary::Summary;

/// Writes `summary.json`.
pub fn write_json(summary: &Summary, out: &mut impl Write) -> io::Result<()> {
    serde_json::to_writer_pretty(&mut *out, summary)?;
    writeln!(out)
}

/// Bytes in GB (10^9) with two decimals, or MB with one below a GB.
fn gigabytes(bytes: u64) -> String {
    if bytes >= 1_000_000_000 {
        format!("{:.2} GB", bytes as f64 / 1e9)
    } else {
        format!("{:.1} MB", bytes as f64 / 1e6)
    }
}

fn ms(ns: u64) -> String {
    format!("{:.3} ms", ns as f64 / 1e6)
}

/// Writes the summary for a terminal.
pub fn write_text(s: &Summary, out: &mut impl Write) -> io::Result<()> {
    writeln!(out, "nccltrace summary: {} traced", ms(s.duration_ns))?;
    if let Some(reason) = &s.stop_reason {
        writeln!(out, "  stopped: {reason}")?;
    }
    for t in &s.targets {
        writeln!(
            out,
            "  target pid {} ({}): NCCL {}, CUDA {}, {} probes",
            t.pid,
            t.comm,
            t.nccl_library.as_deref().unwrap_or("not found"),
            t.cuda_library.as_deref().unwrap_or("not found"),
            t.probes
        )?;
        if let Some(py) = &t.python {
            match (&py.note, t.python_stacks) {
                (Some(note), _) => writeln!(out, "    python: {note}")?,
                (None, stacks) => writeln!(
                    out,
                    "    python: CPython {} ({}), frames named in {} stacks",
                    py.version,
                    py.path,
                    stacks.unwrap_or(0)
                )?,
            }
        }
    }
    write!(
        out,
        "NCCL: {} calls, {} bytes, {} errors",
        s.nccl.calls, s.nccl.bytes, s.nccl.errors
    )?;
    if s.nccl.entry_only > 0 {
        write!(
            out,
            " ({} calls traced at entry only: their time and result not seen)",
            s.nccl.entry_only
        )?;
    }
    writeln!(out)?;
    for (op, o) in &s.nccl.by_op {
        writeln!(
            out,
            "  {op:<20} {:>8} calls {:>14} bytes  enqueue {}",
            o.calls,
            o.bytes,
            o.enqueue_ns.map_or_else(|| "not traced".to_owned(), ms)
        )?;
    }
    writeln!(
        out,
        "CUDA sync: {} calls, waited {}",
        s.cuda_sync.calls,
        ms(s.cuda_sync.wait_ns)
    )?;
    for (f, c) in &s.cuda_sync.by_func {
        writeln!(
            out,
            "  {f:<26} {:>8} calls  waited {}",
            c.calls,
            ms(c.wait_ns)
        )?;
    }
    writeln!(
        out,
        "Scheduler: {} threads, {} switches out ({} involuntary), {} wakeups, {} migrations",
        s.sched.threads_seen,
        s.sched.switches_out,
        s.sched.involuntary_switches,
        s.sched.wakeups,
        s.sched.migrations
    )?;
    let faults = s.memory.page_faults.map_or_else(
        || "page faults not traced (the profile has them off)".to_owned(),
        |n| format!("{n} page faults"),
    );
    writeln!(
        out,
        "Memory: {faults}, {} pages migrated",
        s.memory.pages_migrated
    )?;
    write_infiniband(s, out)?;
    write_gpus(s, out)?;
    writeln!(out, "Events: {} recorded, {} lost", s.events, s.lost_events)?;
    for (kind, n) in s.lost_by_kind.iter().filter(|(_, n)| **n > 0) {
        writeln!(out, "  lost {kind}: {n}")?;
    }
    if let Some(what) = &s.attributed {
        writeln!(out, "Attributed: {what}")?;
    }
    if let Some(why) = &s.incomplete {
        writeln!(out, "Incomplete: {why}")?;
    }
    if let Some(what) = &s.damaged {
        writeln!(out, "Damaged: {what}")?;
    }
    Ok(())
}

/// Each InfiniBand port's traffic and errors over the run, a line each.
fn write_infiniband(s: &Summary, out: &mut impl Write) -> io::Result<()> {
    let Some(ib) = &s.infiniband else {
        return Ok(());
    };
    for (port, counters) in &ib.0 {
        let get = |name: &str| counters.iter().find(|(n, _)| *n == name).map(|c| c.1);
        let bytes = |name: &str| get(name).map_or_else(|| "?".to_owned(), gigabytes);
        let errors: Vec<String> = counters
            .iter()
            .filter(|(n, v)| *v > 0 && !n.starts_with("transmit") && !n.starts_with("receive"))
            .filter(|(n, _)| !n.ends_with("_packets") && *n != "port_xmit_wait")
            .map(|(n, v)| format!("{n} {v}"))
            .collect();
        writeln!(
            out,
            "InfiniBand {port}: {} sent, {} received, {}",
            bytes("transmit_bytes"),
            bytes("receive_bytes"),
            if errors.is_empty() {
                "no errors".to_owned()
            } else {
                errors.join(", ")
            }
        )?;
    }
    Ok(())
}

/// Each GPU read over the run, a line each, or why none was.
fn write_gpus(s: &Summary, out: &mut impl Write) -> io::Result<()> {
    let g = &s.gpus;
    if let Some(why) = &g.refused {
        return writeln!(out, "GPUs: not read ({why})");
    }
    for gpu in &g.read {
        let busy = gpu.busy.map_or_else(
            || "busy not sampled".to_owned(),
            |b| {
                format!(
                    "busy {:.0}% of {:.1} s sampled ({} NVML samples)",
                    b * 100.0,
                    gpu.sampled_ns as f64 / 1e9,
                    gpu.busy_samples
                )
            },
        );
        let clocks = match (gpu.sm_clock_mhz_min, gpu.sm_clock_mhz_max) {
            (Some(lo), Some(hi)) => format!(", SM clock {lo}–{hi} MHz"),
            _ => String::new(),
        };
        let reasons = gpu
            .clock_event_reasons
            .as_ref()
            .filter(|r| r.iter().any(|n| *n != "gpu_idle"))
            .map(|r| format!(", clocks held down: {}", r.join(", ")))
            .unwrap_or_default();
        let shared = gpu
            .processes_max
            .filter(|n| *n > 1)
            .map(|n| format!(", shared by up to {n} processes (NVML's compute processes)"))
            .unwrap_or_default();
        writeln!(
            out,
            "GPU {} {}: {busy}{clocks}{reasons}{shared}",
            gpu.index, gpu.name
        )?;
    }
    Ok(())
}

/// The agent's own cost in one line: the programs' run time per step, in the traced
/// threads and on all CPUs.
pub fn write_cost(agent: &crate::summary::AgentStats, out: &mut impl Write) -> io::Result<()> {
    let Some(bpf) = &agent.bpf else {
        let why = agent.bpf_unmeasured.as_deref().unwrap_or("no reading");
        return writeln!(out, "agent cost: not measured ({why})");
    };
    let us = |ns: u64| ns as f64 / 1e3;
    let per_second = format!("{:.2} ms of CPU a second", bpf.cpu_share * 1e3);
    let traps = bpf.traps_per_step_ns.map_or_else(
        || "uprobe traps not measured".to_owned(),
        |t| format!("uprobe traps {:.1} µs", us(t)),
    );
    // Sampling interrupts: measured, none (no samples), or not measured and why.
    let (sampling, not_counted) = match (bpf.sampling_per_step_ns, &bpf.sampling_unmeasured) {
        (Some(ns), _) if bpf.sampling_ns.unwrap_or(0) > 0 => (
            format!(", sampling interrupts {:.1} µs", us(ns)),
            String::new(),
        ),
        (_, Some(why)) => (
            String::new(),
            format!("; the sampling interrupt is not counted ({why})"),
        ),
        _ => (String::new(), String::new()),
    };
    let steps = bpf
        .traced_total_per_step_ns
        .zip(bpf.traced_total_step_share);
    let head = match (steps, bpf.traced_per_step_ns, bpf.per_step_ns) {
        (Some((total, share)), Some(programs), Some(all)) => format!(
            "{:.1} µs a step in the traced threads ({:.2}% of step time, estimated: programs \
             {:.1} µs, {traps}{sampling}), {:.1} µs of programs on all CPUs ({per_second})",
            us(total),
            share * 100.0,
            us(programs),
            us(all)
        ),
        _ => format!(
            "{per_second} on all CPUs, {:.2} ms of it in the traced threads (estimated)",
            bpf.traced_ns as f64 / 1e6
        ),
    };
    let mut heaviest: Vec<&crate::summary::ProgramCost> = bpf.programs.iter().collect();
    heaviest.sort_by_key(|p| std::cmp::Reverse(p.traced_ns));
    let top: Vec<String> = heaviest
        .iter()
        .take(3)
        .map(|p| match p.traced_per_step_ns {
            Some(ns) => format!("{} {:.1} µs", p.name, us(ns)),
            None => format!("{} {:.2} ms", p.name, p.traced_ns as f64 / 1e6),
        })
        .collect();
    // Counted in windows: said, since every figure is then scaled.
    let windows = bpf
        .accounted_share
        .filter(|share| *share < 0.995)
        .map_or_else(String::new, |share| {
            format!(
                "; programs counted {:.0}% of the run, scaled (profile [cost] timing_ms)",
                share * 100.0
            )
        });
    // Inside the steps and outside them (start-up, idle): what tracing costs a step.
    let inside = match (
        bpf.in_steps_per_step_ns,
        bpf.in_steps_step_share,
        bpf.outside_steps_ns,
    ) {
        (Some(step), Some(share), Some(outside)) => format!(
            "{:.1} µs a step inside the steps ({:.2}% of step time) and {:.2} ms outside \
             them (start-up, idle; split by reading interval, estimated); over the whole run ",
            us(step),
            share * 100.0,
            outside as f64 / 1e6
        ),
        _ => String::new(),
    };
    writeln!(
        out,
        "agent cost: {inside}{head} — programs in the traced threads: {}{not_counted}{windows}",
        top.join(", ")
    )
}
