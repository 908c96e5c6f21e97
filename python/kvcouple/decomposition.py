"""The decomposition ``E[M]/T = P(tau<=T)/T + exposure x rho`` (SPEC section 3): its parts
from the counts, one implementation for the analysis (column means of documents), the exact
solver (:class:`kvcouple.synth.ExactResult`) and the Monte Carlo estimates
(:class:`kvcouple.synth.Estimate`).

Every function takes numbers or numpy arrays (the analysis's bootstrap passes arrays of
resampled means) and divides once, so each caller gets the same value to the last bit.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def divided_where(a: Any, b: Any, ok: Any) -> np.ndarray:
    """``a / b`` where ``ok``, NaN elsewhere, in one pass over the operands (the studentized
    bootstrap calls it on (resamples x documents) arrays, once per statistic)."""
    a, b = np.asarray(a), np.asarray(b)
    dtype = np.result_type(a.dtype, b.dtype, np.float64)
    out = np.full(np.broadcast_shapes(a.shape, b.shape), np.nan, dtype)
    return np.divide(a, b, out=out, where=ok)


def ratio(a: Any, b: Any) -> np.ndarray:
    """``a / b`` where ``b > 0`` (a rate over a count), NaN elsewhere."""
    return divided_where(a, b, np.asarray(b) > 0)


def signed_ratio(a: Any, b: Any) -> np.ndarray:
    """``a / b`` where ``b != 0`` (a share of a signed difference), NaN elsewhere."""
    return divided_where(a, b, np.asarray(b) != 0)


def mismatch_fraction(expected_mismatches: Any, horizon: float) -> Any:
    """``E[M]/T``: the expected fraction of the T tokens that differ."""
    return expected_mismatches / float(horizon)


def first_mismatch(occurrence: Any, horizon: float) -> Any:
    """``P(tau <= T)/T``: the first mismatch's share of ``E[M]/T``."""
    return occurrence / float(horizon)


def exposure(occupation: Any, horizon: float) -> Any:
    """``E[(T - tau)+]/T``: the share of the horizon left after the first divergence."""
    return occupation / float(horizon)


def rho(post_mismatches: Any, occupation: Any) -> np.ndarray:
    """Post-divergence mismatches per token of exposure (a ratio of means; NaN without
    exposure)."""
    return ratio(post_mismatches, occupation)


def parts(
    expected_mismatches: float,
    occurrence: float,
    occupation: float,
    post_mismatches: float,
    horizon: float,
) -> dict[str, float]:
    """The four parts of one result as numbers: ``mismatch_fraction``, ``first_mismatch``,
    ``exposure`` and ``rho``."""
    return {
        "mismatch_fraction": float(mismatch_fraction(expected_mismatches, horizon)),
        "first_mismatch": float(first_mismatch(occurrence, horizon)),
        "exposure": float(exposure(occupation, horizon)),
        "rho": float(rho(post_mismatches, occupation)),
    }


def median_step(pmf: Any) -> Any:
    """The median of the law of tau given tau <= T, with the steps as unit-width classes
    ``(t - 1/2, t + 1/2]`` (the grouped-data median): ``t - 1/2 + (1/2 - F(t-1)) / P(tau = t |
    tau <= T)`` at the first step ``t`` where the conditional CDF ``F`` reaches 1/2.

    A law on one step ``t`` has median ``t``; otherwise the median moves continuously with the
    law, so that a bootstrap interval of it can hold its level (the smallest such step, the
    integer median, cannot: its estimate from a few documents is nearly always the population's
    step). Values in ``[1/2, T + 1/2]``; NaN where nothing diverges. ``pmf``: ``P(tau = t)``,
    ``t = 1..T`` along the first axis (further axes: resamples)."""
    pmf = np.asarray(pmf, np.float64)
    cum = np.cumsum(pmf, axis=0)
    total = cum[-1]
    # The tolerance keeps a law that reaches 1/2 exactly at a step on that step despite rounding.
    at = np.argmax(2.0 * cum >= total * (1 - 1e-12), axis=0)
    below = (
        np.take_along_axis(cum, np.expand_dims(at, 0), 0)[0]
        - np.take_along_axis(pmf, np.expand_dims(at, 0), 0)[0]
    )
    mass = np.take_along_axis(pmf, np.expand_dims(at, 0), 0)[0]
    ok = (total > 0) & (mass > 0)
    share = np.clip(divided_where(0.5 * total - below, mass, ok), 0.0, 1.0)
    out = np.where(ok, at + 0.5 + share, np.nan)
    return float(out) if out.ndim == 0 else out


def median_step_gradient(pmf: Any) -> np.ndarray:
    """``d median_step / d P(tau = s)`` for every step ``s`` (the shape of ``pmf``: steps
    along the first axis, resamples along the others), inside the median's step ``t``:
    ``-1/(2 p_t)`` for ``s < t`` (mass moved below the median), ``(1/2 - share)/p_t`` at
    ``s = t`` and ``1/(2 p_t)`` for ``s > t``, with ``share = (total/2 - F(t-1))/p_t``. NaN
    where the median is, and where it is at an end of its class (the law reaches 1/2 exactly
    at a step's end, as resamples of a few documents whose laws sit on one step do): there it
    has no derivative, and the caller takes central differences. The studentized interval's
    delta method uses it for a median difference instead of central differences over all 2T
    columns (4T evaluations of the median over every resample)."""
    pmf = np.asarray(pmf, np.float64)
    cum = np.cumsum(pmf, axis=0)
    total = cum[-1]
    at = np.argmax(2.0 * cum >= total * (1 - 1e-12), axis=0)
    mass = np.take_along_axis(pmf, np.expand_dims(at, 0), 0)[0]
    below = np.take_along_axis(cum, np.expand_dims(at, 0), 0)[0] - mass
    ok = (total > 0) & (mass > 0)
    share = divided_where(0.5 * total - below, mass, ok)
    inside = ok & (share > 0.0) & (share < 1.0)
    half = divided_where(0.5, mass, inside)
    steps = np.arange(pmf.shape[0]).reshape((-1,) + (1,) * (pmf.ndim - 1))
    grad = np.where(steps < at, -half, half)
    grad = np.where(steps == at, divided_where(0.5 - share, mass, inside), grad)
    return np.where(inside, grad, np.nan)
