//! The one place where Rust errors become Python exceptions.
//!
//! Every exception is a `ValueError` subclass (bad input) except `InternalError`, raised if a
//! Rust panic is caught at the boundary (a bug; never undefined behaviour).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::Duration;

use kvcouple_core::cancel::Cancel;
use kvcouple_core::KvError;
use kvcouple_fetch::FetchError;
use pyo3::create_exception;
use pyo3::exceptions::{PyKeyboardInterrupt, PyOSError, PyRuntimeError, PyValueError};
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

create_exception!(
    _core,
    ObjectStoreError,
    PyOSError,
    "A request to object storage that failed (after retries) for a reason other than the \
     object's absence: the message names the object."
);

pub fn to_py(e: KvError) -> PyErr {
    match e {
        KvError::Shape(_) => ShapeError::new_err(e.to_string()),
        KvError::InvalidKernel(_) => InvalidKernelError::new_err(e.to_string()),
        KvError::InvalidRow { .. } | KvError::InvalidArgument(_) => {
            InvalidInputError::new_err(e.to_string())
        }
        KvError::Interrupted => PyKeyboardInterrupt::new_err("interrupted"),
    }
}

pub fn fetch_to_py(e: FetchError) -> PyErr {
    match e {
        FetchError::Config(_) => InvalidInputError::new_err(e.to_string()),
        FetchError::Request { .. } => ObjectStoreError::new_err(e.to_string()),
        FetchError::Interrupted => PyKeyboardInterrupt::new_err("interrupted"),
    }
}

/// How often a waiting binding looks for Ctrl-C (and other signals).
const SIGNAL_POLL: Duration = Duration::from_millis(50);

/// Run a long core computation on a helper thread with the GIL released, checking for Python
/// signals while it runs: on Ctrl-C the computation is cancelled and the signal's exception
/// (KeyboardInterrupt) raised once it has stopped.
pub fn interruptible<T: Send>(
    py: Python<'_>,
    f: impl FnOnce(&Cancel) -> Result<T, KvError> + Send,
) -> PyResult<T> {
    let cancel = Cancel::new();
    let mut signal: Option<PyErr> = None;
    let out = py.detach(|| {
        std::thread::scope(|s| {
            let (tx, rx) = mpsc::channel();
            let cancel = &cancel;
            s.spawn(move || {
                let _ = tx.send(guard(|| f(cancel)));
            });
            loop {
                match rx.recv_timeout(SIGNAL_POLL) {
                    Ok(r) => return r,
                    Err(RecvTimeoutError::Timeout) => {
                        if signal.is_none() {
                            if let Err(e) = Python::attach(|py| py.check_signals()) {
                                signal = Some(e);
                                cancel.cancel();
                            }
                        }
                    }
                    Err(RecvTimeoutError::Disconnected) => {
                        return Err(InternalError::new_err("the computation thread stopped"));
                    }
                }
            }
        })
    });
    // A signal wins even if the computation finished before it saw the cancel.
    match signal {
        Some(e) => Err(e),
        None => out,
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
    m.add("ObjectStoreError", py.get_type::<ObjectStoreError>())?;
    Ok(())
}
