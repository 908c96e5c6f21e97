"""The studentized (bootstrap-t) interval and the ratio's test-inversion set, against cases
with a known answer: normal documents, where the t interval is exact."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvcouple import _core
from kvcouple.analysis import stats as st
from kvcouple.analysis.bootstrap import Bootstrap, bootstrap_table
from kvcouple.analysis.distributions import t_ppf
from kvcouple.analysis.estimates import Table
from kvcouple.analysis.intervals import DEFAULT_CI_METHOD, STUDENTIZED_MIN_DOCS, Statistic
from kvcouple.analysis.studentized import DeltaMethod, symmetric_sorted

N_DOCS = 16
STUDIES = 300
# A coverage estimated from STUDIES independent studies has standard error
# sqrt(0.95 * 0.05 / STUDIES) (0.0126): the checks allow three.
COVERAGE_TOL = 3 * math.sqrt(0.95 * 0.05 / STUDIES)


def _bootstrap(cols: dict[str, np.ndarray], seed: int, n_boot: int = 999) -> Bootstrap:
    table = Table([f"d{i}" for i in range(len(next(iter(cols.values()))))], dict(cols))
    return bootstrap_table(table, n_boot, seed, 0.95, "studentized")


def test_counts_are_the_resamples_of_the_means():
    rng = np.random.default_rng(0)
    mat = rng.normal(size=(9, 3))
    counts = _core.bootstrap_counts(9, 40, 5)
    assert counts.shape == (40, 9) and (counts.sum(1) == 9).all()
    np.testing.assert_allclose(counts @ mat / 9, _core.bootstrap_means(mat, 40, 5), atol=1e-12)


def test_the_jackknife_kernel_equals_its_definition_inside_every_resample():
    """``_core.jackknife_se`` (the studentized interval's standard error inside each resample)
    against ``sqrt((n-1)/n sum w (v - mean)^2)`` in numpy: draw counts from the bootstrap,
    values far from 0 (no cancellation), NaN at undrawn documents ignored and at drawn ones
    propagated, a row without draws NaN; shapes that differ refused, typed."""
    rng = np.random.default_rng(3)
    counts = _core.bootstrap_counts(37, 500, 9).astype(np.float64)
    values = 1e6 + rng.normal(size=counts.shape)
    values[counts == 0] = np.nan  # never read: those documents are not drawn
    n = counts.sum(1)
    mean = np.nansum(counts * values, 1) / n
    want = np.sqrt((n - 1) / n * np.nansum(counts * (values - mean[:, None]) ** 2, 1))
    got = _core.jackknife_se(values, counts)
    np.testing.assert_allclose(got, want, rtol=1e-9)
    drawn = int(np.flatnonzero(counts[0])[0])
    values[0, drawn] = np.nan
    counts[1] = 0.0
    got = _core.jackknife_se(values, counts)
    assert np.isnan(got[0]) and np.isnan(got[1]) and np.isfinite(got[2:]).all()
    with pytest.raises(_core.ShapeError, match="one shape"):
        _core.jackknife_se(values, counts[:, :5])
    with pytest.raises(_core.ShapeError, match="C-contiguous"):
        _core.jackknife_se(values[:, ::2], counts[:, ::2])


def test_the_standard_error_of_a_mean_is_s_over_root_n():
    x = np.random.default_rng(1).normal(size=N_DOCS)
    e = _bootstrap({"p|x": x}, 0).evaluate(lambda g: g("p|x"))
    assert e.method == "studentized"
    assert e.se == pytest.approx(np.std(x, ddof=1) / math.sqrt(N_DOCS), rel=1e-12)
    # The interval is theta - t* se, t* the replicates' studentized values (sorted).
    assert e.tstar is not None and np.all(np.diff(e.tstar) >= 0)
    assert e.ci_low < e.estimate < e.ci_high


def test_normal_documents_cover_at_the_level_and_match_the_t_interval():
    """Normal documents: the t interval is exact; the bootstrap-t approximates it. Coverage of
    the mean within three Monte Carlo standard errors of 0.95; the mean width within 10% of
    the t interval's (the bootstrap-t's own Monte Carlo spread of its quantiles is a few %)."""
    rng = np.random.default_rng(2)
    t15 = float(t_ppf(0.975, N_DOCS - 1))
    hits, ratio = 0, []
    for study in range(STUDIES):
        x = rng.normal(3.0, 2.0, N_DOCS)
        e = _bootstrap({"p|x": x}, study).evaluate(lambda g: g("p|x"))
        hits += int(e.ci_low <= 3.0 <= e.ci_high)
        ratio.append((e.ci_high - e.ci_low) / (2 * t15 * np.std(x, ddof=1) / math.sqrt(N_DOCS)))
    assert abs(hits / STUDIES - 0.95) < COVERAGE_TOL, hits / STUDIES
    assert abs(np.mean(ratio) - 1.0) < 0.10, np.mean(ratio)


def test_paired_differences_of_normal_documents_cover():
    """A paired difference (correlated columns): coverage within 3 standard errors."""
    rng = np.random.default_rng(3)
    hits = 0
    for study in range(STUDIES):
        a = rng.normal(1.0, 1.0, N_DOCS)
        b = a + rng.normal(0.25, 0.5, N_DOCS)
        e = _bootstrap({"a|x": a, "b|x": b}, study).evaluate(lambda g: g("b|x") - g("a|x"))
        hits += int(e.ci_low <= 0.25 <= e.ci_high)
    assert abs(hits / STUDIES - 0.95) < COVERAGE_TOL, hits / STUDIES


def test_p_values_invert_the_studentized_interval():
    rng = np.random.default_rng(5)
    bs = _bootstrap({"x|v": rng.lognormal(0, 0.8, N_DOCS)}, 3, n_boot=3999).at_level(0.90)
    est = bs.evaluate(lambda g: g("x|v"))
    values = np.linspace(est.ci_low - 0.3, est.ci_high + 0.3, 41)
    agree = [
        (bs.p_value(est, "greater", v) < 0.05) == (est.ci_low > v)
        and (bs.p_value(est, "less", v) < 0.05) == (est.ci_high < v)
        for v in values
    ]
    assert sum(agree) >= len(values) - 2  # up to the replicates' granularity at the ends
    assert bs.p_value(est, "two-sided", est.estimate) == pytest.approx(1.0, abs=0.05)


def test_a_constant_statistic_has_a_point_interval():
    bs = _bootstrap({"p|x": np.full(N_DOCS, 0.5)}, 0)
    e = bs.evaluate(lambda g: g("p|x"))
    assert (e.ci_low, e.estimate, e.ci_high) == (0.5, 0.5, 0.5) and e.se == 0.0
    assert bs.p_value(e, "greater", 0.4) == 0.0 and bs.p_value(e, "greater", 0.6) == 1.0


def test_the_ratio_set_covers_when_the_denominator_is_clear_of_zero():
    """num/den of bivariate normal documents with den far from 0 (truth 0.5): the set is a
    bounded interval around the estimate and covers within three standard errors."""
    rng = np.random.default_rng(6)
    hits = 0
    for study in range(STUDIES // 2):
        den = rng.normal(2.0, 1.0, N_DOCS)
        num = 0.5 * den + rng.normal(0.0, 0.5, N_DOCS)
        e = _bootstrap({"p|n": num, "p|d": den}, study).ratio(
            lambda g: g("p|n"), lambda g: g("p|d")
        )
        assert math.isfinite(e.ci_low) and math.isfinite(e.ci_high) and e.exclude is None
        assert e.ci_low < e.estimate < e.ci_high
        hits += int(e.covers(0.5))
    tol = 3 * math.sqrt(0.95 * 0.05 / (STUDIES // 2))
    assert abs(hits / (STUDIES // 2) - 0.95) < tol, hits / (STUDIES // 2)


def test_the_ratio_set_is_unbounded_when_the_denominator_may_be_zero():
    """A denominator with mean 0: no bounded set can keep the level (Gleser and Hwang), and
    the set is unbounded (the whole line, or two rays with the excluded part named)."""
    rng = np.random.default_rng(7)
    num = rng.normal(1.0, 0.3, N_DOCS)
    den = rng.normal(0.0, 1.0, N_DOCS)
    den += 0.05 - den.mean()  # a mean a fifth of its standard error from 0
    e = _bootstrap({"p|n": num, "p|d": den}, 1).ratio(lambda g: g("p|n"), lambda g: g("p|d"))
    assert e.ci_low == -math.inf and e.ci_high == math.inf
    if e.exclude is not None:  # two rays: everything but an interval around 0
        lo, hi = e.exclude
        assert lo < hi and not e.covers(0.5 * (lo + hi)) and e.covers(hi + 1.0)
    assert e.covers(e.estimate)


def test_gap_rows_use_the_ratio_set_for_the_share():
    rng = np.random.default_rng(8)
    cols = {}
    for pol, scale in (("a", 1.0), ("b", 2.0)):
        occ = rng.uniform(0.2, 0.4, N_DOCS) * scale
        cols[f"{pol}|occurrence"] = occ
        cols[f"{pol}|occupation"] = occ * 4
        cols[f"{pol}|post_mismatches"] = occ * 4 * rng.uniform(0.3, 0.5, N_DOCS)
    bs = _bootstrap(cols, 2)
    fns = st.gap_fns("a", "b", 8)
    ests = st.gap_estimates(bs, fns)
    share = bs.ratio(fns["exposure_term"], fns["gap"])
    assert ests["exposure_share"].ci_low == share.ci_low
    assert ests["exposure_term"].method == "studentized"
    rows = st.gap_rows(bs, fns, {})
    assert [r["term"] for r in rows] == list(fns)


def test_the_default_is_studentized_and_few_documents_get_expanded_bca():
    rng = np.random.default_rng(9)
    n = STUDENTIZED_MIN_DOCS
    for docs, method in ((n, "studentized"), (n - 1, "expanded-bca"), (2, "expanded-bca")):
        x = rng.normal(size=docs)
        bs = bootstrap_table(Table([f"d{i}" for i in range(docs)], {"p|x": x}), 999, 0, 0.95)
        e = bs.evaluate(lambda g: g("p|x"))
        assert DEFAULT_CI_METHOD == "studentized" and e.method == method
        assert np.isfinite(e.ci_low) and e.ci_low < e.estimate < e.ci_high


def test_the_standard_error_inside_each_resample_is_the_delta_method_of_its_draws():
    """se* of resample b is the delta method over b's drawn documents (duplicates included):
    for a ratio of means ``sqrt(g' S g / (n - 1))``, ``S`` the draws' covariance (divisor n),
    ``g = (1/y, -x/y^2)``; for a mean exactly the jackknife of its draws; a column's NaN
    entries are left out as the bootstrap leaves them out."""
    rng = np.random.default_rng(10)
    x = rng.normal(size=12)
    y = rng.uniform(1, 2, size=12)
    bs = _bootstrap({"p|x": x, "p|y": y}, 4, n_boot=50)

    def ratio(g):
        return g("p|x") / g("p|y")

    point, boot, se, se_boot = bs.studentized_parts([ratio, lambda g: g("p|x")])
    counts = _core.bootstrap_counts(12, 50, 4)
    for b in range(5):
        draws = np.repeat(np.arange(12), counts[b])
        xb, yb = x[draws], y[draws]
        grad = np.array([1 / yb.mean(), -xb.mean() / yb.mean() ** 2])
        cov = np.cov(np.stack([xb, yb]), ddof=0)
        assert se_boot[b, 0] == pytest.approx(math.sqrt(grad @ cov @ grad / 11), rel=1e-6)
        assert boot[b, 0] == pytest.approx(xb.mean() / yb.mean(), rel=1e-12)
        loo = np.array([np.delete(xb, k).mean() for k in range(12)])
        want = math.sqrt(11 / 12 * np.sum((loo - loo.mean()) ** 2))
        assert se_boot[b, 1] == pytest.approx(want, rel=1e-9)
    # A column with NaN entries: its mean's standard error is over its finite documents.
    x[[2, 7]] = np.nan
    e = _bootstrap({"p|x": x}, 4).evaluate(lambda g: g("p|x"))
    f = x[np.isfinite(x)]
    assert e.se == pytest.approx(np.std(f) / math.sqrt(11), rel=1e-9)


def test_curve_points_take_closed_form_derivatives_equal_to_central_differences():
    """Every point of a policy's curves (survival, pmf, hazard, branch TV by lag) is a
    Statistic whose derivatives the delta method uses instead of central differences: equal
    to them (to their truncation and rounding) at the means and in every resample, NaN where
    a ratio's denominator is not positive (where central differences give NaN too), and the
    standard errors are those of central differences."""
    rng = np.random.default_rng(3)
    T, lags, n = 4, 3, 40
    hazards = rng.uniform(0.05, 0.5, size=(n, T))
    survival = np.concatenate([np.ones((n, 1)), np.cumprod(1 - hazards, axis=1)], axis=1)
    cols = {f"a|S|{t}": survival[:, t] for t in range(T + 1)}
    cols |= {f"a|pmf|{t}": survival[:, t - 1] - survival[:, t] for t in range(1, T + 1)}
    den = rng.uniform(0.2, 1.0, size=(n, lags))
    den[:, 2] = 0.0  # a lag no document reached: its TV is undefined
    cols |= {f"a|tvd|{lag}": den[:, lag] for lag in range(lags)}
    cols |= {f"a|tvn|{lag}": den[:, lag] * rng.uniform(0, 1, n) for lag in range(lags)}
    bs = _bootstrap(cols, seed=5, n_boot=200)
    fns = st.curve_fns("a", T, lags)
    assert all(isinstance(f, Statistic) for f in fns.values())
    dm = DeltaMethod(bs, list(fns.values()))
    for f, used in zip(fns.values(), dm.cols, strict=True):
        for means in (bs.point, bs.reps):
            closed = dm.gradient(f, used, means)
            numeric = dm.central_differences(f, used, means)
            np.testing.assert_array_equal(np.isnan(closed), np.isnan(numeric))
            np.testing.assert_allclose(closed, numeric, rtol=1e-6, atol=1e-9)
    assert np.isnan(dm.gradient(fns[("branch_tv", 2)], dm.cols[-1], bs.point)).all()
    se, _ = dm.standard_errors()
    plain = [lambda g, f=f: f.value(g) for f in fns.values()]  # the same, without derivatives
    se_numeric, _ = DeltaMethod(bs, plain).standard_errors()
    np.testing.assert_allclose(se, se_numeric, rtol=1e-6, equal_nan=True)


def test_symmetric_sorted_is_the_sort_of_t_and_minus_t():
    rng = np.random.default_rng(8)
    for n in (0, 1, 2, 7, 2000):
        t = np.round(rng.standard_normal(n) * 3, 1)  # ties
        if n >= 4:
            t[:4] = [np.inf, -np.inf, 0.0, -0.0]
        got = symmetric_sorted(t)
        np.testing.assert_array_equal(got, np.sort(np.concatenate([t, -t])))
        assert got.size == 2 * n
