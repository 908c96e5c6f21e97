"""An independent exact solver for the analysis tests (SPEC sections 3-6): dynamic programming
over the SMC joint chain of a synthetic emitter pair. Kept small and separate from
``kvcouple.synth`` so the analysis is checked against two implementations once that lands."""

from __future__ import annotations

import numpy as np


def exact_dp(pair, horizon: int, window: int) -> dict[str, object]:
    """occurrence, survival, pmf, occupation, expected_mismatches, window/tail contributions,
    tail_exposure and the O-weighted branch TV by lag (lags 0..T-1) of ``pair`` (an
    ``EmitterPair``)."""
    T, L = horizon, window
    pe, pn, qe, qn = pair.p_emit, pair.p_next, pair.q_emit, pair.q_next
    a = np.zeros((pe.shape[0], qe.shape[0]))
    a[pair.p_start, pair.q_start] = 1.0
    pmf = np.zeros(T)
    post = np.zeros(T)  # expected mismatches by lag after tau
    reach = np.zeros(T)  # P(tau <= T - lag)

    def step(mass: np.ndarray, diverge_only: bool = False):
        """One SMC step from a joint state distribution: mismatch mass, next distributions."""
        overlap_next = np.zeros_like(mass)
        resid_next = np.zeros_like(mass)
        mismatch = 0.0
        for sp, sq in zip(*np.nonzero(mass), strict=True):
            w = mass[sp, sq]
            p, q = pe[sp], qe[sq]
            m = np.minimum(p, q)
            d = 1.0 - m.sum()
            mismatch += w * d
            for z in np.flatnonzero(m):
                overlap_next[pn[sp, z], qn[sq, z]] += w * m[z]
            if d > 1e-15:
                rp, rq = np.maximum(p - q, 0.0), np.maximum(q - p, 0.0)
                for x in np.flatnonzero(rp):
                    for y in np.flatnonzero(rq):
                        resid_next[pn[sp, x], qn[sq, y]] += w * rp[x] * rq[y] / d
        return mismatch, overlap_next, resid_next

    for t in range(1, T + 1):
        d_mass, a_next, b = step(a)
        pmf[t - 1] = d_mass
        reach[0] += d_mass
        post_states = b
        for s in range(t + 1, T + 1):
            lag = s - t
            mm, o, r = step(post_states)
            post[lag] += mm
            reach[lag] += d_mass
            post_states = o + r
        a = a_next
    steps = np.arange(1, T + 1)
    occurrence = pmf.sum()
    lags = np.arange(T)
    return {
        "occurrence": occurrence,
        "pmf": pmf,
        "survival": np.concatenate([[1.0], 1.0 - np.cumsum(pmf)]),
        "occupation": float(pmf @ (T - steps)),
        "expected_mismatches": occurrence + post.sum(),
        "window_contribution": post[(lags >= 1) & (lags <= L)].sum(),
        "tail_contribution": post[lags > L].sum(),
        "tail_exposure": float(pmf @ np.maximum(T - steps - L, 0)),
        "post_by_lag": post,
        "reach": reach,
        "branch_tv": np.where(
            reach > 0, np.concatenate([[np.nan], post[1:]]) / np.where(reach > 0, reach, 1), np.nan
        ),
    }
