//! Per (document, policy) RB-CMC estimates from a trace store's summary fields (SPEC sections
//! 3-5), for a batch of units at once (all cores).
//!
//! For every replicate r (overlap path with hazards `h_t`, K branches): survival weights
//! `W_t = prod_{s<=t} (1 - h_s)`, divergence mass `W_{t-1} h_t`, occurrence `O = sum_t mass`,
//! occupation, tail exposure and `sum_t t mass`; post-divergence mismatches from the branches,
//! split at the observation window `L_w` into a window and a tail part, each `O` times the mean
//! over the replicate's branches of the summed mismatch indicators (`Estimator::Indicator`) or
//! of the summed branch TVs (`Estimator::Tv`). A unit's value is the mean over replicates and
//! its Monte Carlo standard error the standard deviation over replicates / sqrt(R). The numpy
//! implementation in `kvcouple.reference.estimates` is the independent reference (equal to
//! 1e-12 in the Python tests).

use rayon::prelude::*;

use crate::error::{KvError, KvResult};
use crate::parallel;
use crate::stats::pairwise::pairwise_sum;

/// Below this occurrence a replicate without branches is float noise, not an error.
pub const NOISE_OCCURRENCE: f64 = 1e-6;

/// The scalar quantities, in this order (`kvcouple.analysis.estimates.SCALARS`).
pub const SCALARS: usize = 10;

/// Which branch record the post-divergence part reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Estimator {
    /// Branch mismatch indicators (Rao-Blackwellised: never more variance than naive SMC).
    Indicator,
    /// Branch-aligned TVs.
    Tv,
}

/// The shape of a batch: `units` (document, policy) pairs of `replicates` x `horizon` hazards,
/// `branches` branches with `lags` stored lags (0..L).
#[derive(Clone, Copy, Debug)]
pub struct UnitShape {
    pub units: usize,
    pub replicates: usize,
    pub horizon: usize,
    pub branches: usize,
    pub lags: usize,
}

/// What a damaged unit contained (the first problem in replicate, then step/branch order).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum UnitDamage {
    /// A hazard that is not a probability: replicate, step (0-based), value.
    Hazard {
        replicate: usize,
        step: usize,
        value: f64,
    },
    /// A replicate that diverges but has no branch: replicate, its occurrence.
    MissingBranch { replicate: usize, occurrence: f64 },
    /// A branch past the horizon: replicate, branch, its step.
    BranchPastHorizon {
        replicate: usize,
        branch: usize,
        step: i64,
    },
}

/// Every unit's estimates, unit-major.
#[derive(Clone, Debug, Default)]
pub struct UnitEstimates {
    pub values: Vec<f64>,     // units x SCALARS
    pub stderr: Vec<f64>,     // units x SCALARS
    pub survival: Vec<f64>,   // units x (T + 1)
    pub pmf: Vec<f64>,        // units x T
    pub tv_lag_num: Vec<f64>, // units x lags
    pub tv_lag_den: Vec<f64>, // units x lags
    pub median_tau: Vec<f64>, // units
    pub damage: Vec<Option<UnitDamage>>,
}

/// A stored float (`float32` as traced, or `float64`), read as `f64`: the batch is estimated
/// from the stored values without a converted copy.
pub trait StoredFloat: Copy + Send + Sync + Into<f64> {}
impl StoredFloat for f32 {}
impl StoredFloat for f64 {}

/// A stored step (`int32` as traced, or `int64`), read as `i64`.
pub trait StoredStep: Copy + Send + Sync + Into<i64> {}
impl StoredStep for i32 {}
impl StoredStep for i64 {}

/// The inputs of a batch, each unit-major and C-contiguous: `hazard` units x R x T,
/// `branch_step` units x R x K, `branch_mismatch` and `branch_tv` units x R x K x lags.
pub struct UnitInputs<'a, F: StoredFloat = f64, S: StoredStep = i64> {
    pub hazard: &'a [F],
    pub branch_step: &'a [S],
    pub branch_mismatch: &'a [i8],
    pub branch_tv: &'a [F],
}

impl UnitEstimates {
    /// Outputs for `units` units, NaN until estimated (a damaged unit's rows stay NaN).
    fn unestimated(units: usize, t: usize, lags: usize) -> Self {
        UnitEstimates {
            values: vec![f64::NAN; units * SCALARS],
            stderr: vec![f64::NAN; units * SCALARS],
            survival: vec![f64::NAN; units * (t + 1)],
            pmf: vec![f64::NAN; units * t],
            tv_lag_num: vec![f64::NAN; units * lags],
            tv_lag_den: vec![f64::NAN; units * lags],
            median_tau: vec![f64::NAN; units],
            damage: vec![None; units],
        }
    }
}

/// Where one unit's estimates go (its rows of a block's outputs).
struct UnitOut<'o> {
    values: &'o mut [f64],
    stderr: &'o mut [f64],
    survival: &'o mut [f64],
    pmf: &'o mut [f64],
    num: &'o mut [f64],
    den: &'o mut [f64],
    median_tau: &'o mut f64,
}

/// Buffers reused from unit to unit (a block allocates once, not per unit and replicate),
/// and the weights of the mass sums, which depend on the step alone.
struct Scratch {
    survival_sum: Vec<f64>,
    pmf_sum: Vec<f64>,
    per_rep: Vec<[f64; SCALARS]>,
    occurrence: Vec<f64>,
    prev: Vec<f64>,
    mass: Vec<f64>, // R x T
    terms: Vec<f64>,
    weights: Weights,
    per_lag: Vec<f64>,
    reached_mean: Vec<f64>,
    tv_mean: Vec<f64>,
    num: Vec<f64>,
    den: Vec<f64>,
    column: Vec<f64>,
}

/// The weights of a step's divergence mass (step s = 1..T): the occupation's `T - s`, the
/// tail exposure's `max(T - s - L_w, 0)` and the first divergence's `s`.
struct Weights {
    occupation: Vec<f64>,
    tail_exposure: Vec<f64>,
    step: Vec<f64>,
}

impl Weights {
    fn new(t: usize, obs_window: usize) -> Self {
        let (tf, lw) = (t as f64, obs_window as f64);
        let steps = || (1..=t).map(|s| s as f64);
        Weights {
            occupation: steps().map(|x| tf - x).collect(),
            tail_exposure: steps().map(|x| (tf - x - lw).max(0.0)).collect(),
            step: steps().collect(),
        }
    }
}

impl Scratch {
    fn new(shape: UnitShape, obs_window: usize) -> Self {
        let (r, t, lags) = (shape.replicates, shape.horizon, shape.lags);
        Scratch {
            survival_sum: vec![0.0; t],
            pmf_sum: vec![0.0; t],
            per_rep: vec![[0.0; SCALARS]; r],
            occurrence: vec![0.0; r],
            prev: vec![0.0; r],
            mass: vec![0.0; r * t],
            terms: vec![0.0; t],
            weights: Weights::new(t, obs_window),
            per_lag: vec![0.0; lags],
            reached_mean: vec![0.0; lags],
            tv_mean: vec![0.0; lags],
            num: vec![0.0; lags],
            den: vec![0.0; lags],
            column: vec![0.0; r.max(t)],
        }
    }
}

/// Units per parallel task: enough to amortise a block's buffers, few enough to balance.
const BLOCK: usize = 32;

/// The estimates of every unit of a batch (all cores). `obs_window` is `L_w` (at most
/// `lags - 1`); `tail_observed` whether branches were traced to the horizon (`L >= T - 1`).
pub fn estimate_units<F: StoredFloat, S: StoredStep>(
    inputs: &UnitInputs<'_, F, S>,
    shape: UnitShape,
    obs_window: usize,
    estimator: Estimator,
    tail_observed: bool,
) -> KvResult<UnitEstimates> {
    let UnitShape {
        units,
        replicates: r,
        horizon: t,
        branches: k,
        lags,
    } = shape;
    let sizes = [
        ("hazard", inputs.hazard.len(), units * r * t),
        ("branch_step", inputs.branch_step.len(), units * r * k),
        (
            "branch_mismatch",
            inputs.branch_mismatch.len(),
            units * r * k * lags,
        ),
        ("branch_tv", inputs.branch_tv.len(), units * r * k * lags),
    ];
    for (name, got, want) in sizes {
        if got != want {
            return Err(KvError::Shape(format!(
                "{name} has {got} values, the batch's shape needs {want}"
            )));
        }
    }
    if lags == 0 || obs_window >= lags {
        return Err(KvError::InvalidArgument(format!(
            "the observation window must be in 0..{} (the stored window), got {obs_window}",
            lags.saturating_sub(1)
        )));
    }
    if r == 0 || t == 0 {
        return Err(KvError::Shape(
            "a unit needs at least one replicate and one step".into(),
        ));
    }
    // Each block of units writes its rows of the batch's outputs in place.
    let mut out = UnitEstimates::unestimated(units, t, lags);
    let rows = |width: usize| BLOCK * width;
    let o = &mut out;
    let parts = (
        o.values.par_chunks_mut(rows(SCALARS)),
        o.stderr.par_chunks_mut(rows(SCALARS)),
        o.survival.par_chunks_mut(rows(t + 1)),
        o.pmf.par_chunks_mut(rows(t)),
        o.tv_lag_num.par_chunks_mut(rows(lags)),
        o.tv_lag_den.par_chunks_mut(rows(lags)),
        o.median_tau.par_chunks_mut(BLOCK),
        o.damage.par_chunks_mut(BLOCK),
    );
    parallel::install(|| {
        parts.into_par_iter().enumerate().for_each(
            |(b, (values, stderr, survival, pmf, num, den, median_tau, damage))| {
                let mut scratch = Scratch::new(shape, obs_window);
                for (i, d) in damage.iter_mut().enumerate() {
                    let u = b * BLOCK + i;
                    let out = UnitOut {
                        values: &mut values[i * SCALARS..(i + 1) * SCALARS],
                        stderr: &mut stderr[i * SCALARS..(i + 1) * SCALARS],
                        survival: &mut survival[i * (t + 1)..(i + 1) * (t + 1)],
                        pmf: &mut pmf[i * t..(i + 1) * t],
                        num: &mut num[i * lags..(i + 1) * lags],
                        den: &mut den[i * lags..(i + 1) * lags],
                        median_tau: &mut median_tau[i],
                    };
                    let unit = UnitRecords {
                        hazard: &inputs.hazard[u * r * t..(u + 1) * r * t],
                        branch_step: &inputs.branch_step[u * r * k..(u + 1) * r * k],
                        mismatch: &inputs.branch_mismatch[u * r * k * lags..(u + 1) * r * k * lags],
                        tv: &inputs.branch_tv[u * r * k * lags..(u + 1) * r * k * lags],
                    };
                    let settings = (shape, obs_window, estimator, tail_observed);
                    if let Err(e) = one_unit(&unit, settings, &mut scratch, out) {
                        *d = Some(e);
                    }
                }
            },
        )
    });
    Ok(out)
}

/// One unit's stored records (its rows of the batch's inputs).
struct UnitRecords<'a, F, S> {
    hazard: &'a [F],
    branch_step: &'a [S],
    mismatch: &'a [i8],
    tv: &'a [F],
}

/// One unit's estimates, written to `out` only once every check has passed (a damaged unit's
/// rows stay NaN).
fn one_unit<F: StoredFloat, S: StoredStep>(
    unit: &UnitRecords<'_, F, S>,
    (shape, obs_window, estimator, tail_observed): (UnitShape, usize, Estimator, bool),
    scratch: &mut Scratch,
    out: UnitOut<'_>,
) -> Result<(), UnitDamage> {
    let UnitShape {
        replicates: r,
        horizon: t,
        branches: k,
        lags,
        ..
    } = shape;
    let UnitRecords {
        hazard,
        branch_step,
        mismatch,
        tv,
    } = *unit;
    // Hazards checked and clipped at 1 (the tracer's float noise may exceed it by 1e-6); NaN
    // and inf are outside the range. One branch-free pass, the position only where one is bad.
    let allowed = |h: f64| (0.0..=1.0 + 1e-6).contains(&h);
    if !hazard.iter().fold(true, |ok, &h| ok & allowed(h.into())) {
        let i = hazard.iter().position(|&h| !allowed(h.into())).unwrap_or(0);
        return Err(UnitDamage::Hazard {
            replicate: i / t,
            step: i % t,
            value: hazard[i].into(),
        });
    }
    let Scratch {
        survival_sum,
        pmf_sum,
        per_rep,
        occurrence,
        prev,
        mass,
        terms,
        weights,
        per_lag,
        reached_mean,
        tv_mean,
        num,
        den,
        column,
    } = scratch;
    // Survival weights, every replicate a step at a time (independent chains side by side);
    // each step's sums over replicates taken in replicate order, as one at a time would.
    prev.fill(1.0);
    for s in 0..t {
        let (mut w_sum, mut m_sum) = (0.0, 0.0);
        for (rep, p) in prev.iter_mut().enumerate() {
            let hs = hazard[rep * t + s].into().min(1.0);
            let w = *p * (1.0 - hs);
            let m = *p * hs;
            mass[rep * t + s] = m;
            w_sum += w;
            m_sum += m;
            *p = w;
        }
        survival_sum[s] = w_sum;
        pmf_sum[s] = m_sum;
    }
    for rep in 0..r {
        let mass = &mass[rep * t..(rep + 1) * t];
        let occ = pairwise_sum(mass);
        occurrence[rep] = occ;
        let s = &mut per_rep[rep];
        s[0] = occ;
        s[1] = weighted_sum(mass, terms, &weights.occupation);
        s[6] = weighted_sum(mass, terms, &weights.tail_exposure);
        s[9] = weighted_sum(mass, terms, &weights.step);
    }
    // Branches: recorded where branch_step > 0; a diverging replicate without one is damage.
    for rep in 0..r {
        let steps = &branch_step[rep * k..(rep + 1) * k];
        if occurrence[rep] > NOISE_OCCURRENCE && !steps.iter().all(|&s| s.into() > 0) {
            return Err(UnitDamage::MissingBranch {
                replicate: rep,
                occurrence: occurrence[rep],
            });
        }
    }
    for rep in 0..r {
        let steps = &branch_step[rep * k..(rep + 1) * k];
        if let Some(b) = steps.iter().position(|&s| s.into() > t as i64) {
            return Err(UnitDamage::BranchPastHorizon {
                replicate: rep,
                branch: b,
                step: steps[b].into(),
            });
        }
    }
    let (rf, per_branch, per_rep_count) = (r as f64, Divisor::new(k), Divisor::new(r));
    num.fill(0.0);
    den.fill(0.0);
    for rep in 0..r {
        let occ = occurrence[rep];
        let (mut win, mut tail) = (0.0, 0.0);
        reached_mean.fill(0.0);
        tv_mean.fill(0.0);
        for b in 0..k {
            let has = branch_step[rep * k + b].into() > 0;
            let at = (rep * k + b) * lags;
            let (flags, tvs) = (&mismatch[at..at + lags], &tv[at..at + lags]);
            if has {
                match estimator {
                    Estimator::Indicator => {
                        for (v, &m) in per_lag.iter_mut().zip(flags) {
                            *v = f64::from(m.max(0));
                        }
                    }
                    Estimator::Tv => {
                        for (v, &x) in per_lag.iter_mut().zip(tvs) {
                            let x: f64 = x.into();
                            *v = if x.is_nan() {
                                0.0
                            } else if x.is_infinite() {
                                if x > 0.0 {
                                    f64::MAX
                                } else {
                                    f64::MIN
                                }
                            } else {
                                x
                            };
                        }
                    }
                }
                // Branch-free: a lag the branch did not reach (NaN) adds +0.0 to both sums.
                for ((reached, mean), &x) in
                    reached_mean.iter_mut().zip(tv_mean.iter_mut()).zip(tvs)
                {
                    let x: f64 = x.into();
                    let finite = x.is_finite();
                    *reached += if finite { 1.0 } else { 0.0 };
                    *mean += if finite { x } else { 0.0 };
                }
            } else {
                per_lag.fill(0.0);
            }
            win += pairwise_sum(&per_lag[1..=obs_window]);
            tail += pairwise_sum(&per_lag[obs_window + 1..]);
        }
        let win = per_branch.of(win) * occ;
        let tail = per_branch.of(tail) * occ;
        for (n, &x) in num.iter_mut().zip(tv_mean.iter()) {
            *n += per_branch.of(x) * occ;
        }
        for (d, &x) in den.iter_mut().zip(reached_mean.iter()) {
            *d += per_branch.of(x) * occ;
        }
        let s = &mut per_rep[rep];
        s[4] = win;
        s[5] = if tail_observed { tail } else { f64::NAN };
        s[2] = if tail_observed { win + tail } else { f64::NAN };
        s[3] = if tail_observed {
            occ + win + tail
        } else {
            f64::NAN
        };
        s[7] = occ + win;
        s[8] = occ + win + s[6];
    }
    let column = &mut column[..r];
    for q in 0..SCALARS {
        for (c, v) in column.iter_mut().zip(per_rep.iter()) {
            *c = v[q];
        }
        let mean = per_rep_count.of(pairwise_sum(column));
        out.values[q] = mean;
        out.stderr[q] = f64::NAN;
        if r > 1 {
            for c in column.iter_mut() {
                *c = (*c - mean) * (*c - mean);
            }
            out.stderr[q] = (pairwise_sum(column) / (rf - 1.0)).sqrt() / rf.sqrt();
        }
    }
    for (p, &x) in out.pmf.iter_mut().zip(pmf_sum.iter()) {
        *p = per_rep_count.of(x);
    }
    out.survival[0] = 1.0;
    for (w, &x) in out.survival[1..].iter_mut().zip(survival_sum.iter()) {
        *w = per_rep_count.of(x);
    }
    for (o, &x) in out.num.iter_mut().zip(num.iter()) {
        *o = per_rep_count.of(x);
    }
    for (o, &x) in out.den.iter_mut().zip(den.iter()) {
        *o = per_rep_count.of(x);
    }
    *out.median_tau = median(out.pmf);
    Ok(())
}

/// Division by a count: by multiplication with its reciprocal where that is exact (a power of
/// two: the same bits as the division, at a fraction of its cost), else by division.
#[derive(Clone, Copy)]
struct Divisor {
    by: f64,
    inverse: Option<f64>,
}

impl Divisor {
    fn new(count: usize) -> Self {
        let by = count as f64;
        let inverse = count.is_power_of_two().then(|| 1.0 / by);
        Divisor { by, inverse }
    }

    #[inline]
    fn of(self, x: f64) -> f64 {
        match self.inverse {
            Some(inverse) => x * inverse,
            None => x / self.by,
        }
    }
}

/// `sum_s mass[s] weight[s]`, summed pairwise as numpy sums (`terms` is a buffer).
fn weighted_sum(mass: &[f64], terms: &mut [f64], weight: &[f64]) -> f64 {
    for ((term, &m), &w) in terms.iter_mut().zip(mass).zip(weight) {
        *term = m * w;
    }
    pairwise_sum(terms)
}

/// The median of the law of tau given tau <= T with step t spread over (t - 1/2, t + 1/2]
/// (the grouped-data median, `kvcouple.decomposition.median_step`, operation for operation):
/// continuous in the law, so that its bootstrap interval can hold its level; NaN when nothing
/// diverges.
fn median(pmf: &[f64]) -> f64 {
    // The cumulative sums in order, twice (the second pass finds the class), no buffer.
    let total = pmf.iter().fold(0.0, |acc, &p| acc + p);
    let mut cum = 0.0;
    let Some(at) = pmf.iter().position(|&p| {
        cum += p;
        2.0 * cum >= total * (1.0 - 1e-12)
    }) else {
        return f64::NAN;
    };
    let mass = pmf[at];
    if !(total > 0.0 && mass > 0.0) {
        return f64::NAN;
    }
    let below = cum - mass;
    let share = ((0.5 * total - below) / mass).clamp(0.0, 1.0);
    at as f64 + 0.5 + share
}

#[cfg(test)]
#[path = "units_tests.rs"]
mod tests;
