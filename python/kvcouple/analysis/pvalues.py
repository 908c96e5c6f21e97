"""Bootstrap p-values, each the smallest alpha at which the interval of the same method excludes
the value tested: percentile and (expanded) BCa from the replicates
(:func:`bootstrap_p_value`), bootstrap-t from the studentized replicates
(:func:`studentized_p_value`); Holm's step-down correction over a plan's tests (:func:`holm`).
"""

from __future__ import annotations

import math

import numpy as np

from kvcouple.analysis.distributions import norm_cdf, norm_ppf, t_cdf
from kvcouple.analysis.intervals import Estimate


def bootstrap_p_value(
    boot: np.ndarray,
    direction: str,
    value: float = 0.0,
    *,
    z0: float = 0.0,
    accel: float = 0.0,
    n_docs: int | None = None,
) -> float:
    """Bootstrap p-value of ``H0: theta <= value`` (greater), ``>= value`` (less) or
    ``= value`` (two-sided): the smallest alpha at which the interval of the same method
    excludes ``value`` (percentile: ``z0 = accel = 0``; BCa: its constants; expanded:
    ``n_docs``), with the +1 correction that keeps it valid for finite resamples."""
    b = boot[np.isfinite(boot)]
    if b.size == 0:
        return float("nan")
    le = (1 + np.sum(b <= value)) / (b.size + 1)
    ge = (1 + np.sum(b >= value)) / (b.size + 1)
    sd = float(np.std(b, ddof=1)) if b.size > 1 else 0.0
    if sd > 0 and not b.min() <= value <= b.max():
        # Beyond every replicate the intervals extrapolate their ends by the normal tail (never
        # inside the replicates): the matching position of ``value`` is the smaller of the two.
        below = float(norm_cdf((value - b.mean()) / sd))
        if value < b.min():
            le = min(le, below)
        else:
            ge = min(ge, 1.0 - below)

    def level(frac: float) -> float:
        # The alpha whose lower one-sided end sits at the replicates' quantile ``frac``.
        if z0 == 0.0 and accel == 0.0 and n_docs is None:
            return float(frac)
        # The normal tail above can underflow to 0 (or 1): keep the quantile finite, or the
        # BCa map below turns -inf/inf into NaN and a far-off value is never rejected.
        frac = min(max(float(frac), 1e-300), 1.0 - 1e-16)
        u = float(norm_ppf(frac)) - z0
        w = u / (1.0 + accel * u) if 1.0 + accel * u > 0 else math.copysign(math.inf, u)
        z = w - z0
        if n_docs is not None and n_docs >= 2:
            return float(t_cdf(z / math.sqrt(n_docs / (n_docs - 1)), n_docs - 1))
        return float(norm_cdf(z))

    p_greater = level(le)
    p_less = 1.0 - level(1.0 - ge)
    if direction == "greater":
        return p_greater
    if direction == "less":
        return p_less
    return float(min(1.0, 2 * min(p_greater, p_less)))


def studentized_p_value(est: Estimate, direction: str, value: float = 0.0) -> float:
    """The bootstrap-t p-value of ``H0: theta <= value`` (greater), ``>= value`` (less) or
    ``= value``: with ``t = (psi - scale(value)) / se_psi`` on the estimate's scale, ``(1 + #{t* >= t}) / (m + 1)`` (greater)
    and ``(1 + #{t* <= t}) / (m + 1)`` (less), the smallest alpha at which the studentized
    interval excludes ``value``."""
    if est.tstar is None or not math.isfinite(est.se):
        if est.constant or est.se == 0.0:  # a constant statistic: no doubt either way
            return _degenerate_p_value(est.estimate, direction, value)
        return math.nan
    scale = est.scale
    if scale.bounded and not scale.low < value < scale.high:
        psi_value = -math.inf if value <= scale.low else math.inf
    else:
        psi_value = float(scale.forward(value))
    se_psi = float(scale.slope(est.estimate)) * est.se
    with np.errstate(divide="ignore", invalid="ignore"):
        t = (float(scale.forward(est.estimate)) - psi_value) / se_psi
    m = est.tstar.size
    p_greater = float((1 + np.sum(est.tstar >= t)) / (m + 1))
    p_less = float((1 + np.sum(est.tstar <= t)) / (m + 1))
    if direction == "greater":
        return p_greater
    if direction == "less":
        return p_less
    return float(min(1.0, 2 * min(p_greater, p_less)))


def _degenerate_p_value(estimate: float, direction: str, value: float) -> float:
    holds = {"greater": estimate > value, "less": estimate < value}
    if direction in holds:
        return 0.0 if holds[direction] else 1.0
    return 0.0 if estimate != value else 1.0


def holm(p_values: list[float]) -> list[float]:
    """Holm step-down adjusted p-values (monotone, capped at 1)."""
    p = np.asarray(p_values, float)
    order = np.argsort(p)
    adj = np.empty_like(p)
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(p) - rank) * p[i]))
        adj[i] = running
    return adj.tolist()
