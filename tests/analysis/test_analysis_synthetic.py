"""analyze's estimates agree with the exact solver on synthetic stores (SPEC sections 3-5, 9).

Each pair is simulated into a trace store with RB-CMC (``kvcouple.synth.trace_store``) and
analysed end to end. Tolerances come from the estimates' own uncertainty: per document, 4.5
Monte Carlo standard errors; across documents, the exact mean must lie in the bootstrap CI
widened by the Monte Carlo standard error of the mean (the CI is about resampling documents;
with few near-identical documents it can be narrower than the simulation noise).
"""

from __future__ import annotations

import numpy as np
import pytest

from analysis_exact_dp import exact_dp
from kvcouple.analysis import analyze
from kvcouple.synth.trace_store import as_emitter_pair, with_starts, write_synthetic_trace_store

T = 8


def exact_truth(pair, start: int, horizon: int, window: int) -> dict[str, object]:
    """The exact solver's answer: ``kvcouple.synth.exact`` (the project's solver) when it is
    installed, else the independent DP of ``analysis_exact_dp`` (the two are cross-checked
    below)."""
    base = with_starts(as_emitter_pair(pair), start, start)
    try:
        from kvcouple import synth
    except ImportError:
        return exact_dp(base, horizon, window)
    kp = synth.pair_from_mapping(
        {
            "P_emit": base.p_emit,
            "P_next": base.p_next,
            "P_start": base.p_start,
            "Q_emit": base.q_emit,
            "Q_next": base.q_next,
            "Q_start": base.q_start,
        }
    )
    r = synth.exact(kp, horizon=horizon, window=window)
    post = np.zeros(horizon)
    reach = np.zeros(horizon)
    reach[0] = r.occurrence
    n = len(r.branch_tv_by_lag)
    reach[1 : n + 1] = r.branch_lag_weight
    post[1 : n + 1] = np.nan_to_num(r.branch_tv_by_lag) * r.branch_lag_weight
    return {
        "occurrence": r.occurrence,
        "occupation": r.occupation,
        "expected_mismatches": r.expected_mismatches,
        "window_contribution": r.window_contribution,
        "tail_contribution": r.tail_contribution,
        "tail_exposure": r.tail_exposure,
        "survival": np.asarray(r.survival),
        "pmf": np.asarray(r.divergence_time_pmf),
        "post_by_lag": post,
        "reach": reach,
    }


def _markov(seed: int, V: int, mix: float) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    P = rng.dirichlet(np.ones(V) * 0.7, size=V)
    Q = (1 - mix) * P + mix * rng.dirichlet(np.ones(V), size=V)
    return {"P": P, "Q": Q, "start": 0}


def _emitter(seed: int) -> dict[str, np.ndarray]:
    """A 3-state emitter pair over 3 tokens whose states differ from the last token."""
    rng = np.random.default_rng(seed)
    S, V = 3, 3
    nxt = rng.integers(0, S, size=(S, V))
    pe = rng.dirichlet(np.ones(V), size=S)
    qe = 0.7 * pe + 0.3 * rng.dirichlet(np.ones(V), size=S)
    return {"P_emit": pe, "P_next": nxt, "P_start": 0, "Q_emit": qe, "Q_next": nxt, "Q_start": 0}


PAIRS = {
    "markov3": _markov(1, 3, 0.25),
    "markov3b": _markov(2, 3, 0.45),
    "emitter": _emitter(3),
}
STARTS = [0, 1, 2]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("syn") / "run.zarr"
    write_synthetic_trace_store(
        path, PAIRS, horizon=T, branches=2, replicates=300, docs=STARTS, seed=11
    )
    return path


@pytest.fixture(scope="module")
def exact():
    out = {}
    for name, pair in PAIRS.items():
        out[name] = [exact_truth(pair, s, T, T - 1) for s in STARTS]
    return out


def _row(rows, **kw):
    hits = [r for r in rows if all(r[k] == v for k, v in kw.items())]
    assert len(hits) == 1, kw
    return hits[0]


def _check_aggregate(result, exact, quantities, scale=None):
    m = result.models[0]
    per_doc = {(d.doc_id, pol): u for d in m.docs for pol, u in d.units.items()}
    for pol, ex in exact.items():
        for q in quantities:
            truth = np.mean([e[q] for e in ex]) / (scale or {}).get(q, 1.0)
            row = _row(m.tables["summary"], policy=pol, quantity=q)
            ses = [per_doc[(f"doc{i:04d}", pol)].stderr[q] for i in range(len(ex))]
            mc_se = np.sqrt(np.sum(np.square(ses))) / len(ses) / (scale or {}).get(q, 1.0)
            lo, hi = row["ci_low"] - 3 * mc_se, row["ci_high"] + 3 * mc_se
            assert lo <= truth <= hi, (pol, q, truth, row)


@pytest.mark.parametrize("estimator", ["indicator", "tv"])
def test_estimates_agree_with_exact_solver(store, exact, estimator):
    result = analyze(store, estimator=estimator, n_boot=400)
    m = result.models[0]
    assert result.estimator == estimator
    quantities = ["occurrence", "occupation", "expected_mismatches", "window_contribution"]
    # Per document: within 4.5 Monte Carlo standard errors (plus float32 storage rounding).
    for d in m.docs:
        i = int(d.doc_id[3:])
        for pol, u in d.units.items():
            for q in quantities:
                truth = exact[pol][i][q]
                assert abs(u.values[q] - truth) <= 4.5 * u.stderr[q] + 1e-5, (pol, i, q)
            # Survival curve: every point within 4.5 SE of S_t, computed over replicates.
    _check_aggregate(result, exact, quantities)


def test_curves_and_rho_match_exact(store, exact):
    result = analyze(store, n_boot=400)
    m = result.models[0]
    for pol, ex in exact.items():
        s_true = np.mean([e["survival"] for e in ex], axis=0)
        for t in range(T + 1):
            row = _row(m.tables["curves"], policy=pol, curve="survival", x=t)
            assert abs(row["estimate"] - s_true[t]) < 0.05
        occ = np.mean([e["occupation"] for e in ex])
        post = np.mean([e["expected_mismatches"] - e["occurrence"] for e in ex])
        rho = _row(m.tables["summary"], policy=pol, quantity="rho")
        assert abs(rho["estimate"] - post / occ) < 0.05
        # Decomposition holds exactly in aggregate: m = f + e rho.
        f = _row(m.tables["summary"], policy=pol, quantity="first_mismatch")["estimate"]
        e = _row(m.tables["summary"], policy=pol, quantity="exposure")["estimate"]
        mm = _row(m.tables["summary"], policy=pol, quantity="mismatch_fraction")["estimate"]
        assert mm == pytest.approx(f + e * rho["estimate"], rel=1e-12)
        # Branch TV by lag: O-weighted over branches that reach the lag, pooled over docs.
        for lag in range(1, T - 2):
            tv = sum(e["post_by_lag"][lag] for e in ex) / sum(e["reach"][lag] for e in ex)
            row = _row(m.tables["curves"], policy=pol, curve="branch_tv", x=lag)
            assert row["ci_low"] - 0.03 <= tv <= row["ci_high"] + 0.03, (pol, lag, row)


def test_observation_window_splits_tail(store, exact):
    """With L_w < stored L: window + tail contributions and tail exposure match the exact
    solver at L_w, and the sharp interval contains E[M]/T."""
    Lw = 3
    ex_w = {pol: [exact_truth(PAIRS[pol], s, T, Lw) for s in STARTS] for pol in PAIRS}
    result = analyze(store, window=Lw, n_boot=400)
    _check_aggregate(result, ex_w, ["window_contribution", "tail_contribution", "tail_exposure"])
    for pol, ex in ex_w.items():
        m_true = np.mean([e["expected_mismatches"] for e in ex]) / T
        lo = _row(
            result.models[0].tables["summary"], policy=pol, quantity="interval_lower_fraction"
        )
        hi = _row(
            result.models[0].tables["summary"], policy=pol, quantity="interval_upper_fraction"
        )
        assert lo["ci_low"] <= m_true <= hi["ci_high"]
        assert lo["estimate"] <= hi["estimate"]


def test_short_window_store_reports_interval_not_point(tmp_path, exact):
    path = tmp_path / "short.zarr"
    write_synthetic_trace_store(
        path,
        {"markov3": PAIRS["markov3"]},
        horizon=T,
        window=2,
        replicates=300,
        docs=STARTS,
        seed=5,
    )
    result = analyze(path, n_boot=300)
    rows = result.models[0].tables["summary"]
    assert np.isnan(_row(rows, quantity="mismatch_fraction")["estimate"])
    ex2 = {"markov3": [exact_truth(PAIRS["markov3"], s, T, 2) for s in STARTS]}
    _check_aggregate(result, ex2, ["window_contribution", "tail_exposure", "occurrence"])
    m_true = np.mean([e["expected_mismatches"] for e in ex2["markov3"]]) / T
    assert _row(rows, quantity="interval_lower_fraction")["ci_low"] <= m_true
    assert m_true <= _row(rows, quantity="interval_upper_fraction")["ci_high"]


def test_independent_exact_dp_matches_synth_exact():
    synth = pytest.importorskip("kvcouple.synth")
    for name, pair in PAIRS.items():
        ours = exact_dp(as_emitter_pair(pair), T, 3)
        theirs = synth.exact(synth.pair_from_mapping(pair), horizon=T, window=3)
        for key in (
            "occurrence",
            "occupation",
            "expected_mismatches",
            "window_contribution",
            "tail_contribution",
            "tail_exposure",
        ):
            assert getattr(theirs, key) == pytest.approx(ours[key], abs=1e-12), (name, key)
        np.testing.assert_allclose(theirs.branch_tv_by_lag, ours["branch_tv"][1:4], atol=1e-12)
