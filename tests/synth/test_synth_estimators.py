"""Monte Carlo estimators against the exact solver, variance dominance, determinism, and the
numba reference."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcouple
from kvcouple import _core, synth
from kvcouple.cli import main
from synth_helpers import tiny_kernel

QUANTITIES = (
    "occurrence",
    "occupation",
    "window_contribution",
    "tail_contribution",
    "expected_mismatches",
    "tail_exposure",
    "interval_lower",
    "interval_upper",
)
REPLICATES = 3000


def random_cases() -> list[tuple[synth.KernelPair, int, int]]:
    """At least 50 random pairs (V 2..6, S up to 8, T 1..16, several windows)."""
    rng = np.random.default_rng(2024)
    cases = []
    for seed in range(56):
        vocab = int(rng.integers(2, 7))
        states = int(rng.integers(2, 9))
        pair = synth.random_pair(
            vocab,
            states,
            seed=seed,
            closeness=float(rng.choice([0.5, 0.8, 0.95, 0.99])),
            sparsity=float(rng.choice([0.0, 0.3])),
            absorbing=bool(seed % 4 == 1),
            deterministic=float(rng.choice([0.0, 0.0, 0.2])),
            markov=bool(seed % 3 == 0),
        )
        horizon = int(rng.integers(1, 17))
        window = int(rng.choice([0, 1, 3, horizon // 2, horizon]))
        cases.append((pair, horizon, window))
    return cases


def edge_cases() -> list[tuple[str, synth.KernelPair, int, int]]:
    table = np.array([[0.2, 0.5, 0.3], [0.6, 0.2, 0.2], [0.1, 0.1, 0.8]])
    p2 = np.tile([1.0, 0.0], (2, 1))
    q2 = np.tile([0.0, 1.0], (2, 1))
    nxt = np.array([[1, 1], [1, 1]])
    first_only = synth.KernelPair(
        synth.Kernel(np.array([[1.0, 0.0], [0.5, 0.5]]), nxt, 0),
        synth.Kernel(np.array([[0.0, 1.0], [0.5, 0.5]]), nxt, 0),
    )
    return [
        ("identical", synth.KernelPair.markov(table, table, 0), 8, 3),
        ("disjoint", synth.KernelPair.markov(p2, q2, 0), 6, 2),
        ("tv1-at-step-1", first_only, 7, 2),
        ("deterministic", synth.random_pair(4, 5, seed=5, deterministic=0.7, closeness=0.9), 10, 3),
        ("absorbing", synth.random_pair(4, 4, seed=6, absorbing=True, closeness=0.8), 12, 4),
        ("rare-divergence", synth.random_pair(5, 4, seed=7, closeness=0.995), 16, 5),
    ]


def _tolerance(values: np.ndarray, name: str, horizon: int) -> float:
    """4 standard errors, floored at one event's resolution (all-zero samples have SE 0)."""
    n = len(values)
    se = float(np.std(values, ddof=1) / np.sqrt(n))
    scale = 1.0 if name == "occurrence" else float(horizon)
    return 4 * max(se, scale / n) + 1e-12


def _check(est: synth.MonteCarloEstimate, truth: synth.ExactResult, label: str) -> None:
    for name in QUANTITIES:
        values = est.values[name]
        tol = _tolerance(values, name, truth.horizon)
        got, want = float(np.mean(values)), getattr(truth, name)
        assert abs(got - want) <= tol, f"{label} {est.estimator} {name}: {got} vs exact {want}"


@pytest.mark.parametrize("estimator", synth.SYNTH_ESTIMATORS)
def test_every_mean_within_4_se_of_exact_on_random_pairs(estimator: str) -> None:
    for i, (pair, horizon, window) in enumerate(random_cases()):
        truth = synth.exact(pair, horizon, window)
        est = synth.estimate(
            pair, horizon, window, estimator=estimator, replicates=REPLICATES, branches=2, seed=i
        )
        _check(est, truth, f"case {i} (T={horizon}, L={window})")


@pytest.mark.parametrize("estimator", synth.SYNTH_ESTIMATORS)
@pytest.mark.parametrize("case", range(6))
def test_edge_cases_within_4_se(estimator: str, case: int) -> None:
    label, pair, horizon, window = edge_cases()[case]
    truth = synth.exact(pair, horizon, window)
    est = synth.estimate(
        pair, horizon, window, estimator=estimator, replicates=REPLICATES, seed=case
    )
    _check(est, truth, label)
    if label == "identical":
        assert all(np.all(est.values[k] == 0) for k in QUANTITIES)


def _var_and_se(x: np.ndarray) -> tuple[float, float]:
    """Sample variance and its standard error (from the fourth central moment)."""
    n = len(x)
    c = x - x.mean()
    var = float(np.mean(c**2) * n / (n - 1))
    m4 = float(np.mean(c**4))
    return var, float(np.sqrt(max(m4 - var**2, 0.0) / n))


def test_rb_variance_never_exceeds_naive() -> None:
    for i, (pair, horizon, window) in enumerate(random_cases()):
        truth = synth.exact(pair, horizon, window)
        runs = {
            m: synth.simulate(
                pair, horizon, window, estimator=m, replicates=REPLICATES, seed=100 + i
            )
            for m in ("naive", "indicator")
        }
        # Total loss: both variances sampled (SE floored at one event of size T).
        floor = horizon**2 / REPLICATES
        v_rb, s_rb = _var_and_se(runs["indicator"]["expected_mismatches"])
        v_nv, s_nv = _var_and_se(runs["naive"]["expected_mismatches"])
        tol = 4 * np.hypot(max(s_rb, floor), max(s_nv, floor))
        assert v_rb <= v_nv + tol, (i, v_rb, v_nv)
        # Functions of tau: the naive variance is exact, from the divergence-time law.
        t = np.arange(1, horizon + 1)
        pmf = truth.divergence_time_pmf
        for name, g in (
            ("occurrence", np.ones(horizon)),
            ("occupation", (horizon - t).astype(float)),
            ("tail_exposure", np.maximum(horizon - t - window, 0).astype(float)),
        ):
            v_naive = float(pmf @ g**2 - (pmf @ g) ** 2)
            v_rb, s_rb = _var_and_se(runs["indicator"][name])
            assert v_rb <= v_naive + 4 * s_rb + 1e-12, (i, name, v_rb, v_naive)


def test_rb_pays_off_when_divergence_is_rare() -> None:
    pair = synth.random_pair(5, 4, seed=7, closeness=0.995)
    naive = synth.estimate(pair, 16, 16, estimator="naive", replicates=4000, seed=1)
    rb = synth.estimate(pair, 16, 16, estimator="indicator", replicates=4000, seed=1)
    assert rb.variance("expected_mismatches") < 0.5 * naive.variance("expected_mismatches")


def test_branch_tv_by_lag_estimates() -> None:
    pair = synth.random_pair(4, 4, seed=11, closeness=0.9)
    truth = synth.exact(pair, 12, 6)
    for estimator in synth.SYNTH_ESTIMATORS:
        est = synth.estimate(pair, 12, 6, estimator=estimator, replicates=6000, seed=3)
        assert est.branch_tv_by_lag.shape == truth.branch_tv_by_lag.shape == (6,)
        err = np.abs(est.branch_tv_by_lag - truth.branch_tv_by_lag)
        assert np.all(err <= 4 * est.branch_tv_by_lag_se + 1e-3), (estimator, err)
        weights = est.raw["branch_lag_weight"]
        se = weights.std(0, ddof=1) / np.sqrt(len(weights))
        assert np.all(np.abs(weights.mean(0) - truth.branch_lag_weight) <= 4 * se + 1e-3)
        rate = est.mean["rho"]
        assert abs(rate - truth.rho) <= 4 * est.se["rho"] + 1e-9


def test_results_do_not_depend_on_the_thread_count() -> None:
    pair = synth.random_pair(5, 6, seed=4, closeness=0.9)
    before = kvcouple.get_num_threads()
    try:
        outs = []
        for n in (1, 2):
            kvcouple.set_num_threads(n)
            outs.append(
                synth.simulate(pair, 14, 4, estimator="indicator", replicates=777, branches=3)
            )
            outs.append(synth.simulate(pair, 14, 4, estimator="naive", replicates=777))
    finally:
        kvcouple.set_num_threads(0 if before == 0 else before)
    for a, b in zip(outs[:2], outs[2:], strict=True):
        assert a.keys() == b.keys()
        for k in a:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_seeds_give_different_streams() -> None:
    pair = synth.random_pair(4, 4, seed=4, closeness=0.9)
    a = synth.simulate(pair, 10, 3, estimator="naive", replicates=200, seed=1)
    b = synth.simulate(pair, 10, 3, estimator="naive", replicates=200, seed=2)
    assert not np.array_equal(a["expected_mismatches"], b["expected_mismatches"])


def test_window_only_tracing() -> None:
    pair = synth.random_pair(4, 4, seed=8, closeness=0.9)
    truth = synth.exact(pair, 12, 3)
    for estimator in synth.SYNTH_ESTIMATORS:
        est = synth.estimate(
            pair, 12, 3, estimator=estimator, replicates=4000, seed=5, trace="window"
        )
        assert np.isnan(est.mean["tail_contribution"]) and np.isnan(est.mean["expected_mismatches"])
        for name in ("occurrence", "window_contribution", "interval_lower", "interval_upper"):
            tol = _tolerance(est.values[name], name, 12)
            assert abs(est.mean[name] - getattr(truth, name)) <= tol, (estimator, name)
        full = synth.estimate(pair, 12, 3, estimator=estimator, replicates=200, seed=5)
        assert est.evaluations <= full.evaluations


def test_interval_from_estimates_covers_exact() -> None:
    pair = synth.random_pair(5, 5, seed=9, closeness=0.95)
    truth = synth.exact(pair, 16, 4)
    est = synth.estimate(pair, 16, 4, estimator="tv", replicates=4000, seed=2)
    iv = synth.interval(est, level=0.999)
    assert iv.ci_low <= truth.interval_lower and truth.interval_upper <= iv.ci_high
    assert iv.ci_low <= truth.expected_mismatches <= iv.ci_high
    lo, hi = iv.fractions()
    assert lo == pytest.approx(iv.lower / 16)
    exact_iv = synth.interval(truth)
    assert (exact_iv.lower, exact_iv.upper) == (truth.interval_lower, truth.interval_upper)
    assert exact_iv.ci_low == exact_iv.lower


def test_numba_reference_reproduces_the_replicates() -> None:
    from kvcouple.reference.synth import simulate_ref

    for seed in range(4):
        pair = synth.random_pair(
            3 + seed, 2 + seed, seed=seed, closeness=0.9, sparsity=0.2, absorbing=seed == 2
        )
        for estimator in ("naive", "indicator"):
            ours = _core.synth_simulate(
                pair.arrays(), 11, 3, estimator=estimator, replicates=300, branches=2, seed=seed
            )
            ref = simulate_ref(
                pair.arrays(), 11, 3, estimator=estimator, replicates=300, branches=2, seed=seed
            )
            for k, v in ref.items():
                np.testing.assert_allclose(ours[k], v, rtol=1e-12, atol=1e-12, err_msg=k)


def test_bad_arguments_raise_typed_errors() -> None:
    pair = synth.random_pair(3, 3, seed=0)
    with pytest.raises(kvcouple.InvalidInputError, match="horizon"):
        synth.exact(pair, 0, 2)
    with pytest.raises(kvcouple.InvalidInputError, match="horizon"):
        synth.estimate(pair, 0, 2)
    with pytest.raises(kvcouple.InvalidInputError, match="unknown estimator"):
        synth.estimate(pair, 5, 2, estimator="fast")  # type: ignore[arg-type]
    with pytest.raises(kvcouple.InvalidInputError, match="replicates"):
        synth.estimate(pair, 5, 2, replicates=0)
    with pytest.raises(kvcouple.InvalidInputError, match="branch"):
        synth.estimate(pair, 5, 2, branches=0)
    with pytest.raises(kvcouple.InvalidInputError, match="window"):
        synth.exact(pair, 5, -1)
    with pytest.raises(kvcouple.InvalidInputError, match="seed"):
        synth.estimate(pair, 5, 2, seed=-3)
    with pytest.raises(kvcouple.InvalidInputError, match="horizon"):
        synth.exact(pair, 2**21, 2)
    with pytest.raises(kvcouple.InvalidInputError, match="too many for the exact solver"):
        synth.exact(synth.random_pair(3, 64, seed=0), 2**20, 2**20)
    with pytest.raises(kvcouple.InvalidInputError, match="memory"):
        synth.estimate(pair, 2**20, 2**20, replicates=10**6)


@settings(max_examples=25)
@given(data=st.data())
def test_estimators_on_pairs_with_ties_and_zeros(data: st.DataObject) -> None:
    vocab = data.draw(st.integers(2, 3))
    pair = synth.KernelPair(data.draw(tiny_kernel(vocab)), data.draw(tiny_kernel(vocab)))
    horizon, window = data.draw(st.integers(1, 6)), data.draw(st.integers(0, 6))
    truth = synth.exact(pair, horizon, window)
    for i, estimator in enumerate(synth.SYNTH_ESTIMATORS):
        est = synth.estimate(pair, horizon, window, estimator=estimator, replicates=2000, seed=i)
        _check(est, truth, "tiny pair")


def _assert_warned(warned: pytest.WarningsRecorder, *new_names: str) -> None:
    """Each new name was named by one of the DeprecationWarnings caught."""
    said = " ".join(str(w.message) for w in warned)
    for name in new_names:
        assert f"use {name!r}" in said, (name, said)


def test_former_estimator_names_still_read_with_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One release of deprecated aliases for the estimator's former words: method=, "rb",
    "rb-tv", synth.METHODS / Method / Estimate, MonteCarloEstimate.method, the CLI's --method
    and its JSON key, and the numba reference's method=; each gives what the new word gives."""
    from kvcouple.reference.synth import simulate_ref

    pair = synth.random_pair(3, 3, seed=6, closeness=0.9)
    with pytest.warns(DeprecationWarning, match="use 'SYNTH_ESTIMATORS'"):
        assert synth.METHODS == synth.SYNTH_ESTIMATORS
    with pytest.warns(DeprecationWarning, match="use 'Estimator'"):
        assert synth.Method is synth.Estimator
    with pytest.warns(DeprecationWarning, match="use 'MonteCarloEstimate'"):
        assert synth.Estimate is synth.MonteCarloEstimate
    for old, new in (("rb", "indicator"), ("rb-tv", "tv"), ("naive", "naive")):
        want = synth.estimate(pair, 8, 3, estimator=new, replicates=50, seed=1)
        renamed = ("estimator",) if old == new else ("estimator", new)  # naive kept its name
        with pytest.warns(DeprecationWarning) as warned:
            got = synth.estimate(pair, 8, 3, method=old, replicates=50, seed=1)
        _assert_warned(warned, *renamed)
        assert got.estimator == new and got.mean == want.mean
        with pytest.warns(DeprecationWarning, match="use 'estimator'"):
            assert got.method == new
        assert got.to_dict()["method"] == old
        with pytest.warns(DeprecationWarning) as warned:
            raw = synth.simulate(pair, 8, 3, method=old, replicates=50, seed=1)
        _assert_warned(warned, *renamed)
        np.testing.assert_array_equal(
            raw["expected_mismatches"], want.values["expected_mismatches"]
        )
    with pytest.warns(DeprecationWarning, match="use 'tv'"):
        est = synth.estimate(pair, 8, 3, estimator="rb-tv", replicates=50)  # type: ignore[arg-type]
    assert est.estimator == "tv"
    with pytest.warns(DeprecationWarning, match="use 'estimator'"):
        ref = simulate_ref(pair.arrays(), 8, 3, method="rb", replicates=50, seed=1)
    want_ref = simulate_ref(pair.arrays(), 8, 3, estimator="indicator", replicates=50, seed=1)
    for k, v in want_ref.items():
        np.testing.assert_array_equal(ref[k], v, err_msg=k)
    path = tmp_path / "pair.npz"
    synth.save_pair(pair, path)
    args = ["synth", "estimate", "--pair", str(path), "-T", "8", "-L", "3", "--json"]
    with pytest.warns(DeprecationWarning) as warned:
        assert main([*args, "--method", "rb-tv", "--replicates", "50"]) == 0
    _assert_warned(warned, "estimator", "tv")
    out = json.loads(capsys.readouterr().out)
    assert out["estimator"] == "tv" and out["method"] == "rb-tv"
