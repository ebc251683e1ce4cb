//! The per-step table on stdout, its histograms and the verdict under it.

use super::*;

/// The value at quantile `q` (nearest rank) of `values`.
#[must_use]
pub fn quantile(values: &mut [u64], q: f64) -> u64 {
    if values.is_empty() {
        return 0;
    }
    let rank = ((q * values.len() as f64).ceil() as usize).clamp(1, values.len());
    // The one value wanted, not the whole order.
    *values.select_nth_unstable(rank - 1).1
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
        "nccl_wait" => {
            "waits in CUDA syncs with NCCL collectives outstanding (an upper bound of the wait \
             for NCCL: the sync also waits for GPU work queued before them)"
        }
        "gpu_wait" => {
            "waits for the GPU's own work in CUDA syncs (kernels, copies; no collective of a \
             multi-rank communicator outstanding)"
        }
        "page_fault" => "handles page faults",
        "remote_memory" => "stalls on remote-NUMA memory (an estimate from NUMA hinting faults)",
        "cpu_migration" => "waits for a CPU after migrations",
        "runqueue" => "waits in the run queue",
        _ if c.unmeasured.nccl_wait || c.unmeasured.nccl_wait_lower_bound => {
            "is blocked off-CPU (I/O, locks, or waits for the GPU and NCCL: without CUDA sync \
             probes this profile cannot tell them apart)"
        }
        _ => "is blocked off-CPU (I/O, locks)",
    }
}

/// What the table and the verdict need of every step, not the steps themselves (a long
/// run's steps are written out as they close): exact values for the first
/// [`EXACT_STEPS`] steps, then log-bucket histograms (each quantile within 0.2%, said
/// under the table), so that memory stays bounded at any run length.
#[derive(Clone, Debug, Default)]
pub struct StepTable {
    steps: usize,
    /// Wall time, then each category in [`Categories::named`] order (`NOT_MEASURED`
    /// where not measured).
    pub(super) columns: [Column; 1 + crate::attribute::NAMES.len()],
    /// The slowest steps: (wall, index, the columns' values), slowest first.
    pub(super) slowest: Vec<(u64, usize, [u64; 1 + crate::attribute::NAMES.len()])>,
    sum: Categories,
    wall_ns: u64,
    migrations: u64,
    cross_node_migrations: u64,
    /// Steps with one GPU read over them: (Σ busy share × wall, Σ wall), and whether any
    /// step had several (then no verdict names the rank's GPU).
    gpu: (f64, u64),
    several_gpus: bool,
}

/// Steps whose values are kept exactly; past them, histograms.
pub const EXACT_STEPS: usize = 10_000;
/// Slowest steps kept.
const SLOWEST: usize = 3;
/// A category value the step could not measure, in [`StepTable`].
const NOT_MEASURED: u64 = u64::MAX;

/// One column of the table.
#[derive(Clone, Debug)]
pub(super) enum Column {
    Exact(Vec<u64>),
    Histogram(LogHistogram),
}

impl Default for Column {
    fn default() -> Self {
        Column::Exact(Vec::new())
    }
}

/// Counts per bucket: values below 1024 exactly, above in 512 buckets per power of two
/// (a bucket's width is at most 1/512 = 0.2% of its values).
#[derive(Clone, Debug, Default)]
pub struct LogHistogram {
    /// Indexed by bucket, up to the highest seen (50 KB for ms-long steps, 230 KB at
    /// most): a tree's lookup per value was a fifth of a short-step run's report.
    counts: Vec<u64>,
}

const MANTISSA_BITS: u32 = 9;

impl LogHistogram {
    pub(super) fn bucket(v: u64) -> u32 {
        if v < 1 << (MANTISSA_BITS + 1) {
            return v as u32;
        }
        let exp = v.ilog2();
        let mantissa = (v >> (exp - MANTISSA_BITS)) & ((1 << MANTISSA_BITS) - 1);
        ((exp - MANTISSA_BITS) << MANTISSA_BITS | mantissa as u32) + (1 << MANTISSA_BITS)
    }

    /// The middle of bucket `b`'s values.
    pub(super) fn value(b: u32) -> u64 {
        if b < 1 << (MANTISSA_BITS + 1) {
            return u64::from(b);
        }
        let b = b - (1 << MANTISSA_BITS);
        let shift = b >> MANTISSA_BITS;
        let mantissa = u64::from(b & ((1 << MANTISSA_BITS) - 1));
        let low = ((1 << MANTISSA_BITS) | mantissa) << shift;
        low + (1u64 << shift) / 2
    }

    pub fn add(&mut self, v: u64) {
        let b = Self::bucket(v) as usize;
        if b >= self.counts.len() {
            self.counts.resize(b + 1, 0);
        }
        self.counts[b] += 1;
    }

    /// The value at quantile `q` (nearest rank), within a bucket's width.
    #[must_use]
    pub fn quantile(&self, q: f64) -> u64 {
        let n: u64 = self.counts.iter().sum();
        if n == 0 {
            return 0;
        }
        let rank = ((q * n as f64).ceil() as u64).clamp(1, n);
        let mut seen = 0;
        for (b, c) in (0u32..).zip(&self.counts) {
            seen += c;
            if seen >= rank {
                return Self::value(b);
            }
        }
        0
    }
}

impl Column {
    fn push(&mut self, v: u64) {
        match self {
            Column::Exact(values) => {
                if values.capacity() == 0 {
                    values.reserve_exact(EXACT_STEPS);
                }
                values.push(v);
            }
            Column::Histogram(h) => h.add(v),
        }
    }

    /// Past [`EXACT_STEPS`]: into a histogram.
    fn fold(&mut self) {
        if let Column::Exact(values) = self {
            let mut h = LogHistogram::default();
            for v in values.iter() {
                h.add(*v);
            }
            *self = Column::Histogram(h);
        }
    }

    /// The value at quantile `q`, not-measured values counted as 0.
    pub(super) fn quantile(&self, q: f64) -> u64 {
        match self {
            Column::Exact(values) => {
                let mut v: Vec<u64> = values
                    .iter()
                    .map(|v| if *v == NOT_MEASURED { 0 } else { *v })
                    .collect();
                quantile(&mut v, q)
            }
            Column::Histogram(h) => h.quantile(q),
        }
    }
}

impl StepTable {
    /// The table of `steps`.
    #[must_use]
    pub fn of(steps: &[Step]) -> StepTable {
        let mut t = StepTable::default();
        for s in steps {
            t.push(s);
        }
        t
    }

    /// Adds the next step.
    pub fn push(&mut self, s: &Step) {
        let mut row = [0u64; 1 + crate::attribute::NAMES.len()];
        row[0] = s.wall_ns;
        for (cell, (_, v)) in row[1..].iter_mut().zip(s.categories.named()) {
            *cell = v.unwrap_or(NOT_MEASURED);
        }
        if self.steps == EXACT_STEPS {
            self.columns.iter_mut().for_each(Column::fold);
        }
        for (column, v) in self.columns.iter_mut().zip(row) {
            column.push(
                if v == NOT_MEASURED && matches!(column, Column::Histogram(_)) {
                    0
                } else {
                    v
                },
            );
        }
        // Slowest first; among equals, the earlier step.
        let at = self.slowest.partition_point(|(w, _, _)| *w >= s.wall_ns);
        if at < SLOWEST {
            self.slowest.insert(at, (s.wall_ns, s.index, row));
            self.slowest.truncate(SLOWEST);
        }
        self.steps += 1;
        self.wall_ns += s.wall_ns;
        self.sum.add(&s.categories);
        self.migrations += s.migrations;
        self.cross_node_migrations += s.cross_node_migrations;
        match s.gpu.as_deref().map_or(&[][..], Vec::as_slice) {
            [one] => {
                self.gpu.0 += f64::from(one.busy) / 1000.0 * s.wall_ns as f64;
                self.gpu.1 += s.wall_ns;
            }
            [] => {}
            _ => self.several_gpus = true,
        }
    }

    /// The GPU's busy share of the steps' time (0 to 1) where one GPU was read over them,
    /// and the share of step time those steps make.
    #[must_use]
    pub fn gpu_busy(&self) -> Option<(f64, f64)> {
        (!self.several_gpus && self.gpu.1 > 0).then(|| {
            (
                self.gpu.0 / self.gpu.1 as f64,
                self.gpu.1 as f64 / self.wall_ns.max(1) as f64,
            )
        })
    }

    /// Steps in the table.
    #[must_use]
    pub fn len(&self) -> usize {
        self.steps
    }

    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.steps == 0
    }

    /// Whether quantiles come from histograms (more than [`EXACT_STEPS`] steps).
    #[must_use]
    pub fn approximate(&self) -> bool {
        self.steps > EXACT_STEPS
    }

    /// The median of each category, in [`Categories::named`] order.
    pub(super) fn category_medians(&self) -> Vec<u64> {
        self.columns[1..].iter().map(|c| c.quantile(0.5)).collect()
    }

    /// What made a step (its `row`) slower than the median step: the category with the
    /// largest excess over its own median (`medians`), and that excess.
    pub(super) fn slowest_cause(
        row: &[u64; 1 + crate::attribute::NAMES.len()],
        medians: &[u64],
    ) -> Option<(&'static str, u64)> {
        crate::attribute::NAMES
            .iter()
            .zip(&row[1..])
            .zip(medians)
            .filter(|((_, v), _)| **v != NOT_MEASURED)
            .map(|((name, v), median)| (*name, v.saturating_sub(*median)))
            .filter(|(_, excess)| *excess > 0)
            .max_by_key(|(_, excess)| *excess)
    }
}

/// A blocking stack (frames root first, `;`-separated) in short: the innermost user
/// frame, where the program asked to block, then the kernel frames it blocked in.
pub(super) fn blocked_in(stack: &str) -> String {
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

/// The lines naming where the rank thread waited with collectives outstanding and for
/// the GPU most (its Python line, when the stacks have Python frames) and where it
/// blocked most.
fn write_top_stacks(report: &StepsReport, out: &mut impl Write) -> io::Result<()> {
    for (what, tops) in [
        ("with NCCL outstanding", &report.nccl_wait_top_stacks),
        ("for the GPU", &report.gpu_wait_top_stacks),
    ] {
        if let Some(top) = tops.first()
            && let Some(line) = python_line(&top.stack)
        {
            writeln!(
                out,
                "  waited {what} most at: {line} ({} ms over the steps; all in steps.json)",
                ms(top.total_ns)
            )?;
        }
    }
    if let Some(top) = report.other_offcpu_top_stacks.first() {
        writeln!(
            out,
            "  blocked most in: {} ({} ms over the steps; all in steps.json)",
            blocked_in(&top.stack),
            ms(top.total_ns)
        )?;
    }
    Ok(())
}

/// The innermost Python frame of a folded stack (`wait_for_gpu (train.py:41)`), if any.
fn python_line(stack: &str) -> Option<&str> {
    stack
        .split(';')
        .rfind(|f| f.ends_with(')') && f.contains(".py:"))
}

/// The one line naming the dominant cause.
#[must_use]
pub fn verdict(report: &StepsReport, table: &StepTable) -> String {
    let sum = table.sum;
    let wall = table.wall_ns;
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
    if let Some(bound) = gpu_bound(table) {
        let _ = write!(line, "; {bound}");
    }
    if let Some(tid) = report.rank_tid {
        let (migrations, cross) = (table.migrations, table.cross_node_migrations);
        let _ = write!(
            line,
            "; rank thread {tid} migrated {migrations} times, {:.0}% across nodes",
            pct(cross, migrations)
        );
    }
    line
}

/// Busy this share of the steps' time or more, the GPU bounds the step.
const GPU_BOUND: f64 = 0.85;
/// Busy this share or less, the host does.
const HOST_BOUND: f64 = 0.5;

/// Whether the GPU or the host bounds the steps, from the GPU's busy share (NVML) where one
/// GPU was read over them; `None` where none or several were.
fn gpu_bound(table: &StepTable) -> Option<String> {
    let (busy, covered) = table.gpu_busy()?;
    let sum = &table.sum;
    let wall = table.wall_ns;
    let of = if covered < 0.99 {
        format!(
            " of the {:.0}% of step time it was sampled over",
            covered * 100.0
        )
    } else {
        String::new()
    };
    Some(if busy >= GPU_BOUND {
        format!(
            "GPU-bound: the GPU was busy {:.0}% of the steps' time{of} (NVML); the host waited \
             for it {:.0}% (gpu_wait) and for NCCL {:.0}%",
            busy * 100.0,
            pct(sum.gpu_wait, wall),
            pct(sum.nccl_wait, wall)
        )
    } else if busy <= HOST_BOUND {
        format!(
            "host-bound: the GPU idled {:.0}% of the steps' time{of} (NVML) while the rank's \
             threads computed {:.0}% of it",
            (1.0 - busy) * 100.0,
            pct(sum.compute, wall)
        )
    } else {
        format!(
            "the GPU was busy {:.0}% of the steps' time{of} (NVML): between what this verdict \
             calls host-bound ({:.0}% or less) and GPU-bound ({:.0}% or more)",
            busy * 100.0,
            HOST_BOUND * 100.0,
            GPU_BOUND * 100.0
        )
    })
}

/// The idle stretches, a line each, with what the rank thread mostly did in them (a sleep,
/// loading, the end's teardown).
fn write_idle(report: &StepsReport, out: &mut impl Write) -> io::Result<()> {
    for idle in &report.idle {
        let mostly = idle
            .categories
            .named()
            .into_iter()
            .filter_map(|(name, ns)| Some((name, ns?)))
            .max_by_key(|&(_, ns)| ns)
            .filter(|&(_, ns)| ns > 0 && idle.wall_ns > 0)
            .map(|(name, ns)| {
                format!(
                    "mostly {name} {:.0}%; ",
                    100.0 * ns as f64 / idle.wall_ns as f64
                )
            })
            .unwrap_or_default();
        // Pages moved between nodes are the one count said here: a `migrate_pages()`
        // call of a second or more between steps reads as a pause.
        let moved = match idle.numa_page_migrations {
            0 => String::new(),
            n => format!("{n} pages moved between NUMA nodes; "),
        };
        // A stretch with collectives that repeat as no step does is not idle: said so.
        let (what, held) = match idle.collectives {
            0 => ("idle, not a step", "no collectives".to_owned()),
            n => (
                "not a step",
                format!("{n} collectives that repeat as no step does"),
            ),
        };
        writeln!(
            out,
            "  {what}: {:.3} s {} ({held}; {mostly}{moved}steps.json idle)",
            idle.wall_ns as f64 / 1e9,
            idle.when
        )?;
        // Its Python line where it has one, else its user frame (the stack has no thread
        // frame of its own: one is put before it); said where it holds a tenth of the
        // stretch or more (short off-CPU stretches have no stack by design).
        if let Some(top) = idle
            .top_stacks
            .first()
            .filter(|t| t.total_ns.saturating_mul(10) >= idle.wall_ns)
        {
            let at = python_line(&top.stack).map_or_else(
                || blocked_in(&format!("thread;{}", top.stack)),
                str::to_owned,
            );
            if !at.starts_with("(no user frame") {
                writeln!(out, "    most at: {at} ({} ms)", ms(top.total_ns))?;
            }
        }
    }
    Ok(())
}

/// Where the run followed several jobs (one after another): a line each, its steps and
/// their median (while the table keeps every step's wall time), its rank, how it ended.
/// The table below is of every job's steps.
fn write_jobs(report: &StepsReport, table: &StepTable, out: &mut impl Write) -> io::Result<()> {
    if report.jobs.len() < 2 {
        return Ok(());
    }
    writeln!(
        out,
        "  {} jobs followed, one after another (steps.json jobs); the table is of all their \
         steps:",
        report.jobs.len()
    )?;
    for (i, job) in report.jobs.iter().enumerate() {
        // The table's wall times are the steps' in order, up to EXACT_STEPS of them.
        let range = job.first_step..job.first_step + job.steps;
        let mut walls: Vec<u64> = match &table.columns[0] {
            Column::Exact(walls) => walls.get(range).map(<[u64]>::to_vec).unwrap_or_default(),
            Column::Histogram(_) => Vec::new(),
        };
        walls.sort_unstable();
        let median = walls
            .get(walls.len() / 2)
            .map_or_else(String::new, |w| format!(", median {} ms", ms(*w)));
        let left_out = match job.steps_left_out {
            0 => String::new(),
            n => format!(", {n} before it was followed left out"),
        };
        let ended = if job.exited_ns.is_some() {
            "exited"
        } else {
            "ran to the end"
        };
        writeln!(
            out,
            "    job {}: pid {}{}: {} steps{median}{left_out}; {ended}",
            i + 1,
            job.rank_pid,
            job.job
                .as_ref()
                .map_or_else(String::new, |j| format!(" ({j})")),
            job.steps,
        )?;
    }
    Ok(())
}

/// Writes the per-category quantiles, the slowest steps and the verdict.
pub fn write_table(
    report: &StepsReport,
    table: &StepTable,
    out: &mut impl Write,
) -> io::Result<()> {
    writeln!(
        out,
        "Steps: {} found ({}): {}",
        table.len(),
        serde_json::to_value(report.method)
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned))
            .unwrap_or_default(),
        report.reason
    )?;
    write_jobs(report, table, out)?;
    write_idle(report, out)?;
    if table.is_empty() {
        return Ok(());
    }
    let wall = table.wall_ns;
    writeln!(
        out,
        "  {:<14} {:>10} {:>10} {:>10} {:>7}",
        "per step (ms)", "p50", "p90", "p99", "share"
    )?;
    writeln!(
        out,
        "  {:<14} {:>10} {:>10} {:>10} {:>6.1}%",
        "wall",
        ms(table.columns[0].quantile(0.5)),
        ms(table.columns[0].quantile(0.9)),
        ms(table.columns[0].quantile(0.99)),
        100.0
    )?;
    let sum = table.sum;
    for (i, (name, value)) in sum.named().iter().enumerate() {
        let Some(value) = value else {
            writeln!(
                out,
                "  {name:<14} {:>10} (not measured: see steps.json methods)",
                "-"
            )?;
            continue;
        };
        let per = &table.columns[i + 1];
        let note = match *name {
            "nccl_wait" if sum.unmeasured.nccl_wait_lower_bound => {
                "  (a lower bound: see steps.json methods)"
            }
            "nccl_wait" => "  (an upper bound: see steps.json methods)",
            _ => "",
        };
        writeln!(
            out,
            "  {name:<14} {:>10} {:>10} {:>10} {:>6.1}%{note}",
            ms(per.quantile(0.5)),
            ms(per.quantile(0.9)),
            ms(per.quantile(0.99)),
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
    let median_wall = table.columns[0].quantile(0.5);
    write!(
        out,
        "  slowest steps (against the median step, {} ms):",
        ms(median_wall)
    )?;
    let medians = table.category_medians();
    for (wall, index, row) in &table.slowest {
        write!(out, " #{index} {} ms", ms(*wall))?;
        match StepTable::slowest_cause(row, &medians) {
            Some((name, excess)) => write!(out, " ({name} +{} ms);", ms(excess))?,
            None => write!(out, ";")?,
        }
    }
    writeln!(out)?;
    if table.approximate() {
        writeln!(
            out,
            "  (p50/p90/p99 from log-bucket histograms past the first {EXACT_STEPS} steps: \
             each within 0.2%)"
        )?;
    }
    write_top_stacks(report, out)?;
    write_ranks(report, out)?;
    write_workers(report, out)?;
    writeln!(out, "{}", verdict(report, table))
}

/// With several ranks: each rank's NCCL traffic and where its training-loop thread's time
/// went over the run, then the straggler (each job's, where the ranks are of several).
/// The processes that work for a rank, a line each, under the ranks.
fn write_workers(report: &StepsReport, out: &mut impl Write) -> io::Result<()> {
    if report.workers.is_empty() {
        return Ok(());
    }
    writeln!(
        out,
        "Workers: {} (forked by a rank, no collective of their own: not ranks)",
        report.workers.len()
    )?;
    for w in &report.workers {
        let total = w.categories.total();
        let (name, value) = dominant(&w.categories);
        let rank = w.rank.map_or_else(|| "?".to_owned(), |r| r.to_string());
        writeln!(
            out,
            "  pid {} of rank {rank} (pid {}): {} thread(s); over the run compute {:.1}%, {} \
             {:.1}%; {} faults",
            w.pid,
            w.rank_pid,
            w.threads,
            pct(w.categories.compute, total),
            name,
            pct(value, total),
            w.faults
        )?;
    }
    Ok(())
}

fn write_ranks(report: &StepsReport, out: &mut impl Write) -> io::Result<()> {
    use crate::attribute::align::{IN_ORDER, REFERENCE};
    if report.ranks.len() < 2 {
        return Ok(());
    }
    writeln!(out, "Ranks: {}", report.ranks.len())?;
    for r in &report.ranks {
        let total = r.categories.total();
        let (name, value) = dominant(&r.categories);
        writeln!(
            out,
            "  rank {} (pid {}, {}): {} collectives, {} bytes; over the run compute {:.1}%, \
             {} {:.1}%",
            r.rank,
            r.pid,
            r.rank_source,
            r.nccl.collectives,
            r.nccl.bytes,
            pct(r.categories.compute, total),
            name,
            pct(value, total)
        )?;
        if report.one_rank_jobs.contains(&r.pid) {
            writeln!(
                out,
                "    a job of its own: every collective on a one-rank communicator"
            )?;
        }
        // Lined up other than in plain order (docs/ranks.md): said, as it bears on the
        // straggler.
        if let Some(how) = r
            .matched
            .as_deref()
            .filter(|h| ![IN_ORDER, REFERENCE].contains(h))
        {
            writeln!(out, "    matched {how}")?;
        }
    }
    let line = |s: &crate::attribute::ranks::Straggler| {
        format!(
            "rank {} (pid {}): {:.0}% of the waits at collectives, {} ms late on average",
            s.rank,
            s.pid,
            s.share_of_waits * 100.0,
            ms(s.mean_lateness_ns)
        )
    };
    match &report.straggler {
        Some(s) => writeln!(out, "  straggler: {}", line(s))?,
        None if report.one_rank_jobs.len() == report.ranks.len() => writeln!(
            out,
            "  straggler: none ({} independent jobs of one rank: none waits for another)",
            report.ranks.len()
        )?,
        None if report.stragglers_by_job.is_empty() => writeln!(
            out,
            "  straggler: none (no rank made another wait at a collective they all reached)"
        )?,
        None => {}
    }
    for s in &report.stragglers_by_job {
        let job = s.job.as_deref().unwrap_or("unnamed job");
        writeln!(out, "  straggler of {job}: {}", line(s))?;
    }
    Ok(())
}
