//! One step of the stepwise maximal coupling on two f64 rows (SPEC section 2).
//!
//! The same decision rule and inverse-CDF walks as [`crate::couple`] (residual iff
//! `u0 < delta`, tokens in index order, the last positive index when rounding leaves the
//! target unreached), on rows that kernels have already normalised. One simplification: rows
//! whose residual mass on one side is exactly zero are treated as identical (`delta = 0`), so
//! the sampler never needs the fallback that could return `x == y` after a residual draw.

/// Masses of one row pair.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepStats {
    /// TV distance: the probability of the residual branch.
    pub delta: f64,
    /// `sum min(a, b)`.
    pub overlap: f64,
    /// `sum (a - b)+` and `sum (b - a)+`.
    pub res_p: f64,
    pub res_q: f64,
}

#[inline]
pub fn stats(a: &[f64], b: &[f64]) -> StepStats {
    let (mut abs_diff, mut overlap, mut res_p, mut res_q) = (0.0, 0.0, 0.0, 0.0);
    for (&x, &y) in a.iter().zip(b) {
        let d = x - y;
        abs_diff += d.abs();
        overlap += x.min(y);
        res_p += d.max(0.0);
        res_q += (-d).max(0.0);
    }
    let delta = if overlap <= 0.0 {
        1.0
    } else if res_p <= 0.0 || res_q <= 0.0 {
        0.0
    } else {
        (0.5 * abs_diff).min(1.0)
    };
    StepStats {
        delta,
        overlap,
        res_p,
        res_q,
    }
}

/// First index whose running weight exceeds `target`; else the last positive index.
#[inline]
fn inverse_cdf(a: &[f64], b: &[f64], target: f64, weight: impl Fn(f64, f64) -> f64) -> usize {
    let mut cum = 0.0;
    let mut last_positive = 0;
    for (i, (&x, &y)) in a.iter().zip(b).enumerate() {
        let w = weight(x, y);
        if w > 0.0 {
            last_positive = i;
            cum += w;
            if cum > target {
                return i;
            }
        }
    }
    last_positive
}

#[inline]
pub fn overlap_token(a: &[f64], b: &[f64], st: &StepStats, u1: f64) -> usize {
    inverse_cdf(a, b, u1 * st.overlap, f64::min)
}

/// The residual draw `(x, y)`, `x ~ (a - b)+`, `y ~ (b - a)+` (requires `delta > 0`).
#[inline]
pub fn residual_tokens(a: &[f64], b: &[f64], st: &StepStats, u1: f64, u2: f64) -> (usize, usize) {
    let x = inverse_cdf(a, b, u1 * st.res_p, |x, y| (x - y).max(0.0));
    let y = inverse_cdf(a, b, u2 * st.res_q, |x, y| (y - x).max(0.0));
    (x, y)
}

/// The coupled draw `(x, y)` of one step with uniforms `u`.
#[inline]
pub fn draw(a: &[f64], b: &[f64], st: &StepStats, u: [f64; 3]) -> (usize, usize) {
    if u[0] >= st.delta {
        let z = overlap_token(a, b, st, u[1]);
        (z, z)
    } else {
        residual_tokens(a, b, st, u[1], u[2])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::couple::couple;
    use crate::rows::Rows;
    use crate::synth::rng::Rng;

    #[test]
    fn same_tokens_as_the_public_sampler() {
        let mut rng = Rng::new(5);
        for trial in 0..2000 {
            let v = 1 + trial % 7;
            let mut a: Vec<f64> = (0..v).map(|_| rng.uniform()).collect();
            let mut b: Vec<f64> = (0..v).map(|_| rng.uniform()).collect();
            if trial % 5 == 0 {
                a[rng.below(v)] = 0.0;
                b[rng.below(v)] = 0.0;
            }
            if trial % 11 == 0 {
                b = a.clone();
            }
            if a.iter().sum::<f64>() == 0.0 || b.iter().sum::<f64>() == 0.0 {
                continue;
            }
            let (sa, sb): (f64, f64) = (a.iter().sum(), b.iter().sum());
            let an: Vec<f64> = a.iter().map(|x| x * (1.0 / sa)).collect();
            let bn: Vec<f64> = b.iter().map(|x| x * (1.0 / sb)).collect();
            let st = stats(&an, &bn);
            let u = [rng.uniform(), rng.uniform(), rng.uniform()];
            let ours = draw(&an, &bn, &st, u);
            let theirs = couple(Rows::F64(&a), Rows::F64(&b), &u, 1, v, true, None).unwrap()[0];
            assert_eq!(
                (ours.0 as i64, ours.1 as i64),
                (theirs.x, theirs.y),
                "{a:?} {b:?} {u:?}"
            );
        }
    }
}
