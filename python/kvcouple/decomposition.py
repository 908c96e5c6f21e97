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
