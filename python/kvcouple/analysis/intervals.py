"""What an interval of the document bootstrap is: the interval methods, the scale an interval is
computed on (:class:`Scale`), the normal scores of its ends, and what a statistic's interval
yields (:class:`Estimate`). The bootstrap (:mod:`kvcouple.analysis.bootstrap`), the studentized
intervals (:mod:`kvcouple.analysis.studentized`) and the p-values
(:mod:`kvcouple.analysis.pvalues`) all speak these words.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvcouple.analysis.distributions import norm_ppf, t_ppf

# A statistic reads column means by name (``g(column)``) and returns its value.
Getter = Callable[[str], np.ndarray]
StatFn = Callable[[Getter], np.ndarray]
# Its derivatives with respect to the column means it reads, by column name (others: 0).
DerivativesFn = Callable[[Getter], dict[str, np.ndarray]]


@dataclass(frozen=True)
class Statistic:
    """A statistic (a :data:`StatFn`) that knows its derivatives in closed form: the delta
    method (:class:`kvcouple.analysis.studentized.DeltaMethod`) uses them instead of central
    differences, which cost two evaluations of the statistic per column it reads."""

    value: StatFn
    derivatives: DerivativesFn

    def __call__(self, g: Getter) -> np.ndarray:
        return self.value(g)


CI_METHODS = ("percentile", "bca", "expanded-bca", "studentized")
DEFAULT_CI_METHOD = "studentized"
# Resamples of fewer documents take too few distinct values to studentize (with 2, every
# resample that can be studentized has t* = 0): below this, studentized means expanded-bca.
STUDENTIZED_MIN_DOCS = 8
# From this many documents the studentized interval's resamples are drawn from their Gaussian
# limit (:func:`kvcouple.analysis.bootstrap.gaussian_means`): the bootstrap-t's correction of
# the normal interval is of order 1/n for a symmetric interval, below Monte Carlo noise here,
# while resampling costs resamples x documents x columns (docs/statistics.md, "Many
# documents").
GAUSSIAN_MIN_DOCS = 5000


@dataclass(frozen=True)
class Scale:
    """The scale an interval is computed on: for a quantity with a finite range
    ``[low, high]`` (the registry's, :mod:`kvcouple.analysis.quantities`) the logit of
    ``(theta - low) / (high - low)``, whose inverse maps every real number into the range (the
    ends are +-inf); otherwise the identity."""

    low: float = -math.inf
    high: float = math.inf

    @property
    def bounded(self) -> bool:
        return math.isfinite(self.low) and math.isfinite(self.high) and self.high > self.low

    def holds(self, theta: float) -> bool:
        """Whether ``theta`` lies strictly inside the range (where the logit is finite)."""
        return not self.bounded or self.low < theta < self.high

    def forward(self, theta: np.ndarray | float) -> np.ndarray:
        x = np.asarray(theta, np.float64)
        if not self.bounded:
            return x
        u = (x - self.low) / (self.high - self.low)
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.asarray(np.log(u) - np.log1p(-u))

    def slope(self, theta: np.ndarray | float) -> np.ndarray:
        """``d psi / d theta`` (infinite at the range's ends)."""
        x = np.asarray(theta, np.float64)
        if not self.bounded:
            return np.ones_like(x)
        width = self.high - self.low
        u = (x - self.low) / width
        with np.errstate(divide="ignore"):
            return np.asarray(1.0 / (width * u * (1.0 - u)))

    def back(self, psi: np.ndarray | float) -> np.ndarray:
        y = np.asarray(psi, np.float64)
        if not self.bounded:
            return y
        with np.errstate(over="ignore"):
            return np.asarray(self.low + (self.high - self.low) / (1.0 + np.exp(-y)))


UNBOUNDED = Scale()


def normal_scores(level: float, method: str, n_docs: int) -> tuple[float, float]:
    """The normal scores of the two interval ends at ``level``; ``expanded-bca`` widens them
    to ``sqrt(n/(n-1)) t_{n-1}``."""
    if method not in CI_METHODS:
        raise ValueError(f"ci_method must be one of {CI_METHODS}, got {method!r}")
    upper = 1.0 - (1.0 - level) / 2.0
    if method == "expanded-bca" and n_docs >= 2:
        z = math.sqrt(n_docs / (n_docs - 1)) * float(t_ppf(upper, n_docs - 1))
    else:
        z = float(norm_ppf(upper))
    return -z, z


@dataclass
class Estimate:
    """A statistic's point estimate, CI, replicates and BCa constants (for p-values)."""

    estimate: float
    ci_low: float
    ci_high: float
    boot: np.ndarray
    z0: float = 0.0
    accel: float = 0.0
    method: str = "percentile"
    # studentized: the jackknife standard error and the sorted finite t* replicates
    se: float = math.nan
    tstar: np.ndarray | None = None
    # A ratio's confidence set may be [ci_low, ci_high] less the open interval ``exclude``
    # (Fieller's two rays); ci_low/ci_high alone then still bound it.
    exclude: tuple[float, float] | None = None
    # Constant over the documents: the interval is the point.
    constant: bool = False
    scale: Scale = UNBOUNDED

    def covers(self, value: float) -> bool:
        """Whether ``value`` lies in the confidence set."""
        if not self.ci_low <= value <= self.ci_high:
            return False
        return self.exclude is None or not self.exclude[0] < value < self.exclude[1]


def beside_range(lo: float, hi: float, point: float, scale: Scale) -> tuple[float, float]:
    """The interval of an estimate outside its quantity's range (a ratio of Monte Carlo
    estimates with few documents: rho above 1), made on the plain scale, then kept inside the
    range except as far as the estimate itself lies outside: ``[0, 1.02]`` for rho = 1.02."""
    return (
        min(max(lo, scale.low), point),
        max(min(hi, scale.high), point),
    )
