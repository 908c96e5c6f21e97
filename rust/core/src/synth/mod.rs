//! Synthetic kernel pairs with exact ground truth (SPEC sections 2 to 6).
//!
//! - [`kernel`]: finite-state emitters, the Markov shorthand, validation, random pairs;
//! - [`step`]: one SMC step on f64 rows (the rule of [`crate::couple`]);
//! - [`exact`]: the exact DP solver (decomposition, survival, window/tail, interval);
//! - [`montecarlo`]: the naive, indicator and tv (RB-CMC) estimators, parallel over replicates;
//! - [`construction`]: the pairs that attain both ends of the sharp interval;
//! - [`rng`]: the seeded per-replicate PRNG.

pub mod construction;
pub mod exact;
pub mod kernel;
pub mod montecarlo;
pub mod rng;
pub mod step;

#[cfg(test)]
mod tests;
