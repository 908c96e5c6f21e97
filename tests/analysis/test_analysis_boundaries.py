"""Issue 36: every interval inside its quantity's range and around its estimate, on the shapes
real traces take (near-saturated divergence, rare divergence, a policy that never diverges);
degenerate cases named; the scale's rules for resamples that cannot be studentized."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvcouple.analysis import analyze, studentized
from kvcouple.analysis import quantities as qn
from kvcouple.analysis import stats as st
from kvcouple.analysis.bootstrap import Bootstrap, bootstrap_table
from kvcouple.analysis.console import format_decomposition
from kvcouple.analysis.estimates import Table
from kvcouple.analysis.intervals import UNBOUNDED, Scale
from kvcouple.synth.trace_store import write_synthetic_trace_store

V, T = 4, 8


def _pairs() -> dict[str, dict[str, object]]:
    """``full`` never diverges; ``sat`` diverges with probability 0.99-1.0 in every document
    (per-document occurrence as on real data); ``rare`` rarely (0-0.05, some documents never)."""
    p = np.random.default_rng(0).dirichlet(np.ones(V) * 3, size=V)

    def towards_eye(w: list[float]) -> np.ndarray:
        q = p * (1 - np.array(w))[:, None] + np.array(w)[:, None] * np.eye(V)
        return q / q.sum(1, keepdims=True)

    return {
        "full": {"P": p, "Q": p.copy(), "start": 0},
        "sat": {"P": p, "Q": towards_eye([0.9, 0.6, 0.75, 0.5]), "start": 0},
        "rare": {"P": p, "Q": towards_eye([0.0, 0.003, 0.01, 0.0]), "start": 0},
    }


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    path = write_synthetic_trace_store(
        tmp_path_factory.mktemp("bnd") / "s.zarr", _pairs(), horizon=T, window=T,
        branches=2, replicates=8, docs=list(range(V)) * 4, seed=3,
    )  # fmt: skip
    return analyze(str(path), n_boot=499)


def _range(table: str, row: dict) -> tuple[float, float]:
    if table == "summary":
        return qn.quantity(row["quantity"]).value_range(T)
    if table == "differences":
        return qn.quantity(row["quantity"]).difference_range(T)
    if table == "curves":
        return qn.quantity(row["curve"]).value_range(T)
    if table == "gap_attribution":
        return qn.quantity(row["term"]).value_range(T)
    return -1.0, 1.0  # survival differences


@pytest.mark.parametrize(
    "table", ["summary", "differences", "curves", "gap_attribution", "survival_differences"]
)
def test_every_interval_lies_in_its_range_and_contains_its_estimate(result, table):
    m = result.models[0]
    checked = 0
    for row in m.tables[table]:
        est = row.get("estimate", row.get("difference"))
        if not math.isfinite(est):
            assert row.get("note"), row
            continue
        low, high = _range(table, row)
        ends = [("ci_low", "ci_high")]
        if table == "survival_differences":
            ends.append(("band_low", "band_high"))
        for lo_key, hi_key in ends:
            lo, hi = row[lo_key], row[hi_key]
            if row.get("term") == "exposure_share" or math.isnan(lo):
                assert row.get("term") == "exposure_share" or row["note"], row
                continue
            assert low <= lo <= est <= hi <= high, (table, row)
            checked += 1
    assert checked >= 6


def test_near_saturated_occurrence_gets_a_tight_interval_below_one(result):
    """Per-document occurrence 0.99-1.0: the interval hugs the estimate (the old studentized
    interval gave [0, 1.00] on such data)."""
    rows = {(r["policy"], r["quantity"]): r for r in result.models[0].tables["summary"]}
    occ = rows[("sat", "occurrence")]
    assert 0.99 < occ["ci_low"] < occ["estimate"] < occ["ci_high"] < 1.0
    rare = rows[("rare", "occurrence")]
    assert 0.0 < rare["ci_low"] < rare["estimate"] < rare["ci_high"] < 0.05


def test_a_policy_that_never_diverges_has_rho_undefined_for_that_reason(result):
    m = result.models[0]
    rows = {(r["policy"], r["quantity"]): r for r in m.tables["summary"]}
    assert rows[("full", "rho")]["note"] == st.NEVER_DIVERGES
    assert math.isnan(rows[("full", "rho")]["estimate"])
    text = format_decomposition(result)
    assert "undefined" in text and "full never diverged in any document" in text
    # L = T: nothing is unobserved, so the L < T note must not be printed.
    assert "unobserved" not in text and "--window" not in text


def test_a_constant_quantity_gets_a_point_interval_and_a_flag(result):
    rows = {(r["policy"], r["quantity"]): r for r in result.models[0].tables["summary"]}
    for q in ("occurrence", "mismatch_fraction", "rmst"):
        r = rows[("full", q)]
        assert r["ci_low"] == r["estimate"] == r["ci_high"] and r["note"] == st.CONSTANT
    assert rows[("sat", "occurrence")]["note"] == ""


def _boot(cols: dict[str, np.ndarray], seed: int = 0) -> Bootstrap:
    n = len(next(iter(cols.values())))
    return bootstrap_table(Table([f"d{i}" for i in range(n)], cols), 999, seed, 0.95)


def test_most_documents_at_one_keep_the_interval_inside_the_unit_range():
    """12 of 16 documents exactly at 1 (a resample of only those is at the range's end: its
    t* is +inf, as far as a resample goes), the rest 0.94-0.99."""
    x = np.r_[np.ones(12), [0.944, 0.96, 0.97, 0.99]]
    scale = st.quantity_scale("occurrence", T)
    e = _boot({"p|x": x}).evaluate(lambda g: g("p|x"), scale=scale)
    assert 0.9 < e.ci_low < e.estimate < e.ci_high <= 1.0, e
    d = _boot({"a|x": x, "b|x": x[::-1].copy()}).evaluate(
        lambda g: g("b|x") - g("a|x"), scale=st.quantity_scale("occurrence", T, paired=True)
    )
    assert -1.0 <= d.ci_low <= d.estimate <= d.ci_high <= 1.0


def test_near_identical_resamples_do_not_set_the_critical_value(monkeypatch):
    """SmolLM2-135M-Instruct's ``recent:retain=0.5`` on 8 documents: seven diverge with
    probability within 1e-8 of 1 (not exactly 1), one with 0.83. A resample of only the seven
    has a standard error of about 1e-9; studentized by it, its t* was about 14 on the logit
    scale and the interval [0, 1]. A resample's standard error is floored at
    RESAMPLE_SE_FLOOR of the table's (studentized.py)."""
    x = np.array([1 - 7.3e-8, 1 - 4.4e-8, 1 - 3.2e-10, 1 - 2.1e-12,
                  1 - 2.5e-12, 1 - 7.4e-12, 1 - 2.5e-9, 0.8266])  # fmt: skip
    scale = st.quantity_scale("occurrence", T)
    e = _boot({"p|x": x}).evaluate(lambda g: g("p|x"), scale=scale)
    assert 0.8 < e.ci_low < e.estimate < e.ci_high < 1.0, e
    monkeypatch.setattr(studentized, "RESAMPLE_SE_FLOOR", 0.0)
    unfloored = _boot({"p|x": x}).evaluate(lambda g: g("p|x"), scale=scale)
    assert unfloored.ci_low < 1e-6  # the interval the floor replaces


def test_the_scale_maps_the_real_line_into_the_range():
    s = Scale(0.0, 8.0)
    x = np.array([0.5, 4.0, 7.99])
    np.testing.assert_allclose(s.back(s.forward(x)), x, rtol=1e-12)
    assert s.back(-math.inf) == 0.0 and s.back(math.inf) == 8.0
    assert s.slope(0.0) == math.inf and UNBOUNDED.forward(3.0) == 3.0
    assert st.quantity_scale("exposure_share", T) == UNBOUNDED
    assert st.quantity_scale("late_minus_early_tv", T, paired=True) == Scale(-2.0, 2.0)


@pytest.mark.parametrize("method", ["percentile", "bca", "expanded-bca"])
def test_other_methods_extrapolate_on_the_scale(method):
    """Eight documents near 1: an expanded end beyond the replicates is extrapolated on the
    logit scale, so it stays inside [0, 1] (the normal tail on the raw scale left it)."""
    x = np.array([1.0, 1.0, 1.0, 0.999, 0.98, 1.0, 0.95, 1.0])
    bs = bootstrap_table(Table([f"d{i}" for i in range(8)], {"p|x": x}), 200, 1, 0.99, method)
    e = bs.evaluate(lambda g: g("p|x"), scale=Scale(0.0, 1.0))
    assert 0.0 <= e.ci_low <= e.estimate <= e.ci_high <= 1.0


def test_p_values_invert_the_interval_on_the_scale():
    rng = np.random.default_rng(4)
    x = rng.beta(8, 1, 16)
    bs = _boot({"p|x": x}, 2).at_level(0.90)
    e = bs.evaluate(lambda g: g("p|x"), scale=Scale(0.0, 1.0))
    for v in np.linspace(e.ci_low - 0.05, min(e.ci_high + 0.05, 1.0), 25):
        assert (bs.p_value(e, "greater", v) < 0.05) == (e.ci_low > v) or abs(v - e.ci_low) < 1e-3
    assert bs.p_value(e, "less", 1.0) < 0.05 and bs.p_value(e, "greater", 0.0) < 0.05


def test_the_curve_figures_draw_their_bands_inside_the_unit_range(result):
    """Survival, hazard and TV-by-lag figures: every band polygon inside [0, 1], the axis over
    the registry's range; a point without a band (no document reached that lag) is not a band."""
    from matplotlib.collections import PolyCollection

    from kvcouple.analysis.figures import draw_figures
    from kvcouple.analysis.tables import tidy_tables

    curves = [r for r in result.models[0].tables["curves"] if r["curve"] == "branch_tv"]
    assert any(r["note"].startswith("too few documents") for r in curves)
    figs = draw_figures(tidy_tables(result))
    for name in ("survival", "hazard", "branch_tv_by_lag"):
        ax = figs[name].axes[0]
        low, high = ax.get_ylim()
        assert -0.03 < low <= 0.0 and 1.0 <= high < 1.03, (name, low, high)
        polys = [c for c in ax.collections if isinstance(c, PolyCollection)]
        assert polys, name
        for c in polys:
            for path in c.get_paths():
                y = path.vertices[:, 1]
                assert (y >= -1e-12).all() and (y <= 1 + 1e-12).all(), name


def test_an_estimate_outside_its_range_keeps_its_interval_beside_the_range():
    """A ratio of Monte Carlo estimates can land just outside its range with few documents
    (rho = 1.02): its interval contains it and leaves the range only as far as it does."""
    from kvcouple.analysis.intervals import Scale
    from kvcouple.analysis.stats import OUTSIDE, _note
    from kvcouple.analysis.studentized import studentized_estimate

    rng = np.random.default_rng(0)
    boot = 1.02 + 0.4 * rng.standard_normal(400)
    se_boot = np.full(400, 0.4)
    e = studentized_estimate(1.02, boot, 0.4, se_boot, 0.95, Scale(0.0, 1.0))
    assert 0.0 <= e.ci_low < 1.02 == e.ci_high
    assert _note(e, scale=Scale(0.0, 1.0)) == OUTSIDE
    inside = studentized_estimate(0.6, boot - 0.42, 0.1, se_boot / 4, 0.95, Scale(0.0, 1.0))
    assert 0 < inside.ci_low <= 0.6 <= inside.ci_high < 1
    assert _note(inside, scale=Scale(0.0, 1.0)) == ""
