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

/// The inputs of a batch, each unit-major and C-contiguous: `hazard` units x R x T,
/// `branch_step` units x R x K, `branch_mismatch` and `branch_tv` units x R x K x lags.
pub struct UnitInputs<'a> {
    pub hazard: &'a [f64],
    pub branch_step: &'a [i64],
    pub branch_mismatch: &'a [i8],
    pub branch_tv: &'a [f64],
}

struct One {
    values: [f64; SCALARS],
    stderr: [f64; SCALARS],
    survival: Vec<f64>,
    pmf: Vec<f64>,
    num: Vec<f64>,
    den: Vec<f64>,
    median_tau: f64,
}

/// The estimates of every unit of a batch (all cores). `obs_window` is `L_w` (at most
/// `lags - 1`); `tail_observed` whether branches were traced to the horizon (`L >= T - 1`).
pub fn estimate_units(
    inputs: &UnitInputs<'_>,
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
    let results: Vec<Result<One, UnitDamage>> = parallel::install(|| {
        (0..units)
            .into_par_iter()
            .map(|u| {
                one_unit(
                    &inputs.hazard[u * r * t..(u + 1) * r * t],
                    &inputs.branch_step[u * r * k..(u + 1) * r * k],
                    &inputs.branch_mismatch[u * r * k * lags..(u + 1) * r * k * lags],
                    &inputs.branch_tv[u * r * k * lags..(u + 1) * r * k * lags],
                    shape,
                    obs_window,
                    estimator,
                    tail_observed,
                )
            })
            .collect()
    });
    let mut out = UnitEstimates {
        values: vec![f64::NAN; units * SCALARS],
        stderr: vec![f64::NAN; units * SCALARS],
        survival: vec![f64::NAN; units * (t + 1)],
        pmf: vec![f64::NAN; units * t],
        tv_lag_num: vec![f64::NAN; units * lags],
        tv_lag_den: vec![f64::NAN; units * lags],
        median_tau: vec![f64::NAN; units],
        damage: vec![None; units],
    };
    for (u, res) in results.into_iter().enumerate() {
        match res {
            Ok(one) => {
                out.values[u * SCALARS..(u + 1) * SCALARS].copy_from_slice(&one.values);
                out.stderr[u * SCALARS..(u + 1) * SCALARS].copy_from_slice(&one.stderr);
                out.survival[u * (t + 1)..(u + 1) * (t + 1)].copy_from_slice(&one.survival);
                out.pmf[u * t..(u + 1) * t].copy_from_slice(&one.pmf);
                out.tv_lag_num[u * lags..(u + 1) * lags].copy_from_slice(&one.num);
                out.tv_lag_den[u * lags..(u + 1) * lags].copy_from_slice(&one.den);
                out.median_tau[u] = one.median_tau;
            }
            Err(d) => out.damage[u] = Some(d),
        }
    }
    Ok(out)
}

#[allow(clippy::too_many_arguments)]
fn one_unit(
    hazard: &[f64],
    branch_step: &[i64],
    mismatch: &[i8],
    tv: &[f64],
    shape: UnitShape,
    obs_window: usize,
    estimator: Estimator,
    tail_observed: bool,
) -> Result<One, UnitDamage> {
    let UnitShape {
        replicates: r,
        horizon: t,
        branches: k,
        lags,
        ..
    } = shape;
    // Hazards checked and clipped at 1 (the tracer's float noise may exceed it by 1e-6).
    for (i, &h) in hazard.iter().enumerate() {
        if !h.is_finite() || !(0.0..=1.0 + 1e-6).contains(&h) {
            return Err(UnitDamage::Hazard {
                replicate: i / t,
                step: i % t,
                value: h,
            });
        }
    }
    let mut survival_sum = vec![0.0; t];
    let mut pmf_sum = vec![0.0; t];
    let mut per_rep = vec![[0.0f64; SCALARS]; r];
    let mut occurrence = vec![0.0; r];
    let mut mass = vec![0.0; t];
    let mut w = vec![0.0; t];
    for rep in 0..r {
        let h = &hazard[rep * t..(rep + 1) * t];
        let mut prev = 1.0;
        for s in 0..t {
            let hs = h[s].min(1.0);
            w[s] = prev * (1.0 - hs);
            mass[s] = prev * hs;
            prev = w[s];
        }
        let occ = pairwise_sum(&mass);
        occurrence[rep] = occ;
        let steps = |f: &dyn Fn(f64) -> f64| -> f64 {
            let terms: Vec<f64> = (0..t).map(|s| mass[s] * f((s + 1) as f64)).collect();
            pairwise_sum(&terms)
        };
        let tf = t as f64;
        let lw = obs_window as f64;
        let occupation = steps(&|x| tf - x);
        let tail_exposure = steps(&|x| (tf - x - lw).max(0.0));
        let tau_mass = steps(&|x| x);
        for s in 0..t {
            survival_sum[s] += w[s];
            pmf_sum[s] += mass[s];
        }
        per_rep[rep][0] = occ;
        per_rep[rep][1] = occupation;
        per_rep[rep][6] = tail_exposure;
        per_rep[rep][9] = tau_mass;
    }
    // Branches: recorded where branch_step > 0; a diverging replicate without one is damage.
    for rep in 0..r {
        let steps = &branch_step[rep * k..(rep + 1) * k];
        if occurrence[rep] > NOISE_OCCURRENCE && !steps.iter().all(|&s| s > 0) {
            return Err(UnitDamage::MissingBranch {
                replicate: rep,
                occurrence: occurrence[rep],
            });
        }
    }
    for rep in 0..r {
        let steps = &branch_step[rep * k..(rep + 1) * k];
        if let Some(b) = steps.iter().position(|&s| s > t as i64) {
            return Err(UnitDamage::BranchPastHorizon {
                replicate: rep,
                branch: b,
                step: steps[b],
            });
        }
    }
    let rf = r as f64;
    let mut num = vec![0.0; lags];
    let mut den = vec![0.0; lags];
    let mut per_lag = vec![0.0; lags];
    for rep in 0..r {
        let occ = occurrence[rep];
        let (mut win, mut tail) = (0.0, 0.0);
        let mut reached_mean = vec![0.0; lags];
        let mut tv_mean = vec![0.0; lags];
        for b in 0..k {
            let has = branch_step[rep * k + b] > 0;
            let at = (rep * k + b) * lags;
            for (l, v) in per_lag.iter_mut().enumerate() {
                *v = if !has {
                    0.0
                } else {
                    match estimator {
                        Estimator::Indicator => f64::from(mismatch[at + l].max(0)),
                        Estimator::Tv => {
                            let x = tv[at + l];
                            if x.is_nan() {
                                0.0
                            } else if x.is_infinite() {
                                if x > 0.0 {
                                    f64::MAX
                                } else {
                                    f64::MIN
                                }
                            } else {
                                x
                            }
                        }
                    }
                };
                let x = tv[at + l];
                if has && x.is_finite() {
                    reached_mean[l] += 1.0;
                    tv_mean[l] += x;
                }
            }
            win += pairwise_sum(&per_lag[1..=obs_window]);
            tail += pairwise_sum(&per_lag[obs_window + 1..]);
        }
        let kf = k as f64;
        let win = win / kf * occ;
        let tail = tail / kf * occ;
        for l in 0..lags {
            num[l] += tv_mean[l] / kf * occ;
            den[l] += reached_mean[l] / kf * occ;
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
    let mut values = [0.0; SCALARS];
    let mut stderr = [f64::NAN; SCALARS];
    for q in 0..SCALARS {
        let column: Vec<f64> = per_rep.iter().map(|v| v[q]).collect();
        let mean = pairwise_sum(&column) / rf;
        values[q] = mean;
        if r > 1 {
            let dev: Vec<f64> = column.iter().map(|x| (x - mean) * (x - mean)).collect();
            stderr[q] = (pairwise_sum(&dev) / (rf - 1.0)).sqrt() / rf.sqrt();
        }
    }
    let pmf: Vec<f64> = pmf_sum.iter().map(|x| x / rf).collect();
    let mut survival = Vec::with_capacity(t + 1);
    survival.push(1.0);
    survival.extend(survival_sum.iter().map(|x| x / rf));
    let median_tau = median(&pmf);
    Ok(One {
        values,
        stderr,
        survival,
        pmf,
        num: num.iter().map(|x| x / rf).collect(),
        den: den.iter().map(|x| x / rf).collect(),
        median_tau,
    })
}

/// The median of the law of tau given tau <= T with step t spread over (t - 1/2, t + 1/2]
/// (the grouped-data median, `kvcouple.decomposition.median_step`, operation for operation):
/// continuous in the law, so that its bootstrap interval can hold its level; NaN when nothing
/// diverges.
fn median(pmf: &[f64]) -> f64 {
    let mut cum = Vec::with_capacity(pmf.len());
    let mut acc = 0.0;
    for &p in pmf {
        acc += p;
        cum.push(acc);
    }
    let total = acc;
    let Some(at) = cum.iter().position(|&c| 2.0 * c >= total * (1.0 - 1e-12)) else {
        return f64::NAN;
    };
    let mass = pmf[at];
    if !(total > 0.0 && mass > 0.0) {
        return f64::NAN;
    }
    let below = cum[at] - mass;
    let share = ((0.5 * total - below) / mass).clamp(0.0, 1.0);
    at as f64 + 0.5 + share
}

/// numpy's pairwise summation for a contiguous run (blocks of 8 below 128 values), so that
/// the sums agree with the numpy reference to the last bits in most cases.
fn pairwise_sum(x: &[f64]) -> f64 {
    let n = x.len();
    if n < 8 {
        let mut s = 0.0;
        for &v in x {
            s += v;
        }
        return s;
    }
    if n <= 128 {
        let mut r = [x[0], x[1], x[2], x[3], x[4], x[5], x[6], x[7]];
        let mut i = 8;
        while i + 8 <= n {
            for j in 0..8 {
                r[j] += x[i + j];
            }
            i += 8;
        }
        let mut s = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        while i < n {
            s += x[i];
            i += 1;
        }
        return s;
    }
    let half = (n / 2) - (n / 2) % 8;
    pairwise_sum(&x[..half]) + pairwise_sum(&x[half..])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(units: usize) -> UnitShape {
        UnitShape {
            units,
            replicates: 2,
            horizon: 3,
            branches: 1,
            lags: 4,
        }
    }

    #[test]
    fn a_certain_divergence_at_the_first_step() {
        // h = 1 at step 1: O = 1, occupation T - 1, tau = 1, one mismatch per lag observed.
        let hazard = [1.0, 0.0, 0.0, 1.0, 0.0, 0.0];
        let steps = [1, 1];
        let mismatch = [0i8, 1, 1, 1, 0, 1, 1, 1];
        let tv = [0.0, 0.5, 0.5, 0.5, 0.0, 0.5, 0.5, 0.5];
        let inputs = UnitInputs {
            hazard: &hazard,
            branch_step: &steps,
            branch_mismatch: &mismatch,
            branch_tv: &tv,
        };
        let out = estimate_units(&inputs, shape(1), 2, Estimator::Indicator, true).unwrap();
        assert_eq!(out.values[0], 1.0); // occurrence
        assert_eq!(out.values[1], 2.0); // occupation
        assert_eq!(out.values[4], 2.0); // window part: lags 1..2
        assert_eq!(out.values[5], 1.0); // tail part: lag 3
        assert_eq!(out.values[3], 4.0); // expected mismatches
        assert_eq!(out.stderr[0], 0.0);
        assert_eq!(out.median_tau[0], 1.0);
        assert_eq!(&out.survival[..4], &[1.0, 0.0, 0.0, 0.0]);
        let tv_out = estimate_units(&inputs, shape(1), 2, Estimator::Tv, true).unwrap();
        assert_eq!(tv_out.values[4], 1.0);
        assert_eq!(tv_out.tv_lag_num[1], 0.5);
        assert_eq!(tv_out.tv_lag_den[1], 1.0);
    }

    #[test]
    fn median_spreads_each_step_over_its_class() {
        assert_eq!(median(&[0.0, 1.0, 0.0]), 2.0); // one step: that step
        assert_eq!(median(&[0.5, 0.5]), 1.5); // 1/2 at (1/2, 3/2], 1/2 at (3/2, 5/2]
        assert_eq!(median(&[0.2, 0.2, 0.2]), 2.0); // the middle of three equal steps
        assert!((median(&[0.1, 0.3, 0.0]) - (1.5 + 1.0 / 3.0)).abs() < 1e-15);
        assert!(median(&[0.0, 0.0]).is_nan()); // nothing diverges
        assert!(median(&[]).is_nan());
    }

    #[test]
    fn damage_is_named_not_estimated() {
        let mut hazard = [0.5; 6];
        hazard[4] = 1.5;
        let inputs = UnitInputs {
            hazard: &hazard,
            branch_step: &[1, 1],
            branch_mismatch: &[0; 8],
            branch_tv: &[0.0; 8],
        };
        let out = estimate_units(&inputs, shape(1), 2, Estimator::Indicator, true).unwrap();
        assert_eq!(
            out.damage[0],
            Some(UnitDamage::Hazard {
                replicate: 1,
                step: 1,
                value: 1.5
            })
        );
        let hazard = [0.5; 6];
        let inputs = UnitInputs {
            branch_step: &[1, 0],
            hazard: &hazard,
            ..inputs
        };
        let out = estimate_units(&inputs, shape(1), 2, Estimator::Indicator, true).unwrap();
        assert!(matches!(
            out.damage[0],
            Some(UnitDamage::MissingBranch { replicate: 1, .. })
        ));
        let inputs = UnitInputs {
            branch_step: &[1, 9],
            ..inputs
        };
        let out = estimate_units(&inputs, shape(1), 2, Estimator::Indicator, true).unwrap();
        assert_eq!(
            out.damage[0],
            Some(UnitDamage::BranchPastHorizon {
                replicate: 1,
                branch: 0,
                step: 9
            })
        );
    }

    #[test]
    fn shapes_and_windows_are_checked() {
        let inputs = UnitInputs {
            hazard: &[0.5; 5],
            branch_step: &[1, 1],
            branch_mismatch: &[0; 8],
            branch_tv: &[0.0; 8],
        };
        assert!(estimate_units(&inputs, shape(1), 2, Estimator::Tv, true).is_err());
        let inputs = UnitInputs {
            hazard: &[0.5; 6],
            ..inputs
        };
        assert!(estimate_units(&inputs, shape(1), 4, Estimator::Tv, true).is_err());
    }

    #[test]
    fn pairwise_sum_matches_a_plain_sum_on_exact_values() {
        let x: Vec<f64> = (0..300).map(|i| i as f64).collect();
        assert_eq!(pairwise_sum(&x), 44850.0);
    }
}
