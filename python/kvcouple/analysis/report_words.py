"""The report's words: numbers with their intervals, policy labels and the legend, the headline
in sentences, the flags, how to read the report, and the Markdown tables' cells.

The figures' titles and captions live with the figures (:data:`kvcouple.analysis.figures.FIGURES`);
the sections that arrange these words are in :mod:`kvcouple.analysis.report_sections`.
"""

from __future__ import annotations

import math
from typing import Any, TypeGuard

from kvcouple.analysis.console import run_stamp
from kvcouple.analysis.labels import number, percent, policy_labels
from kvcouple.analysis.results import AnalysisResult
from kvcouple.analysis.stats import NEVER_DIVERGES
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


def with_ci(
    r: dict[str, Any] | None,
    key: str = "estimate",
    pct: bool = False,
    integer: bool = False,
    low: str = "ci_low",
    high: str = "ci_high",
) -> str:
    """``0.229 [0.206, 0.258]`` (or percentages; whole numbers for steps); ``n/a`` when not
    estimable. Three significant figures, as everywhere (:func:`~kvcouple.analysis.labels.number`)."""
    if r is None or not finite(r.get(key)):
        return "n/a"

    def f(v: float) -> str:
        return percent(v) if pct else number(v, integer=integer)

    if not (finite(r.get(low)) and finite(r.get(high))):
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


def finite(v: Any) -> TypeGuard[float]:
    return isinstance(v, int | float) and math.isfinite(v)


def summary_lookup(rows: list[dict[str, Any]], model: str) -> dict[tuple[str, str], dict[str, Any]]:
    return {(r["policy"], r["quantity"]): r for r in rows if r["model"] == model}


def _excludes_zero(r: dict[str, Any]) -> bool:
    lo, hi = r.get("ci_low"), r.get("ci_high")
    return finite(lo) and finite(hi) and (lo > 0 or hi < 0)


def headline(result: AnalysisResult, tables: dict[str, list[dict[str, Any]]]) -> list[str]:
    """The report's first section: per policy, in words, then each compared pair's gap."""
    level = f"{100 * result.settings.get('ci', 0.95):.0f}%"
    lines = ["## Headline\n", *legend_table(result)]
    labels = report_labels(result)
    for m in result.models:
        q = summary_lookup(tables["summary"], m.model)
        if len(result.models) > 1:
            lines.append(f"**{terminal(m.model)}**\n")
        for pol in m.policies:
            occ, med, rho, frac = (
                q.get((pol, k)) for k in ("occurrence", "median_tau", "rho", "mismatch_fraction")
            )
            exp_ = q.get((pol, "exposure"))
            words = [
                f"- **{labels[pol]}** diverges from the full-cache model in "
                f"{with_ci(occ, pct=True)} of trajectories within the T = {m.horizon} generated "
                "tokens"
            ]
            if med is not None and finite(med.get("estimate")):
                words.append(f", at step {number(med['estimate'])} on median when it does")
            if rho is not None and finite(rho.get("estimate")):
                words.append(f"; after divergence {with_ci(rho, pct=True)} of tokens differ")
            if frac is not None and finite(frac.get("estimate")):
                exposure_share = ""
                if exp_ is not None and finite(exp_.get("estimate")) and frac["estimate"] > 0:
                    s = exp_["estimate"] * rho["estimate"] / frac["estimate"]  # type: ignore[index]
                    exposure_share = f", {percent(s)} of it post-divergence exposure x rate"
                words.append(
                    f". In all, a fraction E[M]/T = {with_ci(frac)} of the generated tokens "
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
                    f"known only to lie in the sharp interval [{with_ci(lo)}, {with_ci(hi)}] (the values "
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
                f"E[M]/T differs by {with_ci(gap)} ({level} CI)"
            )
            if _excludes_zero(gap) and share is not None and finite(share.get("estimate")):
                sentence += (
                    f"; post-divergence exposure explains {with_ci(share, pct=True)} of the gap"
                )
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
    other = number(sum(v for v in rest if finite(v)))
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
    if (finite(hi) and hi > 1) or (finite(lo) and lo < 0):
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


# Below this many documents the report warns that a sample can miss a population's tail
# (docs/statistics.md: at 16 documents mean_tau covered 0.89 where five of 40 documents carry
# the divergence-time law, 0.945 at 32).
FEW_DOCS = 32


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
        if n < FEW_DOCS:
            out.append(
                f"{name}: {n} documents. A sample this small can miss the few documents that "
                "diverge far more often or earlier than the rest, and then nothing in it shows "
                "them: in the coverage study (docs/statistics.md) every interval covered "
                "0.93-0.97 at 16 documents except the mean and median divergence step of such "
                "a population (0.87-0.89; 0.945 at 32 documents)."
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


def report_title(result: AnalysisResult) -> str:
    models = ", ".join(m.model for m in result.models)
    docs = sum(len(m.docs) for m in result.models)
    policies = len({p for m in result.models for p in m.policies})
    return (
        f"kvcouple report: {models}, {docs} documents, {policies} "
        f"{'policy' if policies == 1 else 'policies'}"
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
