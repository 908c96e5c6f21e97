//! Borrowed views of `(rows, vocab)` matrices in the floating formats a model emits.
//!
//! Half formats are passed as raw `u16` bits: numpy has no bfloat16, so Python hands over a
//! `uint16` view plus a dtype flag; [`crate::half`] widens them.

use crate::error::{KvError, KvResult};
use crate::half::{bf16_nonfinite, bf16_to_f64, f16_nonfinite, f16_to_f64, widen_f16};

/// The element format of a row matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dtype {
    F16,
    BF16,
    F32,
    F64,
}

/// A row-major matrix borrowed from the caller (numpy memory, no copy).
#[derive(Debug, Clone, Copy)]
pub enum Rows<'a> {
    F16(&'a [u16]),
    BF16(&'a [u16]),
    F32(&'a [f32]),
    F64(&'a [f64]),
}

impl<'a> Rows<'a> {
    pub fn len(&self) -> usize {
        match self {
            Rows::F16(s) | Rows::BF16(s) => s.len(),
            Rows::F32(s) => s.len(),
            Rows::F64(s) => s.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn dtype(&self) -> Dtype {
        match self {
            Rows::F16(_) => Dtype::F16,
            Rows::BF16(_) => Dtype::BF16,
            Rows::F32(_) => Dtype::F32,
            Rows::F64(_) => Dtype::F64,
        }
    }

    /// Convert `[start, start + out.len())` into f64; returns true if any value is NaN or inf.
    #[inline(always)]
    pub fn load(&self, start: usize, out: &mut [f64]) -> bool {
        let n = out.len();
        match self {
            Rows::F16(s) => {
                let src = &s[start..start + n];
                widen_f16(src, out);
                src.iter().fold(false, |bad, &h| bad | f16_nonfinite(h))
            }
            Rows::BF16(s) => {
                let src = &s[start..start + n];
                let mut bad = false;
                for (o, &h) in out.iter_mut().zip(src) {
                    *o = bf16_to_f64(h);
                    bad |= bf16_nonfinite(h);
                }
                bad
            }
            Rows::F32(s) => {
                let src = &s[start..start + n];
                let mut bad = false;
                for (o, &x) in out.iter_mut().zip(src) {
                    *o = x as f64;
                    bad |= !x.is_finite();
                }
                bad
            }
            Rows::F64(s) => {
                let src = &s[start..start + n];
                out.copy_from_slice(src);
                src.iter().any(|x| !x.is_finite())
            }
        }
    }

    /// Element `i` as f64 (slow path for scalar walks such as inverse-CDF search).
    #[inline(always)]
    pub fn get(&self, i: usize) -> f64 {
        match self {
            Rows::F16(s) => f16_to_f64(s[i]),
            Rows::BF16(s) => bf16_to_f64(s[i]),
            Rows::F32(s) => s[i] as f64,
            Rows::F64(s) => s[i],
        }
    }
}

/// `p` and `q` must be in one format.
pub fn check_same_dtype(p: &Rows, q: &Rows) -> KvResult<()> {
    if p.dtype() != q.dtype() {
        return Err(KvError::InvalidArgument(format!(
            "p is {:?} but q is {:?}; pass both in one dtype",
            p.dtype(),
            q.dtype()
        )));
    }
    Ok(())
}

/// Check that `p` and `q` are matrices of `rows x vocab` (at least one of each) in one format.
pub fn check_pair(p: &Rows, q: &Rows, rows: usize, vocab: usize) -> KvResult<()> {
    if rows == 0 || vocab == 0 {
        return Err(KvError::Shape(format!(
            "empty input: {rows} rows x {vocab} vocab (need at least one of each)"
        )));
    }
    if vocab > i32::MAX as usize {
        return Err(KvError::Shape(format!(
            "vocab {vocab} exceeds the int32 range of token ids"
        )));
    }
    check_lengths(p, q, rows, vocab)?;
    check_same_dtype(p, q)
}

/// `p` and `q` must each hold `rows x vocab` elements.
pub fn check_lengths(p: &Rows, q: &Rows, rows: usize, vocab: usize) -> KvResult<()> {
    if p.len() != rows * vocab || q.len() != rows * vocab {
        return Err(KvError::Shape(format!(
            "p has {} elements and q has {}, expected {rows} x {vocab}",
            p.len(),
            q.len()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_half_loads_exactly() {
        let all: Vec<u16> = (0..=u16::MAX).filter(|&h| !f16_nonfinite(h)).collect();
        let mut out = vec![0.0; all.len()];
        assert!(!Rows::F16(&all).load(0, &mut out));
        for (&h, &v) in all.iter().zip(&out) {
            assert_eq!(v.to_bits(), f16_to_f64(h).to_bits(), "half {h:#06x}");
        }
    }

    #[test]
    fn pairs_must_share_shape_and_dtype() {
        let (h, f) = ([0x3c00u16, 0], [1.0f32, 0.0]);
        assert!(check_pair(&Rows::F16(&h), &Rows::F16(&h), 1, 2).is_ok());
        assert!(check_pair(&Rows::F16(&h), &Rows::F16(&h), 2, 2).is_err());
        let mixed = check_pair(&Rows::F16(&h), &Rows::F32(&f), 1, 2).unwrap_err();
        assert!(mixed.to_string().contains("one dtype"), "{mixed}");
    }
}
