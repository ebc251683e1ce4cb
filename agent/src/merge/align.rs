//! Clock alignment of two ranks from the collectives they share.
//!
//! A collective completes at one instant C for all its ranks: no rank's wait on it can end
//! before C, and C cannot come before the last rank arrived. So each matched collective
//! gives, for the offset between two clocks, a hard interval (arrival on one side to
//! completion seen on the other) and a point (the two completions seen, which both trail C
//! by the time the host took to notice). The offset is the median of the points; its
//! error bound covers the interval every collective allows (causality, exact) narrowed to
//! the range of the points, and is never below half their central 90% (the median assumes
//! both hosts notice completion alike; a rank that always arrives last notices it at
//! once while the others poll).
//!
//! Which collective of one rank is which of the other is not known either: agents attach
//! at different moments, so their first collectives differ. Candidates are the pairings
//! kept when every pair calls the same function with the same bytes:
//! between hosts every such pairing, whatever the wall clocks say (they may be off by more
//! than assumed: no NTP, a drifting node); on one host those its clock allows. A periodic
//! job lines up one step later too, but its steps' lengths jitter, and each rank sees
//! the same jitter: only the true pairing puts every collective's completions at one
//! offset, a pairing a step off spreads them by the jitter, and breaks causality wherever
//! step lengths differ by more than a collective's wait. Pairings are screened on windows
//! spread over the overlap and the nearest to the best weighed on every pair: the one that
//! keeps causality and spreads least is taken where no other comes close ([`TIE`]); where
//! several do (steps that repeat exactly), only the wall clocks can choose, within the
//! assumed error, and where they cannot that is said, naming `--clock-error`, never
//! guessed.

/// One collective as one rank saw it, on its host's clock (ns): the same as on one host
/// (where the ranks' collectives are lined up before they are matched).
pub use crate::attribute::align::Seen;

/// A rank's collectives: every one, or, past what is kept, runs of them in windows spread
/// over the run (`Sequence` in input.rs).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Kept {
    /// Runs of consecutive collectives: (the first one's index in the rank's order, them),
    /// in order.
    pub runs: Vec<(usize, Vec<Seen>)>,
}

impl Kept {
    /// One run from the first collective on.
    #[must_use]
    pub fn whole(seen: Vec<Seen>) -> Kept {
        Kept {
            runs: vec![(0, seen)],
        }
    }

    /// How many are kept.
    #[must_use]
    pub fn len(&self) -> usize {
        self.runs.iter().map(|r| r.1.len()).sum()
    }

    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The collective of index `i`, when kept.
    #[must_use]
    pub fn get(&self, i: usize) -> Option<&Seen> {
        let at = self.runs.partition_point(|(first, _)| *first <= i);
        let (first, run) = self.runs.get(at.checked_sub(1)?)?;
        run.get(i - first)
    }

    /// Every kept collective with its index.
    pub fn iter(&self) -> impl Iterator<Item = (usize, &Seen)> {
        self.runs
            .iter()
            .flat_map(|(first, run)| run.iter().enumerate().map(move |(k, s)| (first + k, s)))
    }
}

/// How two ranks' collectives line up, and the offset between their clocks.
#[derive(Clone, Debug, PartialEq)]
pub struct Alignment {
    /// `x[j + shift]` is `r[j]` (indices in each rank's order).
    pub shift: i64,
    /// Added to x's times (after the wall-clock guess) to put them on r's clock, at the
    /// middle of the overlap.
    pub correction_ns: i64,
    /// The correction lies within ± this: the interval causality allows (no wait on a
    /// collective ends before its last rank arrived), narrowed to the range of the
    /// per-collective differences, and never less than half their central 90%.
    pub bound_ns: u64,
    /// Rate of the correction's change (x's clock running slow: positive), parts per
    /// million; 0 when no drift stands out of the noise over the overlap.
    pub drift_ppm: f64,
    /// The time on r's clock the correction is given at (middle of the overlap).
    pub at_ns: u64,
    pub matched: usize,
    /// Pairs left out because their calls or sizes differ (a call lost on one side).
    pub mismatched: usize,
    /// The interval causality alone allows.
    pub causal_ns: (i64, i64),
    /// How far the central 90% of the per-collective differences spreads (drift taken
    /// out).
    pub spread_ns: u64,
    /// By how much the pairs' causal intervals miss a common point (0: they share one, as
    /// the true pairing's always do).
    pub broken_ns: u64,
}

impl Alignment {
    /// The correction at `t` (r's clock).
    #[must_use]
    pub fn correction_at(&self, t: u64) -> i64 {
        let dt = t as f64 - self.at_ns as f64;
        self.correction_ns + (self.drift_ppm * 1e-6 * dt).round() as i64
    }
}

/// Why two ranks could not be aligned.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AlignError {
    #[error(
        "none of their collectives falls within the clock error of the reference's (by the \
         wall clocks): not the same run, or clocks further apart than --clock-error"
    )]
    NoOverlap,
    #[error(
        "no pairing of their collectives (any, between hosts; within the clock error, on one \
         host) puts the same calls with the same sizes side by side ({candidates} tried): \
         not the same job, or a call lost on one side"
    )]
    NoMatch { candidates: usize },
    #[error(
        "none of its communicators is the reference rank's (unique id {id:#018x}): another \
         job's, or one the reference rank does not use first"
    )]
    OtherCommunicator { id: u64 },
    #[error("only {matched} collectives overlap (at least {needed} needed)")]
    TooFew { matched: usize, needed: usize },
    #[error(
        "the collectives line up equally well at clock corrections of {} and {} (the steps \
         repeat, their lengths alike): the wall clocks, within --clock-error, cannot tell \
         which",
        ms(*chosen), ms(*other)
    )]
    Ambiguous { chosen: i64, other: i64 },
}

fn ms(ns: i64) -> String {
    format!("{:+.3} ms", ns as f64 / 1e6)
}

/// Collectives both ranks must share.
pub const MIN_MATCHED: usize = 20;
/// How late one rank may notice one collective's completion.
const PAIR_SLACK_NS: u64 = 5_000_000;
/// Pairs looked at when screening a candidate pairing, in this many windows.
const SCREEN: usize = 256;
const SCREEN_WINDOWS: usize = 8;
/// A pairing comes as close as the best when the central 90% of its differences spreads
/// less than twice the best's plus this (a few completions noticed late).
const TIE: u64 = 20_000;
/// Pairings weighed on every pair: the screen's nearest to the best, and as many again of
/// those the wall clocks allow.
const WEIGHED: usize = 16;

/// Aligns `x` to `r`: `guess_ns` is what the wall clocks say to add to x's times; the
/// true correction is assumed within `max_error_ns` of it, unless `wide` (another host's
/// clock): then any pairing whose differences spread clearly least is taken, wherever it
/// puts the clock, and the assumed error only chooses among pairings alike.
pub fn align(
    r: &Kept,
    x: &Kept,
    guess_ns: i64,
    max_error_ns: u64,
    wide: bool,
) -> Result<Alignment, AlignError> {
    let window = if wide { u64::MAX / 4 } else { max_error_ns };
    let candidates = candidates(r, x, guess_ns, window);
    if candidates.is_empty() {
        return Err(AlignError::NoOverlap);
    }
    let at: Vec<usize> = r.iter().map(|(j, _)| j).collect();
    let enough = MIN_MATCHED.min(SCREEN).min(r.len()).min(x.len());
    let mut fits: Vec<Screened> = candidates
        .iter()
        .filter_map(|&shift| {
            let c = screen(r, &at, x, shift, guess_ns);
            log::debug!("pairing shifted by {shift}: {c:?}");
            // Between hosts, a pairing that overlaps by a few collectives spreads little
            // by chance: only those that share enough to be taken count.
            c.filter(|c| !wide || c.pairs >= enough)
        })
        .filter(|c| c.correction.unsigned_abs() <= window)
        .collect();
    if fits.is_empty() {
        return Err(AlignError::NoMatch {
            candidates: candidates.len(),
        });
    }
    // The screen sees windows of the overlap: the pairings that come near the best there,
    // and those the wall clocks allow, are weighed on every pair they share.
    fits.sort_by_key(|f| (f.broken, f.spread));
    let (least_broken, best) = (fits[0].broken, fits[0].spread);
    let mut weigh: Vec<i64> = fits
        .iter()
        .filter(|f| f.broken <= least_broken + TIE && f.spread <= 4 * best + 4 * TIE)
        .take(WEIGHED)
        .map(|f| f.shift)
        .collect();
    let allowed: Vec<i64> = fits
        .iter()
        .filter(|f| f.correction.unsigned_abs() <= max_error_ns && !weigh.contains(&f.shift))
        .take(WEIGHED)
        .map(|f| f.shift)
        .collect();
    weigh.extend(allowed);
    let mut weighed: Vec<Alignment> = weigh
        .into_iter()
        .map(|shift| estimate(r, x, shift, guess_ns))
        .collect();
    let most = weighed.iter().map(|a| a.matched).max().unwrap_or(0);
    if most < MIN_MATCHED {
        return Err(AlignError::TooFew {
            matched: most,
            needed: MIN_MATCHED,
        });
    }
    weighed.retain(|a| a.matched >= MIN_MATCHED);
    for a in &weighed {
        log::debug!(
            "pairing shifted by {}: correction {}, spread {} ns, causality broken by {} ns \
             over {} pairs",
            a.shift,
            a.correction_ns,
            a.spread_ns,
            a.broken_ns,
            a.matched
        );
    }
    // The true pairing keeps causality on every pair (its clock offset lies in each
    // pair's interval); one a step off breaks it wherever step lengths differ by more
    // than a collective's wait. Then the least spread.
    let least_broken = weighed.iter().map(|a| a.broken_ns).min().unwrap_or(0);
    weighed.retain(|a| a.broken_ns <= least_broken + TIE);
    let best = weighed.iter().map(|a| a.spread_ns).min().unwrap_or(0);
    weighed.retain(|a| a.spread_ns <= 2 * best + TIE);
    if weighed.len() > 1 {
        // The steps repeat alike: the wall clocks choose, within the assumed error.
        weighed.sort_by_key(|a| a.correction_ns.unsigned_abs());
        let (chosen, other) = (weighed[0].correction_ns, weighed[1].correction_ns);
        weighed.retain(|a| a.correction_ns.unsigned_abs() <= max_error_ns);
        if weighed.len() != 1 {
            return Err(AlignError::Ambiguous { chosen, other });
        }
    }
    Ok(weighed.swap_remove(0))
}

/// Pairings whose first pair the wall clocks allow: the first collective of each of x's
/// runs (until one finds any) against each of r's near it, and the same from r's side.
fn candidates(r: &Kept, x: &Kept, guess_ns: i64, max_error_ns: u64) -> Vec<i64> {
    // One collective's completion is noticed late by as much as a descheduled rank takes:
    // the first pair may be off by more than the clocks are.
    let near = |a: u64, b: u64| {
        (a as i64 - b as i64).unsigned_abs() <= max_error_ns.saturating_add(PAIR_SLACK_NS)
    };
    let on_r = |s: &Seen| s.done_ns.saturating_add_signed(guess_ns);
    let starts = |k: &Kept| -> Vec<(usize, Seen)> {
        k.runs
            .iter()
            .filter_map(|(first, run)| Some((*first, *run.first()?)))
            .collect()
    };
    let mut out = Vec::new();
    for (i, a) in starts(x) {
        let found: Vec<i64> = r
            .iter()
            .filter(|(_, s)| near(s.done_ns, on_r(&a)))
            .map(|(j, _)| i as i64 - j as i64)
            .collect();
        if !found.is_empty() {
            out.extend(found);
            break;
        }
    }
    for (j, b) in starts(r) {
        let found: Vec<i64> = x
            .iter()
            .filter(|(_, s)| near(on_r(s), b.done_ns))
            .map(|(i, _)| i as i64 - j as i64)
            .collect();
        if !found.is_empty() {
            out.extend(found);
            break;
        }
    }
    out.sort_unstable();
    out.dedup();
    out
}

/// Matched pairs `(r[j], x[j + shift])` that both keep.
fn pairs<'a>(r: &'a Kept, x: &'a Kept, shift: i64) -> impl Iterator<Item = (&'a Seen, &'a Seen)> {
    r.iter().filter_map(move |(j, a)| {
        let i = usize::try_from(j as i64 + shift).ok()?;
        Some((a, x.get(i)?))
    })
}

/// What a pairing's screen found.
#[derive(Clone, Copy, Debug)]
struct Screened {
    shift: i64,
    /// The median difference: the correction it gives.
    correction: i64,
    /// How far the pairs' causal intervals miss a common point, summed over the windows.
    broken: u64,
    /// The median over the windows of how far the central 90% of their differences
    /// spreads.
    spread: u64,
    pairs: usize,
}

/// A pairing screened on [`SCREEN_WINDOWS`] windows of consecutive pairs spread evenly
/// over the overlap (the first at its start): `None` when any pair there calls other
/// functions or sizes. Each window is short enough for a drifting clock to stay put in
/// it, and together they see whether step lengths jitter anywhere in the run.
fn screen(refs: &Kept, at: &[usize], other: &Kept, shift: i64, guess_ns: i64) -> Option<Screened> {
    let (first, last) = (other.runs.first()?.0 as i64, other.iter().last()?.0 as i64);
    let from = at.partition_point(|&j| (j as i64) < first - shift);
    let to = at.partition_point(|&j| (j as i64) <= last - shift);
    let width = SCREEN / SCREEN_WINDOWS;
    let room = to.saturating_sub(from).saturating_sub(width);
    let (mut all, mut spreads, mut broken) = (Vec::with_capacity(SCREEN), Vec::new(), 0);
    let mut next = from;
    for w in 0..SCREEN_WINDOWS {
        let start = (from + room * w / (SCREEN_WINDOWS - 1)).max(next);
        next = (start + width).min(to);
        let (mut lo, mut hi, mut points) = (i64::MIN, i64::MAX, Vec::with_capacity(width));
        for &j in &at[start..next] {
            let (Some(a), Some(b)) = (refs.get(j), other.get((j as i64 + shift) as usize)) else {
                continue;
            };
            if a.func != b.func || a.bytes != b.bytes {
                log::trace!("shift {shift}: {a:?} beside {b:?}");
                return None;
            }
            let (low, high, p) = bounds(a, b, guess_ns);
            lo = lo.max(low);
            hi = hi.min(high);
            points.push(p);
        }
        if points.is_empty() {
            continue;
        }
        broken += lo.saturating_sub(hi).max(0).unsigned_abs();
        points.sort_unstable();
        let q = |q: f64| points[((points.len() - 1) as f64 * q).round() as usize];
        spreads.push((q(0.95) - q(0.05)).unsigned_abs());
        all.extend(points);
    }
    if all.is_empty() {
        return None;
    }
    Some(Screened {
        shift,
        correction: median(&mut all),
        broken,
        spread: median_u(&mut spreads),
        pairs: all.len(),
    })
}

fn median_u(v: &mut [u64]) -> u64 {
    let mid = v.len() / 2;
    *v.select_nth_unstable(mid).1
}

/// For one matched pair: the hard interval of the correction and its point estimate.
fn bounds(a: &Seen, b: &Seen, guess_ns: i64) -> (i64, i64, i64) {
    let (ra, rd) = (a.arrival_ns as i64, a.done_ns as i64);
    let (xa, xd) = (b.arrival_ns as i64 + guess_ns, b.done_ns as i64 + guess_ns);
    (ra - xd, rd - xa, rd - xd)
}

fn median(v: &mut [i64]) -> i64 {
    let mid = v.len() / 2;
    *v.select_nth_unstable(mid).1
}

fn quantile(sorted: &[f64], q: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

/// The correction, its drift and bound over every matched pair.
fn estimate(refs: &Kept, other: &Kept, shift: i64, guess_ns: i64) -> Alignment {
    let mut mismatched = 0;
    let pts: Vec<(f64, i64, i64, i64)> = pairs(refs, other, shift)
        .filter(|(a, b)| {
            // A call lost on one side moves every later pair: those are left out.
            let same = a.func == b.func && a.bytes == b.bytes;
            mismatched += usize::from(!same);
            same
        })
        .map(|(a, b)| {
            let (low, high, p) = bounds(a, b, guess_ns);
            (a.done_ns as f64, low, high, p)
        })
        .collect();
    let count = pts.len() as f64;
    let t_mid = pts.iter().map(|p| p.0).sum::<f64>() / count;
    let d_mean = pts.iter().map(|p| p.3 as f64).sum::<f64>() / count;
    let (sxy, sxx) = pts.iter().fold((0.0, 0.0), |(sxy, sxx), p| {
        let dt = p.0 - t_mid;
        (sxy + dt * (p.3 as f64 - d_mean), sxx + dt * dt)
    });
    let slope = if sxx > 0.0 { sxy / sxx } else { 0.0 };
    let mut residuals: Vec<f64> = pts
        .iter()
        .map(|p| p.3 as f64 - slope * (p.0 - t_mid))
        .collect();
    residuals.sort_unstable_by(f64::total_cmp);
    let (q05, q95) = (quantile(&residuals, 0.05), quantile(&residuals, 0.95));
    // A drift only counts when it moves the correction over the overlap by more than the
    // spread of the points: otherwise it is noise, and a constant correction is better.
    let span = pts.last().map_or(0.0, |p| p.0) - pts.first().map_or(0.0, |p| p.0);
    let slope = if (slope * span).abs() > (q95 - q05) {
        slope
    } else {
        0.0
    };
    let detrend = |p: &(f64, i64, i64, i64), v: i64| v as f64 - slope * (p.0 - t_mid);
    let mut centred: Vec<f64> = pts.iter().map(|p| detrend(p, p.3)).collect();
    centred.sort_unstable_by(f64::total_cmp);
    let est = quantile(&centred, 0.5);
    let (q05, q95) = (quantile(&centred, 0.05), quantile(&centred, 0.95));
    let (dmin, dmax) = (centred[0], centred[centred.len() - 1]);
    let lo = pts.iter().map(|p| detrend(p, p.1)).fold(f64::MIN, f64::max);
    let hi = pts.iter().map(|p| detrend(p, p.2)).fold(f64::MAX, f64::min);
    // The truth lies among the differences when each side sometimes notices completion
    // first, and within causality always; the median assumes both notice it alike, so the
    // bound is never below half the central spread of the differences (how unevenly they
    // notice it).
    let (a, b) = (dmin.max(lo), dmax.min(hi));
    let bound = if a <= b {
        (est - a).max(b - est).max((q95 - q05) / 2.0)
    } else {
        (est - lo).max(hi - est)
    };
    Alignment {
        shift,
        correction_ns: est.round() as i64,
        bound_ns: bound.ceil() as u64,
        drift_ppm: slope * 1e6,
        at_ns: t_mid as u64,
        matched: pts.len(),
        mismatched,
        causal_ns: (lo.round() as i64, hi.round() as i64),
        spread_ns: (q95 - q05).max(0.0).round() as u64,
        broken_ns: (lo - hi).max(0.0).round() as u64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::Func;

    /// Aligns two ranks that kept every collective.
    fn fit(
        r: &[Seen],
        x: &[Seen],
        guess_ns: i64,
        max_error_ns: u64,
    ) -> Result<Alignment, AlignError> {
        align(
            &Kept::whole(r.to_vec()),
            &Kept::whole(x.to_vec()),
            guess_ns,
            max_error_ns,
            true,
        )
    }

    /// A job: steps of `period` ns with four all-reduces of growing size; each rank's
    /// arrivals `late` ns after the first, and every rank seeing completion within `noise`
    /// of it (a fixed pseudo-random pattern).
    fn job(steps: u64, period: u64, late: u64, noise: u64, clock: i64, skip: usize) -> Vec<Seen> {
        let mut out = Vec::new();
        let mut rng = 0x2545_f491_u64.wrapping_add(late);
        for s in 0..steps {
            for k in 0..4u64 {
                rng = rng.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                let c = s * period + k * 300_000 + 1_000_000;
                let jitter = (rng >> 33) % noise.max(1);
                out.push(Seen {
                    func: Func::AllReduce,
                    bytes: 4096 << k,
                    arrival_ns: (c as i64 - 50_000 + late as i64 - clock) as u64 - 100_000,
                    done_ns: (c as i64 + jitter as i64 - clock) as u64,
                });
            }
        }
        out.split_off(skip)
    }

    /// Another host's clock 7.3 ms behind and its agent attached 13 collectives later:
    /// found within a few µs, the bound covers the truth, the pairing is the true one.
    #[test]
    fn recovers_a_shifted_clock() {
        let r = job(200, 5_000_000, 0, 40_000, 0, 0);
        let x = job(200, 5_000_000, 30_000, 40_000, -7_300_000, 13);
        // The wall clocks say 0 and claim to be right within 1 ms: the steps repeat exactly
        // (no jitter in this job), every pairing a whole step off fits as well, and none
        // is within the error: said so.
        assert!(matches!(
            fit(&r, &x, 0, 1_000_000),
            Err(AlignError::Ambiguous { .. })
        ));
        // On one host (not wide), no pairing within 1 ms.
        assert!(matches!(
            align(
                &Kept::whole(r.clone()),
                &Kept::whole(x.clone()),
                0,
                1_000_000,
                false
            ),
            Err(AlignError::NoMatch { .. })
        ));
        let a = fit(&r, &x, -7_000_000, 2_000_000).unwrap();
        assert_eq!(a.shift, -13);
        assert!((a.correction_ns + 300_000).abs() < 10_000, "{a:?}");
        assert!(
            a.bound_ns >= (a.correction_ns + 300_000).unsigned_abs(),
            "{a:?}"
        );
        assert!(a.bound_ns < 60_000, "{a:?}");
        assert!(a.drift_ppm.abs() < f64::EPSILON);
        assert_eq!(a.matched, 787);
    }

    /// Steps repeat every 5 ms, exactly: with a 10 ms clock error, pairings one step apart
    /// are as good, and the wall clocks cannot choose: said, not guessed.
    #[test]
    fn periodic_steps_are_ambiguous_beyond_half_a_period() {
        let r = job(100, 5_000_000, 0, 40_000, 0, 0);
        let x = job(100, 5_000_000, 30_000, 40_000, 0, 4);
        match fit(&r, &x, 0, 10_000_000) {
            Err(AlignError::Ambiguous { chosen, other }) => {
                assert!(chosen.abs() < 50_000);
                assert!((other.abs() - 5_000_000).abs() < 50_000);
            }
            other => panic!("{other:?}"),
        }
        let a = fit(&r, &x, 0, 2_000_000).unwrap();
        assert_eq!((a.shift, a.matched), (-4, 396));
    }

    /// Different sizes never pair: a job whose collectives another rank does not issue.
    #[test]
    fn different_collectives_do_not_match() {
        let r = job(50, 5_000_000, 0, 40_000, 0, 0);
        let mut x = r.clone();
        for s in &mut x {
            s.bytes += 1;
        }
        assert!(matches!(
            fit(&r, &x, 0, 1_000_000),
            Err(AlignError::NoMatch { .. })
        ));
        let short = job(3, 5_000_000, 0, 40_000, 0, 0);
        assert!(matches!(
            fit(&short, &short, 0, 1_000_000),
            Err(AlignError::TooFew { matched: 12, .. })
        ));
    }

    /// Only windows of each rank kept (every third of 100 steps, both hosts alike, as
    /// wall-clock windows fall): paired through the runs both keep, the same offset.
    #[test]
    fn windows_of_collectives_align() {
        let windows = |v: Vec<Seen>| Kept {
            runs: v
                .chunks(40)
                .enumerate()
                .filter(|(n, _)| n.is_multiple_of(3))
                .map(|(n, c)| (n * 40, c.to_vec()))
                .collect(),
        };
        let r = windows(job(1000, 5_000_000, 0, 40_000, 0, 0));
        let x = windows(job(1000, 5_000_000, 30_000, 40_000, -7_300_000, 0));
        let a = align(&r, &x, -7_000_000, 2_000_000, true).unwrap();
        assert_eq!(a.shift, 0);
        assert!((a.correction_ns + 300_000).abs() < 10_000, "{a:?}");
        assert_eq!(a.matched, r.len());
        assert_eq!(r.get(41), None);
        assert_eq!(r.get(120), r.runs[1].1.first());
    }

    /// A clock drifting 20 ppm over 60 s (1.2 ms by the end) is followed: the drift found,
    /// the correction right at both ends.
    #[test]
    fn follows_a_drifting_clock() {
        let r = job(12_000, 5_000_000, 0, 20_000, 0, 0);
        let mut x = r.clone();
        for s in &mut x {
            let skew = |t: u64| t - (t as f64 * 20e-6) as u64;
            s.arrival_ns = skew(s.arrival_ns);
            s.done_ns = skew(s.done_ns);
        }
        let a = fit(&r, &x, 0, 2_000_000).unwrap();
        assert!((a.drift_ppm - 20.0).abs() < 0.5, "{a:?}");
        let at_end = r.last().unwrap().done_ns;
        let truth_end = (at_end as f64 * 20e-6) as i64;
        assert!(
            (a.correction_at(at_end) - truth_end).abs() < 20_000,
            "{a:?}"
        );
        assert!(a.correction_at(1_000_000).abs() < 20_000, "{a:?}");
    }

    /// Issue 52: a host's wall clock 0.25 s or 3 s off, far beyond the assumed 10 ms, on a
    /// job whose steps jitter (as real steps do, alike on every rank): the pairing a step
    /// off spreads the differences by the jitter, the true one does not, and it is found
    /// wherever the wall clocks put it, within 100 µs. With steps that repeat exactly
    /// (`recovers_a_shifted_clock`) it cannot be, and is said so.
    #[test]
    fn finds_a_clock_far_beyond_the_assumed_error() {
        let r = jittered(0, 0, 0, 0);
        for clock in [250_000_000i64, 3_000_000_000] {
            let x = jittered(30_000, -clock, 9 * 4 + 1, 0);
            // Its agent attached 9 steps and one collective later; the wall clocks say 0.
            let a = fit(&r, &x, 0, 10_000_000).unwrap();
            assert_eq!(a.shift, -37, "{a:?}");
            let truth = -clock + 30_000 / 2;
            assert!(
                (a.correction_ns - (-clock)).abs() < 100_000,
                "{a:?} against {truth}"
            );
        }
    }

    /// Steps that repeat exactly over the first 100 (past the screen's 256 pairs), and
    /// jitter after: pairings a step off look as good as the true one at first and break
    /// causality later; weighed on every pair, the true one is found, the clock 0.25 s off
    /// and the wall clocks no help.
    #[test]
    fn steps_alike_at_first_are_told_apart_later() {
        let r = jittered(0, 0, 0, 100);
        let x = jittered(30_000, -250_000_000, 9 * 4 + 1, 100);
        let a = fit(&r, &x, 0, 10_000_000).unwrap();
        assert_eq!(a.shift, -37, "{a:?}");
        assert!((a.correction_ns + 250_000_000).abs() < 100_000, "{a:?}");
        assert_eq!(a.broken_ns, 0, "{a:?}");
    }

    /// [`job`] of 300 steps whose lengths are 5 ms + up to 600 µs from step `from` on (one
    /// sequence, alike on every rank), exactly 5 ms before.
    fn jittered(late: u64, clock: i64, skip: usize, from: usize) -> Vec<Seen> {
        let mut rng = 0x9e37_79b9_u64;
        let mut step_start = 0u64;
        let mut x = job(300, 5_000_000, late, 40_000, clock, 0);
        for (n, step) in x.chunks_mut(4).enumerate() {
            rng = rng.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            let shift = step_start;
            for s in step.iter_mut() {
                s.arrival_ns += shift;
                s.done_ns += shift;
            }
            if n >= from {
                step_start += (rng >> 33) % 600_000;
            }
        }
        x.split_off(skip)
    }
}
