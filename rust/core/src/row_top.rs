//! The change in the probability of P's top token, `q(a) - p(a)` with `a = argmax p` (the
//! first maximum), per stored row: the scoreboard's `delta_p` (llama-perplexity's "Δp"),
//! computed where the engine already holds the decoded rows, so full records are not read a
//! second time.
//!
//! It is computed as numpy computes it from the rows widened to float32
//! (`q32[a] - p32[a]`, `a = argmax(p32)`): exact for half formats (every half is an f32).

use crate::error::KvResult;
use crate::rows::{check_lengths, check_same_dtype, Rows};

/// `q(a) - p(a)` at `a = argmax p_r` for each row `r` (NaN where `p_r` holds a NaN: numpy's
/// argmax then names the first NaN, whose difference is NaN).
pub fn row_top_delta(p: Rows, q: Rows, rows: usize, vocab: usize) -> KvResult<Vec<f64>> {
    check_lengths(&p, &q, rows, vocab)?;
    check_same_dtype(&p, &q)?;
    Ok((0..rows)
        .map(|r| top_delta_one(&p, &q, r * vocab, vocab))
        .collect())
}

/// One row's `q(a) - p(a)` (see [`row_top_delta`]); `base` is the row's first element.
pub fn top_delta_one(p: &Rows, q: &Rows, base: usize, vocab: usize) -> f64 {
    if vocab == 0 {
        return f64::NAN;
    }
    let a = match p {
        Rows::F16(s) => half_argmax(&s[base..base + vocab], 0x7c00),
        Rows::BF16(s) => half_argmax(&s[base..base + vocab], 0x7f80),
        Rows::F32(s) => float_argmax(s[base..base + vocab].iter().copied()),
        Rows::F64(s) => float_argmax(s[base..base + vocab].iter().map(|&v| v as f32)),
    };
    let at = |rows: &Rows| -> f32 {
        match rows {
            Rows::F16(s) => crate::half::f16_to_f32(s[base + a]),
            Rows::BF16(s) => f32::from_bits((s[base + a] as u32) << 16),
            Rows::F32(s) => s[base + a],
            Rows::F64(s) => s[base + a] as f32,
        }
    };
    (at(q) - at(p)) as f64
}

/// numpy's argmax of f32 values: the first maximum, or the first NaN.
fn float_argmax(values: impl Iterator<Item = f32>) -> usize {
    let mut best = (0usize, f32::NEG_INFINITY);
    for (i, v) in values.enumerate() {
        if v.is_nan() {
            return i;
        }
        if v > best.1 || i == 0 {
            best = (i, v);
        }
    }
    best.0
}

/// Argmax of half bits. For halves without the sign bit the bit patterns sort as the values
/// (NaNs above infinity), so an integer maximum and a search for its first occurrence give
/// numpy's answer; a row with a negative entry (never a distribution) takes the float path.
/// `inf` is the format's infinity pattern. One pass: blocks of the row, each block's maximum
/// and sign bits vectorised (as i16, which orders the patterns below the sign bit as u16
/// does, and SSE2 has), the first block holding the row's maximum kept, and only that block
/// searched again.
fn half_argmax(row: &[u16], inf: u16) -> usize {
    const BLOCK: usize = 64;
    let (mut signs, mut top, mut top_block) = (0u16, i16::MIN, 0usize);
    for (b, block) in row.chunks(BLOCK).enumerate() {
        let (or, max) = block.iter().fold((0u16, i16::MIN), |(or, max), &h| {
            (or | h, max.max(h as i16))
        });
        signs |= or;
        if max > top {
            (top, top_block) = (max, b);
        }
    }
    if signs & 0x8000 != 0 {
        let widen = |h: u16| {
            if inf == 0x7c00 {
                crate::half::f16_to_f32(h)
            } else {
                f32::from_bits((h as u32) << 16)
            }
        };
        return float_argmax(row.iter().map(|&h| widen(h)));
    }
    let top = top as u16; // no sign bit anywhere: the i16 maximum is the u16 one
    if top > inf {
        // A NaN: numpy names the first NaN, whatever its payload.
        return row.iter().position(|&h| h > inf).unwrap_or(0);
    }
    let start = top_block * BLOCK;
    start + row[start..].iter().position(|&h| h == top).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f16(v: f32) -> u16 {
        // Exact for the values used here (multiples of 2^-10 in [0, 1]).
        let bits = v.to_bits();
        if v == 0.0 {
            return 0;
        }
        let exp = ((bits >> 23) & 0xff) as i32 - 127 + 15;
        let mant = (bits >> 13) & 0x3ff;
        ((exp as u32) << 10 | mant) as u16
    }

    #[test]
    fn block_argmax_is_the_first_maximum_of_the_widened_row() {
        // Rows of several blocks (the last partial), the maximum repeated in later blocks or
        // in the last one, a NaN, a negative entry: numpy's argmax of the widened values.
        let widen = |h: u16| crate::half::f16_to_f32(h);
        let mut state = 12345u32;
        let mut next = move || {
            state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            state >> 8
        };
        for case in 0..200 {
            let n = 1 + (next() as usize % 1000);
            let mut row: Vec<u16> = (0..n).map(|_| (next() % 0x3c00) as u16).collect();
            let at = next() as usize % n;
            row[at] = 0x3c00; // 1.0, the maximum
            if case % 3 == 0 {
                let again = next() as usize % n;
                row[again] = 0x3c00; // a tie: the first wins
            }
            if case % 17 == 0 {
                row[next() as usize % n] = 0x7e01; // a NaN
            }
            if case % 23 == 0 {
                row[next() as usize % n] = 0x8400; // a negative entry
            }
            let want = float_argmax(row.iter().map(|&h| widen(h)));
            assert_eq!(half_argmax(&row, 0x7c00), want, "case {case}, length {n}");
        }
    }

    #[test]
    fn first_maximum_and_its_difference_in_every_format() {
        let p = [0.25f32, 0.5, 0.125, 0.5, 0.125];
        let q = [0.5f32, 0.25, 0.125, 0.0, 0.125];
        let want = q[1] as f64 - p[1] as f64; // the first of the two maxima
        let p16: Vec<u16> = p.iter().map(|&v| f16(v)).collect();
        let q16: Vec<u16> = q.iter().map(|&v| f16(v)).collect();
        let pb: Vec<u16> = p.iter().map(|v| (v.to_bits() >> 16) as u16).collect();
        let qb: Vec<u16> = q.iter().map(|v| (v.to_bits() >> 16) as u16).collect();
        let p64: Vec<f64> = p.iter().map(|&v| v as f64).collect();
        let q64: Vec<f64> = q.iter().map(|&v| v as f64).collect();
        for (a, b) in [
            (Rows::F16(&p16), Rows::F16(&q16)),
            (Rows::BF16(&pb), Rows::BF16(&qb)),
            (Rows::F32(&p), Rows::F32(&q)),
            (Rows::F64(&p64), Rows::F64(&q64)),
        ] {
            assert_eq!(row_top_delta(a, b, 1, 5).unwrap(), vec![want]);
        }
    }

    #[test]
    fn nan_and_negative_rows_follow_numpy() {
        let nan = 0x7e00u16;
        let p = [f16(0.5), nan, f16(0.75)];
        let q = [f16(0.25), f16(0.25), f16(0.25)];
        assert!(row_top_delta(Rows::F16(&p), Rows::F16(&q), 1, 3).unwrap()[0].is_nan());
        // A negative entry: the float path, the largest value wins.
        let p = [0xbc00u16 /* -1 */, f16(0.25), f16(0.5)];
        let d = row_top_delta(Rows::F16(&p), Rows::F16(&q), 1, 3).unwrap()[0];
        assert_eq!(d, 0.25 - 0.5);
        // Two rows, and a shape that does not fit is an error.
        let p2 = [f16(0.5), f16(0.5), f16(0.0), f16(1.0)];
        let q2 = [f16(0.0), f16(1.0), f16(0.5), f16(0.5)];
        let d = row_top_delta(Rows::F16(&p2), Rows::F16(&q2), 2, 2).unwrap();
        assert_eq!(d, vec![-0.5, -0.5]);
        assert!(row_top_delta(Rows::F16(&p2), Rows::F16(&q2), 3, 2).is_err());
    }
}
