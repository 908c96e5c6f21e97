//! The heavy parts of trace-store analysis.
//!
//! - [`bootstrap`]: document-level bootstrap of column means, seeded per replicate so that
//!   results do not depend on the number of threads;
//! - [`histogram`]: counts of float32 values in the bins of their order-preserving bit
//!   patterns (the scoreboard's pooled steps);
//! - [`intervals`]: percentile and BCa intervals of many statistics from their replicates;
//! - [`jackknife`]: jackknife standard errors of many rows of leave-one-out values (the
//!   studentized bootstrap's, inside every resample);
//! - [`moments`]: resample means of columns and of column products (the studentized
//!   interval's standard errors, in memory independent of resamples x documents);
//! - [`path_steps`]: the scoreboard's path steps of a batch of units in one pass.

pub mod bootstrap;
pub mod histogram;
pub mod intervals;
pub mod jackknife;
pub mod moments;
mod pairwise;
pub mod path_steps;
pub mod units;
