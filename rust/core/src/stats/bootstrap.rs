//! Document-level bootstrap of column means.
//!
//! Every statistic the analysis reports across documents is a function of column means of a
//! `(docs, cols)` table (ratios such as the aggregate post-divergence rate are ratios of means),
//! so one resample of documents gives every statistic's replicate at once, and all columns of
//! a replicate see the same documents (paired differences stay paired).
//!
//! Replicate `b` draws its documents from its own SplitMix64 stream seeded by `(seed, b)`, so
//! the output is identical whatever the thread count. NaN entries (a quantity undefined for a
//! document, e.g. the median divergence time of a document that never diverges) are left out
//! of that column's mean; a replicate whose column has no finite entry gets NaN.

use rayon::prelude::*;

use crate::error::{KvError, KvResult};
use crate::parallel;

/// SplitMix64: tiny, fast, and plenty for drawing document indices.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// The stream of replicate `index` under `seed`.
    pub fn stream(seed: u64, index: u64) -> Self {
        let mut s = SplitMix64(seed ^ 0x5851_F42D_4C95_7F2D);
        let mixed = s.next_u64() ^ index.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        SplitMix64(mixed)
    }

    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A uniform index in `0..n` (n > 0) by Lemire's multiply-shift (bias < n / 2^64).
    #[inline]
    pub fn below(&mut self, n: usize) -> usize {
        ((self.next_u64() as u128 * n as u128) >> 64) as usize
    }
}

/// The documents replicate `b` draws, in order: the one definition of a resample.
fn draws(seed: u64, b: usize, docs: usize) -> impl Iterator<Item = usize> {
    let mut rng = SplitMix64::stream(seed, b as u64);
    (0..docs).map(move |_| rng.below(docs))
}

/// How many times each document is drawn in each of `n_boot` resamples (`n_boot x docs`,
/// row-major): the resamples of [`bootstrap_means`] with the same `seed`. The studentized
/// interval needs them to recompute a jackknife inside every resample.
pub fn bootstrap_counts(docs: usize, n_boot: usize, seed: u64) -> KvResult<Vec<u32>> {
    if docs == 0 {
        return Err(KvError::Shape(
            "bootstrap needs at least one document, got 0".into(),
        ));
    }
    if n_boot == 0 {
        return Err(KvError::InvalidArgument("n_boot must be at least 1".into()));
    }
    let mut out = vec![0u32; n_boot * docs];
    parallel::install(|| {
        out.par_chunks_mut(docs)
            .enumerate()
            .for_each(|(b, row)| bootstrap_counts_into(seed, b, row))
    });
    Ok(out)
}

/// Adds replicate `b`'s draw counts to `row` (one entry per document).
pub(crate) fn bootstrap_counts_into(seed: u64, b: usize, row: &mut [u32]) {
    for d in draws(seed, b, row.len()) {
        row[d] += 1;
    }
}

/// Adds replicate `b`'s draw counts to `row` in two bytes a count; false (the row then
/// partly counted) where a count would pass `limit` (at most `u16::MAX`).
pub(crate) fn bootstrap_counts_narrow(seed: u64, b: usize, row: &mut [u16], limit: u16) -> bool {
    for d in draws(seed, b, row.len()) {
        let c = &mut row[d];
        if *c >= limit {
            return false;
        }
        *c += 1;
    }
    true
}

/// A `docs x cols` table to resample has at least one of each.
pub(crate) fn check_table(docs: usize, cols: usize) -> KvResult<()> {
    if docs == 0 || cols == 0 {
        return Err(KvError::Shape(format!(
            "bootstrap needs at least one document and one column, got {docs} x {cols}"
        )));
    }
    Ok(())
}

/// Column means of `n_boot` bootstrap resamples of the rows of `values` (`docs x cols`,
/// row-major). Returns `n_boot x cols`, row-major.
pub fn bootstrap_means(
    values: &[f64],
    docs: usize,
    cols: usize,
    n_boot: usize,
    seed: u64,
) -> KvResult<Vec<f64>> {
    check_table(docs, cols)?;
    if values.len() != docs * cols {
        return Err(KvError::Shape(format!(
            "values has {} elements, expected {docs} x {cols}",
            values.len()
        )));
    }
    if n_boot == 0 {
        return Err(KvError::InvalidArgument("n_boot must be at least 1".into()));
    }
    // Non-finite entries are left out of their column's mean.
    Ok(super::moments::blocked_means(
        docs,
        cols,
        n_boot,
        seed,
        |d, out| {
            for (o, &v) in out.iter_mut().zip(&values[d * cols..(d + 1) * cols]) {
                *o = if v.is_finite() { v } else { f64::NAN };
            }
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replicates_do_not_depend_on_threads() {
        let values: Vec<f64> = (0..200).map(|i| (i as f64).sin()).collect();
        let a = bootstrap_means(&values, 50, 4, 64, 7).unwrap();
        crate::parallel::set_num_threads(1).unwrap();
        let b = bootstrap_means(&values, 50, 4, 64, 7).unwrap();
        crate::parallel::set_num_threads(0).unwrap();
        assert_eq!(a, b);
        let c = bootstrap_means(&values, 50, 4, 64, 8).unwrap();
        assert_ne!(a, c);
    }

    #[test]
    fn bootstrap_mean_is_near_sample_mean_and_nan_is_skipped() {
        let docs = 400;
        let values: Vec<f64> = (0..docs)
            .flat_map(|i| {
                let x = (i % 10) as f64;
                [x, if i % 2 == 0 { f64::NAN } else { 1.0 }]
            })
            .collect();
        let out = bootstrap_means(&values, docs, 2, 500, 1).unwrap();
        let mean0: f64 = out.chunks(2).map(|r| r[0]).sum::<f64>() / 500.0;
        assert!((mean0 - 4.5).abs() < 0.05, "{mean0}");
        assert!(out.chunks(2).all(|r| r[1] == 1.0));
    }

    #[test]
    fn counts_are_the_resamples_of_the_means() {
        let (docs, cols, n_boot) = (7usize, 3usize, 50usize);
        let values: Vec<f64> = (0..docs * cols).map(|i| (i as f64 * 0.7).cos()).collect();
        let means = bootstrap_means(&values, docs, cols, n_boot, 11).unwrap();
        let counts = bootstrap_counts(docs, n_boot, 11).unwrap();
        for b in 0..n_boot {
            let row = &counts[b * docs..(b + 1) * docs];
            assert_eq!(row.iter().sum::<u32>() as usize, docs);
            for c in 0..cols {
                let m: f64 = (0..docs)
                    .map(|d| row[d] as f64 * values[d * cols + c])
                    .sum::<f64>()
                    / docs as f64;
                assert!((m - means[b * cols + c]).abs() < 1e-12, "{b} {c}");
            }
        }
        assert_ne!(counts, bootstrap_counts(docs, n_boot, 12).unwrap());
        assert!(bootstrap_counts(0, 5, 0).is_err());
        assert!(bootstrap_counts(3, 0, 0).is_err());
    }

    #[test]
    fn bad_shapes_are_errors() {
        assert!(bootstrap_means(&[1.0, 2.0], 3, 1, 10, 0).is_err());
        assert!(bootstrap_means(&[], 0, 1, 10, 0).is_err());
        assert!(bootstrap_means(&[1.0], 1, 1, 0, 0).is_err());
    }

    #[test]
    fn one_document_returns_its_own_values() {
        let values = [3.5, -2.0, f64::NAN, 0.0];
        let out = bootstrap_means(&values, 1, 4, 50, 9).unwrap();
        assert_eq!(out.len(), 50 * 4);
        for r in out.chunks(4) {
            assert_eq!(&r[..2], &values[..2]);
            assert!(r[2].is_nan());
            assert_eq!(r[3], 0.0);
        }
    }

    #[test]
    fn every_replicate_draws_n_documents() {
        // Column 0 counts the draws of document 0 (in units of 1/n), column 1 is constant:
        // n draws make every replicate of column 0 a multiple of 1/n.
        for docs in [2usize, 3, 7] {
            let values: Vec<f64> = (0..docs)
                .flat_map(|d| [if d == 0 { 1.0 } else { 0.0 }, 5.0])
                .collect();
            let out = bootstrap_means(&values, docs, 2, 400, 4).unwrap();
            let mut draws_of_doc0 = 0.0;
            for r in out.chunks(2) {
                let k = r[0] * docs as f64;
                assert!((k - k.round()).abs() < 1e-9, "{docs} docs: {}", r[0]);
                assert_eq!(r[1], 5.0);
                draws_of_doc0 += k.round();
            }
            // Each draw picks document 0 with probability 1/n: about 400 draws in all.
            let sd = (400.0 * docs as f64 * (1.0 / docs as f64) * (1.0 - 1.0 / docs as f64)).sqrt();
            assert!(
                (draws_of_doc0 - 400.0).abs() < 5.0 * sd,
                "{docs}: {draws_of_doc0}"
            );
        }
    }

    #[test]
    fn spread_of_the_mean_is_sd_over_sqrt_n() {
        // The bootstrap law of the mean of n documents has variance s^2 / n, s^2 the
        // population variance of the documents (ddof 0).
        let values = [0.0, 1.0, 2.0, 3.0, 10.0];
        let n = values.len() as f64;
        let mean = values.iter().sum::<f64>() / n;
        let s2 = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n;
        let boots = 40_000;
        let out = bootstrap_means(&values, values.len(), 1, boots, 21).unwrap();
        let b = boots as f64;
        let m = out.iter().sum::<f64>() / b;
        let var = out.iter().map(|v| (v - m).powi(2)).sum::<f64>() / (b - 1.0);
        let want = s2 / n;
        // Monte Carlo error: the mean within 5 SE; the variance within 5 of its SE, from the
        // fourth central moment of the replicates (about 1.5% here; n - 1 draws give +25%).
        assert!((m - mean).abs() < 5.0 * (want / b).sqrt(), "{m} vs {mean}");
        let m4 = out.iter().map(|v| (v - m).powi(4)).sum::<f64>() / b;
        let var_se = ((m4 - var * var) / b).sqrt();
        assert!(
            (var - want).abs() < 5.0 * var_se,
            "{var} vs {want} (se {var_se})"
        );
        assert!(
            5.0 * var_se < 0.1 * want,
            "the check must tell n from n - 1"
        );
    }

    #[test]
    fn splitmix64_matches_the_reference_generator() {
        // The first outputs of Vigna's splitmix64.c from state 0.
        let mut r = SplitMix64(0);
        let got = [r.next_u64(), r.next_u64(), r.next_u64()];
        assert_eq!(
            got,
            [0xe220a8397b1dcdaf, 0x6e789e6aa1b965f4, 0x06c45d188009454f]
        );
    }

    #[test]
    fn seeds_and_replicates_get_distinct_streams() {
        // Seeding must not merge streams: every (seed, replicate) pair starts differently.
        let mut firsts = std::collections::HashSet::new();
        for seed in 0..64u64 {
            for index in 0..64u64 {
                let first = SplitMix64::stream(seed, index).next_u64();
                assert!(firsts.insert(first), "seed {seed}, replicate {index}");
            }
        }
    }

    #[test]
    fn indices_are_uniform() {
        let mut r = SplitMix64::stream(3, 0);
        let mut counts = [0usize; 5];
        for _ in 0..50_000 {
            counts[r.below(5)] += 1;
        }
        assert!(counts.iter().all(|&c| (c as f64 - 10_000.0).abs() < 500.0));
    }
}
