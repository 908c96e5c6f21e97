"""The Monte Carlo estimators on synthetic pairs: naive SMC and the RB-CMC estimators
(indicator, tv), their names, per-replicate values (:func:`simulate`) and means with standard
errors (:func:`estimate`, :class:`MonteCarloEstimate`). Conventions: :mod:`kvcouple.synth.exact`
(the exact solver); the sharp interval: :mod:`kvcouple.synth.interval`.
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
from kvcouple.errors import InvalidInputError, ResourceLimitError
from kvcouple.resources import check_memory
from kvcouple.synth.exact import json_values, resolved_window
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
# The branch steps one call simulates at most (replicates x branches x horizon): about three
# hours on two cores (~1e8 a second; Ctrl-C stops it). Beyond is a slip of the keyboard (-K
# 2000000 with -N 2000000 is 33 hours here), refused before it starts rather than run a day.
MAX_BRANCH_STEPS = 2**40

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


def _check_work(replicates: int, branches: object, horizon: object) -> None:
    """Refuse a simulation of more than :data:`MAX_BRANCH_STEPS` branch steps (bad sizes are
    the core's to name)."""
    if type(branches) is not int or type(horizon) is not int or branches < 1 or horizon < 1:
        return
    steps = replicates * branches * horizon
    if steps > MAX_BRANCH_STEPS:
        raise ResourceLimitError(
            f"replicates x branches x horizon = {replicates} x {branches} x {horizon} = "
            f"{steps:.3g} branch steps, beyond the {MAX_BRANCH_STEPS:.3g} one simulation runs "
            "(about three hours on two cores): lower the replicates or the branches, or split "
            "the run over seeds"
        )


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
        The per-replicate outputs would not fit in the memory available, or the simulation
        is beyond :data:`MAX_BRANCH_STEPS` branch steps.
    """
    chosen = resolve_estimator(estimator, method, "simulate")
    if trace not in ("horizon", "window"):
        raise InvalidInputError(f"trace must be 'horizon' or 'window', got {trace!r}")
    # Per-replicate outputs: about a dozen values plus two per lag, refused beyond memory.
    if isinstance(replicates, int) and replicates > 0:
        lags = (
            max(min(resolved_window(horizon, window), horizon - 1), 1)
            if isinstance(horizon, int)
            else 1
        )
        if replicates * lags <= 2**27:  # beyond, the core refuses with its own message
            check_memory(f"replicates = {replicates}", 8 * replicates * (16 + 2 * lags))
            _check_work(replicates, branches, horizon)
    out = _core.synth_simulate(
        pair.arrays(),
        horizon,
        resolved_window(horizon, window),
        estimator=chosen,
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
        return json_values(d)


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
        The per-replicate outputs would not fit in the memory available, or the simulation
        is beyond :data:`MAX_BRANCH_STEPS` branch steps.
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
        window=resolved_window(horizon, window),
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
