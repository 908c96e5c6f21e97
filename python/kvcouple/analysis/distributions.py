"""The normal and Student t distribution functions the bootstrap needs, from the standard
library alone (the analysis core declares no scipy).

Tails are computed directly rather than as ``1 - cdf`` so that p-values far from the
replicates keep their relative accuracy (as scipy's ``ndtr`` and ``stdtr`` do).
"""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import Any, Protocol

_STANDARD_NORMAL = NormalDist()
_SQRT2 = math.sqrt(2.0)


def linear_between(a: float, b: float, t: float) -> float:
    """``a`` and ``b`` (``a <= b``) interpolated at ``t`` in [0, 1] as ``numpy.quantile``'s
    linear method does, to the bit (from the nearer end); ``a`` where they are equal (two
    infinities too, which numpy's formula turns into NaN), and either end itself at ``t`` 0 or
    1 (an infinite end too)."""
    if a == b or t == 0.0:
        return a
    if t == 1.0:
        return b
    return b - (b - a) * (1 - t) if t >= 0.5 else a + (b - a) * t


class _Ordered(Protocol):
    """Values in ascending order (a list, or a numpy array)."""

    def __len__(self) -> int: ...
    def __getitem__(self, i: int, /) -> Any: ...


def sorted_quantile(ordered: _Ordered, q: float) -> float:
    """``numpy.quantile(values, q)`` (linear) of values already in ascending order, without
    NaN; without numpy, whose quantile imports ``numpy.ma`` (35 ms on every command)."""
    if not len(ordered):
        return math.nan
    pos = (len(ordered) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return linear_between(float(ordered[lo]), float(ordered[hi]), pos - lo)


def norm_cdf(z: float) -> float:
    """``P(Z <= z)`` for a standard normal ``Z``; ``erfc`` keeps the lower tail accurate."""
    return 0.5 * math.erfc(-z / _SQRT2)


def norm_ppf(p: float) -> float:
    """The standard normal quantile of ``p`` in (0, 1); ``-inf``/``inf`` at 0 and 1."""
    if p <= 0.0:
        return -math.inf if p == 0.0 else math.nan
    if p >= 1.0:
        return math.inf if p == 1.0 else math.nan
    return _STANDARD_NORMAL.inv_cdf(p)


def _beta_continued_fraction(a: float, b: float, x: float) -> float:
    # The continued fraction of the regularized incomplete beta function (modified Lentz),
    # which converges fast for x < (a + 1) / (a + b + 2).
    tiny = 1e-300
    c = 1.0
    d = 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    frac = d
    for m in range(1, 10_000):
        m2 = 2 * m
        num = m * (b - m) * x / ((a + m2 - 1.0) * (a + m2))
        d = 1.0 + num * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + num / (c if abs(c) > tiny else tiny)
        frac *= d * c
        num = -(a + m) * (a + b + m) * x / ((a + m2) * (a + m2 + 1.0))
        d = 1.0 + num * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + num / (c if abs(c) > tiny else tiny)
        step = d * c
        frac *= step
        if abs(step - 1.0) < 1e-16:
            return frac
    raise ArithmeticError(f"incomplete beta did not converge (a={a}, b={b}, x={x})")


def beta_inc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function ``I_x(a, b)`` for ``a, b > 0``."""
    if not a > 0 or not b > 0:
        raise ValueError(f"beta_inc needs a, b > 0, got a={a}, b={b}")
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = (
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _beta_continued_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_continued_fraction(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """``P(T <= t)`` for Student's t with ``df > 0`` degrees of freedom."""
    if not df > 0:
        raise ValueError(f"t_cdf needs df > 0, got {df}")
    if math.isnan(t):
        return math.nan
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    # The tail beyond |t| is I_x(df/2, 1/2) / 2 with x = df / (df + t^2), computed directly.
    tail = 0.5 * beta_inc(0.5 * df, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def t_ppf(p: float, df: float) -> float:
    """The quantile of ``p`` in (0, 1) of Student's t with ``df > 0`` degrees of freedom."""
    if not df > 0:
        raise ValueError(f"t_ppf needs df > 0, got {df}")
    if p <= 0.0 or p >= 1.0:
        return norm_ppf(p)
    if p == 0.5:
        return 0.0
    if p > 0.5:
        return -t_ppf(1.0 - p, df)
    # Lower half: bracket, then bisect in t; the cdf is monotone, so this cannot miss.
    hi = min(norm_ppf(p), 0.0)
    lo = 2.0 * hi - 1.0
    while t_cdf(lo, df) > p:
        hi, lo = lo, 2.0 * lo
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) > p:
            hi = mid
        else:
            lo = mid
        if hi - lo <= 1e-15 * max(1.0, abs(mid)):
            break
    return 0.5 * (lo + hi)
