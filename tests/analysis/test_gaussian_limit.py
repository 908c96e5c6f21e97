"""The studentized interval of many documents draws its replicates from the bootstrap's
Gaussian limit (docs/statistics.md, "Many documents"): the draws have the means' covariance,
columns that do not vary stay exact, the intervals agree with resampling the documents on
real-shaped tables (near-certain, rare and never-diverging documents) and stay inside their
ranges, and they cover. Agreement is judged against the Monte Carlo error of the bootstrap-t's
critical value; coverage allows three Monte Carlo standard errors."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvcouple.analysis import stats as st
from kvcouple.analysis.bootstrap import Bootstrap, bootstrap_table, gaussian_means
from kvcouple.analysis.estimates import Table
from kvcouple.analysis.intervals import GAUSSIAN_MIN_DOCS, Scale

PROB = Scale(0.0, 1.0)
DIFF = Scale(-1.0, 1.0)


def _table(cols: dict[str, np.ndarray]) -> Table:
    n = len(next(iter(cols.values())))
    return Table([f"d{i}" for i in range(n)], dict(cols))


def test_draws_have_the_covariance_of_the_means_with_nan_entries_left_out():
    rng = np.random.default_rng(0)
    n = 400
    a = rng.normal(1.0, 2.0, n)
    b = 0.5 * a + rng.normal(0.0, 1.0, n)
    c = np.where(rng.random(n) < 0.3, np.nan, rng.exponential(1.0, n))  # NaN where undefined
    flat = np.full(n, 0.25)  # does not vary
    none = np.full(n, np.nan)  # no finite entry
    mat = np.column_stack([a, b, c, flat, none])
    with np.errstate(invalid="ignore"), pytest.warns(RuntimeWarning):
        point = np.nanmean(mat, axis=0)
    reps = gaussian_means(mat, point, 40000, 3)
    assert reps.shape == (40000, 5)
    np.testing.assert_array_equal(reps[:, 3], 0.25)  # exactly, not to rounding
    assert np.isnan(reps[:, 4]).all()
    # The covariance of the means, NaN entries left out: sum over both finite / (n_j n_k).
    x = mat[:, :3] - point[:3]
    finite = np.isfinite(x)
    x = np.where(finite, x, 0.0)
    counts = finite.sum(0).astype(float)
    expect = (x.T @ x) / np.outer(counts, counts)
    got = np.cov(reps[:, :3], rowvar=False)
    # A sample covariance of 40,000 draws: relative error about sqrt(2 / 40000) = 0.007.
    np.testing.assert_allclose(
        got,
        expect,
        rtol=0.04,
        atol=0.04 * np.sqrt(np.outer(np.diag(expect), np.diag(expect))).max(),
    )
    se_mean = np.sqrt(np.diag(expect) / 40000)
    assert np.all(np.abs(reps[:, :3].mean(0) - point[:3]) < 4 * se_mean)
    # Seeded: the same draws again.
    np.testing.assert_array_equal(
        gaussian_means(mat, point, 50, 3), gaussian_means(mat, point, 50, 3)
    )


def test_the_switch_is_by_documents_and_only_for_the_studentized_interval():
    rng = np.random.default_rng(1)
    few = _table({"p|x": rng.random(GAUSSIAN_MIN_DOCS - 1)})
    many = _table({"p|x": rng.random(GAUSSIAN_MIN_DOCS)})
    assert not bootstrap_table(few, 200, 0, 0.95).gaussian
    assert bootstrap_table(many, 200, 0, 0.95).gaussian
    assert not bootstrap_table(many, 200, 0, 0.95, "expanded-bca").gaussian
    assert not bootstrap_table(many, 200, 0, 0.95, gaussian=False).gaussian


def _saturated(rng: np.random.Generator, n: int) -> np.ndarray:
    """Most documents diverge with probability 0.95-1.0 (as SmolLM2's), a few exactly 1."""
    return np.where(rng.random(n) < 0.2, 1.0, 1.0 - rng.beta(1.0, 40.0, n))


def _rare(rng: np.random.Generator, n: int) -> np.ndarray:
    """Most documents at 0-0.05, a few far higher."""
    return np.where(rng.random(n) < 0.02, rng.uniform(0.2, 0.9, n), rng.beta(0.5, 40.0, n))


def _never(rng: np.random.Generator, n: int) -> np.ndarray:
    """Half the documents never diverge (exactly 0), the others spread."""
    return np.where(rng.random(n) < 0.5, 0.0, rng.beta(2.0, 3.0, n))


SHAPES = {"saturated": _saturated, "rare": _rare, "never": _never}


def _pair_table(shape, seed: int, n: int) -> Table:
    rng = np.random.default_rng(seed)
    a = SHAPES[shape](rng, n)
    # The second policy: the same documents a little more often diverging (paired).
    b = np.clip(a + rng.normal(0.01, 0.02, n) * (a > 0), 0.0, 1.0)
    mass = a * rng.uniform(2.0, 6.0, n)  # a first-divergence mass: its ratio to a is a mean tau
    return _table({"a|occ": a, "b|occ": b, "a|mass": mass})


STATS = (
    ("occurrence a", lambda g: g("a|occ"), PROB),
    ("occurrence b", lambda g: g("b|occ"), PROB),
    ("difference b - a", lambda g: g("b|occ") - g("a|occ"), DIFF),
    ("ratio mass / occurrence", lambda g: g("a|mass") / g("a|occ"), Scale(0.0, 8.0)),
)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_the_limit_agrees_with_resampling_the_documents(shape):
    """At the switch, on real-shaped tables: every end within a tenth of the interval's width
    of the resampled one (the bootstrap-t critical value of 2,000 resamples alone moves an end
    by about 4% of the width), both inside their ranges and around the estimate."""
    table = _pair_table(shape, 7, GAUSSIAN_MIN_DOCS)
    fns = [f for _, f, _ in STATS]
    scales = [s for _, _, s in STATS]
    limit = bootstrap_table(table, 2000, 5, 0.95).evaluate_many(fns, scales=scales)
    resampled = bootstrap_table(table, 2000, 5, 0.95, gaussian=False)
    assert not resampled.gaussian
    for (name, _, scale), g, r in zip(STATS, limit, resampled.evaluate_many(fns, scales=scales)):
        assert g.estimate == r.estimate
        for e in (g, r):
            assert scale.low <= e.ci_low <= e.estimate <= e.ci_high <= scale.high, name
        width = r.ci_high - r.ci_low
        assert width > 0, name
        assert abs(g.ci_low - r.ci_low) < 0.1 * width, name
        assert abs(g.ci_high - r.ci_high) < 0.1 * width, name


def test_the_survival_band_agrees_with_resampling_the_documents():
    rng = np.random.default_rng(2)
    n, horizon = GAUSSIAN_MIN_DOCS, 12
    cols = {}
    for pol, shift in (("a", 0.0), ("b", 0.03)):
        hazard = np.clip(rng.beta(2.0, 12.0, n) + shift, 0.0, 1.0)
        for t in range(1, horizon + 1):
            cols[f"{pol}|S|{t}"] = (1.0 - hazard) ** t
    table = _table(cols)
    limit = st.survival_band(bootstrap_table(table, 2000, 5, 0.95), "a", "b", horizon)
    resampled = st.survival_band(
        bootstrap_table(table, 2000, 5, 0.95, gaussian=False), "a", "b", horizon
    )
    for g, r in zip(limit, resampled, strict=True):
        assert (
            -1
            <= g["band_low"]
            <= g["ci_low"]
            <= g["difference"]
            <= g["ci_high"]
            <= g["band_high"]
            <= 1
        )
        width = r["band_high"] - r["band_low"]
        assert abs(g["band_low"] - r["band_low"]) < 0.1 * width
        assert abs(g["band_high"] - r["band_high"]) < 0.1 * width
    c = limit[0]["band_critical_value"]
    assert c == pytest.approx(resampled[0]["band_critical_value"], rel=0.1)
    assert c > 1.96  # simultaneous: wider than one step's interval


@pytest.mark.parametrize("shape", ["rare", "never"])
def test_the_limit_covers_on_real_shaped_populations(shape):
    """300 studies of GAUSSIAN_MIN_DOCS documents: the occurrence (a mean of a skewed,
    zero-inflated or boundary-heavy column) and the mass / occurrence ratio cover 0.95."""
    studies = 300
    truth_table = _pair_table(shape, 999, 400000)
    mu_occ = float(truth_table.cols["a|occ"].mean())
    mu_ratio = float(truth_table.cols["a|mass"].mean() / truth_table.cols["a|occ"].mean())
    hits = np.zeros(2)
    for study in range(studies):
        bs: Bootstrap = bootstrap_table(
            _pair_table(shape, study, GAUSSIAN_MIN_DOCS), 500, study, 0.95
        )
        assert bs.gaussian
        occ, ratio = bs.evaluate_many([STATS[0][1], STATS[3][1]], scales=[PROB, STATS[3][2]])
        hits += [occ.ci_low <= mu_occ <= occ.ci_high, ratio.ci_low <= mu_ratio <= ratio.ci_high]
    tol = 3 * math.sqrt(0.95 * 0.05 / studies)
    for got in hits / studies:
        assert abs(got - 0.95) < tol


def test_an_analysis_says_its_replicates_are_the_gaussian_limit(tmp_path, monkeypatch):
    """Through analyze and the report: the settings record how each store's replicates were
    drawn, the report says it in words, and the intervals stay inside their ranges."""
    from kvcouple.analysis import analyze, intervals
    from kvcouple.analysis.report import write_report
    from kvcouple.synth.trace_store import write_synthetic_trace_store

    rng = np.random.default_rng(4)
    P = rng.dirichlet(np.ones(6), size=6)
    pairs = {
        "a": {"P": P, "Q": 0.6 * P + 0.4 * rng.dirichlet(np.ones(6), size=6), "start": 0},
        "b": {"P": P, "Q": 0.2 * P + 0.8 * rng.dirichlet(np.ones(6), size=6), "start": 2},
    }
    store = write_synthetic_trace_store(
        tmp_path / "run.zarr", pairs, horizon=6, branches=2, replicates=4, docs=24, seed=3
    )
    plain = analyze(store, n_boot=300)
    assert plain.settings["bootstrap_draws"] == {str(store): "documents"}
    monkeypatch.setattr(intervals, "GAUSSIAN_MIN_DOCS", 24)
    result = analyze(store, n_boot=300)
    assert result.settings["bootstrap_draws"] == {str(store): "gaussian limit"}
    assert result.models[0].bootstrap.gaussian
    for row in result.models[0].tables["summary"]:
        if row["quantity"] in ("occurrence", "mismatch_fraction", "exposure"):
            assert 0 <= row["ci_low"] <= row["estimate"] <= row["ci_high"] <= 1
    out = tmp_path / "out"
    write_report(result, out, figures=False)
    assert "draws from the document bootstrap's Gaussian limit" in (out / "report.md").read_text()
