"""The paired difference of two median steps and its test-inversion set
(:mod:`kvcouple.analysis.median_shift`): the test's statistic ``D(delta) = F_b(x + delta) -
F_a(x)``, its gradient and its resamples' variances each against a direct computation (a
bisection for ``x``, central differences, the resamples' documents drawn explicitly); the set
is the accepted hull, contains the estimate and stays in ``[-T, T]`` on real-shaped tables,
its p-value inverts it, and it covers the population's difference where the delta method's
interval did not (three Monte Carlo standard errors)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvcouple import _core
from kvcouple import decomposition as dc
from kvcouple.analysis import median_shift
from kvcouple.analysis.bootstrap import Bootstrap, bootstrap_table
from kvcouple.analysis.estimates import Table
from kvcouple.analysis.median_shift import MedianShiftTest


def _cdf(p: np.ndarray, y: float) -> float:
    """The grouped conditional CDF at ``y``, summed step by step (step s over (s-1/2, s+1/2])."""
    steps = np.arange(1, p.size + 1)
    return float((p * np.clip(y - (steps - 0.5), 0.0, 1.0)).sum() / p.sum())


def _statistic(pa: np.ndarray, pb: np.ndarray, delta: float) -> float:
    """``D(delta)`` with ``x`` the smallest point where ``(F_a(x) + F_b(x + delta)) / 2``
    reaches 1/2, found by bisection."""
    lo, hi = -abs(delta) - 1.0, pa.size + abs(delta) + 1.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if (_cdf(pa, mid) + _cdf(pb, mid + delta)) / 2 >= 0.5:
            hi = mid
        else:
            lo = mid
    return _cdf(pb, hi + delta) - _cdf(pa, hi)


def _pmf_gradient(coef: np.ndarray, at: np.ndarray, T: int) -> np.ndarray:
    """The gradient over the 2T pmf columns from the coefficients on the cumulative columns
    (column k of a law sums steps 1..k, so step s enters every k >= s)."""
    on_cumulative = np.zeros(2 * T + 2)
    np.add.at(on_cumulative, at, coef)
    a, b = on_cumulative[: T + 1], on_cumulative[T + 1 :]
    return np.concatenate([np.cumsum(a[::-1])[::-1][1:], np.cumsum(b[::-1])[::-1][1:]])


def _laws(rng: np.random.Generator, n: int, T: int, shape: str) -> tuple[np.ndarray, np.ndarray]:
    """Paired per-document laws of tau under two policies, shaped like real traces: b is a
    partly shifted a (a share 0-0.6 of its mass, the document's own, moved one step
    earlier), as a harsher policy's law is."""
    if shape == "saturated":  # diverge with probability 0.9-1.0, mostly early
        occ = rng.uniform(0.9, 1.0, n)
        law = rng.dirichlet(np.geomspace(4.0, 0.05, T), n)
    elif shape == "rare":  # with probability 0-0.05
        occ = rng.uniform(0.0, 0.05, n)
        law = rng.dirichlet(np.ones(T), n)
    elif shape == "never":  # half never diverge
        occ = np.where(np.arange(n) % 2 == 0, 0.0, rng.uniform(0.1, 0.9, n))
        law = rng.dirichlet(np.ones(T) * 0.7, n)
    else:  # spread
        occ = rng.uniform(0.1, 0.9, n)
        law = rng.dirichlet(np.ones(T), n)
    a = law * occ[:, None]
    earlier = np.concatenate([a[:, 1:2] + a[:, :1], a[:, 2:], np.zeros((n, 1))], axis=1)
    share = rng.uniform(0.0, 0.6, (n, 1))
    b = (1 - share) * a + share * earlier
    return a, b


def _names(T: int, policy: str) -> list[str]:
    return [f"{policy}|pmf|{t}" for t in range(1, T + 1)]


def _bootstrap(a: np.ndarray, b: np.ndarray, seed: int, n_boot: int = 400, **kw) -> Bootstrap:
    cols = {name: law[:, t] for law, p in ((a, "a"), (b, "b")) for t, name in
            enumerate(_names(a.shape[1], p))}  # fmt: skip
    return bootstrap_table(Table([f"d{i}" for i in range(len(a))], cols), n_boot, seed, 0.95, **kw)


def _test(bs: Bootstrap, T: int) -> MedianShiftTest:
    idx = {n: i for i, n in enumerate(bs.names)}
    return MedianShiftTest(bs, [idx[c] for c in _names(T, "a")], [idx[c] for c in _names(T, "b")])


@pytest.mark.parametrize("shape", ["spread", "saturated", "never"])
def test_statistic_is_the_difference_of_cdfs_at_the_average_laws_median(shape):
    rng = np.random.default_rng(1)
    T = 7
    a, b = _laws(rng, 16, T, shape)
    bs = _bootstrap(a, b, 3, 60)
    test = _test(bs, T)
    assert test.estimate == pytest.approx(
        dc.median_step(b.mean(0)) - dc.median_step(a.mean(0)), abs=1e-12
    )
    laws = np.vstack([np.concatenate([a.mean(0), b.mean(0)]), bs.reps[:, :14]])
    assert np.array_equal(bs.names[:14], _names(T, "a") + _names(T, "b"))
    for delta in (test.estimate, -2.5, -0.3, 0.0, 0.4, 3.0):
        d = test.statistic(delta)[0]
        want = [_statistic(row[:T], row[T:], delta) for row in laws]
        np.testing.assert_allclose(d, want, atol=1e-12)
    # At the estimate x is a's median and D is 0.
    assert test.median(test.estimate)[0] == pytest.approx(dc.median_step(a.mean(0)), abs=1e-12)
    assert abs(test.statistic(test.estimate)[0][0]) < 1e-12


def test_gradient_is_the_derivative_with_x_moving():
    # D as a function of the 2T means, x solved again at every step: central differences
    # agree with the closed form (the laws' terms scaled by 1 -+ r) away from class ends.
    rng = np.random.default_rng(2)
    T = 6
    checked = 0
    for _ in range(30):
        a, b = _laws(rng, 12, T, "spread")
        bs = _bootstrap(a, b, 1, 20)
        test = _test(bs, T)
        pa, pb = a.mean(0), b.mean(0)
        for delta in (-0.7, 0.2, 1.3):
            x = test.median(delta)[0]  # the table's
            ends = np.concatenate([np.arange(T + 1) + 0.5, np.arange(T + 1) + 0.5 - delta])
            if np.min(np.abs(x - ends)) < 1e-3:  # a kink of the CDFs: no derivative
                continue
            _, coef, at = test.statistic(delta)
            grad = _pmf_gradient(coef[0], at[0], T)
            h = 1e-7
            numeric = np.empty(2 * T)
            for s in range(2 * T):
                up, down = np.concatenate([pa, pb]), np.concatenate([pa, pb])
                up[s] += h
                down[s] -= h
                numeric[s] = (
                    _statistic(up[:T], up[T:], delta) - _statistic(down[:T], down[T:], delta)
                ) / (2 * h)
            np.testing.assert_allclose(grad, numeric, rtol=1e-5, atol=1e-6)
            checked += 1
    assert checked > 60


@pytest.mark.parametrize("grouped", [False, True])
def test_resamples_variances_are_their_drawn_documents(grouped, monkeypatch):
    # Both ways of reading a resample's moments: document by document, and by groups of
    # resamples sharing their columns (many documents; forced here).
    monkeypatch.setattr(median_shift, "GROUPED_DOCS", 0 if grouped else 10**9)
    rng = np.random.default_rng(3)
    T = 6
    a, b = _laws(rng, 14, T, "saturated")
    bs = _bootstrap(a, b, 7, 50, gaussian=False)
    test = _test(bs, T)
    x = np.hstack([a, b])
    counts = _core.bootstrap_counts(14, 50, 7).astype(float)
    for delta in (-1.0, test.estimate, 0.5):
        _, coef, at = test.statistic(delta)
        var = test._variances(coef, at)
        rows = [(np.ones(14), 0)] + [(counts[r], r + 1) for r in range(50)]
        for weights, row in rows:
            g = _pmf_gradient(coef[row], at[row], T)
            mean = weights @ x / 14
            cov = (weights[:, None] * (x - mean)).T @ (x - mean) / 14
            want = g @ cov @ g / 13
            assert var[row] == pytest.approx(want, rel=1e-8, abs=1e-15)


def test_gaussian_limit_variances_are_the_tables_covariance():
    rng = np.random.default_rng(4)
    T = 5
    a, b = _laws(rng, 40, T, "spread")
    bs = _bootstrap(a, b, 2, 30, gaussian=True)
    assert bs.moments is not None
    test = _test(bs, T)
    cov = np.cov(np.hstack([a, b]), rowvar=False, bias=True)
    _, coef, at = test.statistic(0.3)
    var = test._variances(coef, at)
    for row in range(31):
        g = _pmf_gradient(coef[row], at[row], T)
        assert var[row] == pytest.approx(g @ cov @ g / 39, rel=1e-9)


@pytest.mark.parametrize("gaussian", [False, True])
@pytest.mark.parametrize("shape", ["spread", "saturated", "rare", "never"])
def test_set_is_the_accepted_hull_around_the_estimate_inside_the_range(shape, gaussian):
    rng = np.random.default_rng(5)
    T = 10
    a, b = _laws(rng, 20, T, shape)
    bs = _bootstrap(a, b, 11, 400, gaussian=gaussian)
    test = _test(bs, T)
    est = test.interval()
    assert est.method == "studentized" and not est.constant
    assert -T <= est.ci_low < est.estimate < est.ci_high <= T
    assert test.accepts(est.estimate)
    # The ends are where acceptance stops (to the bisection's last bracket).
    for end, outward in ((est.ci_low, -1.0), (est.ci_high, 1.0)):
        reach = abs(end - est.estimate)
        tol = max(reach, median_shift.FIRST_STEP) / 2**median_shift.BISECTIONS * 1.01
        assert test.accepts(end)
        assert not test.accepts(end + outward * tol) or abs(end + outward * tol) > T


def test_degenerate_tables():
    T = 5
    law = np.tile([0.3, 0.2, 0.1, 0.0, 0.0], (12, 1))
    # Every document alike: the point, flagged constant.
    same = _bootstrap(law, law[:, ::-1].copy(), 1, 100).median_difference(
        _names(T, "a"), _names(T, "b")
    )
    assert same is not None and same.constant
    assert same.ci_low == same.estimate == same.ci_high
    # One policy never diverges: no median, no set.
    varied = law * np.linspace(0.5, 1.0, 12)[:, None]
    none = _bootstrap(varied, np.zeros_like(law), 1, 100).median_difference(
        _names(T, "a"), _names(T, "b")
    )
    assert none is not None and math.isnan(none.estimate) and math.isnan(none.ci_low)
    # A NaN entry: the caller's interval stands.
    holed = varied.copy()
    holed[2, 1] = np.nan
    bs = _bootstrap(holed, varied, 1, 100)
    assert bs.median_difference(_names(T, "a"), _names(T, "b")) is None
    assert math.isnan(bs.median_difference_p_value(_names(T, "a"), _names(T, "b"), "two-sided"))


def test_p_value_inverts_the_set():
    rng = np.random.default_rng(6)
    T = 8
    a, b = _laws(rng, 24, T, "saturated")
    bs = _bootstrap(a, b, 5, 999)
    names = (_names(T, "a"), _names(T, "b"))
    est = bs.median_difference(*names)
    assert est is not None
    width = est.ci_high - est.ci_low
    assert bs.median_difference_p_value(*names, "two-sided", est.estimate) == 1.0
    with pytest.raises(ValueError, match="finite"):
        bs.median_difference_p_value(*names, "two-sided", math.inf)
    for inside in (0.7 * est.ci_low + 0.3 * est.estimate, 0.7 * est.ci_high + 0.3 * est.estimate):
        assert bs.median_difference_p_value(*names, "two-sided", inside) > 0.05
    for outside in (est.ci_low - 0.2 * width, est.ci_high + 0.2 * width):
        assert bs.median_difference_p_value(*names, "two-sided", outside) < 0.05
    # One-sided: far below the set, "greater" (H0: difference <= value) is rejected.
    below = est.ci_low - width
    assert bs.median_difference_p_value(*names, "greater", below) < 0.025
    assert bs.median_difference_p_value(*names, "less", below) > 0.9


@pytest.mark.parametrize("shape", ["spread", "never"])
def test_set_covers_the_population_difference(shape):
    # In the "saturated" shape (medians near the end of class 1, exact laws without Monte
    # Carlo noise) the two laws' terms nearly cancel in some samples and the set covers about
    # 0.87 (the delta method's interval 0.83; docs/statistics.md): not asserted here.
    rng = np.random.default_rng(12)
    T, n, studies = 8, 16, 150
    pop_a, pop_b = _laws(rng, 400, T, shape)
    truth = dc.median_step(pop_b.mean(0)) - dc.median_step(pop_a.mean(0))
    hits = 0
    for s in range(studies):
        pick = rng.integers(len(pop_a), size=n)
        est = _bootstrap(pop_a[pick], pop_b[pick], s, 400).median_difference(
            _names(T, "a"), _names(T, "b")
        )
        assert est is not None
        hits += est.covers(truth)
    se = math.sqrt(0.95 * 0.05 / studies)
    assert abs(hits / studies - 0.95) <= 3 * se, hits / studies
