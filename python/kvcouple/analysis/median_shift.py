"""The confidence set of a paired difference of median steps ``m_b - m_a`` by test inversion
(docs/statistics.md, *Median steps*): the shifts ``delta`` at which the symmetric studentized
bootstrap test of

    D(delta) = F_b(x + delta) - F_a(x) = 0,  x the median of G(x) = (F_a(x) + F_b(x + delta)) / 2,

accepts, ``F`` the grouped conditional CDFs of the two divergence-time laws (step t spread over
``(t - 1/2, t + 1/2]``, :func:`kvcouple.decomposition.median_step`) and ``x`` solved again in
every resample. At the true difference ``x = m_a`` and ``D = 0``. The delta method on the
difference's own scale failed where either median changes class (its density jumps there, and
with it the bootstrap-t's critical value: 0.902 in the coverage study's ``saturated``); ``D``
is a difference of CDFs, smooth in the laws.

``D``'s standard error is the delta method's with ``x`` moving with the laws (``G(x) = 1/2``):
each law's own terms scaled by ``1 + r`` and ``1 - r``, ``r = (f_b - f_a) / (f_a + f_b)`` at
``x``, bounded by 1, so no density stands alone in a denominator. The densities are the grouped
laws' own (their classes' masses): the laws' frequency polygons instead (continuous in ``x``)
covered better where one policy's law is a fixed mix of the other's and its shift, whose terms
nearly cancel (0.95 against 0.87, tests/analysis/test_median_difference.py), but 0.865 in the
coverage study's ``saturated-tail`` (docs/statistics.md). ``D`` does not
decrease with ``delta`` (``D = 1 - 2 F_a(x)`` and ``x`` moves left), so the set is found by
stepping out from the estimate and bisecting each end.

Each test is O(T) per resample: the CDFs are read off cumulative sums, and a gradient is six
numbers on the documents' cumulative pmf columns (two neighbouring steps and the total, per
law), so that a resample's variance is one gather per document (document resamples, from their
draw counts) or one 6 x 6 contraction of the table's covariance (resamples drawn from the
Gaussian limit), never a (resamples x documents x steps) array.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from kvcouple import _core
from kvcouple import decomposition as dc
from kvcouple.analysis.intervals import Estimate
from kvcouple.analysis.moments import GATHER_BYTES
from kvcouple.analysis.pvalues import studentized_p_value
from kvcouple.analysis.studentized import Resamples, studentized_estimate

__all__ = ["MedianShiftTest", "median_difference"]

# Each end of the set: steps out from the estimate doubling from FIRST_STEP (in steps), then
# BISECTIONS halvings of the last bracket (its end to about 1/1000 of its distance).
FIRST_STEP = 0.05
BISECTIONS = 10
# A resample's variance below this share of its second moment is rounding (sum of squares
# less the square of the mean cancels to about 1e-16 of the terms).
CANCELLATION = 1e-10
# Beyond this many documents a resample's moments are read by groups of resamples sharing
# their columns (BLAS) rather than gathered document by document.
GROUPED_DOCS = 256


@dataclass(frozen=True)
class _Place:
    """Where values ``y`` fall in a grouped law (rows: the table and the resamples): the
    class ``t`` (1..T) and the share of it below ``y`` (``within``, 0..1), the CDF there, its
    density and the law's total."""

    t: np.ndarray
    within: np.ndarray
    cdf: np.ndarray
    density: np.ndarray
    total: np.ndarray


def _rows(cum: np.ndarray, at: np.ndarray) -> np.ndarray:
    """``cum[i, at[i]]`` for every row ``i`` (one flat gather)."""
    return cum.ravel()[np.arange(cum.shape[0]) * cum.shape[1] + at]


def _class(cum: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The class ``t`` (1..T) of each row's ``y`` and the share of it below ``y`` (0..1):
    class T wholly below beyond ``T + 1/2``, class 1 wholly above below ``1/2``. An undefined
    ``y`` (a resample where a law has no mass) reads class 1."""
    T = cum.shape[1] - 1
    t = np.clip(np.ceil(np.nan_to_num(y, nan=1.0) - 0.5), 1, T).astype(np.int64)
    return t, np.clip(y - (t - 0.5), 0.0, 1.0)


def _cdf(cum: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The grouped CDF of each row's law (cumulative sums ``cum`` (rows, T + 1), ``cum[:, 0]
    = 0``) at that row's ``y`` (rows,): 0 below ``1/2``, 1 beyond ``T + 1/2``."""
    t, within = _class(cum, y)
    below = _rows(cum, t - 1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return (below + within * (_rows(cum, t) - below)) / cum[:, -1]


def _place(cum: np.ndarray, y: np.ndarray) -> _Place:
    """Each row's ``y`` (rows,) in its law (cumulative sums ``cum``, as :func:`_cdf`); the
    density is the grouped law's own, its class's mass over the total (0 outside
    ``(1/2, T + 1/2)``)."""
    t, within = _class(cum, y)
    below = _rows(cum, t - 1)
    mass = _rows(cum, t) - below
    total = cum[:, -1]
    inside = (y > 0.5) & (y < cum.shape[1] - 0.5)
    with np.errstate(invalid="ignore", divide="ignore"):
        cdf = (below + within * mass) / total
        density = np.where(inside, mass / total, np.where(np.isnan(y), np.nan, 0.0))
    return _Place(t, within, cdf, density, total)


def _coefficients(a: _Place, b: _Place, r: np.ndarray) -> np.ndarray:
    """``D``'s gradient as coefficients on the cumulative columns (rows, 6): ``dD/dp_s =
    -(1 + r)(w_a[s] - F_a)/total_a + (1 - r)(w_b[s] - F_b)/total_b``, ``w[s]`` 1 below the
    class, its share at it and 0 above, so that ``sum_s w[s] d_s`` is the cumulative column
    below the class plus the share of the class's."""
    with np.errstate(invalid="ignore", divide="ignore"):
        ka, kb = -(1.0 + r) / a.total, (1.0 - r) / b.total
    return np.stack(
        [ka * (1 - a.within), ka * a.within, -ka * a.cdf,
         kb * (1 - b.within), kb * b.within, -kb * b.cdf],
        axis=1,
    )  # fmt: skip


def _cumulative(p: np.ndarray) -> np.ndarray:
    """``[0, p_1, p_1 + p_2, ...]`` along the last axis."""
    out = np.zeros(p.shape[:-1] + (p.shape[-1] + 1,))
    np.cumsum(p, axis=-1, out=out[..., 1:])
    return out


class MedianShiftTest:
    """The studentized test of ``m_b - m_a = delta`` for any ``delta`` (module docstring):
    the two laws' cumulative sums at the table and in every resample, the documents' centred
    cumulative columns and the resamples' draw counts (or the table's covariance, for
    resamples drawn from the Gaussian limit), made once."""

    def __init__(self, bs: Resamples, pmf_a: list[int], pmf_b: list[int]) -> None:
        """``pmf_a``, ``pmf_b``: the table's columns of ``P(tau = t)``, t = 1..T, of each law.
        The table's columns must be complete (:meth:`complete`)."""
        if bs.data is None:
            raise ValueError("a median difference's test needs the table (bootstrap_table)")
        self.bs, self.T = bs, len(pmf_a)
        cols = list(pmf_a) + list(pmf_b)
        rows = np.vstack([bs.point[cols][None], bs.reps[:, cols]])
        # Row 0: the table; rows 1..: the resamples.
        self.cum_a, self.cum_b = _cumulative(rows[:, : self.T]), _cumulative(rows[:, self.T :])
        self.estimate = float(dc.median_step(bs.point[pmf_b]) - dc.median_step(bs.point[pmf_a]))
        self.boot = np.asarray(
            dc.median_step(bs.reps[:, pmf_b].T) - dc.median_step(bs.reps[:, pmf_a].T)
        )
        n, T = bs.n_docs, self.T
        self.n = n
        self.cov: np.ndarray | None
        if bs.moments is not None:
            self.constant = bool((np.diag(bs.moments.gram)[cols] == 0).all())
            # The Gaussian limit: every resample has the table's covariance, read in the
            # cumulative columns' coordinates (L S L', L the cumulative sum with a 0 row).
            sub = bs.moments.gram[np.ix_(cols, cols)] / n
            lower = np.tril(np.ones((T + 1, T)), -1)
            both = np.zeros((2 * T + 2, 2 * T))
            both[: T + 1, :T], both[T + 1 :, T:] = lower, lower
            self.cov = np.asarray(both @ sub @ both.T)
            self.docs: np.ndarray | None = None
            self.counts: np.ndarray | None = None
        else:
            block = bs.data[:, cols]
            self.constant = bool((block == block[:1]).all())
            centred = block - bs.point[cols]
            self.docs = np.hstack([_cumulative(centred[:, :T]), _cumulative(centred[:, T:])])
            self.cov = None
            self.counts = _core.bootstrap_counts(n, bs.reps.shape[0], int(bs.seed)).astype(
                np.float64
            )

    @staticmethod
    def complete(bs: Resamples, cols: list[int]) -> bool:
        """Whether the table's ``cols`` have every entry finite (the test reads no NaN)."""
        if bs.moments is not None:
            return bool(bs.moments.complete(bs.n_docs)[cols].all())
        assert bs.data is not None
        return bool(np.isfinite(bs.data[:, cols]).all())

    def median(self, delta: float) -> np.ndarray:
        """``x`` of every row: the first point where ``G`` reaches 1/2. ``G`` is linear between
        its breakpoints (the class ends ``k + 1/2`` and ``k + 1/2 - delta``): the first one
        where it reaches 1/2 found by bisection over them (it is 0 at the first, 1 at the
        last), then interpolated."""
        edges = np.arange(self.T + 1) + 0.5
        xs = np.unique(np.concatenate([edges, edges - delta]))

        def average(k: np.ndarray) -> np.ndarray:
            x = xs[k]
            return (_cdf(self.cum_a, x) + _cdf(self.cum_b, x + delta)) / 2

        rows = self.cum_a.shape[0]
        lo, hi = np.zeros(rows, np.int64), np.full(rows, xs.size - 1)
        while (hi - lo > 1).any():  # G(xs[lo]) < 1/2 <= G(xs[hi]) (NaN: hi stays last)
            mid = (lo + hi) // 2
            up = average(mid) >= 0.5
            lo, hi = np.where(up, lo, mid), np.where(up, mid, hi)
        g0, g1 = average(hi - 1), average(hi)
        with np.errstate(invalid="ignore", divide="ignore"):
            share = np.where(g1 > g0, (0.5 - g0) / (g1 - g0), 0.0)
        share = np.where(np.isnan(g0 + g1), np.nan, share)
        return np.asarray(xs[hi - 1] + np.clip(share, 0.0, 1.0) * (xs[hi] - xs[hi - 1]))

    def statistic(self, delta: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``D(delta)`` of every row, and its gradient as coefficients (rows, 6) on the
        cumulative columns at indices (rows, 6) (law a's at 0..T, law b's at T+1..2T+1)."""
        T = self.T
        x = self.median(delta)
        a, b = _place(self.cum_a, x), _place(self.cum_b, x + delta)
        with np.errstate(invalid="ignore", divide="ignore"):
            both = a.density + b.density
            r = np.where(both > 0, (b.density - a.density) / both, 0.0)
        coef = _coefficients(a, b, r)
        full = np.full_like(a.t, T)
        at = np.stack([a.t - 1, a.t, full, b.t + T, b.t + T + 1, full + T + 1], axis=1)
        return b.cdf - a.cdf, coef, at

    def _variances(self, coef: np.ndarray, at: np.ndarray) -> np.ndarray:
        """The delta method's variance of ``D`` in every row: ``g' S g / (n - 1)`` with ``S``
        the covariance (divisor n) of the table's columns (row 0) or of each resample's."""
        n = self.n
        if self.cov is not None:
            s = self.cov[at[:, :, None], at[:, None, :]]
            return np.einsum("ra,rab,rb->r", coef, s, coef) / max(n - 1, 1)
        docs, counts = self.docs, self.counts
        assert docs is not None and counts is not None
        out = np.empty(coef.shape[0])
        # The table's: its documents' projections on the gradient (their mean is 0).
        proj = docs[:, at[0]] @ coef[0]
        out[0] = float(np.mean(proj * proj))
        # Each resample's: the second moment of its drawn documents' projections less its
        # mean's square.
        moments = self._grouped if n > GROUPED_DOCS else self._gathered
        mean, second = moments(coef[1:], at[1:], docs, counts)
        # A resample whose drawn documents project alike has variance 0 (its rounding residue
        # is no spread: the flat-resample rule of studentized_estimate holds).
        var = second - mean * mean
        out[1:] = np.where(var > CANCELLATION * second, var, 0.0)
        return out / max(n - 1, 1)

    def _gathered(
        self, coef: np.ndarray, at: np.ndarray, docs: np.ndarray, counts: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """The resamples' mean and second moment of the projections, every drawn document's
        projection gathered, a block of resamples at a time (memory: GATHER_BYTES per array)."""
        n = self.n
        mean, second = np.empty(coef.shape[0]), np.empty(coef.shape[0])
        step = max(1, GATHER_BYTES // (8 * max(n, 1)))
        for start in range(0, coef.shape[0], step):
            stop = min(start + step, coef.shape[0])
            proj = np.zeros((stop - start, n))
            for j in range(coef.shape[1]):
                proj += coef[start:stop, j : j + 1] * docs[:, at[start:stop, j]].T
            c = counts[start:stop]
            mean[start:stop] = (c * proj).sum(1) / n
            second[start:stop] = (c * proj * proj).sum(1) / n
        return mean, second

    def _grouped(
        self, coef: np.ndarray, at: np.ndarray, docs: np.ndarray, counts: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`_gathered` for many documents: resamples that read the same six cumulative
        columns share them, so each group's moments are two products of its draw counts with
        the columns and their pairwise products (BLAS), contracted with the coefficients."""
        n = self.n
        mean, second = np.empty(coef.shape[0]), np.empty(coef.shape[0])
        upper_i, upper_j = np.triu_indices(at.shape[1])
        twice = np.where(upper_i == upper_j, 1.0, 2.0)
        keys, group = np.unique(at, axis=0, return_inverse=True)
        order = np.argsort(group.ravel(), kind="stable")
        bounds = np.searchsorted(group.ravel()[order], np.arange(keys.shape[0] + 1))
        for g in range(keys.shape[0]):
            rows = order[bounds[g] : bounds[g + 1]]
            cols = docs[:, keys[g]]  # (n, 6)
            drawn = counts[rows]  # (rows, n)
            first = drawn @ cols / n
            cross = drawn @ (cols[:, upper_i] * cols[:, upper_j]) / n
            c = coef[rows]
            mean[rows] = (c * first).sum(1)
            second[rows] = (cross * c[:, upper_i] * c[:, upper_j] * twice).sum(1)
        return mean, second

    def evaluate(self, delta: float) -> Estimate:
        """The studentized interval of ``D(delta)`` (on its plain scale); the test accepts
        ``delta`` where it holds 0 (:meth:`accepts`)."""
        d, coef, at = self.statistic(delta)
        with np.errstate(invalid="ignore"):
            se = np.sqrt(np.maximum(self._variances(coef, at), 0.0))
        return studentized_estimate(float(d[0]), d[1:], float(se[0]), se[1:], self.bs.level)

    def accepts(self, delta: float) -> bool:
        """Whether the test of ``m_b - m_a = delta`` accepts (``delta`` within the range
        ``[-T, T]``)."""
        if not abs(delta) <= self.T:
            return False
        e = self.evaluate(delta)
        return bool(e.ci_low <= 0.0 <= e.ci_high)

    def interval(self) -> Estimate:
        """The estimate with the hull of the accepted shifts: stepping out from the estimate
        until a shift is rejected, then bisecting the last bracket. No interval (NaN) where
        the estimate itself is not accepted (too few resamples define the test)."""
        est, nan = self.estimate, math.nan
        out = Estimate(est, nan, nan, self.boot, method="studentized")
        if not math.isfinite(est):
            return out
        if self.constant:
            return Estimate(est, est, est, self.boot, method="studentized", se=0.0, constant=True)
        home = self.evaluate(est)
        if not home.ci_low <= 0.0 <= home.ci_high:
            return out
        ends = []
        for sign in (1.0, -1.0):
            good, step = 0.0, FIRST_STEP
            while abs(est + sign * step) <= self.T and self.accepts(est + sign * step):
                good, step = step, 2 * step
            for _ in range(BISECTIONS):
                mid = (good + step) / 2
                if self.accepts(est + sign * mid):
                    good = mid
                else:
                    step = mid
            ends.append(est + sign * good)
        return Estimate(est, min(ends), max(ends), self.boot, method="studentized", se=home.se)

    def p_value(self, direction: str, value: float = 0.0) -> float:
        """The bootstrap-t p-value of ``H0: m_b - m_a <= value`` (greater), ``>= value`` (less)
        or ``= value``, from the test at ``value``: ``D`` grows with the shift, so
        ``t = -D(value) / se`` measures the estimate above ``value``; ``(1 + #{t* >= t}) /
        (m + 1)`` (greater), ``(1 + #{t* <= t}) / (m + 1)`` (less), ``t*`` the test's
        symmetric replicates. NaN where the test is undefined."""
        if not math.isfinite(self.estimate):
            return math.nan
        e = self.evaluate(min(max(value, -self.T), self.T))
        # -D(value) on the plain scale tested against 0: the interval's own p-value.
        return studentized_p_value(replace(e, estimate=-e.estimate), direction, 0.0)


def median_difference(bs: Resamples, pmf_a: list[int], pmf_b: list[int]) -> Estimate | None:
    """The paired difference ``m_b - m_a`` of two median steps with its test-inversion set
    (:class:`MedianShiftTest`); None where the table's pmf columns are not complete (the
    caller's interval stands)."""
    if bs.data is None or not MedianShiftTest.complete(bs, list(pmf_a) + list(pmf_b)):
        return None
    return MedianShiftTest(bs, pmf_a, pmf_b).interval()
