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
- ``studentized`` (bootstrap-t): ``theta - t*_q se`` with ``se`` the jackknife standard error
  and ``t*`` the replicates of ``(theta* - theta) / se*``, ``se*`` the jackknife inside each
  resample (from its draw counts, :func:`kvcouple._core.bootstrap_counts`); a ratio of two
  statistics gets the confidence set of the studentized test of ``num - s den = 0`` over ``s``
  (Fieller's construction with bootstrap-t critical values, :meth:`Bootstrap.ratio`).

Percentile and BCa ends of all statistics are computed in one Rust call
(``bootstrap_intervals``). ``median_tau`` (discrete) always gets a percentile interval.
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

    def covers(self, value: float) -> bool:
        """Whether ``value`` lies in the confidence set."""
        if not self.ci_low <= value <= self.ci_high:
            return False
        return self.exclude is None or not self.exclude[0] < value < self.exclude[1]


@dataclass
class Bootstrap:
    """Column means of the table, of its bootstrap resamples and of its jackknife."""

    names: list[str]
    point: np.ndarray  # (cols,)
    reps: np.ndarray  # (n_boot, cols)
    level: float
    n_docs: int
    jack: np.ndarray | None = None  # (n_docs, cols) leave-one-document-out means
    method: str = DEFAULT_CI_METHOD
    data: np.ndarray | None = None  # (n_docs, cols) the table (studentized)
    counts: np.ndarray | None = None  # (n_boot, n_docs) draws per resample (studentized)

    def __post_init__(self) -> None:
        self._index = {n: i for i, n in enumerate(self.names)}
        self._inner: _ResampleJackknife | None = None

    def _resample_jackknife(self) -> _ResampleJackknife:
        """The jackknife inside every resample (made once, on first use)."""
        if self._inner is None:
            self._inner = _ResampleJackknife(self)
        return self._inner

    def at_level(self, level: float) -> Bootstrap:
        return replace(self, level=level)

    def evaluate(self, fn: StatFn, discrete: bool = False) -> Estimate:
        return self.evaluate_many([fn], [discrete])[0]

    def evaluate_many(
        self, fns: Sequence[StatFn], discrete: Sequence[bool] | None = None
    ) -> list[Estimate]:
        """Point estimates and CIs of many statistics (one Rust call per interval method)."""
        if not fns:
            return []
        discrete = list(discrete) if discrete is not None else [False] * len(fns)
        point = np.array([float(np.asarray(f(self._at(self.point)))) for f in fns])
        boot = np.column_stack([self._values(f, self.reps) for f in fns])
        out: list[Estimate | None] = [None] * len(fns)
        continuous = [i for i, d in enumerate(discrete) if not d]
        groups = [
            (self.method, continuous),
            ("percentile", [i for i in range(len(fns)) if discrete[i]]),
        ]
        if self.method == "studentized":
            parts = self._studentized_parts([fns[i] for i in continuous], point[continuous])
            for j, i in enumerate(continuous):
                out[i] = _studentized_estimate(
                    point[i], boot[:, i], parts[0][j], parts[1][:, j], self.level
                )
            groups = groups[1:]
        for method, idx in groups:
            if idx:
                for i, e in zip(
                    idx,
                    self._rust_intervals(method, [fns[i] for i in idx], point[idx], boot[:, idx]),
                    strict=True,
                ):
                    out[i] = e
        return [e for e in out if e is not None]

    def _at(self, means: np.ndarray) -> Getter:
        """The getter of one set of column means (a row, or the rows of a matrix)."""
        if means.ndim == 1:
            return lambda c: means[self._index[c]]
        return lambda c: means[..., self._index[c]]

    def _values(self, f: StatFn, means: np.ndarray) -> np.ndarray:
        """``f`` at every row of ``means``, as an array over the rows."""
        return np.broadcast_to(np.asarray(f(self._at(means)), np.float64), means.shape[:1])

    def _rust_intervals(
        self, method: str, fns: Sequence[StatFn], point: np.ndarray, boot: np.ndarray
    ) -> list[Estimate]:
        """Percentile or (expanded) BCa intervals, in one Rust call."""
        from kvcouple import _core

        use_bca = method in ("bca", "expanded-bca")
        if use_bca:
            if self.jack is None:
                raise ValueError("BCa intervals need the jackknife (bootstrap_table makes it)")
            jack = np.column_stack([self._values(f, self.jack) for f in fns])
        zl, zu = normal_scores(self.level, method, self.n_docs)
        rows = _core.bootstrap_intervals(
            np.ascontiguousarray(boot),
            np.ascontiguousarray(point),
            np.ascontiguousarray(jack) if use_bca else np.zeros((0, len(fns))),
            zl,
            zu,
            use_bca,
        )
        return [
            Estimate(
                float(point[j]),
                float(lo),
                float(hi),
                boot[:, j],
                float(z0) if use_bca else 0.0,
                float(a) if use_bca else 0.0,
                method,
            )
            for j, (lo, hi, z0, a) in enumerate(rows)
        ]

    def _studentized_parts(
        self, fns: Sequence[StatFn], point: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Jackknife standard errors of ``fns``: of the table (k,) and inside every resample
        (n_boot, k)."""
        if self.jack is None or self.data is None or self.counts is None:
            raise ValueError("studentized intervals need bootstrap_table's jackknife and counts")
        k, n = len(fns), self.n_docs
        se = np.empty(k)
        se_boot = np.empty((self.counts.shape[0], k))
        inner = self._resample_jackknife()
        for j, f in enumerate(fns):
            se[j] = _jackknife_se(self._values(f, self.jack)[None, :], np.ones((1, n)))[0]
            loo = np.broadcast_to(np.asarray(f(inner.get), np.float64), inner.shape)
            se_boot[:, j] = _jackknife_se(loo, inner.weights)
            inner.forget()
        return se, se_boot

    def studentized_parts(
        self, fns: Sequence[StatFn]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Point estimates (k,), replicates (n_boot, k), jackknife standard errors (k,) and
        those inside every resample (n_boot, k) of ``fns`` (the studentized band uses them)."""
        point = np.array([float(np.asarray(f(self._at(self.point)))) for f in fns])
        boot = np.column_stack([self._values(f, self.reps) for f in fns])
        se, se_boot = self._studentized_parts(fns, point)
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


class _ResampleJackknife:
    """Leave-one-draw-out column means inside every resample: ``get(col)`` is
    ``(n_boot, n_docs)``, entry ``(b, i)`` the mean of resample ``b`` without one draw of
    document ``i`` (``weights[b, i]`` draws stand for it; NaN entries left out as in the
    bootstrap). Columns are computed when a statistic asks for them, and forgotten after it."""

    def __init__(self, bs: Bootstrap) -> None:
        assert bs.data is not None and bs.counts is not None
        self.finite = np.asfortranarray(np.isfinite(bs.data), dtype=np.float64)
        self.vals = np.asfortranarray(np.where(self.finite > 0, bs.data, 0.0))
        self.weights = bs.counts.astype(np.float64)
        self.shape = self.weights.shape
        self.index = bs._index
        self.reps = bs.reps
        self.cache: dict[str, np.ndarray] = {}

    def get(self, col: str) -> np.ndarray:
        if col not in self.cache:
            j = self.index[col]
            finite = self.finite[:, j]
            # (resamples x documents) values: built in place, two passes, one allocation.
            if finite.all():  # every resample holds n entries: its sum is n * mean
                n = float(self.shape[1])
                loo = np.subtract.outer(self.reps[:, j] * n, self.vals[:, j])
                loo /= n - 1.0
            else:
                count = self.weights @ finite
                total = np.where(count > 0, self.reps[:, j], 0.0) * count
                loo = np.subtract.outer(total, self.vals[:, j])
                with np.errstate(divide="ignore", invalid="ignore"):
                    np.divide(loo, np.subtract.outer(count, finite), out=loo)
            self.cache[col] = loo
        return self.cache[col]

    def forget(self) -> None:
        self.cache.clear()


def _jackknife_se(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Jackknife standard errors along the last axis: ``values[..., i]`` the statistic without
    one draw of document ``i``, which ``weights[..., i]`` draws share (n draws in all):
    ``sqrt((n-1)/n sum_draws (v - mean)^2)`` (for a mean, ``s / sqrt(n)`` with ``ddof=1``);
    one pass per row in Rust (:func:`kvcouple._core.jackknife_se`: the studentized bootstrap
    takes one per statistic and resample)."""
    from kvcouple import _core

    values = np.asarray(values, np.float64)
    n = values.shape[-1]
    flat = np.ascontiguousarray(values.reshape(-1, n))
    draws = np.ascontiguousarray(np.broadcast_to(weights, values.shape).reshape(-1, n), np.float64)
    return np.asarray(_core.jackknife_se(flat, draws)).reshape(values.shape[:-1])


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
    point: float, boot: np.ndarray, se: float, se_boot: np.ndarray, level: float
) -> Estimate:
    """The bootstrap-t interval ``[theta - t*_high se, theta - t*_low se]``. Resamples whose
    statistic cannot be studentized (``se* = 0``: every draw alike) are left out; a statistic
    whose standard error is 0 is constant over documents (its interval is the point)."""
    nan = math.nan
    if not (math.isfinite(point) and math.isfinite(se)):
        return Estimate(point, nan, nan, boot, method="studentized", se=se)
    if se == 0.0:
        return Estimate(point, point, point, boot, method="studentized", se=se)
    with np.errstate(divide="ignore", invalid="ignore"):
        t = (boot - point) / se_boot
    tstar = np.sort(t[np.isfinite(t) & (se_boot > 0)])
    if tstar.size < boot.size / 2:
        return Estimate(point, nan, nan, boot, method="studentized", se=se)
    low, high = _t_ends(tstar, level)
    return Estimate(
        point, point - high * se, point - low * se, boot, method="studentized", se=se, tstar=tstar
    )


def studentized_p_value(est: Estimate, direction: str, value: float = 0.0) -> float:
    """The bootstrap-t p-value of ``H0: theta <= value`` (greater), ``>= value`` (less) or
    ``= value``: with ``t = (theta - value) / se``, ``(1 + #{t* >= t}) / (m + 1)`` (greater)
    and ``(1 + #{t* <= t}) / (m + 1)`` (less), the smallest alpha at which the studentized
    interval excludes ``value``."""
    if est.tstar is None or not math.isfinite(est.se):
        if est.se == 0.0:  # a constant statistic: no doubt either way
            return _degenerate_p_value(est.estimate, direction, value)
        return math.nan
    with np.errstate(divide="ignore", invalid="ignore"):
        t = (est.estimate - value) / est.se
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
    assert bs.jack is not None and bs.data is not None and bs.counts is not None
    inner = bs._resample_jackknife()
    jn, jd = (bs._values(f, bs.jack) for f in (num, den))
    ln, ld = (
        np.broadcast_to(np.asarray(f(inner.get), np.float64), inner.shape) for f in (num, den)
    )
    ones = np.ones((1, bs.n_docs))
    cov = np.array([_jackknife_cov(jn, jd, ones)]).reshape(3)
    cov_boot = _jackknife_cov(ln, ld, inner.weights)  # (3, n_boot)

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
    inner.forget()
    if ok[0] and ok[-1]:  # the set passes through infinity
        if len(edges) == 2:  # two rays: everything outside one rejected interval
            return -math.inf, math.inf, (edges[0], edges[1])
        return -math.inf, math.inf, None
    low = -math.inf if ok[0] else edges[0]
    high = math.inf if ok[-1] else edges[-1]
    return low, high, None


def _jackknife_cov(x: np.ndarray, y: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Jackknife (co)variances ``(var x, cov xy, var y)`` along the last axis (see
    :func:`_jackknife_se`), stacked on a new first axis."""
    n = weights.sum(-1)
    use = weights > 0
    mx = (weights * np.where(use, x, 0.0)).sum(-1) / n
    my = (weights * np.where(use, y, 0.0)).sum(-1) / n
    dx = np.where(use, x - mx[..., None], 0.0)
    dy = np.where(use, y - my[..., None], 0.0)
    k = (n - 1) / n
    return np.stack(
        [
            k * (weights * dx * dx).sum(-1),
            k * (weights * dx * dy).sum(-1),
            k * (weights * dy * dy).sum(-1),
        ]
    )


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
    # The jackknife and the draw counts let any interval method be asked for later.
    counts = _core.bootstrap_counts(mat.shape[0], int(n_boot), int(seed))
    jack = jackknife_means(mat)
    return Bootstrap(names, point, reps, level, len(table.doc_ids), jack, method, mat, counts)


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
