"""The exact solver on synthetic pairs: the law of the SMC by dynamic programming
(:func:`exact`, :class:`ExactResult`), the ground truth of the Monte Carlo estimators
(:mod:`kvcouple.synth.estimators`) and of the sharp interval (:mod:`kvcouple.synth.interval`).

Conventions (SPEC sections 3 to 5): steps ``t = 1..T``; the window ``L`` counts lags
``1..L`` after the first divergence ``tau`` (``L >= T``: to the horizon). Quantities are counts
per sequence, not fractions: ``expected_mismatches = occurrence + window_contribution +
tail_contribution``; ``mismatch_fraction = expected_mismatches / T``,
``first_mismatch = occurrence / T``, ``exposure = occupation / T``. The interval is
``[occurrence + window_contribution, that + tail_exposure]`` (``*_fraction``: divided by T).
``branch_tv_by_lag[l - 1] = E[delta_{tau+l} | tau + l <= T]``, ``l = 1..min(L, T - 1)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvcouple import _core
from kvcouple import decomposition as dc
from kvcouple.deprecation import warn_renamed
from kvcouple.synth.pairs import KernelPair


def resolved_window(horizon: int, window: int | None) -> int:
    """The window ``L`` asked for: None traces to the horizon."""
    return horizon if window is None else window


def json_values(x: Any) -> Any:
    """Numbers and arrays as JSON values (NaN as null)."""
    if isinstance(x, np.ndarray):
        return [json_values(v) for v in x.tolist()]
    if isinstance(x, list | tuple):
        return [json_values(v) for v in x]
    if isinstance(x, dict):
        return {k: json_values(v) for k, v in x.items()}
    if isinstance(x, float | np.floating):
        return None if math.isnan(x) else float(x)
    if isinstance(x, np.integer):
        return int(x)
    return x


@dataclass(frozen=True, eq=False)
class ExactResult:
    """The exact law of the SMC on a pair (see the module docstring for the conventions).

    Quantities are counts per sequence, not fractions (divide by ``horizon`` for fractions);
    ``tau`` is the step of the first divergence.

    Attributes
    ----------
    horizon : int
        Number of generated tokens ``T``.
    window : int
        Window ``L`` in lags after the first divergence (``horizon`` when none was given).
    expected_mismatches : float
        ``E[M]``, the expected number of mismatched steps.
    mismatch_fraction : float
        ``expected_mismatches / T``.
    occurrence : float
        ``P(tau <= T)``, the probability that the sequences diverge at all.
    first_mismatch : float
        ``occurrence / T`` (formerly ``first_mismatch_contribution``: still readable,
        deprecated).
    occupation : float
        ``E[(T - tau)+]``, the expected number of steps after the first divergence.
    exposure : float
        ``occupation / T``.
    rho : float
        Mismatches after the first divergence per step of occupation (formerly
        ``mismatch_rate``, still readable, deprecated),
        ``(window_contribution + tail_contribution) / occupation``.
    window_contribution : float
        Expected mismatches at lags ``1..L`` after ``tau``.
    tail_contribution : float
        Expected mismatches at lags greater than ``L`` after ``tau``.
    tail_exposure : float
        ``E[(T - tau - L)+]``, the expected number of steps beyond the window.
    interval_lower : float
        Lower end of the sharp interval, ``occurrence + window_contribution``.
    interval_upper : float
        Upper end of the sharp interval, ``interval_lower + tail_exposure``.
    survival : numpy.ndarray
        ``P(tau > t)`` for ``t = 0..T``.
    divergence_time_pmf : numpy.ndarray
        ``P(tau = t)`` for ``t = 1..T``.
    hazard : numpy.ndarray
        Discrete hazard ``P(tau = t | tau >= t)`` for ``t = 1..T`` (NaN once the survival
        is 0).
    mismatch_by_step : numpy.ndarray
        ``P(X_t != Y_t)`` for ``t = 1..T``.
    branch_tv_by_lag : numpy.ndarray
        ``E[delta_{tau+l} | tau + l <= T]`` for ``l = 1..min(L, T - 1)`` (NaN where the
        condition has probability 0).
    branch_lag_weight : numpy.ndarray
        ``P(tau + l <= T)``, the conditioning event's probability, same lags.
    """

    horizon: int
    window: int
    expected_mismatches: float
    mismatch_fraction: float
    occurrence: float
    first_mismatch: float
    occupation: float
    exposure: float
    rho: float
    window_contribution: float
    tail_contribution: float
    tail_exposure: float
    interval_lower: float
    interval_upper: float
    survival: npt.NDArray[np.float64]
    divergence_time_pmf: npt.NDArray[np.float64]
    hazard: npt.NDArray[np.float64]
    mismatch_by_step: npt.NDArray[np.float64]
    branch_tv_by_lag: npt.NDArray[np.float64]
    branch_lag_weight: npt.NDArray[np.float64]

    @property
    def interval_lower_fraction(self) -> float:
        return self.interval_lower / self.horizon

    @property
    def interval_upper_fraction(self) -> float:
        return self.interval_upper / self.horizon

    @property
    def first_mismatch_contribution(self) -> float:
        warn_renamed("first_mismatch_contribution", "first_mismatch", "ExactResult")
        return self.first_mismatch

    @property
    def mismatch_rate(self) -> float:
        warn_renamed("mismatch_rate", "rho", "ExactResult")
        return self.rho

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["interval_lower_fraction"] = self.interval_lower_fraction
        d["interval_upper_fraction"] = self.interval_upper_fraction
        # The renamed keys, for one release (deprecated).
        d["first_mismatch_contribution"] = self.first_mismatch
        d["mismatch_rate"] = self.rho
        return json_values(d)


def exact(pair: KernelPair, horizon: int, window: int | None = None) -> ExactResult:
    """Exact quantities by dynamic programming over the joint SMC chain.

    Complexity: time ``O(T * A * (V + R^2) * (min(L, T) + 2))`` with ``A <= S_P * S_Q``
    reachable state pairs and ``R <= min(V, S)`` residual successor states; memory
    ``O(S_P * S_Q * (min(L, T) + 2))``. S = V = 16, T = L = 64 takes well under a second.
    ``window=None`` traces to the horizon (no tail).

    Parameters
    ----------
    pair : KernelPair
        The two kernels (P, Q) of the synthetic chain.
    horizon : int
        Number of generated tokens ``T`` (>= 1).
    window : int, optional
        Window ``L`` in lags after the first divergence; None (default) traces to the
        horizon (no tail).

    Returns
    -------
    ExactResult
        The exact expected quantities (occurrence, occupation, window and tail
        contributions, expected mismatches, tail exposure and the interval ends).

    Raises
    ------
    kvcouple.errors.InvalidInputError
        An out-of-range ``horizon`` or ``window``.
    """
    d = _core.synth_exact(pair.arrays(), horizon, resolved_window(horizon, window))
    # The decomposition's parts from the counts, as the analysis and the estimates derive them.
    post = d["window_contribution"] + d["tail_contribution"]
    d.update(
        dc.parts(d["expected_mismatches"], d["occurrence"], d["occupation"], post, d["horizon"])
    )
    return ExactResult(**d)
