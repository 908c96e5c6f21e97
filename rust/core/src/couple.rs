//! Stepwise maximal coupling of one step (SPEC section 2), row by row.
//!
//! The sampler is a deterministic function of `(p, q, u0, u1, u2)`; the torch sampler of the
//! tracer implements the same steps in the same order:
//! 1. normalise each row by its own sum (`a = p / sum p`, `b = q / sum q`);
//! 2. `delta = 1/2 sum |a - b|` (exactly 0 for identical rows), overlap mass `o = sum min(a, b)`;
//! 3. residual branch iff `u0 < delta` (or `o == 0`); otherwise the overlap branch;
//! 4. overlap: `x = y =` the first index whose running sum of `min(a, b)` exceeds `u1 * o`;
//! 5. residual: `x` from `(a - b)+` at `u1`, `y` from `(b - a)+` at `u2`, the same way;
//!    a residual whose mass was lost to rounding falls back to `a` (resp. `b`) itself.
//!
//! Running sums that never exceed the target (rounding) return the last index of positive
//! weight, so the result is always inside the support and the vocabulary.

use rayon::prelude::*;

use crate::divergence::{default_atol, row_total, BLOCK};
use crate::error::{KvError, KvResult};
use crate::parallel;
use crate::rows::{check_pair, Rows};

/// One coupled draw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Draw {
    pub x: i64,
    pub y: i64,
    pub diverged: bool,
}

/// Which weight the inverse-CDF walk follows.
#[derive(Clone, Copy)]
enum Weight {
    Overlap,
    ResidualP,
    ResidualQ,
    P,
    Q,
}

#[inline(always)]
fn weight(kind: Weight, a: f64, b: f64) -> f64 {
    match kind {
        Weight::Overlap => a.min(b),
        Weight::ResidualP => (a - b).max(0.0),
        Weight::ResidualQ => (b - a).max(0.0),
        Weight::P => a,
        Weight::Q => b,
    }
}

struct RowPair<'a> {
    p: &'a Rows<'a>,
    q: &'a Rows<'a>,
    offset: usize,
    vocab: usize,
    scale_p: f64,
    scale_q: f64,
}

impl RowPair<'_> {
    /// Visit `(index, a, b)` block by block.
    #[inline(always)]
    fn for_each_block(&self, mut f: impl FnMut(usize, &[f64], &[f64]) -> bool) {
        let mut a = [0.0f64; BLOCK];
        let mut b = [0.0f64; BLOCK];
        let mut start = 0;
        while start < self.vocab {
            let n = BLOCK.min(self.vocab - start);
            self.p.load(self.offset + start, &mut a[..n]);
            self.q.load(self.offset + start, &mut b[..n]);
            for i in 0..n {
                a[i] *= self.scale_p;
                b[i] *= self.scale_q;
            }
            if !f(start, &a[..n], &b[..n]) {
                return;
            }
            start += n;
        }
    }

    /// First index whose running weight exceeds `target`; else the last positive index.
    fn inverse_cdf(&self, kind: Weight, target: f64) -> i64 {
        let mut cum = 0.0;
        let mut last_positive: i64 = -1;
        let mut found: i64 = -1;
        self.for_each_block(|start, a, b| {
            for i in 0..a.len() {
                let w = weight(kind, a[i], b[i]);
                if w > 0.0 {
                    last_positive = (start + i) as i64;
                    cum += w;
                    if cum > target {
                        found = (start + i) as i64;
                        return false;
                    }
                }
            }
            true
        });
        if found >= 0 {
            found
        } else {
            last_positive.max(0)
        }
    }
}

fn couple_row(pair: &RowPair, u: [f64; 3]) -> Draw {
    let (mut abs_diff, mut overlap, mut res_p, mut res_q) = (0.0, 0.0, 0.0, 0.0);
    pair.for_each_block(|_, a, b| {
        for i in 0..a.len() {
            let d = a[i] - b[i];
            abs_diff += d.abs();
            overlap += a[i].min(b[i]);
            res_p += d.max(0.0);
            res_q += (-d).max(0.0);
        }
        true
    });
    let delta = (0.5 * abs_diff).min(1.0);
    if u[0] >= delta && overlap > 0.0 {
        let z = pair.inverse_cdf(Weight::Overlap, u[1] * overlap);
        return Draw {
            x: z,
            y: z,
            diverged: false,
        };
    }
    let x = if res_p > 0.0 {
        pair.inverse_cdf(Weight::ResidualP, u[1] * res_p)
    } else {
        pair.inverse_cdf(Weight::P, u[1])
    };
    let y = if res_q > 0.0 {
        pair.inverse_cdf(Weight::ResidualQ, u[2] * res_q)
    } else {
        pair.inverse_cdf(Weight::Q, u[2])
    };
    Draw {
        x,
        y,
        diverged: x != y,
    }
}

/// Check one row's uniforms.
fn check_uniforms(row: usize, u: &[f64]) -> KvResult<[f64; 3]> {
    for (k, &v) in u.iter().enumerate() {
        if !(0.0..1.0).contains(&v) {
            return Err(KvError::row(
                row,
                format!("uniform u{k} = {v} is outside [0, 1)"),
            ));
        }
    }
    Ok([u[0], u[1], u[2]])
}

/// The maximal coupling of every row pair, given uniforms `u` of shape `rows x 3`.
/// Rows must sum to 1 within `atol` (default by dtype) unless `renormalize`.
pub fn couple(
    p: Rows,
    q: Rows,
    u: &[f64],
    rows: usize,
    vocab: usize,
    renormalize: bool,
    atol: Option<f64>,
) -> KvResult<Vec<Draw>> {
    check_pair(&p, &q, rows, vocab)?;
    if p.dtype() != q.dtype() {
        return Err(KvError::InvalidArgument(format!(
            "p is {:?} but q is {:?}; pass both in one dtype",
            p.dtype(),
            q.dtype()
        )));
    }
    if u.len() != rows * 3 {
        return Err(KvError::Shape(format!(
            "u has {} elements, expected ({rows}, 3)",
            u.len()
        )));
    }
    if let Some(a) = atol {
        if a.is_nan() || a < 0.0 {
            return Err(KvError::InvalidArgument(format!(
                "atol must be >= 0, got {a}"
            )));
        }
    }
    let atol = atol.unwrap_or_else(|| default_atol(p.dtype()));
    let out: Vec<KvResult<Draw>> = parallel::install(|| {
        (0..rows)
            .into_par_iter()
            .map(|r| {
                let uu = check_uniforms(r, &u[r * 3..r * 3 + 3])?;
                let sp = row_total(&p, r, vocab)?;
                let sq = row_total(&q, r, vocab)?;
                if !renormalize {
                    for (side, s) in [("p", sp), ("q", sq)] {
                        if (s - 1.0).abs() > atol {
                            return Err(KvError::row(
                                r,
                                format!("{side} sums to {s:.6}, not 1 within atol={atol} (pass renormalize=True to normalise rows)"),
                            ));
                        }
                    }
                }
                let pair = RowPair {
                    p: &p,
                    q: &q,
                    offset: r * vocab,
                    vocab,
                    scale_p: 1.0 / sp,
                    scale_q: 1.0 / sq,
                };
                Ok(couple_row(&pair, uu))
            })
            .collect()
    });
    out.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn draw(p: &[f64], q: &[f64], u: [f64; 3]) -> Draw {
        couple(Rows::F64(p), Rows::F64(q), &u, 1, p.len(), false, None).unwrap()[0]
    }

    #[test]
    fn identical_rows_never_diverge() {
        let p = [0.2, 0.3, 0.5];
        for k in 0..100 {
            let u = k as f64 / 100.0;
            let d = draw(&p, &p, [u, u, 1.0 - u - 1e-9]);
            assert!(!d.diverged && d.x == d.y && (0..3).contains(&d.x));
        }
    }

    #[test]
    fn disjoint_rows_always_diverge() {
        let d = draw(&[1.0, 0.0], &[0.0, 1.0], [0.999, 0.5, 0.5]);
        assert_eq!(
            d,
            Draw {
                x: 0,
                y: 1,
                diverged: true
            }
        );
    }

    #[test]
    fn overlap_and_residual_tokens() {
        // p = (0.5, 0.5, 0), q = (0.5, 0, 0.5): delta = 0.5, overlap = {0: 0.5}.
        let p = [0.5, 0.5, 0.0];
        let q = [0.5, 0.0, 0.5];
        assert_eq!(
            draw(&p, &q, [0.7, 0.9, 0.1]),
            Draw {
                x: 0,
                y: 0,
                diverged: false
            }
        );
        assert_eq!(
            draw(&p, &q, [0.2, 0.9, 0.1]),
            Draw {
                x: 1,
                y: 2,
                diverged: true
            }
        );
    }

    #[test]
    fn exact_law_on_a_grid() {
        // Integrate the sampler over a fine grid of uniforms: the joint law is the maximal coupling.
        let p = [0.1, 0.4, 0.3, 0.2];
        let q = [0.3, 0.3, 0.1, 0.3];
        let n = 40;
        let mut joint = [[0.0f64; 4]; 4];
        for i in 0..n {
            for j in 0..n {
                for k in 0..n {
                    let u = [
                        (i as f64 + 0.5) / n as f64,
                        (j as f64 + 0.5) / n as f64,
                        (k as f64 + 0.5) / n as f64,
                    ];
                    let d = draw(&p, &q, u);
                    joint[d.x as usize][d.y as usize] += 1.0 / (n * n * n) as f64;
                }
            }
        }
        let diag: f64 = (0..4).map(|v| joint[v][v]).sum();
        assert!((diag - 0.7).abs() < 0.03, "P(x == y) = {diag}");
        for v in 0..4 {
            let px: f64 = joint[v].iter().sum();
            let qy: f64 = (0..4).map(|w| joint[w][v]).sum();
            assert!((px - p[v]).abs() < 0.03 && (qy - q[v]).abs() < 0.03);
        }
    }

    #[test]
    fn bad_uniforms_and_shapes() {
        let p = [0.5, 0.5];
        let e = couple(
            Rows::F64(&p),
            Rows::F64(&p),
            &[0.1, 0.2, 1.0],
            1,
            2,
            false,
            None,
        );
        assert!(matches!(e, Err(KvError::InvalidRow { row: 0, .. })));
        let e = couple(Rows::F64(&p), Rows::F64(&p), &[0.1, 0.2], 1, 2, false, None);
        assert!(matches!(e, Err(KvError::Shape(_))));
    }
}
