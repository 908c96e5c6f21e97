//! Wrappers of the analysis kernels (`kvcouple-core::stats`): bootstrap of column means and
//! TV recomputed from stored distributions.

use kvcouple_core::stats::{bootstrap, recompute};
use numpy::{IntoPyArray, PyArray2, PyArrayMethods, PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::prelude::*;

use crate::arrays::MatrixPair;
use crate::errors::{guard, ShapeError};

/// Column means of `n_boot` document resamples of `values` (docs x cols); NaN entries skipped.
#[pyfunction]
#[pyo3(signature = (values, n_boot, seed))]
pub fn bootstrap_means<'py>(
    py: Python<'py>,
    values: PyReadonlyArray2<'py, f64>,
    n_boot: usize,
    seed: u64,
) -> PyResult<Bound<'py, PyArray2<f64>>> {
    let shape = values.shape();
    let (docs, cols) = (shape[0], shape[1]);
    let data = values
        .as_slice()
        .map_err(|_| ShapeError::new_err("values must be C-contiguous"))?;
    let out = py.detach(|| guard(|| bootstrap::bootstrap_means(data, docs, cols, n_boot, seed)))?;
    let flat = out.into_pyarray(py);
    flat.reshape([n_boot, cols])
}

/// Per-row TV between stored distributions; NaN for rows that hold NaN (never recorded).
#[pyfunction]
pub fn row_tv<'py>(
    py: Python<'py>,
    p: &Bound<'py, PyAny>,
    q: &Bound<'py, PyAny>,
    dtype: &str,
) -> PyResult<Bound<'py, numpy::PyArray1<f64>>> {
    let pair = MatrixPair::extract(p, q, dtype)?;
    let (rows, vocab) = pair.shape;
    let (pr, qr) = pair.views()?;
    let out = py.detach(|| guard(|| recompute::row_tv(pr, qr, rows, vocab)))?;
    Ok(out.into_pyarray(py))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(bootstrap_means, m)?)?;
    m.add_function(wrap_pyfunction!(row_tv, m)?)?;
    Ok(())
}
