//! The per-unit RB-CMC estimates of a batch of (document, policy) units
//! (`kvcouple-core::stats::units`), for the analysis engine.

use kvcouple_core::stats::units::{
    estimate_units as estimate, Estimator, UnitDamage, UnitInputs, UnitShape, SCALARS,
};
use numpy::{
    IntoPyArray, PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray3, PyReadonlyArray4,
    PyUntypedArrayMethods,
};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::{guard, ShapeError};

/// One damaged unit: (unit, kind, index, index, value); kind "hazard" (replicate, step),
/// "missing_branch" (replicate, -1, occurrence) or "branch_past_horizon" (replicate, branch,
/// step).
type Damage = (usize, &'static str, i64, i64, f64);

/// Estimates of `units` (document, policy) pairs: `hazard` (units, R, T) doubles,
/// `branch_step` (units, R, K) int64, `branch_mismatch` (units, R, K, lags) int8 and
/// `branch_tv` (units, R, K, lags) doubles, every one C-contiguous. Returns a dict of arrays
/// (`values`, `stderr`: units x 10 scalars; `survival` units x (T + 1); `pmf` units x T;
/// `tv_lag_num`, `tv_lag_den` units x lags; `median_tau` units) and `damage`, a list of
/// `(unit, kind, i, j, value)` for the units not estimated.
#[pyfunction]
#[pyo3(signature = (hazard, branch_step, branch_mismatch, branch_tv, obs_window, estimator, tail_observed))]
#[allow(clippy::too_many_arguments)]
pub fn estimate_units<'py>(
    py: Python<'py>,
    hazard: PyReadonlyArray3<'py, f64>,
    branch_step: PyReadonlyArray3<'py, i64>,
    branch_mismatch: PyReadonlyArray4<'py, i8>,
    branch_tv: PyReadonlyArray4<'py, f64>,
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
    let (h, b) = (hazard.shape(), branch_mismatch.shape());
    let shape = UnitShape {
        units: h[0],
        replicates: h[1],
        horizon: h[2],
        branches: b[2],
        lags: b[3],
    };
    let contiguous = |name: &str| ShapeError::new_err(format!("{name} must be C-contiguous"));
    let inputs = UnitInputs {
        hazard: hazard.as_slice().map_err(|_| contiguous("hazard"))?,
        branch_step: branch_step
            .as_slice()
            .map_err(|_| contiguous("branch_step"))?,
        branch_mismatch: branch_mismatch
            .as_slice()
            .map_err(|_| contiguous("branch_mismatch"))?,
        branch_tv: branch_tv.as_slice().map_err(|_| contiguous("branch_tv"))?,
    };
    let out = py.detach(|| guard(|| estimate(&inputs, shape, obs_window, which, tail_observed)))?;
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
