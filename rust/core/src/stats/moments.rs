//! Resample moments for the studentized bootstrap at any number of documents.
//!
//! The studentized interval needs, for every resample, the standard error of each statistic
//! within that resample. Every statistic is a smooth function of column means, so its standard
//! error is the delta method's `sqrt(grad' S grad / (n - 1))` with `S` the resample's covariance
//! of the columns the statistic reads (for a mean it is exactly the jackknife's `s / sqrt(n)`).
//! That needs only the resample means of the columns and of the products of the column pairs
//! the statistics read: [`bootstrap_moments`] computes both from the same draws as
//! [`super::bootstrap::bootstrap_means`], in memory independent of resamples x documents
//! (a block of replicates' draw counts and accumulators per task).

use rayon::prelude::*;

use crate::error::{KvError, KvResult};
use crate::parallel;

use super::bootstrap::{bootstrap_counts_into, bootstrap_counts_narrow, check_table};

/// Replicates per task: their draw counts (`REPS x docs`) and accumulators are the task's
/// memory, and every pass over the table serves all of them.
const REPS: usize = 128;

/// Documents per tile: a tile's rows (`TILE x width`) and the replicates' counts of them are
/// multiplied as one matrix product, the counts (`REPS x TILE`) by the rows.
const TILE: usize = 512;

/// Means over the `n_boot` resamples (the draws of [`super::bootstrap::bootstrap_means`] with
/// the same `seed`) of the products `(x_j - c_j)(x_l - c_l)` of the columns of `values`
/// (`docs x cols`, row-major) for each `(j, l)` of `pairs` (`c` = `centers`, so that
/// covariances do not cancel). Entries where either value is not finite are left out; a mean
/// without any finite entry is NaN. Returns `n_boot x pairs`, row-major.
pub fn bootstrap_moments(
    values: &[f64],
    docs: usize,
    cols: usize,
    centers: &[f64],
    pairs: &[(usize, usize)],
    n_boot: usize,
    seed: u64,
) -> KvResult<Vec<f64>> {
    check_table(docs, cols)?;
    if values.len() != docs * cols || centers.len() != cols {
        return Err(KvError::Shape(format!(
            "values has {} elements and centers {}, expected {docs} x {cols} and {cols}",
            values.len(),
            centers.len()
        )));
    }
    if let Some(&(j, l)) = pairs.iter().find(|&&(j, l)| j >= cols || l >= cols) {
        return Err(KvError::Shape(format!(
            "pair ({j}, {l}) names a column beyond the {cols} columns"
        )));
    }
    if n_boot == 0 {
        return Err(KvError::InvalidArgument("n_boot must be at least 1".into()));
    }
    let np = pairs.len();
    if np == 0 {
        return Ok(Vec::new());
    }
    // Products of the pairs, document by document (NaN where either value is not finite).
    Ok(blocked_means(docs, np, n_boot, seed, |d, out| {
        let row = &values[d * cols..(d + 1) * cols];
        for (p, &(j, l)) in out.iter_mut().zip(pairs) {
            let v = (row[j] - centers[j]) * (row[l] - centers[l]);
            *p = if v.is_finite() { v } else { f64::NAN };
        }
    }))
}

/// Means over the `n_boot` resamples (the draws of replicate `b` under `seed`) of rows that
/// `fill(d, row)` writes for document `d` (`width` values; NaN: left out of that column's
/// mean). Returns `n_boot x width`, row-major; a mean without any entry is NaN.
///
/// Replicates go in blocks of [`REPS`] (one task each): a block's draw counts are made once,
/// then the documents go by tiles of [`TILE`], and each tile's rows are added to every
/// replicate of the block, weighted by its counts, as one register-blocked matrix product
/// (`matrixmultiply`'s dgemm; a second one counts the draws of NaN entries where a tile has
/// any). Memory per task is the block's counts, one tile and the accumulators, whatever
/// `n_boot`; each replicate's sums are taken in the same order whatever the thread count.
pub(crate) fn blocked_means<F>(
    docs: usize,
    width: usize,
    n_boot: usize,
    seed: u64,
    fill: F,
) -> Vec<f64>
where
    F: Fn(usize, &mut [f64]) + Sync,
{
    let mut out = vec![0.0; n_boot * width];
    if width == 0 {
        return out;
    }
    parallel::install(|| {
        out.par_chunks_mut(REPS * width)
            .enumerate()
            .for_each(|(block, out)| block_means(docs, width, seed, block, out, &fill))
    });
    out
}

/// One block of replicates of [`blocked_means`]: `out` holds its `reps x width` means.
fn block_means<F>(docs: usize, width: usize, seed: u64, block: usize, out: &mut [f64], fill: &F)
where
    F: Fn(usize, &mut [f64]),
{
    let reps = out.len() / width;
    let counts = Counts::draw(seed, block * REPS, reps, docs, u16::MAX);
    let mut weights = vec![0.0f64; reps * TILE]; // the tile's counts, reps x tile
    let mut rows = vec![0.0f64; TILE * width]; // the tile's rows, NaN as 0
    let mut missing = vec![0.0f64; TILE * width]; // 1 where the entry is NaN
    let mut left_out = vec![0.0f64; reps * width]; // draws of NaN entries
    for start in (0..docs).step_by(TILE) {
        let n = TILE.min(docs - start);
        let mut any_nan = false;
        for (i, d) in (start..start + n).enumerate() {
            let row = &mut rows[i * width..(i + 1) * width];
            fill(d, row);
            let gone = &mut missing[i * width..(i + 1) * width];
            for (v, m) in row.iter_mut().zip(gone.iter_mut()) {
                let nan = v.is_nan();
                any_nan |= nan;
                *m = if nan { 1.0 } else { 0.0 };
                if nan {
                    *v = 0.0;
                }
            }
        }
        for (r, w) in weights.chunks_mut(n).take(reps).enumerate() {
            counts.weights(r * docs + start, w);
        }
        gemm_add(
            reps,
            n,
            width,
            &weights[..reps * n],
            &rows[..n * width],
            out,
        );
        if any_nan {
            gemm_add(
                reps,
                n,
                width,
                &weights[..reps * n],
                &missing[..n * width],
                &mut left_out,
            );
        }
    }
    for (a, &gone) in out.iter_mut().zip(&left_out) {
        let drawn = docs as f64 - gone;
        *a = if drawn > 0.0 { *a / drawn } else { f64::NAN };
    }
}

/// A block's draw counts, replicate-major (`reps x docs`): two bytes a count, the block's
/// memory at 100k documents 25 MB; four where a count passes `narrow` (a document drawn
/// 65,536 times in one resample: possible, never seen).
enum Counts {
    Narrow(Vec<u16>),
    Wide(Vec<u32>),
}

impl Counts {
    fn draw(seed: u64, first: usize, reps: usize, docs: usize, narrow: u16) -> Self {
        let mut out = vec![0u16; reps * docs];
        for (r, kept) in out.chunks_mut(docs).enumerate() {
            if !bootstrap_counts_narrow(seed, first + r, kept, narrow) {
                let mut wide = vec![0u32; reps * docs];
                for (r, kept) in wide.chunks_mut(docs).enumerate() {
                    bootstrap_counts_into(seed, first + r, kept);
                }
                return Counts::Wide(wide);
            }
        }
        Counts::Narrow(out)
    }

    /// The counts from `at` on (replicate-major position), as weights.
    fn weights(&self, at: usize, out: &mut [f64]) {
        let n = out.len();
        match self {
            Counts::Narrow(c) => out.iter_mut().zip(&c[at..at + n]).for_each(|(w, &c)| {
                *w = c as f64;
            }),
            Counts::Wide(c) => out.iter_mut().zip(&c[at..at + n]).for_each(|(w, &c)| {
                *w = c as f64;
            }),
        }
    }
}

/// `c += a b` for row-major `a` (`m x k`), `b` (`k x n`) and `c` (`m x n`).
fn gemm_add(m: usize, k: usize, n: usize, a: &[f64], b: &[f64], c: &mut [f64]) {
    assert!(a.len() == m * k && b.len() == k * n && c.len() == m * n);
    // SAFETY: the slices hold exactly the m x k, k x n and m x n row-major matrices the
    // strides describe (asserted above), and `c` does not alias `a` or `b` (it is `&mut`).
    unsafe {
        matrixmultiply::dgemm(
            m,
            k,
            n,
            1.0,
            a.as_ptr(),
            k as isize,
            1,
            b.as_ptr(),
            n as isize,
            1,
            1.0,
            c.as_mut_ptr(),
            n as isize,
            1,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::super::bootstrap::bootstrap_counts;
    use super::*;

    fn table(docs: usize, cols: usize) -> Vec<f64> {
        (0..docs * cols)
            .map(|i| 3.0 + (i as f64 * 0.37).sin())
            .collect()
    }

    #[test]
    fn cross_moments_are_their_definition_over_the_bootstrap_draws() {
        let (docs, cols, n_boot) = (13usize, 3usize, 41usize);
        let values = table(docs, cols);
        let centers = [3.0, 2.5, 0.0];
        let pairs = [(0, 0), (0, 1), (2, 1)];
        let c = bootstrap_moments(&values, docs, cols, &centers, &pairs, n_boot, 5).unwrap();
        let counts = bootstrap_counts(docs, n_boot, 5).unwrap();
        for b in 0..n_boot {
            for (q, &(j, l)) in pairs.iter().enumerate() {
                let s: f64 = (0..docs)
                    .map(|d| {
                        let x = values[d * cols + j] - centers[j];
                        let y = values[d * cols + l] - centers[l];
                        counts[b * docs + d] as f64 * x * y
                    })
                    .sum::<f64>()
                    / docs as f64;
                assert!((c[b * 3 + q] - s).abs() < 1e-12, "{b} {q}");
            }
        }
    }

    #[test]
    fn non_finite_entries_are_left_out_and_threads_do_not_matter() {
        let (docs, cols) = (9usize, 2usize);
        let mut values = table(docs, cols);
        values[2] = f64::NAN; // document 1, column 0
        let pairs = [(0, 1), (1, 1), (0, 0)];
        let c = bootstrap_moments(&values, docs, cols, &[0.0, 0.0], &pairs, 37, 2).unwrap();
        crate::parallel::set_num_threads(1).unwrap();
        let again = bootstrap_moments(&values, docs, cols, &[0.0, 0.0], &pairs, 37, 2).unwrap();
        crate::parallel::set_num_threads(0).unwrap();
        assert_eq!(c, again);
        assert!(c.iter().all(|v| v.is_finite()));
        // Column 0 without document 1: its draws are left out of the count too.
        let counts = bootstrap_counts(docs, 37, 2).unwrap();
        let (num, den) = (0..docs).filter(|&d| d != 1).fold((0.0, 0.0), |(s, n), d| {
            let w = counts[d] as f64;
            (s + w * values[d * cols] * values[d * cols], n + w)
        });
        assert!((c[2] - num / den).abs() < 1e-12);
    }

    #[test]
    fn means_across_tiles_and_blocks_are_their_definition() {
        // Documents over several tiles (the last partial), replicates over several blocks,
        // NaN entries in some tiles only.
        let (docs, cols, n_boot) = (TILE * 2 + 37, 3usize, REPS * 2 + 5);
        let mut values = table(docs, cols);
        for d in (0..docs).step_by(97) {
            values[d * cols + d % cols] = f64::NAN;
        }
        let pairs = [(0, 0), (0, 1), (1, 2), (2, 2)];
        let c = bootstrap_moments(&values, docs, cols, &[3.0; 3], &pairs, n_boot, 11).unwrap();
        let counts = bootstrap_counts(docs, n_boot, 11).unwrap();
        for b in 0..n_boot {
            for (q, &(j, l)) in pairs.iter().enumerate() {
                let (mut num, mut den) = (0.0, 0.0);
                for d in 0..docs {
                    let v = (values[d * cols + j] - 3.0) * (values[d * cols + l] - 3.0);
                    if v.is_finite() {
                        num += counts[b * docs + d] as f64 * v;
                        den += counts[b * docs + d] as f64;
                    }
                }
                let got = c[b * pairs.len() + q];
                assert!(
                    (got - num / den).abs() < 1e-12,
                    "{b} {q}: {got} {}",
                    num / den
                );
            }
        }
    }

    #[test]
    fn wide_counts_are_the_narrow_ones() {
        let (docs, reps) = (300usize, 5usize);
        let narrow = Counts::draw(4, 7, reps, docs, u16::MAX);
        let wide = Counts::draw(4, 7, reps, docs, 1); // every block with a 2 goes wide
        assert!(matches!(narrow, Counts::Narrow(_)) && matches!(wide, Counts::Wide(_)));
        let (mut a, mut b) = (vec![0.0; reps * docs], vec![0.0; reps * docs]);
        narrow.weights(0, &mut a);
        wide.weights(0, &mut b);
        assert_eq!(a, b);
        let want = bootstrap_counts(docs, 7 + reps, 4).unwrap();
        let want: Vec<f64> = want[7 * docs..].iter().map(|&c| c as f64).collect();
        assert_eq!(a, want);
    }

    #[test]
    fn bad_shapes_are_errors() {
        let v = table(3, 2);
        assert!(bootstrap_moments(&v, 3, 2, &[0.0], &[], 5, 0).is_err());
        assert!(bootstrap_moments(&v, 3, 2, &[0.0, 0.0], &[(0, 2)], 5, 0).is_err());
        assert!(bootstrap_moments(&v, 3, 2, &[0.0, 0.0], &[], 0, 0).is_err());
        assert!(bootstrap_moments(&[], 0, 2, &[0.0, 0.0], &[], 5, 0).is_err());
    }
}
