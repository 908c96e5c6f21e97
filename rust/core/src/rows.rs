//! Borrowed views of `(rows, vocab)` matrices in the floating formats a model emits.
//!
//! Half formats are passed as raw `u16` bits: numpy has no bfloat16, so Python hands over a
//! `uint16` view plus a dtype flag. Conversion is branchless so the hot loops vectorise.

use crate::error::{KvError, KvResult};

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

/// IEEE half -> f64 by arithmetic, exact for every finite half (subnormals included):
/// multiplying the shifted bits by 2^112 rebiases the exponent. Used once to fill the table.
fn f16_to_f64_arith(h: u16) -> f64 {
    let mag = f32::from_bits(((h & 0x7fff) as u32) << 13) as f64 * 2f64.powi(112);
    if h & 0x8000 != 0 {
        -mag
    } else {
        mag
    }
}

/// All 65536 halves as f32 (256 KiB, stays in cache). A table beats arithmetic here: softmax
/// outputs over a large vocabulary are mostly f16 subnormals, and subnormal float arithmetic
/// costs ~100 cycles on x86.
fn f16_table() -> &'static [f32; 65536] {
    static TABLE: std::sync::OnceLock<Box<[f32; 65536]>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        let mut t = Box::new([0f32; 65536]);
        for (h, v) in t.iter_mut().enumerate() {
            *v = f16_to_f64_arith(h as u16) as f32; // exact: halves are a subset of f32
        }
        t
    })
}

/// IEEE half -> f64, exact.
#[inline(always)]
pub fn f16_to_f64(h: u16) -> f64 {
    f16_table()[h as usize] as f64
}

/// Widen a run of halves with the F16C instruction (8 at a time; exact, subnormals included).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,f16c")]
unsafe fn f16_run_f16c(src: &[u16], out: &mut [f64]) {
    use std::arch::x86_64::{
        __m128i, _mm256_castps256_ps128, _mm256_cvtph_ps, _mm256_cvtps_pd, _mm256_extractf128_ps,
        _mm256_storeu_pd, _mm_loadu_si128,
    };
    let n = src.len().min(out.len());
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: i + 8 <= n bounds both the 16-byte load and the two 4-lane stores.
        let halves = _mm_loadu_si128(src.as_ptr().add(i) as *const __m128i);
        let singles = _mm256_cvtph_ps(halves);
        _mm256_storeu_pd(
            out.as_mut_ptr().add(i),
            _mm256_cvtps_pd(_mm256_castps256_ps128(singles)),
        );
        _mm256_storeu_pd(
            out.as_mut_ptr().add(i + 4),
            _mm256_cvtps_pd(_mm256_extractf128_ps(singles, 1)),
        );
        i += 8;
    }
    for k in i..n {
        out[k] = f16_to_f64(src[k]);
    }
}

/// Widen a run of halves: F16C where the CPU has it, else the table.
#[inline(always)]
fn f16_run(src: &[u16], out: &mut [f64]) {
    #[cfg(target_arch = "x86_64")]
    {
        static HAS_F16C: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        if *HAS_F16C.get_or_init(|| {
            std::is_x86_feature_detected!("avx") && std::is_x86_feature_detected!("f16c")
        }) {
            // SAFETY: the CPU supports the features the function was compiled for.
            unsafe { f16_run_f16c(src, out) };
            return;
        }
    }
    let table = f16_table();
    for (o, &h) in out.iter_mut().zip(src) {
        *o = table[h as usize] as f64;
    }
}

/// bfloat16 -> f64: bfloat16 is the top half of an f32.
#[inline(always)]
pub fn bf16_to_f64(h: u16) -> f64 {
    f32::from_bits((h as u32) << 16) as f64
}

/// Is this half (IEEE f16) infinite or NaN?
#[inline(always)]
pub fn f16_nonfinite(h: u16) -> bool {
    h & 0x7c00 == 0x7c00
}

#[inline(always)]
pub fn bf16_nonfinite(h: u16) -> bool {
    h & 0x7f80 == 0x7f80
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
                f16_run(src, out);
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

/// Check that `p` and `q` are matrices of `rows x vocab` and return `(rows, vocab)`.
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
    fn f16_conversion_matches_reference_values() {
        assert_eq!(f16_to_f64(0x3c00), 1.0);
        assert_eq!(f16_to_f64(0xc000), -2.0);
        assert_eq!(f16_to_f64(0x0001), 2f64.powi(-24)); // smallest subnormal
        assert_eq!(f16_to_f64(0x03ff), 1023.0 * 2f64.powi(-24)); // largest subnormal
        assert_eq!(f16_to_f64(0x7bff), 65504.0);
        assert_eq!(f16_to_f64(0x0000), 0.0);
        assert!(f16_nonfinite(0x7c00) && f16_nonfinite(0x7e00) && !f16_nonfinite(0x7bff));
    }

    #[test]
    fn every_half_widens_exactly_by_both_paths() {
        let all: Vec<u16> = (0..=u16::MAX).filter(|&h| !f16_nonfinite(h)).collect();
        let mut out = vec![0.0; all.len()];
        Rows::F16(&all).load(0, &mut out);
        for (&h, &v) in all.iter().zip(&out) {
            assert_eq!(v.to_bits(), f16_to_f64_arith(h).to_bits(), "half {h:#06x}");
        }
    }

    #[test]
    fn bf16_conversion() {
        assert_eq!(bf16_to_f64(0x3f80), 1.0);
        assert_eq!(bf16_to_f64(0x3f00), 0.5);
        assert!(bf16_nonfinite(0x7f80) && !bf16_nonfinite(0x7f7f));
    }
}
