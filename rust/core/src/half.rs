//! The 16-bit float formats a model emits, as raw `u16` bits (numpy has no bfloat16, so Python
//! hands both over as `uint16`): widening to f32 and f64, and the float16 row kernels that
//! read stored distributions in place (the analysis's hot loop over full records: vocab
//! ~128k, float16).
//!
//! **One float16 widening, a table.** `f16_to_f32` looks the half up in a 65536-entry table
//! (256 KiB, stays in cache). Integer operations (rebias a normal half, scale a subnormal's
//! mantissa by 2^-24) give the same bits for every half, but measured single-threaded on
//! x86-64 with `cargo run --release --example f16_widening` (halves as a softmax over 128k
//! entries stores them, mostly subnormal) the table is faster where the portable code runs,
//! compiled for the target's baseline: 0.38-0.43 against 0.81-0.88 ns per half widened into
//! f64, 0.42-0.46 against 0.69-0.78 ns per entry of the f32-lane TV; with AVX2 enabled the two
//! are within 20% of each other (x86-64 only: aarch64 was not measured).
//! Where the CPU has F16C ([`simd::Level::Avx2`] and up), runs are widened by that instruction
//! and the table only finishes tails and single values. (Float arithmetic on subnormal
//! operands, as in multiplying by 2^112, costs ~100 cycles on x86: it only fills the table.)
//!
//! The float16 row kernels sum `|p - q|` (or `p`) of exact halves in 16 f32 lanes per block
//! of [`BLOCK`] values (each lane at most 64 terms: relative error below 4e-6, far under the
//! half-precision storage error) and add every block into f64. The F16C variants add the same
//! terms in the same lanes in the same order: bit-identical results.

use crate::simd::{self, Level};

/// Values per block of the float16 row kernels.
pub const BLOCK: usize = 1024;
/// f32 lanes per block.
const LANES: usize = 16;

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

/// A NaN or infinite half as f32, bit for bit as F16C's `vcvtph2ps` widens it: sign kept,
/// exponent all ones, mantissa shifted up, a NaN made quiet.
fn f16_nonfinite_to_f32(h: u16) -> f32 {
    let (sign, mantissa) = (((h & 0x8000) as u32) << 16, ((h & 0x03ff) as u32) << 13);
    let quiet = if mantissa != 0 { 0x0040_0000 } else { 0 };
    f32::from_bits(sign | 0x7f80_0000 | mantissa | quiet)
}

/// All 65536 halves as f32; NaN stays NaN and infinities infinite, so that every check
/// downstream sees them (a finite stand-in would be a silently wrong number).
fn f16_table() -> &'static [f32; 65536] {
    static TABLE: std::sync::OnceLock<Box<[f32; 65536]>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        let mut t = Box::new([0f32; 65536]);
        for (h, v) in t.iter_mut().enumerate() {
            let h = h as u16;
            *v = if f16_nonfinite(h) {
                f16_nonfinite_to_f32(h)
            } else {
                f16_to_f64_arith(h) as f32 // exact: halves are a subset of f32
            };
        }
        t
    })
}

/// IEEE half -> f32, exact for every finite half (the one float16 widening; see above).
#[inline(always)]
pub fn f16_to_f32(h: u16) -> f32 {
    f16_table()[h as usize]
}

/// IEEE half -> f64, exact for every finite half.
#[inline(always)]
pub fn f16_to_f64(h: u16) -> f64 {
    f16_to_f32(h) as f64
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

/// Is this half NaN, infinite, or negative and nonzero (not an entry of a distribution)?
#[inline(always)]
fn f16_not_a_probability(h: u16) -> bool {
    f16_nonfinite(h) | ((h & 0x8000 != 0) & (h & 0x7fff != 0))
}

/// Widen a run of halves into f64 (`out.len()` values).
#[inline(always)]
pub fn widen_f16(src: &[u16], out: &mut [f64]) {
    match simd::level() {
        // SAFETY: the level says the CPU has AVX2 (so AVX) and F16C.
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 | Level::Avx512 => unsafe { x86::widen_f16c(src, out) },
        _ => {
            for (o, &h) in out.iter_mut().zip(src) {
                *o = f16_to_f64(h);
            }
        }
    }
}

/// `1/2 sum |a - b|` of two half rows; NaN where either holds a NaN or an infinity (a row the
/// tracer never recorded).
pub fn tv_f16(a: &[u16], b: &[u16]) -> f64 {
    match simd::level() {
        // SAFETY: the level says the CPU has AVX2 and F16C.
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 | Level::Avx512 => unsafe { x86::tv_f16c(a, b) },
        _ => tv_portable(a, b),
    }
}

/// One pass over a pair of half rows: `(tv, sum a, sum b, flagged)`, flagged where any entry is
/// NaN, infinite or negative (then the sums mean nothing and the caller scans the row).
pub fn tv_and_sums_f16(a: &[u16], b: &[u16]) -> (f64, f64, f64, bool) {
    match simd::level() {
        // SAFETY: the level says the CPU has AVX2 and F16C.
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 | Level::Avx512 => unsafe { x86::tv_and_sums_f16c(a, b) },
        _ => tv_and_sums_portable(a, b),
    }
}

/// Whether `bad` holds for any value of a block of a pair of half rows (a branchless OR over
/// the block, so that it vectorises).
#[inline(always)]
fn block_any(a: &[u16], b: &[u16], bad: impl Fn(u16) -> bool) -> bool {
    let mut any = 0u16;
    for (&x, &y) in a.iter().zip(b) {
        any |= bad(x) as u16 | bad(y) as u16;
    }
    any != 0
}

#[inline(always)]
fn tv_portable(a: &[u16], b: &[u16]) -> f64 {
    let mut total = 0.0f64;
    for (ba, bb) in a.chunks(BLOCK).zip(b.chunks(BLOCK)) {
        if block_any(ba, bb, f16_nonfinite) {
            return f64::NAN; // an unrecorded (NaN) row
        }
        let mut lanes = [0.0f32; LANES];
        let full = ba.len() - ba.len() % LANES;
        for (ca, cb) in ba[..full]
            .chunks_exact(LANES)
            .zip(bb[..full].chunks_exact(LANES))
        {
            for j in 0..LANES {
                lanes[j] += (f16_to_f32(ca[j]) - f16_to_f32(cb[j])).abs();
            }
        }
        let block: f64 = lanes.iter().map(|&x| x as f64).sum();
        total += add_tv_tail(block, &ba[full..], &bb[full..]);
    }
    0.5 * total
}

/// `block` plus the terms after the last whole group of lanes, added one by one in f64.
#[inline(always)]
fn add_tv_tail(mut block: f64, a: &[u16], b: &[u16]) -> f64 {
    for (&x, &y) in a.iter().zip(b) {
        block += (f16_to_f64(x) - f16_to_f64(y)).abs();
    }
    block
}

#[inline(always)]
fn tv_and_sums_portable(a: &[u16], b: &[u16]) -> (f64, f64, f64, bool) {
    let (mut tv, mut sa, mut sb) = (0.0f64, 0.0f64, 0.0f64);
    let mut flagged = false;
    for (ba, bb) in a.chunks(BLOCK).zip(b.chunks(BLOCK)) {
        flagged |= block_any(ba, bb, f16_not_a_probability);
        let mut lanes = [[0.0f32; LANES]; 3];
        let full = ba.len() - ba.len() % LANES;
        for (ca, cb) in ba[..full]
            .chunks_exact(LANES)
            .zip(bb[..full].chunks_exact(LANES))
        {
            for j in 0..LANES {
                let (x, y) = (f16_to_f32(ca[j]), f16_to_f32(cb[j]));
                lanes[0][j] += (x - y).abs();
                lanes[1][j] += x;
                lanes[2][j] += y;
            }
        }
        let [t, x, y] = add_tail_and_fold(lanes, &ba[full..], &bb[full..]);
        (tv, sa, sb) = (tv + t, sa + x, sb + y);
    }
    (0.5 * tv, sa, sb, flagged)
}

/// The block's lanes of `|a - b|`, `a` and `b` with the tail after the last whole group
/// added into lane 0, each folded into f64.
#[inline(always)]
fn add_tail_and_fold(mut lanes: [[f32; LANES]; 3], a: &[u16], b: &[u16]) -> [f64; 3] {
    for (&x, &y) in a.iter().zip(b) {
        let (x, y) = (f16_to_f32(x), f16_to_f32(y));
        lanes[0][0] += (x - y).abs();
        lanes[1][0] += x;
        lanes[2][0] += y;
    }
    lanes.map(|l| l.iter().map(|&v| v as f64).sum::<f64>())
}

/// Sum, NaN count and first NaN/infinite/negative entry of one half-precision row, from the
/// bits (no float compare on a NaN); the sum as in [`tv_f16`]: f32 lanes per block, f64 total.
pub fn sum_f16(a: &[u16]) -> (f64, usize, Option<usize>) {
    let mut total = 0.0f64;
    let mut nans = 0usize;
    let mut first_bad = None;
    for (b, block) in a.chunks(BLOCK).enumerate() {
        let mut flagged = 0u16;
        for &h in block {
            flagged |= f16_not_a_probability(h) as u16;
        }
        let mut lanes = [0.0f32; LANES];
        let full = block.len() - block.len() % LANES;
        for c in block[..full].chunks_exact(LANES) {
            for j in 0..LANES {
                lanes[j] += f16_to_f32(c[j]);
            }
        }
        for (j, &h) in block[full..].iter().enumerate() {
            lanes[j] += f16_to_f32(h);
        }
        if flagged != 0 {
            for (i, &h) in block.iter().enumerate() {
                nans += (f16_nonfinite(h) && h & 0x03ff != 0) as usize;
                if f16_not_a_probability(h) && first_bad.is_none() {
                    first_bad = Some(b * BLOCK + i);
                }
            }
        }
        total += lanes.iter().map(|&x| x as f64).sum::<f64>();
    }
    (total, nans, first_bad)
}

/// The F16C variants (`vcvtph2ps`, exact like [`f16_to_f32`] for every finite half, 8 values
/// per instruction): the same 16 f32 lanes, each adding the same terms in the same order as
/// the portable code. Non-finite halves convert differently, but a row holding one is flagged
/// first and its sums are not used.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{
        add_tail_and_fold, add_tv_tail, block_any, f16_nonfinite, f16_not_a_probability,
        f16_to_f64, BLOCK,
    };
    use std::arch::x86_64::*;

    /// Halves `i..i + 8` of `v` as 8 f32.
    #[inline(always)]
    unsafe fn load8(v: &[u16], i: usize) -> __m256 {
        debug_assert!(i + 8 <= v.len());
        // SAFETY: i + 8 <= v.len() (the callers step through whole groups).
        _mm256_cvtph_ps(_mm_loadu_si128(v.as_ptr().add(i) as *const __m128i))
    }

    #[inline(always)]
    unsafe fn lanes(v: [__m256; 2]) -> [f32; 16] {
        let mut out = [0.0f32; 16];
        _mm256_storeu_ps(out.as_mut_ptr(), v[0]);
        _mm256_storeu_ps(out.as_mut_ptr().add(8), v[1]);
        out
    }

    #[target_feature(enable = "avx,f16c")]
    pub(super) unsafe fn widen_f16c(src: &[u16], out: &mut [f64]) {
        let n = src.len().min(out.len());
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: i + 8 <= n bounds both the 16-byte load and the two 4-lane stores.
            let singles = load8(src, i);
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

    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn tv_f16c(a: &[u16], b: &[u16]) -> f64 {
        let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
        let mut total = 0.0f64;
        for (ba, bb) in a.chunks(BLOCK).zip(b.chunks(BLOCK)) {
            if block_any(ba, bb, f16_nonfinite) {
                return f64::NAN; // an unrecorded (NaN) row
            }
            let mut lt = [_mm256_setzero_ps(); 2];
            let full = ba.len() - ba.len() % 16;
            for i in (0..full).step_by(16) {
                for (h, acc) in lt.iter_mut().enumerate() {
                    let d = _mm256_sub_ps(load8(ba, i + 8 * h), load8(bb, i + 8 * h));
                    *acc = _mm256_add_ps(*acc, _mm256_and_ps(d, abs));
                }
            }
            let block: f64 = lanes(lt).iter().map(|&x| x as f64).sum();
            total += add_tv_tail(block, &ba[full..], &bb[full..]);
        }
        0.5 * total
    }

    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn tv_and_sums_f16c(a: &[u16], b: &[u16]) -> (f64, f64, f64, bool) {
        let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
        let (mut tv, mut sa, mut sb) = (0.0f64, 0.0f64, 0.0f64);
        let mut flagged = false;
        for (ba, bb) in a.chunks(BLOCK).zip(b.chunks(BLOCK)) {
            flagged |= block_any(ba, bb, f16_not_a_probability);
            let zero = _mm256_setzero_ps();
            let (mut lt, mut la, mut lb) = ([zero; 2], [zero; 2], [zero; 2]);
            let full = ba.len() - ba.len() % 16;
            for i in (0..full).step_by(16) {
                for h in 0..2 {
                    let (x, y) = (load8(ba, i + 8 * h), load8(bb, i + 8 * h));
                    lt[h] = _mm256_add_ps(lt[h], _mm256_and_ps(_mm256_sub_ps(x, y), abs));
                    la[h] = _mm256_add_ps(la[h], x);
                    lb[h] = _mm256_add_ps(lb[h], y);
                }
            }
            let folded = [lanes(lt), lanes(la), lanes(lb)];
            let [t, x, y] = add_tail_and_fold(folded, &ba[full..], &bb[full..]);
            (tv, sa, sb) = (tv + t, sa + x, sb + y);
        }
        (0.5 * tv, sa, sb, flagged)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An independent widening, by integer operations: a normal half rebiased by an integer
    /// add, a subnormal one its integer mantissa times 2^-24.
    fn f16_to_f32_integer(h: u16) -> f32 {
        let h = h as u32;
        let mag = h & 0x7fff;
        let normal = f32::from_bits((mag << 13) + 0x3800_0000); // exponent bias 15 -> 127
        let sub = (mag & 0x03ff) as f32 * f32::from_bits(0x3380_0000); // 2^-24
        let special = f32::from_bits(
            0x7f80_0000 | ((mag & 0x03ff) << 13) | ((mag & 0x03ff != 0) as u32) << 22,
        );
        let v = if mag < 0x0400 {
            sub
        } else if mag >= 0x7c00 {
            special
        } else {
            normal
        };
        f32::from_bits(v.to_bits() | ((h & 0x8000) << 16))
    }

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
    fn every_half_widens_exactly_by_every_path() {
        for h in 0..=u16::MAX {
            assert_eq!(
                f16_to_f32(h).to_bits(),
                f16_to_f32_integer(h).to_bits(),
                "{h:#x}"
            );
            if !f16_nonfinite(h) {
                assert_eq!(f16_to_f64(h), f16_to_f64_arith(h), "{h:#x}");
            }
        }
        let all: Vec<u16> = (0..=u16::MAX).collect();
        let mut out = vec![0.0; all.len()];
        widen_f16(&all, &mut out);
        for (&h, &v) in all.iter().zip(&out) {
            assert_eq!(v.to_bits(), f16_to_f64(h).to_bits(), "half {h:#06x}");
            if !f16_nonfinite(h) {
                assert_eq!(v.to_bits(), f16_to_f64_arith(h).to_bits(), "half {h:#06x}");
            }
        }
    }

    #[test]
    fn nan_and_infinite_halves_stay_nan_and_infinite() {
        assert_eq!(f16_to_f64(0x7c00), f64::INFINITY);
        assert_eq!(f16_to_f64(0xfc00), f64::NEG_INFINITY);
        for h in [0x7e00u16, 0x7c01, 0xfe00, 0x7fff] {
            assert!(f16_to_f64(h).is_nan(), "{h:#06x}");
            assert!(f16_to_f32(h).is_nan(), "{h:#06x}");
        }
        let mut out = [0.0; 3];
        widen_f16(&[0x3c00, 0x7e00, 0x7c00], &mut out);
        assert_eq!(out[0], 1.0);
        assert!(out[1].is_nan());
        assert_eq!(out[2], f64::INFINITY);
    }

    #[test]
    fn bf16_conversion() {
        assert_eq!(bf16_to_f64(0x3f80), 1.0);
        assert_eq!(bf16_to_f64(0x3f00), 0.5);
        assert!(bf16_nonfinite(0x7f80) && !bf16_nonfinite(0x7f7f));
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn f16c_rows_are_bit_identical_to_the_portable_ones() {
        if simd::level() < Level::Avx2 {
            return;
        }
        // Every finite non-negative half (subnormals included), in a scrambled order, and a
        // length that leaves a tail after the 16-value groups.
        let n = 0x7c00usize + 7;
        let a: Vec<u16> = (0..n).map(|i| ((i * 7919) % 0x7c00) as u16).collect();
        let b: Vec<u16> = (0..n)
            .map(|i| ((i * 104_729 + 11) % 0x7c00) as u16)
            .collect();
        // SAFETY: the CPU supports AVX2 and F16C (checked above).
        let (fast, fused) = unsafe { (x86::tv_f16c(&a, &b), x86::tv_and_sums_f16c(&a, &b)) };
        assert_eq!(fast.to_bits(), tv_portable(&a, &b).to_bits());
        let slow = tv_and_sums_portable(&a, &b);
        assert_eq!(fused.0.to_bits(), slow.0.to_bits());
        assert_eq!(fused.1.to_bits(), slow.1.to_bits());
        assert_eq!(fused.2.to_bits(), slow.2.to_bits());
        assert!(!fused.3);
        let mut wide = vec![0.0; n];
        // SAFETY: as above.
        unsafe { x86::widen_f16c(&a, &mut wide) };
        assert!(wide.iter().zip(&a).all(|(&w, &h)| w == f16_to_f64(h)));
    }
}
