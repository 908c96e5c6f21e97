//! One step of the stepwise maximal coupling on two f64 rows (SPEC section 2).
//!
//! The same decision rule and inverse-CDF walks as [`crate::couple`] (residual iff
//! `u0 < delta`, tokens in index order, the last positive index when rounding leaves the
//! target unreached), on rows that kernels have already normalised. One simplification: rows
//! whose residual mass on one side is exactly zero are treated as identical (`delta = 0`), so
//! the sampler never needs the fallback that could return `x == y` after a residual draw.

use crate::synth::kernel::KernelPair;

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
pub(crate) fn inverse_cdf(
    a: &[f64],
    b: &[f64],
    target: f64,
    weight: impl Fn(f64, f64) -> f64,
) -> usize {
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

/// See [`Stepper::frozen`].
pub fn frozen(pair: &KernelPair, sp: usize, sq: usize) -> bool {
    let (a, b) = (pair.p.row(sp), pair.q.row(sq));
    stats(a, b).delta == 0.0
        && (0..a.len()).all(|z| {
            a[z].min(b[z]) <= 0.0
                || (pair.p.next_state(sp, z) == sp && pair.q.next_state(sq, z) == sq)
        })
}

/// How the Monte Carlo estimators take one step from a state pair.
pub trait Stepper: Sync {
    fn stats(&self, sp: usize, sq: usize) -> StepStats;
    /// Both kernels emit the same tokens and every one of them leads back to `(sp, sq)`
    /// (e.g. both after EOS): nothing can change any more, so simulation may stop here
    /// (as a tracer stops at EOS).
    fn frozen(&self, sp: usize, sq: usize) -> bool;
    fn overlap_token(&self, sp: usize, sq: usize, st: &StepStats, u1: f64) -> usize;
    fn residual_tokens(&self, sp: usize, sq: usize, st: &StepStats, u: [f64; 2]) -> (usize, usize);

    #[inline]
    fn draw(&self, sp: usize, sq: usize, st: &StepStats, u: [f64; 3]) -> (usize, usize) {
        if u[0] >= st.delta {
            let z = self.overlap_token(sp, sq, st, u[1]);
            (z, z)
        } else {
            self.residual_tokens(sp, sq, st, [u[1], u[2]])
        }
    }
}

/// Steps computed from the kernels' rows each time (any size).
pub struct RowStepper<'a>(pub &'a KernelPair);

impl Stepper for RowStepper<'_> {
    #[inline]
    fn stats(&self, sp: usize, sq: usize) -> StepStats {
        stats(self.0.p.row(sp), self.0.q.row(sq))
    }
    fn frozen(&self, sp: usize, sq: usize) -> bool {
        frozen(self.0, sp, sq)
    }
    #[inline]
    fn overlap_token(&self, sp: usize, sq: usize, st: &StepStats, u1: f64) -> usize {
        overlap_token(self.0.p.row(sp), self.0.q.row(sq), st, u1)
    }
    #[inline]
    fn residual_tokens(&self, sp: usize, sq: usize, st: &StepStats, u: [f64; 2]) -> (usize, usize) {
        residual_tokens(self.0.p.row(sp), self.0.q.row(sq), st, u[0], u[1])
    }
}

/// Steps from precomputed per-state-pair tables: the stats and the running sums of the
/// overlap and residual weights, searched by bisection. The running sums are accumulated in
/// the order [`inverse_cdf`] uses, so the tokens are identical to [`RowStepper`]'s.
pub struct TableStepper {
    states_q: usize,
    vocab: usize,
    stats: Vec<StepStats>,
    frozen: Vec<bool>,
    cum: Vec<f64>,
    last_positive: Vec<[usize; 3]>,
}

/// Largest table (f64 entries) [`TableStepper::build`] allocates: 32 MB.
pub const TABLE_LIMIT: usize = 1 << 22;

impl TableStepper {
    /// The tables of every state pair, or `None` when they would exceed [`TABLE_LIMIT`].
    pub fn build(pair: &KernelPair) -> Option<Self> {
        let (sp_n, sq_n, v) = (pair.p.states, pair.q.states, pair.vocab());
        let pairs = sp_n.checked_mul(sq_n)?;
        if pairs.checked_mul(3 * v)? > TABLE_LIMIT {
            return None;
        }
        let mut t = TableStepper {
            states_q: sq_n,
            vocab: v,
            stats: Vec::with_capacity(pairs),
            frozen: Vec::with_capacity(pairs),
            cum: Vec::with_capacity(pairs * 3 * v),
            last_positive: Vec::with_capacity(pairs),
        };
        let weights: [fn(f64, f64) -> f64; 3] =
            [f64::min, |x, y| (x - y).max(0.0), |x, y| (y - x).max(0.0)];
        for sp in 0..sp_n {
            for sq in 0..sq_n {
                let (a, b) = (pair.p.row(sp), pair.q.row(sq));
                t.stats.push(stats(a, b));
                t.frozen.push(frozen(pair, sp, sq));
                let mut last = [0usize; 3];
                for (k, w) in weights.iter().enumerate() {
                    let mut cum = 0.0;
                    for i in 0..v {
                        let x = w(a[i], b[i]);
                        if x > 0.0 {
                            cum += x;
                            last[k] = i;
                        }
                        t.cum.push(cum);
                    }
                }
                t.last_positive.push(last);
            }
        }
        Some(t)
    }

    #[inline]
    fn search(&self, pair_index: usize, kind: usize, target: f64) -> usize {
        let start = (pair_index * 3 + kind) * self.vocab;
        let cum = &self.cum[start..start + self.vocab];
        // Sorted sums: the count of entries <= target is the partition point; counting is
        // branch-free and faster than bisection on short rows.
        let i = if self.vocab <= 32 {
            cum.iter().map(|&c| (c <= target) as usize).sum()
        } else {
            cum.partition_point(|&c| c <= target)
        };
        if i < self.vocab {
            i
        } else {
            self.last_positive[pair_index][kind]
        }
    }
}

impl Stepper for TableStepper {
    #[inline]
    fn stats(&self, sp: usize, sq: usize) -> StepStats {
        self.stats[sp * self.states_q + sq]
    }
    #[inline]
    fn frozen(&self, sp: usize, sq: usize) -> bool {
        self.frozen[sp * self.states_q + sq]
    }
    #[inline]
    fn overlap_token(&self, sp: usize, sq: usize, st: &StepStats, u1: f64) -> usize {
        self.search(sp * self.states_q + sq, 0, u1 * st.overlap)
    }
    #[inline]
    fn residual_tokens(&self, sp: usize, sq: usize, st: &StepStats, u: [f64; 2]) -> (usize, usize) {
        let k = sp * self.states_q + sq;
        (
            self.search(k, 1, u[0] * st.res_p),
            self.search(k, 2, u[1] * st.res_q),
        )
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

    #[test]
    fn table_stepper_gives_the_same_tokens() {
        use crate::synth::kernel::{random_pair, RandomPairOptions};
        for seed in 0..20 {
            let pair = random_pair(&RandomPairOptions {
                vocab: 1 + seed as usize % 9,
                states: 1 + seed as usize % 4,
                closeness: 0.7,
                sparsity: 0.4,
                absorbing: false,
                deterministic: 0.2,
                markov: false,
                seed,
            })
            .unwrap();
            let table = TableStepper::build(&pair).unwrap();
            let rows = RowStepper(&pair);
            let mut rng = Rng::new(seed);
            for sp in 0..pair.p.states {
                for sq in 0..pair.q.states {
                    let st = rows.stats(sp, sq);
                    assert_eq!(st, table.stats(sp, sq));
                    assert_eq!(rows.frozen(sp, sq), table.frozen(sp, sq));
                    for _ in 0..200 {
                        let u = [rng.uniform(), rng.uniform(), rng.uniform()];
                        assert_eq!(rows.draw(sp, sq, &st, u), table.draw(sp, sq, &st, u));
                    }
                }
            }
        }
    }
}
