//! The one place where Rust errors become Python exceptions.
//!
//! Every exception is a `ValueError` subclass (bad input) except `InternalError`, raised if a
//! Rust panic is caught at the boundary (a bug; never undefined behaviour).

use std::panic::{catch_unwind, AssertUnwindSafe};

use kvcouple_core::KvError;
use pyo3::create_exception;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

create_exception!(
    _core,
    InvalidInputError,
    PyValueError,
    "Input that kvcouple cannot use: the message names the first offending row or argument."
);
create_exception!(
    _core,
    ShapeError,
    InvalidInputError,
    "Arrays whose shapes do not fit together, or empty arrays."
);
create_exception!(
    _core,
    InvalidKernelError,
    InvalidInputError,
    "A synthetic kernel or kernel pair that is not well formed."
);
create_exception!(
    _core,
    InternalError,
    PyRuntimeError,
    "A bug in kvcouple's Rust core (a caught panic). Please report it."
);

pub fn to_py(e: KvError) -> PyErr {
    match e {
        KvError::Shape(_) => ShapeError::new_err(e.to_string()),
        KvError::InvalidKernel(_) => InvalidKernelError::new_err(e.to_string()),
        KvError::InvalidRow { .. } | KvError::InvalidArgument(_) => {
            InvalidInputError::new_err(e.to_string())
        }
    }
}

/// Run core code, mapping its error and any panic to Python exceptions.
pub fn guard<T>(f: impl FnOnce() -> Result<T, KvError>) -> PyResult<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r.map_err(to_py),
        Err(panic) => {
            let msg = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            Err(InternalError::new_err(msg))
        }
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("InvalidInputError", py.get_type::<InvalidInputError>())?;
    m.add("ShapeError", py.get_type::<ShapeError>())?;
    m.add("InvalidKernelError", py.get_type::<InvalidKernelError>())?;
    m.add("InternalError", py.get_type::<InternalError>())?;
    Ok(())
}
