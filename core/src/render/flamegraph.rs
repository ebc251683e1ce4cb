//! Flamegraphs (inferno): on-CPU, off-CPU, NCCL wait and attributed, each as a `.folded`
//! file (one stack per line, root first, weight in µs) and an SVG.

use std::collections::BTreeMap;
use std::io::{self, Write};

use crate::attribute::{Cat, Detail, StackKey, ThreadDetail};
use crate::event::{Func, Library};
use crate::symbolize::Symbols;

/// The flamegraphs nccltrace draws.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    OnCpu,
    OffCpu,
    NcclWait,
    Attributed,
}

impl Kind {
    pub const ALL: [Kind; 4] = [Kind::OnCpu, Kind::OffCpu, Kind::NcclWait, Kind::Attributed];

    /// File name without extension.
    #[must_use]
    pub fn file(self) -> &'static str {
        match self {
            Kind::OnCpu => "flamegraph-oncpu",
            Kind::OffCpu => "flamegraph-offcpu",
            Kind::NcclWait => "flamegraph-nccl-wait",
            Kind::Attributed => "flamegraph-attributed",
        }
    }

    /// The SVG's title: what the width means.
    #[must_use]
    pub fn title(self) -> &'static str {
        match self {
            Kind::OnCpu => "On-CPU time of the target threads (sampled; width = CPU time)",
            Kind::OffCpu => "Off-CPU time of the target threads (width = time off the CPU)",
            Kind::NcclWait => {
                "Waits: where the host waited with NCCL collectives outstanding (nccl_wait) \
                 and for the GPU's own work (gpu_wait); width = wait time"
            }
            Kind::Attributed => {
                "Rank thread's step time by category, then by stack (width = wall time)"
            }
        }
    }
}

/// Appends `frame` to a folded line (`;` separates frames, so one inside a name becomes
/// `:`).
fn push_frame(line: &mut String, frame: &str) {
    if !line.is_empty() {
        line.push(';');
    }
    if frame.contains(';') {
        line.extend(frame.chars().map(|c| if c == ';' { ':' } else { c }));
    } else {
        line.push_str(frame);
    }
}

/// A stack's frames as part of a folded line, root first: user frames outermost first
/// (Python frames in place of the interpreter loop), then kernel frames.
fn stack_line(stacks: &[StackKey], symbols: &Symbols, stack: u32) -> String {
    let mut line = String::new();
    let Some(s) = stacks.get(stack as usize) else {
        return line;
    };
    let native = s.ustack.iter().map(|a| symbols.user(s.pid, *a)).collect();
    let v310 = symbols.python_310(s.pid, &s.py);
    let user = crate::python::merge_frames(native, &s.py, v310, |f| symbols.python(s.pid, f));
    for frame in user.iter().rev() {
        push_frame(&mut line, frame);
    }
    for addr in s.kstack.iter().rev() {
        push_frame(&mut line, &format!("{}_[k]", symbols.kernel(*addr)));
    }
    line
}

fn thread_frame(t: &ThreadDetail) -> String {
    let name = if t.name.is_empty() { "thread" } else { &t.name };
    format!("{name} {} ({})", t.tid, t.role)
}

/// Weight-key suffixes at or above this name the traced call (`CALL_SUFFIX + func id`).
const CALL_SUFFIX: u32 = 1 << 16;

/// Adds, per thread, each CUDA sync or NCCL call's nccl_wait and gpu_wait time at its
/// entry stack, under a root frame naming the category;
/// returns per thread the `[start, end)` of the calls so drawn, by time.
fn waits_at_call_sites(detail: &Detail, weights: &mut Weights) -> Vec<Vec<(u64, u64)>> {
    let mut covered = vec![Vec::new(); detail.threads.len()];
    let index: std::collections::HashMap<u32, usize> = detail
        .threads
        .iter()
        .enumerate()
        .map(|(i, t)| (t.tid, i))
        .collect();
    for c in &detail.calls {
        if !matches!(c.func.library(), Library::Cuda | Library::Nccl) {
            continue;
        }
        let Some(&ti) = index.get(&c.task.tid) else {
            continue;
        };
        let t = &detail.threads[ti];
        // The entry stack is recorded by the entry program, just after the start time.
        let i = t.call_stacks.partition_point(|(ts, _)| *ts < c.start_ns);
        let Some(&(_, stack)) = t.call_stacks.get(i).filter(|(ts, _)| *ts <= c.end_ns) else {
            continue;
        };
        for cat in [Cat::NcclWait, Cat::GpuWait] {
            let wait: u64 = overlap(t, c.start_ns, c.end_ns, |x| x == cat)
                .iter()
                .map(|(_, d)| d)
                .sum();
            if wait > 0 {
                weights.add(Some(cat), t, stack, CALL_SUFFIX + c.func.id(), wait);
            }
        }
        covered[ti].push((c.start_ns, c.end_ns));
    }
    for c in &mut covered {
        c.sort_unstable();
    }
    covered
}

/// The categories the waits graph draws.
fn is_wait(cat: Cat) -> bool {
    matches!(cat, Cat::NcclWait | Cat::GpuWait)
}

/// Overlap of `[a, b)` with the thread's pieces of category `cat`.
fn overlap(t: &ThreadDetail, a: u64, b: u64, mut keep: impl FnMut(Cat) -> bool) -> Vec<(Cat, u64)> {
    let first = t.segments.partition_point(|(_, e, _)| *e <= a);
    t.segments[first..]
        .iter()
        .take_while(|(s, _, _)| *s < b)
        .filter(|(_, _, c)| keep(*c))
        .map(|(s, e, c)| (*c, (*e).min(b).saturating_sub((*s).max(a))))
        .collect()
}

/// The part of `[a, b)` inside steps (all of it when there are no steps). Steps are in
/// time order and do not overlap, so a binary search finds the first that can count.
fn in_steps(detail: &Detail, a: u64, b: u64) -> u64 {
    if detail.step_bounds.is_empty() {
        return b.saturating_sub(a);
    }
    let first = detail.step_bounds.partition_point(|(_, e)| *e <= a);
    detail.step_bounds[first..]
        .iter()
        .take_while(|(s, _)| *s < b)
        .map(|(s, e)| (*e).min(b).saturating_sub((*s).max(a)))
        .sum()
}

/// As `overlap` for every category, counting only time inside steps.
fn overlap_in_steps(detail: &Detail, t: &ThreadDetail, a: u64, b: u64) -> Vec<(Cat, u64)> {
    let first = t.segments.partition_point(|(_, e, _)| *e <= a);
    t.segments[first..]
        .iter()
        .take_while(|(s, _, _)| *s < b)
        .map(|(s, e, c)| (*c, in_steps(detail, (*s).max(a), (*e).min(b))))
        .filter(|(_, d)| *d > 0)
        .collect()
}

/// The stack id standing for off-CPU stretches shorter than `Detail::offcpu_min_ns`,
/// which have no stack by design.
const SHORT_STACK: u32 = u32::MAX;

/// One flamegraph's weights as they add up: ns per (root category, thread, stack,
/// suffix), over any number of epochs; each distinct stack is symbolized and joined once
/// at the end ([`Weights::lines`]), as traces hold far more samples than stacks.
#[derive(Debug, Default)]
pub struct Weights {
    /// Hashed, not ordered: [`Weights::lines`] orders the lines (a tree's search was a
    /// tenth of the report's main thread on the trainer recording).
    ns: std::collections::HashMap<(Option<Cat>, u32, u32, u32), u64, foldhash::fast::FixedState>,
    /// Each thread's root frame, as it was last seen.
    threads: BTreeMap<u32, String>,
}

impl Weights {
    fn add(&mut self, root: Option<Cat>, t: &ThreadDetail, stack: u32, suffix: u32, ns: u64) {
        self.threads.entry(t.tid).or_insert_with(|| thread_frame(t));
        *self.ns.entry((root, t.tid, stack, suffix)).or_default() += ns;
    }

    /// Adds `detail`'s part of the `kind` graph. The attributed graph covers the rank
    /// thread's steps, as steps.json does; the others every target thread over the whole
    /// trace.
    pub fn weigh(&mut self, detail: &Detail, kind: Kind) {
        for t in &detail.threads {
            // The role may be known only from a later epoch on.
            if self.threads.contains_key(&t.tid) {
                self.threads.insert(t.tid, thread_frame(t));
            }
        }
        // NCCL waits inside calls whose entry stack was captured are drawn at that call
        // site, weighted by the call's nccl_wait time; samples and off-CPU stacks inside
        // those calls are then left out, so nothing is counted twice.
        let covered = if kind == Kind::NcclWait {
            waits_at_call_sites(detail, self)
        } else {
            vec![Vec::new(); detail.threads.len()]
        };
        for (ti, t) in detail.threads.iter().enumerate() {
            let inside_covered = |ts: u64| {
                let c = &covered[ti];
                let i = c.partition_point(|(_, e)| *e <= ts);
                c.get(i).is_some_and(|(s, _)| *s <= ts)
            };
            if kind == Kind::Attributed && detail.rank_tid.is_some_and(|r| r != t.tid) {
                continue;
            }
            for &(ts, stack, cat, weight) in &t.samples {
                if kind == Kind::Attributed && in_steps(detail, ts, ts + 1) == 0 {
                    continue;
                }
                let root = match kind {
                    Kind::OnCpu => None,
                    Kind::NcclWait if is_wait(cat) && !inside_covered(ts) => Some(cat),
                    Kind::Attributed => Some(cat),
                    Kind::NcclWait | Kind::OffCpu => continue,
                };
                self.add(root, t, stack, 0, weight);
            }
            if kind == Kind::OnCpu {
                continue;
            }
            for off in &t.offcpu {
                // A stretch too short for a stack by design is drawn all the same, as one
                // frame that says so; one without for another reason (the run began
                // during it, the buffer was full) is left out.
                let short = off.end_ns.saturating_sub(off.start_ns) < detail.offcpu_min_ns;
                let Some(stack) = off.stack.or(short.then_some(SHORT_STACK)) else {
                    continue;
                };
                if kind == Kind::NcclWait && inside_covered(off.start_ns) {
                    continue;
                }
                let pieces: Vec<(Option<Cat>, u64)> = match kind {
                    Kind::OffCpu => vec![(None, off.end_ns.saturating_sub(off.start_ns))],
                    Kind::NcclWait => overlap(t, off.start_ns, off.end_ns, is_wait)
                        .into_iter()
                        .map(|(c, d)| (Some(c), d))
                        .collect(),
                    Kind::Attributed => overlap_in_steps(detail, t, off.start_ns, off.end_ns)
                        .into_iter()
                        .map(|(c, d)| (Some(c), d))
                        .collect(),
                    Kind::OnCpu => Vec::new(),
                };
                let suffix = if off.runnable { 1 } else { 2 };
                for (cat, ns) in pieces {
                    self.add(cat, t, stack, suffix, ns);
                }
            }
        }
    }

    /// The folded lines, `stack weight_us` sorted (`min_ns`: the off-CPU stacks' minimum
    /// stretch, named by the frame of shorter ones).
    #[must_use]
    pub fn lines(&self, stacks: &[StackKey], symbols: &Symbols, min_ns: u64) -> Vec<String> {
        // Each stack's frames are made once, not per weight.
        let mut joined: std::collections::HashMap<u32, String> = std::collections::HashMap::new();
        let mut out: BTreeMap<String, u64> = BTreeMap::new();
        for (&(root, tid, stack, suffix), &ns) in &self.ns {
            let us = ns / 1000;
            if us == 0 {
                continue;
            }
            let mut line = String::new();
            if let Some(c) = root {
                push_frame(&mut line, c.name());
            }
            push_frame(
                &mut line,
                self.threads.get(&tid).map_or("thread", String::as_str),
            );
            let frames = joined.entry(stack).or_insert_with(|| {
                if stack == SHORT_STACK {
                    format!(
                        "[off-CPU under {} µs: no stack taken]",
                        min_ns.div_ceil(1000)
                    )
                } else {
                    stack_line(stacks, symbols, stack)
                }
            });
            if !frames.is_empty() {
                // Already joined and cleaned.
                line.push(';');
                line.push_str(frames);
            }
            match suffix {
                1 | 2 => push_frame(&mut line, offcpu_frame(suffix == 1)),
                CALL_SUFFIX.. => {
                    let name =
                        Func::from_id(suffix - CALL_SUFFIX).map_or("call", |f| f.symbols()[0]);
                    push_frame(&mut line, &format!("[in {name}]"));
                }
                _ => {}
            }
            *out.entry(line).or_insert(0) += us;
        }
        out.into_iter()
            .map(|(stack, us)| format!("{stack} {us}"))
            .collect()
    }
}

/// The folded stacks of one flamegraph of `detail`, `stack weight_us` sorted.
#[must_use]
pub fn folded(detail: &Detail, symbols: &Symbols, kind: Kind) -> Vec<String> {
    let mut weights = Weights::default();
    weights.weigh(detail, kind);
    weights.lines(&detail.stacks, symbols, detail.offcpu_min_ns)
}

/// Writes the folded lines.
pub fn write_folded(lines: &[String], out: &mut impl Write) -> io::Result<()> {
    for line in lines {
        writeln!(out, "{line}")?;
    }
    Ok(())
}

/// Writes the SVG (an empty graph says so in its title).
pub fn write_svg(kind: Kind, lines: &[String], out: &mut impl Write) -> io::Result<()> {
    let mut options = inferno::flamegraph::Options::default();
    kind.title().clone_into(&mut options.title);
    "µs".clone_into(&mut options.count_name);
    options.deterministic = true;
    options.hash = true;
    if lines.is_empty() {
        options.subtitle = Some("no stacks in this recording".to_owned());
        let empty = ["no-stacks 1"];
        return inferno::flamegraph::from_lines(&mut options, empty.iter().copied(), out);
    }
    inferno::flamegraph::from_lines(&mut options, lines.iter().map(String::as_str), out)
}

/// The `n` heaviest stacks under root frame `category` of attributed folded lines (the
/// category and the weight taken off; µs back to ns).
#[must_use]
pub fn top_stacks(
    lines: &[String],
    category: &str,
    n: usize,
) -> Vec<crate::attribute::BlockingStack> {
    let prefix = format!("{category};");
    let mut stacks: Vec<crate::attribute::BlockingStack> = lines
        .iter()
        .filter_map(|line| {
            let rest = line.strip_prefix(&prefix)?;
            let (stack, us) = rest.rsplit_once(' ')?;
            Some(crate::attribute::BlockingStack {
                stack: stack.to_owned(),
                total_ns: us.parse::<u64>().ok()? * 1000,
            })
        })
        .collect();
    stacks.sort_by(|a, b| {
        b.total_ns
            .cmp(&a.total_ns)
            .then_with(|| a.stack.cmp(&b.stack))
    });
    stacks.truncate(n);
    stacks
}

/// The pseudo-frame that ends an off-CPU stack: preempted (still runnable) or blocked.
fn offcpu_frame(preempted: bool) -> &'static str {
    if preempted {
        "[preempted]"
    } else {
        "[blocked]"
    }
}

/// The `n` heaviest of `weights` (ns per stack id and kind: 0 on-CPU, 1 preempted, 2
/// blocked), named as the folded files name them, root first.
#[must_use]
pub fn named_top(
    stacks: &[StackKey],
    symbols: &Symbols,
    weights: &BTreeMap<(u32, u8), u64>,
    n: usize,
) -> Vec<crate::attribute::BlockingStack> {
    let mut heaviest: Vec<(&(u32, u8), &u64)> = weights.iter().collect();
    heaviest.sort_by(|a, b| b.1.cmp(a.1).then_with(|| a.0.cmp(b.0)));
    heaviest
        .into_iter()
        .take(n)
        .map(|(&(stack, kind), &ns)| {
            let mut line = stack_line(stacks, symbols, stack);
            if kind > 0 {
                push_frame(&mut line, offcpu_frame(kind == 1));
            }
            crate::attribute::BlockingStack {
                stack: line,
                total_ns: ns,
            }
        })
        .collect()
}

/// Samples per stack, for [`short_stack_share`]: adds `detail`'s.
pub fn count_samples(detail: &Detail, counts: &mut BTreeMap<u32, u64>) {
    for t in &detail.threads {
        for &(_, stack, _, _) in &t.samples {
            *counts.entry(stack).or_default() += 1;
        }
    }
}

/// Share of samples whose user stack has at most two frames and no Python frames: a sign
/// the target was built without frame pointers, so its stacks stop early (`counts` from
/// [`count_samples`]).
#[must_use]
pub fn short_stack_share(stacks: &[StackKey], counts: &BTreeMap<u32, u64>) -> Option<f64> {
    let (mut short, mut total) = (0u64, 0u64);
    for (&stack, &n) in counts {
        let Some(s) = stacks.get(stack as usize) else {
            continue;
        };
        if s.ustack.is_empty() {
            continue;
        }
        total += n;
        // Python frames come from the interpreter's own chain, not from unwinding.
        if s.ustack.len() <= 2 && s.py.is_empty() {
            short += n;
        }
    }
    (total > 0).then(|| short as f64 / total as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// With the sync call's entry stack captured, its NCCL wait (3 ms) is drawn at that
    /// call site, and the off-CPU stack inside the call no longer adds to the graph.
    #[test]
    fn nccl_wait_at_call_site() {
        let (mut detail, symbols) = crate::render::fixture::detail();
        let before = folded(&detail, &symbols, Kind::NcclWait);
        assert!(
            before.iter().any(|l| l.ends_with("[blocked] 2000")),
            "{before:?}"
        );
        detail.stacks.push(crate::attribute::StackKey {
            pid: 10,
            kstack: Vec::new(),
            ustack: vec![0x1300, 0x1100],
            py: vec![],
        });
        detail.threads[0].call_stacks = vec![(4_000_001, 3)];
        let lines = folded(&detail, &symbols, Kind::NcclWait);
        assert_eq!(
            lines,
            vec![
                "nccl_wait;trainer 10 (main (rank));main;cuStreamSynchronize;\
                 [in cuStreamSynchronize] 3000"
                    .to_owned()
            ]
        );
    }

    /// The four folded outputs of a fixed timeline, against golden files.
    #[test]
    fn folded_golden() {
        let (detail, symbols) = crate::render::fixture::detail();
        for kind in Kind::ALL {
            let lines = folded(&detail, &symbols, kind);
            crate::render::golden(
                &format!("{}.folded", kind.file()),
                &(lines.join("\n") + "\n"),
            );
        }
    }

    /// The heaviest blocking stacks come from the attributed lines of their category.
    /// With a minimum stretch for off-CPU stacks, the shorter stretches are drawn as one
    /// frame that says so, weighted by their time; a long one without a stack (the run
    /// began during it) is still left out.
    #[test]
    fn short_stretches_drawn_without_a_stack() {
        let (mut detail, symbols) = crate::render::fixture::detail();
        let before = folded(&detail, &symbols, Kind::OffCpu);
        detail.offcpu_min_ns = 100_000;
        let short = |start_ns: u64, len: u64, runnable: bool| crate::attribute::OffCpu {
            start_ns,
            end_ns: start_ns + len,
            runnable,
            stack: None,
            waker: None,
            woken_ns: None,
        };
        detail.threads[0].offcpu.extend([
            short(3_000_000, 40_000, false),
            short(3_100_000, 30_000, false),
            short(3_200_000, 20_000, true),
            short(3_300_000, 500_000, false),
        ]);
        let after = folded(&detail, &symbols, Kind::OffCpu);
        let new: Vec<&String> = after.iter().filter(|l| !before.contains(l)).collect();
        assert_eq!(
            new,
            [
                "trainer 10 (main (rank));[off-CPU under 100 µs: no stack taken];[blocked] 70",
                "trainer 10 (main (rank));[off-CPU under 100 µs: no stack taken];[preempted] 20",
            ],
            "{after:?}"
        );
        assert_eq!(after.len(), before.len() + 2);
    }

    #[test]
    fn top_blocking_stacks() {
        let lines = vec![
            "other_offcpu;t;a;b 30".to_owned(),
            "compute;t;c 99".to_owned(),
            "other_offcpu;t;d 40".to_owned(),
        ];
        let top = top_stacks(&lines, "other_offcpu", 5);
        assert_eq!(top.len(), 2);
        assert_eq!((top[0].stack.as_str(), top[0].total_ns), ("t;d", 40_000));
    }

    /// The SVG names the frames and says what the width means.
    #[test]
    fn svg_names_frames() {
        let (detail, symbols) = crate::render::fixture::detail();
        let lines = folded(&detail, &symbols, Kind::Attributed);
        let mut svg = Vec::new();
        write_svg(Kind::Attributed, &lines, &mut svg).unwrap();
        let svg = String::from_utf8(svg).unwrap();
        for needle in [
            "nccl_wait",
            "page_fault",
            "compute",
            "clear_page_erms",
            "width = wall time",
        ] {
            assert!(svg.contains(needle), "{needle}");
        }
    }
}
