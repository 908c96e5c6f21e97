"""The document bootstrap: column means of the per-document table, of its resamples (one Rust
call, seeded, independent of thread count) and of its jackknife; intervals and p-values of
statistics that are functions of those means (:class:`Bootstrap`); Holm's correction.

Intervals (``ci_method``; docs/statistics.md has the coverage study that chose the default):

- ``percentile``: quantiles of the replicates;
- ``bca``: bias-corrected and accelerated (Efron 1987), the acceleration from the
  leave-one-document-out jackknife;
- ``expanded-bca``: BCa with the normal scores widened to ``sqrt(n/(n-1)) t_{n-1}``
  (Hesterberg's small-sample expansion), which makes the interval exact for the mean of normal
  documents; plain percentile and BCa intervals are too narrow with few documents (coverage
  about 0.92 at 16 documents for a nominal 0.95);
- ``studentized`` (bootstrap-t) on the quantity's scale (:class:`Scale`): for a quantity with
  a finite range ``[low, high]`` the logit of ``(theta - low) / (high - low)``, so that the
  interval lies inside the range by construction; ``psi - t*_q se_psi`` mapped back, ``t*``
  the replicates of ``(psi* - psi) / se_psi*``. Standard errors are the delta method's
  (``sqrt(grad' S grad / (n - 1))``, ``S`` the covariance of the columns the statistic reads:
  for a mean exactly the jackknife's ``s / sqrt(n)``), inside each resample from its moments
  (:func:`kvcouple._core.bootstrap_moments`: memory independent of resamples x documents).
  A ratio of two statistics gets the confidence set of the studentized test of
  ``num - s den = 0`` over ``s`` (Fieller's construction with bootstrap-t critical values,
  :meth:`Bootstrap.ratio`).

Percentile and BCa ends of all statistics are computed in one Rust call
(``bootstrap_intervals``); an end extrapolated beyond the replicates is extrapolated on the
quantity's scale. ``median_tau`` (discrete) always gets a percentile interval. A statistic that
is constant over the documents gets its point as interval and ``Estimate.constant``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from kvcouple.analysis.distributions import norm_cdf, norm_ppf, t_cdf, t_ppf

if TYPE_CHECKING:
    from kvcouple.analysis.estimates import Table

Getter = Callable[[str], np.ndarray]
StatFn = Callable[[Getter], np.ndarray]

CI_METHODS = ("percentile", "bca", "expanded-bca", "studentized")
DEFAULT_CI_METHOD = "studentized"
# Resamples of fewer documents take too few distinct values to studentize (with 2, every
# resample that can be studentized has t* = 0): below this, studentized means expanded-bca.
STUDENTIZED_MIN_DOCS = 8


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


@dataclass
class Bootstrap:
    """Column means of the table and of its bootstrap resamples (the table and the seed give
    the resamples' moments and the jackknife when an interval needs them)."""

    names: list[str]
    point: np.ndarray  # (cols,)
    reps: np.ndarray  # (n_boot, cols)
    level: float
    n_docs: int
    jack: np.ndarray | None = None  # (n_docs, cols) leave-one-document-out means (BCa; lazy)
    method: str = DEFAULT_CI_METHOD
    data: np.ndarray | None = None  # (n_docs, cols) the table
    seed: int = 0  # the resamples' seed (their moments come from the same draws)

    def __post_init__(self) -> None:
        self._index = {n: i for i, n in enumerate(self.names)}

    def at_level(self, level: float) -> Bootstrap:
        return replace(self, level=level)

    def evaluate(self, fn: StatFn, discrete: bool = False, scale: Scale = UNBOUNDED) -> Estimate:
        return self.evaluate_many([fn], [discrete], [scale])[0]

    def evaluate_many(
        self,
        fns: Sequence[StatFn],
        discrete: Sequence[bool] | None = None,
        scales: Sequence[Scale] | None = None,
    ) -> list[Estimate]:
        """Point estimates and CIs of many statistics, each on its scale (default: the
        identity; one Rust call per interval method)."""
        if not fns:
            return []
        discrete = list(discrete) if discrete is not None else [False] * len(fns)
        scales = list(scales) if scales is not None else [UNBOUNDED] * len(fns)
        point = np.array([float(np.asarray(f(self._at(self.point)))) for f in fns])
        boot = np.column_stack([self._values(f, self.reps) for f in fns])
        out: list[Estimate | None] = [None] * len(fns)
        continuous = [i for i, d in enumerate(discrete) if not d]
        groups = [
            (self.method, continuous),
            ("percentile", [i for i in range(len(fns)) if discrete[i]]),
        ]
        if self.method == "studentized":
            moments = _Moments(self, [fns[i] for i in continuous])
            se, se_boot = moments.standard_errors()
            for j, i in enumerate(continuous):
                out[i] = _studentized_estimate(
                    point[i], boot[:, i], se[j], se_boot[:, j], self.level, scales[i]
                )
            groups = groups[1:]
        for method, idx in groups:
            if idx:
                for i, e in zip(
                    idx,
                    self._rust_intervals(
                        method,
                        [fns[i] for i in idx],
                        point[idx],
                        boot[:, idx],
                        [scales[i] for i in idx],
                    ),
                    strict=True,
                ):
                    out[i] = e
        return [e for e in out if e is not None]

    def _jackknife(self) -> np.ndarray:
        """Leave-one-document-out column means (made on first use: BCa's acceleration)."""
        if self.jack is None:
            if self.data is None:
                raise ValueError("BCa intervals need the table (bootstrap_table keeps it)")
            self.jack = jackknife_means(self.data)
        return self.jack

    def columns(self, f: StatFn) -> list[int]:
        """The columns ``f`` reads (traced at the point estimate), in table order."""
        seen: set[int] = set()

        def g(c: str) -> np.ndarray:
            seen.add(self._index[c])
            return self.point[self._index[c]]

        f(g)
        return sorted(seen)

    def _at(self, means: np.ndarray) -> Getter:
        """The getter of one set of column means (a row, or the rows of a matrix)."""
        if means.ndim == 1:
            return lambda c: means[self._index[c]]
        return lambda c: means[..., self._index[c]]

    def _values(self, f: StatFn, means: np.ndarray) -> np.ndarray:
        """``f`` at every row of ``means``, as an array over the rows."""
        return np.broadcast_to(np.asarray(f(self._at(means)), np.float64), means.shape[:1])

    def _rust_intervals(
        self,
        method: str,
        fns: Sequence[StatFn],
        point: np.ndarray,
        boot: np.ndarray,
        scales: Sequence[Scale],
    ) -> list[Estimate]:
        """Percentile or (expanded) BCa intervals, in one Rust call; an end extrapolated
        beyond the replicates is moved to the same normal score on the statistic's scale."""
        from kvcouple import _core

        use_bca = method in ("bca", "expanded-bca")
        if use_bca:
            jack = np.column_stack([self._values(f, self._jackknife()) for f in fns])
        zl, zu = normal_scores(self.level, method, self.n_docs)
        rows = _core.bootstrap_intervals(
            np.ascontiguousarray(boot),
            np.ascontiguousarray(point),
            np.ascontiguousarray(jack) if use_bca else np.zeros((0, len(fns))),
            zl,
            zu,
            use_bca,
        )
        out = []
        for j, (lo, hi, z0, a) in enumerate(rows):
            scale = scales[j]
            if scale.low <= point[j] <= scale.high:
                lo, hi = _on_scale(float(lo), float(hi), boot[:, j], scale)
            else:  # a Monte Carlo estimate just outside the range (rho above 1)
                lo, hi = _beside_range(float(lo), float(hi), float(point[j]), scale)
                scale = UNBOUNDED
            b = boot[:, j][np.isfinite(boot[:, j])]
            out.append(
                Estimate(
                    float(point[j]),
                    lo,
                    hi,
                    boot[:, j],
                    float(z0) if use_bca else 0.0,
                    float(a) if use_bca else 0.0,
                    method,
                    constant=bool(b.size and b.min() == b.max() == point[j]),
                    scale=scale,
                )
            )
        return out

    def studentized_parts(
        self, fns: Sequence[StatFn]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Point estimates (k,), replicates (n_boot, k), standard errors (k,) and those inside
        every resample (n_boot, k) of ``fns`` (delta method, :class:`_Moments`)."""
        point = np.array([float(np.asarray(f(self._at(self.point)))) for f in fns])
        boot = np.column_stack([self._values(f, self.reps) for f in fns])
        se, se_boot = _Moments(self, fns).standard_errors()
        return point, boot, se, se_boot

    def ratio(self, num: StatFn, den: StatFn) -> Estimate:
        """The ratio ``num / den`` by test inversion: the set of ``s`` at which the studentized
        bootstrap test of ``num - s den = 0`` accepts (Fieller's construction with bootstrap-t
        critical values). Unlike an interval around the ratio's replicates it is unbounded
        when ``den`` is not distinguishable from 0, as a valid set must then be; two rays are
        ``(-inf, inf)`` with ``exclude`` the open interval between them."""
        parts = self.studentized_parts([num, den])
        point, boot = parts[0], parts[1]
        with np.errstate(divide="ignore", invalid="ignore"):
            estimate = float(point[0] / point[1]) if point[1] != 0 else math.nan
            ratio_boot = np.where(boot[:, 1] != 0, boot[:, 0] / boot[:, 1], np.nan)
        lo, hi, exclude = _fieller_set(self, num, den, point, boot)
        return Estimate(estimate, lo, hi, ratio_boot, method="studentized", exclude=exclude)

    def p_value(self, est: Estimate, direction: str, value: float = 0.0) -> float:
        """The bootstrap p-value matching ``est``'s interval method (see
        :func:`bootstrap_p_value`; studentized: :func:`studentized_p_value`)."""
        if est.method == "studentized":
            return studentized_p_value(est, direction, value)
        return bootstrap_p_value(
            est.boot,
            direction,
            value,
            z0=est.z0,
            accel=est.accel,
            n_docs=self.n_docs if est.method == "expanded-bca" else None,
        )


class _Moments:
    """Delta-method standard errors of statistics of column means, of the table and inside
    every resample: ``se^2 = grad' S grad / (n - 1)`` with ``S`` the covariance (divisor n) of
    the columns a statistic reads and ``grad`` its gradient at the means (central
    differences). For a mean this is the jackknife's ``s^2 / n`` exactly; for a ratio of means
    the jackknife's to first order. The resamples' covariances come from their cross moments
    (:func:`kvcouple._core.bootstrap_moments`), never from a (resamples x documents) array."""

    def __init__(self, bs: Bootstrap, fns: Sequence[StatFn], joint: bool = False) -> None:
        """``joint``: the statistics' covariances with each other are needed too (every pair
        of the columns any of them reads)."""
        from kvcouple import _core

        if bs.data is None:
            raise ValueError("studentized intervals need the table (bootstrap_table keeps it)")
        self.bs, self.fns = bs, list(fns)
        self.cols = [bs.columns(f) for f in self.fns]
        if joint:
            self.cols = [sorted({j for c in self.cols for j in c})] * len(self.cols)
        pairs = sorted({(j, k) for c in self.cols for j in c for k in c if j <= k})
        self.pair = {p: q for q, p in enumerate(pairs)}
        self.center = np.where(np.isfinite(bs.point), bs.point, 0.0)
        data = bs.data
        with np.errstate(invalid="ignore"):
            self.cross = np.array(
                [np.nanmean((data[:, j] - self.center[j]) * (data[:, k] - self.center[k]))
                 if np.isfinite(data[:, j] * data[:, k]).any() else np.nan
                 for j, k in pairs]
            )  # fmt: skip
        arr = np.asarray(pairs, np.int64).reshape(-1, 2)
        n_boot = bs.reps.shape[0]
        self.cross_boot = (
            _core.bootstrap_moments(
                np.ascontiguousarray(data, np.float64), self.center, arr, n_boot, int(bs.seed)
            )
            if pairs
            else np.zeros((n_boot, 0))
        )
        # Central differences' steps: a millionth of each column's scale (column by column:
        # no temporary the size of the table).
        with np.errstate(invalid="ignore"):
            sd = np.array([np.nanstd(data[:, j]) if np.isfinite(data[:, j]).any() else 0.0
                           for j in range(data.shape[1])])  # fmt: skip
        self.step = 1e-6 * (np.abs(self.center) + sd + 1e-6)

    def gradient(self, f: StatFn, cols: list[int], means: np.ndarray) -> np.ndarray:
        """``d f / d mean_j`` for ``j`` in ``cols`` at ``means`` ((cols,) or (n_boot, cols)):
        central differences, (len(cols),) or (n_boot, len(cols))."""
        index = self.bs._index

        def shifted(j: int, h: float) -> Getter:
            # The getter of ``means`` with column j moved by h (no copy of the means).
            def g(c: str) -> np.ndarray:
                i = index[c]
                return means[..., i] + h if i == j else means[..., i]

            return g

        out = []
        for j in cols:
            h = float(self.step[j])
            up = np.asarray(f(shifted(j, h)), np.float64)
            down = np.asarray(f(shifted(j, -h)), np.float64)
            out.append(np.broadcast_to((up - down) / (2 * h), means.shape[:-1]))
        return np.stack(out, axis=-1) if out else np.zeros(means.shape[:-1] + (0,))

    def covariance(self, j: int, k: int, boot: bool) -> np.ndarray | float:
        """Covariance (divisor n) of columns j and k: of the table, or of every resample."""
        q = self.pair[(min(j, k), max(j, k))]
        if not boot:
            return float(self.cross[q])
        reps = self.bs.reps
        return self.cross_boot[:, q] - (reps[:, j] - self.center[j]) * (reps[:, k] - self.center[k])

    def variance(
        self, ga: np.ndarray, gb: np.ndarray, cols: list[int], boot: bool
    ) -> np.ndarray | float:
        """``ga' S gb / (n - 1)``: the delta method's (co)variance of two statistics reading
        ``cols`` (gradients ``ga``, ``gb`` over them)."""
        total: np.ndarray | float = 0.0
        for a, j in enumerate(cols):
            for b, k in enumerate(cols):
                total = total + ga[..., a] * gb[..., b] * self.covariance(j, k, boot)
        return total / max(self.bs.n_docs - 1, 1)

    def standard_errors(self) -> tuple[np.ndarray, np.ndarray]:
        """Standard errors of every statistic: of the table (k,) and of every resample
        (n_boot, k)."""
        bs = self.bs
        k, n_boot = len(self.fns), bs.reps.shape[0]
        se, se_boot = np.empty(k), np.empty((n_boot, k))
        for i, (f, cols) in enumerate(zip(self.fns, self.cols, strict=True)):
            g = self.gradient(f, cols, bs.point)
            gb = self.gradient(f, cols, bs.reps)
            with np.errstate(invalid="ignore"):
                se[i] = math.sqrt(max(float(self.variance(g, g, cols, False)), 0.0))
                se_boot[:, i] = np.sqrt(np.maximum(self.variance(gb, gb, cols, True), 0.0))
        return se, se_boot


def _t_ends(tstar: np.ndarray, level: float) -> tuple[float, float]:
    """The order statistics of the sorted finite ``t*`` at the two tails of ``level``:
    ``t*_(floor((m+1) a))`` and ``t*_(ceil((m+1)(1-a)))``, ``a = (1 - level)/2`` (so that the
    p-values below invert the interval); beyond the replicates: infinite."""
    m = tstar.size
    a = (1.0 - level) / 2.0
    j = math.floor((m + 1) * a + 1e-9)
    k = math.ceil((m + 1) * (1.0 - a) - 1e-9)
    low = float(tstar[j - 1]) if 1 <= j <= m else -math.inf
    high = float(tstar[k - 1]) if 1 <= k <= m else math.inf
    return low, high


def _studentized_estimate(
    point: float,
    boot: np.ndarray,
    se: float,
    se_boot: np.ndarray,
    level: float,
    scale: Scale = UNBOUNDED,
) -> Estimate:
    """The bootstrap-t interval on ``scale``: ``back([psi - t*_high se_psi, psi - t*_low
    se_psi])`` with ``psi = scale(theta)``, ``se_psi = scale'(theta) se`` and ``t*`` the
    replicates of ``(psi* - psi) / se_psi*``. Rules for resamples that cannot be studentized:
    one at an end of the range (every draw there: ``psi* = +-inf``) is as far as a resample
    goes, ``t* = +-inf``; one whose draws are all alike inside the range (``se* = 0``) is
    studentized by the table's ``se_psi``; one whose statistic is undefined is left out. A
    statistic constant over the documents (``se = 0``, or at an end of its range) gets the
    point as interval, ``constant``. The interval always contains the point (``t*_low <= 0
    <= t*_high``)."""
    nan = math.nan
    if not (math.isfinite(point) and math.isfinite(se)):
        return Estimate(point, nan, nan, boot, method="studentized", se=se, scale=scale)
    outside = not (scale.low <= point <= scale.high)
    if outside:  # a Monte Carlo estimate just outside the range (rho above 1)
        plain = _studentized_estimate(point, boot, se, se_boot, level, UNBOUNDED)
        lo, hi = _beside_range(plain.ci_low, plain.ci_high, point, scale)
        return replace(plain, ci_low=lo, ci_high=hi)
    if se <= 1e-12 * max(1.0, abs(point)) or not scale.holds(point):
        return Estimate(
            point, point, point, boot, method="studentized", se=0.0, constant=True, scale=scale
        )
    psi = float(scale.forward(point))
    se_psi = float(scale.slope(point)) * se
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        psi_b = scale.forward(boot)
        t = (psi_b - psi) / (scale.slope(boot) * se_boot)
        edge = np.isinf(psi_b)
        t = np.where(edge, np.sign(psi_b) * math.inf, t)
        flat = (se_boot == 0) & np.isfinite(psi_b)
        t = np.where(flat, (psi_b - psi) / se_psi, t)
    tstar = np.sort(t[~np.isnan(t)])
    if tstar.size < boot.size / 2:
        return Estimate(point, nan, nan, boot, method="studentized", se=se, scale=scale)
    low, high = _t_ends(tstar, level)
    low, high = min(low, 0.0), max(high, 0.0)
    with np.errstate(invalid="ignore"):
        ends = scale.back(np.array([psi - high * se_psi, psi - low * se_psi]))
    return Estimate(
        point,
        float(ends[0]),
        float(ends[1]),
        boot,
        method="studentized",
        se=se,
        tstar=tstar,
        scale=scale,
    )


def _beside_range(lo: float, hi: float, point: float, scale: Scale) -> tuple[float, float]:
    """The interval of an estimate outside its quantity's range (a ratio of Monte Carlo
    estimates with few documents: rho above 1), made on the plain scale, then kept inside the
    range except as far as the estimate itself lies outside: ``[0, 1.02]`` for rho = 1.02."""
    return (
        min(max(lo, scale.low), point),
        max(min(hi, scale.high), point),
    )


def _on_scale(lo: float, hi: float, boot: np.ndarray, scale: Scale) -> tuple[float, float]:
    """Percentile and BCa ends lie among the replicates, inside the range; an end the Rust
    kernel extrapolated beyond them by the normal tail (mean + z sd) is extrapolated with the
    same ``z`` on ``scale`` instead, so that it stays inside the range too."""
    b = boot[np.isfinite(boot)]
    if not scale.bounded or b.size < 2:
        return lo, hi
    mean, sd = float(b.mean()), float(b.std(ddof=1))
    psi = scale.forward(b)
    psi = psi[np.isfinite(psi)]
    if sd <= 0 or psi.size < 2:
        return lo, hi
    pm, ps = float(psi.mean()), float(psi.std(ddof=1))

    def moved(end: float) -> float:
        if b.min() <= end <= b.max() or not math.isfinite(end):
            return end
        return float(scale.back(pm + (end - mean) / sd * ps))

    return moved(lo), moved(hi)


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


def _fieller_set(
    bs: Bootstrap, num: StatFn, den: StatFn, point: np.ndarray, boot: np.ndarray
) -> tuple[float, float, tuple[float, float] | None]:
    """The accepted set of the ratio (see :meth:`Bootstrap.ratio`) as (low, high, exclude).

    ``s = tan(phi)``: testing ``cos(phi) num - sin(phi) den = 0`` over ``phi`` in
    ``(-pi/2, pi/2)`` covers every ``s`` and infinity (the test's statistic does not change
    when the combination is rescaled). A grid of angles finds where the test accepts, and
    bisection the boundaries."""
    # (var num, cov, var den) by the delta method, of the table and of every resample.
    moments = _Moments(bs, [num, den], joint=True)
    cols = moments.cols[0]
    gn, gd = (moments.gradient(f, cols, bs.point) for f in (num, den))
    bn, bd = (moments.gradient(f, cols, bs.reps) for f in (num, den))
    cov = np.array(
        [float(moments.variance(a, b, cols, False)) for a, b in ((gn, gn), (gn, gd), (gd, gd))]
    )
    cov_boot = np.stack(
        [
            np.broadcast_to(moments.variance(a, b, cols, True), bs.reps.shape[:1])
            for a, b in ((bn, bn), (bn, bd), (bd, bd))
        ]
    )

    def accepts(phi: np.ndarray) -> np.ndarray:
        c, s = np.cos(phi), np.sin(phi)
        var = cov[0] * c * c - 2 * cov[1] * c * s + cov[2] * s * s
        var_boot = cov_boot[0][:, None] * c * c - 2 * cov_boot[1][:, None] * c * s
        var_boot = var_boot + cov_boot[2][:, None] * s * s
        d = point[0] * c - point[1] * s
        d_boot = boot[:, :1] * c - boot[:, 1:2] * s
        with np.errstate(divide="ignore", invalid="ignore"):
            t_obs = d / np.sqrt(var)
            t = (d_boot - d) / np.sqrt(var_boot)
        t = np.sort(np.where(np.isfinite(t), t, np.nan), axis=0)  # NaN sorts last
        m = np.isfinite(t).sum(0)
        a = (1.0 - bs.level) / 2.0
        j = np.floor((m + 1) * a + 1e-9).astype(int)
        k = np.ceil((m + 1) * (1.0 - a) - 1e-9).astype(int)
        cols = np.arange(phi.size)
        low = np.where(j >= 1, t[np.clip(j - 1, 0, None), cols], -np.inf)
        high = np.where(k <= m, t[np.clip(k - 1, 0, t.shape[0] - 1), cols], np.inf)
        enough = (m >= boot.shape[0] / 2) & np.isfinite(t_obs)
        return np.asarray(enough & (low <= t_obs) & (t_obs <= high))

    def edge(a: float, b: float) -> float:
        # The boundary between angles a and b (accepts(a) != accepts(b)), by bisection.
        inside_a = bool(accepts(np.array([a]))[0])
        for _ in range(40):
            mid = 0.5 * (a + b)
            if bool(accepts(np.array([mid]))[0]) == inside_a:
                a = mid
            else:
                b = mid
        return 0.5 * (a + b)

    phi = np.linspace(-math.pi / 2, math.pi / 2, 723)[1:-1]
    ok = accepts(phi)
    if not ok.any() or not np.isfinite(point).all():
        return math.nan, math.nan, None
    if ok.all():
        return -math.inf, math.inf, None
    # Boundaries: where acceptance changes between neighbouring angles.
    flips = np.flatnonzero(ok[1:] != ok[:-1])
    edges = [math.tan(edge(float(phi[i]), float(phi[i + 1]))) for i in flips]
    if ok[0] and ok[-1]:  # the set passes through infinity
        if len(edges) == 2:  # two rays: everything outside one rejected interval
            return -math.inf, math.inf, (edges[0], edges[1])
        return -math.inf, math.inf, None
    low = -math.inf if ok[0] else edges[0]
    high = math.inf if ok[-1] else edges[-1]
    return low, high, None


def jackknife_means(mat: np.ndarray) -> np.ndarray:
    """Leave-one-row-out column means of ``mat`` (NaN entries left out, as in the bootstrap)."""
    finite = np.isfinite(mat)
    vals = np.where(finite, mat, 0.0)
    total, count = vals.sum(0), finite.sum(0).astype(float)
    with np.errstate(divide="ignore", invalid="ignore"):
        loo_sum = total[None, :] - vals
        loo_count = count[None, :] - finite
        return np.where(loo_count > 0, loo_sum / np.where(loo_count > 0, loo_count, 1), np.nan)


def bootstrap_table(
    table: Table, n_boot: int, seed: int, level: float, method: str = DEFAULT_CI_METHOD
) -> Bootstrap:
    from kvcouple import _core

    if not 0 <= int(seed) < 2**64:
        raise ValueError(f"the bootstrap seed must be an integer in [0, 2**64), got {seed}")
    if int(n_boot) < 1:
        raise ValueError(f"n_boot must be at least 1, got {n_boot}")
    if not 0 < level < 1:
        raise ValueError(f"the confidence level must be in (0, 1), got {level}")
    if method not in CI_METHODS:
        raise ValueError(f"ci_method must be one of {CI_METHODS}, got {method!r}")
    names, mat = table.matrix()
    with np.errstate(invalid="ignore"):
        point = np.array([np.nanmean(c) if np.isfinite(c).any() else np.nan for c in mat.T])
    mat = np.ascontiguousarray(mat, np.float64)
    reps = _core.bootstrap_means(mat, int(n_boot), int(seed))
    if mat.shape[0] < 2:  # one document: no jackknife
        return Bootstrap(names, point, reps, level, 1, None, "percentile")
    if method == "studentized" and mat.shape[0] < STUDENTIZED_MIN_DOCS:
        method = "expanded-bca"
    # The table and the seed let any interval method be asked for later (the resamples'
    # moments and the jackknife are made when an interval needs them).
    return Bootstrap(names, point, reps, level, len(table.doc_ids), None, method, mat, int(seed))


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
