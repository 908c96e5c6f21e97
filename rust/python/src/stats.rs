//! Wrappers of the analysis kernels (`kvcouple-core::stats`): bootstrap of column means,
//! their intervals, jackknife standard errors.

use kvcouple_core::stats::path_steps as steps_kernel;
use kvcouple_core::stats::{bootstrap, histogram, intervals, jackknife, moments};
use numpy::ndarray::IxDyn;
use numpy::{
    IntoPyArray, PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray1, PyReadonlyArray2,
    PyReadonlyArrayDyn, PyReadwriteArray1, PyUntypedArrayMethods,
};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::{guard, ShapeError};
use crate::units::{contiguous, read_as};

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

/// How many times each document is drawn in each resample (n_boot x docs, uint32): the
/// resamples `bootstrap_means` makes with the same seed.
#[pyfunction]
#[pyo3(signature = (docs, n_boot, seed))]
pub fn bootstrap_counts<'py>(
    py: Python<'py>,
    docs: usize,
    n_boot: usize,
    seed: u64,
) -> PyResult<Bound<'py, PyArray2<u32>>> {
    let out = py.detach(|| guard(|| bootstrap::bootstrap_counts(docs, n_boot, seed)))?;
    out.into_pyarray(py).reshape([n_boot, docs])
}

/// Resample means of the centred products of the column `pairs` (P x 2) of `values`
/// (docs x cols): the draws of `bootstrap_means` with the same seed, in memory independent of
/// resamples x documents. Returns n_boot x P.
#[pyfunction]
#[pyo3(signature = (values, centers, pairs, n_boot, seed))]
pub fn bootstrap_moments<'py>(
    py: Python<'py>,
    values: PyReadonlyArray2<'py, f64>,
    centers: PyReadonlyArray1<'py, f64>,
    pairs: PyReadonlyArray2<'py, i64>,
    n_boot: usize,
    seed: u64,
) -> PyResult<Bound<'py, PyArray2<f64>>> {
    let (docs, cols) = (values.shape()[0], values.shape()[1]);
    if pairs.shape()[1] != 2 {
        return Err(ShapeError::new_err(format!(
            "pairs must be (P, 2), got {:?}",
            pairs.shape()
        )));
    }
    let not_contiguous = |name: &str| ShapeError::new_err(format!("{name} must be C-contiguous"));
    let data = values.as_slice().map_err(|_| not_contiguous("values"))?;
    let c = centers.as_slice().map_err(|_| not_contiguous("centers"))?;
    let flat = pairs.as_slice().map_err(|_| not_contiguous("pairs"))?;
    let mut list = Vec::with_capacity(flat.len() / 2);
    for pair in flat.chunks(2) {
        let (Ok(j), Ok(l)) = (usize::try_from(pair[0]), usize::try_from(pair[1])) else {
            return Err(ShapeError::new_err(format!(
                "pair {pair:?} has a negative column"
            )));
        };
        list.push((j, l));
    }
    let np = list.len();
    let x = py.detach(|| {
        guard(|| moments::bootstrap_moments(data, docs, cols, c, &list, n_boot, seed))
    })?;
    x.into_pyarray(py).reshape([n_boot, np])
}

/// Percentile or BCa intervals of k statistics: `reps` (n_boot x k), `point` (k), `jack`
/// (n_jack x k, leave-one-document-out values; used by BCa). Returns (k x 4): lower, upper,
/// z0, acceleration.
#[pyfunction]
#[pyo3(signature = (reps, point, jack, z_lower, z_upper, bca))]
pub fn bootstrap_intervals<'py>(
    py: Python<'py>,
    reps: PyReadonlyArray2<'py, f64>,
    point: PyReadonlyArray1<'py, f64>,
    jack: PyReadonlyArray2<'py, f64>,
    z_lower: f64,
    z_upper: f64,
    bca: bool,
) -> PyResult<Bound<'py, PyArray2<f64>>> {
    let (n_boot, n_jack) = (reps.shape()[0], jack.shape()[0]);
    let contiguous = |ok: bool, name: &str| {
        if ok {
            Ok(())
        } else {
            Err(ShapeError::new_err(format!("{name} must be C-contiguous")))
        }
    };
    contiguous(reps.is_c_contiguous(), "reps")?;
    contiguous(jack.is_c_contiguous(), "jack")?;
    let (r, p, j) = (reps.as_slice()?, point.as_slice()?, jack.as_slice()?);
    if reps.shape()[1] != p.len() || (n_jack > 0 && jack.shape()[1] != p.len()) {
        return Err(ShapeError::new_err(format!(
            "reps {:?}, point ({},) and jack {:?} must share the number of statistics",
            reps.shape(),
            p.len(),
            jack.shape()
        )));
    }
    let rows = py.detach(|| {
        guard(|| intervals::bootstrap_intervals(r, n_boot, p, j, n_jack, z_lower, z_upper, bca))
    })?;
    let flat: Vec<f64> = rows
        .iter()
        .flat_map(|x| [x.lower, x.upper, x.z0, x.accel])
        .collect();
    flat.into_pyarray(py).reshape([rows.len(), 4])
}

/// Jackknife standard errors of the rows of `values` (rows x n, leave-one-out values) with
/// draw counts `weights` (rows x n): `kvcouple-core::stats::jackknife`.
#[pyfunction]
#[pyo3(signature = (values, weights))]
pub fn jackknife_se<'py>(
    py: Python<'py>,
    values: PyReadonlyArray2<'py, f64>,
    weights: PyReadonlyArray2<'py, f64>,
) -> PyResult<Bound<'py, PyArray1<f64>>> {
    let (rows, n) = (values.shape()[0], values.shape()[1]);
    if weights.shape() != values.shape() {
        return Err(ShapeError::new_err(format!(
            "values {:?} and weights {:?} must have one shape (rows, n)",
            values.shape(),
            weights.shape()
        )));
    }
    let not_contiguous = |name: &str| ShapeError::new_err(format!("{name} must be C-contiguous"));
    let v = values.as_slice().map_err(|_| not_contiguous("values"))?;
    let w = weights.as_slice().map_err(|_| not_contiguous("weights"))?;
    let out = py.detach(|| guard(|| jackknife::jackknife_se(v, w, rows, n)))?;
    Ok(out.into_pyarray(py))
}

/// Add to `counts` (2^`bits` int64 bins, in place) the float32 `values` counted in the bins of
/// their order-preserving bit patterns' top `bits` bits (the scoreboard's histogram).
#[pyfunction]
#[pyo3(signature = (values, counts, bits))]
pub fn count_float_keys<'py>(
    py: Python<'py>,
    values: PyReadonlyArray1<'py, f32>,
    mut counts: PyReadwriteArray1<'py, i64>,
    bits: u32,
) -> PyResult<()> {
    let values = values
        .as_slice()
        .map_err(|_| ShapeError::new_err("values must be contiguous"))?;
    let counts = counts
        .as_slice_mut()
        .map_err(|_| ShapeError::new_err("counts must be contiguous"))?;
    py.detach(|| guard(|| histogram::count_keys(values, counts, bits)))
}

/// The scoreboard's path steps of a batch (`values` float64, `tokens` int32 and `flags` bool:
/// documents x policies x ..., C-contiguous, one shape): a step counts where its token was
/// generated and its value is finite. Returns a dict: `sizes`, `sums`, `squares` and
/// `flagged` (documents x policies; `flagged` None without flags), and per policy the counted
/// steps' `values` (float32: the pooled percentiles' precision) and `flags` (bool, or None),
/// document after document.
#[pyfunction]
#[pyo3(signature = (values, tokens, flags=None))]
pub fn path_steps<'py>(
    py: Python<'py>,
    values: &Bound<'py, PyAny>,
    tokens: PyReadonlyArrayDyn<'py, i32>,
    flags: Option<PyReadonlyArrayDyn<'py, bool>>,
) -> PyResult<Bound<'py, PyDict>> {
    // Read as stored (float32 as traced), or as float64: no converted copy.
    let narrow = read_as::<f32, IxDyn>(values, "values")?;
    let wide = read_as::<f64, IxDyn>(values, "values")?;
    let shape = match (&narrow, &wide) {
        (Some(v), _) => v.shape().to_vec(),
        (_, Some(v)) => v.shape().to_vec(),
        _ => {
            return Err(ShapeError::new_err(
                "values must be a float32 or float64 array",
            ))
        }
    };
    let same = tokens.shape() == shape.as_slice()
        && flags.as_ref().is_none_or(|f| f.shape() == shape.as_slice());
    if shape.len() < 2 || !same {
        return Err(ShapeError::new_err(format!(
            "values {shape:?}, tokens {:?} and flags must have one shape (documents, policies, \
             ...)",
            tokens.shape()
        )));
    }
    let (documents, policies) = (shape[0], shape[1]);
    let steps: usize = shape[2..].iter().product();
    let t = contiguous(&tokens, "tokens")?;
    let f = match &flags {
        Some(f) => Some(contiguous(f, "flags")?),
        None => None,
    };
    let out = if let Some(v) = &narrow {
        let v = contiguous(v, "values")?;
        py.detach(|| guard(|| steps_kernel::path_steps(v, t, f, documents, policies, steps)))?
    } else if let Some(v) = &wide {
        let v = contiguous(v, "values")?;
        py.detach(|| guard(|| steps_kernel::path_steps(v, t, f, documents, policies, steps)))?
    } else {
        return Err(ShapeError::new_err(
            "values must be a float32 or float64 array",
        ));
    };
    let units = |x: Vec<f64>| x.into_pyarray(py).reshape([documents, policies]);
    let dict = PyDict::new(py);
    dict.set_item(
        "sizes",
        out.sizes.into_pyarray(py).reshape([documents, policies])?,
    )?;
    dict.set_item("sums", units(out.sums)?)?;
    dict.set_item("squares", units(out.squares)?)?;
    if f.is_some() {
        dict.set_item("flagged", units(out.flagged)?)?;
        let flags: Vec<_> = out.flags.into_iter().map(|x| x.into_pyarray(py)).collect();
        dict.set_item("flags", flags)?;
    } else {
        dict.set_item("flagged", py.None())?;
        dict.set_item("flags", py.None())?;
    }
    let values: Vec<_> = out.values.into_iter().map(|x| x.into_pyarray(py)).collect();
    dict.set_item("values", values)?;
    Ok(dict)
}

/// Each segment's sum and sum of squares (in order, in f64) of `values` laid end to end in
/// segments of `sizes` (as `path_steps` sums a unit's steps).
#[pyfunction]
pub fn segment_sums<'py>(
    py: Python<'py>,
    values: PyReadonlyArray1<'py, f64>,
    sizes: PyReadonlyArray1<'py, i64>,
) -> PyResult<(Bound<'py, PyArray1<f64>>, Bound<'py, PyArray1<f64>>)> {
    let v = values
        .as_slice()
        .map_err(|_| ShapeError::new_err("values must be contiguous"))?;
    let s = sizes
        .as_slice()
        .map_err(|_| ShapeError::new_err("sizes must be contiguous"))?;
    let (sums, squares) = py.detach(|| guard(|| steps_kernel::segment_sums(v, s)))?;
    Ok((sums.into_pyarray(py), squares.into_pyarray(py)))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(path_steps, m)?)?;
    m.add_function(wrap_pyfunction!(segment_sums, m)?)?;
    m.add_function(wrap_pyfunction!(count_float_keys, m)?)?;
    m.add_function(wrap_pyfunction!(bootstrap_means, m)?)?;
    m.add_function(wrap_pyfunction!(bootstrap_counts, m)?)?;
    m.add_function(wrap_pyfunction!(bootstrap_moments, m)?)?;
    m.add_function(wrap_pyfunction!(bootstrap_intervals, m)?)?;
    m.add_function(wrap_pyfunction!(jackknife_se, m)?)?;
    Ok(())
}
