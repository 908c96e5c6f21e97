//! A branchless natural logarithm in f64 that the compiler can vectorise.
//!
//! libm's `ln` is a scalar call; the divergence pass needs three logarithms per vocabulary
//! entry, so we reduce `x = 2^e * m` with `m` in [sqrt(1/2), sqrt(2)) and sum the series
//! `ln m = 2 atanh(s)`, `s = (m - 1) / (m + 1)`, `|s| < 0.1716`, to s^21.
//! Valid for every positive input, subnormals included (they are scaled by 2^64 first);
//! callers map zeros with [`positive_or_tiny`] and multiply the result by the zero weight.

/// What zeros become before a logarithm: the smallest *normal* number, because arithmetic on
/// subnormal operands costs a ~100-cycle microcode assist on x86 (and zeros are common).
pub const TINY: f64 = f64::MIN_POSITIVE;

/// `x` itself when positive (subnormals kept, so their logarithm stays exact), else [`TINY`].
#[inline(always)]
pub fn positive_or_tiny(x: f64) -> f64 {
    if x > 0.0 {
        x
    } else {
        TINY
    }
}

/// `x = 2^e * m` with `m` in [sqrt(1/2), sqrt(2)); returns `(e, m)`.
#[inline(always)]
fn reduce(x: f64) -> (f64, f64) {
    // Subnormals have no implicit leading bit: lift them into the normal range (a select,
    // so the loop still vectorises) and take the 64 back from the exponent.
    let subnormal = x < f64::MIN_POSITIVE;
    let x = if subnormal {
        x * 18_446_744_073_709_551_616.0
    } else {
        x
    };
    let shift = if subnormal { 64.0 } else { 0.0 };
    // Rebias so that the exponent field counts from sqrt(1/2) instead of 1.
    let hx = x
        .to_bits()
        .wrapping_add(0x3ff0_0000_0000_0000 - 0x3fe6_a09e_667f_3bcd);
    // Exponent to f64 without an i64 -> f64 conversion (AVX2 has none): splice the 12 bits
    // into the mantissa of 2^52 and subtract.
    let e = f64::from_bits(0x4330_0000_0000_0000 | (hx >> 52)) - (4_503_599_627_370_496.0 + 1023.0);
    let m = f64::from_bits((hx & 0x000f_ffff_ffff_ffff) + 0x3fe6_a09e_667f_3bcd);
    (e - shift, m)
}

/// `e ln 2 + 2 atanh(s)` with the series to s^21 (the next term is below 2.3e-17 relative),
/// Horner in s^2.
#[inline(always)]
fn series(e: f64, s: f64) -> f64 {
    let s2 = s * s;
    let mut r = 2.0 / 21.0;
    r = r * s2 + 2.0 / 19.0;
    r = r * s2 + 2.0 / 17.0;
    r = r * s2 + 2.0 / 15.0;
    r = r * s2 + 2.0 / 13.0;
    r = r * s2 + 2.0 / 11.0;
    r = r * s2 + 2.0 / 9.0;
    r = r * s2 + 2.0 / 7.0;
    r = r * s2 + 2.0 / 5.0;
    r = r * s2 + 2.0 / 3.0;
    r = r * s2 + 2.0;
    e * std::f64::consts::LN_2 + s * r
}

#[inline(always)]
pub fn ln(x: f64) -> f64 {
    let (e, m) = reduce(x);
    series(e, (m - 1.0) / (m + 1.0))
}

/// Three logarithms and one extra quotient `num / den` for the price of one division.
///
/// Division and square root share one slow unit; the divergence pass needs three logarithms
/// and a Hellinger term per entry, so one reciprocal of the product of the four denominators
/// (each in [1.7, 2.5] for the logarithms, `den` kept in [1e-150, 8]) serves all of them.
/// The extra multiplications cost a few ulps, far below the tolerances callers state.
#[inline(always)]
pub fn ln3_and_quotient(x: f64, y: f64, z: f64, num: f64, den: f64) -> (f64, f64, f64, f64) {
    let (ex, mx) = reduce(x);
    let (ey, my) = reduce(y);
    let (ez, mz) = reduce(z);
    let (dx, dy, dz) = (mx + 1.0, my + 1.0, mz + 1.0);
    let dxy = dx * dy;
    let dzw = dz * den;
    let r = 1.0 / (dxy * dzw);
    let sx = (mx - 1.0) * (r * dy * dzw);
    let sy = (my - 1.0) * (r * dx * dzw);
    let sz = (mz - 1.0) * (r * dxy * den);
    let quotient = num * (r * dxy * dz);
    (series(ex, sx), series(ey, sy), series(ez, sz), quotient)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_std_ln_across_magnitudes() {
        let mut worst: f64 = 0.0;
        let mut x = f64::from_bits(1); // the smallest subnormal
        while x < 1e300 {
            // (starts among the subnormals)
            for k in 0..97 {
                let v = x * (1.0 + k as f64 / 97.0);
                let err = (ln(v) - v.ln()).abs() / v.ln().abs().max(1.0);
                worst = worst.max(err);
            }
            x *= 3.7;
        }
        assert!(worst < 4e-16, "worst relative error {worst}");
        assert_eq!(ln(1.0), 0.0);
    }

    #[test]
    fn ln3_and_quotient_match_separate_operations() {
        let xs = [
            f64::from_bits(1),
            3e-310,
            2.2e-308,
            1e-300,
            1e-200,
            3e-17,
            1e-8,
            0.3,
            0.5,
            1.0,
            1.7,
            7.0,
            1e100,
        ];
        for &x in &xs {
            for &y in &xs {
                for &(num, den) in &[(0.0, 1e-150), (0.25, 1.0), (1e-300, 1e-150), (3.0, 7.9)] {
                    let z = 0.5 * (x + y);
                    let (a, b, c, d) = ln3_and_quotient(x, y, z, num, den);
                    for (got, want) in [(a, x.ln()), (b, y.ln()), (c, z.ln())] {
                        assert!((got - want).abs() <= 2e-15 * want.abs().max(1.0), "{x} {y}");
                    }
                    assert!(
                        (d - num / den).abs() <= 1e-15 * (num / den),
                        "{num} / {den}"
                    );
                }
            }
        }
    }

    #[test]
    fn near_one_and_sqrt_two_boundary() {
        for &v in &[
            1.0 - 1e-12,
            1.0 + 1e-12,
            std::f64::consts::SQRT_2,
            std::f64::consts::FRAC_1_SQRT_2,
            0.5,
            2.0,
        ] {
            assert!((ln(v) - v.ln()).abs() < 1e-16 + 1e-15 * v.ln().abs(), "{v}");
        }
    }
}
