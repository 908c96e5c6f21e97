"""The studentized interval's small-sample rules (issue 36, docs/statistics.md "Coverage
study"): symmetric bootstrap-t on the quantity's scale, the symmetric Fieller set, and the
studentized simultaneous survival band with its floor on the resamples' standard errors.
Coverage checks allow three Monte Carlo standard errors."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvcouple.analysis import stats as st
from kvcouple.analysis.bootstrap import Bootstrap, bootstrap_table
from kvcouple.analysis.estimates import Table
from kvcouple.analysis.intervals import UNBOUNDED, Scale
from kvcouple.analysis.pvalues import studentized_p_value
from kvcouple.analysis.studentized import sup_t_band

N_DOCS = 16


def _tol(studies: int) -> float:
    return 3 * math.sqrt(0.95 * 0.05 / studies)


def _bootstrap(cols: dict[str, np.ndarray], seed: int, n_boot: int = 999) -> Bootstrap:
    n = len(next(iter(cols.values())))
    return bootstrap_table(Table([f"d{i}" for i in range(n)], dict(cols)), n_boot, seed, 0.95)


@pytest.mark.parametrize("scale", [UNBOUNDED, Scale(0.0, 10.0)])
def test_the_interval_is_symmetric_on_its_scale_and_its_p_values_invert_it(scale):
    """Skewed documents: the equal-tailed bootstrap-t would be lopsided; the symmetric one is
    ``psi -+ c se_psi``, and ``t*`` is kept symmetric so that the p-values invert it."""
    x = np.random.default_rng(4).lognormal(0.0, 1.0, N_DOCS)
    e = _bootstrap({"p|x": x}, 1).evaluate(lambda g: g("p|x"), scale=scale)
    lo, est, hi = (float(scale.forward(v)) for v in (e.ci_low, e.estimate, e.ci_high))
    assert lo < est < hi
    assert est - lo == pytest.approx(hi - est, rel=1e-9)
    assert e.tstar is not None
    np.testing.assert_allclose(e.tstar, -e.tstar[::-1])
    # The ends are where the two-sided p-value crosses 0.05 (up to the replicates' steps).
    inside = [0.25 * e.ci_low + 0.75 * e.estimate, 0.25 * e.ci_high + 0.75 * e.estimate]
    outside = [e.ci_low - 0.05 * (e.ci_high - e.ci_low), e.ci_high + 0.05 * (e.ci_high - e.ci_low)]
    assert all(studentized_p_value(e, "two-sided", v) > 0.05 for v in inside)
    assert all(studentized_p_value(e, "two-sided", v) < 0.05 for v in outside if scale.holds(v))


def _coverage(draw, mu: float, scale: Scale, studies: int) -> float:
    rng = np.random.default_rng(11)
    hits = 0
    for study in range(studies):
        e = _bootstrap({"p|x": draw(rng)}, study).evaluate(lambda g: g("p|x"), scale=scale)
        assert e.ci_low <= e.estimate <= e.ci_high
        hits += int(e.ci_low <= mu <= e.ci_high)
    return hits / studies


def test_half_the_documents_exactly_zero_and_the_rest_heavy_tailed_cover():
    """The shape of a paired difference where half the documents never diverge (a point mass
    at 0) and the rest differ by heavy-tailed noise around a small mean: the equal-tailed
    bootstrap-t covered 0.875 here (its two tails follow the sample's chance skew), the
    symmetric one 0.96."""
    studies = 400

    def draw(rng: np.random.Generator) -> np.ndarray:
        zero = rng.random(N_DOCS) < 0.5
        return np.where(zero, 0.0, 0.05 + 0.1 * rng.standard_t(3, N_DOCS))

    cover = _coverage(draw, 0.025, Scale(-1.0, 1.0), studies)
    assert abs(cover - 0.95) < _tol(studies), cover


def test_half_the_documents_exactly_zero_and_the_rest_normal_is_conservative():
    """Normal noise instead of t_3: the symmetric interval over-covers (about 0.99, where
    the equal-tailed one covered 0.91): a documented limit, conservative, never below the
    level by more than the Monte Carlo error."""
    studies = 300

    def draw(rng: np.random.Generator) -> np.ndarray:
        zero = rng.random(N_DOCS) < 0.5
        return np.where(zero, 0.0, rng.normal(0.05, 0.2, N_DOCS))

    cover = _coverage(draw, 0.025, Scale(-1.0, 1.0), studies)
    assert cover > 0.95 - _tol(studies), cover


def test_the_ratio_set_is_symmetric_test_inversion():
    """The Fieller set accepts ``s`` exactly where ``|t(s)|`` is within the level quantile of
    ``|t*|``: the estimate is inside, and the set's ends are where acceptance flips."""
    rng = np.random.default_rng(8)
    den = rng.gamma(2.0, 1.0, N_DOCS)
    num = 0.4 * den + rng.normal(0.0, 0.3, N_DOCS)
    bs = _bootstrap({"p|n": num, "p|d": den}, 2)
    e = bs.ratio(lambda g: g("p|n"), lambda g: g("p|d"))
    assert e.exclude is None and e.ci_low < e.estimate < e.ci_high
    low = bs.at_level(0.80).ratio(lambda g: g("p|n"), lambda g: g("p|d"))
    assert e.ci_low < low.ci_low < low.ci_high < e.ci_high  # a lower level: a smaller set


def _survival_population(n: int, horizon: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per-document survival curves of two policies: half the documents never diverge
    (S = 1 under both), the others with geometric divergence times, b's hazard a little
    higher than a's."""
    rng = np.random.default_rng(seed)
    t = np.arange(horizon + 1)
    docs = []
    for i in range(n):
        if i % 2 == 0:
            docs.append((np.ones(horizon + 1), np.ones(horizon + 1)))
            continue
        h = rng.uniform(0.02, 0.3)
        docs.append(((1 - h) ** t, (1 - min(1.3 * h, 1.0)) ** t))
    return docs


def _survival_table(docs, pick, rng: np.random.Generator, horizon: int) -> Table:
    cols: dict[str, np.ndarray] = {}
    noisy = []
    for i in pick:
        # Monte Carlo noise on the diverging documents' curves, as an RB-CMC estimate has.
        sa, sb = docs[i]
        if sa[-1] < 1:
            sa = np.clip(sa + rng.normal(0, 0.03, sa.size) * (np.arange(sa.size) > 0), 0, 1)
            sb = np.clip(sb + rng.normal(0, 0.03, sb.size) * (np.arange(sb.size) > 0), 0, 1)
        noisy.append((sa, sb))
    for p, k in (("a", 0), ("b", 1)):
        for t in range(horizon + 1):
            cols[f"{p}|S|{t}"] = np.array([d[k][t] for d in noisy])
    return Table([f"d{j}" for j in range(len(pick))], cols)


def test_the_studentized_survival_band_covers_the_whole_curve():
    """Zero-inflated curves (the coverage study's ``never`` shape): the studentized sup-t band
    covers the whole difference curve at the level, inside [-1, 1] and around its points."""
    horizon, studies = 6, 200
    docs = _survival_population(40, horizon, 0)
    truth = np.mean([b - a for a, b in docs], axis=0)[1:]
    rng = np.random.default_rng(1)
    hits = 0
    for study in range(studies):
        pick = rng.integers(len(docs), size=N_DOCS)
        table = _survival_table(docs, pick, rng, horizon)
        bs = bootstrap_table(table, 999, study, 0.95)
        rows = st.survival_band(bs, "a", "b", horizon)
        lo = np.array([r["band_low"] for r in rows])
        hi = np.array([r["band_high"] for r in rows])
        d = np.array([r["difference"] for r in rows])
        assert np.all((-1 <= lo) & (lo <= d) & (d <= hi) & (hi <= 1))
        hits += int(np.all((lo <= truth) & (truth <= hi)))
    assert abs(hits / studies - 0.95) < _tol(studies), hits / studies


def test_the_floor_keeps_one_degenerate_step_from_setting_the_band():
    """A step where a single document differs: resamples without it are flat there and those
    with it have a tiny se*; floored, that step's |t*| cannot blow up the critical value
    that every step's band uses."""
    rng = np.random.default_rng(5)
    n, horizon = N_DOCS, 5
    base = rng.uniform(0.2, 0.8, n)
    cols = {}
    for t in range(horizon + 1):
        cols[f"a|S|{t}"] = np.clip(base - 0.05 * t + rng.normal(0, 0.02, n), 0, 1)
        cols[f"b|S|{t}"] = np.clip(cols[f"a|S|{t}"] - 0.02 * t + rng.normal(0, 0.03, n), 0, 1)
    cols[f"b|S|{horizon}"] = cols[f"a|S|{horizon}"].copy()
    cols[f"b|S|{horizon}"][3] -= 0.1  # the last step: one document differs, a little
    bs = _bootstrap(cols, 0)
    fns = [(lambda g, t=t: g(f"b|S|{t}") - g(f"a|S|{t}")) for t in range(1, horizon + 1)]
    point, boot, se, se_boot = bs.studentized_parts(fns)
    scale = Scale(-1.0, 1.0)
    lo, hi, c = sup_t_band(point, boot, se, se_boot, 0.95, scale)
    _, _, c_raw = sup_t_band(point, boot, se, se_boot, 0.95, scale, se_floor=0.0)
    assert math.isfinite(c) and 2.0 < c < c_raw
    assert np.all((-1 <= lo) & (lo <= point) & (point <= hi) & (hi <= 1))
