"""Across-document statistics: means with document-level bootstrap CIs, paired policy
differences, gap attribution (SPEC section 3), early-vs-late window TV, survival comparisons,
curves.

Every reported statistic is a function of column means of one per-document table (ratios such
as the aggregate rho = mean(post) / mean(occupation) are ratios of means, as SPEC section 3
asks, so the decomposition holds exactly in aggregate). One bootstrap of documents (in Rust,
seeded, independent of thread count) resamples every column at once, so every statistic,
difference and attribution term gets its CI from the same resampled documents and paired
comparisons stay paired.

Intervals (``ci_method``; docs/statistics.md has the coverage study that chose the default):

- ``percentile``: quantiles of the replicates;
- ``bca``: bias-corrected and accelerated (Efron 1987), the acceleration from the
  leave-one-document-out jackknife;
- ``expanded-bca`` (default): BCa with the normal scores widened to ``sqrt(n/(n-1)) t_{n-1}``
  (Hesterberg's small-sample expansion), which makes the interval exact for the mean of normal
  documents; plain percentile and BCa intervals are too narrow with few documents (coverage
  about 0.92 at 16 documents for a nominal 0.95).

The interval ends of all statistics are computed in one Rust call (``bootstrap_intervals``).
``median_tau`` (discrete) and the exposure share (a ratio whose denominator can be near 0)
always get percentile intervals.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from itertools import combinations
from typing import Any

import numpy as np

from kvcouple.analysis.estimates import SCALARS, UnitEstimate

Getter = Callable[[str], np.ndarray]
StatFn = Callable[[Getter], np.ndarray]

CI_METHODS = ("percentile", "bca", "expanded-bca")
DEFAULT_CI_METHOD = "expanded-bca"

# Quantities reported per policy: name -> description (with the unit).
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
    "mean_tau": "E[tau | tau <= T] (step)",
    "median_tau": "median of the pooled law of tau given tau <= T (step; percentile CI)",
    "rmst": "restricted mean time to divergence E[min(tau, T)] = sum_{t<T} S_t (tokens)",
    "early_tv": "branch-aligned TV, early lags 1..s of the window (O-weighted)",
    "late_tv": "branch-aligned TV, late lags s+1..L_w of the window (O-weighted)",
    "late_minus_early_tv": "late - early branch-aligned TV (paired)",
}
DISCRETE = ("median_tau",)  # integer-valued: percentile intervals only
PERCENTILE_TERMS = ("exposure_share",)  # gap terms with percentile intervals only
GAP_TERMS = ("gap", "delta_first_mismatch", "exposure_term", "rate_term", "exposure_share")
NOT_INTERPRETABLE = "not interpretable: the gap's CI includes 0"


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
    early_late_split: int | None = None,
) -> Table:
    """One column per (policy, per-document quantity); curves as one column per point.
    Early lags are ``1..s``, late ``s+1..L_w`` with ``s = early_late_split`` (default
    ``L_w // 2``)."""
    t = Table(doc_ids)
    half = obs_window // 2 if early_late_split is None else int(early_late_split)
    if not 0 < half < obs_window:
        raise ValueError(
            f"the early/late split must be a lag in 1..{obs_window - 1} (the window has "
            f"{obs_window} lags), got {half}"
        )
    for pol in policies:
        us = [u[pol] for u in units]
        for name in SCALARS:
            t.cols[f"{pol}|{name}"] = np.array([u.values[name] for u in us])
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


def _pooled_median(g: Getter, policy: str, horizon: int) -> np.ndarray:
    """Smallest t with P(tau <= t | tau <= T) >= 1/2 under the pooled (document-averaged)
    divergence-time law; NaN if nothing diverges."""
    pmf = np.stack([np.asarray(g(f"{policy}|pmf|{t}"), float) for t in range(1, horizon + 1)])
    cum = np.cumsum(pmf, axis=0)
    total = cum[-1]
    first = np.argmax(2.0 * cum >= total * (1 - 1e-12), axis=0) + 1.0
    return np.where(total > 0, first, np.nan)


def quantity_range(name: str, horizon: int) -> tuple[float, float]:
    """The values a quantity can take: its CI is clipped to them (an interval end extrapolated
    beyond the replicates, or a BCa end, can otherwise leave the parameter space)."""
    T = float(horizon)
    if name in ("occupation", "expected_mismatches", "window_contribution", "rmst"):
        return 0.0, T
    if name in ("tail_contribution", "tail_exposure"):
        return 0.0, T
    if name in ("mean_tau", "median_tau"):
        return 1.0, T
    if name == "first_mismatch":
        return 0.0, 1.0 / T
    if name == "late_minus_early_tv":
        return -1.0, 1.0
    return 0.0, 1.0  # probabilities, fractions of T, rates and TVs


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
        "median_tau": lambda g: _pooled_median(g, policy, horizon),
        # E[min(tau, T)] = T - E[(T - tau)+]: the survival curve summed over t = 0..T-1.
        "rmst": lambda g: T - m(g, "occupation"),
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
        out[("survival", t)] = _column(f"{policy}|S|{t}")
    for t in range(1, horizon + 1):
        out[("pmf", t)] = _column(f"{policy}|pmf|{t}")
        out[("hazard", t)] = _column_ratio(f"{policy}|pmf|{t}", f"{policy}|S|{t - 1}")
    for lag in range(lags):
        out[("branch_tv", lag)] = _column_ratio(f"{policy}|tvn|{lag}", f"{policy}|tvd|{lag}")
    return out


def _column(name: str) -> StatFn:
    """The mean of one column."""
    return lambda g: g(name)


def _column_ratio(num: str, den: str) -> StatFn:
    """The ratio of two column means (NaN where the denominator is not positive)."""
    return lambda g: _ratio(g(num), g(den))


def _prefixed(g: Getter, prefix: str) -> Getter:
    """``g`` reading the columns named ``prefix + name``."""
    return lambda c: g(prefix + c)


def _average(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """The equally weighted mean of ``arrays``, summed in order."""
    total = arrays[0]
    for a in arrays[1:]:
        total = total + a
    return total / len(arrays)


def difference(fa: StatFn, fb: StatFn) -> StatFn:
    """The paired difference ``fb - fa`` of two statistics."""
    return lambda g: fb(g) - fa(g)


def _gap_parts(g: Getter, p: str, T: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    f = g(f"{p}|occurrence") / T
    e = g(f"{p}|occupation") / T
    return f, e, _ratio(g(f"{p}|post_mismatches"), g(f"{p}|occupation"))


def _gap_terms(g: Getter, a: str, b: str, T: float) -> dict[str, np.ndarray]:
    fa, ea, ra = _gap_parts(g, a, T)
    fb, eb, rb = _gap_parts(g, b, T)
    return {
        "gap": (fb + eb * rb) - (fa + ea * ra),
        "delta_first_mismatch": fb - fa,
        "exposure_term": 0.5 * (ra + rb) * (eb - ea),
        "rate_term": 0.5 * (ea + eb) * (rb - ra),
    }


def gap_fns(a: str, b: str, horizon: int) -> dict[str, StatFn]:
    """Gap attribution m_B - m_A = df + rho_bar de + e_bar drho (SPEC section 3)."""
    return pooled_gap_fns(a, b, [("", horizon)])


def pooled_gap_fns(a: str, b: str, models: Sequence[tuple[str, int]]) -> dict[str, StatFn]:
    """Gap terms averaged over models ``(column prefix, horizon)`` with equal weights; the
    exposure share is the pooled exposure term over the pooled gap."""

    def terms(g: Getter) -> dict[str, np.ndarray]:
        per = [_gap_terms(_prefixed(g, pre), a, b, float(T)) for pre, T in models]
        out = {k: _average([x[k] for x in per]) for k in GAP_TERMS[:-1]}
        out["exposure_share"] = _signed_ratio(out["exposure_term"], out["gap"])
        return out

    def term(name: str) -> StatFn:
        return lambda g: terms(g)[name]

    return {name: term(name) for name in GAP_TERMS}


def policy_pairs(policies: list[str], reference: str | None) -> list[tuple[str, str]]:
    """(a, b) pairs compared as b - a: every pair in store order, or each policy against the
    reference."""
    if reference is None:
        return list(combinations(policies, 2))
    if reference not in policies:
        raise ValueError(
            f"the reference policy {reference!r} is not among the policies: {', '.join(policies)}"
        )
    return [(reference, p) for p in policies if p != reference]


def normal_scores(level: float, method: str, n_docs: int) -> tuple[float, float]:
    """The normal scores of the two interval ends at ``level``; ``expanded-bca`` widens them
    to ``sqrt(n/(n-1)) t_{n-1}``."""
    from scipy import stats as sps

    if method not in CI_METHODS:
        raise ValueError(f"ci_method must be one of {CI_METHODS}, got {method!r}")
    upper = 1.0 - (1.0 - level) / 2.0
    if method == "expanded-bca" and n_docs >= 2:
        z = math.sqrt(n_docs / (n_docs - 1)) * float(sps.t.ppf(upper, n_docs - 1))
    else:
        z = float(sps.norm.ppf(upper))
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

    def __post_init__(self) -> None:
        self._index = {n: i for i, n in enumerate(self.names)}

    def at_level(self, level: float) -> Bootstrap:
        return replace(self, level=level)

    def evaluate(self, fn: StatFn, discrete: bool = False) -> Estimate:
        return self.evaluate_many([fn], [discrete])[0]

    def evaluate_many(
        self, fns: Sequence[StatFn], discrete: Sequence[bool] | None = None
    ) -> list[Estimate]:
        """Point estimates and CIs of many statistics (one Rust call per interval method)."""
        from kvcouple import _core

        if not fns:
            return []
        discrete = list(discrete) if discrete is not None else [False] * len(fns)
        point = np.array([float(np.asarray(f(lambda c: self.point[self._index[c]]))) for f in fns])
        boot = np.column_stack(
            [
                np.broadcast_to(
                    np.asarray(f(lambda c: self.reps[:, self._index[c]]), np.float64),
                    (self.reps.shape[0],),
                )
                for f in fns
            ]
        )
        bca = self.method != "percentile"
        if bca:
            if self.jack is None:
                raise ValueError("BCa intervals need the jackknife (bootstrap_table makes it)")
            jack_reps = self.jack
            jack = np.column_stack(
                [
                    np.broadcast_to(
                        np.asarray(f(lambda c: jack_reps[:, self._index[c]]), np.float64),
                        (jack_reps.shape[0],),
                    )
                    for f in fns
                ]
            )
        out: list[Estimate | None] = [None] * len(fns)
        groups = [
            (self.method, [i for i, d in enumerate(discrete) if not d]),
            ("percentile", [i for i, d in enumerate(discrete) if d]),
        ]
        for method, idx in groups:
            if not idx:
                continue
            zl, zu = normal_scores(self.level, method, self.n_docs)
            use_bca = bca and method != "percentile"
            rows = _core.bootstrap_intervals(
                np.ascontiguousarray(boot[:, idx]),
                np.ascontiguousarray(point[idx]),
                np.ascontiguousarray(jack[:, idx]) if use_bca else np.zeros((0, len(idx))),
                zl,
                zu,
                use_bca,
            )
            for j, i in enumerate(idx):
                lo, hi, z0, a = rows[j]
                out[i] = Estimate(
                    float(point[i]),
                    float(lo),
                    float(hi),
                    boot[:, i],
                    float(z0) if use_bca else 0.0,
                    float(a) if use_bca else 0.0,
                    method,
                )
        return [e for e in out if e is not None]

    def p_value(self, est: Estimate, direction: str, value: float = 0.0) -> float:
        """The bootstrap p-value matching ``est``'s interval method (see
        :func:`bootstrap_p_value`)."""
        return bootstrap_p_value(
            est.boot,
            direction,
            value,
            z0=est.z0,
            accel=est.accel,
            n_docs=self.n_docs if est.method == "expanded-bca" else None,
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
    reps = _core.bootstrap_means(np.ascontiguousarray(mat, np.float64), int(n_boot), int(seed))
    jack = jackknife_means(mat) if method != "percentile" and mat.shape[0] >= 2 else None
    if jack is None and method != "percentile":
        method = "percentile"  # one document: no jackknife
    return Bootstrap(names, point, reps, level, len(table.doc_ids), jack, method)


def survival_band(bs: Bootstrap, a: str, b: str, horizon: int) -> list[dict[str, Any]]:
    """Paired survival difference ``S^b_t - S^a_t`` (t = 1..T) with pointwise CIs and a
    simultaneous band: ``D_t +- c sd_t`` with ``c`` the ``level`` quantile over replicates of
    ``max_t |D*_t - D_t| / sd_t`` (a sup-t band: it covers the whole curve at once), widened
    like the pointwise intervals by ``sqrt(n/(n-1)) t_{n-1} / z`` under ``expanded-bca``."""
    fns = [(lambda g, t=t: g(f"{b}|S|{t}") - g(f"{a}|S|{t}")) for t in range(1, horizon + 1)]
    ests = bs.evaluate_many(fns)
    boot = np.column_stack([e.boot for e in ests])
    point = np.array([e.estimate for e in ests])
    with np.errstate(invalid="ignore"):
        sd = np.nanstd(boot, axis=0, ddof=1)
    varying = np.isfinite(sd) & (sd > 0)
    if varying.any():
        dev = np.abs(boot[:, varying] - point[varying]) / sd[varying]
        c = float(np.quantile(np.nanmax(dev, axis=1), bs.level))
    else:
        c = 0.0
    if bs.method == "expanded-bca":
        # The same small-sample expansion as the pointwise intervals (t_{n-1} over normal).
        c *= (
            normal_scores(bs.level, "expanded-bca", bs.n_docs)[1]
            / normal_scores(bs.level, "percentile", bs.n_docs)[1]
        )
    half = np.where(varying, c * np.nan_to_num(sd), 0.0)
    return [
        {
            "policy_a": a,
            "policy_b": b,
            "step": t,
            "difference": e.estimate,
            "ci_low": e.ci_low,
            "ci_high": e.ci_high,
            "band_low": e.estimate - h,
            "band_high": e.estimate + h,
            "band_critical_value": c,
        }
        for t, e, h in zip(range(1, horizon + 1), ests, half, strict=True)
    ]


def gap_rows(bs: Bootstrap, fns: dict[str, StatFn], base: dict[str, Any]) -> list[dict[str, Any]]:
    """Gap attribution rows; the exposure share is flagged when the gap's CI includes 0."""
    # The share is a ratio whose denominator can be near 0: its jackknife acceleration is
    # unstable (BCa covered 0.68 in the coverage study), so it gets a percentile interval.
    flags = [t in PERCENTILE_TERMS for t in fns]
    ests = dict(zip(fns, bs.evaluate_many(list(fns.values()), flags), strict=True))
    gap = ests["gap"]
    gap_clear = (
        math.isfinite(gap.ci_low)
        and math.isfinite(gap.ci_high)
        and not gap.ci_low <= 0 <= gap.ci_high
    )
    rows = []
    for term, e in ests.items():
        ok = gap_clear or term != "exposure_share"
        rows.append(
            {
                **base,
                "term": term,
                "estimate": e.estimate,
                "ci_low": e.ci_low,
                "ci_high": e.ci_high,
                "interpretable": ok,
                "note": "" if ok else NOT_INTERPRETABLE,
            }
        )
    return rows


def summarise(
    bs: Bootstrap,
    policies: list[str],
    horizon: int,
    lags: int,
    reference: str | None = None,
) -> dict[str, list[dict[str, Any]]]:
    """The tidy rows of every table: summary, curves, differences, gap attribution, survival
    differences."""
    summary, curves, diffs, gaps, surv = [], [], [], [], []
    for pol in policies:
        names = list(QUANTITIES)
        ests = bs.evaluate_many(
            [quantity_fn(pol, n, horizon) for n in names], [n in DISCRETE for n in names]
        )
        for name, e in zip(names, ests, strict=True):
            lo, hi = quantity_range(name, horizon)
            # A Monte Carlo estimate may itself lie outside (e.g. rho a little above 1).
            if e.estimate == e.estimate:
                lo, hi = min(lo, e.estimate), max(hi, e.estimate)
            summary.append(
                {
                    "policy": pol,
                    "quantity": name,
                    "estimate": e.estimate,
                    "ci_low": min(max(e.ci_low, lo), hi),
                    "ci_high": max(min(e.ci_high, hi), lo),
                    "n_docs": bs.n_docs,
                }
            )
        cfns = curve_fns(pol, horizon, lags)
        for (curve, x), e in zip(cfns, bs.evaluate_many(list(cfns.values())), strict=True):
            curves.append(
                {
                    "policy": pol,
                    "curve": curve,
                    "x": x,
                    "estimate": e.estimate,
                    "ci_low": e.ci_low,
                    "ci_high": e.ci_high,
                }
            )
    for a, b in policy_pairs(policies, reference):
        names = list(QUANTITIES)
        fns: list[StatFn] = []
        for name in names:
            fa, fb = quantity_fn(a, name, horizon), quantity_fn(b, name, horizon)
            fns.append(difference(fa, fb))
        for name, e in zip(
            names, bs.evaluate_many(fns, [n in DISCRETE for n in names]), strict=True
        ):
            diffs.append(
                {
                    "policy_a": a,
                    "policy_b": b,
                    "quantity": name,
                    "difference": e.estimate,
                    "ci_low": e.ci_low,
                    "ci_high": e.ci_high,
                }
            )
        gaps += gap_rows(bs, gap_fns(a, b, horizon), {"policy_a": a, "policy_b": b})
        surv += survival_band(bs, a, b, horizon)
    return {
        "summary": summary,
        "curves": curves,
        "differences": diffs,
        "gap_attribution": gaps,
        "survival_differences": surv,
    }


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
    from scipy import stats as sps

    b = boot[np.isfinite(boot)]
    if b.size == 0:
        return float("nan")
    le = (1 + np.sum(b <= value)) / (b.size + 1)
    ge = (1 + np.sum(b >= value)) / (b.size + 1)
    sd = float(np.std(b, ddof=1)) if b.size > 1 else 0.0
    if sd > 0 and not b.min() <= value <= b.max():
        # Beyond every replicate the intervals extrapolate their ends by the normal tail (never
        # inside the replicates): the matching position of ``value`` is the smaller of the two.
        below = float(sps.norm.cdf((value - b.mean()) / sd))
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
        u = float(sps.norm.ppf(frac)) - z0
        w = u / (1.0 + accel * u) if 1.0 + accel * u > 0 else math.copysign(math.inf, u)
        z = w - z0
        if n_docs is not None and n_docs >= 2:
            return float(sps.t.cdf(z / math.sqrt(n_docs / (n_docs - 1)), n_docs - 1))
        return float(sps.norm.cdf(z))

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
