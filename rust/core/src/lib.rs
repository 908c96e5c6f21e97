//! kvcouple-core: the pure-Rust heart of kvcouple (no Python here).
//!
//! - [`divergence`]: per-row TV, KL, JS, Hellinger, entropies between next-token distributions;
//! - [`couple`]: the stepwise maximal coupling sampler;
//! - [`transform`]: the decoding transform (temperature, top-k, top-p) shared with the tracer;
//! - [`rows`]: borrowed row matrices in the formats a model emits, [`half`] their 16-bit floats;
//! - [`row_tv`] and [`row_check`]: per-row TV of stored distributions and their validity
//!   (rows never recorded hold NaN);
//! - [`simd`]: the one decision of which compiled kernel variant runs on this CPU;
//! - [`stats`]: the heavy parts of the analysis's statistics (bootstrap, intervals);
//! - [`text_table`]: the analysis's large tables as CSV and JSON text, column-wise.

pub mod cancel;
pub mod couple;
pub mod divergence;
pub mod error;
pub mod fastmath;
pub mod half;
pub mod parallel;
pub mod row_check;
pub mod row_top;
pub mod row_tv;
pub mod rows;
pub mod simd;
pub mod stats;
pub mod synth;
pub mod text_table;
pub mod transform;

pub use error::{KvError, KvResult};
