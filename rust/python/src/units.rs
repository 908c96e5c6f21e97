//! The per-unit RB-CMC estimates of a batch of (document, policy) units
//! (`kvcouple-core::stats::units`), for the analysis engine.

use kvcouple_core::error::KvResult;
use kvcouple_core::stats::units::{
    estimate_units as estimate, Estimator, UnitDamage, UnitEstimates, UnitInputs, UnitShape,
    SCALARS,
};
use numpy::ndarray::{Ix3, Ix4};
use numpy::{
    IntoPyArray, PyArray, PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray, PyReadonlyArray4,
    PyUntypedArrayMethods,
};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::{guard, ShapeError};

/// One damaged unit: (unit, kind, index, index, value); kind "hazard" (replicate, step),
/// "missing_branch" (replicate, -1, occurrence) or "branch_past_horizon" (replicate, branch,
/// step).
type Damage = (usize, &'static str, i64, i64, f64);

/// A batch's stored floats (`hazard`, `branch_tv`): both float32, as traced, or both float64.
enum Floats<'a> {
    F32(&'a [f32], &'a [f32]),
    F64(&'a [f64], &'a [f64]),
}

/// A batch's `branch_step`: int32, as traced, or int64.
enum Steps<'a> {
    I32(&'a [i32]),
    I64(&'a [i64]),
}

/// `a` as an array of `T` and dimension `D`: None where it is not one; an error (not a panic)
/// where it is but something holds it for writing.
pub(crate) fn read_as<'py, T: numpy::Element, D: numpy::ndarray::Dimension>(
    a: &Bound<'py, PyAny>,
    name: &str,
) -> PyResult<Option<PyReadonlyArray<'py, T, D>>> {
    match a.cast::<PyArray<T, D>>() {
        Err(_) => Ok(None),
        Ok(array) => array.try_readonly().map(Some).map_err(|e| {
            pyo3::exceptions::PyRuntimeError::new_err(format!("{name} cannot be read: {e}"))
        }),
    }
}

pub(crate) fn contiguous<'a, T: numpy::Element, D: numpy::ndarray::Dimension>(
    a: &'a PyReadonlyArray<'_, T, D>,
    name: &str,
) -> PyResult<&'a [T]> {
    a.as_slice()
        .map_err(|_| ShapeError::new_err(format!("{name} must be C-contiguous")))
}

/// The estimates of a batch whatever its stored types (read as stored, no converted copy).
fn estimate_any(
    floats: Floats<'_>,
    steps: Steps<'_>,
    mismatch: &[i8],
    shape: UnitShape,
    (obs_window, which, tail_observed): (usize, Estimator, bool),
) -> KvResult<UnitEstimates> {
    macro_rules! run {
        ($h:expr, $s:expr, $tv:expr) => {
            estimate(
                &UnitInputs {
                    hazard: $h,
                    branch_step: $s,
                    branch_mismatch: mismatch,
                    branch_tv: $tv,
                },
                shape,
                obs_window,
                which,
                tail_observed,
            )
        };
    }
    match (floats, steps) {
        (Floats::F32(h, tv), Steps::I32(s)) => run!(h, s, tv),
        (Floats::F32(h, tv), Steps::I64(s)) => run!(h, s, tv),
        (Floats::F64(h, tv), Steps::I32(s)) => run!(h, s, tv),
        (Floats::F64(h, tv), Steps::I64(s)) => run!(h, s, tv),
    }
}

/// Estimates of `units` (document, policy) pairs: `hazard` (units, R, T) and `branch_tv`
/// (units, R, K, lags) floats (both float32, as traced, or both float64), `branch_step`
/// (units, R, K) int32 or int64 and `branch_mismatch` (units, R, K, lags) int8, every one
/// C-contiguous: read as stored, no converted copy. Returns a dict of arrays (`values`,
/// `stderr`: units x 10 scalars; `survival` units x (T + 1); `pmf` units x T; `tv_lag_num`,
/// `tv_lag_den` units x lags; `median_tau` units) and `damage`, a list of
/// `(unit, kind, i, j, value)` for the units not estimated.
#[pyfunction]
#[pyo3(signature = (hazard, branch_step, branch_mismatch, branch_tv, obs_window, estimator, tail_observed))]
#[allow(clippy::too_many_arguments)]
pub fn estimate_units<'py>(
    py: Python<'py>,
    hazard: &Bound<'py, PyAny>,
    branch_step: &Bound<'py, PyAny>,
    branch_mismatch: PyReadonlyArray4<'py, i8>,
    branch_tv: &Bound<'py, PyAny>,
    obs_window: usize,
    estimator: &str,
    tail_observed: bool,
) -> PyResult<Bound<'py, PyDict>> {
    let which = match estimator {
        "indicator" => Estimator::Indicator,
        "tv" => Estimator::Tv,
        other => {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "estimator must be 'indicator' or 'tv', got {other:?}"
            )))
        }
    };
    let typed = |what: &str| ShapeError::new_err(what.to_string());
    let (h32, tv32) = (
        read_as::<f32, Ix3>(hazard, "hazard")?,
        read_as::<f32, Ix4>(branch_tv, "branch_tv")?,
    );
    let (h64, tv64) = (
        read_as::<f64, Ix3>(hazard, "hazard")?,
        read_as::<f64, Ix4>(branch_tv, "branch_tv")?,
    );
    let (floats, h) = match (&h32, &tv32, &h64, &tv64) {
        (Some(h), Some(tv), _, _) => (
            Floats::F32(contiguous(h, "hazard")?, contiguous(tv, "branch_tv")?),
            h.shape(),
        ),
        (_, _, Some(h), Some(tv)) => (
            Floats::F64(contiguous(h, "hazard")?, contiguous(tv, "branch_tv")?),
            h.shape(),
        ),
        _ => {
            return Err(typed(
                "hazard (3-d) and branch_tv (4-d) must be float32 arrays or float64 arrays, \
                 both of one dtype",
            ))
        }
    };
    let (s32, s64) = (
        read_as::<i32, Ix3>(branch_step, "branch_step")?,
        read_as::<i64, Ix3>(branch_step, "branch_step")?,
    );
    let steps = match (&s32, &s64) {
        (Some(s), _) => Steps::I32(contiguous(s, "branch_step")?),
        (_, Some(s)) => Steps::I64(contiguous(s, "branch_step")?),
        _ => return Err(typed("branch_step must be a 3-d int32 or int64 array")),
    };
    let b = branch_mismatch.shape();
    let shape = UnitShape {
        units: h[0],
        replicates: h[1],
        horizon: h[2],
        branches: b[2],
        lags: b[3],
    };
    let mismatch = contiguous(&branch_mismatch, "branch_mismatch")?;
    let settings = (obs_window, which, tail_observed);
    let out = py.detach(|| guard(|| estimate_any(floats, steps, mismatch, shape, settings)))?;
    let (u, t, lags) = (shape.units, shape.horizon, shape.lags);
    let dict = PyDict::new(py);
    let matrix = |v: Vec<f64>, cols: usize| -> PyResult<Bound<'py, PyArray2<f64>>> {
        v.into_pyarray(py).reshape([u, cols])
    };
    dict.set_item("values", matrix(out.values, SCALARS)?)?;
    dict.set_item("stderr", matrix(out.stderr, SCALARS)?)?;
    dict.set_item("survival", matrix(out.survival, t + 1)?)?;
    dict.set_item("pmf", matrix(out.pmf, t)?)?;
    dict.set_item("tv_lag_num", matrix(out.tv_lag_num, lags)?)?;
    dict.set_item("tv_lag_den", matrix(out.tv_lag_den, lags)?)?;
    let median: Bound<'py, PyArray1<f64>> = out.median_tau.into_pyarray(py);
    dict.set_item("median_tau", median)?;
    let damage: Vec<Damage> = out
        .damage
        .iter()
        .enumerate()
        .filter_map(|(unit, d)| {
            d.map(|d| match d {
                UnitDamage::Hazard {
                    replicate,
                    step,
                    value,
                } => (unit, "hazard", replicate as i64, step as i64, value),
                UnitDamage::MissingBranch {
                    replicate,
                    occurrence,
                } => (unit, "missing_branch", replicate as i64, -1, occurrence),
                UnitDamage::BranchPastHorizon {
                    replicate,
                    branch,
                    step,
                } => (
                    unit,
                    "branch_past_horizon",
                    replicate as i64,
                    branch as i64,
                    step as f64,
                ),
            })
        })
        .collect();
    dict.set_item("damage", damage)?;
    Ok(dict)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(estimate_units, m)?)?;
    Ok(())
}
