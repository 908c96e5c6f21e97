//! Thin wrappers of the row kernels: divergences, coupling, the TV of stored rows.

use kvcouple_core::couple as core_couple;
use kvcouple_core::divergence::{self, Options};
use kvcouple_core::rows::Rows;
use kvcouple_core::transform::Transform;
use kvcouple_core::{row_tv as stored, KvResult};
use numpy::{IntoPyArray, PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::arrays::MatrixPair;
use crate::errors::{guard, ShapeError};

/// Divergences of each row pair; returns a dict of 1-D arrays (see `kvcouple.divergences`).
#[pyfunction]
#[pyo3(signature = (p, q, dtype, *, logits=false, temperature=1.0, top_k=None, top_p=None, renormalize=false, atol=None))]
pub fn divergences<'py>(
    py: Python<'py>,
    p: &Bound<'py, PyAny>,
    q: &Bound<'py, PyAny>,
    dtype: &str,
    logits: bool,
    temperature: f64,
    top_k: Option<usize>,
    top_p: Option<f64>,
    renormalize: bool,
    atol: Option<f64>,
) -> PyResult<Bound<'py, PyDict>> {
    let pair = MatrixPair::extract(p, q, dtype)?;
    let (rows, vocab) = pair.shape;
    let (pr, qr) = pair.views()?;
    let opts = Options {
        logits: logits.then_some(Transform {
            temperature,
            top_k,
            top_p,
        }),
        renormalize,
        atol,
    };
    let out = py.detach(|| guard(|| divergence::divergences(pr, qr, rows, vocab, &opts)))?;
    let d = PyDict::new(py);
    macro_rules! column {
        ($name:ident) => {
            d.set_item(
                stringify!($name),
                out.iter()
                    .map(|r| r.$name)
                    .collect::<Vec<_>>()
                    .into_pyarray(py),
            )?;
        };
    }
    column!(tv);
    column!(kl_pq);
    column!(kl_qp);
    column!(js);
    column!(hellinger);
    column!(entropy_p);
    column!(entropy_q);
    column!(overlap);
    column!(top1_agree);
    Ok(d)
}

/// Maximal coupling of each row pair; returns `(x, y, diverged)`.
#[pyfunction]
#[pyo3(signature = (p, q, u, dtype, *, renormalize=false, atol=None))]
pub fn couple<'py>(
    py: Python<'py>,
    p: &Bound<'py, PyAny>,
    q: &Bound<'py, PyAny>,
    u: PyReadonlyArray2<'py, f64>,
    dtype: &str,
    renormalize: bool,
    atol: Option<f64>,
) -> PyResult<(
    Bound<'py, numpy::PyArray1<i64>>,
    Bound<'py, numpy::PyArray1<i64>>,
    Bound<'py, numpy::PyArray1<bool>>,
)> {
    let pair = MatrixPair::extract(p, q, dtype)?;
    let (rows, vocab) = pair.shape;
    let us_shape = u.shape();
    if us_shape != [rows, 3] {
        return Err(ShapeError::new_err(format!(
            "u has shape ({}, {}), expected ({rows}, 3)",
            us_shape[0], us_shape[1]
        )));
    }
    let us = u
        .as_slice()
        .map_err(|_| ShapeError::new_err("u must be C-contiguous"))?;
    let (pr, qr) = pair.views()?;
    let draws =
        py.detach(|| guard(|| core_couple::couple(pr, qr, us, rows, vocab, renormalize, atol)))?;
    Ok((
        draws
            .iter()
            .map(|d| d.x)
            .collect::<Vec<_>>()
            .into_pyarray(py),
        draws
            .iter()
            .map(|d| d.y)
            .collect::<Vec<_>>()
            .into_pyarray(py),
        draws
            .iter()
            .map(|d| d.diverged)
            .collect::<Vec<_>>()
            .into_pyarray(py),
    ))
}

/// One value per row pair of `p` and `q` from `kernel`, run with the GIL released.
fn per_row<'py>(
    py: Python<'py>,
    (p, q): (&Bound<'py, PyAny>, &Bound<'py, PyAny>),
    dtype: &str,
    kernel: fn(Rows, Rows, usize, usize) -> KvResult<Vec<f64>>,
) -> PyResult<Bound<'py, numpy::PyArray1<f64>>> {
    let pair = MatrixPair::extract(p, q, dtype)?;
    let (rows, vocab) = pair.shape;
    let (pr, qr) = pair.views()?;
    let out = py.detach(|| guard(|| kernel(pr, qr, rows, vocab)))?;
    Ok(out.into_pyarray(py))
}

/// A plain streaming pass (convert and sum) over the same bytes: the benchmark's speed of light.
#[pyfunction]
pub fn plain_pass<'py>(
    py: Python<'py>,
    p: &Bound<'py, PyAny>,
    q: &Bound<'py, PyAny>,
    dtype: &str,
) -> PyResult<Bound<'py, numpy::PyArray1<f64>>> {
    per_row(py, (p, q), dtype, divergence::plain_pass)
}

/// Per-row TV between stored distributions; NaN for rows that hold NaN (never recorded).
#[pyfunction]
pub fn row_tv<'py>(
    py: Python<'py>,
    p: &Bound<'py, PyAny>,
    q: &Bound<'py, PyAny>,
    dtype: &str,
) -> PyResult<Bound<'py, numpy::PyArray1<f64>>> {
    per_row(py, (p, q), dtype, stored::row_tv)
}

/// Use `n` threads in every kernel (0: the default pool of all cores).
#[pyfunction]
pub fn set_num_threads(n: usize) -> PyResult<()> {
    guard(|| kvcouple_core::parallel::set_num_threads(n))
}

/// The number of threads kernels use.
#[pyfunction]
pub fn get_num_threads() -> usize {
    kvcouple_core::parallel::num_threads()
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(divergences, m)?)?;
    m.add_function(wrap_pyfunction!(couple, m)?)?;
    m.add_function(wrap_pyfunction!(plain_pass, m)?)?;
    m.add_function(wrap_pyfunction!(row_tv, m)?)?;
    m.add_function(wrap_pyfunction!(set_num_threads, m)?)?;
    m.add_function(wrap_pyfunction!(get_num_threads, m)?)?;
    Ok(())
}
