"""A candidate interval for a paired difference of median steps, measured against the
analysis's own on the coverage study's populations (docs/statistics.md, *Coverage study*).

The analysis makes a difference of two grouped medians ``m_b - m_a`` by the delta method on
the difference's scale; its density jumps where either median changes class, and with it the
bootstrap-t's critical value (``median_tau (harsh2 - harsh)`` in ``saturated``: 0.902). The
candidate inverts a test on the CDF scale instead, as the per-policy median's interval does:
``delta`` is accepted where the studentized bootstrap test of

    D(delta) = F_b(x + delta) - F_a(x) = 0,  x the median of G(x) = (F_a(x) + F_b(x + delta)) / 2,

accepts (``F`` the grouped CDFs, ``x`` solved again in every resample). At the true difference
``x = m_a`` and ``D = 0``; an error in ``x`` moves ``D`` by ``f_b - f_a`` times it, small
where the two laws are alike, which is where the delta method fails. ``D``'s standard error
is the delta method's with ``x`` moving with the laws (``G(x) = 1/2``): the laws' terms scaled
by ``1 + r`` and ``1 - r``, ``r = (f_b - f_a) / (f_a + f_b)`` at ``x``, bounded by 1, so no
density stands alone in a denominator (``--fixed-x``: ``r = 0``, which over-covers). ``D``
increases with ``delta``, so the set is found by stepping out from the estimate and
bisecting. A prototype, not the analysis's interval: docs/statistics.md gives its coverage.

    python scripts/median_difference_inversion.py --scenarios saturated,never --reps 400
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvcouple import decomposition as dc
from kvcouple.analysis import stats as st
from kvcouple.analysis.bootstrap import Bootstrap, bootstrap_table
from kvcouple.analysis.intervals import Getter, Statistic
from kvcouple.analysis.units import build_table

# Whether D's standard error includes x's movement with the laws (without: --fixed-x).
FULL = True

_spec = importlib.util.spec_from_file_location(
    "coverage_study", Path(__file__).with_name("coverage_study.py")
)
assert _spec is not None and _spec.loader is not None
cov: Any = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cov)


def pooled_law(g: Getter, policy: str, T: int) -> tuple[np.ndarray, np.ndarray]:
    """The pooled ``P(tau = t)``, t = 1..T (first axis), and its total."""
    p = np.stack([np.asarray(g(f"{policy}|pmf|{t}"), float) for t in range(1, T + 1)])
    return p, p.sum(0)


def cdf(p: np.ndarray, total: np.ndarray, x: Any, T: int) -> tuple[np.ndarray, np.ndarray]:
    """The grouped CDF at ``x`` (step t spread over (t - 1/2, t + 1/2]) and ``w_s(x) =
    d(total F(x)) / dp_s`` for every step s."""
    x = np.broadcast_to(np.asarray(x, float), total.shape)
    t = np.clip(np.ceil(x - 0.5), 1, T).astype(int)
    within = np.clip(x - (t - 0.5), 0.0, 1.0)
    steps = np.arange(1, T + 1).reshape((-1,) + (1,) * total.ndim)
    w = np.where(steps < t, 1.0, np.where(steps == t, within, 0.0))
    w = np.where(x >= T + 0.5, 1.0, np.where(x <= 0.5, 0.0, w))
    with np.errstate(invalid="ignore", divide="ignore"):
        return (w * p).sum(0) / total, w


def density(p: np.ndarray, total: np.ndarray, x: Any, T: int) -> np.ndarray:
    """The grouped law's density at ``x``: its class's mass (0 outside [1/2, T + 1/2])."""
    x = np.broadcast_to(np.asarray(x, float), total.shape)
    t = np.clip(np.ceil(x - 0.5), 1, T).astype(int)
    mass = np.take_along_axis(p, (t - 1)[None], 0)[0]
    inside = (x > 0.5) & (x < T + 0.5)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(inside, mass / total, 0.0)


def average_median(laws: tuple[np.ndarray, ...], delta: float, T: int) -> np.ndarray:
    """The median of ``(F_a(x) + F_b(x + delta)) / 2``, from its values at its breakpoints
    (it is linear between them)."""
    pa, ta, pb, tb = laws
    edges = np.arange(0.5, T + 1.0)
    xs = np.unique(np.concatenate([edges, edges - delta]))
    G = np.stack([(cdf(pa, ta, x, T)[0] + cdf(pb, tb, x + delta, T)[0]) / 2 for x in xs])
    k = np.maximum(np.argmax(G >= 0.5, axis=0), 1)
    g0 = np.take_along_axis(G, (k - 1)[None], 0)[0]
    g1 = np.take_along_axis(G, k[None], 0)[0]
    with np.errstate(invalid="ignore", divide="ignore"):
        share = np.where(g1 > g0, (0.5 - g0) / (g1 - g0), 0.0)
    return np.asarray(xs[k - 1] + np.clip(share, 0.0, 1.0) * (xs[k] - xs[k - 1]))


def shift_test(a: str, b: str, T: int, delta: float) -> Statistic:
    """``D(delta)`` as a statistic of the column means, with its derivatives at fixed ``x``."""

    def parts(g: Getter) -> tuple[np.ndarray, ...]:
        pa, ta = pooled_law(g, a, T)
        pb, tb = pooled_law(g, b, T)
        x = average_median((pa, ta, pb, tb), delta, T)
        Fa, wa = cdf(pa, ta, x, T)
        Fb, wb = cdf(pb, tb, x + delta, T)
        return ta, tb, Fa, wa, Fb, wb

    def value(g: Getter) -> np.ndarray:
        _, _, Fa, _, Fb, _ = parts(g)
        return Fb - Fa

    def derivatives(g: Getter) -> dict[str, np.ndarray]:
        ta, tb, Fa, wa, Fb, wb = parts(g)
        out = {}
        with np.errstate(invalid="ignore", divide="ignore"):
            # x moves with the laws (G(x) = 1/2): D's derivative gains (f_b - f_a) dx/dp,
            # dx/dp = -dG/dp / g, so the laws' own terms are scaled by 1 -+ r, r the densities'
            # (f_b - f_a) / (f_a + f_b) at x (bounded by 1: no density alone in a denominator).
            pa, _ = pooled_law(g, a, T)
            pb, _ = pooled_law(g, b, T)
            x = average_median((pa, ta, pb, tb), delta, T)
            fa = density(pa, ta, x, T)
            fb = density(pb, tb, x + delta, T)
            r = np.where(fa + fb > 0, (fb - fa) / (fa + fb), 0.0) if FULL else 0.0
            for t in range(1, T + 1):
                out[f"{a}|pmf|{t}"] = -(1.0 + r) * (wa[t - 1] - Fa) / ta
                out[f"{b}|pmf|{t}"] = (1.0 - r) * (wb[t - 1] - Fb) / tb
        return out

    return Statistic(value, derivatives)


def inverted_interval(bs: Bootstrap, a: str, b: str, T: int) -> tuple[float, float, float]:
    """The estimate ``m_b - m_a`` and the accepted shifts' hull (stepping out from the
    estimate, then 10 bisections per end)."""
    medians = [
        float(dc.median_step(np.array([bs.point[bs.names.index(f"{p}|pmf|{t}")]
                                       for t in range(1, T + 1)])))
        for p in (a, b)
    ]  # fmt: skip
    estimate = medians[1] - medians[0]
    if not np.isfinite(estimate):
        return estimate, np.nan, np.nan

    def accepts(delta: float) -> bool:
        e = bs.evaluate(shift_test(a, b, T, delta))
        return bool(np.isfinite(e.ci_low) and e.ci_low <= 0.0 <= e.ci_high)

    ends = []
    for sign in (1.0, -1.0):
        good, step = 0.0, 0.05
        while abs(estimate + sign * step) <= T and accepts(estimate + sign * step):
            good, step = step, 2 * step
        for _ in range(10):
            mid = (good + step) / 2
            if abs(estimate + sign * mid) <= T and accepts(estimate + sign * mid):
                good = mid
            else:
                step = mid
        ends.append(estimate + sign * good)
    return estimate, min(ends), max(ends)


def study(scenario: str, reps: int, n: int, T: int, seed: int) -> dict[tuple[str, str], float]:
    """Coverage of both intervals of every pair's median difference, on the same studies."""
    docs = cov.population(40, 4, seed, scenario)
    target = cov.truth([cov.exact_doc(d, T) for d in docs], T)
    layout = cov.study_layout(T, 16, 4)
    rng = np.random.default_rng(seed + 1)
    hits: dict[tuple[str, str], list[int]] = {}
    for rep in range(reps):
        chosen = [cov.simulate(docs[i], layout, rng) for i in rng.integers(len(docs), size=n)]
        table = build_table([f"d{i}" for i in range(n)], chosen, list(cov.POLICIES), T, T - 1)
        bs = bootstrap_table(table, 1000, seed * 7919 + rep, 0.95)
        for a, b in cov.PAIRS:
            truth = target[("diff", a, b, "median_tau")]
            f = st.difference(
                st.quantity_fn(a, "median_tau", T), st.quantity_fn(b, "median_tau", T)
            )
            now = bs.evaluate(f, False, st.quantity_scale("median_tau", T, paired=True))
            _, low, high = inverted_interval(bs, a, b, T)
            for name, covered in (
                ("studentized", now.covers(truth)),
                ("inverted", bool(low - 1e-9 <= truth <= high + 1e-9)),
            ):
                hits.setdefault((f"{b} - {a}", name), []).append(int(covered))
    return {k: float(np.mean(v)) for k, v in sorted(hits.items())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenarios", default=",".join(cov.SCENARIOS))
    ap.add_argument("--reps", type=int, default=400)
    ap.add_argument("--docs", type=int, default=16)
    ap.add_argument("--horizon", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fixed-x", action="store_true", help="D's standard error with x held fixed")
    a = ap.parse_args(argv)
    global FULL
    FULL = not a.fixed_x
    for scenario in a.scenarios.split(","):
        t0 = time.time()
        got = study(scenario, a.reps, a.docs, a.horizon, a.seed)
        cells = ", ".join(f"{pair} {name} {c:.3f}" for (pair, name), c in got.items())
        print(f"{scenario} ({a.reps} studies, {time.time() - t0:.0f} s): {cells}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
