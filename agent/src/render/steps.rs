//! `steps.json`, `steps.csv` and the per-step table on stdout.

use std::fmt::Write as _;
use std::io::{self, Write};

use crate::attribute::{Categories, Step, StepsReport, total};

/// Writes `steps.json`.
pub fn write_json(report: &StepsReport, out: &mut impl Write) -> io::Result<()> {
    serde_json::to_writer_pretty(&mut *out, report)?;
    writeln!(out)
}

/// The CSV columns before and after the categories (named by [`crate::attribute::NAMES`]).
const CSV_BEFORE: [&str; 4] = ["index", "start_ns", "end_ns", "wall_ns"];
const CSV_AFTER: [&str; 7] = [
    "nccl_collectives",
    "nccl_bytes",
    "faults",
    "migrations",
    "cross_node_migrations",
    "numa_page_migrations",
    "numa_task_moves",
];

/// The CSV header line's columns, in order.
#[must_use]
pub fn csv_columns() -> Vec<&'static str> {
    CSV_BEFORE
        .iter()
        .chain(&crate::attribute::NAMES)
        .chain(&CSV_AFTER)
        .copied()
        .collect()
}

/// Writes `steps.csv`: one row per step, categories in ns (empty when not measured).
pub fn write_csv(report: &StepsReport, out: &mut impl Write) -> io::Result<()> {
    writeln!(out, "{}", csv_columns().join(","))?;
    for s in &report.steps {
        let mut categories = String::new();
        for (_, value) in s.categories.named() {
            if let Some(v) = value {
                let _ = write!(categories, "{v}");
            }
            categories.push(',');
        }
        writeln!(
            out,
            "{},{},{},{},{categories}{},{},{},{},{},{},{}",
            s.index,
            s.start_ns,
            s.end_ns,
            s.wall_ns,
            s.nccl.collectives,
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

/// What time in `category` means, in words; `c` says what the run could measure.
fn describe(category: &str, c: &Categories) -> &'static str {
    match category {
        "nccl_wait" => "waits on NCCL",
        "page_fault" => "handles page faults",
        "remote_memory" => "stalls on remote-NUMA memory",
        "cpu_migration" => "waits for a CPU after migrations",
        "runqueue" => "waits in the run queue",
        _ if c.unmeasured.nccl_wait || c.unmeasured.nccl_wait_lower_bound => {
            "is blocked off-CPU (I/O, locks, or waits for the GPU and NCCL: without CUDA sync \
             probes this profile cannot tell them apart)"
        }
        _ => "is blocked off-CPU (I/O, locks)",
    }
}

/// The median of each category over `steps`, in [`Categories::named`] order.
fn category_medians(steps: &[Step]) -> Vec<u64> {
    (0..Categories::default().named().len())
        .map(|i| {
            let mut all: Vec<u64> = steps
                .iter()
                .map(|s| s.categories.named()[i].1.unwrap_or(0))
                .collect();
            quantile(&mut all, 0.5)
        })
        .collect()
}

/// What made `step` slower than the median step: the category with the largest excess
/// over its own median (`medians`, from [`category_medians`]), and that excess.
fn slowest_cause(step: &Step, medians: &[u64]) -> Option<(&'static str, u64)> {
    step.categories
        .named()
        .into_iter()
        .zip(medians)
        .filter_map(|((name, value), median)| Some((name, value?.saturating_sub(*median))))
        .filter(|(_, excess)| *excess > 0)
        .max_by_key(|(_, excess)| *excess)
}

/// A blocking stack (frames root first, `;`-separated) in short: the innermost user
/// frame, where the program asked to block, then the kernel frames it blocked in.
fn blocked_in(stack: &str) -> String {
    let frames: Vec<&str> = stack.split(';').collect();
    let is_kernel = |f: &str| f.ends_with("_[k]");
    // The first frame names the thread; pseudo-frames ("[blocked]") are in brackets.
    let user = frames
        .iter()
        .skip(1)
        .rfind(|f| !is_kernel(f) && !f.starts_with('['));
    let kernel: Vec<&str> = frames.iter().copied().filter(|f| is_kernel(f)).collect();
    let leaf = &kernel[kernel.len().saturating_sub(3)..];
    let kernel_part = if leaf.is_empty() {
        String::new()
    } else {
        format!(" → {}", leaf.join(" > "))
    };
    match user {
        Some(user) => format!("{user}{kernel_part}"),
        None => format!("(no user frame captured){kernel_part}"),
    }
}

/// The one line naming the dominant cause.
#[must_use]
pub fn verdict(report: &StepsReport) -> String {
    let sum = total(&report.steps);
    let wall: u64 = report.steps.iter().map(|s| s.wall_ns).sum();
    let (name, value) = dominant(&sum);
    let mut line = format!(
        "{:.0}% of step time {}",
        pct(value, wall),
        describe(name, &sum)
    );
    if sum.unmeasured.nccl_wait || sum.unmeasured.nccl_wait_lower_bound {
        // A spinning sync (cudaDeviceScheduleAuto) counts as compute without sync probes.
        let _ = write!(
            line,
            "; compute ({:.0}%) may hold waits for the GPU and NCCL that this profile cannot \
             see (no CUDA sync probes)",
            pct(sum.compute, wall)
        );
    }
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
        let note = if *name == "nccl_wait" && sum.unmeasured.nccl_wait_lower_bound {
            "  (a lower bound: see steps.json methods)"
        } else {
            ""
        };
        writeln!(
            out,
            "  {name:<14} {:>10} {:>10} {:>10} {:>6.1}%{note}",
            ms(quantile(&mut per, 0.5)),
            ms(quantile(&mut per, 0.9)),
            ms(quantile(&mut per, 0.99)),
            pct(*value, wall)
        )?;
    }
    // Time no measured category holds (a category the profile could not measure).
    let unattributed = wall.saturating_sub(sum.total());
    if unattributed > 0 {
        writeln!(
            out,
            "  {:<14} {:>10} {:>10} {:>10} {:>6.1}%  (in no measured category)",
            "unattributed",
            "-",
            "-",
            "-",
            pct(unattributed, wall)
        )?;
    }
    let mut slowest: Vec<&Step> = steps.iter().collect();
    slowest.sort_by_key(|s| std::cmp::Reverse(s.wall_ns));
    let mut walls: Vec<u64> = steps.iter().map(|s| s.wall_ns).collect();
    let median_wall = quantile(&mut walls, 0.5);
    write!(
        out,
        "  slowest steps (against the median step, {} ms):",
        ms(median_wall)
    )?;
    let medians = category_medians(steps);
    for s in slowest.iter().take(3) {
        write!(out, " #{} {} ms", s.index, ms(s.wall_ns))?;
        match slowest_cause(s, &medians) {
            Some((name, excess)) => write!(out, " ({name} +{} ms);", ms(excess))?,
            None => write!(out, ";")?,
        }
    }
    writeln!(out)?;
    if let Some(top) = report.other_offcpu_top_stacks.first() {
        writeln!(
            out,
            "  blocked most in: {} ({} ms over the steps; all in steps.json)",
            blocked_in(&top.stack),
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

    fn step(index: usize, compute: u64, nccl_wait: u64) -> Step {
        Step {
            index,
            start_ns: 0,
            end_ns: compute + nccl_wait,
            wall_ns: compute + nccl_wait,
            categories: Categories {
                compute,
                nccl_wait,
                ..Categories::default()
            },
            nccl: crate::attribute::NcclCount::default(),
            faults: 0,
            migrations: 0,
            cross_node_migrations: 0,
            numa_page_migrations: 0,
            numa_task_moves: 0,
            slowest_rank: None,
            ranks: vec![],
        }
    }

    /// Regression (issue 17): "#267 28.261 ms (nccl_wait 2.067 ms)" named a typical wait
    /// while compute made the step slow. The cause is the category furthest above its
    /// own median.
    #[test]
    fn slowest_step_names_its_excess() {
        let steps: Vec<Step> = (0..9)
            .map(|i| step(i, 3_000_000, 2_000_000))
            .chain([step(9, 25_000_000, 2_100_000)])
            .collect();
        let medians = category_medians(&steps);
        assert_eq!(
            slowest_cause(&steps[9], &medians),
            Some(("compute", 22_000_000))
        );
        assert_eq!(slowest_cause(&steps[0], &medians), None);
    }

    /// Regression (issue 17): "blocked most in:" showed only leaf kernel frames; the
    /// innermost user frame comes first now.
    #[test]
    fn blocked_stack_names_the_user_frame() {
        let stack = "trainer 7 (main (rank));main;train_step;sched_setaffinity;\
                     entry_SYSCALL_64_[k];__x64_sys_sched_setaffinity_[k];stop_one_cpu_[k];\
                     wait_for_completion_[k];schedule_[k];[blocked]";
        assert_eq!(
            blocked_in(stack),
            "sched_setaffinity → stop_one_cpu_[k] > wait_for_completion_[k] > schedule_[k]"
        );
        assert_eq!(
            blocked_in("t 7;a_[k];b_[k];[blocked]"),
            "(no user frame captured) → a_[k] > b_[k]"
        );
    }

    /// steps.csv: the header, from the category names written once, has as many columns
    /// as every row; an unmeasured category is an empty cell, not 0.
    #[test]
    fn csv_columns_match_rows() {
        let mut one = step(0, 3_000_000, 2_000_000);
        one.categories.unmeasured.page_fault = true;
        let report = StepsReport {
            clock: "",
            partial_steps_left_out: 0,
            epochs: 1,
            late_events_left_out: 0,
            method: crate::attribute::steps::Method::Window,
            reason: String::new(),
            period: None,
            rank_pid: None,
            rank_tid: None,
            methods: crate::attribute::Methods {
                nccl_wait: String::new(),
                page_fault: String::new(),
                remote_memory: String::new(),
                remote_memory_estimated: false,
            },
            steps: vec![one],
            threads: vec![],
            other_offcpu_top_stacks: vec![],
            ranks: vec![],
            straggler: None,
        };
        let mut out = Vec::new();
        write_csv(&report, &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        let lines: Vec<Vec<&str>> = text.lines().map(|l| l.split(',').collect()).collect();
        assert_eq!(lines[0].len(), 18);
        assert_eq!(lines[1].len(), lines[0].len());
        let cell = |name: &str| lines[1][lines[0].iter().position(|c| *c == name).unwrap()];
        assert_eq!(cell("compute"), "3000000");
        assert_eq!(cell("nccl_wait"), "2000000");
        assert_eq!(cell("page_fault"), "");
        assert_eq!(cell("remote_memory"), "");
    }
}
