"""Across-document statistics: means with document-level bootstrap CIs, paired policy
differences, gap attribution (SPEC section 3), early-vs-late window TV, survival comparisons,
curves.

Every reported statistic is a function of column means of one per-document table (ratios such
as the aggregate rho = mean(post) / mean(occupation) are ratios of means, as SPEC section 3
asks, so the decomposition holds exactly in aggregate). One bootstrap of documents (in Rust,
seeded, independent of thread count) resamples every column at once, so every statistic,
difference and attribution term gets its CI from the same resampled documents and paired
comparisons stay paired.

The bootstrap itself is in :mod:`kvcouple.analysis.bootstrap`, its intervals in
:mod:`kvcouple.analysis.intervals` and :mod:`kvcouple.analysis.studentized`, p-values in
:mod:`kvcouple.analysis.pvalues`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from itertools import combinations
from typing import Any

import numpy as np

from kvcouple import decomposition as dc
from kvcouple.analysis import quantities
from kvcouple.analysis.bootstrap import (
    STUDENTIZED_MIN_DOCS,
    UNBOUNDED,
    Bootstrap,
    Estimate,
    Getter,
    Scale,
    StatFn,
    normal_scores,
)
from kvcouple.analysis.distributions import sorted_quantile
from kvcouple.analysis.intervals import Statistic
from kvcouple.analysis.studentized import studentized_estimate, sup_t_band
from kvcouple.deprecation import module_getattr, moved_getattr

__all__ = [
    "INVERTED_SUMMARY",
    "GAP_TERMS",
    "NOT_INTERPRETABLE",
    "PERCENTILE_TERMS",
    "SUMMARY_DEFINITIONS",
    "curve_fns",
    "difference",
    "difference_estimates",
    "gap_estimates",
    "gap_fns",
    "gap_rows",
    "pmf_columns",
    "policy_pairs",
    "pooled_gap_fns",
    "quantity_fn",
    "quantity_range",
    "quantity_scale",
    "summarise",
    "survival_band",
]

# Quantities reported per policy: name -> definition (with the unit), from the registry.
SUMMARY_DEFINITIONS: dict[str, str] = {
    q.name: f"{q.definition} ({q.unit})" for q in quantities.SUMMARY
}
# QUANTITIES named both this map and the registry (kvcouple.analysis.quantities.QUANTITIES).
# Former names: renamed, or read from where they live now (the bootstrap's), for one release.
_MOVED = {
    **dict.fromkeys(("CI_METHODS", "DEFAULT_CI_METHOD"), "kvcouple.analysis.intervals"),
    **dict.fromkeys(
        ("bootstrap_p_value", "holm", "studentized_p_value"), "kvcouple.analysis.pvalues"
    ),
    **dict.fromkeys(("bootstrap_table", "jackknife_means"), "kvcouple.analysis.bootstrap"),
    "Table": "kvcouple.analysis.estimates",
    "build_table": "kvcouple.analysis.units",
}
__getattr__ = moved_getattr(
    __name__,
    _MOVED,
    module_getattr(
        __name__,
        {"QUANTITIES": "SUMMARY_DEFINITIONS", "DISCRETE": "INVERTED_SUMMARY"},
        globals(),
    ),
)
# The registry says each quantity's interval: the median step and the gap terms that are
# ratios get a test-inversion set when studentized (percentile intervals under other methods),
# and so does a paired difference of median steps (the analysis's method under the others).
INVERTED_SUMMARY = tuple(q.name for q in quantities.SUMMARY if q.interval == "test-inversion")
PERCENTILE_TERMS = tuple(q.name for q in quantities.GAP if q.interval == "test-inversion")
GAP_TERMS = ("gap", "delta_first_mismatch", "exposure_term", "rate_term", "exposure_share")
NOT_INTERPRETABLE = "not interpretable: the gap's CI includes 0"
CONSTANT = "constant over the documents: the interval is the point"
OUTSIDE = (
    "the Monte Carlo estimate lies outside the quantity's range (a ratio of estimates, with too "
    "few documents or replicates): its interval is made on the plain scale, not inside the range"
)
NEVER_DIVERGES = "undefined: nothing diverged (occurrence 0 in every document)"
TAIL_UNOBSERVED = "unobserved: branches were traced for L < T - 1 lags"
UNDEFINED = "undefined: its denominator is 0 in every document"
NO_INTERVAL = "no interval: too few resamples define the statistic"
# Quantities that condition on a divergence (undefined when nothing diverges).
AFTER_DIVERGENCE = ("rho", "mean_tau", "median_tau", "early_tv", "late_tv", "late_minus_early_tv")
# Quantities that need the branches traced to the horizon.
NEED_TAIL = ("expected_mismatches", "mismatch_fraction", "rho", "tail_contribution")


def quantity_range(name: str, horizon: int) -> tuple[float, float]:
    """The values a quantity can take (the registry's range)."""
    return quantities.quantity(name).value_range(horizon)


def quantity_scale(name: str, horizon: int, paired: bool = False) -> Scale:
    """The scale of the quantity's interval (of its paired difference with ``paired``): the
    logit of its position in the registry's range where that range is finite, so that every
    interval lies inside it by construction; the identity otherwise."""
    q = quantities.quantity(name)
    low, high = q.difference_range(horizon) if paired else q.value_range(horizon)
    return Scale(low, high) if math.isfinite(low) and math.isfinite(high) else UNBOUNDED


def quantity_fn(policy: str, name: str, horizon: int) -> StatFn:
    """The statistic ``name`` of ``policy`` as a function of column means: the registry's
    formula (:attr:`kvcouple.analysis.quantities.Quantity.formula`) on the policy's columns."""
    q = quantities.quantity(name)
    formula, derivatives = q.formula, q.derivatives
    if formula is None:
        raise KeyError(f"{name!r} has no formula in the registry (kvcouple.analysis.quantities)")
    T = float(horizon)
    prefix = f"{policy}|"

    def value(g: Getter) -> np.ndarray:
        return formula(_prefixed(g, prefix), T)

    if derivatives is None:
        return value

    def by_column(g: Getter) -> dict[str, np.ndarray]:
        return {prefix + c: d for c, d in derivatives(_prefixed(g, prefix), T).items()}

    return Statistic(value, by_column)


def pmf_columns(policy: str, horizon: int) -> list[str]:
    """The table's columns of ``policy``'s ``P(tau = t)``, t = 1..T (the median step's law)."""
    return [f"{policy}|pmf|{t}" for t in range(1, horizon + 1)]


def summary_estimates(
    bs: Bootstrap, policy: str, names: Sequence[str], horizon: int
) -> list[Estimate]:
    """The estimates of the per-policy quantities ``names``, each with the interval the
    registry names: the analysis's method on the quantity's scale; the median step, when
    studentized, by inverting the test of its CDF (:meth:`Bootstrap.median_step`), a
    percentile interval under the other methods."""
    inverted = [n in INVERTED_SUMMARY for n in names]
    scales = [quantity_scale(n, horizon) for n in names]
    ests = bs.evaluate_many([quantity_fn(policy, n, horizon) for n in names], inverted, scales)
    if bs.method == "studentized" and "median_tau" in names:
        i = list(names).index("median_tau")
        median = bs.median_step(pmf_columns(policy, horizon))
        if median is not None:
            ests[i] = replace(median, scale=scales[i])
    return ests


def difference_estimates(
    bs: Bootstrap, a: str, b: str, names: Sequence[str], horizon: int
) -> list[Estimate]:
    """The paired differences ``b - a`` of the per-policy quantities ``names``: the
    analysis's method on the difference's scale; the median step's, when studentized, by
    inverting the test of ``F_b(x + delta) = F_a(x)`` (:meth:`Bootstrap.median_difference`;
    the delta method's interval of the difference covered 0.902 in the coverage study's
    ``saturated``, docs/statistics.md)."""
    fns = [difference(quantity_fn(a, n, horizon), quantity_fn(b, n, horizon)) for n in names]
    scales = [quantity_scale(n, horizon, paired=True) for n in names]
    ests = bs.evaluate_many(fns, None, scales)
    if bs.method == "studentized" and "median_tau" in names:
        i = list(names).index("median_tau")
        median = bs.median_difference(pmf_columns(a, horizon), pmf_columns(b, horizon))
        if median is not None:
            ests[i] = replace(median, scale=scales[i])
    return ests


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


def _column(name: str) -> Statistic:
    """The mean of one column (its derivative 1: no central differences, which cost two
    evaluations per resample for each of a curve's points)."""
    return Statistic(lambda g: g(name), lambda g: {name: np.ones(())})


def _column_ratio(num: str, den: str) -> Statistic:
    """The ratio of two column means (NaN where the denominator is not positive), with its
    derivatives ``1 / d`` and ``-n / d**2`` (NaN where it is undefined, as its value)."""

    def derivatives(g: Getter) -> dict[str, np.ndarray]:
        inverse = dc.ratio(1.0, g(den))
        return {num: inverse, den: -g(num) * inverse * inverse}

    return Statistic(lambda g: dc.ratio(g(num), g(den)), derivatives)


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
    """The paired difference ``fb - fa`` of two statistics (a
    :class:`~kvcouple.analysis.intervals.Statistic` where both know their derivatives)."""

    def value(g: Getter) -> np.ndarray:
        return fb(g) - fa(g)

    if not (isinstance(fa, Statistic) and isinstance(fb, Statistic)):
        return value

    def derivatives(g: Getter) -> dict[str, np.ndarray]:
        out = dict(fb.derivatives(g))
        for c, d in fa.derivatives(g).items():
            out[c] = out[c] - d if c in out else -d
        return out

    return Statistic(value, derivatives)


def _gap_parts(g: Getter, p: str, T: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    f = dc.first_mismatch(g(f"{p}|occurrence"), T)
    e = dc.exposure(g(f"{p}|occupation"), T)
    return f, e, dc.rho(g(f"{p}|post_mismatches"), g(f"{p}|occupation"))


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
        out["exposure_share"] = dc.signed_ratio(out["exposure_term"], out["gap"])
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


def survival_band(bs: Bootstrap, a: str, b: str, horizon: int) -> list[dict[str, Any]]:
    """Paired survival difference ``S^b_t - S^a_t`` (t = 1..T) with pointwise CIs and a
    simultaneous band, both inside [-1, 1], made on the difference's scale ``psi`` (the logit
    of ``(D + 1) / 2``). ``studentized`` (the default): a studentized sup-t band,
    ``psi_t -+ c se_psi_t`` with ``c`` the ``level`` quantile over resamples of
    ``max_t |t*_t|`` (:func:`kvcouple.analysis.studentized.sup_t_band`). Other methods: ``c``
    the quantile of ``max_t |psi*_t - psi_t| / sd_t`` (``sd_t`` the replicates' standard
    deviation), widened by ``sqrt(n/(n-1)) t_{n-1} / z`` under ``expanded-bca``. Either band
    covers the whole curve at once."""
    fns = [(lambda g, t=t: g(f"{b}|S|{t}") - g(f"{a}|S|{t}")) for t in range(1, horizon + 1)]
    scale = Scale(-1.0, 1.0)  # a difference of probabilities: the band is made on its scale
    if bs.method == "studentized":
        point, boot, se, se_boot = bs.studentized_parts(fns)
        ests = [
            studentized_estimate(point[i], boot[:, i], se[i], se_boot[:, i], bs.level, scale)
            for i in range(len(fns))
        ]
        lows, highs, c = sup_t_band(point, boot, se, se_boot, bs.level, scale)
    else:
        ests = bs.evaluate_many(fns, scales=[scale] * len(fns))
        lows, highs, c = _replicate_band(bs, ests, scale)
    return [
        {
            "policy_a": a,
            "policy_b": b,
            "step": t,
            "difference": e.estimate,
            "ci_low": e.ci_low,
            "ci_high": e.ci_high,
            "band_low": float(lo),
            "band_high": float(hi),
            "band_critical_value": c,
        }
        for t, e, lo, hi in zip(range(1, horizon + 1), ests, lows, highs, strict=True)
    ]


def _replicate_band(
    bs: Bootstrap, ests: list[Estimate], scale: Scale
) -> tuple[np.ndarray, np.ndarray, float]:
    """The band of the percentile and BCa methods: a sup-t band over the replicates' standard
    deviations on ``scale`` (not studentized), widened under ``expanded-bca``."""
    point = scale.forward(np.array([e.estimate for e in ests]))
    with np.errstate(invalid="ignore"):
        boot = scale.forward(np.column_stack([e.boot for e in ests]))
        finite = np.where(np.isfinite(boot), boot, np.nan)
        sd = np.nanstd(finite, axis=0, ddof=1)
    varying = np.isfinite(sd) & (sd > 0) & np.isfinite(point)
    if varying.any():
        # A replicate at +-1 (every drawn document at an end) lies beyond any band: inf.
        with np.errstate(invalid="ignore"):
            dev = np.abs(boot[:, varying] - point[varying]) / sd[varying]
        c = sorted_quantile(
            np.sort(np.nanmax(np.where(np.isnan(dev), -np.inf, dev), axis=1)), bs.level
        )
    else:
        c = 0.0
    if bs.method == "expanded-bca":
        # The same small-sample expansion as the pointwise intervals (t_{n-1} over normal).
        c *= (
            normal_scores(bs.level, "expanded-bca", bs.n_docs)[1]
            / normal_scores(bs.level, "percentile", bs.n_docs)[1]
        )
    with np.errstate(invalid="ignore"):  # c may be infinite where sd is 0
        half = np.where(varying, c * np.nan_to_num(sd), 0.0)
        lows = np.where(varying, scale.back(point - half), [e.estimate for e in ests])
        highs = np.where(varying, scale.back(point + half), [e.estimate for e in ests])
    return lows, highs, c


def gap_scales(horizon: int) -> dict[str, Scale]:
    """Each gap term's scale (the registry's range; pooled rows: their shortest horizon)."""
    return {t: quantity_scale(t, horizon) for t in GAP_TERMS}


def gap_estimates(
    bs: Bootstrap, fns: dict[str, StatFn], scales: dict[str, Scale] | None = None
) -> dict[str, Estimate]:
    """Estimates of the gap terms ``fns`` (from :func:`gap_fns`). The exposure share is a ratio
    whose denominator can be near 0: studentized, it gets the test-inversion set of
    :meth:`Bootstrap.ratio`; otherwise a percentile interval (its jackknife acceleration is
    unstable: BCa covered 0.68 in the coverage study)."""
    scales = scales or {}
    flags = [t in PERCENTILE_TERMS for t in fns]
    if bs.method != "studentized":
        sc = [scales.get(t, UNBOUNDED) for t in fns]
        return dict(zip(fns, bs.evaluate_many(list(fns.values()), flags, sc), strict=True))
    linear = [t for t in fns if t not in PERCENTILE_TERMS]
    sc = [scales.get(t, UNBOUNDED) for t in linear]
    ests = dict(zip(linear, bs.evaluate_many([fns[t] for t in linear], None, sc), strict=True))
    if "exposure_share" in fns:
        ests["exposure_share"] = bs.ratio(fns["exposure_term"], fns["gap"])
    return {t: ests[t] for t in fns}


def gap_rows(
    bs: Bootstrap,
    fns: dict[str, StatFn],
    base: dict[str, Any],
    scales: dict[str, Scale] | None = None,
) -> list[dict[str, Any]]:
    """Gap attribution rows; the exposure share is flagged when the gap's CI includes 0."""
    ests = gap_estimates(bs, fns, scales)
    gap = ests["gap"]
    gap_clear = (
        math.isfinite(gap.ci_low)
        and math.isfinite(gap.ci_high)
        and not gap.ci_low <= 0 <= gap.ci_high
    )
    rows = []
    for term, e in ests.items():
        ok = gap_clear or term != "exposure_share"
        note = "" if ok else NOT_INTERPRETABLE
        rows.append(
            {
                **base,
                "term": term,
                "estimate": e.estimate,
                "ci_low": e.ci_low,
                "ci_high": e.ci_high,
                "interpretable": ok,
                "note": note or _note(e),
            }
        )
    return rows


def _note(e: Estimate, reason: str = UNDEFINED, scale: Scale | None = None) -> str:
    """Why a row's interval is a point or absent, or not inside its range ``scale`` ("" when
    it is an interval inside it)."""
    if e.constant:
        return CONSTANT
    if not math.isfinite(e.estimate):
        return reason
    if scale is not None and scale.bounded and not scale.low <= e.estimate <= scale.high:
        return OUTSIDE
    if not (math.isfinite(e.ci_low) or math.isfinite(e.ci_high)) and e.exclude is None:
        return "" if e.ci_low == -math.inf else NO_INTERVAL
    return ""


def _undefined_reason(bs: Bootstrap, policy: str, name: str) -> str:
    """Why ``name`` of ``policy`` has no estimate: nothing diverged, or the tail is unseen."""
    col = {c: i for i, c in enumerate(bs.names)}
    occurrence = bs.point[col[f"{policy}|occurrence"]]
    if name in AFTER_DIVERGENCE and occurrence == 0:
        return NEVER_DIVERGES
    if name in NEED_TAIL and not np.isfinite(bs.point[col[f"{policy}|expected_mismatches"]]):
        return TAIL_UNOBSERVED
    return UNDEFINED


def _positive_counts(bs: Bootstrap) -> np.ndarray | None:
    """Each column's number of documents with a positive entry (None without the table): the
    table's moments' where they were made (as the rows were read), else one pass over
    contiguous blocks of the table's rows (8 MB), every column at once."""
    if bs.data is None:
        return None
    if bs.moments is not None:
        return bs.moments.positive
    data = bs.data
    counts = np.zeros(data.shape[1], np.int64)
    step = max(1, (8 << 20) // (8 * max(data.shape[1], 1)))
    for start in range(0, data.shape[0], step):
        counts += np.count_nonzero(data[start : start + step] > 0, axis=0)
    return counts


def _curve_docs(
    bs: Bootstrap, policy: str, points: Sequence[tuple[str, int]], positive: np.ndarray | None
) -> list[int]:
    """Documents that inform each curve point: all for survival and pmf; for the hazard at t
    those not certainly diverged before t (S_{t-1} > 0); for branch TV at a lag those whose
    branches reached it (``positive``: :func:`_positive_counts`)."""
    out = [bs.n_docs] * len(points)
    if positive is None:
        return out
    index = {n: j for j, n in enumerate(bs.names)}
    for i, (curve, x) in enumerate(points):
        if curve not in ("survival", "pmf"):
            name = f"{policy}|S|{x - 1}" if curve == "hazard" else f"{policy}|tvd|{x}"
            out[i] = int(positive[index[name]])
    return out


def summarise(
    bs: Bootstrap,
    policies: list[str],
    horizon: int,
    lags: int,
    reference: str | None = None,
) -> dict[str, list[dict[str, Any]]]:
    """The tidy rows of every table: summary, curves, differences, gap attribution, survival
    differences. Every interval lies inside its quantity's range (each is made on its scale,
    :func:`quantity_scale`); ``note`` says why one is a point (constant over the documents) or
    absent (undefined, unobserved, too few documents)."""
    summary, curves, diffs, gaps, surv = [], [], [], [], []
    names = list(SUMMARY_DEFINITIONS)
    positive = _positive_counts(bs)
    for pol in policies:
        own = [quantity_scale(n, horizon) for n in names]
        ests = summary_estimates(bs, pol, names, horizon)
        for name, e, scale in zip(names, ests, own, strict=True):
            summary.append(
                {
                    "policy": pol,
                    "quantity": name,
                    "estimate": e.estimate,
                    "ci_low": e.ci_low,
                    "ci_high": e.ci_high,
                    "n_docs": bs.n_docs,
                    "note": _note(e, _undefined_reason(bs, pol, name), scale),
                }
            )
        curves += _curve_rows(bs, pol, horizon, lags, positive)
    for a, b in policy_pairs(policies, reference):
        for name, e in zip(names, difference_estimates(bs, a, b, names, horizon), strict=True):
            reasons = {_undefined_reason(bs, p, name) for p in (a, b)} - {UNDEFINED}
            diffs.append(
                {
                    "policy_a": a,
                    "policy_b": b,
                    "quantity": name,
                    "difference": e.estimate,
                    "ci_low": e.ci_low,
                    "ci_high": e.ci_high,
                    "note": _note(e, " / ".join(sorted(reasons)) or UNDEFINED),
                }
            )
        gaps += gap_rows(
            bs, gap_fns(a, b, horizon), {"policy_a": a, "policy_b": b}, gap_scales(horizon)
        )
        surv += survival_band(bs, a, b, horizon)
    return {
        "summary": summary,
        "curves": curves,
        "differences": diffs,
        "gap_attribution": gaps,
        "survival_differences": surv,
    }


def _curve_rows(
    bs: Bootstrap, pol: str, horizon: int, lags: int, positive: np.ndarray | None
) -> list[dict[str, Any]]:
    """One policy's curves with pointwise bands inside [0, 1]; a point informed by fewer than
    :data:`STUDENTIZED_MIN_DOCS` documents gets no band (NaN, and a note saying so)."""
    cfns = curve_fns(pol, horizon, lags)
    scales = [quantity_scale(curve, horizon) for curve, _ in cfns]
    rows = []
    informed = _curve_docs(bs, pol, list(cfns), positive)
    for (curve, x), e, docs in zip(
        cfns, bs.evaluate_many(list(cfns.values()), None, scales), informed, strict=True
    ):
        lo, hi, note = e.ci_low, e.ci_high, _note(e)
        if docs < min(STUDENTIZED_MIN_DOCS, bs.n_docs) and not e.constant:
            lo = hi = math.nan
            note = f"too few documents ({docs}) at this point: no band"
        rows.append(
            {
                "policy": pol,
                "curve": curve,
                "x": x,
                "estimate": e.estimate,
                "ci_low": lo,
                "ci_high": hi,
                "n_docs": docs,
                "note": note,
            }
        )
    return rows
