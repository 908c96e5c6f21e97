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

/// Rows this long or shorter are coupled with stack buffers of this size.
const SHORT: usize = 64;

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
    fn for_each_block(&self, f: impl FnMut(usize, &[f64], &[f64]) -> bool) {
        // A short row (a synthetic pair's few tokens) is one block either way: buffers of its
        // size spare zeroing two 8 KiB arrays per call, three calls a row.
        if self.vocab <= SHORT {
            self.blocks::<SHORT>(f)
        } else {
            self.blocks::<BLOCK>(f)
        }
    }

    #[inline(always)]
    fn blocks<const N: usize>(&self, mut f: impl FnMut(usize, &[f64], &[f64]) -> bool) {
        let mut a = [0.0f64; N];
        let mut b = [0.0f64; N];
        let mut start = 0;
        while start < self.vocab {
            let n = N.min(self.vocab - start);
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
    fn a_uniform_on_a_cdf_step_takes_the_next_token() {
        // x is the first index whose running weight exceeds u1 * mass: F(i-1) <= u1 < F(i).
        let p = [0.25, 0.25, 0.5];
        for (u1, want) in [(0.0, 0), (0.2, 0), (0.25, 1), (0.5, 2), (0.75, 2)] {
            let d = draw(&p, &p, [0.0, u1, 0.9]);
            assert_eq!((d.x, d.y, d.diverged), (want, want, false), "u1 = {u1}");
        }
        // Disjoint rows: residuals are p and q themselves, with u1 and u2 on steps.
        let (p, q) = ([0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.5, 0.5]);
        assert_eq!(
            draw(&p, &q, [0.3, 0.5, 0.5]),
            Draw {
                x: 1,
                y: 3,
                diverged: true
            }
        );
        assert_eq!(
            draw(&p, &q, [0.3, 0.0, 0.25]),
            Draw {
                x: 0,
                y: 2,
                diverged: true
            }
        );
    }

    #[test]
    fn a_target_never_exceeded_takes_the_last_positive_weight() {
        // The rounding fallback: a target at or above the total mass returns the last index of
        // positive weight (inside the support), never a zero-weight or out-of-range index.
        let a = [0.0, 0.25, 0.0, 0.75, 0.0, 0.0];
        let b = [0.5, 0.5, 0.0, 0.0, 0.0, 0.0];
        let (pa, pb) = (Rows::F64(&a), Rows::F64(&b));
        let pair = RowPair {
            p: &pa,
            q: &pb,
            offset: 0,
            vocab: a.len(),
            scale_p: 1.0,
            scale_q: 1.0,
        };
        assert_eq!(pair.inverse_cdf(Weight::P, 1.0), 3);
        assert_eq!(pair.inverse_cdf(Weight::P, 7.0), 3);
        assert_eq!(pair.inverse_cdf(Weight::Q, 1.0), 1);
        assert_eq!(pair.inverse_cdf(Weight::Overlap, 0.25), 1);
        assert_eq!(pair.inverse_cdf(Weight::ResidualP, 0.75), 3);
        assert_eq!(pair.inverse_cdf(Weight::ResidualQ, 0.5), 1);
        assert_eq!(pair.inverse_cdf(Weight::ResidualQ, 0.25), 0);
        assert_eq!(pair.inverse_cdf(Weight::ResidualQ, 0.75), 1);
        assert_eq!(pair.inverse_cdf(Weight::ResidualP, 0.1), 3);
        // No positive weight at all (never asked by the sampler): index 0, still in range.
        let zero = [0.0; 6];
        let pz = Rows::F64(&zero);
        let empty = RowPair { p: &pz, ..pair };
        assert_eq!(empty.inverse_cdf(Weight::P, 0.5), 0);
    }

    #[test]
    fn disjoint_rows_diverge_even_when_delta_rounds_below_one() {
        // 1/2 sum |a - b| of these disjoint rows is 1 - 2^-53: a u0 at that value must not
        // take the (empty) overlap.
        let third = 1.0 / 3.0;
        let p = [third, third, third, 0.0, 0.0, 0.0];
        let q = [0.0, 0.0, 0.0, third, third, third];
        let top = 1.0 - f64::EPSILON / 2.0;
        for u in [[top, 0.5, 0.5], [top, 0.0, top], [0.0, top, 0.0]] {
            let d = draw(&p, &q, u);
            assert!(
                d.diverged && (0..3).contains(&d.x) && (3..6).contains(&d.y),
                "{u:?}"
            );
        }
    }

    #[test]
    fn row_sums_and_atol() {
        let p = [0.5, 0.5];
        let twice = [1.0, 1.0];
        let c = |p: &[f64], q: &[f64], renormalize, atol| {
            couple(
                Rows::F64(p),
                Rows::F64(q),
                &[0.1, 0.2, 0.3],
                1,
                2,
                renormalize,
                atol,
            )
        };
        assert!(matches!(
            c(&twice, &p, false, None),
            Err(KvError::InvalidRow { row: 0, .. })
        ));
        assert!(matches!(
            c(&p, &twice, false, None),
            Err(KvError::InvalidRow { row: 0, .. })
        ));
        assert_eq!(
            c(&twice, &p, true, None).unwrap(),
            c(&p, &p, false, None).unwrap()
        );
        // Exactly 1 passes a zero tolerance; 1 + 2^-52 does not, but does under the default.
        assert!(c(&p, &p, false, Some(0.0)).is_ok());
        let over = [0.5, 0.5 + f64::EPSILON];
        assert!(c(&over, &p, false, Some(0.0)).is_err());
        assert!(c(&over, &p, false, None).is_ok());
        for bad in [f64::NAN, -1e-3] {
            assert!(matches!(
                c(&p, &p, false, Some(bad)),
                Err(KvError::InvalidArgument(_))
            ));
        }
    }

    #[test]
    fn a_residual_lost_to_rounding_falls_back_to_the_row() {
        // Rows that differ in one direction only (what renormalisation rounding can leave):
        // the side with no residual mass draws from its own row.
        let (even, more) = ([0.5, 0.5], [0.5, 0.5 + 1e-12]);
        let (pe, pm) = (Rows::F64(&even), Rows::F64(&more));
        let pair = |p, q| RowPair {
            p,
            q,
            offset: 0,
            vocab: 2,
            scale_p: 1.0,
            scale_q: 1.0,
        };
        let d = couple_row(&pair(&pe, &pm), [0.0, 0.7, 0.2]);
        assert_eq!((d.x, d.y), (1, 1)); // x from p at 0.7; y from the residual of q
        let d = couple_row(&pair(&pm, &pe), [0.0, 0.2, 0.7]);
        assert_eq!((d.x, d.y), (1, 1)); // x from the residual of p; y from q at 0.7
    }

    /// The sampler restated on plain vectors, one row at a time (SPEC section 2).
    fn naive(p: &[f64], q: &[f64], u: [f64; 3]) -> Draw {
        let (sp, sq): (f64, f64) = (p.iter().sum(), q.iter().sum());
        let a: Vec<f64> = p.iter().map(|x| x / sp).collect();
        let b: Vec<f64> = q.iter().map(|x| x / sq).collect();
        let walk = |w: &[f64], target: f64| -> i64 {
            let (mut cum, mut last) = (0.0, 0);
            for (i, &x) in w.iter().enumerate() {
                if x > 0.0 {
                    last = i as i64;
                    cum += x;
                    if cum > target {
                        return i as i64;
                    }
                }
            }
            last
        };
        let ov: Vec<f64> = a.iter().zip(&b).map(|(x, y)| x.min(*y)).collect();
        let rp: Vec<f64> = a.iter().zip(&b).map(|(x, y)| (x - y).max(0.0)).collect();
        let rq: Vec<f64> = a.iter().zip(&b).map(|(x, y)| (y - x).max(0.0)).collect();
        let o: f64 = ov.iter().sum();
        let delta = (0.5 * a.iter().zip(&b).map(|(x, y)| (x - y).abs()).sum::<f64>()).min(1.0);
        if u[0] >= delta && o > 0.0 {
            let z = walk(&ov, u[1] * o);
            return Draw {
                x: z,
                y: z,
                diverged: false,
            };
        }
        let (tp, tq): (f64, f64) = (rp.iter().sum(), rq.iter().sum());
        let x = if tp > 0.0 {
            walk(&rp, u[1] * tp)
        } else {
            walk(&a, u[1])
        };
        let y = if tq > 0.0 {
            walk(&rq, u[2] * tq)
        } else {
            walk(&b, u[2])
        };
        Draw {
            x,
            y,
            diverged: x != y,
        }
    }

    #[test]
    fn many_rows_over_several_blocks_match_the_naive_sampler() {
        // Rows differ (each row must read its own offset) and span three blocks of the
        // vocabulary, with mass in every block; both branches are exercised.
        let (rows, vocab) = (4, 2 * BLOCK + 300);
        let mut state = 7u64;
        let mut next = || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 11) as f64) / ((1u64 << 53) as f64)
        };
        let mut p = vec![0.0; rows * vocab];
        let mut q = vec![0.0; rows * vocab];
        for r in 0..rows {
            for v in 0..vocab {
                // Row r puts extra weight on block r % 3 of p: TVs differ by row.
                let boost = if v / BLOCK == r % 3 {
                    1.0 + r as f64
                } else {
                    0.0
                };
                p[r * vocab + v] = next() + boost;
                q[r * vocab + v] = next();
            }
        }
        for m in [&mut p, &mut q] {
            for row in m.chunks_mut(vocab) {
                let s: f64 = row.iter().sum();
                row.iter_mut().for_each(|x| *x /= s);
            }
        }
        let mut diverged = 0;
        for k in 0..25 {
            let u: Vec<f64> = (0..rows * 3).map(|_| next()).collect();
            let got = couple(Rows::F64(&p), Rows::F64(&q), &u, rows, vocab, false, None).unwrap();
            for r in 0..rows {
                let want = naive(
                    &p[r * vocab..(r + 1) * vocab],
                    &q[r * vocab..(r + 1) * vocab],
                    [u[3 * r], u[3 * r + 1], u[3 * r + 2]],
                );
                assert_eq!(got[r], want, "draw {k}, row {r}");
                diverged += want.diverged as usize;
            }
            // Unnormalised rows (scaled by 3) with renormalize give the same draws.
            let p3: Vec<f64> = p.iter().map(|x| 3.0 * x).collect();
            let again = couple(Rows::F64(&p3), Rows::F64(&q), &u, rows, vocab, true, None);
            assert_eq!(again.unwrap(), got);
        }
        assert!(diverged > 5 && diverged < 95, "{diverged}");
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
