"""The registry of quantities: one name, one unit, one label, one valid range and a one-line
definition for every number the analysis (and the synthetic tools) report.

The report, the console table, the CSV columns, the figures' axis labels and
docs/quantities.md are generated from :data:`QUANTITIES` and :data:`FIELDS`; a fraction of
the horizon T has its own name (``interval_lower`` counts tokens, ``interval_lower_fraction``
is the same end divided by T). Renamed public names live in :data:`DEPRECATED` for one
release. ``tests/analysis/test_quantities.py`` fails when a CSV column, report label or console row
names something not registered here, or when two names share a definition.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvcouple import decomposition as dc
from kvcouple.deprecation import RENAMED, warn_renamed

UNITS = {
    "tokens": "a count of generated tokens (0..T)",
    "fraction of T": "a count of tokens divided by the horizon T",
    "steps": "a step index 1..T",
    "probability": "a probability, or a total-variation distance (0..1)",
    "rate": "mismatches per token of exposure (0..1)",
    "ratio": "a ratio of two fractions of T (any real number)",
}

Bound = float | str  # a number, or "T" / "T+1/2" / "1/T" / "-1/T" / "-inf" / "inf" at the horizon

# How a quantity's interval is made (docs/statistics.md): "bootstrap" (the analysis's
# ci_method on the quantity's scale: the logit of its position in a finite range, so that the
# interval stays inside it; the identity for an unbounded one); "test-inversion" (studentized:
# the values at which the studentized test accepts, a percentile interval under the other
# methods; a ratio whose denominator may be near 0: Fieller's set, unbounded when the
# denominator is not clear of 0; the median step: the steps where the test of its CDF = 1/2
# accepts, and its paired difference the shifts where the test of F_b(x + delta) = F_a(x)
# accepts, analysis/median_shift.py).
INTERVALS = ("bootstrap", "test-inversion")

# A per-policy quantity as a function of the means of one policy's per-document columns
# (``columns(name)``: numbers, or arrays over bootstrap resamples) and the horizon T.
Columns = Callable[[str], Any]
Formula = Callable[[Columns, float], Any]
# A formula's derivatives with respect to the column means it reads, by column name (those
# not named: 0), where the delta method should not take central differences over them.
Derivatives = Callable[[Columns, float], dict[str, Any]]


@dataclass(frozen=True)
class Quantity:
    """One reported number: its name, unit, label (tables, console, axes), valid range and
    definition."""

    name: str
    unit: str
    label: str
    low: Bound
    high: Bound
    definition: str
    interval: str = "bootstrap"
    # How the analysis computes it from column means (per-policy quantities only).
    formula: Formula | None = None
    # Its derivatives in closed form, where central differences would cost too much.
    derivatives: Derivatives | None = None

    def value_range(self, horizon: int) -> tuple[float, float]:
        """The values the quantity can take at horizon ``T``."""
        return _resolve(self.low, horizon), _resolve(self.high, horizon)

    def difference_range(self, horizon: int) -> tuple[float, float]:
        """The values a paired difference ``b - a`` of the quantity can take."""
        low, high = self.value_range(horizon)
        return low - high, high - low


def _resolve(bound: Bound, horizon: int) -> float:
    if isinstance(bound, float | int):
        return float(bound)
    named = {
        "T": float(horizon),
        "T+1/2": horizon + 0.5,
        "1/T": 1.0 / horizon,
        "-1/T": -1.0 / horizon,
    }
    return named.get(bound, -float("inf") if bound == "-inf" else float("inf"))


def _q(
    name: str,
    unit: str,
    label: str,
    low: Bound,
    high: Bound,
    definition: str,
    interval: str = "bootstrap",
    formula: Formula | None = None,
    derivatives: Derivatives | None = None,
) -> Quantity:
    assert unit in UNITS and interval in INTERVALS, (unit, interval)
    return Quantity(name, unit, label, low, high, definition, interval, formula, derivatives)


def _mean(column: str) -> Formula:
    """The quantity is the mean of its own per-document column."""
    return lambda c, T: c(column)


def _pooled_pmf(c: Columns, T: float) -> np.ndarray:
    """The pooled law of tau, ``P(tau = t)`` for t = 1..T along the first axis."""
    return np.stack([np.asarray(c(f"pmf|{t}"), float) for t in range(1, int(T) + 1)])


def _pooled_median(c: Columns, T: float) -> Any:
    """The median step of the pooled (document-averaged) divergence-time law given tau <= T
    (:func:`kvcouple.decomposition.median_step`); NaN if nothing diverges."""
    return dc.median_step(_pooled_pmf(c, T))


def _pooled_median_derivatives(c: Columns, T: float) -> dict[str, Any]:
    """:func:`_pooled_median`'s derivatives by pmf column
    (:func:`kvcouple.decomposition.median_step_gradient`)."""
    grad = dc.median_step_gradient(_pooled_pmf(c, T))
    return {f"pmf|{t}": grad[t - 1] for t in range(1, int(T) + 1)}


def _window_tv(part: str) -> Formula:
    """The O-weighted branch TV over the early or late lags of the window."""
    return lambda c, T: dc.ratio(c(f"{part}n"), c(f"{part}d"))


# Per policy (summary.csv, differences.csv, plan metrics).
SUMMARY = (
    _q("occurrence", "probability", "occurrence P(tau<=T)", 0.0, 1.0,
       "P(tau <= T): the two coupled models emit different tokens within the horizon",
       formula=_mean("occurrence")),
    _q("occupation", "tokens", "occupation E[(T-tau)+]", 0.0, "T",
       "E[(T - tau)+]: tokens generated after the first divergence",
       formula=_mean("occupation")),
    _q("expected_mismatches", "tokens", "E[M]", 0.0, "T",
       "E[M]: the expected number of the T tokens that differ",
       formula=_mean("expected_mismatches")),
    _q("mismatch_fraction", "fraction of T", "E[M]/T", 0.0, 1.0,
       "E[M]/T: the expected fraction of the T tokens that differ",
       formula=lambda c, T: dc.mismatch_fraction(c("expected_mismatches"), T)),
    _q("first_mismatch", "fraction of T", "first mismatch P(tau<=T)/T", 0.0, "1/T",
       "P(tau <= T)/T: the first mismatch's share of E[M]/T",
       formula=lambda c, T: dc.first_mismatch(c("occurrence"), T)),
    _q("exposure", "fraction of T", "exposure E[(T-tau)+]/T", 0.0, 1.0,
       "E[(T - tau)+]/T: the share of the horizon left after the first divergence",
       formula=lambda c, T: dc.exposure(c("occupation"), T)),
    _q("rho", "rate", "mismatch rate rho", 0.0, 1.0,
       "post-divergence mismatches per token of exposure (ratio of document means)",
       formula=lambda c, T: dc.rho(c("post_mismatches"), c("occupation"))),
    _q("window_contribution", "tokens", "window mismatches", 0.0, "T",
       "E[mismatches at lags 1..L_w after tau]",
       formula=_mean("window_contribution")),
    _q("tail_contribution", "tokens", "tail mismatches", 0.0, "T",
       "E[mismatches at lags > L_w after tau]",
       formula=_mean("tail_contribution")),
    _q("tail_exposure", "tokens", "tail exposure", 0.0, "T",
       "E[(T - tau - L_w)+]: tokens beyond the observation window",
       formula=_mean("tail_exposure")),
    _q("interval_lower_fraction", "fraction of T", "sharp interval, lower end", 0.0, 1.0,
       "(occurrence + window_contribution)/T: the lower end of the sharp interval for E[M]/T",
       formula=lambda c, T: c("interval_lower") / T),
    _q("interval_upper_fraction", "fraction of T", "sharp interval, upper end", 0.0, 1.0,
       "(occurrence + window_contribution + tail_exposure)/T: its upper end",
       formula=lambda c, T: c("interval_upper") / T),
    _q("mean_tau", "steps", "mean divergence step", 1.0, "T",
       "E[tau | tau <= T]",
       formula=lambda c, T: dc.ratio(c("tau_mass"), c("occurrence"))),
    _q("median_tau", "steps", "median divergence step", 0.5, "T+1/2",
       "median of the pooled law of tau given tau <= T, step t spread over (t-1/2, t+1/2]",
       "test-inversion", formula=_pooled_median, derivatives=_pooled_median_derivatives),
    _q("rmst", "tokens", "restricted mean time to divergence", 0.0, "T",
       "E[min(tau, T)] = sum_{t<T} S_t",
       # E[min(tau, T)] = T - E[(T - tau)+]: the survival curve summed over t = 0..T-1.
       formula=lambda c, T: T - c("occupation")),
    _q("early_tv", "probability", "branch TV, early window", 0.0, 1.0,
       "branch-aligned TV at early lags 1..s of the window (O-weighted)",
       formula=_window_tv("early")),
    _q("late_tv", "probability", "branch TV, late window", 0.0, 1.0,
       "branch-aligned TV at late lags s+1..L_w of the window (O-weighted)",
       formula=_window_tv("late")),
    _q("late_minus_early_tv", "probability", "late - early branch TV", -1.0, 1.0,
       "late_tv - early_tv (paired within documents)",
       formula=lambda c, T: _window_tv("late")(c, T) - _window_tv("early")(c, T)),
)  # fmt: skip

# Per document only (per_document.csv; each also with a `_se` column: its Monte Carlo
# standard error, same unit), and the synthetic tools' token-valued interval ends.
PER_DOCUMENT = (
    _q("post_mismatches", "tokens", "post-divergence mismatches", 0.0, "T",
       "E[mismatches after tau]: window_contribution + tail_contribution"),
    _q("interval_lower", "tokens", "sharp interval for E[M], lower end", 0.0, "T",
       "occurrence + window_contribution: the lower end of the sharp interval for E[M]"),
    _q("interval_upper", "tokens", "sharp interval for E[M], upper end", 0.0, "T",
       "occurrence + window_contribution + tail_exposure: its upper end"),
    _q("tau_mass", "steps", "sum_t t P(tau = t)", 0.0, "T",
       "sum_t t P(tau = t): the numerator of E[tau | tau <= T]"),
)  # fmt: skip

# Gap attribution m_B - m_A = df + rho_bar de + e_bar drho (gap_attribution.csv, `term`).
GAP = (
    _q("gap", "fraction of T", "gap m_B - m_A", -1.0, 1.0,
       "mismatch_fraction of B minus that of A"),
    _q("delta_first_mismatch", "fraction of T", "df (first mismatch)", "-1/T", "1/T",
       "first_mismatch of B minus that of A"),
    _q("exposure_term", "fraction of T", "rho_bar de (exposure)", -1.0, 1.0,
       "mean rho of A and B times the exposure difference"),
    _q("rate_term", "fraction of T", "e_bar drho (rate)", -1.0, 1.0,
       "mean exposure of A and B times the rho difference"),
    _q("exposure_share", "ratio", "exposure share", "-inf", "inf",
       "exposure_term / gap: the part of the gap from diverging earlier or more often",
       "test-inversion"),
)  # fmt: skip

# Curves (curves.csv, `curve`; x is the step or the lag).
CURVES = (
    _q("survival", "probability", "S_t = P(tau > t)", 0.0, 1.0,
       "S_t = P(tau > t), t = 0..T"),
    _q("pmf", "probability", "P(tau = t)", 0.0, 1.0,
       "P(tau = t), t = 1..T"),
    _q("hazard", "probability", "P(tau = t | tau >= t)", 0.0, 1.0,
       "the discrete hazard P(tau = t | tau >= t), t = 1..T"),
    _q("branch_tv", "probability", "branch-aligned TV (O-weighted)", 0.0, 1.0,
       "branch-aligned TV at each lag after tau (O-weighted over documents)"),
)  # fmt: skip

QUANTITIES: dict[str, Quantity] = {q.name: q for q in (*SUMMARY, *PER_DOCUMENT, *GAP, *CURVES)}


# Table columns that are not quantities: identifiers, interval ends, test and check fields.
FIELDS: dict[str, str] = {
    "model": "the model (one store); 'pooled: A + B' for rows pooled across stores",
    "policy": "the policy's canonical spec",
    "policy_a": "the first policy of a pair (the reference under --reference)",
    "policy_b": "the second policy of a pair (differences are b - a)",
    "doc_id": "the document's id in the store",
    "quantity": "a registered quantity's name",
    "estimate": "the point estimate",
    "difference": "the paired difference b - a of the quantity",
    "ci_low": "the confidence interval's lower end (a confidence set's lower bound)",
    "ci_high": "the confidence interval's upper end",
    "n_docs": "documents in the bootstrap",
    "term": "a gap-attribution term's name",
    "interpretable": "false when the exposure share's gap CI includes 0",
    "note": "why a row is not interpretable, undefined, or its interval a point or absent",
    "curve": "a registered curve's name",
    "x": "the curve's step or lag",
    "step": "the step t",
    "band_low": "the simultaneous band's lower end",
    "band_high": "the simultaneous band's upper end",
    "band_critical_value": "the band's critical value c (D_t +- c sd_t)",
    "tail_observed": "whether branches were traced to the horizon",
    "plan_hash": "SHA-256 of the completed plan, or 'none'",
    "estimator": "the per-unit estimator: indicator or tv",
    "doc_set": "all, exploratory or confirmatory",
    "preregistration": "the preregistration stamp",
    "comparison": "the plan comparison's name",
    "metric": "the tested quantity",
    "value": "the tested value",
    "direction": "greater, less or two-sided",
    "ci_method": "the interval method used",
    "p_value": "the bootstrap p-value",
    "p_adjusted": "the p-value after the multiplicity correction",
    "correction": "holm, bonferroni or none",
    "alpha": "the tests' level",
    "reject_h0": "whether the adjusted p-value is below alpha",
    "store": "the trace store's path",
    "reason": "why a document was skipped",
    "where": "the recorded field a recompute check compares",
    "rep": "the replicate",
    "index": "the branch or row",
    "lag": "the lag after divergence",
    "recorded": "the value in the store",
    "recomputed": "the value recomputed from the stored distributions",
    "rows_checked": "distribution rows recomputed",
    "max_abs_diff": "the largest |recorded - recomputed|",
    "disagreements": "rows beyond the tolerance",
    "tolerance": "the recompute tolerance",
}

# The scoreboard in llama.cpp's layout (scoreboard.csv: `quantity` and `statistic`; the
# report's scoreboard), from the overlap path's records: kvcouple.analysis.scoreboard.
UNITS["nats"] = "a Kullback-Leibler divergence in nats (natural logarithm)"
SCOREBOARD = (
    _q("kl_pq", "nats", "KLD", 0.0, "inf",
       "sum_v p_t(v) log(p_t(v)/q_t(v)) at a step of the overlap path (both read one prefix)"),
    _q("delta_p", "probability", "delta p", -1.0, 1.0,
       "q_t(a) - p_t(a), a = argmax p_t: the change in P's top token's probability"),
    _q("same_top", "probability", "same top p", 0.0, 1.0,
       "the share of path steps where argmax p_t == argmax q_t"),
)  # fmt: skip
QUANTITIES.update({q.name: q for q in SCOREBOARD})
FIELDS.update(
    {
        "statistic": "mean (over documents), a percentile, max, min or rms (of the pooled steps)",
        "se": "the standard error of a mean over documents",
        "steps": "the path steps pooled",
        "relative_error": "a pooled percentile's relative resolution: 0 (exact) up to 2^22 "
        "pooled steps, beyond 2^-12 (a histogram of the steps' float32 values)",
    }
)

# How the scoreboard relates to llama-perplexity --kl-divergence (docs/quantities.md).
LLAMA_CPP = (
    "The scoreboard (`scoreboard.csv`, the report's scoreboard) lists per policy the numbers "
    "`llama-perplexity --kl-divergence` prints when it compares a model with a reference "
    "(here Q, the evicted cache, with P, the full cache), in its layout: Mean KLD with its "
    "uncertainty, Maximum / 99.9% / 99% / Median / 10% / 5% / 1% / 0.1% / Minimum KLD, Mean "
    "delta p, its percentiles and RMS, and Same top p. The steps are those of the overlap "
    "path, where P and Q read the same prefix: every one is before the first divergence, as in "
    "llama.cpp's teacher-forced comparison over one text.",
    "How they differ from llama.cpp's: (1) the text both sides read is the overlap path, "
    "generated from the two models' common part, not a fixed corpus; (2) the mean's "
    "uncertainty (`se`) is across documents (each document's mean over its steps, then the "
    "mean of the documents and its standard error), as every kvcouple interval, where llama.cpp "
    "treats tokens as independent, so kvcouple's is wider where documents differ; the "
    "percentiles pool every step of every document, as llama.cpp's; (3) delta p is the change "
    "in the probability of P's top token, `q_t(a) - p_t(a)` with `a = argmax p_t`, where "
    "llama.cpp takes the text's next token: the two agree where the text follows the "
    "reference's greedy choice; it needs the distributions (`--record full`, exact; "
    "`--record topk:K`, the steps where P's top token is among Q's top K) and is absent from "
    "summary records; (4) llama.cpp prints delta p and same top p in percent, the CSV keeps "
    "fractions (the report prints percent); (5) llama.cpp's perplexity rows have no "
    "counterpart: the overlap path is not the text either model was scored on.",
)


def scoreboard_markdown() -> list[str]:
    """docs/quantities.md's scoreboard section: the quantities, their statistics, llama.cpp."""
    lines = ["## Scoreboard (llama.cpp's layout)", "", *LLAMA_CPP[:1], ""]
    lines += ["| name | unit | label | range | definition |", "|---|---|---|---|---|"]
    for q in SCOREBOARD:
        lines.append(
            f"| `{q.name}` | {q.unit} | {q.label} | [{q.low}, {q.high}] | {q.definition} |"
        )
    return [*lines, "", *LLAMA_CPP[1:], ""]


# Public names renamed for one name per quantity: old name -> registered name.
DEPRECATED: dict[str, str] = RENAMED
# Names whose unit changed place: summary.csv's fractions of T.
RENAMED_METRICS: dict[str, str] = {
    "interval_lower": "interval_lower_fraction",
    "interval_upper": "interval_upper_fraction",
}


def quantity(name: str) -> Quantity:
    """The registered quantity ``name`` (KeyError naming the registry otherwise)."""
    try:
        return QUANTITIES[name]
    except KeyError:
        raise KeyError(
            f"{name!r} is not a registered quantity (kvcouple.analysis.quantities)"
        ) from None


def label(name: str) -> str:
    """The label tables, the console and axes use for ``name``."""
    return quantity(name).label


def labelled(*names: str) -> tuple[tuple[str, str], ...]:
    """``(name, label)`` for each name: the rows of a report or console table."""
    return tuple((name, label(name)) for name in names)


def current_name(name: str, where: str) -> str:
    """``name``, or the registered name of a deprecated one (with a DeprecationWarning
    naming ``where``)."""
    new = DEPRECATED.get(name) or RENAMED_METRICS.get(name)
    if new is None:
        return name
    warn_renamed(name, new, where, stacklevel=4)
    return new


def is_column(name: str) -> bool:
    """Whether a CSV column is registered: a quantity, its ``_se``, or a field."""
    base = name[: -len("_se")] if name.endswith("_se") else name
    return name in FIELDS or base in QUANTITIES


def markdown() -> str:
    """docs/quantities.md: every quantity and field (generated; a test keeps it in sync)."""
    lines = [
        "# Quantities",
        "",
        "Generated from `kvcouple.analysis.quantities` (do not edit by hand: "
        "`python -c 'from kvcouple.analysis.quantities import markdown; print(markdown())' "
        "> docs/quantities.md`). One name per quantity in Rust, the Python API, the store, "
        "the CSV files and the report; one unit per name.",
        "",
    ]
    groups = (
        ("Per policy", SUMMARY),
        ("Per document", PER_DOCUMENT),
        ("Gap attribution", GAP),
        ("Curves", CURVES),
    )
    for title, group in groups:
        lines += [f"## {title}", "", "| name | unit | label | range | interval | definition |"]
        lines.append("|---|---|---|---|---|---|")
        for q in group:
            lines.append(
                f"| `{q.name}` | {q.unit} | {q.label} | [{q.low}, {q.high}] | {q.interval} "
                f"| {q.definition} |"
            )
        lines.append("")
    lines += [
        "## Intervals",
        "",
        "- bootstrap: the analysis's `ci_method` on the quantity's scale, the logit of its "
        "position in its range (a paired difference: in the difference's range, `[low - high, "
        "high - low]`), so every interval lies inside the range; the identity where the range "
        "is unbounded",
        "- test-inversion: studentized, the set of values the studentized bootstrap test "
        "accepts (a ratio: Fieller's set; the median step: where the test of its CDF = 1/2 "
        "accepts, Brookmeyer and Crowley's; a paired difference of median steps: the shifts "
        "`delta` where the test of `F_b(x + delta) = F_a(x)` accepts, `x` the median of the "
        "two laws' average); under the other methods, a percentile interval",
        "",
    ]
    lines += ["## Units", "", *(f"- {u}: {d}" for u, d in UNITS.items()), ""]
    lines += ["## Other columns", "", *(f"- `{k}`: {v}" for k, v in FIELDS.items()), ""]
    lines += ["## Deprecated names (removed in the next release)", ""]
    lines += [f"- `{k}`: now `{v}`" for k, v in {**DEPRECATED, **RENAMED_METRICS}.items()]
    lines += ["", *scoreboard_markdown()]
    return "\n".join(lines).rstrip("\n") + "\n"
