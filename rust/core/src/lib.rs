//! kvcouple-core: the pure-Rust heart of kvcouple (no Python here).
//!
//! - [`divergence`]: per-row TV, KL, JS, Hellinger, entropies between next-token distributions;
//! - [`couple`]: the stepwise maximal coupling sampler;
//! - [`transform`]: the decoding transform (temperature, top-k, top-p) shared with the tracer.

pub mod cancel;
pub mod couple;
pub mod divergence;
pub mod error;
pub mod fastmath;
pub mod parallel;
pub mod rows;
pub mod stats;
pub mod synth;
pub mod transform;

pub use error::{KvError, KvResult};
