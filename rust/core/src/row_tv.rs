//! Total variation of stored distribution rows, to check the recorded hazards and branch TVs
//! against the full records. Each row is streamed once in blocks, converted in registers and
//! summed in lanes; float16 rows, the common case, go to [`crate::half`]'s kernels.
//!
//! Rows holding any NaN or infinity are rows the tracer never recorded (after a stop, past the
//! horizon, no branch): their TV is NaN rather than an error.

use rayon::prelude::*;

use crate::error::{KvError, KvResult};
use crate::half::{tv_and_sums_f16, tv_f16, BLOCK};
use crate::parallel;
use crate::row_check::{check_one_row, RowViolation};
use crate::row_top::top_delta_one;
use crate::rows::{check_lengths, check_same_dtype, Rows};

const LANES: usize = 8;

/// `TV(p_r, q_r) = 1/2 sum_v |p_r(v) - q_r(v)|` for each row, NaN for unrecorded rows.
pub fn row_tv(p: Rows, q: Rows, rows: usize, vocab: usize) -> KvResult<Vec<f64>> {
    check_tv_shapes(&p, &q, rows, vocab)?;
    Ok(parallel::install(|| {
        (0..rows)
            .into_par_iter()
            .with_min_len(4)
            .map(|r| one_row(&p, &q, r * vocab, vocab))
            .collect()
    }))
}

/// Unlike [`crate::rows::check_pair`], zero rows are allowed (an empty block has no TVs).
fn check_tv_shapes(p: &Rows, q: &Rows, rows: usize, vocab: usize) -> KvResult<()> {
    if vocab == 0 {
        return Err(KvError::Shape("row_tv: vocab is empty".into()));
    }
    check_lengths(p, q, rows, vocab)?;
    check_same_dtype(p, q)
}

#[inline]
fn one_row(p: &Rows, q: &Rows, base: usize, vocab: usize) -> f64 {
    if let (Rows::F16(a), Rows::F16(b)) = (p, q) {
        return tv_f16(&a[base..base + vocab], &b[base..base + vocab]);
    }
    let mut a = [0.0f64; BLOCK];
    let mut b = [0.0f64; BLOCK];
    let mut lanes = [0.0f64; LANES];
    let mut bad = false;
    let mut start = 0;
    while start < vocab {
        let n = BLOCK.min(vocab - start);
        bad |= p.load(base + start, &mut a[..n]);
        bad |= q.load(base + start, &mut b[..n]);
        if bad {
            return f64::NAN;
        }
        let full = n - n % LANES;
        for (ca, cb) in a[..full]
            .chunks_exact(LANES)
            .zip(b[..full].chunks_exact(LANES))
        {
            for j in 0..LANES {
                lanes[j] += (ca[j] - cb[j]).abs();
            }
        }
        for j in full..n {
            lanes[0] += (a[j] - b[j]).abs();
        }
        start += n;
    }
    0.5 * (((lanes[0] + lanes[1]) + (lanes[2] + lanes[3]))
        + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7])))
}

/// [`row_tv`] and [`crate::row_check::row_check`] of both sides in one pass over the rows: the
/// TVs, or the first row (in row order, `p` before `q`) that is not a distribution, with its
/// side (0: `p`, 1: `q`). Half-precision rows are read once: the TV and both sums share the
/// loop, and only a row holding a NaN, an infinity or a negative entry is scanned again to say
/// which.
///
/// With `with_top`, each row's top-token delta ([`crate::row_top::top_delta_one`]) is made
/// right after its TV, while the row is still in cache (a second pass over the block's rows
/// read them from memory again): `[tv, delta]` per row, row after row.
pub fn row_tv_checked(
    p: Rows,
    q: Rows,
    rows: usize,
    vocab: usize,
    tolerance: f64,
    with_top: bool,
) -> KvResult<Result<Vec<f64>, (usize, RowViolation)>> {
    check_tv_shapes(&p, &q, rows, vocab)?;
    let per_row: Vec<Result<[f64; 2], (usize, RowViolation)>> = parallel::install(|| {
        (0..rows)
            .into_par_iter()
            .with_min_len(4)
            .map(|r| {
                let tv = checked_row(&p, &q, r, vocab, tolerance)?;
                let top = with_top.then(|| top_delta_one(&p, &q, r * vocab, vocab));
                Ok([tv, top.unwrap_or(f64::NAN)])
            })
            .collect()
    });
    let width = if with_top { 2 } else { 1 };
    Ok(per_row
        .into_iter()
        .collect::<Result<Vec<[f64; 2]>, _>>()
        .map(|values| {
            values
                .into_iter()
                .flat_map(|v| v.into_iter().take(width))
                .collect()
        }))
}

fn checked_row(
    p: &Rows,
    q: &Rows,
    r: usize,
    vocab: usize,
    tolerance: f64,
) -> Result<f64, (usize, RowViolation)> {
    let base = r * vocab;
    if let (Rows::F16(a), Rows::F16(b)) = (p, q) {
        let (tv, sa, sb, flagged) = tv_and_sums_f16(&a[base..base + vocab], &b[base..base + vocab]);
        if !flagged {
            if (sa - 1.0).abs() > tolerance {
                return Err((0, RowViolation::Sum { row: r, sum: sa }));
            }
            if (sb - 1.0).abs() > tolerance {
                return Err((1, RowViolation::Sum { row: r, sum: sb }));
            }
            return Ok(tv);
        }
    }
    for (side, rows) in [p, q].into_iter().enumerate() {
        if let Some(v) = check_one_row(rows, r, vocab, tolerance) {
            return Err((side, v));
        }
    }
    Ok(one_row(p, q, base, vocab)) // NaN where a side is unrecorded
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::half::{f16_to_f32, f16_to_f64};
    use crate::row_check::row_check;

    #[test]
    fn matches_naive_tv_and_marks_unrecorded_rows() {
        let vocab = 2500; // not a multiple of the block or the lanes
        let rows = 3;
        let mut p = vec![0.0f64; rows * vocab];
        let mut q = vec![0.0f64; rows * vocab];
        for v in 0..vocab {
            p[v] = 1.0 / vocab as f64;
            q[v] = if v < 10 { 0.1 } else { 0.0 };
            p[vocab + v] = q[v];
            q[vocab + v] = q[v];
        }
        p[2 * vocab + 7] = f64::NAN;
        let tv = row_tv(Rows::F64(&p), Rows::F64(&q), rows, vocab).unwrap();
        let naive: f64 = 0.5 * (0..vocab).map(|v| (p[v] - q[v]).abs()).sum::<f64>();
        assert!((tv[0] - naive).abs() < 1e-12);
        assert!((tv[0] - (1.0 - 10.0 / vocab as f64)).abs() < 1e-12);
        assert_eq!(tv[1], 0.0);
        assert!(tv[2].is_nan());
    }

    #[test]
    fn f16_rows_match_the_f64_reference() {
        // Every finite half, paired with a shifted copy, against the f64 reference.
        let vocab = 3000;
        let halves: Vec<u16> = (0..vocab as u32)
            .map(|i| ((i * 7919) % 0x7c00) as u16 | if i % 3 == 0 { 0x8000 } else { 0 })
            .collect();
        let shifted: Vec<u16> = halves.iter().rev().copied().collect();
        let fast = row_tv(Rows::F16(&halves), Rows::F16(&shifted), 1, vocab).unwrap()[0];
        let reference: f64 = 0.5
            * halves
                .iter()
                .zip(&shifted)
                .map(|(&x, &y)| (f16_to_f64(x) - f16_to_f64(y)).abs())
                .sum::<f64>();
        assert!(
            (fast - reference).abs() <= 1e-6 * reference,
            "{fast} {reference}"
        );
        let mut nan_row = halves.clone();
        nan_row[2500] = 0x7e00;
        assert!(row_tv(Rows::F16(&nan_row), Rows::F16(&shifted), 1, vocab).unwrap()[0].is_nan());
    }

    #[test]
    fn half_rows_and_shape_errors() {
        // 0x3800 = 0.5, 0x0000 = 0
        let p = [0x3800u16, 0x3800, 0, 0];
        let q = [0u16, 0, 0x3800, 0x3800];
        let tv = row_tv(Rows::F16(&p), Rows::F16(&q), 1, 4).unwrap();
        assert_eq!(tv, vec![1.0]);
        assert!(row_tv(Rows::F16(&p), Rows::F16(&q), 2, 4).is_err());
        assert!(row_tv(Rows::F16(&p), Rows::BF16(&q), 1, 4).is_err());
    }
    /// The nearest half to a value in [0, 65504] (positive halves are ordered as their bits).
    fn to_half(x: f64) -> u16 {
        let (mut lo, mut hi) = (0u16, 0x7bffu16);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if (f16_to_f32(mid) as f64) < x {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        let below = lo.saturating_sub(1);
        if (x - f16_to_f32(below) as f64).abs() < (f16_to_f32(lo) as f64 - x).abs() {
            below
        } else {
            lo
        }
    }

    #[test]
    fn fused_check_agrees_with_the_separate_passes() {
        let vocab = 2500; // not a multiple of the block or the lanes
        let rows = 4;
        let halves = |seed: u32| -> Vec<u16> {
            // A distribution in float16: equal weights with a few larger ones.
            let mut v: Vec<f64> = (0..vocab as u32)
                .map(|i| 1.0 + ((i * 7919 + seed) % 13) as f64)
                .collect();
            let total: f64 = v.iter().sum();
            v.iter_mut().for_each(|x| *x /= total);
            v.iter().map(|&x| to_half(x)).collect()
        };
        let mut p: Vec<u16> = (0..rows as u32).flat_map(halves).collect();
        let q: Vec<u16> = (10..10 + rows as u32).flat_map(halves).collect();
        let tol = 1e-3;
        let tv = row_tv(Rows::F16(&p), Rows::F16(&q), rows, vocab).unwrap();
        let fused = row_tv_checked(Rows::F16(&p), Rows::F16(&q), rows, vocab, tol, false).unwrap();
        assert_eq!(fused.unwrap(), tv);
        // With the top-token deltas: each row's TV, then its delta (as the separate pass).
        let delta = crate::row_top::row_top_delta(Rows::F16(&p), Rows::F16(&q), rows, vocab);
        let top = row_tv_checked(Rows::F16(&p), Rows::F16(&q), rows, vocab, tol, true).unwrap();
        let want: Vec<f64> = tv
            .iter()
            .zip(delta.unwrap())
            .flat_map(|(&t, d)| [t, d])
            .collect();
        assert_eq!(top.unwrap(), want);
        // Row 2 of q all NaN (unrecorded): allowed, its TV NaN.
        let mut q2 = q.clone();
        q2[2 * vocab..3 * vocab].fill(0x7e00);
        let fused = row_tv_checked(Rows::F16(&p), Rows::F16(&q2), rows, vocab, tol, false).unwrap();
        let fused = fused.unwrap();
        assert!(fused[2].is_nan() && fused[1] == tv[1]);
        // A negative entry in p's row 3 and a short row 1 of q: row 1 comes first.
        p[3 * vocab + 5] = 0x8001;
        let mut q3 = q.clone();
        q3[vocab..2 * vocab]
            .iter_mut()
            .take(vocab / 2)
            .for_each(|h| *h = 0);
        let err = row_tv_checked(Rows::F16(&p), Rows::F16(&q3), rows, vocab, tol, false).unwrap();
        assert!(
            matches!(err, Err((1, RowViolation::Sum { row: 1, .. }))),
            "{err:?}"
        );
        let err = row_tv_checked(Rows::F16(&p), Rows::F16(&q), rows, vocab, tol, false).unwrap();
        assert!(
            matches!(err, Err((0, RowViolation::Entry { row: 3, col: 5, value })) if value < 0.0),
            "{err:?}"
        );
        let top = row_tv_checked(Rows::F16(&p), Rows::F16(&q3), rows, vocab, tol, true).unwrap();
        assert!(matches!(top, Err((1, RowViolation::Sum { row: 1, .. }))));
        assert_eq!(
            row_check(Rows::F16(&p), rows, vocab, tol).unwrap(),
            err.err().map(|e| e.1)
        );
    }
}
