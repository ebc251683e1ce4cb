//! `steps.json`, `steps.csv` and the per-step table on stdout.

use std::fmt::Write as _;
use std::io::{self, Write};

use crate::attribute::{Categories, Step, StepsReport, total};

/// Writes `steps.json`.
pub fn write_json(report: &StepsReport, out: &mut impl Write) -> io::Result<()> {
    serde_json::to_writer_pretty(&mut *out, report)?;
    writeln!(out)
}

/// The CSV columns, in order.
pub const CSV_COLUMNS: [&str; 18] = [
    "index",
    "start_ns",
    "end_ns",
    "wall_ns",
    "compute",
    "nccl_wait",
    "page_fault",
    "remote_memory",
    "cpu_migration",
    "runqueue",
    "other_offcpu",
    "nccl_calls",
    "nccl_bytes",
    "faults",
    "migrations",
    "cross_node_migrations",
    "numa_page_migrations",
    "numa_task_moves",
];

/// Writes `steps.csv`: one row per step, categories in ns (`remote_memory` empty when
/// not measured).
pub fn write_csv(report: &StepsReport, out: &mut impl Write) -> io::Result<()> {
    writeln!(out, "{}", CSV_COLUMNS.join(","))?;
    for s in &report.steps {
        let c = &s.categories;
        let remote = c.remote_memory.map(|v| v.to_string()).unwrap_or_default();
        writeln!(
            out,
            "{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{}",
            s.index,
            s.start_ns,
            s.end_ns,
            s.wall_ns,
            c.compute,
            c.nccl_wait,
            c.page_fault,
            remote,
            c.cpu_migration,
            c.runqueue,
            c.other_offcpu,
            s.nccl.calls,
            s.nccl.bytes,
            s.faults,
            s.migrations,
            s.cross_node_migrations,
            s.numa_page_migrations,
            s.numa_task_moves
        )?;
    }
    Ok(())
}

/// The value at quantile `q` (nearest rank) of `values`.
#[must_use]
pub fn quantile(values: &mut [u64], q: f64) -> u64 {
    if values.is_empty() {
        return 0;
    }
    values.sort_unstable();
    let rank = ((q * values.len() as f64).ceil() as usize).clamp(1, values.len());
    values[rank - 1]
}

fn ms(ns: u64) -> String {
    format!("{:.3}", ns as f64 / 1e6)
}

fn pct(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        100.0 * part as f64 / whole as f64
    }
}

fn dominant(c: &Categories) -> (&'static str, u64) {
    c.named()
        .iter()
        .filter(|(name, _)| *name != "compute")
        .filter_map(|(name, v)| v.map(|v| (*name, v)))
        .max_by_key(|(_, v)| *v)
        .unwrap_or(("nccl_wait", 0))
}

fn describe(category: &str) -> &'static str {
    match category {
        "nccl_wait" => "waits on NCCL",
        "page_fault" => "handles page faults",
        "remote_memory" => "stalls on remote-NUMA memory",
        "cpu_migration" => "waits for a CPU after migrations",
        "runqueue" => "waits in the run queue",
        _ => "is blocked off-CPU (I/O, locks)",
    }
}

/// The one line naming the dominant cause.
#[must_use]
pub fn verdict(report: &StepsReport) -> String {
    let sum = total(&report.steps);
    let wall: u64 = report.steps.iter().map(|s| s.wall_ns).sum();
    let (name, value) = dominant(&sum);
    let mut line = format!("{:.0}% of step time {}", pct(value, wall), describe(name));
    if let Some(tid) = report.rank_tid {
        let migrations: u64 = report.steps.iter().map(|s| s.migrations).sum();
        let cross: u64 = report.steps.iter().map(|s| s.cross_node_migrations).sum();
        let _ = write!(
            line,
            "; rank thread {tid} migrated {migrations} times, {:.0}% across nodes",
            pct(cross, migrations)
        );
    }
    line
}

/// Writes the per-category quantiles, the slowest steps and the verdict.
pub fn write_table(report: &StepsReport, out: &mut impl Write) -> io::Result<()> {
    let steps: &[Step] = &report.steps;
    writeln!(
        out,
        "Steps: {} found ({}): {}",
        steps.len(),
        serde_json::to_value(report.method)
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned))
            .unwrap_or_default(),
        report.reason
    )?;
    if steps.is_empty() {
        return Ok(());
    }
    let wall: u64 = steps.iter().map(|s| s.wall_ns).sum();
    let mut walls: Vec<u64> = steps.iter().map(|s| s.wall_ns).collect();
    writeln!(
        out,
        "  {:<14} {:>10} {:>10} {:>10} {:>7}",
        "per step (ms)", "p50", "p90", "p99", "share"
    )?;
    writeln!(
        out,
        "  {:<14} {:>10} {:>10} {:>10} {:>6.1}%",
        "wall",
        ms(quantile(&mut walls, 0.5)),
        ms(quantile(&mut walls, 0.9)),
        ms(quantile(&mut walls, 0.99)),
        100.0
    )?;
    let sum = total(steps);
    for (i, (name, value)) in sum.named().iter().enumerate() {
        let Some(value) = value else {
            writeln!(
                out,
                "  {name:<14} {:>10} (not measured: see steps.json methods)",
                "-"
            )?;
            continue;
        };
        let mut per: Vec<u64> = steps
            .iter()
            .map(|s| s.categories.named()[i].1.unwrap_or(0))
            .collect();
        writeln!(
            out,
            "  {name:<14} {:>10} {:>10} {:>10} {:>6.1}%",
            ms(quantile(&mut per, 0.5)),
            ms(quantile(&mut per, 0.9)),
            ms(quantile(&mut per, 0.99)),
            pct(*value, wall)
        )?;
    }
    let mut slowest: Vec<&Step> = steps.iter().collect();
    slowest.sort_by_key(|s| std::cmp::Reverse(s.wall_ns));
    write!(out, "  slowest steps:")?;
    for s in slowest.iter().take(3) {
        let (name, value) = dominant(&s.categories);
        write!(
            out,
            " #{} {} ms ({name} {} ms);",
            s.index,
            ms(s.wall_ns),
            ms(value)
        )?;
    }
    writeln!(out)?;
    if let Some(top) = report.other_offcpu_top_stacks.first() {
        let leaf: Vec<&str> = top.stack.rsplit(';').take(4).collect();
        writeln!(
            out,
            "  blocked most in: {} ({} ms over the steps; all in steps.json)",
            leaf.into_iter().rev().collect::<Vec<_>>().join(" > "),
            ms(top.total_ns)
        )?;
    }
    writeln!(out, "{}", verdict(report))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Nearest-rank quantiles.
    #[test]
    fn quantiles() {
        let mut v: Vec<u64> = (1..=100).collect();
        assert_eq!(quantile(&mut v, 0.5), 50);
        assert_eq!(quantile(&mut v, 0.9), 90);
        assert_eq!(quantile(&mut v, 0.99), 99);
        assert_eq!(quantile(&mut [], 0.5), 0);
        assert_eq!(quantile(&mut [7], 0.99), 7);
    }
}
