//! `steps.json`, `steps.csv` and the per-step table on stdout.

use std::fmt::Write as _;
use std::io::{self, Write};

use crate::attribute::{Categories, Step, StepsReport};

mod table;
pub use table::*;

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
    use super::json::{Obj, categories, key};
    let mut o = Obj::new(out)?;
    o.u64(key!("index"), s.index as u64)?;
    o.u64(key!("start_ns"), s.start_ns)?;
    o.u64(key!("end_ns"), s.end_ns)?;
    o.u64(key!("wall_ns"), s.wall_ns)?;
    categories(o.key(key!("categories_ns"))?, &s.categories)?;
    o.opt_u64(key!("page_fault_error_ns"), s.page_fault_error_ns)?;
    o.opt_u64(
        key!("gpu_wait_error_ns"),
        s.gpu_wait_error_ns.as_deref().copied(),
    )?;
    let n = o.key(key!("nccl"))?;
    let mut nccl = Obj::new(n)?;
    nccl.u64(key!("collectives"), s.nccl.collectives)?;
    nccl.u64(key!("bytes"), s.nccl.bytes)?;
    nccl.end()?;
    o.u64(key!("faults"), s.faults)?;
    o.u64(key!("migrations"), s.migrations)?;
    o.u64(key!("cross_node_migrations"), s.cross_node_migrations)?;
    o.u64(key!("numa_page_migrations"), s.numa_page_migrations)?;
    o.u64(key!("numa_task_moves"), s.numa_task_moves)?;
    o.value(key!("remote_access"), &s.remote_access)?;
    if let Some(loads) = &s.remote_loads {
        o.value(key!("remote_loads"), loads)?;
    }
    if let Some(ib) = &s.infiniband {
        o.value(key!("infiniband"), ib)?;
    }
    if let Some(gpu) = &s.gpu {
        o.value(key!("gpu"), gpu)?;
    }
    o.opt_i64(key!("slowest_rank"), s.slowest_rank.map(i64::from))?;
    let out = o.key(key!("ranks"))?;
    out.write_all(b"[")?;
    for (i, r) in s.ranks.iter().enumerate() {
        if i > 0 {
            out.write_all(b",")?;
        }
        let mut rank = Obj::new(&mut *out)?;
        rank.i64(key!("rank"), i64::from(r.rank))?;
        rank.u64(key!("pid"), u64::from(r.pid))?;
        categories(rank.key(key!("categories_ns"))?, &r.categories)?;
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
        gpu_wait_top_stacks: report.gpu_wait_top_stacks.clone(),
        ranks: report.ranks.clone(),
        communicators: report.communicators.clone(),
        idle: report.idle.clone(),
        workers: report.workers.clone(),
        one_rank_jobs: report.one_rank_jobs.clone(),
        straggler: report.straggler.clone(),
        stragglers_by_job: report.stragglers_by_job.clone(),
        reason: report.reason.clone(),
        jobs: report.jobs.clone(),
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
            .as_ref()
            .and_then(|m| m.share())
            .or_else(|| s.remote_access.as_ref().map(|r| r.share()))
        {
            write!(row, "{share:.4}")?;
        }
        row.push(b'\n');
        out.write_all(&row)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests;
