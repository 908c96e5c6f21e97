"""Survival comparisons (RMST, paired survival differences with simultaneous bands) against
exact survival; gap attribution with a reference policy, pooled across models, and the
exposure-share flag; pooled median_tau."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from kvcouple import synth
from kvcouple.analysis import analyze, write_report
from kvcouple.analysis.stats import NOT_INTERPRETABLE
from kvcouple.synth.trace_store import write_synthetic_trace_store

V, T = 3, 8
_rng = np.random.default_rng(12)
_P = _rng.dirichlet(np.ones(V), size=V)
_N = _rng.dirichlet(np.ones(V), size=V)
PAIRS = {
    "mild": {"P": _P, "Q": 0.9 * _P + 0.1 * _N, "start": 0},
    "harsh": {"P": _P, "Q": 0.5 * _P + 0.5 * _N, "start": 0},
    "harsh_twin": {"P": _P, "Q": 0.5 * _P + 0.5 * _N, "start": 0},  # the same kernels
}
STARTS = [0, 1, 2] * 4


def _exact(pol: str, start: int) -> synth.ExactResult:
    return synth.exact(synth.pair_from_mapping(dict(PAIRS[pol], start=start)), horizon=T)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("surv") / "run.zarr"
    return write_synthetic_trace_store(path, PAIRS, horizon=T, replicates=300, docs=STARTS, seed=8)


@pytest.fixture(scope="module")
def result(store):
    return analyze(store, n_boot=1000, reference="mild")


def _row(rows, **kw):
    hits = [r for r in rows if all(r[k] == v for k, v in kw.items())]
    assert len(hits) == 1, kw
    return hits[0]


def _mc_se(result, pol, scale=1.0):
    """Monte Carlo standard error of the document mean of occupation (RMST = T - it)."""
    ses = [d.units[pol].stderr["occupation"] for d in result.models[0].docs]
    return np.sqrt(np.sum(np.square(ses))) / len(ses) * scale


def test_rmst_per_policy_and_paired_against_exact(result):
    m = result.models[0]
    truth = {
        pol: T - np.mean([_exact(pol, s).occupation for s in STARTS]) for pol in ("mild", "harsh")
    }
    for pol, value in truth.items():
        row = _row(m.tables["summary"], policy=pol, quantity="rmst")
        pad = 3 * _mc_se(result, pol)
        assert row["ci_low"] - pad <= value <= row["ci_high"] + pad, (pol, row, value)
        # RMST is the survival curve summed over t = 0..T-1.
        curve = [_row(m.tables["curves"], policy=pol, curve="survival", x=t) for t in range(T)]
        assert row["estimate"] == pytest.approx(sum(r["estimate"] for r in curve), rel=1e-12)
    diff = _row(m.tables["differences"], policy_a="mild", policy_b="harsh", quantity="rmst")
    pad = 3 * np.hypot(_mc_se(result, "mild"), _mc_se(result, "harsh"))
    assert diff["ci_low"] - pad <= truth["harsh"] - truth["mild"] <= diff["ci_high"] + pad
    assert diff["ci_high"] < 0  # harsh diverges earlier: clearly less time before divergence


def test_survival_difference_band_covers_exact_curve(result):
    m = result.models[0]
    rows = [r for r in m.tables["survival_differences"] if r["policy_b"] == "harsh"]
    assert [r["step"] for r in rows] == list(range(1, T + 1))
    s = {pol: np.mean([_exact(pol, st).survival for st in STARTS], axis=0) for pol in PAIRS}
    exact_diff = s["harsh"][1:] - s["mild"][1:]
    lo = np.array([r["band_low"] for r in rows])
    hi = np.array([r["band_high"] for r in rows])
    assert np.all((lo - 0.01 <= exact_diff) & (exact_diff <= hi + 0.01)), (lo, exact_diff, hi)
    # A simultaneous band is wider than the pointwise intervals: its critical value exceeds
    # the pointwise normal score.
    assert rows[0]["band_critical_value"] > 1.96
    widths = hi - lo
    pointwise = np.array([r["ci_high"] - r["ci_low"] for r in rows])
    assert np.mean(widths >= pointwise * 0.95) > 0.75
    # The curve is clearly below 0 somewhere, and the band says so.
    assert (hi < 0).any()


def test_reference_fixes_the_direction_and_is_checked(result, store):
    m = result.models[0]
    for name in ("differences", "gap_attribution", "survival_differences"):
        assert {r["policy_a"] for r in m.tables[name]} == {"mild"}, name
        assert {r["policy_b"] for r in m.tables[name]} == {"harsh", "harsh_twin"}, name
    with pytest.raises(ValueError, match="reference policy 'snapkv' is not among"):
        analyze(store, n_boot=100, reference="snapkv")


def test_exposure_share_flagged_when_gap_includes_zero(store, tmp_path):
    res = analyze(store, n_boot=1000, reference="harsh")
    gaps = res.models[0].tables["gap_attribution"]
    twin_gap = _row(gaps, policy_b="harsh_twin", term="gap")
    assert twin_gap["ci_low"] <= 0 <= twin_gap["ci_high"]  # identical kernels
    twin_share = _row(gaps, policy_b="harsh_twin", term="exposure_share")
    assert not twin_share["interpretable"] and twin_share["note"] == NOT_INTERPRETABLE
    mild_share = _row(gaps, policy_b="mild", term="exposure_share")
    assert mild_share["interpretable"] and mild_share["note"] == ""
    assert all(r["interpretable"] for r in gaps if r["term"] != "exposure_share")
    out = write_report(res, tmp_path / "out", figures=False, html_report=False)
    with (out / "gap_attribution.csv").open() as f:
        flagged = [r for r in csv.DictReader(f) if r["note"] == NOT_INTERPRETABLE]
    assert [(r["policy_b"], r["term"]) for r in flagged] == [("harsh_twin", "exposure_share")]
    data = json.loads((out / "results.json").read_text())
    assert sum(r["note"] == NOT_INTERPRETABLE for r in data["gap_attribution"]) == 1
    assert NOT_INTERPRETABLE in (out / "report.md").read_text()


def test_gaps_pooled_across_models(store, tmp_path):
    other = write_synthetic_trace_store(
        tmp_path / "other.zarr",
        {"mild": PAIRS["harsh"], "harsh": PAIRS["mild"]},  # the other model reverses the gap
        horizon=T,
        replicates=100,
        docs=STARTS,
        seed=3,
        model_id="other-model",
    )
    res = analyze([store, other], n_boot=300, reference="mild", pool_models=True)
    pooled = res.pooled["gap_attribution"]
    assert {r["model"] for r in pooled} == {"pooled: synthetic + other-model"}
    assert {r["policy_b"] for r in pooled} == {"harsh"}  # the policies both stores have
    per_model = [
        {r["term"]: r["estimate"] for r in m.tables["gap_attribution"] if r["policy_b"] == "harsh"}
        for m in res.models
    ]
    p = {r["term"]: r for r in pooled}
    for term in ("gap", "delta_first_mismatch", "exposure_term", "rate_term"):
        assert p[term]["estimate"] == pytest.approx(np.mean([x[term] for x in per_model]))
    assert p["exposure_share"]["estimate"] == pytest.approx(
        p["exposure_term"]["estimate"] / p["gap"]["estimate"]
    )
    # The two models' gaps nearly cancel: the pooled CI includes 0 and the share is flagged.
    assert p["gap"]["ci_low"] <= 0 <= p["gap"]["ci_high"]
    assert p["exposure_share"]["note"] == NOT_INTERPRETABLE
    with pytest.raises(ValueError, match="at least two stores"):
        analyze(store, n_boot=100, pool_models=True)


def test_median_tau_is_the_pooled_median(result):
    m = result.models[0]
    for pol in ("mild", "harsh"):
        pmf = np.array(
            [
                _row(m.tables["curves"], policy=pol, curve="pmf", x=t)["estimate"]
                for t in range(1, T + 1)
            ]
        )
        # The grouped-data median of the pooled pmf, by its formula.
        F = np.concatenate([[0.0], np.cumsum(pmf) / pmf.sum()])
        t = int(np.argmax(F[1:] >= 0.5)) + 1
        expected = t - 0.5 + (0.5 - F[t - 1]) / (F[t] - F[t - 1])
        row = _row(m.tables["summary"], policy=pol, quantity="median_tau")
        assert row["estimate"] == pytest.approx(expected, rel=1e-9)
        assert 0.5 <= row["ci_low"] <= row["estimate"] <= row["ci_high"] <= T + 0.5
        assert row["ci_low"] < row["ci_high"]
