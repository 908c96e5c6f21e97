"""The exact solver against brute-force enumeration, its identities, and the construction."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcouple import synth
from synth_helpers import tiny_kernel


def _stats(a: np.ndarray, b: np.ndarray) -> tuple[float, np.ndarray, np.ndarray, np.ndarray]:
    """delta, overlap law, residual laws (the SMC of SPEC section 2, written independently)."""
    mins = np.minimum(a, b)
    rp, rq = np.maximum(a - b, 0), np.maximum(b - a, 0)
    if mins.sum() <= 0:
        delta = 1.0
    elif rp.sum() <= 0 or rq.sum() <= 0:
        delta = 0.0
    else:
        delta = min(0.5 * np.abs(a - b).sum(), 1.0)
    return (
        delta,
        mins / max(mins.sum(), 1e-300),
        rp / max(rp.sum(), 1e-300),
        rq / max(rq.sum(), 1e-300),
    )


def brute_force(pair: synth.KernelPair, horizon: int, window: int) -> dict[str, object]:
    """Enumerate every joint SMC path (token pairs with their probabilities)."""
    lags = min(window, horizon - 1)
    acc = {
        "pmf": np.zeros(horizon),
        "mism": np.zeros(horizon),
        "win": 0.0,
        "tail": 0.0,
        "tv_num": np.zeros(lags),
        "tv_den": np.zeros(lags),
    }
    p, q = pair.p, pair.q

    def walk(t: int, sp: int, sq: int, prob: float, tau: int) -> None:
        if t > horizon or prob == 0.0:
            return
        a, b = p.emit[sp], q.emit[sq]
        delta, m, rp, rq = _stats(a, b)
        if tau:
            lag = t - tau
            if lag <= lags:
                acc["tv_num"][lag - 1] += prob * delta
                acc["tv_den"][lag - 1] += prob
        for z in np.nonzero(m)[0]:
            walk(t + 1, p.next[sp, z], q.next[sq, z], prob * (1 - delta) * m[z], tau)
        if delta > 0:
            for x in np.nonzero(rp)[0]:
                for y in np.nonzero(rq)[0]:
                    w = prob * delta * rp[x] * rq[y]
                    acc["mism"][t - 1] += w
                    if not tau:
                        acc["pmf"][t - 1] += w
                    elif t - tau <= window:
                        acc["win"] += w
                    else:
                        acc["tail"] += w
                    walk(t + 1, p.next[sp, x], q.next[sq, y], w, tau or t)

    walk(1, p.start, q.start, 1.0, 0)
    return acc


def tiny_pairs() -> list[synth.KernelPair]:
    pairs = []
    for seed in range(12):
        pairs.append(
            synth.random_pair(
                2 + seed % 2,
                1 + seed % 3 + (seed % 4 == 3),
                seed=seed,
                closeness=[0.3, 0.8, 0.95][seed % 3],
                sparsity=0.3 * (seed % 2),
                deterministic=0.2 * (seed % 3 == 1),
                absorbing=seed % 4 == 3,
                markov=seed % 5 == 0,
            )
        )
    return pairs


@pytest.mark.parametrize("index", range(12))
@pytest.mark.parametrize(("horizon", "window"), [(1, 0), (3, 1), (4, 2), (4, 9)])
def test_exact_matches_brute_force(index: int, horizon: int, window: int) -> None:
    pair = tiny_pairs()[index]
    bf = brute_force(pair, horizon, window)
    e = synth.exact(pair, horizon, window)
    np.testing.assert_allclose(e.divergence_time_pmf, bf["pmf"], atol=1e-12)
    np.testing.assert_allclose(e.mismatch_by_step, bf["mism"], atol=1e-12)
    assert e.window_contribution == pytest.approx(bf["win"], abs=1e-12)
    assert e.tail_contribution == pytest.approx(bf["tail"], abs=1e-12)
    assert e.expected_mismatches == pytest.approx(bf["mism"].sum(), abs=1e-12)
    np.testing.assert_allclose(e.branch_lag_weight, bf["tv_den"], atol=1e-12)
    den = np.where(bf["tv_den"] > 0, bf["tv_den"], np.nan)
    np.testing.assert_allclose(e.branch_tv_by_lag, bf["tv_num"] / den, atol=1e-12)
    t = np.arange(1, horizon + 1)
    assert e.tail_exposure == pytest.approx(
        (bf["pmf"] * np.maximum(horizon - t - window, 0)).sum(), abs=1e-12
    )


@pytest.mark.parametrize("seed", range(25))
def test_decomposition_identities(seed: int) -> None:
    pair = synth.random_pair(2 + seed % 5, 1 + seed % 8, seed=seed, closeness=0.9, sparsity=0.2)
    horizon, window = 1 + seed % 16, seed % 7
    e = synth.exact(pair, horizon, window)
    parts = e.occurrence + e.window_contribution + e.tail_contribution
    assert abs(e.expected_mismatches - parts) <= 1e-12
    # m = f + e * rho, in fractions
    if e.occupation > 0:
        rebuilt = e.first_mismatch + e.exposure * e.rho
        assert abs(e.mismatch_fraction - rebuilt) <= 1e-12
    assert e.survival[0] == 1.0 and len(e.survival) == horizon + 1
    assert abs(1 - e.survival[-1] - e.occurrence) <= 1e-12
    assert abs(sum(1 - e.survival[:-1]) - e.occupation) <= 1e-12
    assert np.all(np.diff(e.survival) <= 1e-15)
    assert e.interval_lower <= e.expected_mismatches + 1e-12 <= e.interval_upper + 2e-12
    surv_before = e.survival[:-1]
    ok = surv_before > 0
    np.testing.assert_allclose(e.hazard[ok], e.divergence_time_pmf[ok] / surv_before[ok])
    # L >= T traces to the horizon: no tail at all.
    full = synth.exact(pair, horizon, horizon)
    assert full.tail_contribution == 0 and full.tail_exposure == 0
    assert full.interval_lower == pytest.approx(full.expected_mismatches, abs=1e-12)


def test_edge_cases() -> None:
    table = np.array([[0.2, 0.5, 0.3], [0.6, 0.2, 0.2], [0.1, 0.1, 0.8]])
    same = synth.KernelPair.markov(table, table, start=0)
    e = synth.exact(same, 10, 3)
    assert e.expected_mismatches == 0 and e.occurrence == 0 and np.isnan(e.rho)
    # Disjoint supports at every row: TV 1 at every step.
    p = np.tile([1.0, 0.0], (2, 1))
    q = np.tile([0.0, 1.0], (2, 1))
    e = synth.exact(synth.KernelPair.markov(p, q, start=0), 6, 2)
    assert e.expected_mismatches == 6 and e.divergence_time_pmf[0] == 1
    assert e.window_contribution == 2 and e.tail_contribution == 3 and e.tail_exposure == 3
    # TV 1 at step 1, identical afterwards: one mismatch, then re-synchronised rows.
    emit_p = np.array([[1.0, 0.0], [0.5, 0.5]])
    emit_q = np.array([[0.0, 1.0], [0.5, 0.5]])
    nxt = np.array([[1, 1], [1, 1]])
    pair = synth.KernelPair(synth.Kernel(emit_p, nxt, 0), synth.Kernel(emit_q, nxt, 0))
    e = synth.exact(pair, 8, 2)
    assert e.occurrence == 1 and e.expected_mismatches == 1 and e.rho == 0


def test_exact_is_fast_at_the_stated_size() -> None:
    pair = synth.random_pair(16, 16, seed=3, closeness=0.9, sparsity=0.1)
    start = time.perf_counter()
    e = synth.exact(pair, 64, 64)
    elapsed = time.perf_counter() - start
    assert np.isfinite(e.expected_mismatches)
    print(f"S = V = 16, T = L = 64: {elapsed:.3f} s")  # informative; no timing assertion


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("window", [0, 2, 5, 30])
def test_constructions_attain_the_interval_ends(seed: int, window: int) -> None:
    pair = synth.random_pair(
        2 + seed % 4, 2 + seed % 3, seed=seed, closeness=0.85, absorbing=seed % 3 == 2
    )
    horizon = 12
    e = synth.exact(pair, horizon, window)
    lower, upper = synth.interval_constructions(pair, horizon, window)
    el, eu = synth.exact(lower, horizon, window), synth.exact(upper, horizon, window)
    assert e.interval_lower - 1e-12 <= e.expected_mismatches <= e.interval_upper + 1e-12
    assert el.expected_mismatches == pytest.approx(e.interval_lower, abs=1e-12)
    assert eu.expected_mismatches == pytest.approx(e.interval_upper, abs=1e-12)
    for c in (el, eu):
        # The observed law: divergence times, window mismatches and TVs by lag.
        np.testing.assert_allclose(c.divergence_time_pmf, e.divergence_time_pmf, atol=1e-12)
        assert c.window_contribution == pytest.approx(e.window_contribution, abs=1e-12)
        np.testing.assert_allclose(c.branch_tv_by_lag, e.branch_tv_by_lag, atol=1e-12)
        assert c.interval_lower == pytest.approx(e.interval_lower, abs=1e-12)
        assert c.interval_upper == pytest.approx(e.interval_upper, abs=1e-12)
    assert el.tail_contribution == 0
    assert eu.tail_contribution == pytest.approx(e.tail_exposure, abs=1e-12)
    # Beyond the window the TVs are 0 (lower) and 1 (upper).
    full_l, full_u = synth.exact(lower, horizon, horizon), synth.exact(upper, horizon, horizon)
    beyond = full_l.branch_lag_weight[window:] > 0
    assert np.all(full_l.branch_tv_by_lag[window:][beyond] == 0)
    assert np.allclose(full_u.branch_tv_by_lag[window:][beyond], 1)


@given(data=st.data())
def test_exact_matches_brute_force_on_arbitrary_tiny_pairs(data: st.DataObject) -> None:
    vocab = data.draw(st.integers(2, 3))
    pair = synth.KernelPair(data.draw(tiny_kernel(vocab)), data.draw(tiny_kernel(vocab)))
    horizon = data.draw(st.integers(1, 4))
    window = data.draw(st.integers(0, 4))
    bf = brute_force(pair, horizon, window)
    e = synth.exact(pair, horizon, window)
    np.testing.assert_allclose(e.divergence_time_pmf, bf["pmf"], atol=1e-12)
    np.testing.assert_allclose(e.mismatch_by_step, bf["mism"], atol=1e-12)
    assert e.window_contribution == pytest.approx(bf["win"], abs=1e-12)
    assert e.tail_contribution == pytest.approx(bf["tail"], abs=1e-12)
    lower, upper = synth.interval_constructions(pair, horizon, window)
    assert synth.exact(lower, horizon, window).expected_mismatches == pytest.approx(
        e.interval_lower, abs=1e-12
    )
    assert synth.exact(upper, horizon, window).expected_mismatches == pytest.approx(
        e.interval_upper, abs=1e-12
    )


def test_renamed_quantities_still_read_with_a_warning():
    """One release of deprecated aliases: first_mismatch_contribution, mismatch_rate (exact)
    and total_loss (simulate), each the registered quantity's value."""
    pair = synth.random_pair(3, 2, seed=4)
    e = synth.exact(pair, 6)
    with pytest.warns(DeprecationWarning, match="use 'first_mismatch'"):
        assert e.first_mismatch_contribution == e.first_mismatch == e.occurrence / 6
    with pytest.warns(DeprecationWarning, match="use 'rho'"):
        assert e.mismatch_rate == e.rho
    out = synth.simulate(pair, 6, estimator="indicator", replicates=20)
    with pytest.warns(DeprecationWarning, match="use 'expected_mismatches'"):
        np.testing.assert_array_equal(out["total_loss"], out["expected_mismatches"])
    est = synth.estimate(pair, 6, replicates=20)
    with pytest.warns(DeprecationWarning):
        assert est.mean["mismatch_rate"] == est.mean["rho"]
