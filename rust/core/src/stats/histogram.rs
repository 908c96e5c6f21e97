//! Counts of float32 values in the bins of their order-preserving bit patterns: the
//! scoreboard's pooled steps beyond what it keeps exactly (`kvcouple.analysis.scoreboard`).

use crate::error::{KvError, KvResult};

/// The value's float32 bits mapped to an unsigned key in the order of the values (negative
/// values' bits inverted, positive values' sign bit set), as the Python side's
/// `_sortable_keys`.
#[inline]
pub fn sortable_key(value: f32) -> u32 {
    let bits = value.to_bits();
    if bits >> 31 == 1 {
        !bits
    } else {
        bits | (1 << 31)
    }
}

/// Add to `counts` (2^`bits` bins) the number of `values` whose key's top `bits` bits are
/// each bin's index.
pub fn count_keys(values: &[f32], counts: &mut [i64], bits: u32) -> KvResult<()> {
    if !(1..=24).contains(&bits) {
        return Err(KvError::InvalidArgument(format!(
            "histogram bits must be in 1..=24, got {bits}"
        )));
    }
    if counts.len() != 1usize << bits {
        return Err(KvError::Shape(format!(
            "{} bins for {bits} bits (need {})",
            counts.len(),
            1usize << bits
        )));
    }
    let shift = 32 - bits;
    for &v in values {
        counts[(sortable_key(v) >> shift) as usize] += 1;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_follow_the_values_order() {
        let values = [
            f32::NEG_INFINITY,
            -3.5,
            -1e-30,
            -0.0,
            0.0,
            1e-40,
            2.0,
            f32::INFINITY,
        ];
        for w in values.windows(2) {
            assert!(sortable_key(w[0]) <= sortable_key(w[1]), "{w:?}");
        }
    }

    #[test]
    fn counts_each_value_in_its_bin() {
        let values = [0.5f32, 0.5, -2.0, 7.0];
        let mut counts = vec![0i64; 1 << 4];
        count_keys(&values, &mut counts, 4).unwrap();
        assert_eq!(counts.iter().sum::<i64>(), 4);
        assert_eq!(counts[(sortable_key(0.5) >> 28) as usize], 2);
        assert_eq!(counts[(sortable_key(-2.0) >> 28) as usize], 1);
        // Counts add up across calls.
        count_keys(&values[..1], &mut counts, 4).unwrap();
        assert_eq!(counts[(sortable_key(0.5) >> 28) as usize], 3);
    }

    #[test]
    fn refuses_bins_that_do_not_fit_the_bits() {
        let mut counts = vec![0i64; 8];
        assert!(matches!(
            count_keys(&[1.0], &mut counts, 4),
            Err(KvError::Shape(_))
        ));
        assert!(matches!(
            count_keys(&[1.0], &mut counts, 0),
            Err(KvError::InvalidArgument(_))
        ));
    }
}
