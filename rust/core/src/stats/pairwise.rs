//! numpy's pairwise summation, so that sums made in Rust agree with the numpy reference
//! implementations to the last bits in most cases.

/// numpy's pairwise summation for a contiguous run (blocks of 8 below 128 values), so that
/// the sums agree with the numpy reference to the last bits in most cases.
pub(crate) fn pairwise_sum(x: &[f64]) -> f64 {
    let n = x.len();
    if n < 8 {
        let mut s = 0.0;
        for &v in x {
            s += v;
        }
        return s;
    }
    if n <= 128 {
        // Eight running sums over blocks of eight (no bounds checks: they vectorise).
        let mut r = [0.0; 8];
        r.copy_from_slice(&x[..8]);
        let mut blocks = x[8..].chunks_exact(8);
        for block in &mut blocks {
            for (acc, &v) in r.iter_mut().zip(block) {
                *acc += v;
            }
        }
        let mut s = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for &v in blocks.remainder() {
            s += v;
        }
        return s;
    }
    let half = (n / 2) - (n / 2) % 8;
    pairwise_sum(&x[..half]) + pairwise_sum(&x[half..])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairwise_sum_matches_a_plain_sum_on_exact_values() {
        let x: Vec<f64> = (0..300).map(|i| i as f64).collect();
        assert_eq!(pairwise_sum(&x), 44850.0);
    }
}
