//! Jackknife standard errors of many statistics at once, in one pass over their
//! leave-one-out values: the studentized bootstrap needs one inside every resample.
//!
//! Row `i` holds `values[i, j]`, the statistic without one draw of document `j`, which
//! `weights[i, j]` draws share (`n_i = sum_j weights[i, j]` draws in all; documents not drawn
//! have weight 0 and are left out):
//!
//! `se_i = sqrt((n_i - 1) / n_i * sum_j w_ij (v_ij - m_i)^2)`, `m_i = sum_j w_ij v_ij / n_i`
//!
//! (for a mean, `s / sqrt(n)` with `ddof = 1`), in two passes over the row (the mean, then
//! the squares about it: no cancellation however far the values are from 0). NaN propagates:
//! a drawn document whose value is NaN gives NaN, and a row without draws gives NaN (0 / 0).

use rayon::prelude::*;

use crate::error::{KvError, KvResult};
use crate::parallel;

/// Rows below this are not worth splitting over threads.
const ROWS_PER_TASK: usize = 64;

/// The jackknife standard error of every row of `values` (`rows x n`, row-major) with draw
/// counts `weights` (same shape).
pub fn jackknife_se(values: &[f64], weights: &[f64], rows: usize, n: usize) -> KvResult<Vec<f64>> {
    if values.len() != rows * n || weights.len() != rows * n {
        return Err(KvError::Shape(format!(
            "values ({}) and weights ({}) must both be {rows} x {n}",
            values.len(),
            weights.len()
        )));
    }
    let mut out = vec![0.0; rows];
    if n == 0 {
        out.fill(f64::NAN);
        return Ok(out);
    }
    parallel::install(|| {
        out.par_chunks_mut(ROWS_PER_TASK)
            .enumerate()
            .for_each(|(task, chunk)| {
                for (k, se) in chunk.iter_mut().enumerate() {
                    let i = task * ROWS_PER_TASK + k;
                    let row = i * n..(i + 1) * n;
                    *se = row_se(&values[row.clone()], &weights[row]);
                }
            })
    });
    Ok(out)
}

fn row_se(values: &[f64], weights: &[f64]) -> f64 {
    // Selects rather than branches (so the loops vectorise); an undrawn document's value,
    // NaN included, never enters a sum.
    let (mut draws, mut sum) = (0.0, 0.0);
    for (&v, &w) in values.iter().zip(weights) {
        draws += w;
        sum += if w > 0.0 { w * v } else { 0.0 };
    }
    let mean = sum / draws;
    let mut squares = 0.0;
    for (&v, &w) in values.iter().zip(weights) {
        let d = v - mean;
        squares += if w > 0.0 { w * d * d } else { 0.0 };
    }
    ((draws - 1.0) / draws * squares).sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The definition, term by term: (n-1)/n sum over draws of (v - mean)^2.
    fn by_definition(values: &[f64], weights: &[f64]) -> f64 {
        let n: f64 = weights.iter().sum();
        let mean = values.iter().zip(weights).map(|(v, w)| v * w).sum::<f64>() / n;
        let ss: f64 = values
            .iter()
            .zip(weights)
            .map(|(v, w)| w * (v - mean) * (v - mean))
            .sum();
        ((n - 1.0) / n * ss).sqrt()
    }

    #[test]
    fn equals_the_definition_however_far_from_zero() {
        let values = [0.3, -1.2, 2.5, 0.7, 0.0, 4.1];
        let weights = [1.0, 0.0, 2.0, 1.0, 3.0, 0.0];
        let want = by_definition(&values, &weights);
        for shift in [0.0, 1.0, -3.0, 1e6] {
            let moved: Vec<f64> = values.iter().map(|v| v + shift).collect();
            let got = jackknife_se(&moved, &weights, 1, 6).unwrap()[0];
            assert!((got - want).abs() <= 1e-9, "{shift}: {got} vs {want}");
        }
    }

    #[test]
    fn a_mean_gives_s_over_root_n() {
        // leave-one-out means of x: (sum - x_j) / (n - 1)
        let x = [1.0, 4.0, 2.0, 8.0, 5.0];
        let n = x.len() as f64;
        let sum: f64 = x.iter().sum();
        let loo: Vec<f64> = x.iter().map(|v| (sum - v) / (n - 1.0)).collect();
        let mean = sum / n;
        let s = (x.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / (n - 1.0)).sqrt();
        let got = jackknife_se(&loo, &[1.0; 5], 1, 5).unwrap()[0];
        assert!(
            (got - s / n.sqrt()).abs() < 1e-12,
            "{got} vs {}",
            s / n.sqrt()
        );
    }

    #[test]
    fn rows_are_independent_and_thread_count_free() {
        let (rows, n) = (1000, 37);
        let values: Vec<f64> = (0..rows * n)
            .map(|k| ((k * 7919) % 101) as f64 / 9.0)
            .collect();
        let weights: Vec<f64> = (0..rows * n).map(|k| ((k * 31) % 4) as f64).collect();
        let all = jackknife_se(&values, &weights, rows, n).unwrap();
        for i in [0, 63, 64, 500, 999] {
            let row = i * n..(i + 1) * n;
            let one = jackknife_se(&values[row.clone()], &weights[row], 1, n);
            assert_eq!(all[i].to_bits(), one.unwrap()[0].to_bits());
        }
    }

    #[test]
    fn nan_propagates_and_undrawn_documents_are_left_out() {
        let got = jackknife_se(&[1.0, f64::NAN, 3.0], &[1.0, 1.0, 1.0], 1, 3).unwrap();
        assert!(got[0].is_nan());
        let got = jackknife_se(&[1.0, f64::NAN, 3.0], &[1.0, 0.0, 1.0], 1, 3).unwrap();
        assert!((got[0] - by_definition(&[1.0, 3.0], &[1.0, 1.0])).abs() < 1e-12);
        let none = jackknife_se(&[1.0, 2.0], &[0.0, 0.0], 1, 2).unwrap();
        assert!(none[0].is_nan());
        // one draw: no spread
        assert_eq!(jackknife_se(&[5.0], &[1.0], 1, 1).unwrap()[0], 0.0);
    }

    #[test]
    fn shapes_that_do_not_fit_are_refused() {
        assert!(matches!(
            jackknife_se(&[1.0, 2.0], &[1.0], 1, 2),
            Err(KvError::Shape(_))
        ));
        assert!(matches!(
            jackknife_se(&[1.0, 2.0], &[1.0, 1.0], 2, 2),
            Err(KvError::Shape(_))
        ));
    }
}
