"""Exact solver, Monte Carlo estimators and the sharp interval on synthetic pairs.

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
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from kvcouple import _core
from kvcouple import decomposition as dc
from kvcouple.deprecation import RenamedKeys, module_getattr, warn_renamed
from kvcouple.errors import InvalidInputError
from kvcouple.resources import check_memory
from kvcouple.synth.pairs import KernelPair, check_seed

# The estimators, in the analysis's words (kvcouple.analysis.estimates.ESTIMATORS: indicator,
# tv), plus naive SMC, which only the synthetic tools run.
Estimator = Literal["naive", "indicator", "tv"]
SYNTH_ESTIMATORS: tuple[str, ...] = ("naive", "indicator", "tv")
ESTIMATOR_NOTES = {
    "naive": "naive SMC: realised mismatch counts",
    "indicator": "RB-CMC with branch mismatch indicators (Var <= naive per replicate)",
    "tv": "RB-CMC with branch-aligned TVs (unbiased; usually lower variance, no dominance guarantee)",
}
# The synthetic tools' former words (`method`, "rb", "rb-tv"): read for one release, deprecated.
RENAMED_ESTIMATORS = {"rb": "indicator", "rb-tv": "tv"}
FORMER_NAMES = {new: old for old, new in RENAMED_ESTIMATORS.items()}


def resolve_estimator(estimator: str | None, method: str | None, where: str) -> str:
    """The estimator asked for, in the analysis's words: ``method=`` and the former names
    ``"rb"``/``"rb-tv"`` still read, with a DeprecationWarning."""
    if method is not None:
        warn_renamed("method", "estimator", where, stacklevel=4)
        if estimator is not None and estimator != method:
            raise InvalidInputError("give estimator= or the deprecated method=, not both")
        estimator = method
    estimator = "indicator" if estimator is None else estimator
    if estimator in RENAMED_ESTIMATORS:
        warn_renamed(estimator, RENAMED_ESTIMATORS[estimator], f"{where} estimator", stacklevel=4)
        estimator = RENAMED_ESTIMATORS[estimator]
    if estimator not in SYNTH_ESTIMATORS:
        keyword = "estimator" if method is None else "method"  # the keyword the caller used
        raise InvalidInputError(
            f"unknown {keyword} {estimator!r}: use one of {', '.join(SYNTH_ESTIMATORS)}"
        )
    return estimator


# The per-replicate values every estimator returns (MonteCarloEstimate.values' keys).
REPLICATE_KEYS = (
    "occurrence",
    "occupation",
    "window_contribution",
    "tail_contribution",
    "expected_mismatches",
    "tail_exposure",
    "interval_lower",
    "interval_upper",
)


def _window(horizon: int, window: int | None) -> int:
    return horizon if window is None else window


def _json(x: Any) -> Any:
    """Numbers and arrays as JSON values (NaN as null)."""
    if isinstance(x, np.ndarray):
        return [_json(v) for v in x.tolist()]
    if isinstance(x, list | tuple):
        return [_json(v) for v in x]
    if isinstance(x, dict):
        return {k: _json(v) for k, v in x.items()}
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
        return _json(d)


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
    d = _core.synth_exact(pair.arrays(), horizon, _window(horizon, window))
    # The decomposition's parts from the counts, as the analysis and the estimates derive them.
    post = d["window_contribution"] + d["tail_contribution"]
    d.update(
        dc.parts(d["expected_mismatches"], d["occurrence"], d["occupation"], post, d["horizon"])
    )
    return ExactResult(**d)


def simulate(
    pair: KernelPair,
    horizon: int,
    window: int | None = None,
    *,
    estimator: Estimator | None = None,
    replicates: int = 1000,
    branches: int = 1,
    seed: int = 0,
    trace: Literal["horizon", "window"] = "horizon",
    method: str | None = None,
) -> dict[str, npt.NDArray[np.float64]]:
    """Per-replicate values of one estimator (arrays of length ``replicates``).

    Keys: ``occurrence, occupation, window_contribution, tail_contribution, expected_mismatches,
    tail_exposure, evaluations`` (kernel evaluations, 2 per step), and ``branch_tv_sum``,
    ``branch_lag_weight`` (replicates x lags: unbiased estimates of
    ``E[delta_{tau+l} 1{tau+l <= T}]`` and ``P(tau + l <= T)``). ``trace="window"`` stops
    branches at lag L: the tail and the total are then NaN. Results do not depend on the
    thread count.

    Parameters
    ----------
    pair : KernelPair
        The two kernels (P, Q) of the synthetic chain.
    horizon : int
        Number of generated tokens ``T`` (>= 1).
    window : int, optional
        Window ``L`` in lags after the first divergence; None (default) traces to the
        horizon (no tail).
    estimator : {"naive", "indicator", "tv"}
        Plain coupled simulation, Rao-Blackwellised from the branches' mismatch indicators,
        or Rao-Blackwellised from their branch-aligned TVs (the analysis's estimators).
        Default ``"indicator"``. (Formerly ``method``, with ``"rb"`` for ``"indicator"`` and
        ``"rb-tv"`` for ``"tv"``: still read for one release, deprecated.)
    replicates : int
        Monte Carlo replicates (>= 1). Default 1000.
    branches : int
        Branches per replicate (>= 1 for ``"indicator"`` and ``"tv"``). Default 1.
    seed : int
        Seed in ``[0, 2**64)``. Default 0.
    trace : {"horizon", "window"}
        Trace branches to the horizon (default), or stop them at lag ``L`` (the tail and the
        total are then NaN).
    method : str, optional
        Deprecated: ``estimator`` (read for one release, with a DeprecationWarning).

    Returns
    -------
    dict of str to numpy.ndarray
        float64 per-replicate arrays under the keys above.

    Raises
    ------
    kvcouple.errors.InvalidInputError
        An unknown ``estimator`` or ``trace``, a bad seed, or an out-of-range horizon, window,
        replicate or branch count.
    kvcouple.errors.ResourceLimitError
        The per-replicate outputs would not fit in the memory available.
    """
    chosen = resolve_estimator(estimator, method, "simulate")
    if trace not in ("horizon", "window"):
        raise InvalidInputError(f"trace must be 'horizon' or 'window', got {trace!r}")
    # Per-replicate outputs: about a dozen values plus two per lag, refused beyond memory.
    if isinstance(replicates, int) and replicates > 0:
        lags = max(min(_window(horizon, window), horizon - 1), 1) if isinstance(horizon, int) else 1
        if replicates * lags <= 2**27:  # beyond, the core refuses with its own message
            check_memory(f"replicates = {replicates}", 8 * replicates * (16 + 2 * lags))
    out = _core.synth_simulate(
        pair.arrays(),
        horizon,
        _window(horizon, window),
        method="naive" if chosen == "naive" else "rb",  # the core's words
        replicates=replicates,
        branches=branches,
        seed=check_seed(seed),
        trace_to_horizon=trace == "horizon",
    )
    if chosen == "tv":
        for k in ("window_contribution", "tail_contribution", "expected_mismatches"):
            out[k] = out.pop(k + "_tv")
    for k in ("window_contribution_tv", "tail_contribution_tv", "expected_mismatches_tv"):
        out.pop(k, None)
    return RenamedKeys(out)  # the renamed keys still read, deprecated


def _mean_se(x: npt.NDArray[np.float64]) -> tuple[float, float]:
    n = len(x)
    m = float(np.mean(x))
    se = float(np.std(x, ddof=1) / math.sqrt(n)) if n > 1 else math.nan
    return m, se


def _ratio(a: npt.NDArray[np.float64], b: npt.NDArray[np.float64]) -> tuple[float, float]:
    """``mean(a) / mean(b)`` with its delta-method standard error."""
    mb = float(np.mean(b))
    if mb <= 0:
        return math.nan, math.nan
    r = float(np.mean(a)) / mb
    n = len(a)
    se = float(np.std(a - r * b, ddof=1) / math.sqrt(n) / mb) if n > 1 else math.nan
    return r, se


@dataclass(frozen=True, eq=False)
class MonteCarloEstimate:
    """Means and standard errors of an estimator's replicates.

    ``values[name]`` holds the per-replicate values of each name in ``REPLICATE_KEYS``;
    ``mean``/``se`` also hold the fractions and ratios (``mismatch_fraction``, ``exposure``,
    ``first_mismatch``, ``rho``; ratios with delta-method SEs).

    Attributes
    ----------
    estimator : str
        The estimator: ``"naive"``, ``"indicator"`` or ``"tv"`` (formerly ``method``, still
        readable, deprecated).
    horizon : int
        Number of generated tokens ``T``.
    window : int
        Window ``L`` in lags after the first divergence (``horizon`` when none was given).
    replicates : int
        Number of Monte Carlo replicates.
    branches : int
        Branches per replicate.
    seed : int
        The seed used.
    values : dict of str to numpy.ndarray
        Per-replicate values of each name in ``REPLICATE_KEYS``.
    mean : dict of str to float
        Mean of each quantity, including the fractions and ratios.
    se : dict of str to float
        Standard error of each mean (delta-method for the ratios).
    branch_tv_by_lag : numpy.ndarray
        Estimated ``E[delta_{tau+l} | tau + l <= T]`` per lag.
    branch_tv_by_lag_se : numpy.ndarray
        Standard errors of ``branch_tv_by_lag``.
    evaluations : float
        Mean number of kernel evaluations per replicate.
    raw : dict of str to numpy.ndarray
        The raw output of :func:`simulate`.
    """

    estimator: str
    horizon: int
    window: int
    replicates: int
    branches: int
    seed: int
    values: dict[str, npt.NDArray[np.float64]]
    mean: dict[str, float]
    se: dict[str, float]
    branch_tv_by_lag: npt.NDArray[np.float64]
    branch_tv_by_lag_se: npt.NDArray[np.float64]
    evaluations: float
    raw: dict[str, npt.NDArray[np.float64]] = field(repr=False)

    @property
    def method(self) -> str:
        warn_renamed("method", "estimator", "MonteCarloEstimate")
        return self.estimator

    def variance(self, name: str) -> float:
        """The per-replicate variance of a quantity."""
        return float(np.var(self.values[name], ddof=1))

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "estimator": self.estimator,
            "estimator_note": ESTIMATOR_NOTES[self.estimator],
            "horizon": self.horizon,
            "window": self.window,
            "replicates": self.replicates,
            "branches": self.branches,
            "seed": self.seed,
            "kernel_evaluations_per_replicate": self.evaluations,
        }
        for k in self.mean:
            d[k] = {"mean": self.mean[k], "se": self.se[k]}
        d["branch_tv_by_lag"] = {"mean": self.branch_tv_by_lag, "se": self.branch_tv_by_lag_se}
        # The former key and name, for one release (deprecated).
        d["method"] = FORMER_NAMES.get(self.estimator, self.estimator)
        return _json(d)


def estimate(
    pair: KernelPair,
    horizon: int,
    window: int | None = None,
    *,
    estimator: Estimator | None = None,
    replicates: int = 1000,
    branches: int = 1,
    seed: int = 0,
    trace: Literal["horizon", "window"] = "horizon",
    method: str | None = None,
) -> MonteCarloEstimate:
    """Estimate every quantity of :func:`exact` by Monte Carlo (``estimator``: naive,
    indicator, tv).

    Parameters
    ----------
    pair : KernelPair
        The two kernels (P, Q) of the synthetic chain.
    horizon : int
        Number of generated tokens ``T`` (>= 1).
    window : int, optional
        Window ``L`` in lags after the first divergence; None (default) traces to the
        horizon (no tail).
    estimator : {"naive", "indicator", "tv"}
        Plain coupled simulation, Rao-Blackwellised from the branches' mismatch indicators,
        or Rao-Blackwellised from their branch-aligned TVs (the analysis's estimators).
        Default ``"indicator"``. (Formerly ``method``, with ``"rb"`` for ``"indicator"`` and
        ``"rb-tv"`` for ``"tv"``: still read for one release, deprecated.)
    replicates : int
        Monte Carlo replicates (>= 1). Default 1000.
    branches : int
        Branches per replicate (>= 1 for ``"indicator"`` and ``"tv"``). Default 1.
    seed : int
        Seed in ``[0, 2**64)``. Default 0.
    trace : {"horizon", "window"}
        Trace branches to the horizon (default), or stop them at lag ``L`` (the tail and the
        total are then NaN).
    method : str, optional
        Deprecated: ``estimator`` (read for one release, with a DeprecationWarning).

    Returns
    -------
    MonteCarloEstimate
        Means and standard errors of every quantity, the branch TV by lag, the mean number of
        kernel evaluations and the raw output of :func:`simulate`.

    Raises
    ------
    kvcouple.errors.InvalidInputError
        An unknown ``estimator`` or ``trace``, a bad seed, or an out-of-range horizon, window,
        replicate or branch count.
    kvcouple.errors.ResourceLimitError
        The per-replicate outputs would not fit in the memory available.
    """
    chosen = resolve_estimator(estimator, method, "estimate")
    raw = simulate(
        pair,
        horizon,
        window,
        estimator=chosen,  # type: ignore[arg-type]  # checked: one of SYNTH_ESTIMATORS
        replicates=replicates,
        branches=branches,
        seed=seed,
        trace=trace,
    )
    values = {
        "occurrence": raw["occurrence"],
        "occupation": raw["occupation"],
        "window_contribution": raw["window_contribution"],
        "tail_contribution": raw["tail_contribution"],
        "expected_mismatches": raw["expected_mismatches"],
        "tail_exposure": raw["tail_exposure"],
        "interval_lower": raw["occurrence"] + raw["window_contribution"],
    }
    values["interval_upper"] = values["interval_lower"] + raw["tail_exposure"]
    mean, se = {}, {}
    for k, x in values.items():
        mean[k], se[k] = _mean_se(x)
    t = float(horizon)
    post = raw["window_contribution"] + raw["tail_contribution"]
    # The decomposition's parts from the means, as the analysis and the exact solver derive
    # them; the fractions' standard errors scale with them, rho's by the delta method.
    parts = dc.parts(mean["expected_mismatches"], mean["occurrence"], mean["occupation"],
                     float(np.mean(post)), t)  # fmt: skip
    for k, src in (
        ("mismatch_fraction", "expected_mismatches"),
        ("first_mismatch", "occurrence"),
        ("exposure", "occupation"),
        ("interval_lower_fraction", "interval_lower"),
        ("interval_upper_fraction", "interval_upper"),
    ):
        mean[k], se[k] = parts.get(k, mean[src] / t), se[src] / t
    mean["rho"], se["rho"] = parts["rho"], _ratio(post, raw["occupation"])[1]
    lags = raw["branch_tv_sum"].shape[1]
    tv = [_ratio(raw["branch_tv_sum"][:, i], raw["branch_lag_weight"][:, i]) for i in range(lags)]
    return MonteCarloEstimate(
        estimator=chosen,
        horizon=horizon,
        window=_window(horizon, window),
        replicates=replicates,
        branches=branches,
        seed=seed,
        values=values,
        mean=RenamedKeys(mean),
        se=RenamedKeys(se),
        branch_tv_by_lag=np.array([m for m, _ in tv], dtype=np.float64),
        branch_tv_by_lag_se=np.array([s for _, s in tv], dtype=np.float64),
        evaluations=float(np.mean(raw["evaluations"])),
        raw=raw,
    )


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
        return _json(d)


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


# Former names, for one release (deprecated).
__getattr__ = module_getattr(
    __name__,
    {
        "Estimate": "MonteCarloEstimate",
        "Method": "Estimator",
        "METHODS": "SYNTH_ESTIMATORS",
        "METHOD_NOTES": "ESTIMATOR_NOTES",
        "QUANTITIES": "REPLICATE_KEYS",
    },
    globals(),
)
