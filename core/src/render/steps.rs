//! `steps.json`, `steps.csv` and the per-step table on stdout.

use std::fmt::Write as _;
use std::io::{self, Write};

use crate::attribute::{Categories, Step, StepsReport};

/// Writes `steps.json`: the steps first, one per line, then the rest of the report.
pub fn write_json(report: &StepsReport, out: &mut impl Write) -> io::Result<()> {
    let mut json = StepsJson::new(out)?;
    for s in &report.steps {
        json.step(s)?;
    }
    json.finish(&without_steps(report))
}

/// `steps.json` written as the steps close: `{"steps": [` and one step per line (so that
/// `tail -f` follows the run), then at [`StepsJson::finish`] the rest of the report.
pub struct StepsJson<W: Write> {
    out: W,
    steps: usize,
    /// The row being written: one write to `out` a row (a write a field cost more
    /// than the field).
    row: Vec<u8>,
}

impl<W: Write> StepsJson<W> {
    pub fn new(mut out: W) -> io::Result<Self> {
        out.write_all(b"{\n  \"steps\": [")?;
        Ok(StepsJson {
            out,
            steps: 0,
            row: Vec::with_capacity(512),
        })
    }

    /// The next step, final.
    pub fn step(&mut self, s: &Step) -> io::Result<()> {
        self.row.clear();
        self.row.extend_from_slice(if self.steps == 0 {
            b"\n    "
        } else {
            b",\n    "
        });
        write_step(&mut self.row, s)?;
        self.out.write_all(&self.row)?;
        self.steps += 1;
        Ok(())
    }

    /// Writes out what is buffered.
    pub fn flush(&mut self) -> io::Result<()> {
        self.out.flush()
    }

    /// The rest of the report (`report` has no steps), and the end.
    pub fn finish(mut self, report: &StepsReport) -> io::Result<()> {
        debug_assert!(report.steps.is_empty());
        let pretty = serde_json::to_string_pretty(report)?;
        // Top-level keys are indented by two spaces; the empty steps are written above.
        let rest =
            pretty
                .strip_prefix('{')
                .unwrap_or(&pretty)
                .replacen("\n  \"steps\": [],", "", 1);
        let close: &[u8] = if self.steps == 0 { b"]," } else { b"\n  ]," };
        self.out.write_all(close)?;
        self.out.write_all(rest.as_bytes())?;
        writeln!(self.out)?;
        self.out.flush()
    }
}

/// One step as `Step`'s `Serialize` writes it (`step_rows_as_serde_writes_them` holds
/// them to it), field by field: the rows are most of a short-step run's report.
fn write_step(out: &mut impl Write, s: &Step) -> io::Result<()> {
    use super::json::{Obj, categories};
    let mut o = Obj::new(out)?;
    o.u64("index", s.index as u64)?;
    o.u64("start_ns", s.start_ns)?;
    o.u64("end_ns", s.end_ns)?;
    o.u64("wall_ns", s.wall_ns)?;
    categories(o.key("categories_ns")?, &s.categories)?;
    let n = o.key("nccl")?;
    let mut nccl = Obj::new(n)?;
    nccl.u64("collectives", s.nccl.collectives)?;
    nccl.u64("bytes", s.nccl.bytes)?;
    nccl.end()?;
    o.u64("faults", s.faults)?;
    o.u64("migrations", s.migrations)?;
    o.u64("cross_node_migrations", s.cross_node_migrations)?;
    o.u64("numa_page_migrations", s.numa_page_migrations)?;
    o.u64("numa_task_moves", s.numa_task_moves)?;
    o.value("remote_access", &s.remote_access)?;
    if let Some(loads) = &s.remote_loads {
        o.value("remote_loads", loads)?;
    }
    o.opt_i64("slowest_rank", s.slowest_rank.map(i64::from))?;
    let out = o.key("ranks")?;
    out.write_all(b"[")?;
    for (i, r) in s.ranks.iter().enumerate() {
        if i > 0 {
            out.write_all(b",")?;
        }
        let mut rank = Obj::new(&mut *out)?;
        rank.i64("rank", i64::from(r.rank))?;
        rank.u64("pid", u64::from(r.pid))?;
        categories(rank.key("categories_ns")?, &r.categories)?;
        rank.end()?;
    }
    out.write_all(b"]")?;
    o.end()
}

/// `report` but its steps.
#[must_use]
pub fn without_steps(report: &StepsReport) -> StepsReport {
    StepsReport {
        steps: Vec::new(),
        threads: report.threads.clone(),
        other_offcpu_top_stacks: report.other_offcpu_top_stacks.clone(),
        nccl_wait_top_stacks: report.nccl_wait_top_stacks.clone(),
        ranks: report.ranks.clone(),
        straggler: report.straggler.clone(),
        reason: report.reason.clone(),
        methods: report.methods.clone(),
        ..*report
    }
}

/// The CSV columns before and after the categories (named by [`crate::attribute::NAMES`]).
const CSV_BEFORE: [&str; 4] = ["index", "start_ns", "end_ns", "wall_ns"];
const CSV_AFTER: [&str; 8] = [
    "nccl_collectives",
    "nccl_bytes",
    "faults",
    "migrations",
    "cross_node_migrations",
    "numa_page_migrations",
    "numa_task_moves",
    // The remote share of the sampled memory accesses (empty when unknown).
    "remote_share",
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
    write_csv_rows(&report.steps, out)
}

/// The rows of `steps` in `steps.csv`.
pub fn write_csv_rows(steps: &[Step], out: &mut impl Write) -> io::Result<()> {
    let mut buf = itoa::Buffer::new();
    // A row at a time (a write a cell cost more than the cell).
    let mut row = Vec::with_capacity(256);
    for s in steps {
        row.clear();
        let mut cell = |row: &mut Vec<u8>, v: Option<u64>| {
            if let Some(v) = v {
                row.extend_from_slice(buf.format(v).as_bytes());
            }
            row.push(b',');
        };
        for v in [s.index as u64, s.start_ns, s.end_ns, s.wall_ns] {
            cell(&mut row, Some(v));
        }
        for (_, value) in s.categories.named() {
            cell(&mut row, value);
        }
        for v in [
            s.nccl.collectives,
            s.nccl.bytes,
            s.faults,
            s.migrations,
            s.cross_node_migrations,
            s.numa_page_migrations,
            s.numa_task_moves,
        ] {
            cell(&mut row, Some(v));
        }
        // The PMU's measured share where it sampled, else the hinting faults'.
        if let Some(share) = s
            .remote_loads
            .and_then(|m| m.share())
            .or_else(|| s.remote_access.map(|r| r.share()))
        {
            write!(row, "{share:.4}")?;
        }
        row.push(b'\n');
        out.write_all(&row)?;
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
    columns: [Column; 8],
    /// The slowest steps: (wall, index, the columns' values), slowest first.
    slowest: Vec<(u64, usize, [u64; 8])>,
    sum: Categories,
    wall_ns: u64,
    migrations: u64,
    cross_node_migrations: u64,
}

/// Steps whose values are kept exactly; past them, histograms.
pub const EXACT_STEPS: usize = 10_000;
/// Slowest steps kept.
const SLOWEST: usize = 3;
/// A category value the step could not measure, in [`StepTable`].
const NOT_MEASURED: u64 = u64::MAX;

/// One column of the table.
#[derive(Clone, Debug)]
enum Column {
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
    counts: std::collections::BTreeMap<u32, u64>,
}

const MANTISSA_BITS: u32 = 9;

impl LogHistogram {
    fn bucket(v: u64) -> u32 {
        if v < 1 << (MANTISSA_BITS + 1) {
            return v as u32;
        }
        let exp = v.ilog2();
        let mantissa = (v >> (exp - MANTISSA_BITS)) & ((1 << MANTISSA_BITS) - 1);
        ((exp - MANTISSA_BITS) << MANTISSA_BITS | mantissa as u32) + (1 << MANTISSA_BITS)
    }

    /// The middle of bucket `b`'s values.
    fn value(b: u32) -> u64 {
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
        *self.counts.entry(Self::bucket(v)).or_default() += 1;
    }

    /// The value at quantile `q` (nearest rank), within a bucket's width.
    #[must_use]
    pub fn quantile(&self, q: f64) -> u64 {
        let n: u64 = self.counts.values().sum();
        if n == 0 {
            return 0;
        }
        let rank = ((q * n as f64).ceil() as u64).clamp(1, n);
        let mut seen = 0;
        for (b, c) in &self.counts {
            seen += c;
            if seen >= rank {
                return Self::value(*b);
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
    fn quantile(&self, q: f64) -> u64 {
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
        let mut row = [0u64; 8];
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
    }

    /// Steps in the table.
    #[must_use]
    pub fn len(&self) -> usize {
        self.steps
    }

    /// The steps' wall time, summed.
    #[must_use]
    pub fn wall_ns(&self) -> u64 {
        self.wall_ns
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
    fn category_medians(&self) -> Vec<u64> {
        self.columns[1..].iter().map(|c| c.quantile(0.5)).collect()
    }

    /// What made a step (its `row`) slower than the median step: the category with the
    /// largest excess over its own median (`medians`), and that excess.
    fn slowest_cause(row: &[u64; 8], medians: &[u64]) -> Option<(&'static str, u64)> {
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

/// The lines naming where the rank thread waited for NCCL most (its Python line, when
/// the stacks have Python frames) and where it blocked most.
fn write_top_stacks(report: &StepsReport, out: &mut impl Write) -> io::Result<()> {
    if let Some(top) = report.nccl_wait_top_stacks.first()
        && let Some(line) = python_line(&top.stack)
    {
        writeln!(
            out,
            "  waited for NCCL/GPU most at: {line} ({} ms over the steps; all in steps.json)",
            ms(top.total_ns)
        )?;
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
        let note = if *name == "nccl_wait" && sum.unmeasured.nccl_wait_lower_bound {
            "  (a lower bound: see steps.json methods)"
        } else {
            ""
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
    writeln!(out, "{}", verdict(report, table))
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
            remote_access: None,
            remote_loads: None,
            slowest_rank: None,
            ranks: vec![],
        }
    }

    /// steps.json's rows are written by hand for speed: byte for byte what `Step`'s
    /// `Serialize` writes, for every shape a field can take (a field added to `Step` and
    /// not to the writer fails here).
    #[test]
    fn step_rows_as_serde_writes_them() {
        use crate::attribute::remote::{Basis, RemoteAccess};
        let plain = step(3, 2_000_000, 1_000_000);
        let mut full = step(u32::MAX as usize + 7, u64::MAX / 2, 12);
        full.start_ns = 17;
        full.categories.unmeasured.page_fault = true;
        full.categories.unmeasured.nccl_wait = true;
        full.categories.remote_memory = Some(99);
        full.nccl = crate::attribute::NcclCount {
            collectives: 3,
            bytes: 1 << 40,
        };
        (full.faults, full.migrations, full.cross_node_migrations) = (1, 2, 3);
        (full.numa_page_migrations, full.numa_task_moves) = (4, 5);
        full.remote_access = Some(RemoteAccess {
            pages: 10,
            remote_pages: 3,
            basis: Basis::StepHints,
            gap_ppm: Some(1234),
        });
        full.remote_loads = Some(crate::pmu::MeasuredStep {
            dram_samples: 8,
            remote_samples: 2,
            remote_cycles: 900,
        });
        full.slowest_rank = Some(-1);
        full.ranks = vec![
            crate::attribute::StepRank {
                rank: 0,
                pid: 41,
                categories: plain.categories,
            },
            crate::attribute::StepRank {
                rank: i32::MAX,
                pid: u32::MAX,
                categories: full.categories,
            },
        ];
        let mut one_rank = plain.clone();
        one_rank.ranks.truncate(0);
        one_rank.slowest_rank = Some(2);
        for s in [plain, full, one_rank] {
            let mut ours = Vec::new();
            write_step(&mut ours, &s).unwrap();
            assert_eq!(
                String::from_utf8(ours).unwrap(),
                serde_json::to_string(&s).unwrap()
            );
        }
    }

    /// Past EXACT_STEPS the table's quantiles come from histograms: within 0.2% of the
    /// exact ones, every bucket's middle within 0.2% of its values, and the slowest steps
    /// still exact.
    #[test]
    fn quantiles_past_the_exact_steps_stay_within_their_bucket() {
        for v in [0, 1, 1023, 1024, 1025, 4_000_000, 123_456_789, u64::MAX / 3] {
            let mid = LogHistogram::value(LogHistogram::bucket(v));
            assert!(
                mid.abs_diff(v) as f64 <= v as f64 / 512.0 + 1.0,
                "{v} -> {mid}"
            );
        }
        let n = EXACT_STEPS + 5_000;
        // Deterministic spread of wall times: 1-5 ms, one slow step.
        let wall = |i: usize| 1_000_000 + (i as u64 * 7_919) % 4_000_000;
        let steps: Vec<Step> = (0..n)
            .map(|i| {
                let w = if i == 7_777 { 90_000_000 } else { wall(i) };
                step(i, w, w / 3)
            })
            .collect();
        let table = StepTable::of(&steps);
        assert!(table.approximate());
        let mut walls: Vec<u64> = steps.iter().map(|s| s.wall_ns).collect();
        for q in [0.5, 0.9, 0.99] {
            let exact = quantile(&mut walls, q);
            let approx = table.columns[0].quantile(q);
            assert!(
                approx.abs_diff(exact) as f64 <= exact as f64 * 0.002,
                "q{q}: {approx} vs {exact}"
            );
        }
        assert_eq!(
            (table.slowest[0].0, table.slowest[0].1),
            (steps[7_777].wall_ns, 7_777)
        );
        assert_eq!(table.len(), n);
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
        let table = StepTable::of(&steps);
        let medians = table.category_medians();
        assert_eq!(table.slowest[0].1, 9);
        assert_eq!(
            StepTable::slowest_cause(&table.slowest[0].2, &medians),
            Some(("compute", 22_000_000))
        );
        let typical = StepTable::of(&steps[..1]);
        assert_eq!(
            StepTable::slowest_cause(&typical.slowest[0].2, &medians),
            None
        );
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
            nccl_wait_top_stacks: Vec::new(),
            ranks: vec![],
            straggler: None,
        };
        let mut out = Vec::new();
        write_csv(&report, &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        let lines: Vec<Vec<&str>> = text.lines().map(|l| l.split(',').collect()).collect();
        assert_eq!(lines[0].len(), 19);
        assert_eq!(lines[1].len(), lines[0].len());
        let cell = |name: &str| lines[1][lines[0].iter().position(|c| *c == name).unwrap()];
        assert_eq!(cell("compute"), "3000000");
        assert_eq!(cell("nccl_wait"), "2000000");
        assert_eq!(cell("page_fault"), "");
        assert_eq!(cell("remote_memory"), "");
        // No hinting fault seen: no share (empty, not 0).
        assert_eq!(cell("remote_share"), "");
    }
}
