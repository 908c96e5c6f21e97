//! Thin wrappers of the synthetic-pair tools (kvcouple-core `synth`): validation, random pairs,
//! the exact solver, the Monte Carlo estimators and the interval construction.
//!
//! A pair crosses the boundary as one tuple `(P_emit, P_next, P_start, Q_emit, Q_next,
//! Q_start)` (`KernelPair.arrays()`), read into [`PairArg`]; results come back as the same
//! tuple (`PairArrays`).

use kvcouple_core::synth::construction;
use kvcouple_core::synth::exact;
use kvcouple_core::synth::kernel::{self, Kernel, KernelPair, RandomPairOptions};
use kvcouple_core::synth::montecarlo::{self, Estimators, McOptions};
use numpy::{
    IntoPyArray, PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray2, PyUntypedArrayMethods,
};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::{guard, interruptible, InvalidInputError, InvalidKernelError};

type PairArrays<'py> = (
    Bound<'py, PyArray2<f64>>,
    Bound<'py, PyArray2<i64>>,
    i64,
    Bound<'py, PyArray2<f64>>,
    Bound<'py, PyArray2<i64>>,
    i64,
);

fn kernel(
    name: &str,
    emit: &PyReadonlyArray2<'_, f64>,
    next: &PyReadonlyArray2<'_, i64>,
    start: i64,
) -> PyResult<Kernel> {
    if emit.shape() != next.shape() {
        return Err(InvalidKernelError::new_err(format!(
            "{name}: {name}_emit has shape {:?} but {name}_next has shape {:?}",
            emit.shape(),
            next.shape()
        )));
    }
    let (s, v) = (emit.shape()[0], emit.shape()[1]);
    let contiguous =
        |_| InvalidKernelError::new_err(format!("{name}: arrays must be C-contiguous"));
    let e = emit.as_slice().map_err(contiguous)?;
    let n = next.as_slice().map_err(contiguous)?;
    guard(|| Kernel::new(name, e, n, s, v, start))
}

/// A kernel pair as Python passes it: the tuple `(P_emit, P_next, P_start, Q_emit, Q_next,
/// Q_start)` of `kvcouple.synth.KernelPair.arrays()`.
#[derive(FromPyObject)]
pub struct PairArg<'py>(
    PyReadonlyArray2<'py, f64>,
    PyReadonlyArray2<'py, i64>,
    i64,
    PyReadonlyArray2<'py, f64>,
    PyReadonlyArray2<'py, i64>,
    i64,
);

impl PairArg<'_> {
    /// The validated pair.
    fn pair(&self) -> PyResult<KernelPair> {
        let p = kernel("P", &self.0, &self.1, self.2)?;
        let q = kernel("Q", &self.3, &self.4, self.5)?;
        guard(|| KernelPair::new(p, q))
    }
}

fn kernel_arrays<'py>(
    py: Python<'py>,
    k: &Kernel,
) -> PyResult<(Bound<'py, PyArray2<f64>>, Bound<'py, PyArray2<i64>>, i64)> {
    let shape = [k.states, k.vocab];
    let emit = k.emit.clone().into_pyarray(py).reshape(shape)?;
    let next: Vec<i64> = k.next.iter().map(|&n| n as i64).collect();
    let next = next.into_pyarray(py).reshape(shape)?;
    Ok((emit, next, k.start as i64))
}

fn pair_arrays<'py>(py: Python<'py>, pr: &KernelPair) -> PyResult<PairArrays<'py>> {
    let (pe, pn, ps) = kernel_arrays(py, &pr.p)?;
    let (qe, qn, qs) = kernel_arrays(py, &pr.q)?;
    Ok((pe, pn, ps, qe, qn, qs))
}

fn count(name: &str, value: i64) -> PyResult<usize> {
    usize::try_from(value)
        .map_err(|_| InvalidInputError::new_err(format!("{name} = {value} must be >= 0")))
}

/// Validate a pair; returns its arrays with rows renormalised exactly.
#[pyfunction]
pub fn synth_validate<'py>(py: Python<'py>, pair: PairArg<'py>) -> PyResult<PairArrays<'py>> {
    let pr = pair.pair()?;
    pair_arrays(py, &pr)
}

/// A seeded random pair (see `kvcouple.synth.random_pair`).
#[pyfunction]
#[pyo3(signature = (vocab, states, seed, *, closeness=0.5, sparsity=0.0, absorbing=false, deterministic=0.0, markov=false))]
pub fn synth_random_pair<'py>(
    py: Python<'py>,
    vocab: i64,
    states: i64,
    seed: u64,
    closeness: f64,
    sparsity: f64,
    absorbing: bool,
    deterministic: f64,
    markov: bool,
) -> PyResult<PairArrays<'py>> {
    let o = RandomPairOptions {
        vocab: count("vocab", vocab)?,
        states: count("states", states)?,
        closeness,
        sparsity,
        absorbing,
        deterministic,
        markov,
        seed,
    };
    let pr = guard(|| kernel::random_pair(&o))?;
    pair_arrays(py, &pr)
}

/// Exact quantities for horizon T and window L (see `kvcouple.synth.exact`).
#[pyfunction]
pub fn synth_exact<'py>(
    py: Python<'py>,
    pair: PairArg<'py>,
    horizon: i64,
    window: i64,
) -> PyResult<Bound<'py, PyDict>> {
    let pr = pair.pair()?;
    let (t, l) = (count("horizon", horizon)?, count("window", window)?);
    let e = interruptible(py, |c| exact::exact_with(&pr, t, l, c))?;
    let d = PyDict::new(py);
    d.set_item("horizon", e.horizon)?;
    d.set_item("window", e.window)?;
    d.set_item("expected_mismatches", e.expected_mismatches)?;
    d.set_item("mismatch_fraction", e.mismatch_fraction())?;
    d.set_item("occurrence", e.occurrence)?;
    d.set_item("first_mismatch", e.first_mismatch())?;
    d.set_item("occupation", e.occupation)?;
    d.set_item("exposure", e.exposure())?;
    d.set_item("rho", e.rho())?;
    d.set_item("window_contribution", e.window_contribution)?;
    d.set_item("tail_contribution", e.tail_contribution)?;
    d.set_item("tail_exposure", e.tail_exposure)?;
    d.set_item("interval_lower", e.interval_lower())?;
    d.set_item("interval_upper", e.interval_upper())?;
    d.set_item("survival", e.survival.into_pyarray(py))?;
    d.set_item(
        "divergence_time_pmf",
        e.divergence_time_pmf.into_pyarray(py),
    )?;
    d.set_item("hazard", e.hazard.into_pyarray(py))?;
    d.set_item("mismatch_by_step", e.mismatch_by_step.into_pyarray(py))?;
    d.set_item("branch_tv_by_lag", e.branch_tv_by_lag.into_pyarray(py))?;
    d.set_item("branch_lag_weight", e.branch_lag_weight.into_pyarray(py))?;
    Ok(d)
}

/// Per-replicate Monte Carlo values (see `kvcouple.synth.simulate`).
#[pyfunction]
#[pyo3(signature = (pair, horizon, window, *, estimator, replicates, branches=1, seed=0, trace_to_horizon=true))]
pub fn synth_simulate<'py>(
    py: Python<'py>,
    pair: PairArg<'py>,
    horizon: i64,
    window: i64,
    estimator: &str,
    replicates: i64,
    branches: i64,
    seed: u64,
    trace_to_horizon: bool,
) -> PyResult<Bound<'py, PyDict>> {
    let pr = pair.pair()?;
    // indicator and tv run the same branches: either returns both (the `*_tv` keys: tv's).
    // "rb", the former name, still reads.
    let estimators = match estimator {
        "naive" => Estimators::Naive,
        "indicator" | "tv" | "rb" => Estimators::IndicatorAndTv,
        other => {
            let hint = "use \"naive\", \"indicator\" or \"tv\"";
            let msg = format!("unknown estimator {other:?}: {hint}");
            return Err(InvalidInputError::new_err(msg));
        }
    };
    let o = McOptions {
        estimators,
        horizon: count("horizon", horizon)?,
        window: count("window", window)?,
        replicates: count("replicates", replicates)?,
        branches: count("branches", branches)?,
        seed,
        trace_to_horizon,
    };
    let out = interruptible(py, |c| montecarlo::simulate_with(&pr, &o, c))?;
    let d = PyDict::new(py);
    let lag_shape = [o.replicates, out.lags];
    d.set_item("occurrence", out.occurrence.into_pyarray(py))?;
    d.set_item("occupation", out.occupation.into_pyarray(py))?;
    d.set_item("tail_exposure", out.tail_exposure.into_pyarray(py))?;
    d.set_item(
        "window_contribution",
        out.window_contribution.into_pyarray(py),
    )?;
    d.set_item("tail_contribution", out.tail_contribution.into_pyarray(py))?;
    d.set_item(
        "expected_mismatches",
        out.expected_mismatches.into_pyarray(py),
    )?;
    if estimators == Estimators::IndicatorAndTv {
        d.set_item(
            "window_contribution_tv",
            out.window_contribution_tv.into_pyarray(py),
        )?;
        d.set_item(
            "tail_contribution_tv",
            out.tail_contribution_tv.into_pyarray(py),
        )?;
        d.set_item(
            "expected_mismatches_tv",
            out.expected_mismatches_tv.into_pyarray(py),
        )?;
    }
    let sums: Bound<'py, PyArray1<f64>> = out.branch_tv_sum.into_pyarray(py);
    d.set_item("branch_tv_sum", sums.reshape(lag_shape)?)?;
    let weights: Bound<'py, PyArray1<f64>> = out.branch_lag_weight.into_pyarray(py);
    d.set_item("branch_lag_weight", weights.reshape(lag_shape)?)?;
    d.set_item("evaluations", out.evaluations.into_pyarray(py))?;
    Ok(d)
}

/// The `(lower, upper)` construction pairs (see `kvcouple.synth.interval_constructions`).
#[pyfunction]
pub fn synth_interval_constructions<'py>(
    py: Python<'py>,
    pair: PairArg<'py>,
    horizon: i64,
    window: i64,
) -> PyResult<(PairArrays<'py>, PairArrays<'py>)> {
    let pr = pair.pair()?;
    let (t, l) = (count("horizon", horizon)?, count("window", window)?);
    let (lo, hi) = py.detach(|| guard(|| construction::interval_constructions(&pr, t, l)))?;
    Ok((pair_arrays(py, &lo)?, pair_arrays(py, &hi)?))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(synth_validate, m)?)?;
    m.add_function(wrap_pyfunction!(synth_random_pair, m)?)?;
    m.add_function(wrap_pyfunction!(synth_exact, m)?)?;
    m.add_function(wrap_pyfunction!(synth_simulate, m)?)?;
    m.add_function(wrap_pyfunction!(synth_interval_constructions, m)?)?;
    Ok(())
}
