//! The scoreboard's path steps of a batch of (document, policy) units in one pass: a step
//! counts where its token was generated (`token >= 0`) and its value is finite; per unit, the
//! count, the sum and the sum of squares of its steps (summed in step order), and per
//! policy its steps' values laid end to end in document order (the pooled percentiles).
//! `segment_sums` gives the same sums of steps already laid end to end, so that a document
//! folded alone and one folded in a batch get the same doubles.

use crate::error::{KvError, KvResult};
use crate::stats::units::StoredFloat;

/// The steps of a batch: `units = documents x policies`, unit `(d, p)` at `d * policies + p`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PathSteps {
    /// Steps that count, per unit.
    pub sizes: Vec<i64>,
    /// Sum of the values of those steps, per unit.
    pub sums: Vec<f64>,
    /// Sum of their squares, per unit.
    pub squares: Vec<f64>,
    /// Steps whose flag is set (top-1 agreement), per unit; empty without flags.
    pub flagged: Vec<f64>,
    /// Per policy, the counted steps' values, document after document, as float32 (the
    /// precision the pooled percentiles keep; the sums above are of the values given).
    pub values: Vec<Vec<f32>>,
    /// Per policy, the counted steps' flags, in the same order; empty without flags.
    pub flags: Vec<Vec<bool>>,
}

/// The path steps of `documents x policies` units of `steps` steps each (`values`, `tokens`
/// and `flags`: documents x policies x steps, C order; `values` float32 as stored, or
/// float64: the same sums, each value taken as a double).
pub fn path_steps<F: StoredFloat>(
    values: &[F],
    tokens: &[i32],
    flags: Option<&[bool]>,
    documents: usize,
    policies: usize,
    steps: usize,
) -> KvResult<PathSteps> {
    let n = documents * policies * steps;
    let mut sizes = [("values", values.len()), ("tokens", tokens.len())].to_vec();
    if let Some(f) = flags {
        sizes.push(("flags", f.len()));
    }
    for (name, got) in sizes {
        if got != n {
            return Err(KvError::Shape(format!(
                "{name} has {got} entries, {documents} documents x {policies} policies x \
                 {steps} steps need {n}"
            )));
        }
    }
    let units = documents * policies;
    let mut out = PathSteps {
        sizes: vec![0; units],
        sums: vec![0.0; units],
        squares: vec![0.0; units],
        flagged: if flags.is_some() {
            vec![0.0; units]
        } else {
            Vec::new()
        },
        values: vec![Vec::new(); policies],
        flags: vec![Vec::new(); if flags.is_some() { policies } else { 0 }],
    };
    for p in 0..policies {
        // Branch-free compaction: every step is written, the cursor moves past the kept ones
        // (a skipped step adds +0.0 to the sums: the same doubles as skipping it).
        let (kept, kept_flags) = (&mut out.values[p], &mut out.flags);
        kept.resize(documents * steps, 0.0);
        let mut flag_buf = vec![
            false;
            if flags.is_some() {
                documents * steps
            } else {
                0
            }
        ];
        let mut k = 0usize;
        for d in 0..documents {
            let unit = d * policies + p;
            let (mut size, mut sum, mut square, mut flagged) = (0i64, 0.0f64, 0.0f64, 0.0f64);
            for i in unit * steps..(unit + 1) * steps {
                let v: f64 = values[i].into();
                let keep = tokens[i] >= 0 && v.is_finite();
                let x = if keep { v } else { 0.0 };
                kept[k] = v as f32;
                if let Some(f) = flags {
                    flag_buf[k] = f[i];
                    flagged += f64::from(u8::from(keep && f[i]));
                }
                k += usize::from(keep);
                size += i64::from(keep);
                sum += x;
                square += x * x;
            }
            out.sizes[unit] = size;
            out.sums[unit] = sum;
            out.squares[unit] = square;
            if flags.is_some() {
                out.flagged[unit] = flagged;
            }
        }
        kept.truncate(k);
        if flags.is_some() {
            flag_buf.truncate(k);
            kept_flags[p] = flag_buf;
        }
    }
    Ok(out)
}

/// Each segment's sum and sum of squares (in order, in f64) of `values` laid end to end in
/// segments of `sizes`, as [`path_steps`] sums a unit's steps.
pub fn segment_sums(values: &[f64], sizes: &[i64]) -> KvResult<(Vec<f64>, Vec<f64>)> {
    let total: i64 = sizes.iter().sum();
    if sizes.iter().any(|&s| s < 0) || total != values.len() as i64 {
        return Err(KvError::Shape(format!(
            "segments of {total} values (sizes {} long, none negative) over {} values",
            sizes.len(),
            values.len()
        )));
    }
    let (mut sums, mut squares) = (Vec::with_capacity(sizes.len()), Vec::new());
    squares.reserve(sizes.len());
    let mut at = 0usize;
    for &s in sizes {
        let part = &values[at..at + s as usize];
        let (mut sum, mut square) = (0.0f64, 0.0f64);
        for &x in part {
            sum += x;
            square += x * x;
        }
        sums.push(sum);
        squares.push(square);
        at += s as usize;
    }
    Ok((sums, squares))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_generated_finite_steps_per_unit_and_pools_them_per_policy() {
        // 2 documents x 2 policies x 3 steps.
        let values = [
            1.0,
            2.0,
            f64::NAN, // d0 p0: NaN not counted
            0.5,
            0.5,
            0.5, // d0 p1
            3.0,
            -1.0,
            4.0, // d1 p0: the second step not generated
            f64::INFINITY,
            0.25,
            0.0, // d1 p1: inf not counted
        ];
        let tokens = [1, 2, 3, 1, 1, 1, 5, -1, 6, 1, 1, 1];
        let flags = [
            true, false, true, true, true, false, false, true, true, true, true, false,
        ];
        let got = path_steps(&values, &tokens, Some(&flags), 2, 2, 3).unwrap();
        assert_eq!(got.sizes, vec![2, 3, 2, 2]);
        assert_eq!(got.sums, vec![3.0, 1.5, 7.0, 0.25]);
        assert_eq!(got.squares, vec![5.0, 0.75, 25.0, 0.0625]);
        assert_eq!(got.flagged, vec![1.0, 2.0, 1.0, 1.0]);
        assert_eq!(
            got.values,
            vec![vec![1.0, 2.0, 3.0, 4.0], vec![0.5, 0.5, 0.5, 0.25, 0.0]]
        );
        assert_eq!(
            got.flags,
            vec![
                vec![true, false, false, true],
                vec![true, true, false, true, false]
            ]
        );
        let (sums, squares) = segment_sums(&[1.0, 2.0, 3.0, 4.0, 0.5], &[2, 0, 2, 1]).unwrap();
        assert_eq!(sums, vec![3.0, 0.0, 7.0, 0.5]);
        assert_eq!(squares, vec![5.0, 0.0, 25.0, 0.25]);
        let none = path_steps(&values, &tokens, None, 2, 2, 3).unwrap();
        assert!(none.flagged.is_empty() && none.flags.is_empty());
        assert_eq!(none.values, got.values);
        // Stored float32 values: the same steps and sums as their doubles given.
        let narrow: Vec<f32> = values.iter().map(|&v| v as f32).collect();
        let wide: Vec<f64> = narrow.iter().map(|&v| f64::from(v)).collect();
        assert_eq!(
            path_steps(&narrow, &tokens, Some(&flags), 2, 2, 3).unwrap(),
            path_steps(&wide, &tokens, Some(&flags), 2, 2, 3).unwrap()
        );
    }

    #[test]
    fn shapes_are_checked() {
        assert!(path_steps(&[1.0f64; 5], &[1; 6], None, 1, 2, 3).is_err());
        assert!(path_steps(&[1.0f64; 6], &[1; 6], Some(&[true; 5]), 1, 2, 3).is_err());
        assert!(segment_sums(&[1.0, 2.0], &[1, 2]).is_err());
        assert!(segment_sums(&[1.0, 2.0], &[3, -1]).is_err());
    }
}
