//! A small seeded PRNG: xoshiro256++ seeded by SplitMix64.
//!
//! Every Monte Carlo replicate gets its own stream, derived from `(seed, replicate)` alone, so
//! results do not depend on how replicates are spread over threads. The numba reference
//! (`kvcouple.reference.synth`) implements the same generator bit for bit.

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// The SplitMix64 finaliser: a bijective 64-bit mix.
#[inline]
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// xoshiro256++ (Blackman and Vigna).
#[derive(Debug, Clone)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    /// A generator whose state is filled by SplitMix64 from `seed`.
    pub fn new(seed: u64) -> Self {
        let mut sm = seed;
        let mut s = [0u64; 4];
        for w in s.iter_mut() {
            sm = sm.wrapping_add(GOLDEN);
            *w = mix64(sm);
        }
        Rng { s }
    }

    /// The independent stream of one replicate (or of one pair generated from a seed).
    pub fn stream(seed: u64, index: u64) -> Self {
        // Mixing both inputs keeps streams of neighbouring indices from overlapping.
        Rng::new(mix64(
            seed ^ mix64(index.wrapping_add(0x632B_E59B_D9B4_E019)),
        ))
    }

    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let result = s[0].wrapping_add(s[3]).rotate_left(23).wrapping_add(s[0]);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// A uniform in [0, 1) with 53 random bits.
    #[inline]
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// A uniform integer in `0..n` (n > 0), by the float method (bias below 2^-40 for small n).
    #[inline]
    pub fn below(&mut self, n: usize) -> usize {
        ((self.uniform() * n as f64) as usize).min(n - 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_are_reproducible_and_distinct() {
        let a: Vec<u64> = (0..4).map(|_| Rng::stream(7, 3).next_u64()).collect();
        assert!(a.windows(2).all(|w| w[0] == w[1]));
        let mut r0 = Rng::stream(7, 0);
        let mut r1 = Rng::stream(7, 1);
        let x: Vec<u64> = (0..8).map(|_| r0.next_u64()).collect();
        let y: Vec<u64> = (0..8).map(|_| r1.next_u64()).collect();
        assert!(x.iter().all(|v| !y.contains(v)));
    }

    #[test]
    fn uniforms_in_unit_interval_with_right_mean() {
        let mut r = Rng::new(1);
        let n = 100_000;
        let mut sum = 0.0;
        for _ in 0..n {
            let u = r.uniform();
            assert!((0.0..1.0).contains(&u));
            sum += u;
        }
        assert!((sum / n as f64 - 0.5).abs() < 0.005);
    }
}
