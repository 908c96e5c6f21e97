//! Bootstrap confidence intervals of many statistics at once: percentile and BCa (bias-corrected
//! and accelerated, Efron 1987), with the quantile levels given as normal scores so the caller
//! can pass expanded levels (Hesterberg's small-sample expansion, `sqrt(n/(n-1)) t_{n-1}`).
//!
//! For statistic `j` with point estimate `theta_j`, bootstrap replicates `reps[.., j]` and
//! jackknife (leave-one-document-out) values `jack[.., j]`:
//!
//! - bias correction `z0 = Phi^-1((#{reps < theta} + #{reps == theta}/2) / B)`;
//! - acceleration `a = sum d^3 / (6 (sum d^2)^1.5)`, `d = mean(jack) - jack`;
//! - the interval end for normal score `z` is the replicates' quantile at
//!   `Phi(z0 + (z0 + z) / (1 - a (z0 + z)))` (percentile: at `Phi(z)`).
//!
//! An end whose quantile level lies beyond the replicates' resolution (below `1/(B+1)` or above
//! `B/(B+1)`) is extrapolated by the normal tail from the replicates' mean and standard
//! deviation (and never inside the replicates' range). Non-finite replicates and jackknife values are left
//! out. A statistic whose point estimate is
//! not finite, or whose finite replicates are fewer than half, gets NaN bounds.

use rayon::prelude::*;

use crate::error::{KvError, KvResult};
use crate::parallel;

/// Standard normal CDF, via `erfc` (relative error below 1.2e-7).
pub fn norm_cdf(x: f64) -> f64 {
    0.5 * erfc(-x / std::f64::consts::SQRT_2)
}

/// Complementary error function (Numerical Recipes' Chebyshev fit, fractional error < 1.2e-7).
fn erfc(x: f64) -> f64 {
    let z = x.abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let poly = -z * z - 1.265_512_23
        + t * (1.000_023_68
            + t * (0.374_091_96
                + t * (0.096_784_18
                    + t * (-0.186_288_06
                        + t * (0.278_868_07
                            + t * (-1.135_203_98
                                + t * (1.488_515_87 + t * (-0.822_152_23 + t * 0.170_872_77))))))));
    let r = t * poly.exp();
    if x >= 0.0 {
        r
    } else {
        2.0 - r
    }
}

/// Standard normal quantile (Acklam's rational approximation, relative error < 1.2e-9).
pub fn norm_ppf(p: f64) -> f64 {
    if p <= 0.0 {
        return f64::NEG_INFINITY;
    }
    if p >= 1.0 {
        return f64::INFINITY;
    }
    const A: [f64; 6] = [
        -3.969_683_028_665_376e1,
        2.209_460_984_245_205e2,
        -2.759_285_104_469_687e2,
        1.383_577_518_672_69e2,
        -3.066_479_806_614_716e1,
        2.506_628_277_459_239,
    ];
    const B: [f64; 5] = [
        -5.447_609_879_822_406e1,
        1.615_858_368_580_409e2,
        -1.556_989_798_598_866e2,
        6.680_131_188_771_972e1,
        -1.328_068_155_288_572e1,
    ];
    const C: [f64; 6] = [
        -7.784_894_002_430_293e-3,
        -3.223_964_580_411_365e-1,
        -2.400_758_277_161_838,
        -2.549_732_539_343_734,
        4.374_664_141_464_968,
        2.938_163_982_698_783,
    ];
    const D: [f64; 4] = [
        7.784_695_709_041_462e-3,
        3.224_671_290_700_398e-1,
        2.445_134_137_142_996,
        3.754_408_661_907_416,
    ];
    let tail = |q: f64| {
        (((((C[0] * q + C[1]) * q + C[2]) * q + C[3]) * q + C[4]) * q + C[5])
            / ((((D[0] * q + D[1]) * q + D[2]) * q + D[3]) * q + 1.0)
    };
    if p < 0.024_25 {
        tail((-2.0 * p.ln()).sqrt())
    } else if p > 1.0 - 0.024_25 {
        -tail((-2.0 * (1.0 - p).ln()).sqrt())
    } else {
        let q = p - 0.5;
        let r = q * q;
        (((((A[0] * r + A[1]) * r + A[2]) * r + A[3]) * r + A[4]) * r + A[5]) * q
            / (((((B[0] * r + B[1]) * r + B[2]) * r + B[3]) * r + B[4]) * r + 1.0)
    }
}

/// Quantile of sorted finite values at level `p`, linear interpolation (numpy's default).
fn quantile(sorted: &[f64], p: f64) -> f64 {
    let pos = p.clamp(0.0, 1.0) * (sorted.len() - 1) as f64;
    let lo = pos.floor() as usize;
    let hi = (lo + 1).min(sorted.len() - 1);
    sorted[lo] + (pos - lo as f64) * (sorted[hi] - sorted[lo])
}

/// The quantile level of the interval end for normal score `z` under BCa.
pub fn bca_level(z0: f64, accel: f64, z: f64) -> f64 {
    let w = z0 + z;
    let denom = 1.0 - accel * w;
    if denom <= 0.0 {
        // Beyond the acceleration's range: the end runs to the extreme replicate.
        return if z > 0.0 { 1.0 } else { 0.0 };
    }
    norm_cdf(z0 + w / denom)
}

/// Per statistic: (lower, upper, z0, acceleration).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct IntervalRow {
    pub lower: f64,
    pub upper: f64,
    pub z0: f64,
    pub accel: f64,
}

/// Intervals of `k` statistics. `reps`: `n_boot x k` row-major; `point`: `k`; `jack`:
/// `n_jack x k` row-major (ignored unless `bca`). `z_lower < z_upper` are the normal scores of
/// the two ends (e.g. -1.96, 1.96).
#[allow(clippy::too_many_arguments)]
pub fn bootstrap_intervals(
    reps: &[f64],
    n_boot: usize,
    point: &[f64],
    jack: &[f64],
    n_jack: usize,
    z_lower: f64,
    z_upper: f64,
    bca: bool,
) -> KvResult<Vec<IntervalRow>> {
    let k = point.len();
    if n_boot == 0 || k == 0 {
        return Err(KvError::Shape(format!(
            "intervals need replicates and statistics, got {n_boot} x {k}"
        )));
    }
    if reps.len() != n_boot * k {
        return Err(KvError::Shape(format!(
            "reps has {} elements, expected {n_boot} x {k}",
            reps.len()
        )));
    }
    if bca && (n_jack < 2 || jack.len() != n_jack * k) {
        return Err(KvError::Shape(format!(
            "BCa needs a jackknife of at least 2 rows x {k}, got {} elements for {n_jack} rows",
            jack.len()
        )));
    }
    if !(z_lower.is_finite() && z_upper.is_finite() && z_lower < z_upper) {
        return Err(KvError::InvalidArgument(format!(
            "normal scores must be finite with lower < upper, got {z_lower}, {z_upper}"
        )));
    }
    let nan = IntervalRow {
        lower: f64::NAN,
        upper: f64::NAN,
        z0: f64::NAN,
        accel: f64::NAN,
    };
    let mut out = vec![nan; k];
    parallel::install(|| {
        out.par_iter_mut().enumerate().for_each(|(j, row)| {
            let theta = point[j];
            let mut v: Vec<f64> = (0..n_boot)
                .map(|b| reps[b * k + j])
                .filter(|x| x.is_finite())
                .collect();
            if !theta.is_finite() || 2 * v.len() < n_boot || v.is_empty() {
                return;
            }
            v.sort_unstable_by(|a, b| a.total_cmp(b));
            let (mut z0, mut accel) = (0.0, 0.0);
            if bca {
                let below = v.partition_point(|&x| x < theta);
                let equal = v[below..].partition_point(|&x| x <= theta);
                let n = v.len() as f64;
                let frac = ((below as f64 + 0.5 * equal as f64) / n).clamp(0.5 / n, 1.0 - 0.5 / n);
                z0 = norm_ppf(frac);
                let jk: Vec<f64> = (0..n_jack)
                    .map(|i| jack[i * k + j])
                    .filter(|x| x.is_finite())
                    .collect();
                if jk.len() >= 2 {
                    let mean = jk.iter().sum::<f64>() / jk.len() as f64;
                    let (s2, s3) = jk.iter().fold((0.0, 0.0), |(s2, s3), &x| {
                        let d = mean - x;
                        (s2 + d * d, s3 + d * d * d)
                    });
                    if s2 > 0.0 {
                        accel = s3 / (6.0 * s2.powf(1.5));
                    }
                }
            }
            let (lo_p, hi_p) = if bca {
                (bca_level(z0, accel, z_lower), bca_level(z0, accel, z_upper))
            } else {
                (norm_cdf(z_lower), norm_cdf(z_upper))
            };
            // An end whose level the replicates cannot resolve (beyond 1/(B+1)) is extrapolated
            // from the replicates' mean and standard deviation by the normal tail, never the
            // extreme replicate, which would claim more than the bootstrap knows.
            let resolution = 1.0 / (v.len() as f64 + 1.0);
            let tail = |p: f64| {
                let m = v.iter().sum::<f64>() / v.len() as f64;
                let var =
                    v.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / (v.len().max(2) - 1) as f64;
                // BCa's level reaches 0 or 1 when a (z0 + z) >= 1: cap it at 8 sigma.
                m + norm_ppf(p).clamp(-8.0, 8.0) * var.sqrt()
            };
            *row = IntervalRow {
                lower: if lo_p < resolution {
                    tail(lo_p).min(v[0])
                } else {
                    quantile(&v, lo_p)
                },
                upper: if hi_p > 1.0 - resolution {
                    tail(hi_p).max(v[v.len() - 1])
                } else {
                    quantile(&v, hi_p)
                },
                z0,
                accel,
            };
        })
    });
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normal_functions_invert() {
        for &p in &[1e-6, 0.01, 0.025, 0.3, 0.5, 0.8, 0.975, 0.999_99] {
            assert!(
                (norm_cdf(norm_ppf(p)) - p).abs() < 2e-7 * p.max(1e-3),
                "{p}"
            );
        }
        assert!((norm_ppf(0.975) - 1.959_963_984_540_054).abs() < 1e-8);
        assert!((norm_cdf(1.0) - 0.841_344_746_068_542_9).abs() < 1e-7);
    }

    #[test]
    fn percentile_matches_sorted_quantiles() {
        let reps: Vec<f64> = (0..1001).map(|i| i as f64).collect();
        let out = bootstrap_intervals(&reps, 1001, &[500.0], &[], 0, -1.959_964, 1.959_964, false)
            .unwrap();
        assert!((out[0].lower - 25.0).abs() < 1e-3 && (out[0].upper - 975.0).abs() < 1e-3);
    }

    #[test]
    fn bca_shifts_towards_the_bias_and_skew() {
        // Point estimate below most replicates: z0 < 0 moves both ends down.
        let reps: Vec<f64> = (0..1000).map(|i| i as f64).collect();
        let jack: Vec<f64> = (0..20).map(|i| i as f64).collect(); // symmetric: a = 0
        let out = bootstrap_intervals(&reps, 1000, &[300.0], &jack, 20, -1.96, 1.96, true).unwrap();
        assert!(out[0].z0 < 0.0 && out[0].accel.abs() < 1e-12);
        let pct =
            bootstrap_intervals(&reps, 1000, &[300.0], &jack, 20, -1.96, 1.96, false).unwrap();
        assert!(out[0].lower < pct[0].lower && out[0].upper < pct[0].upper);
        // Skewed jackknife: non-zero acceleration.
        let skew: Vec<f64> = (0..20).map(|i| ((i as f64) / 4.0).exp()).collect();
        let out = bootstrap_intervals(&reps, 1000, &[500.0], &skew, 20, -1.96, 1.96, true).unwrap();
        assert!(out[0].accel.abs() > 0.01);
    }

    #[test]
    fn constant_and_undefined_statistics() {
        let reps = vec![1.0; 200];
        let out = bootstrap_intervals(&reps, 100, &[1.0, f64::NAN], &[1.0; 4], 2, -2.0, 2.0, true)
            .unwrap();
        assert_eq!((out[0].lower, out[0].upper, out[0].z0), (1.0, 1.0, 0.0));
        // Levels beyond what 200 replicates resolve: normal-tail extrapolation.
        let spread: Vec<f64> = (0..200)
            .map(|i| norm_ppf((i as f64 + 0.5) / 200.0))
            .collect();
        let wide = bootstrap_intervals(&spread, 200, &[0.0], &[], 0, -3.5, 3.5, false).unwrap();
        assert!(wide[0].lower < spread[0] && wide[0].upper > spread[199]);
        assert!((wide[0].lower + 3.5).abs() < 0.1 && (wide[0].upper - 3.5).abs() < 0.1);
        assert!(out[1].lower.is_nan());
        assert!(bootstrap_intervals(&reps, 100, &[1.0], &[], 0, -2.0, 2.0, true).is_err());
        assert!(bootstrap_intervals(&reps, 100, &[1.0, 1.0], &[], 0, 2.0, -2.0, false).is_err());
        assert!(bootstrap_intervals(&reps, 3, &[1.0], &[], 0, -2.0, 2.0, false).is_err());
    }
}
