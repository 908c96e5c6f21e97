"""Aggregates that the gap attribution is built from (first_mismatch, exposure, rho, E[M]/T),
each compared directly with the exact solver; the bootstrap on one document; TV recomputation
from float32 and float64 stores.

The documents are chosen so that the aggregate definitions matter: document A diverges early
and then never mismatches again, document B diverges late and then mismatches often. rho as a
ratio of means (SPEC section 3) is then far from a mean of per-document ratios, and
first_mismatch and exposure are far apart. Tolerances are Monte Carlo standard errors from the
per-document estimates (4.5 SE, or a delta-method bound for the ratio).
"""

from __future__ import annotations

import numpy as np
import pytest
import zarr

from analysis_exact_dp import exact_dp
from kvcouple.analysis import analyze
from kvcouple.synth.trace_store import as_emitter_pair, with_starts, write_synthetic_trace_store

T = 8
# Four states over four tokens. Regime A (states 0, 1): TV 0.5 per step, and after a divergence
# both sides sit in state 1 where p = q is a point mass (no further mismatches). Regime B
# (states 2, 3): TV 0.1 per step, and after a divergence both sides sit in state 3 with TV 0.8.
P_EMIT = np.array(
    [[0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0], [0.9, 0.1, 0.0, 0.0], [0.9, 0.1, 0.0, 0.0]]
)
Q_EMIT = np.array(
    [[0.5, 0.0, 0.5, 0.0], [0.0, 0.0, 0.0, 1.0], [0.9, 0.0, 0.1, 0.0], [0.1, 0.9, 0.0, 0.0]]
)
NEXT = np.array([[0, 1, 1, 1], [1, 1, 1, 1], [2, 3, 3, 3], [3, 3, 3, 3]])
PAIR = {
    "P_emit": P_EMIT,
    "P_next": NEXT,
    "P_start": 0,
    "Q_emit": Q_EMIT,
    "Q_next": NEXT,
    "Q_start": 0,
}
STARTS = [(0, 0), (2, 2)]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    path = tmp_path_factory.mktemp("agg") / "run.zarr"
    write_synthetic_trace_store(
        path, {"mixed": PAIR}, horizon=T, branches=2, replicates=400, docs=STARTS, seed=4
    )
    return analyze(path, n_boot=200)


@pytest.fixture(scope="module")
def truth():
    base = as_emitter_pair(PAIR)
    return [exact_dp(with_starts(base, sp, sq), T, T - 1) for sp, sq in STARTS]


def _summary(result, quantity):
    rows = [
        r
        for r in result.models[0].tables["summary"]
        if r["policy"] == "mixed" and r["quantity"] == quantity
    ]
    assert len(rows) == 1, quantity
    return rows[0]["estimate"]


def _mean_and_se(result, name):
    """Mean over documents of a per-document quantity and its Monte Carlo SE."""
    units = [d.units["mixed"] for d in result.models[0].docs]
    values = np.array([u.values[name] for u in units])
    ses = np.array([u.stderr[name] for u in units])
    return values.mean(), np.sqrt(np.sum(ses**2)) / len(units)


def test_the_documents_make_the_definitions_matter(truth):
    occ = [t["occurrence"] for t in truth]
    occupation = [t["occupation"] for t in truth]
    post = [t["expected_mismatches"] - t["occurrence"] for t in truth]
    ratio_of_means = sum(post) / sum(occupation)
    mean_of_ratios = np.mean([p / c for p, c in zip(post, occupation, strict=True)])
    assert abs(ratio_of_means - mean_of_ratios) > 0.15
    assert abs(np.mean(occ) - np.mean(occupation)) / T > 0.2


def test_first_mismatch_and_exposure_match_exact(result, truth):
    for quantity, per_doc in (("first_mismatch", "occurrence"), ("exposure", "occupation")):
        want = np.mean([t[per_doc] for t in truth]) / T
        _, se = _mean_and_se(result, per_doc)
        got = _summary(result, quantity)
        assert abs(got - want) <= 4.5 * se / T + 1e-6, (quantity, got, want, se)


def test_rho_is_a_ratio_of_means_matching_exact(result, truth):
    post_true = sum(t["expected_mismatches"] - t["occurrence"] for t in truth)
    occ_true = sum(t["occupation"] for t in truth)
    want = post_true / occ_true
    post, se_post = _mean_and_se(result, "post_mismatches")
    occ, se_occ = _mean_and_se(result, "occupation")
    # Delta method with the covariance bounded by the product of the SEs.
    se = (se_post + abs(post / occ) * se_occ) / occ
    got = _summary(result, "rho")
    assert abs(got - want) <= 4.5 * se + 1e-6, (got, want, se)
    m_true = np.mean([t["expected_mismatches"] for t in truth]) / T
    _, se_m = _mean_and_se(result, "expected_mismatches")
    assert abs(_summary(result, "mismatch_fraction") - m_true) <= 4.5 * se_m / T + 1e-6


def _curve(result, curve, x):
    rows = [
        r
        for r in result.models[0].tables["curves"]
        if r["policy"] == "mixed" and r["curve"] == curve and r["x"] == x
    ]
    assert len(rows) == 1, (curve, x)
    return rows[0]["estimate"]


def test_overlap_paths_are_deterministic(result):
    """Each start state's only overlap token leads back to it, so every replicate's hazards
    are the same: survival, pmf, occurrence, occupation and tau are exact (float32 storage
    aside), which the next test relies on."""
    for d in result.models[0].docs:
        for name in ("occurrence", "occupation", "tau_mass"):
            assert d.units["mixed"].stderr[name] < 1e-6, (d.doc_id, name)


def test_time_to_divergence_matches_exact(result, truth):
    pmf = np.array([t["pmf"] for t in truth])  # (docs, T)
    surv = np.array([t["survival"] for t in truth])  # (docs, T + 1)
    steps = np.arange(1, T + 1)
    mean_tau = (pmf @ steps).sum() / pmf.sum()
    assert _summary(result, "mean_tau") == pytest.approx(mean_tau, abs=1e-5)
    for t in range(1, T + 1):
        want = pmf[:, t - 1].sum() / surv[:, t - 1].sum()
        assert _curve(result, "hazard", t) == pytest.approx(want, abs=1e-6), t
        assert _curve(result, "pmf", t) == pytest.approx(pmf[:, t - 1].mean(), abs=1e-6), t
        assert _curve(result, "survival", t) == pytest.approx(surv[:, t].mean(), abs=1e-6), t


def test_early_and_late_window_tv_match_exact(result, truth):
    """Branch-aligned TV pooled over the first and second half of the window (lags 1..L/2 and
    L/2+1..L), O-weighted over the branches that reach each lag, against the exact
    E[delta_{tau+l}; tau + l <= T] / P(tau + l <= T). Only the branch times are random here:
    after a divergence document A's TV is 0 and B's is 0.8 at every lag, so the estimate is
    0.8 D_B / (D_A + D_B) with D the O-weighted share of branches reaching the lags (binomial
    over R K draws), and its SE follows by the delta method."""
    R, K = 400, 2
    L = T - 1
    half = L // 2
    occ = [t["occurrence"] for t in truth]
    for name, lags in (("early_tv", range(1, half + 1)), ("late_tv", range(half + 1, L + 1))):
        lags = list(lags)
        num = sum(t["post_by_lag"][lags].sum() for t in truth)
        den = [t["reach"][lags].sum() for t in truth]
        want = num / sum(den)
        # sd of each document's D: binomial per lag, summed (lags share their draws).
        sd = [
            sum(o * np.sqrt(max(p * (1 - p), 0.0) / (R * K)) for p in t["reach"][lags] / o)
            for t, o in zip(truth, occ, strict=True)
        ]
        total = sum(den)
        se = 0.8 * np.hypot(den[0] * sd[1], den[1] * sd[0]) / total**2
        got = _summary(result, name)
        assert abs(got - want) <= 4.5 * se + 1e-6, (name, got, want, se)
    diff = _summary(result, "late_minus_early_tv")
    assert diff == pytest.approx(_summary(result, "late_tv") - _summary(result, "early_tv"))


def test_one_document_bootstrap_is_the_document_itself(tmp_path):
    """Every resample of one document is that document: each CI collapses to its estimate."""
    path = tmp_path / "one.zarr"
    write_synthetic_trace_store(
        path, {"mixed": PAIR}, horizon=T, replicates=50, docs=[(2, 2)], seed=1
    )
    result = analyze(path, n_boot=50)
    unit = result.models[0].docs[0].units["mixed"]
    rows = {r["quantity"]: r for r in result.models[0].tables["summary"]}
    assert rows["occurrence"]["estimate"] == pytest.approx(unit.values["occurrence"], rel=1e-12)
    checked = 0
    for name, r in rows.items():
        if np.isfinite(r["estimate"]):
            assert r["ci_low"] == pytest.approx(r["estimate"], rel=1e-9, abs=1e-12), name
            assert r["ci_high"] == pytest.approx(r["estimate"], rel=1e-9, abs=1e-12), name
            checked += 1
    assert checked >= 10


# Recomputation ---------------------------------------------------------------------------------
def _dyadic_markov(vocab: int, seed: int) -> dict[str, np.ndarray]:
    """A Markov pair whose probabilities are multiples of 1/64: exact in float16, so every
    stored and recomputed TV is exact and recorded and recomputed agree to the last bit. Q
    always puts weight on the last token, P never does, so the last entries (the remainder
    after the 8-wide lanes) always count."""
    rng = np.random.default_rng(seed)

    def rows(extra_last: int) -> np.ndarray:
        counts = rng.multinomial(64 - extra_last, rng.dirichlet(np.ones(vocab - 1)), size=vocab)
        return np.column_stack([counts, np.full(vocab, extra_last)]) / 64.0

    return {"P": rows(0), "Q": rows(8), "start": 0}


def rewrite_distributions(path, dtype: str) -> None:
    """Store the recorded distributions as ``dtype`` (what a user re-writing a store gets)."""
    try:  # zarr 3 would look arrays up in the consolidated metadata written at creation
        g = zarr.open_group(str(path), mode="r+", use_consolidated=False)
    except TypeError:  # zarr 2 reads the array metadata itself
        g = zarr.open_group(str(path), mode="r+")
    config = getattr(zarr, "config", None)
    for name in ("p", "q", "branch_p", "branch_q"):
        old = g[name]
        data, chunks, attrs = old[...], old.chunks, dict(old.attrs)
        if hasattr(g, "create_array"):  # zarr >= 3
            new = g.create_array(name, shape=data.shape, chunks=chunks, dtype=dtype, overwrite=True)
        else:
            new = g.create_dataset(
                name, shape=data.shape, chunks=chunks, dtype=dtype, overwrite=True
            )
        new.attrs.update(attrs)
        if config is not None:
            with config.set({"array.write_empty_chunks": True}):
                new[...] = data.astype(dtype)
        else:
            new[...] = data.astype(dtype)
    zarr.consolidate_metadata(str(path))
    for name in ("p", "q", "branch_p", "branch_q"):
        assert zarr.open_group(str(path), mode="r")[name].dtype == np.dtype(dtype)


@pytest.mark.parametrize("vocab", [11, 1029])
def test_recomputation_from_wider_stores(tmp_path, vocab):
    """float16 (as written), float32 and float64 stores recompute the same exact TVs; vocab 11
    and 1029 leave 3 and 5 entries after the last full 8-wide lane group."""
    pair = {"a": _dyadic_markov(vocab, 1), "b": _dyadic_markov(vocab, 2)}
    path = tmp_path / "run.zarr"
    write_synthetic_trace_store(
        path, pair, horizon=3, branches=1, replicates=4, docs=2, record="full", seed=3
    )
    rows = None
    for dtype in ("float16", "float32", "float64"):
        if dtype != "float16":
            rewrite_distributions(path, dtype)
        result = analyze(path, n_boot=20)
        checks = [d.check for d in result.models[0].docs]
        n = sum(c.rows_checked for c in checks)
        assert n >= 2 * 2 * 4 * 3, dtype  # every path row at least
        rows = n if rows is None else rows
        assert n == rows, dtype
        assert max(c.max_abs_diff for c in checks) == 0.0, dtype
        assert result.checks() == [], dtype
    # A recorded hazard off by one unit of 1/128 is reported on the float64 store.
    g = zarr.open_group(str(path), mode="r+")
    h = g["hazard"][1, 0]
    h[2, 1] += 1.0 / 128
    g["hazard"][1, 0] = h
    bad = analyze(path, n_boot=20).checks()
    assert [(r["doc_id"], r["policy"], r["rep"], r["index"]) for r in bad] == [
        ("doc0001", "a", 2, 2)
    ]
    assert bad[0]["recorded"] - bad[0]["recomputed"] == pytest.approx(1.0 / 128, abs=1e-7)
