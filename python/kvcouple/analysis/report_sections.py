"""The report's Markdown sections: the decomposition, timing and difference tables per model,
the figures with their captions, gap attribution, survival comparisons, the plan's tests, the
checks and the settings, put together by :func:`markdown_report`.

The sentences and cells come from :mod:`kvcouple.analysis.report_words`; the files are written
by :mod:`kvcouple.analysis.report`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvcouple.analysis.figures import FIGURES, early_late_split
from kvcouple.analysis.intervals import GAUSSIAN_MIN_DOCS
from kvcouple.analysis.quantities import labelled
from kvcouple.analysis.report_words import (
    GAP_INTRO,
    HOW_TO_READ,
    SYMBOLS,
    compact_table,
    flags,
    headline,
    report_labels,
    report_title,
    summary_lookup,
    with_ci,
)
from kvcouple.analysis.results import AnalysisResult
from kvcouple.analysis.scoreboard import report_section as scoreboard_section
from kvcouple.analysis.stats import NOT_INTERPRETABLE, SUMMARY_DEFINITIONS
from kvcouple.analysis.text_html import markdown_lines as text_markdown_lines
from kvcouple.textsafe import markdown_cell, terminal

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
        cells = [with_ci(q.get((p, key))) for p in policies]
        if all(c == "n/a" for c in cells):
            continue
        body += f"| {title} | " + " | ".join(cells) + " |\n"
    return head + body


def _model_sections(
    result: AnalysisResult,
    tables: dict[str, list[dict[str, Any]]],
    m: Any,
    labels: dict[str, str],
    level: str,
) -> list[str]:
    """One model's decomposition, timing and drift, and paired-difference tables."""
    q = summary_lookup(tables["summary"], m.model)
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
    s_lag = early_late_split(result, m.obs_window)
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
                + " | ".join(with_ci(d.get(k)) for k in DIFFERENCE_QUANTITIES)
                + " |"
            )
    return lines


def _figure_section(result: AnalysisResult, figures: list[str] | None) -> list[str]:
    """Each figure drawn, with its title and caption from the figure registry."""
    if not figures:
        return []
    lines = ["\n## Figures\n"]
    for k, name in enumerate(figures, 1):
        title, text = FIGURES[name].title, FIGURES[name].caption_for(result)
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


def _draws(result: AnalysisResult) -> str:
    """How the bootstrap's replicates were drawn, in words (``bootstrap_draws``)."""
    draws = result.settings.get("bootstrap_draws", {})
    gaussian = [terminal(s) for s, how in draws.items() if how == "gaussian limit"]
    if not gaussian:
        return "document resamples"
    which = "" if len(gaussian) == len(draws) else f" for {', '.join(gaussian)}"
    return (
        f"draws from the document bootstrap's Gaussian limit{which} (studentized, "
        f"{GAUSSIAN_MIN_DOCS:,} documents or more; docs/statistics.md)"
    )


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
        f"- bootstrap: {result.settings.get('n_boot')} {_draws(result)}, seed "
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
    lines += ["\n## Quantities\n"] + [f"- `{k}`: {v}" for k, v in SUMMARY_DEFINITIONS.items()]
    return "\n".join(lines) + "\n"


GAP_COLUMNS = labelled(
    "gap", "delta_first_mismatch", "exposure_term", "rate_term", "exposure_share"
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
                cell = with_ci(r, pct=key == "exposure_share")
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
                with_ci(d, key="difference") if d is not None else "n/a",
                with_ci(top, key="difference", low="band_low", high="band_high"),
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
            "estimate [CI]": with_ci(r),
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
