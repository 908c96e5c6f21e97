"""Writing an analysis: tidy tables (CSV, JSON, Markdown), figures and one HTML report.

Every table carries the plan hash (``none`` without a plan), the estimator and the document
set, so no output can be separated from the plan and settings that produced it.

Files written into ``out/``: ``summary.csv`` (per model, policy and quantity: estimate and
bootstrap CI), ``per_document.csv`` (per-document estimates with Monte Carlo standard errors;
counts in tokens except ``occurrence``, a probability, and ``interval_lower/upper``, fractions of
T as in ``summary.csv``: one unit per column name),
``curves.csv`` (survival, pmf, hazard by step, branch TV by lag, with CIs),
``differences.csv`` (paired policy differences), ``gap_attribution.csv``, ``tests.csv`` (with a
plan), ``recompute_check.csv`` (recorded vs recomputed TVs beyond the tolerance),
``skipped.csv`` (an empty table is its header alone), ``results.json`` (all of it), ``report.md``, ``figures/*.png`` and
``report.html`` (self-contained: figures embedded as base64 PNG).

This module writes the report's Markdown and every file; the rows come from
:mod:`kvcouple.analysis.tables`, the HTML page from :mod:`kvcouple.analysis.report_html` and the
figures from :mod:`kvcouple.analysis.figures`.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeGuard

from kvcouple.analysis.console import run_stamp
from kvcouple.analysis.engine import AnalysisResult
from kvcouple.analysis.labels import number, percent, policy_labels
from kvcouple.analysis.quantities import labelled
from kvcouple.analysis.report_html import html_page
from kvcouple.analysis.scoreboard import report_section as scoreboard_section
from kvcouple.analysis.stats import DISCRETE, NEVER_DIVERGES, NOT_INTERPRETABLE, QUANTITIES
from kvcouple.analysis.tables import EMPTY_COLUMNS, json_safe, table_meta, tidy_tables, write_csv
from kvcouple.analysis.text_html import markdown_lines as text_markdown_lines
from kvcouple.analysis.text_html import with_text
from kvcouple.errors import InvalidInputError, MissingExtraError, require
from kvcouple.textsafe import markdown_cell, terminal


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return "nan" if math.isnan(v) else number(v)
    return markdown_cell(v)


def markdown_table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    head = "| " + " | ".join(map(markdown_cell, columns)) + " |\n|" + "---|" * len(columns) + "\n"
    return head + "".join(
        "| " + " | ".join(_fmt(r.get(c, "")) for c in columns) + " |\n" for r in rows
    )


def compact_table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    """:func:`markdown_table` that fits a page: a column with one value in every row (of two
    or more) is said once above the table (``In every row: model: kvcouple-default.``)."""
    keep: list[str] = []
    constant: list[str] = []
    for c in columns:
        values = {str(r.get(c, "")) for r in rows}
        (constant if len(rows) > 1 and len(values) == 1 else keep).append(c)
    above = ""
    if constant and keep:
        said = "; ".join(f"{markdown_cell(c)}: {_fmt(rows[0].get(c, ''))}" for c in constant)
        above = f"In every row: {said}.\n\n"
    return above + markdown_table(rows, keep if above else columns)


# Rows of the report's tables, in reading order; labels from the registry.
SUMMARY_ROWS = labelled(
    "occurrence",
    "median_tau",
    "first_mismatch",
    "exposure",
    "rho",
    "mismatch_fraction",
    "interval_lower_fraction",
    "interval_upper_fraction",
)
WINDOW_ROWS = labelled("mean_tau", "rmst", "early_tv", "late_tv", "late_minus_early_tv")
DIFFERENCE_QUANTITIES = (
    "mismatch_fraction",
    "occurrence",
    "exposure",
    "rho",
    "late_minus_early_tv",
)
DIFFERENCE_TITLES = {
    "mismatch_fraction": "E[M]/T",
    "occurrence": "occurrence",
    "exposure": "exposure",
    "rho": "rho",
    "late_minus_early_tv": "late - early TV",
}
# The report's symbols, listed at its end (and said in words where they first appear).
SYMBOLS = [
    "- T: tokens generated per trajectory (the horizon).",
    "- tau: the first step at which the two coupled models emit different tokens.",
    "- M: the number of the T tokens that differ; E[M]/T its expected fraction.",
    "- exposure: E[(T - tau)+]/T, the share of the horizon left after tau.",
    "- rho: the mismatch rate after tau (differing tokens per token of exposure).",
    "- L: lags traced after a first divergence (the branch length, `kvcouple trace --window`).",
    "- L_w: lags after tau the analysis counts as observed (`kvcouple analyze --window`; "
    "default L); later lags are the tail.",
    "- s: the last lag of the early window (lags 1..s; the late window is s+1..L_w); default "
    "L_w // 2.",
    "- O: a replicate's probability of diverging within T (its occurrence estimate). "
    "O-weighted: branch quantities averaged with each replicate's branches weighted by O, so "
    "that they describe diverged trajectories.",
    "- Gap terms (B vs A): m = E[M]/T, f = P(tau<=T)/T, e = exposure; d = B minus A (df, de, "
    "drho); _bar = the mean of A and B.",
]


def _ci(
    r: dict[str, Any] | None,
    key: str = "estimate",
    pct: bool = False,
    integer: bool = False,
    low: str = "ci_low",
    high: str = "ci_high",
) -> str:
    """``0.229 [0.206, 0.258]`` (or percentages; whole numbers for steps); ``n/a`` when not
    estimable. Three significant figures, as everywhere (:func:`~kvcouple.analysis.labels.number`)."""
    if r is None or not _finite(r.get(key)):
        return "n/a"

    def f(v: float) -> str:
        return percent(v) if pct else number(v, integer=integer)

    if not (_finite(r.get(low)) and _finite(r.get(high))):
        return f(r[key])
    return f"{f(r[key])} [{f(r[low])}, {f(r[high])}]"


def report_labels(result: AnalysisResult, markdown: bool = True) -> dict[str, str]:
    """One short label per policy for the whole report (every model's policies together);
    the legend in the headline gives each one's full spec. ``markdown``: escaped for direct
    use in Markdown table text (not for :func:`markdown_table`, which escapes its cells)."""
    specs: list[str] = []
    for m in result.models:
        specs += [p for p in m.policies if p not in specs]
    labels = policy_labels(specs)
    return {p: markdown_cell(lab) if markdown else lab for p, lab in labels.items()}


def legend_table(result: AnalysisResult) -> list[str]:
    """Every policy once: its short label (used in the rest of the report) and full spec."""
    labels = report_labels(result)
    rows = [f"| {labels[p]} | {markdown_cell(p)} |" for p in labels]
    return [
        "Policies compared: the short label used in the rest of this report, and the full spec "
        "with every parameter (as stored).",
        "",
        "| label | full spec |",
        "|---|---|",
        *rows,
        "",
    ]


def _split(result: AnalysisResult, obs_window: int) -> int:
    """s, the last early lag of the early/late window split (default: half of L_w)."""
    split = result.settings.get("early_late_split")
    return obs_window // 2 if split in (None, "half") else int(split)


def _finite(v: Any) -> TypeGuard[float]:
    return isinstance(v, int | float) and math.isfinite(v)


def _lookup(rows: list[dict[str, Any]], model: str) -> dict[tuple[str, str], dict[str, Any]]:
    return {(r["policy"], r["quantity"]): r for r in rows if r["model"] == model}


def _excludes_zero(r: dict[str, Any]) -> bool:
    lo, hi = r.get("ci_low"), r.get("ci_high")
    return _finite(lo) and _finite(hi) and (lo > 0 or hi < 0)


def headline(result: AnalysisResult, tables: dict[str, list[dict[str, Any]]]) -> list[str]:
    """The report's first section: per policy, in words, then each compared pair's gap."""
    level = f"{100 * result.settings.get('ci', 0.95):.0f}%"
    lines = ["## Headline\n", *legend_table(result)]
    labels = report_labels(result)
    for m in result.models:
        q = _lookup(tables["summary"], m.model)
        if len(result.models) > 1:
            lines.append(f"**{terminal(m.model)}**\n")
        for pol in m.policies:
            occ, med, rho, frac = (
                q.get((pol, k)) for k in ("occurrence", "median_tau", "rho", "mismatch_fraction")
            )
            exp_ = q.get((pol, "exposure"))
            words = [
                f"- **{labels[pol]}** diverges from the full-cache model in "
                f"{_ci(occ, pct=True)} of trajectories within the T = {m.horizon} generated "
                "tokens"
            ]
            if med is not None and _finite(med.get("estimate")):
                words.append(
                    f", at step {number(med['estimate'], integer=True)} on median when it does"
                )
            if rho is not None and _finite(rho.get("estimate")):
                words.append(f"; after divergence {_ci(rho, pct=True)} of tokens differ")
            if frac is not None and _finite(frac.get("estimate")):
                exposure_share = ""
                if exp_ is not None and _finite(exp_.get("estimate")) and frac["estimate"] > 0:
                    s = exp_["estimate"] * rho["estimate"] / frac["estimate"]  # type: ignore[index]
                    exposure_share = f", {percent(s)} of it post-divergence exposure x rate"
                words.append(
                    f". In all, a fraction E[M]/T = {_ci(frac)} of the generated tokens "
                    f"differ{exposure_share}."
                )
            else:
                lo, hi = (
                    q.get((pol, "interval_lower_fraction")),
                    q.get((pol, "interval_upper_fraction")),
                )
                words.append(
                    f". Branches (the continuations after a first divergence) were traced for "
                    f"L = {m.window} of T = {m.horizon} steps, so rho is unknown and E[M]/T is "
                    f"known only to lie in the sharp interval [{_ci(lo)}, {_ci(hi)}] (the values "
                    "compatible with what was observed)."
                )
            lines.append("".join(words))
        gaps: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
        for r in tables["gap_attribution"]:
            if r["model"] == m.model:
                gaps.setdefault((r["policy_a"], r["policy_b"]), {})[r["term"]] = r
        if gaps:
            lines += ["", "Pairs of policies (B vs A; paired over documents):", ""]
        for (a, b), terms in gaps.items():
            gap, share = terms.get("gap"), terms.get("exposure_share")
            if gap is None:
                continue
            sentence = (
                f"- **{labels.get(b, terminal(b))}** vs **{labels.get(a, terminal(a))}**: "
                f"E[M]/T differs by {_ci(gap)} ({level} CI)"
            )
            if _excludes_zero(gap) and share is not None and _finite(share.get("estimate")):
                sentence += f"; post-divergence exposure explains {_ci(share, pct=True)} of the gap"
                sentence += _share_note(share, terms)
            elif not _excludes_zero(gap):
                sentence += "; the CI includes 0, so there is no clear gap to attribute"
            lines.append(sentence + ".")
    lines.append("")
    return lines


def _share_note(share: dict[str, Any], terms: dict[str, dict[str, Any]]) -> str:
    """Why an exposure share can pass 100% (or 0%): the other terms pull the other way."""
    est, lo, hi = share["estimate"], share.get("ci_low"), share.get("ci_high")
    rest = [terms.get(k, {}).get("estimate") for k in ("delta_first_mismatch", "rate_term")]
    other = number(sum(v for v in rest if _finite(v)))
    if est > 1:
        return (
            f" (more than all of it: the first-mismatch and rate terms together ({other}) go "
            "the other way, so the exposure term alone is larger than the gap; see Gap "
            "attribution)"
        )
    if est < 0:
        return (
            f" (less than none: the exposure term goes against the gap, which the "
            f"first-mismatch and rate terms ({other}) more than make up; see Gap attribution)"
        )
    if (_finite(hi) and hi > 1) or (_finite(lo) and lo < 0):
        return (
            " (its interval passes 100% or 0%: the share is a ratio over a gap that is small "
            "next to its own uncertainty)"
        )
    return ""


HOW_TO_READ = """## How to read this

Each policy's generations are coupled token by token with the full-cache model's: both sides
emit the same token whenever they can (maximal coupling). *Occurrence* is the chance that the
two ever emit different tokens within the T generated tokens; the *divergence step* tau is the
first step where they do. After it the two continue from different prefixes: *exposure* is the
share of the horizon left after tau, and *rho* the share of those tokens that differ. Exactly,
`E[M]/T = P(tau<=T)/T + exposure x rho`: the expected fraction of differing tokens is the first
mismatch plus everything after it. A policy can be bad by diverging early and often (high
occurrence, early tau) or by drifting far once diverged (high rho). Numbers are means over
documents with document-bootstrap intervals; a difference whose interval includes 0 is not
established.
"""


def _wide(
    q: dict[tuple[str, str], dict[str, Any]],
    policies: list[str],
    labels: dict[str, str],
    rows: tuple[tuple[str, str], ...],
) -> str:
    head = "| quantity | " + " | ".join(labels[p] for p in policies) + " |\n"
    head += "|---|" + "---|" * len(policies) + "\n"
    body = ""
    for key, title in rows:
        cells = [_ci(q.get((p, key)), integer=key in DISCRETE) for p in policies]
        if all(c == "n/a" for c in cells):
            continue
        body += f"| {title} | " + " | ".join(cells) + " |\n"
    return head + body


def flags(result: AnalysisResult, tables: dict[str, list[dict[str, Any]]]) -> list[str]:
    """What the reader must know before trusting the numbers: the preregistration stamp
    first, then every caveat that applies."""
    out = [f"**{run_stamp(result)}**"]
    for m in result.models:
        n = len(m.docs)
        name = terminal(m.model)
        if m.window + 1 < m.horizon:
            out.append(
                f"{name}: branches were traced for L = {m.window} lags of T = {m.horizon} "
                "steps after each first divergence; what happens later is unobserved, so rho "
                "is not estimated and E[M]/T is given as the sharp interval of values "
                "compatible with the observed window."
            )
        never = [
            r["policy"] for r in m.tables.get("summary", [])
            if r["quantity"] == "rho" and r.get("note") == NEVER_DIVERGES
        ]  # fmt: skip
        if never:
            out.append(
                f"{name}: {', '.join(terminal(p) for p in never)} never diverged in any document "
                "(occurrence 0): rho and the other quantities after a divergence are undefined."
            )
        if n < 20:
            out.append(
                f"{name}: {n} documents; bootstrap intervals over so few documents are rough "
                "(they tend to be too narrow)."
            )
    bad = len(result.checks())
    if bad:
        out.append(
            f"{bad} recorded TVs disagree with the TVs recomputed from the stored distributions "
            "beyond the tolerance (see recompute_check.csv): the store may be damaged."
        )
    if tables["skipped"]:
        out.append(
            f"{len(tables['skipped'])} documents were skipped (unfinished or damaged); see the "
            "list below."
        )
    if result.plan_hash == "none":
        out.append(
            "Every comparison here is exploratory. For confirmatory tests, register a plan and "
            "analyse a disjoint document set (`--plan`, `--docs confirmatory`)."
        )
    return out


FIGURES = {
    "survival": (
        "Survival: no divergence yet",
        "S_t = P(tau > t), the share of trajectories still identical to the full-cache model "
        "after t tokens (bands: bootstrap CIs). Look at how fast each curve falls and where "
        "curves cross: a lower curve diverges earlier or more often.",
    ),
    "hazard": (
        "Hazard by step",
        "The chance that the first divergence happens at step t, given none before. A high "
        "value at step 1 means eviction already changes the first next-token distribution; a "
        "rising hazard means the risk grows as generation proceeds.",
    ),
    "decomposition": (
        "Decomposition of E[M]/T",
        "Each bar stacks the first-mismatch contribution P(tau<=T)/T, the post-divergence "
        "mismatches inside the observation window (lags 1..L_w after the first divergence tau, "
        "L_w being the lags the analysis counts as observed) and, where any, those after it "
        "(the tail; hatched: unobserved, at most this much); the black line is the CI of "
        "E[M]/T. The parts above the first one are exposure x rho: compare their heights "
        "across policies to see whether a gap comes from diverging or from drifting.",
    ),
    "branch_tv_by_lag": (
        "Branch-aligned TV by lag after the first divergence",
        "The mean TV between the two models' next-token distributions at each lag after the "
        "first divergence, over the branches traced (each replicate's branches weighted by its "
        "probability O of diverging at all, 'O-weighted', so that the mean is that of diverged "
        "trajectories). Lag 0 is the divergence step itself, whose TV is the (usually small) hazard that "
        "happened to produce different tokens; from lag 1 on, the two models continue from "
        "different prefixes and TV jumps, which is why rho is high. Only trajectories that "
        "diverged early reach the last lags, so the right end rests on few branches and is "
        "noisy (a spike there is not a finding): read it with its band.",
    ),
    "sharp_interval": (
        "Sharp interval of E[M]/T",
        "The range of E[M]/T compatible with what was observed (bar), the CI of its ends "
        "(thin line) and the point estimate when the tail was observed (dot).",
    ),
    "early_vs_late": (
        "Early vs late branch-aligned TV",
        "Branch-aligned TV (O-weighted, as in the TV-by-lag figure) averaged over the early "
        "lags 1..s and the late lags s+1..L_w after divergence ({split}). Late above early "
        "means the two generations keep drifting apart instead of re-synchronising.",
    ),
}
COLLAPSED = (
    " Here every branch was traced to the horizon (L >= T - 1), so nothing is unobserved: the "
    "interval collapses to the point estimate and no bar is drawn. It widens when branches "
    "are traced for fewer lags (`kvcouple trace --window L` with L < T)."
)


def _caption(name: str, result: AnalysisResult) -> tuple[str, str]:
    title, text = FIGURES.get(name, (name, ""))
    if name == "sharp_interval" and all(m.window + 1 >= m.horizon for m in result.models):
        text += COLLAPSED
    if name == "early_vs_late":
        split = "; ".join(
            f"{terminal(m.model) + ': ' if len(result.models) > 1 else ''}"
            f"s = {_split(result, m.obs_window)}, L_w = {m.obs_window}"
            for m in result.models
        )
        text = text.format(split=split)
    return title, text


def report_title(result: AnalysisResult) -> str:
    models = ", ".join(m.model for m in result.models)
    docs = sum(len(m.docs) for m in result.models)
    policies = len({p for m in result.models for p in m.policies})
    return (
        f"kvcouple report: {models}, {docs} documents, {policies} "
        f"{'policy' if policies == 1 else 'policies'}"
    )


def _model_sections(
    result: AnalysisResult,
    tables: dict[str, list[dict[str, Any]]],
    m: Any,
    labels: dict[str, str],
    level: str,
) -> list[str]:
    """One model's decomposition, timing and drift, and paired-difference tables."""
    q = _lookup(tables["summary"], m.model)
    where = f" ({terminal(m.model)})" if len(result.models) > 1 else ""
    # Branches traced to the horizon: the sharp interval is the point estimate itself.
    collapsed = m.window + 1 >= m.horizon
    rows = tuple(r for r in SUMMARY_ROWS if not (collapsed and r[0].startswith("interval_")))
    lines = [
        f"## Decomposition by policy{where}\n",
        f"Means over {len(m.docs)} documents [{level} document-bootstrap CI]; "
        f"T = {m.horizon} tokens generated per trajectory; L = {m.window} lags traced "
        f"after each first divergence; L_w = {m.obs_window} lags counted as observed by "
        "this analysis (its window, at most L).\n",
        _wide(q, m.policies, labels, rows),
    ]
    s_lag = _split(result, m.obs_window)
    lines += [
        f"\n## Timing and drift after divergence{where}\n",
        f"Branch TV: the TV between the two models' next-token distributions after the "
        f"first divergence, O-weighted (each replicate weighted by its probability O of "
        f"diverging); early window: lags 1..s, late: lags s+1..L_w, with s = {s_lag}.\n",
        _wide(q, m.policies, labels, WINDOW_ROWS),
    ]
    pairs: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    for r in tables["differences"]:
        if r["model"] == m.model and r["quantity"] in DIFFERENCE_QUANTITIES:
            pairs.setdefault((r["policy_a"], r["policy_b"]), {})[r["quantity"]] = {
                **r,
                "estimate": r["difference"],
            }
    if pairs:
        lines += [
            f"\n## Paired policy differences (B - A){where}\n",
            "Per document, then averaged; intervals that exclude 0 mark established "
            "differences. late - early TV: the late-window branch TV minus the early one.\n",
            "| B vs A | " + " | ".join(DIFFERENCE_TITLES[k] for k in DIFFERENCE_QUANTITIES) + " |",
            "|---|" + "---|" * len(DIFFERENCE_QUANTITIES),
        ]
        for (a, b), d in pairs.items():
            lines.append(
                f"| {labels.get(b, markdown_cell(b))} vs {labels.get(a, markdown_cell(a))} | "
                + " | ".join(_ci(d.get(k)) for k in DIFFERENCE_QUANTITIES)
                + " |"
            )
    return lines


def _figure_section(result: AnalysisResult, figures: list[str] | None) -> list[str]:
    if not figures:
        return []
    lines = ["\n## Figures\n"]
    for k, name in enumerate(figures, 1):
        title, text = _caption(name, result)
        lines += [f"![{title}](figures/{name}.png)\n", f"*Figure {k}. {title}.* {text}\n"]
    return lines


def _check_sections(tables: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Recorded against recomputed TVs, and the documents skipped."""
    lines: list[str] = []
    if tables["recompute_summary"]:
        lines += [
            "\n## Recorded vs recomputed TVs\n",
            compact_table(
                tables["recompute_summary"],
                ["model", "rows_checked", "max_abs_diff", "disagreements", "tolerance"],
            ),
        ]
    if tables["skipped"]:
        lines += [
            "\n## Skipped documents\n",
            compact_table(tables["skipped"], ["store", "doc_id", "reason"]),
        ]
    return lines


def _settings_section(result: AnalysisResult, level: str) -> list[str]:
    """The run's stamp, estimator, bootstrap and stores."""
    stamp = (
        ["- **exploratory (no plan)**"]
        if result.plan_hash == "none"
        else [
            f"- **{terminal(result.preregistration)}**",
            f"- plan: {terminal(result.plan_name or 'unnamed')} (hash `{result.plan_hash}`)",
        ]
    )
    return [
        "\n## Settings\n",
        *stamp,
        f"- documents: {result.doc_set}; estimator: {result.estimator} "
        f"({'mismatch indicators, Rao-Blackwellised' if result.estimator == 'indicator' else 'branch-aligned TVs'})",
        f"- bootstrap: {result.settings.get('n_boot')} document resamples, seed "
        f"{result.settings.get('seed')}, {level} "
        f"{result.settings.get('ci_method', 'percentile')} intervals",
        "- stores: "
        + ", ".join(
            f"`{terminal(m.store)}` ({terminal(m.model)}: T={m.horizon}, L={m.window}, "
            f"L_w={m.obs_window}, {len(m.docs)} documents; "
            f"{result.settings.get('store_checksums', {}).get(m.store, 'checksums unknown')})"
            for m in result.models
        ),
    ]


def markdown_report(
    result: AnalysisResult,
    tables: dict[str, list[dict[str, Any]]],
    figures: list[str] | None = None,
) -> str:
    """The report as Markdown: headline in words, how to read it, flags, wide tables
    (quantity x policy, short labels and a legend), figures with captions, then the details.
    ``figures`` names the figures written to ``figures/`` (none: no figure section). The HTML
    report is rendered from this text, so both carry the same content."""
    lines = [f"# {terminal(report_title(result))}\n"]
    lines += headline(result, tables)
    lines += ["## Flags\n", *[f"- {f}" for f in flags(result, tables)], ""]
    lines.append(HOW_TO_READ)
    level = f"{100 * result.settings.get('ci', 0.95):.0f}%"
    labels = report_labels(result)
    for m in result.models:
        lines += _model_sections(result, tables, m, labels, level)
    lines += scoreboard_section(result.models, tables.get("scoreboard", []), labels)
    lines += text_markdown_lines()
    lines += _figure_section(result, figures)
    # Gap attribution (exposure-share flags), survival comparisons, the plan's tests.
    lines += statistics_sections(result, tables)
    lines += _check_sections(tables)
    lines += _settings_section(result, level)
    lines += ["\n## Symbols\n", *SYMBOLS]
    lines += ["\n## Quantities\n"] + [f"- `{k}`: {v}" for k, v in QUANTITIES.items()]
    return "\n".join(lines) + "\n"


def _output(out: Path, name: str) -> Path:
    """``out / name``, with a symbolic link there removed so that writing cannot follow it."""
    path = out / name
    if path.is_symlink():
        path.unlink()
    return path


GAP_COLUMNS = labelled(
    "gap", "delta_first_mismatch", "exposure_term", "rate_term", "exposure_share"
)
GAP_INTRO = (
    "The gap in E[M]/T between policies B and A splits exactly into three terms (SPEC section "
    "3): m_B - m_A = df + rho_bar de + e_bar drho, where m = E[M]/T, f = P(tau<=T)/T (the "
    "first-mismatch contribution), e = the exposure E[(T-tau)+]/T and rho = the mismatch rate; "
    "d is B minus A (df = f_B - f_A) and _bar the mean of A and B. The exposure share "
    "rho_bar de / (m_B - m_A) is the part of the gap that comes from B diverging earlier or "
    "more often rather than drifting faster once diverged. It passes 100% (or falls below 0%) "
    "when the other two terms go the other way, and its interval is wide when the gap is small "
    "next to its uncertainty; a share whose gap CI includes 0 is flagged"
)


def _pairs(rows: list[dict[str, Any]]) -> dict[tuple[str, str, str], list[dict[str, Any]]]:
    """Rows grouped by (model, policy_a, policy_b), in their order."""
    out: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in rows:
        out.setdefault((r["model"], r["policy_a"], r["policy_b"]), []).append(r)
    return out


def _by_model(
    groups: dict[tuple[str, str, str], list[dict[str, Any]]],
) -> dict[str, list[tuple[str, str, list[dict[str, Any]]]]]:
    out: dict[str, list[tuple[str, str, list[dict[str, Any]]]]] = {}
    for (model, a, b), rows in groups.items():
        out.setdefault(model, []).append((a, b, rows))
    return out


def _model_note(model: str, several: bool) -> list[str]:
    return [f"Model: {markdown_cell(model)}.\n"] if several else []


PairLabel = Callable[[str, str], str]


def _gap_section(
    result: AnalysisResult, tables: dict[str, list[dict[str, Any]]], pair: PairLabel
) -> list[str]:
    """Gap attribution, one table per model, with the exposure-share flag."""
    gaps = _by_model(_pairs(tables["gap_attribution"]))
    if not gaps:
        return []
    ref = result.settings.get("reference")
    lines = [
        "\n## Gap attribution\n",
        f"{GAP_INTRO} *{NOT_INTERPRETABLE}*. Gaps are B - A"
        f"{f' with A = the reference {markdown_cell(ref)}' if ref else ' for every pair'}.\n",
    ]
    for model, pairs in gaps.items():
        lines += _model_note(model, len(gaps) > 1)
        lines += [
            "| B vs A | " + " | ".join(t for _, t in GAP_COLUMNS) + " |",
            "|---|" + "---|" * len(GAP_COLUMNS),
        ]
        for a, b, rows in pairs:
            terms = {r["term"]: r for r in rows}
            cells = []
            for key, _ in GAP_COLUMNS:
                r = terms.get(key)
                cell = _ci(r, pct=key == "exposure_share")
                if r is not None and r.get("note"):
                    cell += f" ({markdown_cell(r['note'])})"
                cells.append(cell)
            lines.append(f"| {pair(a, b)} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def _survival_section(tables: dict[str, list[dict[str, Any]]], pair: PairLabel) -> list[str]:
    """RMST differences and the survival difference's simultaneous band, per model."""
    surv = tables.get("survival_differences", [])
    if not surv:
        return []
    rmst = _by_model(_pairs([r for r in tables["differences"] if r["quantity"] == "rmst"]))
    lines = [
        "\n## Survival comparisons\n",
        "Restricted mean time to divergence E[min(tau, T)] (tokens), paired difference "
        "B - A, and the survival difference S_B(t) - S_A(t): its largest |value| (at step "
        "t, with the simultaneous band, which covers all steps at once) and at how many "
        "steps the band excludes 0.\n",
    ]
    bands = _by_model(_pairs(surv))
    for model, pairs in bands.items():
        lines += _model_note(model, len(bands) > 1)
        lines += [
            "| B vs A | RMST difference (tokens) | largest S_B - S_A [band] | at step "
            "| steps the band excludes 0 |",
            "|---|---|---|---|---|",
        ]
        diffs = {(a, b): rows[0] for a, b, rows in rmst.get(model, [])}
        for a, b, rows in pairs:
            top = max(
                rows,
                key=lambda r: abs(r["difference"]) if r["difference"] == r["difference"] else -1,
            )
            apart = [r["step"] for r in rows if r["band_low"] > 0 or r["band_high"] < 0]
            d = diffs.get((a, b))
            cells = [
                _ci(d, key="difference") if d is not None else "n/a",
                _ci(top, key="difference", low="band_low", high="band_high"),
                str(top["step"]),
                f"{len(apart)} of {len(rows)}",
            ]
            lines.append(f"| {pair(a, b)} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


TEST_COLUMNS = [
    "comparison",
    "model",
    "metric",
    "tested",
    "direction",
    "value",
    "estimate [CI]",
    "p_value",
    "p_adjusted",
    "reject_h0",
]


def _tests_section(result: AnalysisResult, tables: dict[str, list[dict[str, Any]]]) -> list[str]:
    """The plan's prespecified tests."""
    if not tables["tests"]:
        return []
    raw = report_labels(result, markdown=False)
    rows = [
        {
            **r,
            "tested": raw.get(r["policy"], r["policy"])
            if r["policy"]
            else f"{raw.get(r['policy_b'], r['policy_b'])} - "
            f"{raw.get(r['policy_a'], r['policy_a'])}",
            "estimate [CI]": _ci(r),
        }
        for r in tables["tests"]
    ]
    return [
        f"\n## Prespecified tests ({result.doc_set} documents; {terminal(result.preregistration)})\n",
        compact_table(rows, TEST_COLUMNS),
    ]


def statistics_sections(
    result: AnalysisResult, tables: dict[str, list[dict[str, Any]]]
) -> list[str]:
    """The confirmatory-statistics sections: gap attribution (with the exposure-share flag),
    survival comparisons (RMST, survival difference with its simultaneous band) and the
    plan's tests. Self-contained so the report's layout can change around it. One row per
    pair of policies (short labels; B vs A), the model said above each table, not in a column."""
    labels = report_labels(result)

    def pair(a: str, b: str) -> str:
        return f"{labels.get(b, markdown_cell(b))} vs {labels.get(a, markdown_cell(a))}"

    return [
        *_gap_section(result, tables, pair),
        *_survival_section(tables, pair),
        *_tests_section(result, tables),
    ]


def write_report(
    result: AnalysisResult,
    out: str | os.PathLike[str],
    *,
    figures: bool = True,
    html_report: bool = True,
) -> Path:
    """Write every table, the figures and the report (Markdown and HTML) into ``out``.

    Files are written only inside ``out``: a symbolic link planted where an output goes is
    replaced by the file, never followed. Without matplotlib (the ``plots`` extra) the report
    is written without figures, with a warning.

    Parameters
    ----------
    result : AnalysisResult
        What :func:`kvcouple.analysis.analyze` returned.
    out : path
        Folder to write into (created if missing).
    figures : bool, default True
        Draw the figures (``figures/*.png``, embedded in ``report.html``).
    html_report : bool, default True
        Write ``report.html`` (self-contained) beside ``report.md``.

    Returns
    -------
    pathlib.Path
        ``out``. It holds ``summary.csv``, ``per_document.csv``, ``curves.csv``,
        ``differences.csv``, ``gap_attribution.csv``, ``tests.csv``, ``recompute_check.csv``,
        ``skipped.csv``, ``scoreboard.csv`` (llama.cpp's numbers per policy), ``results.json``,
        ``report.md``, ``report.html`` (with the text views of what diverged, where the
        stores keep text) and ``figures/``.

    Raises
    ------
    kvcouple.errors.InvalidInputError
        ``out`` exists and is not a directory.
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise InvalidInputError(f"out = {out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    tables = tidy_tables(result)
    for name, rows in tables.items():
        write_csv(_output(out, f"{name}.csv"), rows, EMPTY_COLUMNS.get(name))
    payload: dict[str, Any] = {
        "meta": {
            **table_meta(result),
            "plan_name": result.plan_name,
            **result.settings,
            "models": [
                {
                    "model": m.model,
                    "store": m.store,
                    "policies": m.policies,
                    "horizon": m.horizon,
                    "window": m.window,
                    "obs_window": m.obs_window,
                    "documents": len(m.docs),
                }
                for m in result.models
            ],
        },
        **tables,
    }
    _output(out, "results.json").write_text(json.dumps(json_safe(payload), indent=1, default=str))
    images: dict[str, bytes] = {}
    if figures:
        try:
            require("matplotlib", "the report's figures")
        except MissingExtraError as e:
            warnings.warn(f"{e}; writing the report without figures", stacklevel=2)
            figures = False
    if figures:
        from kvcouple.analysis.figures import make_figures

        plan = (
            "exploratory (no plan)"
            if result.plan_hash == "none"
            else f"plan {result.plan_hash[:12]} | " + result.preregistration.split(":")[0]
        )
        stamp = f"{plan} | {result.estimator} | docs: {result.doc_set}"
        folder = _output(out, "figures")
        folder.mkdir(exist_ok=True)
        for f in folder.iterdir():  # links planted inside too
            if f.is_symlink():
                f.unlink()
        images = make_figures(tables, folder, stamp)
    md = markdown_report(result, tables, list(images))
    _output(out, "report.md").write_text(md)
    if html_report:
        page = with_text(html_page(md, images, report_title(result)), result, tables)
        _output(out, "report.html").write_text(page)
    return out
