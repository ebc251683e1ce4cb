//! Which collective of one rank is which of another's, on one host.
//!
//! The agent arms every target at one instant, but the ranks are not at the same point of
//! their work then: where some ranks had entered a collective and a late one had not (the
//! others wait for it: the more a straggler makes them wait, the likelier), the late rank's
//! first traced collective is one before the others'. Matched by position, every pair is
//! then one off and the wrong rank looks late.
//!
//! On one host the ranks share a clock, so causality decides: a collective completes only
//! once its last rank arrived, and no rank sees it complete (its call returns, where the
//! call waits for its peers, else the first CUDA synchronisation it makes after the call)
//! before then. For the true pairing, every rank's arrival comes before every other rank's
//! completion seen; a pairing one collective off breaks that wherever a rank waits for
//! the step's work before starting the next (a synchronisation per step), and pairs
//! different calls or sizes wherever the steps' collectives differ.

use crate::event::Func;

/// One collective of one rank, for the alignment (here and by `nccltrace merge`, across
/// hosts).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Seen {
    pub func: Func,
    pub bytes: u64,
    /// Call entry.
    pub arrival_ns: u64,
    /// When the rank saw it complete: the end of the call when the call waits for its
    /// peers, else of the first CUDA synchronisation of its process after it; 0 while not
    /// known yet.
    pub done_ns: u64,
}

/// Collectives of each rank looked at (its first ones on its first communicator).
pub const PROBE: usize = 64;
/// Fewest pairs a pairing is judged on.
pub const MIN_PAIRS: usize = 16;
/// Pairings tried: each rank's first collective against the other's first this many.
const MAX_SHIFT: i64 = 32;

/// [`Alignment::describe`] of a rank matched in order from its first traced collective
/// because that is the only pairing causality allows (the usual case).
pub const IN_ORDER: &str =
    "in order from the first traced (the only pairing arrivals and completions allow)";
/// [`Alignment::describe`] of the reference rank.
pub const REFERENCE: &str = "the reference the other ranks' collectives were lined up with";

/// How one rank's collectives were lined up with the reference rank's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Alignment {
    /// The rank the others were lined up with.
    Reference,
    /// `x[j + shift]` is the reference's `r[j]`, the only pairing causality allows.
    Causal { shift: i64 },
    /// By position: no pairing could be chosen, for the reason given.
    ByOrder { why: String },
}

impl Alignment {
    /// How the rank's collectives were matched, in words.
    #[must_use]
    pub fn describe(&self) -> String {
        match self {
            Alignment::Reference => REFERENCE.to_owned(),
            Alignment::Causal { shift: 0 } => IN_ORDER.to_owned(),
            Alignment::Causal { shift } if *shift > 0 => format!(
                "its first {shift} traced collective(s) left out: the other ranks' first were \
                 entered before the probes were armed (the only pairing arrivals and \
                 completions allow)"
            ),
            Alignment::Causal { shift } => format!(
                "the other ranks' first {} traced collective(s) have no match on this rank: it \
                 entered them before the probes were armed (the only pairing arrivals and \
                 completions allow)",
                -shift
            ),
            Alignment::ByOrder { why } => format!("in order from the first traced: {why}"),
        }
    }
}

/// Pairs `(r[j], x[j + shift])` both have, with their completions known.
fn pairs<'a>(
    r: &'a [Seen],
    x: &'a [Seen],
    shift: i64,
) -> impl Iterator<Item = (&'a Seen, &'a Seen)> {
    r.iter().enumerate().filter_map(move |(j, a)| {
        let b = x.get(usize::try_from(j as i64 + shift).ok()?)?;
        (a.done_ns != 0 && b.done_ns != 0).then_some((a, b))
    })
}

/// Whether pairing `x[j + shift]` with `r[j]` holds: the same calls with the same sizes,
/// each arrival before the other's completion seen, over enough pairs.
fn holds(r: &[Seen], x: &[Seen], shift: i64) -> bool {
    let mut n = 0;
    for (a, b) in pairs(r, x, shift) {
        if a.func != b.func
            || a.bytes != b.bytes
            || a.arrival_ns > b.done_ns
            || b.arrival_ns > a.done_ns
        {
            return false;
        }
        n += 1;
    }
    n >= MIN_PAIRS
}

/// Lines `x`'s collectives up with the reference `r`'s (each in the rank's order).
#[must_use]
pub fn align(r: &[Seen], x: &[Seen]) -> Alignment {
    let fits: Vec<i64> = (-MAX_SHIFT..=MAX_SHIFT)
        .filter(|&s| holds(r, x, s))
        .collect();
    match fits[..] {
        [shift] => Alignment::Causal { shift },
        [] => Alignment::ByOrder {
            why: format!(
                "no pairing of the first {} collectives within {MAX_SHIFT} of each other has \
                 the same calls and sizes with every arrival before the other rank saw the \
                 collective complete",
                r.len().min(x.len())
            ),
        },
        _ => Alignment::ByOrder {
            why: format!(
                "the collectives line up equally well shifted by {fits:?} (the steps repeat \
                 without a synchronisation between them)"
            ),
        },
    }
}

/// Each rank's collectives to leave out so that their n-th are the same operation: from
/// each rank's alignment with the reference (the reference's own `None`), the ranks
/// ahead (whose first collectives the others missed) drop as many.
#[must_use]
pub fn dropped(alignments: &[Option<&Alignment>]) -> Vec<usize> {
    let shift = |a: Option<&Alignment>| match a {
        Some(Alignment::Causal { shift }) => *shift,
        _ => 0,
    };
    let least = alignments
        .iter()
        .map(|a| shift(*a))
        .min()
        .unwrap_or(0)
        .min(0);
    alignments
        .iter()
        .map(|a| usize::try_from(shift(*a) - least).unwrap_or(0))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One rank's collectives: steps of `per_step` AllReduces of growing sizes, each step
    /// `step_ns` long from `t0`, the rank arriving `late_ns` into the step, a sync ending
    /// 500 µs after the step's last arrival; the first `skip` left out (entered before the
    /// probes were armed).
    fn rank(steps: u64, per_step: u64, late_ns: u64, skip: usize) -> Vec<Seen> {
        let step_ns = 10_000_000;
        let mut out = Vec::new();
        for s in 0..steps {
            let t0 = s * step_ns;
            // Every rank sees the step's work done once the latest rank (3 ms) arrived.
            let done = t0 + 3_000_000 + per_step * 10_000 + 500_000;
            for k in 0..per_step {
                out.push(Seen {
                    func: Func::AllReduce,
                    bytes: 1024 * (k + 1),
                    arrival_ns: t0 + late_ns + k * 10_000,
                    done_ns: done,
                });
            }
        }
        out.split_off(skip)
    }

    #[test]
    fn a_rank_armed_one_collective_later_is_lined_up() {
        // The late rank's first collective was traced, the others' was not.
        let r = rank(10, 4, 0, 1);
        let late = rank(10, 4, 3_000_000, 0);
        assert_eq!(align(&r, &late), Alignment::Causal { shift: 1 });
        assert_eq!(align(&late, &r), Alignment::Causal { shift: -1 });
        assert_eq!(
            align(&r, &rank(10, 4, 0, 1)),
            Alignment::Causal { shift: 0 }
        );
        // Reference, the late rank, another on time: the late one drops its first.
        let a = [
            None,
            Some(&Alignment::Causal { shift: 1 }),
            Some(&Alignment::Causal { shift: 0 }),
        ];
        assert_eq!(dropped(&a), [0, 1, 0]);
        let b = [None, Some(&Alignment::Causal { shift: -1 })];
        assert_eq!(dropped(&b), [1, 0]);
    }

    #[test]
    fn same_sizes_every_step_still_lined_up_by_causality() {
        // One collective a step, always the same size: only the completions tell.
        let r = rank(40, 1, 0, 1);
        let late = rank(40, 1, 3_000_000, 0);
        assert_eq!(align(&r, &late), Alignment::Causal { shift: 1 });
    }

    #[test]
    fn no_pairing_or_several_fall_back_to_order() {
        // Completions not known yet: too few pairs.
        let mut r = rank(10, 4, 0, 0);
        for s in &mut r {
            s.done_ns = 0;
        }
        let why = align(&r, &rank(10, 4, 0, 0));
        assert!(matches!(why, Alignment::ByOrder { .. }), "{why:?}");
        // Different calls altogether.
        let mut other = rank(10, 4, 0, 0);
        for s in &mut other {
            s.func = Func::Broadcast;
        }
        let why = align(&rank(10, 4, 0, 0), &other);
        assert!(why.describe().contains("no pairing"), "{why:?}");
        // Every collective complete only at the end: any nearby pairing holds.
        let mut r = rank(40, 1, 0, 0);
        for s in &mut r {
            s.done_ns = u64::MAX;
        }
        let why = align(&r, &r.clone());
        assert!(why.describe().contains("equally well"), "{why:?}");
    }
}
