//! Errors of the core crate. Every fallible public function returns `KvResult`;
//! the binding crate maps each variant to one Python exception class.

use thiserror::Error;

#[derive(Debug, Error, Clone, PartialEq)]
pub enum KvError {
    /// Arrays whose shapes do not fit together (or are empty).
    #[error("shape error: {0}")]
    Shape(String),
    /// A value that is not allowed (NaN, negative probability, uniform outside [0, 1)...).
    /// `row` is the first offending row.
    #[error("row {row}: {what}")]
    InvalidRow { row: usize, what: String },
    /// A parameter outside its domain (temperature <= 0, top_p outside (0, 1]...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A synthetic kernel or pair that is not well formed.
    #[error("invalid kernel: {0}")]
    InvalidKernel(String),
    /// The computation was cancelled (see [`crate::cancel`]).
    #[error("interrupted")]
    Interrupted,
}

pub type KvResult<T> = Result<T, KvError>;

impl KvError {
    pub fn row(row: usize, what: impl Into<String>) -> Self {
        KvError::InvalidRow {
            row,
            what: what.into(),
        }
    }
}
