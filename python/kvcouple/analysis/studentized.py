"""Studentized (bootstrap-t) intervals of statistics of column means: their delta-method
standard errors, of the table and inside every resample (:class:`DeltaMethod`), the interval on
the quantity's scale (:func:`studentized_estimate`), and the confidence set of a ratio by
inverting the studentized test of ``num - s den = 0`` (Fieller's construction with bootstrap-t
critical values, :func:`fieller_set`), and the studentized simultaneous band of a curve
(:func:`sup_t_band`). The bootstrap that asks for them is
:class:`kvcouple.analysis.bootstrap.Bootstrap` (docs/statistics.md: why the default interval).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Protocol

import numpy as np

from kvcouple import _core
from kvcouple.analysis.intervals import (
    UNBOUNDED,
    Estimate,
    Getter,
    Scale,
    StatFn,
    Statistic,
    beside_range,
)
from kvcouple.analysis.moments import TableMoments, pair_moments, spreads
from kvcouple.analysis.pvalues import studentized_p_value


class Resamples(Protocol):
    """What the standard errors read of a bootstrap
    (:class:`kvcouple.analysis.bootstrap.Bootstrap`): the column names and means, the
    resamples' means and seed, and the table."""

    names: list[str]
    point: np.ndarray  # (cols,)
    reps: np.ndarray  # (n_boot, cols)
    level: float
    n_docs: int
    data: np.ndarray | None  # (n_docs, cols)
    seed: int
    # Set where reps are draws from their Gaussian limit: the table's moments of that pass
    # (no resample has moments of its own).
    moments: TableMoments | None

    def columns(self, f: StatFn) -> list[int]: ...


class DeltaMethod:
    """Delta-method standard errors of statistics of column means, of the table and inside
    every resample: ``se^2 = grad' S grad / (n - 1)`` with ``S`` the covariance (divisor n) of
    the columns a statistic reads and ``grad`` its gradient at the means (central
    differences). For a mean this is the jackknife's ``s^2 / n`` exactly; for a ratio of means
    the jackknife's to first order. The resamples' covariances come from their cross moments
    (:func:`kvcouple._core.bootstrap_moments`), never from a (resamples x documents) array."""

    def __init__(self, bs: Resamples, fns: Sequence[StatFn], joint: bool = False) -> None:
        """``joint``: the statistics' covariances with each other are needed too (every pair
        of the columns any of them reads)."""
        if bs.data is None and bs.moments is None:
            raise ValueError("studentized intervals need the table (bootstrap_table keeps it)")
        self.bs, self.fns = bs, list(fns)
        self.index = {n: i for i, n in enumerate(bs.names)}
        self.cols = [bs.columns(f) for f in self.fns]
        if joint:
            self.cols = [sorted({j for c in self.cols for j in c})] * len(self.cols)
        pairs = sorted({(j, k) for c in self.cols for j in c for k in c if j <= k})
        self.pair = {p: q for q, p in enumerate(pairs)}
        self.center = np.where(np.isfinite(bs.point), bs.point, 0.0)
        data = bs.data
        # Without the table (columns combined from its moments), every pair is read off them.
        self.cross = pair_moments(data, self.center, pairs, bs.moments, bs.n_docs)
        arr = np.asarray(pairs, np.int64).reshape(-1, 2)
        n_boot = bs.reps.shape[0]
        # Draws from the Gaussian limit have the table's covariance (variance() below).
        self.cross_boot = np.zeros((n_boot, 0))
        if pairs and bs.moments is None:
            assert data is not None  # checked above: no moments, so the table
            self.cross_boot = _core.bootstrap_moments(
                np.ascontiguousarray(data, np.float64), self.center, arr, n_boot, int(bs.seed)
            )
        # Central differences' steps: a millionth of each column's scale (of the columns the
        # statistics read; the others are never stepped).
        used = sorted({j for c in self.cols for j in c})
        sd = np.zeros(len(bs.names))
        if bs.moments is not None:  # nanstd from the same pass: sqrt(gram_jj / n_j)
            m = bs.moments
            sd[used] = np.sqrt(np.diag(m.gram)[used] / np.maximum(m.count[used], 1))
        else:
            assert data is not None
            sd[used] = spreads(data, used)
        self.step = 1e-6 * (np.abs(self.center) + sd + 1e-6)

    def gradient(self, f: StatFn, cols: list[int], means: np.ndarray) -> np.ndarray:
        """``d f / d mean_j`` for ``j`` in ``cols`` at ``means`` ((cols,) or (n_boot, cols)):
        a :class:`~kvcouple.analysis.intervals.Statistic`'s own derivatives (central
        differences where they are NaN), else central differences
        (:meth:`central_differences`); (len(cols),) or (n_boot, len(cols))."""
        if not isinstance(f, Statistic) or not cols:
            return self.central_differences(f, cols, means)
        index, rest = self.index, means.shape[:-1]
        got = f.derivatives(lambda c: means[..., index[c]])
        names = self.bs.names
        zero = np.zeros(rest)
        grad = np.stack(
            [np.broadcast_to(np.asarray(got.get(names[j], zero), np.float64), rest) for j in cols],
            axis=-1,
        )
        # Where the statistic has no derivative (NaN: a median at its class's end), central
        # differences, as for any statistic.
        kink = np.isnan(grad).any(axis=-1)
        if not kink.any():
            return grad
        if not rest:
            return self.central_differences(f, cols, means)
        grad = grad.copy()
        grad[kink] = self.central_differences(f, cols, means[kink])
        return grad

    def central_differences(self, f: StatFn, cols: list[int], means: np.ndarray) -> np.ndarray:
        """:meth:`gradient` by central differences: two evaluations of ``f`` per column."""
        index = self.index

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

    def variance(
        self, ga: np.ndarray, gb: np.ndarray, cols: list[int], boot: bool
    ) -> np.ndarray | float:
        """``ga' S gb / (n - 1)``: the delta method's (co)variance of two statistics reading
        ``cols`` (gradients ``ga``, ``gb`` over them), ``S`` the covariance (divisor n) of the
        columns: of the table, or of every resample (the table's where the resamples are draws
        from their Gaussian limit)."""
        if not cols:
            return 0.0
        q = np.array([[self.pair[(min(j, k), max(j, k))] for k in cols] for j in cols])
        n = max(self.bs.n_docs - 1, 1)
        if not boot or self.bs.moments is not None:
            cov = self.cross[q]  # (k, k): the table's
            return np.einsum("...a,ab,...b->...", ga, cov, gb) / n
        # Each resample's S = cross moments - r r' (r: its means less the centre), contracted
        # a row of S at a time: memory n_boot x k, not n_boot x k x k.
        reps = self.bs.reps[:, cols] - self.center[cols]
        total = sum(ga[..., a] * (self.cross_boot[:, q[a]] * gb).sum(-1) for a in range(len(cols)))
        return (total - (ga * reps).sum(-1) * (gb * reps).sum(-1)) / n

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


def symmetric_sorted(t: np.ndarray) -> np.ndarray:
    """``t`` and ``-t`` together, sorted: ``-|t|`` descending then ``|t|`` ascending, one sort
    of ``len(t)`` values (the same values as sorting the ``2 len(t)``, up to the sign of a 0).
    ``t`` holds no NaN."""
    magnitude = np.sort(np.abs(t))
    return np.concatenate([-magnitude[::-1], magnitude])


def _t_ends(tstar: np.ndarray, level: float) -> tuple[float, float]:
    """The order statistics of the sorted ``t*`` (here ``t*`` and ``-t*`` together, so the
    two ends are ``-c`` and ``c``) at the two tails of ``level``: ``t*_(floor((m+1) a))`` and
    ``t*_(ceil((m+1)(1-a)))``, ``a = (1 - level)/2`` (so that the p-values of
    :func:`kvcouple.analysis.pvalues.studentized_p_value` invert the interval); beyond the
    replicates: infinite."""
    m = tstar.size
    a = (1.0 - level) / 2.0
    j = math.floor((m + 1) * a + 1e-9)
    k = math.ceil((m + 1) * (1.0 - a) - 1e-9)
    low = float(tstar[j - 1]) if 1 <= j <= m else -math.inf
    high = float(tstar[k - 1]) if 1 <= k <= m else math.inf
    return low, high


# A resample's standard error is floored at this share of the table's (on the plain scale,
# before the scale's slope) in every studentized interval and in the tests the median steps
# and Fieller's set invert: a resample that drew only near-identical documents has a tiny
# se*, and its huge |t*| set the critical value (a real model's 8 documents, seven at
# occurrence 1 - 1e-8 and one at 0.83: the occurrence's interval was [0, 1]). 0.1 fixes that
# and moves the coverage study's cells by at most 0.005; 0.3 moved some by 0.02.
RESAMPLE_SE_FLOOR = 0.1
# The same floor in the simultaneous band, where a step that few resampled documents inform
# set the critical value of every step (coverage study, saturated / rare / never: 0.965-0.985
# unfloored, 0.963-0.983 at 0.3, 0.91-0.97 at 0.5 of the table's).
BAND_SE_FLOOR = 0.3


def floored_se(se_boot: np.ndarray, se: np.ndarray | float) -> np.ndarray:
    """The resamples' standard errors floored at :data:`RESAMPLE_SE_FLOOR` of the table's
    ``se``; a resample with no spread (0) keeps its 0 (studentized by the table's instead)."""
    return np.where(se_boot > 0, np.maximum(se_boot, RESAMPLE_SE_FLOOR * se), se_boot)


def studentized_estimate(
    point: float,
    boot: np.ndarray,
    se: float,
    se_boot: np.ndarray,
    level: float,
    scale: Scale = UNBOUNDED,
) -> Estimate:
    """The symmetric bootstrap-t interval on ``scale``: ``back(psi -+ c se_psi)`` with
    ``psi = scale(theta)``, ``se_psi = scale'(theta) se``, ``t*`` the replicates of
    ``(psi* - psi) / se_psi*`` and ``c`` the ``level`` quantile of ``|t*|`` (taken as the
    equal-tailed ends of ``t*`` and ``-t*`` together, which are kept as ``tstar``, so that the
    p-values invert the interval). Symmetric rather than equal-tailed: at 16 documents the two
    tails of ``t*`` are each estimated from a few dozen resamples, and a skewed or zero-inflated
    table (documents that never diverge) made the equal-tailed interval miss on one side 0.10
    of the time and over-cover 0.99 elsewhere; the symmetric one's coverage error is of a
    smaller order (Hall 1988) and it covered 0.93-0.97 in the coverage study (docs/statistics.md).
    Rules for resamples that cannot be studentized:
    one at an end of the range (every draw there: ``psi* = +-inf``) is as far as a resample
    goes, ``t* = +-inf``; one whose draws are all alike inside the range (``se* = 0``) is
    studentized by the table's ``se_psi``; one whose statistic is undefined is left out. A
    statistic constant over the documents (``se = 0``, or at an end of its range) gets the
    point as interval, ``constant``. The interval always contains the point (``c >= 0``)."""
    nan = math.nan
    if not (math.isfinite(point) and math.isfinite(se)):
        return Estimate(point, nan, nan, boot, method="studentized", se=se, scale=scale)
    outside = not (scale.low <= point <= scale.high)
    if outside:  # a Monte Carlo estimate just outside the range (rho above 1)
        plain = studentized_estimate(point, boot, se, se_boot, level, UNBOUNDED)
        lo, hi = beside_range(plain.ci_low, plain.ci_high, point, scale)
        return replace(plain, ci_low=lo, ci_high=hi)
    if se <= 1e-12 * max(1.0, abs(point)) or not scale.holds(point):
        return Estimate(
            point, point, point, boot, method="studentized", se=0.0, constant=True, scale=scale
        )
    psi = float(scale.forward(point))
    se_psi = float(scale.slope(point)) * se
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        psi_b = scale.forward(boot)
        t = (psi_b - psi) / (scale.slope(boot) * floored_se(se_boot, se))
        edge = np.isinf(psi_b)
        t = np.where(edge, np.sign(psi_b) * math.inf, t)
        flat = (se_boot == 0) & np.isfinite(psi_b)
        t = np.where(flat, (psi_b - psi) / se_psi, t)
    finite = t[~np.isnan(t)]
    if finite.size < boot.size / 2:
        return Estimate(point, nan, nan, boot, method="studentized", se=se, scale=scale)
    tstar = symmetric_sorted(finite)  # t* and -t*
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


class LinearTest:
    """The symmetric studentized bootstrap test of ``cos(phi) num - sin(phi) den = 0``, for
    any ``phi``: the delta method's (co)variances of ``num`` and ``den``, of the table and of
    every resample, once; :meth:`accepts` then tests many ``phi`` at once. Accepts where
    ``|t|`` is at most the level quantile of ``|t*|``, as the studentized interval."""

    def __init__(
        self, bs: Resamples, num: StatFn, den: StatFn, point: np.ndarray, boot: np.ndarray
    ) -> None:
        moments = DeltaMethod(bs, [num, den], joint=True)
        cols = moments.cols[0]
        gn, gd = (moments.gradient(f, cols, bs.point) for f in (num, den))
        bn, bd = (moments.gradient(f, cols, bs.reps) for f in (num, den))
        pairs = ((gn, gn), (gn, gd), (gd, gd))
        self.cov = np.array([float(moments.variance(a, b, cols, False)) for a, b in pairs])
        self.cov_boot = np.stack(
            [
                np.broadcast_to(moments.variance(a, b, cols, True), bs.reps.shape[:1])
                for a, b in ((bn, bn), (bn, bd), (bd, bd))
            ]
        )
        self.point, self.boot, self.level = point, boot, bs.level

    def _studentized(self, phi: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """At each angle of ``phi`` (k,): the statistic ``d``, its standard error and the
        resamples' ``t* = (d* - d) / se*`` (resamples, k), ``se*`` floored as in
        :func:`studentized_estimate`."""
        cov, cov_boot, point, boot = self.cov, self.cov_boot, self.point, self.boot
        c, s = np.cos(phi), np.sin(phi)
        var = cov[0] * c * c - 2 * cov[1] * c * s + cov[2] * s * s
        var_boot = cov_boot[0][:, None] * c * c - 2 * cov_boot[1][:, None] * c * s
        var_boot = var_boot + cov_boot[2][:, None] * s * s
        d = point[0] * c - point[1] * s
        d_boot = boot[:, :1] * c - boot[:, 1:2] * s
        with np.errstate(divide="ignore", invalid="ignore"):
            se = np.sqrt(var)
            return d, se, (d_boot - d) / floored_se(np.sqrt(var_boot), se)

    def accepts(self, phi: np.ndarray) -> np.ndarray:
        """Whether the test of each angle of ``phi`` accepts."""
        d, se, t = self._studentized(phi)
        boot = self.boot
        with np.errstate(divide="ignore", invalid="ignore"):
            # 0/0 (no spread and exactly 0) is accepted: the value is the estimate itself.
            t_obs = np.where(d == 0, 0.0, d / se)
        t = np.sort(np.where(np.isfinite(t), np.abs(t), np.nan), axis=0)  # NaN sorts last
        m = np.isfinite(t).sum(0)
        k = np.ceil((m + 1) * self.level - 1e-9).astype(int)
        cols = np.arange(np.size(phi))
        high = np.where(k <= m, t[np.clip(k - 1, 0, t.shape[0] - 1), cols], np.inf)
        enough = (m >= boot.shape[0] / 2) & np.isfinite(t_obs)
        return np.asarray(enough & (np.abs(t_obs) <= high))

    def p_value(self, phi: float, direction: str) -> float:
        """The bootstrap-t p-value of the test at ``phi`` for ``-d`` against 0 (``d = cos(phi)
        num - sin(phi) den``): ``H0: -d <= 0`` (greater), ``>= 0`` (less) or ``= 0``, with the
        symmetric ``t*`` that :meth:`accepts` reads (:func:`studentized_p_value`), so that the
        two-sided p-value is below ``1 - level`` where the test rejects. NaN where fewer than
        half the resamples give a ``t*``."""
        ds, ses, ts = self._studentized(np.array([phi]))
        d, se, t = float(ds[0]), float(ses[0]), ts[:, 0]
        if not (math.isfinite(d) and se >= 0):
            return math.nan
        est = Estimate(-d, math.nan, math.nan, self.boot[:, 0], method="studentized", se=se)
        if se == 0:  # no spread: the sign of d decides (studentized_p_value's degenerate rule)
            return studentized_p_value(est, direction, 0.0)
        finite = t[np.isfinite(t)]
        if finite.size < self.boot.shape[0] / 2:
            return math.nan
        tstar = symmetric_sorted(finite)
        return studentized_p_value(replace(est, tstar=tstar), direction, 0.0)

    def edge(self, a: float, b: float) -> float:
        """The boundary between angles ``a`` and ``b`` where acceptance changes, by
        bisection."""
        inside_a = bool(self.accepts(np.array([a]))[0])
        for _ in range(40):
            mid = 0.5 * (a + b)
            if bool(self.accepts(np.array([mid]))[0]) == inside_a:
                a = mid
            else:
                b = mid
        return 0.5 * (a + b)


def fieller_set(
    bs: Resamples, num: StatFn, den: StatFn, point: np.ndarray, boot: np.ndarray
) -> tuple[float, float, tuple[float, float] | None]:
    """The accepted set of the ratio as (low, high, exclude) (see
    :meth:`kvcouple.analysis.bootstrap.Bootstrap.ratio`).

    ``s = tan(phi)``: testing ``cos(phi) num - sin(phi) den = 0`` over ``phi`` in
    ``(-pi/2, pi/2)`` covers every ``s`` and infinity (the test's statistic does not change
    when the combination is rescaled; :class:`LinearTest`). A grid of angles finds where the
    test accepts, and bisection the boundaries."""
    test = LinearTest(bs, num, den, point, boot)
    phi = np.linspace(-math.pi / 2, math.pi / 2, 723)[1:-1]
    ok = test.accepts(phi)
    if not ok.any() or not np.isfinite(point).all():
        return math.nan, math.nan, None
    if ok.all():
        return -math.inf, math.inf, None
    # Boundaries: where acceptance changes between neighbouring angles.
    flips = np.flatnonzero(ok[1:] != ok[:-1])
    edges = [math.tan(test.edge(float(phi[i]), float(phi[i + 1]))) for i in flips]
    if ok[0] and ok[-1]:  # the set passes through infinity
        if len(edges) == 2:  # two rays: everything outside one rejected interval
            return -math.inf, math.inf, (edges[0], edges[1])
        return -math.inf, math.inf, None
    low = -math.inf if ok[0] else edges[0]
    high = math.inf if ok[-1] else edges[-1]
    return low, high, None


def accepted_span(
    test: LinearTest, low: float, high: float, inside: float | None = None, grid: int = 33
) -> tuple[float, float] | None:
    """Where, in ``[low, high]``, the test of ``num - s den = 0`` (``s = tan(phi)``) accepts:
    the first and last accepted values of a grid (``grid`` values, and ``inside``, a value
    known to be accepted), moved to the boundaries by bisection; None where it accepts nowhere
    on the grid."""
    s = np.linspace(low, high, grid)
    if inside is not None:
        s = np.unique(np.append(s, inside))
    phi = np.arctan(s)
    ok = test.accepts(phi)
    if not ok.any():
        return None
    first, last = int(np.argmax(ok)), int(len(ok) - 1 - np.argmax(ok[::-1]))
    lo = low if first == 0 else math.tan(test.edge(float(phi[first]), float(phi[first - 1])))
    hi = (
        high if last == len(ok) - 1 else math.tan(test.edge(float(phi[last]), float(phi[last + 1])))
    )
    return lo, hi


def sup_t_band(
    point: np.ndarray,
    boot: np.ndarray,
    se: np.ndarray,
    se_boot: np.ndarray,
    level: float,
    scale: Scale,
    se_floor: float = BAND_SE_FLOOR,
) -> tuple[np.ndarray, np.ndarray, float]:
    """A simultaneous band over the statistics ``point`` (k,) (a curve's steps), studentized
    on ``scale``: ``back(psi_j -+ c se_psi_j)`` with ``c`` the ``level`` quantile over
    resamples of ``max_j |t*_j|``, ``t*_j = (psi*_j - psi_j) / (scale'(theta*_j) se*_j)`` and
    ``se*_j`` floored at ``se_floor`` times the table's (:data:`BAND_SE_FLOOR`). The rules of
    :func:`studentized_estimate` for resamples that cannot be studentized hold per step; a
    step constant over the documents (or at an end of the range) is its point. Returns the
    band's ends (k,) and ``c``."""
    point = np.asarray(point, np.float64)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        psi = scale.forward(point)
        se_psi = scale.slope(point) * se
        varying = (
            np.isfinite(psi) & np.isfinite(se_psi) & (se > 1e-12 * np.maximum(1.0, abs(point)))
        )
        psi_b = scale.forward(boot[:, varying])
        seb = np.maximum(se_boot[:, varying], se_floor * se[varying])
        t = (psi_b - psi[varying]) / (scale.slope(boot[:, varying]) * seb)
        t = np.where(np.isinf(psi_b), math.inf, np.abs(t))
        t = np.where(
            (seb == 0) & np.isfinite(psi_b), np.abs(psi_b - psi[varying]) / se_psi[varying], t
        )
    if varying.any():
        defined = ~np.isnan(t).all(axis=1)
        sup = np.sort(np.nanmax(np.where(np.isnan(t), -math.inf, t), axis=1)[defined])
        k = math.ceil((sup.size + 1) * level - 1e-9)
        c = float(sup[k - 1]) if 1 <= k <= sup.size else math.inf
    else:
        c = 0.0
    with np.errstate(invalid="ignore", over="ignore"):
        half = np.where(varying, c * np.nan_to_num(se_psi, posinf=0.0), 0.0)
        lows = np.where(varying, scale.back(psi - half), point)
        highs = np.where(varying, scale.back(psi + half), point)
    return lows, highs, c
