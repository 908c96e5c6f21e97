//! Whether stored rows are distributions: every row must be all NaN (never recorded) or
//! finite, >= 0 and sum to 1 within a tolerance. The same rule as the Python reader's
//! `distribution_problems`, for the store engine.

use rayon::prelude::*;

use crate::error::{KvError, KvResult};
use crate::half::{sum_f16, BLOCK};
use crate::parallel;
use crate::rows::Rows;

/// Why a stored distribution row is not one (see [`row_check`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RowViolation {
    /// Entry `col` of `row` is NaN, infinite or negative in a row that is not all NaN.
    Entry { row: usize, col: usize, value: f64 },
    /// The entries of `row` are finite and >= 0 but sum to `sum`, not 1 within the tolerance.
    Sum { row: usize, sum: f64 },
}

/// The first row (in row order) of `rows x vocab` that is not a stored distribution (the
/// caller derives `tolerance` from the storage format;
/// `kvcouple.store.schema.row_sum_tolerance`).
pub fn row_check(
    p: Rows,
    rows: usize,
    vocab: usize,
    tolerance: f64,
) -> KvResult<Option<RowViolation>> {
    if vocab == 0 || p.len() != rows * vocab {
        return Err(KvError::Shape(format!(
            "row_check: {} elements for {rows} rows of {vocab}",
            p.len()
        )));
    }
    Ok(parallel::install(|| {
        (0..rows)
            .into_par_iter()
            .with_min_len(4)
            .map(|r| check_one_row(&p, r, vocab, tolerance))
            .find_first(|v| v.is_some())
            .flatten()
    }))
}

/// Why row `r` is not a distribution, or None.
pub(crate) fn check_one_row(
    p: &Rows,
    r: usize,
    vocab: usize,
    tolerance: f64,
) -> Option<RowViolation> {
    let base = r * vocab;
    let (sum, nans, first_bad) = match p {
        Rows::F16(a) => sum_f16(&a[base..base + vocab]),
        _ => {
            let mut buf = [0.0f64; BLOCK];
            let (mut sum, mut nans, mut first_bad) = (0.0f64, 0usize, None);
            let mut start = 0;
            while start < vocab {
                let n = BLOCK.min(vocab - start);
                p.load(base + start, &mut buf[..n]);
                for (j, &x) in buf[..n].iter().enumerate() {
                    nans += x.is_nan() as usize;
                    if first_bad.is_none() && (!x.is_finite() || x < 0.0) {
                        first_bad = Some(start + j);
                    }
                    sum += x;
                }
                start += n;
            }
            (sum, nans, first_bad)
        }
    };
    if nans == vocab {
        return None; // never recorded
    }
    if let Some(col) = first_bad {
        let value = match p {
            // The half table holds finite values only: name NaN and infinities by their bits.
            Rows::F16(a) if a[base + col] & 0x7c00 == 0x7c00 => {
                let h = a[base + col];
                if h & 0x03ff != 0 {
                    f64::NAN
                } else if h & 0x8000 != 0 {
                    f64::NEG_INFINITY
                } else {
                    f64::INFINITY
                }
            }
            _ => p.get(base + col),
        };
        return Some(RowViolation::Entry { row: r, col, value });
    }
    if (sum - 1.0).abs() > tolerance {
        return Some(RowViolation::Sum { row: r, sum });
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_check_accepts_distributions_and_unrecorded_rows() {
        // 0x3800 = 0.5, 0x3400 = 0.25, 0x7e00 = NaN, 0xb400 = -0.25, 0x8000 = -0.
        let ok = [
            0x3800u16, 0x3400, 0x3400, 0x8000, 0x7e00, 0x7e00, 0x7e00, 0x7e00,
        ];
        assert_eq!(row_check(Rows::F16(&ok), 2, 4, 1e-3).unwrap(), None);
        let nan = [0x3800u16, 0x3400, 0x7e00, 0x3400];
        assert!(matches!(
            row_check(Rows::F16(&nan), 1, 4, 1e-3).unwrap(),
            Some(RowViolation::Entry { row: 0, col: 2, value }) if value.is_nan()
        ));
        let neg = [0x3800u16, 0x3800, 0x3400, 0xb400, 0x3800, 0x3400, 0x3400, 0];
        assert_eq!(
            row_check(Rows::F16(&neg), 2, 4, 1e-3).unwrap(),
            Some(RowViolation::Entry {
                row: 0,
                col: 3,
                value: -0.25
            })
        );
        let short = [0x3800u16, 0x3400, 0, 0, 0x3800, 0x3800, 0, 0];
        assert_eq!(
            row_check(Rows::F16(&short), 2, 4, 1e-3).unwrap(),
            Some(RowViolation::Sum { row: 0, sum: 0.75 })
        );
        let f64_rows = [0.5, 0.5, 0.25, 0.7];
        assert!(matches!(
            row_check(Rows::F64(&f64_rows), 2, 2, 1e-3).unwrap(),
            Some(RowViolation::Sum { row: 1, .. })
        ));
        assert!(row_check(Rows::F64(&f64_rows), 3, 2, 1e-3).is_err());
    }
}
