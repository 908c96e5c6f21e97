"""The median divergence step (docs/statistics.md, ``median_tau``): the grouped-data median of
the pooled law, continuous in the law, the same function per document (Rust) and pooled
(numpy); its studentized interval inverts the test of ``F(x) = 1/2``, contains the estimate,
stays in ``[1/2, T + 1/2]`` on real-shaped tables and covers the population's median (three
Monte Carlo standard errors)."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from kvcouple import decomposition as dc
from kvcouple.analysis import analyze, studentized
from kvcouple.analysis import stats as st
from kvcouple.analysis.bootstrap import bootstrap_table
from kvcouple.analysis.estimates import Table
from kvcouple.analysis.intervals import Scale, Statistic
from kvcouple.analysis.moments import TableMoments
from kvcouple.analysis.studentized import DeltaMethod
from kvcouple.reference import estimates as ref
from kvcouple.synth.trace_store import write_synthetic_trace_store


def test_median_step_spreads_each_step_over_its_class():
    assert dc.median_step([0.0, 1.0, 0.0]) == 2.0  # a law on one step: that step
    assert dc.median_step([0.5, 0.5]) == 1.5
    assert dc.median_step([0.2, 0.2, 0.2]) == 2.0  # the conditional law: total 0.6
    assert dc.median_step([0.1, 0.3, 0.0]) == pytest.approx(1.5 + 0.1 / 0.3)
    assert math.isnan(dc.median_step([0.0, 0.0, 0.0]))  # nothing diverges
    # Along the resamples' axis, each column on its own.
    cols = dc.median_step(np.array([[1.0, 0.5, 0.0], [0.0, 0.5, 0.0]]))
    np.testing.assert_array_equal(cols[:2], [1.0, 1.5])
    assert math.isnan(cols[2])


def test_median_step_is_continuous_where_it_changes_class():
    # F(1) crosses 1/2: the median passes 1.5 without a jump (the smallest-step median jumps
    # from 1 to 2 there).
    eps = np.array([-1e-9, 0.0, 1e-9])
    values = [dc.median_step([0.5 + e, 0.5 - e, 0.0]) for e in eps]
    assert np.ptp(values) < 1e-8
    assert values[1] == pytest.approx(1.5)


def test_per_document_median_is_the_pooled_function():
    # The Rust per-unit median equals the reference's (test_unit_estimates_reference.py
    # compares every unit, median_tau included); the reference is the pooled function.
    for pmf in ([0.1, 0.3, 0.0], [0.0, 0.0, 0.7], [0.25, 0.25, 0.25, 0.25]):
        assert ref._median_tau(np.array(pmf)) == dc.median_step(np.array(pmf))


def _pmf_table(pmf: np.ndarray, policy: str = "p") -> Table:
    cols = {f"{policy}|pmf|{t + 1}": pmf[:, t] for t in range(pmf.shape[1])}
    return Table([f"d{i}" for i in range(len(pmf))], cols)


def _names(T: int, policy: str = "p") -> list[str]:
    return [f"{policy}|pmf|{t}" for t in range(1, T + 1)]


def _laws(rng: np.random.Generator, n: int, T: int, shape: str) -> np.ndarray:
    """Per-document pmfs of tau shaped like real traces."""
    if shape == "saturated":  # diverge with probability 0.9-1.0, mostly at once
        occ = rng.uniform(0.9, 1.0, n)
        law = rng.dirichlet(np.geomspace(4.0, 0.05, T), n)
    elif shape == "rare":  # diverge with probability 0-0.05
        occ = rng.uniform(0.0, 0.05, n)
        law = rng.dirichlet(np.ones(T), n)
    else:  # half never diverge
        occ = np.where(np.arange(n) % 2 == 0, 0.0, rng.uniform(0.1, 0.9, n))
        law = rng.dirichlet(np.ones(T) * 0.7, n)
    return law * occ[:, None]


@pytest.mark.parametrize("shape", ["saturated", "rare", "never"])
def test_interval_contains_the_estimate_inside_its_range(shape):
    rng = np.random.default_rng(5)
    T = 16
    pmf = _laws(rng, 24, T, shape)
    bs = bootstrap_table(_pmf_table(pmf), 400, 3, 0.95)
    est = bs.median_step(_names(T))
    assert est is not None
    assert est.estimate == pytest.approx(dc.median_step(pmf.mean(0)), rel=1e-12)
    assert 0.5 <= est.ci_low <= est.estimate <= est.ci_high <= T + 0.5
    assert est.ci_low < est.ci_high
    # The analysis reports it so, with the registry's range.
    (row,) = st.summary_estimates(bs, "p", ["median_tau"], T)
    assert (row.ci_low, row.ci_high) == (est.ci_low, est.ci_high)
    assert row.scale == Scale(0.5, T + 0.5)


def test_constant_law_is_a_point_and_nothing_diverging_has_no_interval():
    T = 6
    same = np.tile([0.2, 0.5, 0.1, 0.0, 0.0, 0.0], (10, 1))
    est = _median(same, T)
    assert est.constant and est.ci_low == est.estimate == est.ci_high
    none = _median(np.zeros((10, T)), T)
    assert math.isnan(none.estimate) and math.isnan(none.ci_low)


def _median(pmf: np.ndarray, T: int):
    est = bootstrap_table(_pmf_table(pmf), 200, 1, 0.95).median_step(_names(T))
    assert est is not None
    return est


def test_near_identical_resamples_do_not_set_the_median_tests_critical_value(monkeypatch):
    # Seven documents with nearly the same law (within 1e-9) and one spread over every step,
    # as a real model's recent:retain=0.5 on 8 documents: a resample of only the seven has a
    # standard error near 0, and studentized by it the test accepted everywhere ([1/2, T+1/2]).
    # Its standard error is floored at RESAMPLE_SE_FLOOR of the table's, as for every
    # studentized interval (test_analysis_boundaries.py).
    T = 8
    rng = np.random.default_rng(0)
    base = np.array([0.45, 0.35, 0.2, 0, 0, 0, 0, 0])
    pmf = np.array([base * (1 - 1e-9 * rng.random()) for _ in range(7)] + [np.full(T, 0.1)])
    est = bootstrap_table(_pmf_table(pmf), 999, 0, 0.95).median_step(_names(T))
    assert est is not None
    assert 1.0 < est.ci_low < est.estimate < est.ci_high < 6.0, est
    monkeypatch.setattr(studentized, "RESAMPLE_SE_FLOOR", 0.0)
    unfloored = bootstrap_table(_pmf_table(pmf), 999, 0, 0.95).median_step(_names(T))
    assert unfloored is not None and (unfloored.ci_low, unfloored.ci_high) == (0.5, T + 0.5)


@pytest.mark.parametrize("shape", ["saturated", "never"])
def test_p_value_inverts_the_set(shape):
    # The p-value of the test at a value is below 1 - level exactly where the set excludes
    # the value (away from the set's ends, which bisection places to ~1e-3 of a class), so a
    # plan rejects where the summary's interval excludes.
    rng = np.random.default_rng(11)
    T = 8
    bs = bootstrap_table(_pmf_table(_laws(rng, 24, T, shape)), 999, 2, 0.95)
    est = bs.median_step(_names(T))
    assert est is not None and est.ci_low < est.ci_high
    width = est.ci_high - est.ci_low
    assert bs.median_step_p_value(_names(T), "two-sided", est.estimate) > 0.9
    for value in np.linspace(0.6, T + 0.4, 157):
        p = bs.median_step_p_value(_names(T), "two-sided", float(value))
        margin = min(abs(value - est.ci_low), abs(value - est.ci_high))
        if margin > 0.01 * width:
            assert (p < 0.05) == (not est.ci_low <= value <= est.ci_high), (value, p, est)
    # One-sided: H0 "median <= value" far below the set is rejected, "median >= value" not.
    below = est.ci_low - 0.5 * width
    if below > 0.5:
        assert bs.median_step_p_value(_names(T), "greater", below) < 0.025
        assert bs.median_step_p_value(_names(T), "less", below) > 0.9
    above = est.ci_high + 0.5 * width
    if above < T + 0.5:
        assert bs.median_step_p_value(_names(T), "less", above) < 0.025
        assert bs.median_step_p_value(_names(T), "greater", above) > 0.9


def test_p_value_outside_the_range_constant_or_incomplete():
    T = 6
    rng = np.random.default_rng(3)
    bs = bootstrap_table(_pmf_table(_laws(rng, 16, T, "saturated")), 200, 1, 0.95)
    # The median lies in (1/2, T + 1/2]: beyond it the estimate decides.
    assert bs.median_step_p_value(_names(T), "greater", 0.5) == 0.0
    assert bs.median_step_p_value(_names(T), "less", 0.5) == 1.0
    assert bs.median_step_p_value(_names(T), "less", T + 0.5) == 0.0
    same = bootstrap_table(_pmf_table(np.tile([0.2, 0.5, 0.1, 0, 0, 0], (10, 1))), 200, 1, 0.95)
    m = dc.median_step(np.array([0.2, 0.5, 0.1, 0, 0, 0]))
    assert same.median_step_p_value(_names(T), "two-sided", m) == 1.0
    assert same.median_step_p_value(_names(T), "two-sided", m + 0.3) == 0.0
    with pytest.raises(ValueError, match="finite"):
        bs.median_step_p_value(_names(T), "two-sided", math.nan)
    holed = np.tile([0.3, 0.3, 0.2, 0.1, 0.0, 0.0], (12, 1)) + np.linspace(0, 0.05, 12)[:, None]
    holed[3, 2] = np.nan
    bs = bootstrap_table(_pmf_table(holed), 200, 1, 0.95)
    assert math.isnan(bs.median_step_p_value(_names(T), "two-sided", 2.0))


def test_other_methods_get_a_percentile_interval_of_the_same_median():
    rng = np.random.default_rng(2)
    T = 8
    pmf = _laws(rng, 30, T, "saturated")
    bs = bootstrap_table(_pmf_table(pmf), 400, 4, 0.95, method="percentile")
    (row,) = st.summary_estimates(bs, "p", ["median_tau"], T)
    assert row.method == "percentile"
    assert row.estimate == pytest.approx(dc.median_step(pmf.mean(0)), rel=1e-12)
    assert row.ci_low <= row.estimate <= row.ci_high


def test_incomplete_columns_leave_the_methods_interval():
    T = 4
    pmf = np.tile([0.3, 0.3, 0.2, 0.1], (12, 1)) + np.linspace(0, 0.05, 12)[:, None]
    pmf[3, 2] = np.nan
    bs = bootstrap_table(_pmf_table(pmf), 200, 1, 0.95)
    assert bs.median_step(_names(T)) is None


def test_gaussian_limit_gives_the_same_set_as_resampling():
    rng = np.random.default_rng(9)
    T = 12
    pmf = _laws(rng, 3000, T, "saturated")
    table = _pmf_table(pmf)
    a = bootstrap_table(table, 2000, 1, 0.95, gaussian=False).median_step(_names(T))
    b = bootstrap_table(table, 2000, 1, 0.95, gaussian=True).median_step(_names(T))
    assert a is not None and b is not None
    assert a.estimate == pytest.approx(b.estimate, rel=1e-12)
    width = a.ci_high - a.ci_low
    assert abs(a.ci_low - b.ci_low) < 0.1 * width
    assert abs(a.ci_high - b.ci_high) < 0.1 * width


@pytest.mark.parametrize("shape", ["saturated", "never"])
def test_interval_covers_the_population_median(shape):
    # Documents drawn from a fixed population of laws; the truth is its pooled median.
    rng = np.random.default_rng(11)
    T, n, studies = 8, 16, 150
    population = _laws(rng, 400, T, shape)
    truth = dc.median_step(population.mean(0))
    hits = 0
    for s in range(studies):
        pmf = population[rng.integers(len(population), size=n)]
        est = bootstrap_table(_pmf_table(pmf), 400, s, 0.95).median_step(_names(T))
        assert est is not None
        hits += est.covers(truth)
    se = math.sqrt(0.95 * 0.05 / studies)
    assert abs(hits / studies - 0.95) <= 3 * se, hits / studies


def _two_policy_store(tmp_path):
    """12 documents, policies a and b (b diverges more), T = 6."""
    pairs = {
        "a": {"P": np.full((5, 5), 0.2), "Q": np.full((5, 5), 0.2) * 0.6 + 0.4 * np.eye(5)},
        "b": {"P": np.full((5, 5), 0.2), "Q": np.full((5, 5), 0.2) * 0.3 + 0.7 * np.eye(5)},
    }
    return write_synthetic_trace_store(
        tmp_path / "s.zarr", pairs, horizon=6, branches=2, replicates=8, docs=12, seed=2
    )


def test_paired_difference_gets_the_test_inversion_set_on_the_difference_scale(tmp_path):
    # Not the delta method's interval of the difference: the set of shifts the studentized
    # test of F_b(x + delta) = F_a(x) accepts (test_median_difference.py), inside [-T, T].
    # This store's documents share their kernels: every document's law is the same, so the
    # set is the point, flagged constant.
    store = _two_policy_store(tmp_path)
    m = analyze(store, n_boot=300).models[0]
    T, bs = m.horizon, m.bootstrap
    assert bs is not None and bs.method == "studentized"
    (row,) = [r for r in m.tables["differences"] if r["quantity"] == "median_tau"]
    pmf = [_names(T, p) for p in (row["policy_a"], row["policy_b"])]
    want = bs.median_difference(*pmf)
    assert want is not None and want.method == "studentized" and want.constant
    assert (row["difference"], row["ci_low"], row["ci_high"]) == (
        want.estimate, want.ci_low, want.ci_high,
    )  # fmt: skip
    assert row["note"] == st.CONSTANT
    # Documents that differ: an interval around the estimate, inside [-T, T], unlike the
    # delta method's interval of the difference.
    rng = np.random.default_rng(4)
    T = 8
    cols = {**_pmf_table(_laws(rng, 20, T, "saturated"), "a").cols}
    cols.update(_pmf_table(_laws(rng, 20, T, "never"), "b").cols)
    bs = bootstrap_table(Table([f"d{i}" for i in range(20)], cols), 400, 2, 0.95)
    (got,) = st.difference_estimates(bs, "a", "b", ["median_tau"], T)
    want = bs.median_difference(_names(T, "a"), _names(T, "b"))
    assert want is not None and not want.constant
    assert (got.estimate, got.ci_low, got.ci_high) == (want.estimate, want.ci_low, want.ci_high)
    assert got.scale == Scale(-T, T)
    assert -T <= got.ci_low < got.estimate < got.ci_high <= T
    fa, fb = (st.quantity_fn(p, "median_tau", T) for p in ("a", "b"))
    delta = bs.evaluate(st.difference(fa, fb), False, Scale(-T, T))
    assert (delta.ci_low, delta.ci_high) != (got.ci_low, got.ci_high)


def test_median_gradient_in_closed_form_is_the_central_differences():
    # Random laws (resamples along the second axis), some with steps of no mass, one where
    # nothing diverges: the closed form agrees with central differences away from a class's
    # ends, and is NaN where the median is.
    rng = np.random.default_rng(3)
    pmf = rng.dirichlet(np.full(12, 0.4), size=400).T * rng.uniform(0.05, 1.0, 400)
    pmf[:, :40] *= rng.random((12, 40)) > 0.5
    pmf[:, 0] = 0.0
    grad = dc.median_step_gradient(pmf)
    assert grad.shape == pmf.shape
    assert np.isnan(grad[:, 0]).all()
    h = 1e-7
    numeric = np.empty_like(pmf)
    for s in range(pmf.shape[0]):
        up, down = pmf.copy(), pmf.copy()
        up[s] += h
        down[s] -= h
        numeric[s] = (dc.median_step(up) - dc.median_step(down)) / (2 * h)
    median = dc.median_step(pmf)
    share = median - np.floor(median + 0.5) + 0.5  # the position inside the median's class
    clear = np.isfinite(median) & (share > 1e-4) & (share < 1 - 1e-4)
    assert clear.sum() > 300
    np.testing.assert_allclose(grad[:, clear], numeric[:, clear], rtol=1e-5, atol=1e-6)
    # Mass moved below the median lowers it, above raises it (by 1/(2 p_t) each).
    assert (grad[:, clear] != 0).any()


def test_delta_method_uses_the_median_differences_closed_form(tmp_path):
    store = _two_policy_store(tmp_path)
    bs = analyze(store, n_boot=300).models[0].bootstrap
    assert bs is not None
    f = st.difference(*(st.quantity_fn(p, "median_tau", 6) for p in ("a", "b")))
    assert isinstance(f, Statistic)
    dm = DeltaMethod(bs, [f])
    (cols,) = dm.cols
    names = [bs.names[j] for j in cols]
    for means in (bs.point, bs.reps):
        want = np.zeros(means.shape[:-1] + (len(cols),))
        for sign, pol in ((-1.0, "a"), (1.0, "b")):
            pmf = np.stack([means[..., bs.names.index(f"{pol}|pmf|{t}")] for t in range(1, 7)])
            grad = dc.median_step_gradient(pmf)
            for t in range(1, 7):
                want[..., names.index(f"{pol}|pmf|{t}")] += sign * grad[t - 1]
        np.testing.assert_array_equal(dm.gradient(f, cols, means), want)


def test_a_median_at_its_class_end_takes_central_differences():
    # Documents whose laws sit on one step, half at step 1 and half at step 2: the pooled law
    # reaches 1/2 exactly at step 1's end, where the median has no derivative. The closed form
    # says so (NaN) and the delta method takes central differences there, as it did before.
    pmf = np.zeros((16, 4))
    pmf[:8, 0], pmf[8:, 1] = 1.0, 1.0
    assert np.isnan(dc.median_step_gradient(pmf.mean(0))).all()
    cols = {
        f"{p}|pmf|{t + 1}": law[:, t] for p, law in (("a", pmf), ("b", pmf[::-1])) for t in range(4)
    }
    bs = bootstrap_table(Table([f"d{i}" for i in range(16)], cols), 200, 1, 0.95)
    f = st.difference(*(st.quantity_fn(p, "median_tau", 4) for p in ("a", "b")))
    assert isinstance(f, Statistic)
    dm = DeltaMethod(bs, [f])
    (used,) = dm.cols
    # At the point (the class's end): central differences themselves.
    np.testing.assert_array_equal(
        dm.gradient(f, used, bs.point), dm.central_differences(f, used, bs.point)
    )
    # Inside a class (the resamples'): the closed form, which central differences approach
    # (to their rounding: a column that is 0 in every document is stepped by 1e-12).
    np.testing.assert_allclose(
        dm.gradient(f, used, bs.reps), dm.central_differences(f, used, bs.reps), rtol=1e-3
    )


def _combined_from_the_documents(self, block, idx, weights):
    """The combinations' moments by a pass over the documents (the path before the table's
    moments were combined): the reference for the Gaussian limit's."""
    w = np.asarray(weights, np.float64)
    data = np.ascontiguousarray(block() @ w)
    return replace(
        self,
        names=[f"c{j}" for j in range(w.shape[1])],
        point=self.point[idx] @ w,
        reps=np.ascontiguousarray(self.reps[:, idx] @ w),
        data=data,
        jack=None,
        moments=TableMoments.of(data),
    )


def test_combined_moments_are_those_of_a_pass_over_the_combined_columns():
    rng = np.random.default_rng(4)
    mat = rng.normal(size=(500, 6)) @ rng.normal(size=(6, 6))
    mat[rng.random(500) < 0.1, 5] = np.nan  # column 5 is not complete
    moments = TableMoments.of(mat)
    w = rng.normal(size=(4, 2))
    got = moments.combination([3, 0, 2, 1], w, 500)
    want = TableMoments.of(mat[:, [3, 0, 2, 1]] @ w)
    np.testing.assert_allclose(got.point, want.point, rtol=1e-12)
    np.testing.assert_array_equal(got.count, want.count)
    np.testing.assert_allclose(got.gram, want.gram, rtol=1e-10)
    assert got.positive is None
    with pytest.raises(ValueError, match="non-finite"):
        moments.combination([0, 5], w[:2], 500)
    # A combination that cancels its columns (column 4 = columns 0 + 1): its variance is at
    # the level of rounding, so it is left to a pass over the rows.
    mat[:, 4] = mat[:, 0] + mat[:, 1]
    cancels = np.array([[1.0, 0.3], [1.0, 0.2], [-1.0, 0.1]])
    assert TableMoments.of(mat).combination([0, 1, 4], cancels, 500) is None


@pytest.mark.parametrize("shape", ["saturated", "rare", "never"])
def test_gaussian_median_tests_read_the_tables_moments_not_the_documents(shape, monkeypatch):
    """In the Gaussian limit each class's test of the median step combines the table's moments
    (no pass over the documents), and its set and p-values are those of a pass over the
    combined columns."""
    rng = np.random.default_rng(21)
    T = 10
    bs = bootstrap_table(_pmf_table(_laws(rng, 6000, T, shape)), 2000, 3, 0.95)
    assert bs.gaussian
    calls = []
    combination = TableMoments.combination
    monkeypatch.setattr(TableMoments, "combination", lambda *a: calls.append(1) or combination(*a))
    got = bs.median_step(_names(T))
    p = [bs.median_step_p_value(_names(T), "two-sided", v) for v in (2.0, 4.5, 7.0)]
    assert calls and got is not None and math.isfinite(got.ci_low)
    monkeypatch.setattr(type(bs), "_combined", _combined_from_the_documents)
    want = bs.median_step(_names(T))
    assert want is not None
    np.testing.assert_allclose([got.ci_low, got.ci_high], [want.ci_low, want.ci_high], rtol=1e-9)
    want_p = [bs.median_step_p_value(_names(T), "two-sided", v) for v in (2.0, 4.5, 7.0)]
    np.testing.assert_allclose(p, want_p, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("gaussian", [False, True])
def test_completeness_and_constancy_of_the_law_in_both_limits(gaussian):
    """Where the resamples are the Gaussian limit's, completeness is read off the table's
    moments (their count of finite entries) and constancy checked on the first rows first:
    the same answers as a pass over the columns. A law that differs only after its first 64
    documents is not constant; one NaN leaves the method's interval (None)."""
    T, n = 4, 300
    pmf = np.tile([0.3, 0.3, 0.2, 0.1], (n, 1))
    flat = bootstrap_table(_pmf_table(pmf), 200, 1, 0.95, gaussian=gaussian)
    est = flat.median_step(_names(T))
    assert est is not None and est.constant and est.ci_low == est.ci_high == est.estimate
    late = pmf.copy()
    late[200:, 0], late[200:, 1] = 0.2, 0.4  # the first 200 documents alike
    varied = bootstrap_table(_pmf_table(late), 200, 1, 0.95, gaussian=gaussian)
    est = varied.median_step(_names(T))
    assert est is not None and not est.constant and est.ci_low < est.ci_high
    holed = late.copy()
    holed[250, 2] = np.nan
    bs = bootstrap_table(_pmf_table(holed), 200, 1, 0.95, gaussian=gaussian)
    assert bs.median_step(_names(T)) is None
    assert math.isnan(bs.median_step_p_value(_names(T), "two-sided", 2.0))
