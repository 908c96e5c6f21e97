"""The sharp interval for E[M] from a finite window (SPEC section 5): its ends from an exact
result or a Monte Carlo estimate (:func:`interval`), and the two pairs that attain them
(:func:`interval_constructions`). Conventions: :mod:`kvcouple.synth.exact`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvcouple import _core
from kvcouple.errors import InvalidInputError
from kvcouple.synth.estimators import MonteCarloEstimate
from kvcouple.synth.exact import ExactResult, json_values
from kvcouple.synth.pairs import KernelPair


@dataclass(frozen=True)
class Interval:
    """The sharp interval for E[M] from a finite window (SPEC section 5), in counts.

    ``ci_low``/``ci_high`` widen the ends by ``z`` standard errors (0 for exact values).

    Attributes
    ----------
    horizon : int
        Number of generated tokens ``T``.
    window : int
        Window ``L`` in lags after the first divergence.
    lower : float
        Lower end, ``occurrence + window_contribution`` (a count).
    upper : float
        Upper end, ``lower + tail_exposure`` (a count).
    lower_se : float
        Standard error of ``lower`` (0 for an exact result).
    upper_se : float
        Standard error of ``upper`` (0 for an exact result).
    ci_low : float
        ``lower - z * lower_se``.
    ci_high : float
        ``upper + z * upper_se``.
    level : float
        Confidence level in ``(0, 1)`` that ``z`` corresponds to.
    """

    horizon: int
    window: int
    lower: float
    upper: float
    lower_se: float
    upper_se: float
    ci_low: float
    ci_high: float
    level: float

    def fractions(self) -> tuple[float, float]:
        return self.lower / self.horizon, self.upper / self.horizon

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["lower_fraction"], d["upper_fraction"] = self.fractions()
        return json_values(d)


def interval(result: ExactResult | MonteCarloEstimate, level: float = 0.95) -> Interval:
    """The sharp interval ``[occurrence + window, that + tail_exposure]`` of a result.

    For a :class:`MonteCarloEstimate` each end's standard error comes from its per-replicate values;
    the confidence bounds are ``lower - z se`` and ``upper + z se`` with ``z`` the two-sided
    normal quantile of ``level``.

    Parameters
    ----------
    result : ExactResult or MonteCarloEstimate
        The output of :func:`exact` or :func:`estimate`.
    level : float
        Confidence level in ``(0, 1)``. Default 0.95.

    Returns
    -------
    Interval
        The interval ends in counts, their standard errors (0 for exact values) and the
        confidence bounds.

    Raises
    ------
    kvcouple.errors.InvalidInputError
        ``level`` is not in ``(0, 1)``.
    """
    if not 0 < level < 1:
        raise InvalidInputError(f"level = {level} must lie in (0, 1)")
    from statistics import NormalDist

    z = NormalDist().inv_cdf(0.5 + level / 2)
    if isinstance(result, ExactResult):
        lo, hi, slo, shi = result.interval_lower, result.interval_upper, 0.0, 0.0
    else:
        lo, hi = result.mean["interval_lower"], result.mean["interval_upper"]
        slo, shi = result.se["interval_lower"], result.se["interval_upper"]
    return Interval(
        horizon=result.horizon,
        window=result.window,
        lower=lo,
        upper=hi,
        lower_se=slo,
        upper_se=shi,
        ci_low=lo - z * slo,
        ci_high=hi + z * shi,
        level=level,
    )


def interval_constructions(
    pair: KernelPair, horizon: int, window: int
) -> tuple[KernelPair, KernelPair]:
    """Two pairs that agree with ``pair`` up to ``window`` lags after the first divergence and
    then re-synchronise (``lower``: TV 0) or separate forever (``upper``: TV 1), so that
    ``exact(lower).expected_mismatches == exact(pair).interval_lower`` and likewise for the
    upper end (SPEC section 5). Vocabulary ``3V + 2``: overlap tokens, P- and Q-marked residual
    tokens, two end tokens; states ``S_P S_Q + S L + 1``.

    Parameters
    ----------
    pair : KernelPair
        The two kernels (P, Q).
    horizon : int
        Number of generated tokens ``T`` (>= 1).
    window : int
        Window ``L`` in lags after the first divergence.

    Returns
    -------
    tuple of KernelPair
        ``(lower, upper)``.

    Raises
    ------
    kvcouple.errors.InvalidInputError
        An out-of-range ``horizon`` or ``window``.
    """
    lo, hi = _core.synth_interval_constructions(pair.arrays(), horizon, window)
    return KernelPair.from_arrays(lo), KernelPair.from_arrays(hi)
