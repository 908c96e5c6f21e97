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
- ``studentized`` (symmetric bootstrap-t) on the quantity's scale (:class:`Scale`): for a
  quantity with a finite range ``[low, high]`` the logit of ``(theta - low) / (high - low)``,
  so that the interval lies inside the range by construction; ``psi -+ c se_psi`` mapped
  back, ``c`` the level quantile of ``|t*|``, ``t*`` the replicates of
  ``(psi* - psi) / se_psi*`` (symmetric: the equal-tailed ends followed the chance skew of
  16 documents, docs/statistics.md). Standard errors are the delta method's
  (``sqrt(grad' S grad / (n - 1))``, ``S`` the covariance of the columns the statistic reads:
  for a mean exactly the jackknife's ``s / sqrt(n)``), inside each resample from its moments
  (:func:`kvcouple._core.bootstrap_moments`: memory independent of resamples x documents).
  A ratio of two statistics gets the confidence set of the (symmetric) studentized test of
  ``num - s den = 0`` over ``s`` (Fieller's construction with bootstrap-t critical values,
  :meth:`Bootstrap.ratio`). These live in :mod:`kvcouple.analysis.studentized`.

Percentile and BCa ends of all statistics are computed in one Rust call
(``bootstrap_intervals``); an end extrapolated beyond the replicates is extrapolated on the
quantity's scale. A policy's median step and a paired difference of two get test-inversion
sets when studentized (:meth:`Bootstrap.median_step`, :meth:`Bootstrap.median_difference`). A
statistic that is constant over the documents gets its point as interval and
``Estimate.constant``.

The words of an interval (methods, :class:`Scale`, :class:`Estimate`) are in
:mod:`kvcouple.analysis.intervals`, the p-values and Holm's correction in
:mod:`kvcouple.analysis.pvalues`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from kvcouple import _core
from kvcouple import decomposition as dc
from kvcouple.analysis import intervals
from kvcouple.analysis.intervals import (
    CI_METHODS,
    DEFAULT_CI_METHOD,
    STUDENTIZED_MIN_DOCS,
    UNBOUNDED,
    Estimate,
    Getter,
    Scale,
    StatFn,
    beside_range,
    normal_scores,
)
from kvcouple.analysis.median_shift import MedianShiftTest, median_difference
from kvcouple.analysis.moments import TableMoments, column_means
from kvcouple.analysis.pvalues import bootstrap_p_value, studentized_p_value
from kvcouple.analysis.studentized import (
    DeltaMethod,
    LinearTest,
    accepted_span,
    fieller_set,
    studentized_estimate,
)
from kvcouple.deprecation import moved_getattr

if TYPE_CHECKING:
    from kvcouple.analysis.estimates import Table

__all__ = ["Bootstrap", "TableMoments", "bootstrap_table", "gaussian_means", "jackknife_means"]
# Read from where it lives now, for one release.
__getattr__ = moved_getattr(__name__, {"holm": "kvcouple.analysis.pvalues"})


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
    # Set where the resamples are draws from their Gaussian limit (gaussian_means), not
    # resamples of the documents: inside each, the table's covariance stands for the
    # resample's, and the table's moments come from this one pass.
    moments: TableMoments | None = None

    @property
    def gaussian(self) -> bool:
        return self.moments is not None

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
            moments = DeltaMethod(self, [fns[i] for i in continuous])
            se, se_boot = moments.standard_errors()
            for j, i in enumerate(continuous):
                out[i] = studentized_estimate(
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
                lo, hi = beside_range(float(lo), float(hi), float(point[j]), scale)
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
        every resample (n_boot, k) of ``fns`` (delta method, :class:`DeltaMethod`)."""
        point = np.array([float(np.asarray(f(self._at(self.point)))) for f in fns])
        boot = np.column_stack([self._values(f, self.reps) for f in fns])
        se, se_boot = DeltaMethod(self, fns).standard_errors()
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
        lo, hi, exclude = fieller_set(self, num, den, point, boot)
        return Estimate(estimate, lo, hi, ratio_boot, method="studentized", exclude=exclude)

    def combined(self, columns: Sequence[str], weights: np.ndarray) -> Bootstrap:
        """The bootstrap of the linear combinations ``table[:, columns] @ weights`` (columns
        ``c0``, ``c1``, ...) over the same resamples: their means are the combinations of the
        means, and their resamples' moments come from the same draws. The columns must be
        complete (a mean of a column with NaN entries is not the combination's mean)."""
        if self.data is None:
            raise ValueError("combinations of columns need the table (bootstrap_table keeps it)")
        idx = [self._index[c] for c in columns]
        data = self.data
        return self._combined(lambda: data[:, idx], idx, weights)

    def _combined(
        self, block: Callable[[], np.ndarray], idx: list[int], weights: np.ndarray
    ) -> Bootstrap:
        # ``block()``: the table's columns ``idx`` (gathered once by the caller).
        w = np.asarray(weights, np.float64)
        names = [f"c{j}" for j in range(w.shape[1])]
        point = self.point[idx] @ w
        reps = np.ascontiguousarray(self.reps[:, idx] @ w)
        if self.moments is not None and self.moments.complete(self.n_docs)[idx].all():
            # Draws from the Gaussian limit, complete columns: the combinations' moments are
            # the table's (w' G w), with no pass over the documents (100k documents: 20 ms a
            # combination, six for the median steps of two policies); a pass where a
            # combination is (nearly) constant.
            moments = self.moments.combination(idx, w, self.n_docs)
            if moments is not None:
                return replace(
                    self, names=names, point=point, reps=reps, data=None, jack=None,
                    moments=moments,
                )  # fmt: skip
        data = np.ascontiguousarray(block() @ w)
        return replace(
            self,
            names=names,
            point=point,
            reps=reps,
            data=data,
            jack=None,
            moments=TableMoments.of(data) if self.moments is not None else None,
        )

    def median_step(self, pmf: Sequence[str]) -> Estimate | None:
        """The median step of a divergence-time law (``pmf``: the columns of ``P(tau = t)``,
        t = 1..T; :func:`kvcouple.decomposition.median_step`) with its confidence set by test
        inversion: the steps ``x`` at which the studentized bootstrap test of ``F(x) = 1/2``
        accepts, ``F`` the law's conditional CDF with step t spread over ``(t-1/2, t+1/2]``
        (Brookmeyer and Crowley's construction for a median, with bootstrap-t critical values).

        In step t's class, ``total x (F(x) - 1/2) = mean(z1) + x mean(z2)`` with ``z1 = sum_{s<t}
        p_s/2 - t p_t - sum_{s>t} p_s/2`` and ``z2 = p_t`` per document: linear in the column
        means, so the test is Fieller's for ``-z1/z2`` within the class (:class:`LinearTest`
        on two combined columns, :meth:`combined`). The set is the hull of the classes' accepted
        values, scanned from the estimate's class outwards until one accepts nowhere. Unlike an
        interval made from the median's replicates, its level does not depend on the law's
        shape where the median changes class. None where the columns are not complete (the
        caller's interval stands)."""
        idx = [self._index[c] for c in pmf]
        T = len(idx)
        boot = np.asarray(dc.median_step(self.reps[:, idx].T), np.float64)
        estimate = float(dc.median_step(self.point[idx]))
        block = self._complete_block(idx)
        if block is None:
            return None
        if not math.isfinite(estimate):
            return Estimate(estimate, math.nan, math.nan, boot, method="studentized")
        if _constant(block):
            return Estimate(estimate, estimate, estimate, boot, method="studentized", constant=True)
        home = min(max(math.ceil(estimate - 0.5), 1), T)  # the estimate's class

        def accepted(t: int) -> tuple[float, float] | None:
            test = self._median_class_test(block, idx, t)
            # The estimate is accepted (its statistic is 0): on the grid of its own class.
            return accepted_span(test, t - 0.5, t + 0.5, estimate if t == home else None)

        span = accepted(home)
        if span is None:
            return Estimate(estimate, math.nan, math.nan, boot, method="studentized")
        lo, hi = span
        for step, t in ((-1, home - 1), (1, home + 1)):
            while 1 <= t <= T:
                span = accepted(t)
                if span is None:
                    break
                lo, hi = min(lo, span[0]), max(hi, span[1])
                t += step
        return Estimate(estimate, lo, hi, boot, method="studentized")

    def _complete_block(self, idx: list[int]) -> np.ndarray | None:
        """The table's columns ``idx`` (one gather), None without the table or where an
        entry is not finite."""
        if self.data is None:
            return None
        # Columns next to each other (a law's pmf): a view, not a copy of them all.
        run = len(idx) > 0 and idx == list(range(idx[0], idx[0] + len(idx)))
        block = self.data[:, idx[0] : idx[0] + len(idx)] if run else self.data[:, idx]
        if self.moments is not None:  # the pass that made them counted the finite entries
            complete = bool(self.moments.complete(self.n_docs)[idx].all())
        else:
            complete = bool(np.isfinite(block).all())
        return block if complete else None

    def _median_class_test(self, block: np.ndarray, idx: list[int], t: int) -> LinearTest:
        """The test of ``F(x) = 1/2`` for ``x`` in step t's class (:meth:`median_step`): at
        angle ``arctan(x)``, ``d = cos(phi) total (F(x) - 1/2)`` (``block``: the pmf columns
        ``idx``)."""
        T = len(idx)
        weights = np.zeros((T, 2))
        weights[: t - 1, 0], weights[t:, 0], weights[t - 1] = 0.5, -0.5, (-t, 1.0)
        sub = self._combined(lambda: block, idx, weights)
        return LinearTest(
            sub,
            lambda g: g("c0"),
            lambda g: -g("c1"),
            np.array([sub.point[0], -sub.point[1]]),
            np.column_stack([sub.reps[:, 0], -sub.reps[:, 1]]),
        )

    def median_step_p_value(self, pmf: Sequence[str], direction: str, value: float) -> float:
        """The p-value of :meth:`median_step`'s test at ``value``: ``H0: median <= value``
        (greater), ``>= value`` (less) or ``= value``. The median lies above ``value`` where
        ``F(value) < 1/2``, so the test's ``-d`` is the evidence (:meth:`LinearTest.p_value`).
        A value outside ``(1/2, T + 1/2)``, or a law constant over the documents, is decided
        by the estimate alone; NaN where the columns are not complete."""
        if not math.isfinite(value):
            raise ValueError(f"the tested value of a median step must be finite, got {value!r}")
        idx = [self._index[c] for c in pmf]
        T = len(idx)
        estimate = float(dc.median_step(self.point[idx]))
        block = self._complete_block(idx)
        if block is None or not math.isfinite(estimate):
            return math.nan
        if not 0.5 < value < T + 0.5 or _constant(block):
            sure = Estimate(estimate, estimate, estimate, np.array([]), se=0.0, constant=True)
            return studentized_p_value(sure, direction, value)
        t = min(max(math.ceil(value - 0.5), 1), T)
        return self._median_class_test(block, idx, t).p_value(math.atan(value), direction)

    def median_difference(self, pmf_a: Sequence[str], pmf_b: Sequence[str]) -> Estimate | None:
        """The paired difference ``m_b - m_a`` of two median steps (``pmf_a``, ``pmf_b``: the
        columns of each law's ``P(tau = t)``, t = 1..T) with its confidence set by inverting
        the studentized test of ``F_b(x + delta) = F_a(x)``
        (:mod:`kvcouple.analysis.median_shift`); None where the columns are not complete (the
        caller's interval stands)."""
        return median_difference(
            self, [self._index[c] for c in pmf_a], [self._index[c] for c in pmf_b]
        )

    def median_difference_p_value(
        self, pmf_a: Sequence[str], pmf_b: Sequence[str], direction: str, value: float = 0.0
    ) -> float:
        """The p-value of :meth:`median_difference`'s test at ``value``
        (:meth:`kvcouple.analysis.median_shift.MedianShiftTest.p_value`); NaN where the
        columns are not complete."""
        if not math.isfinite(value):
            raise ValueError(f"the tested median difference must be finite, got {value!r}")
        a, b = [self._index[c] for c in pmf_a], [self._index[c] for c in pmf_b]
        if self.data is None or not MedianShiftTest.complete(self, a + b):
            return math.nan
        return MedianShiftTest(self, a, b).p_value(direction, value)

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


def _on_scale(lo: float, hi: float, boot: np.ndarray, scale: Scale) -> tuple[float, float]:
    """Percentile and BCa ends lie among the replicates, inside the range; an end the Rust
    kernel extrapolated beyond them by the normal tail (mean + z sd) is extrapolated with the
    same ``z`` on ``scale`` instead, so that it stays inside the range too."""
    b = boot[np.isfinite(boot)]
    if not scale.bounded or b.size < 2:
        return lo, hi
    low, high = float(b.min()), float(b.max())
    if all(low <= end <= high or not math.isfinite(end) for end in (lo, hi)):
        return lo, hi  # both among the replicates (the usual case): nothing to move
    mean, sd = float(b.mean()), float(b.std(ddof=1))
    psi = scale.forward(b)
    psi = psi[np.isfinite(psi)]
    if sd <= 0 or psi.size < 2:
        return lo, hi
    pm, ps = float(psi.mean()), float(psi.std(ddof=1))

    def moved(end: float) -> float:
        if low <= end <= high or not math.isfinite(end):
            return end
        return float(scale.back(pm + (end - mean) / sd * ps))

    return moved(lo), moved(hi)


def jackknife_means(mat: np.ndarray) -> np.ndarray:
    """Leave-one-row-out column means of ``mat`` (NaN entries left out, as in the bootstrap)."""
    finite = np.isfinite(mat)
    vals = np.where(finite, mat, 0.0)
    total, count = vals.sum(0), finite.sum(0).astype(float)
    with np.errstate(divide="ignore", invalid="ignore"):
        loo_sum = total[None, :] - vals
        loo_count = count[None, :] - finite
        return np.where(loo_count > 0, loo_sum / np.where(loo_count > 0, loo_count, 1), np.nan)


def _constant(block: np.ndarray) -> bool:
    """Whether every row of ``block`` is its first: its first rows asked first (real laws
    differ there, so the whole block is seldom compared)."""
    head = block[:64]
    return bool((head == block[:1]).all()) and bool((block == block[:1]).all())


def gaussian_means(
    mat: np.ndarray, point: np.ndarray, n_boot: int, seed: int, moments: TableMoments | None = None
) -> np.ndarray:
    """``n_boot`` draws of the column means from their Gaussian limit ``N(point, V)``: the
    distribution a resample's means tend to as documents grow (the Gaussian multiplier
    bootstrap's, exactly). ``V`` is the covariance of the means with NaN entries left out as
    the resamples leave them out, ``V_jk = sum_i (x_ij - m_j)(x_ik - m_k) / (n_j n_k)`` over
    the documents where both are finite (``n_j``: column j's finite entries;
    :class:`TableMoments`). A column that does not vary (or has no finite entry) is its point
    in every draw, exactly."""
    m = moments if moments is not None else TableMoments.of(mat)
    varies = (np.diag(m.gram) > 0) & np.isfinite(point)
    reps = np.tile(point, (int(n_boot), 1))
    if varies.any():
        n = m.count[varies]
        cov = m.gram[np.ix_(varies, varies)] / np.outer(n, n)
        lam, vec = np.linalg.eigh(cov)
        root = vec * np.sqrt(np.clip(lam, 0.0, None))
        z = np.random.default_rng(int(seed)).standard_normal((int(n_boot), int(varies.sum())))
        reps[:, varies] += z @ root.T
    return reps


def bootstrap_table(
    table: Table,
    n_boot: int,
    seed: int,
    level: float,
    method: str = DEFAULT_CI_METHOD,
    gaussian: bool | None = None,
    moments: TableMoments | None = None,
) -> Bootstrap:
    """The table's column means and ``n_boot`` resamples of them (seeded). Studentized
    intervals of :data:`~kvcouple.analysis.intervals.GAUSSIAN_MIN_DOCS` documents or more
    draw the resamples' means from their Gaussian limit (:func:`gaussian_means`) instead of
    resampling the documents; ``gaussian`` True or False forces the choice (studentized).
    ``moments``: the table's, made as it was read (:class:`~kvcouple.analysis.moments.
    RunningMoments`); used by the Gaussian limit, made here when not given."""
    if not 0 <= int(seed) < 2**64:
        raise ValueError(f"the bootstrap seed must be an integer in [0, 2**64), got {seed}")
    if int(n_boot) < 1:
        raise ValueError(f"n_boot must be at least 1, got {n_boot}")
    if not 0 < level < 1:
        raise ValueError(f"the confidence level must be in (0, 1), got {level}")
    if method not in CI_METHODS:
        raise ValueError(f"ci_method must be one of {CI_METHODS}, got {method!r}")
    names, mat = table.matrix()
    mat = np.ascontiguousarray(mat, np.float64)
    n = mat.shape[0]
    if gaussian is None:
        gaussian = n >= intervals.GAUSSIAN_MIN_DOCS
    gaussian = bool(gaussian) and method == "studentized" and n >= STUDENTIZED_MIN_DOCS
    if gaussian:
        # The same passes give the means and the cross moments the standard errors read.
        if moments is None:
            moments = TableMoments.of(mat)
        elif moments.count.shape != (mat.shape[1],) or np.any(moments.count > n):
            raise ValueError(
                f"moments of {moments.count.shape[0]} columns for a table of {mat.shape[1]}"
            )
        point = moments.point
        reps = gaussian_means(mat, point, int(n_boot), int(seed), moments)
    else:
        moments = None  # each interval makes the resamples' moments it needs
        point = column_means(mat)[0]
        reps = _core.bootstrap_means(mat, int(n_boot), int(seed))
    if n < 2:  # one document: no jackknife
        return Bootstrap(names, point, reps, level, 1, None, "percentile")
    if method == "studentized" and n < STUDENTIZED_MIN_DOCS:
        method = "expanded-bca"
    # The table and the seed let any interval method be asked for later (the resamples'
    # moments and the jackknife are made when an interval needs them).
    return Bootstrap(
        names, point, reps, level, len(table.doc_ids), None, method, mat, int(seed), moments
    )
