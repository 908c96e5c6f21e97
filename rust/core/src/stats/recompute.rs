//! Total variation recomputed from stored distributions, to check the recorded hazards and
//! branch TVs. This is the analysis's hot loop over full records (vocab ~128k, float16), so it
//! streams each row once in blocks, converts in registers and sums in f64 lanes.
//!
//! Rows holding any NaN or infinity are rows the tracer never recorded (after a stop, past the
//! horizon, no branch): their TV is NaN rather than an error.

use rayon::prelude::*;

use crate::error::{KvError, KvResult};
use crate::parallel;
use crate::rows::Rows;

const BLOCK: usize = 1024;
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

fn check_tv_shapes(p: &Rows, q: &Rows, rows: usize, vocab: usize) -> KvResult<()> {
    if vocab == 0 {
        return Err(KvError::Shape("row_tv: vocab is empty".into()));
    }
    if p.len() != rows * vocab || q.len() != rows * vocab {
        return Err(KvError::Shape(format!(
            "row_tv: p has {} elements and q has {}, expected {rows} x {vocab}",
            p.len(),
            q.len()
        )));
    }
    if p.dtype() != q.dtype() {
        return Err(KvError::InvalidArgument(
            "row_tv: p and q must have the same dtype".into(),
        ));
    }
    Ok(())
}

#[inline]
fn one_row(p: &Rows, q: &Rows, base: usize, vocab: usize) -> f64 {
    if let (Rows::F16(a), Rows::F16(b)) = (p, q) {
        return one_row_f16(&a[base..base + vocab], &b[base..base + vocab]);
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

/// IEEE half bits -> f32, exact, with integer operations only. Softmax outputs over a large
/// vocabulary are mostly half subnormals, and float arithmetic on subnormals (as in the
/// multiply-by-2^112 trick) costs ~100 cycles on x86; here a normal half is rebiased by an
/// integer add and a subnormal one is its integer mantissa times 2^-24 (a normal f32), so the
/// loop vectorises with no subnormal ever touched.
#[inline(always)]
fn f16_to_f32_exact(h: u16) -> f32 {
    let h = h as u32;
    let mag = h & 0x7fff;
    let normal = f32::from_bits((mag << 13) + 0x3800_0000); // exponent bias 15 -> 127
    let sub = (mag & 0x03ff) as f32 * f32::from_bits(0x3380_0000); // 2^-24
    let v = if mag < 0x0400 { sub } else { normal };
    f32::from_bits(v.to_bits() | ((h & 0x8000) << 16))
}

/// The float16 path: `|p - q|` of two exact halves is computed in f32 (one rounding, relative
/// 2^-24), each of 16 lanes sums at most `BLOCK / 16 = 64` terms in f32 (relative error below
/// 4e-6, far under the half-precision storage error) and every block is added into f64.
/// On x86-64 with AVX2 (checked at run time) the same code is compiled for 8-wide vectors.
fn one_row_f16(a: &[u16], b: &[u16]) -> f64 {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("f16c")
        {
            // SAFETY: the CPU supports AVX2 and F16C (checked just above).
            return unsafe { x86::one_row_f16c(a, b) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2 (checked just above); the function is plain safe
            // Rust compiled with that feature enabled.
            return unsafe { one_row_f16_avx2(a, b) };
        }
    }
    one_row_f16_portable(a, b)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn one_row_f16_avx2(a: &[u16], b: &[u16]) -> f64 {
    one_row_f16_portable(a, b)
}

#[inline(always)]
fn one_row_f16_portable(a: &[u16], b: &[u16]) -> f64 {
    const F32_LANES: usize = 16;
    let mut total = 0.0f64;
    for (ba, bb) in a.chunks(BLOCK).zip(b.chunks(BLOCK)) {
        let mut bad = 0u16;
        for (&x, &y) in ba.iter().zip(bb) {
            bad |= (!x & 0x7c00 == 0) as u16 | (!y & 0x7c00 == 0) as u16;
        }
        if bad != 0 {
            return f64::NAN; // an unrecorded (NaN) row
        }
        let mut lanes = [0.0f32; F32_LANES];
        let full = ba.len() - ba.len() % F32_LANES;
        for (ca, cb) in ba[..full]
            .chunks_exact(F32_LANES)
            .zip(bb[..full].chunks_exact(F32_LANES))
        {
            for j in 0..F32_LANES {
                lanes[j] += (f16_to_f32_exact(ca[j]) - f16_to_f32_exact(cb[j])).abs();
            }
        }
        let mut block: f64 = lanes.iter().map(|&x| x as f64).sum();
        for j in full..ba.len() {
            block += (f16_to_f32_exact(ba[j]) as f64 - f16_to_f32_exact(bb[j]) as f64).abs();
        }
        total += block;
    }
    0.5 * total
}

/// [`row_tv`] and [`row_check`] of both sides in one pass over the rows: the TVs, or the first
/// row (in row order, `p` before `q`) that is not a distribution, with its side (0: `p`,
/// 1: `q`). Half-precision rows are read once: the TV and both sums share the loop, and only a
/// row holding a NaN, an infinity or a negative entry is scanned again to say which.
pub fn row_tv_checked(
    p: Rows,
    q: Rows,
    rows: usize,
    vocab: usize,
    tolerance: f64,
) -> KvResult<Result<Vec<f64>, (usize, RowViolation)>> {
    check_tv_shapes(&p, &q, rows, vocab)?;
    let per_row: Vec<Result<f64, (usize, RowViolation)>> = parallel::install(|| {
        (0..rows)
            .into_par_iter()
            .with_min_len(4)
            .map(|r| checked_row(&p, &q, r, vocab, tolerance))
            .collect()
    });
    Ok(per_row.into_iter().collect())
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
        let (tv, sa, sb, flagged) = fused_row_f16(&a[base..base + vocab], &b[base..base + vocab]);
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

/// One pass over a pair of half rows: TV, both sums, and whether any entry is NaN, infinite
/// or negative (then the sums mean nothing and the caller scans the row). Accumulation as in
/// `one_row_f16`: f32 lanes per block, blocks added in f64.
fn fused_row_f16(a: &[u16], b: &[u16]) -> (f64, f64, f64, bool) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("f16c")
        {
            // SAFETY: the CPU supports AVX2 and F16C (checked just above).
            return unsafe { x86::fused_row_f16c(a, b) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2 (checked just above); the function is plain safe
            // Rust compiled with that feature enabled.
            return unsafe { fused_row_f16_avx2(a, b) };
        }
    }
    fused_row_f16_portable(a, b)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn fused_row_f16_avx2(a: &[u16], b: &[u16]) -> (f64, f64, f64, bool) {
    fused_row_f16_portable(a, b)
}

#[inline(always)]
fn fused_row_f16_portable(a: &[u16], b: &[u16]) -> (f64, f64, f64, bool) {
    const L: usize = 16;
    let (mut tv, mut sa, mut sb) = (0.0f64, 0.0f64, 0.0f64);
    let mut flagged = 0u16;
    for (ba, bb) in a.chunks(BLOCK).zip(b.chunks(BLOCK)) {
        for (&x, &y) in ba.iter().zip(bb) {
            // Exponent all ones (NaN, infinity) or sign set on a nonzero value (negative).
            flagged |= (x & 0x7c00 == 0x7c00) as u16 | (y & 0x7c00 == 0x7c00) as u16;
            flagged |= ((x & 0x8000 != 0) & (x & 0x7fff != 0)) as u16;
            flagged |= ((y & 0x8000 != 0) & (y & 0x7fff != 0)) as u16;
        }
        let mut lt = [0.0f32; L];
        let mut la = [0.0f32; L];
        let mut lb = [0.0f32; L];
        let full = ba.len() - ba.len() % L;
        for (ca, cb) in ba[..full].chunks_exact(L).zip(bb[..full].chunks_exact(L)) {
            for j in 0..L {
                let (x, y) = (f16_to_f32_exact(ca[j]), f16_to_f32_exact(cb[j]));
                lt[j] += (x - y).abs();
                la[j] += x;
                lb[j] += y;
            }
        }
        for j in full..ba.len() {
            let (x, y) = (f16_to_f32_exact(ba[j]), f16_to_f32_exact(bb[j]));
            lt[0] += (x - y).abs();
            la[0] += x;
            lb[0] += y;
        }
        tv += lt.iter().map(|&v| v as f64).sum::<f64>();
        sa += la.iter().map(|&v| v as f64).sum::<f64>();
        sb += lb.iter().map(|&v| v as f64).sum::<f64>();
    }
    (0.5 * tv, sa, sb, flagged != 0)
}

/// The half-precision rows with the CPU's own conversion (F16C `vcvtph2ps`, exact like
/// [`f16_to_f32_exact`] for every finite half, in one instruction per 8 values): the same 16
/// f32 lanes, each adding the same terms in the same order, so the results are bit-identical
/// to the portable code's. Non-finite halves convert differently, but a row holding one is
/// flagged first and its sums are not used.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{f16_to_f32_exact, BLOCK};
    use std::arch::x86_64::*;

    /// Halves `i..i + 8` of `v` as 8 f32.
    #[inline(always)]
    unsafe fn load8(v: &[u16], i: usize) -> __m256 {
        debug_assert!(i + 8 <= v.len());
        // SAFETY: i + 8 <= v.len() (the callers step through whole 16-value groups).
        _mm256_cvtph_ps(_mm_loadu_si128(v.as_ptr().add(i) as *const __m128i))
    }

    #[inline(always)]
    unsafe fn lanes(v: [__m256; 2]) -> [f32; 16] {
        let mut out = [0.0f32; 16];
        _mm256_storeu_ps(out.as_mut_ptr(), v[0]);
        _mm256_storeu_ps(out.as_mut_ptr().add(8), v[1]);
        out
    }

    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn one_row_f16c(a: &[u16], b: &[u16]) -> f64 {
        let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
        let mut total = 0.0f64;
        for (ba, bb) in a.chunks(BLOCK).zip(b.chunks(BLOCK)) {
            let mut bad = 0u16;
            for (&x, &y) in ba.iter().zip(bb) {
                bad |= (!x & 0x7c00 == 0) as u16 | (!y & 0x7c00 == 0) as u16;
            }
            if bad != 0 {
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
            let mut block: f64 = lanes(lt).iter().map(|&x| x as f64).sum();
            for j in full..ba.len() {
                block += (f16_to_f32_exact(ba[j]) as f64 - f16_to_f32_exact(bb[j]) as f64).abs();
            }
            total += block;
        }
        0.5 * total
    }

    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn fused_row_f16c(a: &[u16], b: &[u16]) -> (f64, f64, f64, bool) {
        let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
        let (mut tv, mut sa, mut sb) = (0.0f64, 0.0f64, 0.0f64);
        let mut flagged = 0u16;
        for (ba, bb) in a.chunks(BLOCK).zip(b.chunks(BLOCK)) {
            for (&x, &y) in ba.iter().zip(bb) {
                flagged |= (x & 0x7c00 == 0x7c00) as u16 | (y & 0x7c00 == 0x7c00) as u16;
                flagged |= ((x & 0x8000 != 0) & (x & 0x7fff != 0)) as u16;
                flagged |= ((y & 0x8000 != 0) & (y & 0x7fff != 0)) as u16;
            }
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
            let (mut lt, mut la, mut lb) = (lanes(lt), lanes(la), lanes(lb));
            for j in full..ba.len() {
                let (x, y) = (f16_to_f32_exact(ba[j]), f16_to_f32_exact(bb[j]));
                lt[0] += (x - y).abs();
                la[0] += x;
                lb[0] += y;
            }
            tv += lt.iter().map(|&v| v as f64).sum::<f64>();
            sa += la.iter().map(|&v| v as f64).sum::<f64>();
            sb += lb.iter().map(|&v| v as f64).sum::<f64>();
        }
        (0.5 * tv, sa, sb, flagged != 0)
    }
}

/// Why a stored distribution row is not one (see [`row_check`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RowViolation {
    /// Entry `col` of `row` is NaN, infinite or negative in a row that is not all NaN.
    Entry { row: usize, col: usize, value: f64 },
    /// The entries of `row` are finite and >= 0 but sum to `sum`, not 1 within the tolerance.
    Sum { row: usize, sum: f64 },
}

/// The first row (in row order) of `rows x vocab` that is not a stored distribution: every row
/// must be all NaN (never recorded) or finite, >= 0 and sum to 1 within `tolerance` (the
/// caller derives it from the storage format; `kvcouple.store.schema.row_sum_tolerance`).
/// The same rule as the reader's `distribution_problems`, for the store engine.
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

fn check_one_row(p: &Rows, r: usize, vocab: usize, tolerance: f64) -> Option<RowViolation> {
    let base = r * vocab;
    let (sum, nans, first_bad) = match p {
        Rows::F16(a) => row_sum_f16(&a[base..base + vocab]),
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
            // The half table holds finite halves only: name NaN and infinities by their bits.
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

/// Sum, NaN count and first NaN/infinite/negative entry of one half-precision row, from the
/// bits (no float compare on a NaN); the sum as in `row_tv`: f32 lanes per block, f64 total.
fn row_sum_f16(a: &[u16]) -> (f64, usize, Option<usize>) {
    let mut total = 0.0f64;
    let mut nans = 0usize;
    let mut first_bad = None;
    for (b, block) in a.chunks(BLOCK).enumerate() {
        let mut flagged = 0u16;
        for &h in block {
            let nonfinite = (h & 0x7c00 == 0x7c00) as u16;
            let negative = ((h & 0x8000 != 0) & (h & 0x7fff != 0)) as u16;
            flagged |= nonfinite | negative;
        }
        let mut lanes = [0.0f32; 16];
        let full = block.len() - block.len() % 16;
        for c in block[..full].chunks_exact(16) {
            for j in 0..16 {
                lanes[j] += f16_to_f32_exact(c[j]);
            }
        }
        for (j, &h) in block[full..].iter().enumerate() {
            lanes[j] += f16_to_f32_exact(h);
        }
        if flagged != 0 {
            for (i, &h) in block.iter().enumerate() {
                let nan = h & 0x7c00 == 0x7c00 && h & 0x03ff != 0;
                nans += nan as usize;
                let bad = h & 0x7c00 == 0x7c00 || (h & 0x8000 != 0 && h & 0x7fff != 0);
                if bad && first_bad.is_none() {
                    first_bad = Some(b * BLOCK + i);
                }
            }
        }
        total += lanes.iter().map(|&x| x as f64).sum::<f64>();
    }
    (total, nans, first_bad)
}

#[cfg(test)]
mod tests {
    use super::*;

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
                .map(|(&x, &y)| (crate::rows::f16_to_f64(x) - crate::rows::f16_to_f64(y)).abs())
                .sum::<f64>();
        assert!(
            (fast - reference).abs() <= 1e-6 * reference,
            "{fast} {reference}"
        );
        for h in 0..=u16::MAX {
            if h & 0x7c00 != 0x7c00 {
                assert_eq!(
                    f16_to_f32_exact(h) as f64,
                    crate::rows::f16_to_f64(h),
                    "{h:#x}"
                );
            }
        }
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
    /// The nearest half to a value in [0, 65504] (positive halves are ordered as their bits).
    fn to_half(x: f64) -> u16 {
        let (mut lo, mut hi) = (0u16, 0x7bffu16);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if (f16_to_f32_exact(mid) as f64) < x {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        let below = lo.saturating_sub(1);
        if (x - f16_to_f32_exact(below) as f64).abs() < (f16_to_f32_exact(lo) as f64 - x).abs() {
            below
        } else {
            lo
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn f16c_rows_are_bit_identical_to_the_portable_ones() {
        if !(std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("f16c"))
        {
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
        let (fast, fused) = unsafe { (x86::one_row_f16c(&a, &b), x86::fused_row_f16c(&a, &b)) };
        assert_eq!(fast.to_bits(), one_row_f16_portable(&a, &b).to_bits());
        let slow = fused_row_f16_portable(&a, &b);
        assert_eq!(fused.0.to_bits(), slow.0.to_bits());
        assert_eq!(fused.1.to_bits(), slow.1.to_bits());
        assert_eq!(fused.2.to_bits(), slow.2.to_bits());
        assert!(!fused.3);
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
        let fused = row_tv_checked(Rows::F16(&p), Rows::F16(&q), rows, vocab, tol).unwrap();
        assert_eq!(fused.unwrap(), tv);
        // Row 2 of q all NaN (unrecorded): allowed, its TV NaN.
        let mut q2 = q.clone();
        q2[2 * vocab..3 * vocab].fill(0x7e00);
        let fused = row_tv_checked(Rows::F16(&p), Rows::F16(&q2), rows, vocab, tol).unwrap();
        let fused = fused.unwrap();
        assert!(fused[2].is_nan() && fused[1] == tv[1]);
        // A negative entry in p's row 3 and a short row 1 of q: row 1 comes first.
        p[3 * vocab + 5] = 0x8001;
        let mut q3 = q.clone();
        q3[vocab..2 * vocab]
            .iter_mut()
            .take(vocab / 2)
            .for_each(|h| *h = 0);
        let err = row_tv_checked(Rows::F16(&p), Rows::F16(&q3), rows, vocab, tol).unwrap();
        assert!(
            matches!(err, Err((1, RowViolation::Sum { row: 1, .. }))),
            "{err:?}"
        );
        let err = row_tv_checked(Rows::F16(&p), Rows::F16(&q), rows, vocab, tol).unwrap();
        assert!(
            matches!(err, Err((0, RowViolation::Entry { row: 3, col: 5, value })) if value < 0.0),
            "{err:?}"
        );
        assert_eq!(
            row_check(Rows::F16(&p), rows, vocab, tol).unwrap(),
            err.err().map(|e| e.1)
        );
    }
}
