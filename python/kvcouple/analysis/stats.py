"""Across-document statistics: means with document-level bootstrap CIs, paired policy
differences, gap attribution (SPEC section 3), early-vs-late window TV, curves.

Every reported statistic is a function of column means of one per-document table (ratios such
as the aggregate rho = mean(post) / mean(occupation) are ratios of means, as SPEC section 3
asks, so the decomposition holds exactly in aggregate). One bootstrap of documents (in Rust,
seeded, independent of thread count) resamples every column at once, so every statistic,
difference and attribution term gets its CI from the same resampled documents and paired
comparisons stay paired. CIs are percentile intervals.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import combinations
from typing import Any

import numpy as np

from kvcouple.analysis.estimates import SCALARS, UnitEstimate

Getter = Callable[[str], np.ndarray]
StatFn = Callable[[Getter], np.ndarray]

# Quantities reported per policy: name -> (unit, description).
QUANTITIES: dict[str, str] = {
    "occurrence": "P(tau <= T)",
    "occupation": "E[(T - tau)+] (tokens)",
    "expected_mismatches": "E[M] (tokens)",
    "mismatch_fraction": "E[M]/T",
    "first_mismatch": "P(tau <= T)/T",
    "exposure": "E[(T - tau)+]/T",
    "rho": "post-divergence mismatch rate",
    "window_contribution": "E[mismatches at lags 1..L_w after tau] (tokens)",
    "tail_contribution": "E[mismatches at lags > L_w after tau] (tokens)",
    "tail_exposure": "E[(T - tau - L_w)+] (tokens)",
    "interval_lower": "sharp interval for E[M]/T, lower end",
    "interval_upper": "sharp interval for E[M]/T, upper end",
    "mean_tau": "E[tau | tau <= T]",
    "median_tau": "median of tau given tau <= T (mean over documents)",
    "early_tv": "branch-aligned TV, first half of the window (O-weighted)",
    "late_tv": "branch-aligned TV, second half of the window (O-weighted)",
    "late_minus_early_tv": "late - early branch-aligned TV (paired)",
}
GAP_TERMS = ("gap", "delta_first_mismatch", "exposure_term", "rate_term", "exposure_share")


@dataclass
class Table:
    """Per-document columns of one model: ``cols[name]`` is an array over documents."""

    doc_ids: list[str]
    cols: dict[str, np.ndarray] = field(default_factory=dict)

    def matrix(self) -> tuple[list[str], np.ndarray]:
        names = list(self.cols)
        return names, np.ascontiguousarray(np.column_stack([self.cols[n] for n in names]))


def build_table(
    doc_ids: list[str],
    units: list[dict[str, UnitEstimate]],
    policies: list[str],
    horizon: int,
    obs_window: int,
) -> Table:
    """One column per (policy, per-document quantity); curves as one column per point."""
    t = Table(doc_ids)
    half = obs_window // 2
    for pol in policies:
        us = [u[pol] for u in units]
        for name in SCALARS:
            t.cols[f"{pol}|{name}"] = np.array([u.values[name] for u in us])
        t.cols[f"{pol}|median_tau"] = np.array([u.median_tau for u in us])
        for i in range(horizon + 1):
            t.cols[f"{pol}|S|{i}"] = np.array([u.survival[i] for u in us])
        for i in range(horizon):
            t.cols[f"{pol}|pmf|{i + 1}"] = np.array([u.pmf[i] for u in us])
        for lag in range(len(us[0].tv_lag_num)):
            t.cols[f"{pol}|tvn|{lag}"] = np.array([u.tv_lag_num[lag] for u in us])
            t.cols[f"{pol}|tvd|{lag}"] = np.array([u.tv_lag_den[lag] for u in us])
        for part, lags in (
            ("early", range(1, half + 1)),
            ("late", range(half + 1, obs_window + 1)),
        ):
            t.cols[f"{pol}|{part}n"] = np.array([u.tv_lag_num[list(lags)].sum() for u in us])
            t.cols[f"{pol}|{part}d"] = np.array([u.tv_lag_den[list(lags)].sum() for u in us])
    return t


def _ratio(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b > 0, a / np.where(b > 0, b, 1.0), np.nan)


def _signed_ratio(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b != 0, a / np.where(b != 0, b, 1.0), np.nan)


def quantity_fn(policy: str, name: str, horizon: int) -> StatFn:
    """The statistic ``name`` of ``policy`` as a function of column means."""
    T = float(horizon)

    def m(g: Getter, col: str) -> np.ndarray:
        return g(f"{policy}|{col}")

    table: dict[str, StatFn] = {
        "occurrence": lambda g: m(g, "occurrence"),
        "occupation": lambda g: m(g, "occupation"),
        "expected_mismatches": lambda g: m(g, "expected_mismatches"),
        "mismatch_fraction": lambda g: m(g, "expected_mismatches") / T,
        "first_mismatch": lambda g: m(g, "occurrence") / T,
        "exposure": lambda g: m(g, "occupation") / T,
        "rho": lambda g: _ratio(m(g, "post_mismatches"), m(g, "occupation")),
        "window_contribution": lambda g: m(g, "window_contribution"),
        "tail_contribution": lambda g: m(g, "tail_contribution"),
        "tail_exposure": lambda g: m(g, "tail_exposure"),
        "interval_lower": lambda g: m(g, "interval_lower") / T,
        "interval_upper": lambda g: m(g, "interval_upper") / T,
        "mean_tau": lambda g: _ratio(m(g, "tau_mass"), m(g, "occurrence")),
        "median_tau": lambda g: m(g, "median_tau"),
        "early_tv": lambda g: _ratio(m(g, "earlyn"), m(g, "earlyd")),
        "late_tv": lambda g: _ratio(m(g, "laten"), m(g, "lated")),
        "late_minus_early_tv": lambda g: (
            _ratio(m(g, "laten"), m(g, "lated")) - _ratio(m(g, "earlyn"), m(g, "earlyd"))
        ),
    }
    return table[name]


def curve_fns(policy: str, horizon: int, lags: int) -> dict[tuple[str, int], StatFn]:
    """Survival S_t (t = 0..T), pmf and hazard P(tau = t | tau >= t) (t = 1..T), branch TV by
    lag (0..L): each point as a function of column means."""
    out: dict[tuple[str, int], StatFn] = {}
    for t in range(horizon + 1):
        out[("survival", t)] = lambda g, t=t: g(f"{policy}|S|{t}")
    for t in range(1, horizon + 1):
        out[("pmf", t)] = lambda g, t=t: g(f"{policy}|pmf|{t}")
        out[("hazard", t)] = lambda g, t=t: _ratio(g(f"{policy}|pmf|{t}"), g(f"{policy}|S|{t - 1}"))
    for lag in range(lags):
        out[("branch_tv", lag)] = lambda g, lag=lag: _ratio(
            g(f"{policy}|tvn|{lag}"), g(f"{policy}|tvd|{lag}")
        )
    return out


def gap_fns(a: str, b: str, horizon: int) -> dict[str, StatFn]:
    """Gap attribution m_B - m_A = df + rho_bar de + e_bar drho (SPEC section 3)."""
    T = float(horizon)

    def parts(g: Getter, p: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        f = g(f"{p}|occurrence") / T
        e = g(f"{p}|occupation") / T
        return f, e, _ratio(g(f"{p}|post_mismatches"), g(f"{p}|occupation"))

    def term(g: Getter, which: str) -> np.ndarray:
        fa, ea, ra = parts(g, a)
        fb, eb, rb = parts(g, b)
        gap = (fb + eb * rb) - (fa + ea * ra)
        exposure = 0.5 * (ra + rb) * (eb - ea)
        return {
            "gap": gap,
            "delta_first_mismatch": fb - fa,
            "exposure_term": exposure,
            "rate_term": 0.5 * (ea + eb) * (rb - ra),
            "exposure_share": _signed_ratio(exposure, gap),
        }[which]

    return {name: (lambda g, name=name: term(g, name)) for name in GAP_TERMS}


@dataclass
class Bootstrap:
    """Column means of the table and of its bootstrap resamples."""

    names: list[str]
    point: np.ndarray  # (cols,)
    reps: np.ndarray  # (n_boot, cols)
    level: float
    n_docs: int

    def __post_init__(self) -> None:
        self._index = {n: i for i, n in enumerate(self.names)}

    def evaluate(self, fn: StatFn) -> tuple[float, float, float, np.ndarray]:
        """Point estimate, CI low, CI high and the bootstrap replicates of one statistic."""
        est = float(np.asarray(fn(lambda c: self.point[self._index[c]])))
        boot = np.asarray(fn(lambda c: self.reps[:, self._index[c]]), dtype=np.float64)
        finite = boot[np.isfinite(boot)]
        if not np.isfinite(est) or finite.size < 0.5 * boot.size:
            return est, float("nan"), float("nan"), boot
        a = (1.0 - self.level) / 2.0
        lo, hi = np.quantile(finite, [a, 1.0 - a])
        return est, float(lo), float(hi), boot


def bootstrap_table(table: Table, n_boot: int, seed: int, level: float) -> Bootstrap:
    from kvcouple import _core

    if not 0 <= int(seed) < 2**64:
        raise ValueError(f"the bootstrap seed must be an integer in [0, 2**64), got {seed}")
    if int(n_boot) < 1:
        raise ValueError(f"n_boot must be at least 1, got {n_boot}")
    if not 0 < level < 1:
        raise ValueError(f"the confidence level must be in (0, 1), got {level}")
    names, mat = table.matrix()
    with np.errstate(invalid="ignore"):
        point = np.array([np.nanmean(c) if np.isfinite(c).any() else np.nan for c in mat.T])
    reps = _core.bootstrap_means(np.ascontiguousarray(mat, np.float64), int(n_boot), int(seed))
    return Bootstrap(names, point, reps, level, len(table.doc_ids))


def summarise(
    bs: Bootstrap,
    policies: list[str],
    horizon: int,
    lags: int,
) -> dict[str, list[dict[str, Any]]]:
    """The tidy rows of every table: summary, curves, differences, gap attribution."""
    summary, curves, diffs, gaps = [], [], [], []
    for pol in policies:
        for name in QUANTITIES:
            est, lo, hi, _ = bs.evaluate(quantity_fn(pol, name, horizon))
            summary.append(
                {
                    "policy": pol,
                    "quantity": name,
                    "estimate": est,
                    "ci_low": lo,
                    "ci_high": hi,
                    "n_docs": bs.n_docs,
                }
            )
        for (curve, x), fn in curve_fns(pol, horizon, lags).items():
            est, lo, hi, _ = bs.evaluate(fn)
            curves.append(
                {
                    "policy": pol,
                    "curve": curve,
                    "x": x,
                    "estimate": est,
                    "ci_low": lo,
                    "ci_high": hi,
                }
            )
    for a, b in combinations(policies, 2):
        for name in QUANTITIES:
            fa, fb = quantity_fn(a, name, horizon), quantity_fn(b, name, horizon)
            est, lo, hi, _ = bs.evaluate(lambda g, fa=fa, fb=fb: fb(g) - fa(g))
            diffs.append(
                {
                    "policy_a": a,
                    "policy_b": b,
                    "quantity": name,
                    "difference": est,
                    "ci_low": lo,
                    "ci_high": hi,
                }
            )
        for term, fn in gap_fns(a, b, horizon).items():
            est, lo, hi, _ = bs.evaluate(fn)
            gaps.append(
                {
                    "policy_a": a,
                    "policy_b": b,
                    "term": term,
                    "estimate": est,
                    "ci_low": lo,
                    "ci_high": hi,
                }
            )
    return {"summary": summary, "curves": curves, "differences": diffs, "gap_attribution": gaps}


def bootstrap_p_value(boot: np.ndarray, direction: str) -> float:
    """Percentile-bootstrap p-value of ``H0: difference <= 0`` (greater), ``>= 0`` (less) or
    ``= 0`` (two-sided), with the +1 correction that keeps it valid for finite resamples."""
    b = boot[np.isfinite(boot)]
    if b.size == 0:
        return float("nan")
    le = (1 + np.sum(b <= 0)) / (b.size + 1)
    ge = (1 + np.sum(b >= 0)) / (b.size + 1)
    if direction == "greater":
        return float(le)
    if direction == "less":
        return float(ge)
    return float(min(1.0, 2 * min(le, ge)))


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
