"""The per (document, policy) RB-CMC estimates in plain numpy: the independent reference of
the Rust implementation the analysis uses (``kvcouple._core.estimate_units``; the tests hold
the two equal to 1e-12). SPEC sections 3-5; the definitions are in
:mod:`kvcouple.analysis.estimates`.
"""

from __future__ import annotations

import numpy as np

from kvcouple import decomposition as dc
from kvcouple.analysis.estimates import ESTIMATORS, NOISE_OCCURRENCE, UnitEstimate, where
from kvcouple.errors import StoreError

__all__ = ["estimate_unit"]


def estimate_unit(
    hazard: np.ndarray,
    branch_step: np.ndarray,
    branch_mismatch: np.ndarray,
    branch_tv: np.ndarray,
    *,
    obs_window: int,
    estimator: str = "indicator",
    doc_id: str = "?",
    policy: str = "?",
) -> UnitEstimate:
    """Estimates for one (document, policy) from arrays ``hazard[rep, step]``,
    ``branch_step[rep, branch]``, ``branch_mismatch[rep, branch, lag]`` and
    ``branch_tv[rep, branch, lag]`` as stored. ``obs_window`` is ``L_w`` (at most the stored L).
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
    where_ = where(doc_id, policy)
    L = branch_mismatch.shape[-1] - 1
    if not 0 <= obs_window <= L:
        raise ValueError(
            f"the observation window must be in 0..{L} (the stored window), got {obs_window}"
        )
    h = _checked_hazard(hazard, where_)
    R, T = h.shape
    w, mass = _divergence_law(h)
    has_branch = _checked_branches(branch_step, mass.sum(1), T, where_)
    per_rep = _per_replicate(
        mass, has_branch, branch_mismatch, branch_tv, obs_window, estimator, L >= T - 1
    )
    values = {k: float(v.mean()) for k, v in per_rep.items()}
    stderr = {k: float(v.std(ddof=1) / np.sqrt(R)) if R > 1 else np.nan for k, v in per_rep.items()}
    tv_lag_num, tv_lag_den = _tv_by_lag(branch_tv, has_branch, per_rep["occurrence"])
    pmf = mass.mean(0)
    survival = np.concatenate([[1.0], w.mean(0)])
    return UnitEstimate(
        values, stderr, survival, pmf, tv_lag_num, tv_lag_den, _median_tau(pmf), L >= T - 1
    )


def _checked_hazard(hazard: np.ndarray, where: str) -> np.ndarray:
    """The hazards as doubles, refusing any that is not a probability."""
    h = np.asarray(hazard, np.float64)
    bad = ~np.isfinite(h) | (h < 0) | (h > 1 + 1e-6)
    if bad.any():
        r, t = np.argwhere(bad)[0]
        raise StoreError(
            f"{where}: hazard {float(h[r, t])} at replicate {r}, step "
            f"{t + 1} is not a probability (damaged or wrongly written store)"
        )
    return np.minimum(h, 1.0)


def _divergence_law(h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Survival weights ``W_t`` and the contributions ``W_{t-1} h_t`` to ``P(tau = t)``."""
    w = np.cumprod(1.0 - h, axis=1)
    w_prev = np.concatenate([np.ones((h.shape[0], 1)), w[:, :-1]], axis=1)
    return w, w_prev * h


def _checked_branches(
    branch_step: np.ndarray, occurrence: np.ndarray, T: int, where: str
) -> np.ndarray:
    """Which branches were recorded, refusing a diverging replicate without them or a branch
    past the horizon. A tracer may skip the branches when divergence is float noise (e.g. the
    `full` policy); such a replicate's post-divergence part, at most O * T, counts as 0."""
    has_branch = branch_step > 0
    missing = (occurrence > NOISE_OCCURRENCE) & ~has_branch.all(1)
    if missing.any():
        r = int(np.flatnonzero(missing)[0])
        raise StoreError(
            f"{where}: replicate {r} diverges with probability "
            f"{occurrence[r]:.3g} but has no branch recorded (branch_step 0)"
        )
    out_of_range = has_branch & (branch_step > T)
    if out_of_range.any():
        r, k = np.argwhere(out_of_range)[0]
        raise StoreError(
            f"{where}: branch_step {branch_step[r, k]} of "
            f"replicate {r}, branch {k + 1} is past the horizon T={T}"
        )
    return np.asarray(has_branch)


def _per_replicate(
    mass: np.ndarray,
    has_branch: np.ndarray,
    branch_mismatch: np.ndarray,
    branch_tv: np.ndarray,
    obs_window: int,
    estimator: str,
    tail_observed: bool,
) -> dict[str, np.ndarray]:
    """Every scalar of SCALARS per replicate (NaN where it needs the unobserved tail)."""
    R, T = mass.shape
    steps = np.arange(1, T + 1, dtype=np.float64)
    occurrence = mass.sum(1)
    if estimator == "indicator":
        per_lag = np.maximum(np.asarray(branch_mismatch, np.float64), 0.0)  # -1: unobserved
    else:
        per_lag = np.nan_to_num(np.asarray(branch_tv, np.float64), nan=0.0)
    per_lag = np.where(has_branch[:, :, None], per_lag, 0.0)
    win = per_lag[:, :, 1 : obs_window + 1].sum(2).mean(1) * occurrence
    tail = per_lag[:, :, obs_window + 1 :].sum(2).mean(1) * occurrence
    tail_exposure = mass @ np.maximum(T - steps - obs_window, 0.0)
    unobserved = np.full(R, np.nan)
    return {
        "occurrence": occurrence,
        "occupation": mass @ (T - steps),
        "post_mismatches": win + tail if tail_observed else unobserved,
        "expected_mismatches": occurrence + win + tail if tail_observed else unobserved,
        "window_contribution": win,
        "tail_contribution": tail if tail_observed else unobserved,
        "tail_exposure": tail_exposure,
        "interval_lower": occurrence + win,
        "interval_upper": occurrence + win + tail_exposure,
        "tau_mass": mass @ steps,
    }


def _tv_by_lag(
    branch_tv: np.ndarray, has_branch: np.ndarray, occurrence: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Numerator and denominator of the O-weighted branch-aligned TV per lag."""
    tv = np.asarray(branch_tv, np.float64)
    R = tv.shape[0]
    reached = np.isfinite(tv) & has_branch[:, :, None]
    weight = occurrence[:, None]
    num = (np.where(reached, tv, 0.0).mean(1) * weight).sum(0) / R
    den = (reached.mean(1) * weight).sum(0) / R
    return num, den


def _median_tau(pmf: np.ndarray) -> float:
    """The median step of the law of tau given tau <= T (step t spread over (t-1/2, t+1/2]);
    NaN when the document never diverges."""
    return float(dc.median_step(pmf))
