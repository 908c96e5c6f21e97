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
"""

from __future__ import annotations

import csv
import html
import json
import math
import os
import warnings
from pathlib import Path
from typing import Any

from kvcouple.analysis.engine import AnalysisResult
from kvcouple.analysis.estimates import SCALARS
from kvcouple.analysis.reading import TOLERANCE
from kvcouple.analysis.stats import QUANTITIES
from kvcouple.errors import InvalidInputError, MissingExtraError, require
from kvcouple.textsafe import markdown_cell, split_markdown_row, terminal


def _meta(result: AnalysisResult) -> dict[str, Any]:
    return {
        "plan_hash": result.plan_hash,
        "estimator": result.estimator,
        "doc_set": result.doc_set,
        "preregistration": result.preregistration,
    }


def tidy_tables(result: AnalysisResult) -> dict[str, list[dict[str, Any]]]:
    """Every table as a list of flat rows (the same rows go to CSV, JSON and Markdown)."""
    meta = _meta(result)
    out: dict[str, list[dict[str, Any]]] = {
        k: []
        for k in (
            "summary",
            "per_document",
            "curves",
            "differences",
            "gap_attribution",
            "survival_differences",
            "recompute_check",
            "recompute_summary",
        )
    }
    for m in result.models:
        for name in ("summary", "curves", "differences", "gap_attribution", "survival_differences"):
            out[name] += [{"model": m.model, **row, **meta} for row in m.tables.get(name, [])]
        for d in m.docs:
            assert d.units is not None
            for pol, u in d.units.items():
                row: dict[str, Any] = {"model": m.model, "doc_id": d.doc_id, "policy": pol}
                for k in SCALARS:
                    # One unit per column name: the sharp interval is a fraction of T here as
                    # in summary.csv; the other scalars are counts (tokens) in both files.
                    scale = m.horizon if k in ("interval_lower", "interval_upper") else 1
                    row[k] = u.values[k] / scale
                    row[f"{k}_se"] = u.stderr[k] / scale
                row["median_tau"] = u.median_tau
                row["tail_observed"] = u.tail_observed
                out["per_document"].append({**row, **meta})
        checked = [d.check for d in m.docs if d.check is not None]
        if checked:
            out["recompute_summary"].append(
                {
                    "model": m.model,
                    "rows_checked": sum(c.rows_checked for c in checked),
                    "max_abs_diff": max(c.max_abs_diff for c in checked),
                    "disagreements": sum(len(c.disagreements) for c in checked),
                    "tolerance": result.settings.get("tolerance")
                    or "by stored dtype: " + ", ".join(f"{k} {v:g}" for k, v in TOLERANCE.items()),
                    **meta,
                }
            )
    for name, rows in result.pooled.items():  # across models: "model" names the pool
        out[name] += [{**row, **meta} for row in rows]
    out["recompute_check"] = [{**r, **meta} for r in result.checks()]
    out["tests"] = [{**r, **meta} for r in result.tests]
    out["skipped"] = [{**r, **meta} for r in result.skipped]
    return out


# Columns of the tables that can be empty: an empty table is written as its header alone, so
# readers (pandas, R) get the right columns and no rows. Every row also carries _META_KEYS.
_META_KEYS = ["plan_hash", "estimator", "doc_set", "preregistration"]
EMPTY_COLUMNS: dict[str, list[str]] = {
    "tests": [
        "comparison", "model", "metric", "policy_a", "policy_b", "policy", "value",
        "direction", "estimate", "ci_low", "ci_high", "ci_method", "p_value", "n_docs", "doc_set",
        "p_adjusted", "correction", "alpha", "reject_h0",
    ],
    "skipped": ["store", "doc_id", "reason"],
    "recompute_check": [
        "model", "doc_id", "policy", "where", "rep", "index", "lag", "recorded", "recomputed",
    ],
    "recompute_summary": [
        "model", "rows_checked", "max_abs_diff", "disagreements", "tolerance",
    ],
}  # fmt: skip


def _write_csv(path: Path, rows: list[dict[str, Any]], columns: list[str] | None = None) -> None:
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    if not keys and columns is not None:
        keys = columns + [k for k in _META_KEYS if k not in columns]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.4g}"
    return markdown_cell(v)


def markdown_table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    head = "| " + " | ".join(map(markdown_cell, columns)) + " |\n|" + "---|" * len(columns) + "\n"
    return head + "".join(
        "| " + " | ".join(_fmt(r.get(c, "")) for c in columns) + " |\n" for r in rows
    )


def _json_safe(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _json_safe(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_json_safe(x) for x in v]
    return v


def markdown_report(result: AnalysisResult, tables: dict[str, list[dict[str, Any]]]) -> str:
    lines = [
        "# kvcouple analysis\n",
        f"- **{terminal(result.preregistration)}**",
        f"- plan: {terminal(result.plan_name or 'none')} (hash `{result.plan_hash}`)",
        f"- documents: {result.doc_set}; estimator: {result.estimator} "
        f"({'mismatch indicators, Rao-Blackwellised' if result.estimator == 'indicator' else 'branch-aligned TVs'})",
        f"- bootstrap: {result.settings.get('n_boot')} document resamples, seed "
        f"{result.settings.get('seed')}, {100 * result.settings.get('ci', 0.95):.0f}% "
        f"{result.settings.get('ci_method', 'percentile')} intervals",
        "- stores: "
        + ", ".join(
            f"`{terminal(m.store)}` ({terminal(m.model)}: T={m.horizon}, L={m.window}, "
            f"L_w={m.obs_window}, {len(m.docs)} documents)"
            for m in result.models
        ),
        "",
        "## Summary (means over documents with bootstrap CIs)\n",
        markdown_table(
            [
                r
                for r in tables["summary"]
                if r["quantity"]
                in (
                    "occurrence",
                    "mismatch_fraction",
                    "first_mismatch",
                    "exposure",
                    "rho",
                    "interval_lower",
                    "interval_upper",
                    "mean_tau",
                    "early_tv",
                    "late_tv",
                    "late_minus_early_tv",
                    "median_tau",
                    "rmst",
                )
            ],
            ["model", "policy", "quantity", "estimate", "ci_low", "ci_high", "n_docs"],
        ),
    ]
    if tables["differences"]:
        lines += [
            "\n## Paired policy differences (b - a)\n",
            markdown_table(
                [
                    r
                    for r in tables["differences"]
                    if r["quantity"]
                    in (
                        "mismatch_fraction",
                        "occurrence",
                        "exposure",
                        "rho",
                        "rmst",
                        "late_minus_early_tv",
                    )
                ],
                ["model", "policy_a", "policy_b", "quantity", "difference", "ci_low", "ci_high"],
            ),
        ]
    lines += statistics_sections(result, tables)
    if tables["recompute_summary"]:
        lines += [
            "\n## Recorded vs recomputed TVs\n",
            markdown_table(
                tables["recompute_summary"],
                ["model", "rows_checked", "max_abs_diff", "disagreements", "tolerance"],
            ),
        ]
    if tables["skipped"]:
        lines += [
            "\n## Skipped documents\n",
            markdown_table(tables["skipped"], ["store", "doc_id", "reason"]),
        ]
    lines += ["\n## Quantities\n"] + [f"- `{k}`: {v}" for k, v in QUANTITIES.items()]
    return "\n".join(lines) + "\n"


def _output(out: Path, name: str) -> Path:
    """``out / name``, with a symbolic link there removed so that writing cannot follow it."""
    path = out / name
    if path.is_symlink():
        path.unlink()
    return path


def statistics_sections(
    result: AnalysisResult, tables: dict[str, list[dict[str, Any]]]
) -> list[str]:
    """The confirmatory-statistics sections: gap attribution (with the exposure-share flag),
    survival comparisons (RMST, survival difference with its simultaneous band) and the
    plan's tests. Self-contained so the report's layout can change around it."""
    lines: list[str] = []
    if tables["gap_attribution"]:
        ref = result.settings.get("reference")
        lines += [
            "\n## Gap attribution: m_B - m_A = df + rho_bar de + e_bar drho\n",
            f"Gaps are b - a{f' with a = the reference {ref!r}' if ref else ' for every pair'}."
            " An exposure share whose gap CI includes 0 is flagged *not interpretable*.\n",
            markdown_table(
                tables["gap_attribution"],
                ["model", "policy_a", "policy_b", "term", "estimate", "ci_low", "ci_high", "note"],
            ),
        ]
    surv = tables.get("survival_differences", [])
    if surv:
        rmst = [r for r in tables["differences"] if r["quantity"] == "rmst"]
        lines += [
            "\n## Survival comparisons\n",
            "Restricted mean time to divergence E[min(tau, T)] (tokens), paired difference b - a:",
            "",
            markdown_table(
                rmst, ["model", "policy_a", "policy_b", "difference", "ci_low", "ci_high"]
            ),
            "Survival difference S_b(t) - S_a(t): largest |difference| and whether the "
            "simultaneous band (all steps at once) excludes 0 anywhere:",
            "",
        ]
        summary = []
        keys = sorted({(r["model"], r["policy_a"], r["policy_b"]) for r in surv}, key=str)
        for key in keys:
            rows = [r for r in surv if (r["model"], r["policy_a"], r["policy_b"]) == key]
            top = max(
                rows,
                key=lambda r: abs(r["difference"]) if r["difference"] == r["difference"] else -1,
            )
            apart = [r["step"] for r in rows if r["band_low"] > 0 or r["band_high"] < 0]
            summary.append(
                {
                    "model": key[0],
                    "policy_a": key[1],
                    "policy_b": key[2],
                    "max_step": top["step"],
                    "max_difference": top["difference"],
                    "band_low": top["band_low"],
                    "band_high": top["band_high"],
                    "steps_band_excludes_0": f"{len(apart)} of {len(rows)}",
                }
            )
        lines.append(
            markdown_table(
                summary,
                [
                    "model",
                    "policy_a",
                    "policy_b",
                    "max_step",
                    "max_difference",
                    "band_low",
                    "band_high",
                    "steps_band_excludes_0",
                ],
            )  # fmt: skip
        )
    if tables["tests"]:
        lines += [
            f"\n## Prespecified tests ({result.doc_set} documents; {terminal(result.preregistration)})\n",
            markdown_table(
                [
                    {**r, "tested": r["policy"] or f"{r['policy_b']} - {r['policy_a']}"}
                    for r in tables["tests"]
                ],
                [
                    "comparison",
                    "model",
                    "metric",
                    "tested",
                    "direction",
                    "value",
                    "estimate",
                    "ci_low",
                    "ci_high",
                    "p_value",
                    "p_adjusted",
                    "reject_h0",
                ],
            ),
        ]
    return lines


def write_report(
    result: AnalysisResult,
    out: str | os.PathLike[str],
    *,
    figures: bool = True,
    html_report: bool = True,
) -> Path:
    """Write every table, the figures and the HTML report into ``out``; returns ``out``.

    Files are written only inside ``out``: a symbolic link planted where an output goes is
    replaced by the file, never followed. Without matplotlib (the ``plots`` extra) the report
    is written without figures, with a warning.
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise InvalidInputError(f"out = {out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    tables = tidy_tables(result)
    for name, rows in tables.items():
        _write_csv(_output(out, f"{name}.csv"), rows, EMPTY_COLUMNS.get(name))
    payload = {
        "meta": {
            **_meta(result),
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
    _output(out, "results.json").write_text(json.dumps(_json_safe(payload), indent=1, default=str))
    md = markdown_report(result, tables)
    _output(out, "report.md").write_text(md)
    images: dict[str, bytes] = {}
    if figures:
        try:
            require("matplotlib", "the report's figures")
        except MissingExtraError as e:
            warnings.warn(f"{e}; writing the report without figures", stacklevel=2)
            figures = False
    if figures:
        from kvcouple.analysis.figures import make_figures

        stamp = (
            f"plan {result.plan_hash[:12]} | {result.estimator} | docs: {result.doc_set} | "
            + result.preregistration.split(":")[0]
        )
        folder = _output(out, "figures")
        folder.mkdir(exist_ok=True)
        for f in folder.iterdir():  # links planted inside too
            if f.is_symlink():
                f.unlink()
        images = make_figures(tables, folder, stamp)
    if html_report:
        _output(out, "report.html").write_text(html_page(md, images, result.plan_hash))
    return out


def html_page(markdown: str, images: dict[str, bytes], plan_hash: str) -> str:
    """A self-contained page: the Markdown tables as HTML, figures inlined as base64 PNG."""
    import base64

    body: list[str] = []
    in_table = False
    for line in markdown.splitlines():
        if line.startswith("|"):
            cells = [html.escape(c) for c in split_markdown_row(line)]
            if set("".join(cells)) <= set("-"):
                continue
            tag = "th" if not in_table else "td"
            if not in_table:
                body.append("<table>")
                in_table = True
            body.append("<tr>" + "".join(f"<{tag}>{c}</{tag}>" for c in cells) + "</tr>")
            continue
        if in_table:
            body.append("</table>")
            in_table = False
        if line.startswith("# "):
            body.append(f"<h1>{html.escape(line[2:])}</h1>")
        elif line.startswith("## "):
            body.append(f"<h2>{html.escape(line[3:])}</h2>")
        elif line.startswith("- "):
            body.append(f"<p>&bull; {html.escape(line[2:]).replace('`', '')}</p>")
        elif line.strip():
            body.append(f"<p>{html.escape(line)}</p>")
    if in_table:
        body.append("</table>")
    if images:
        body.append("<h2>Figures</h2>")
        for name, png in images.items():
            data = base64.b64encode(png).decode()
            body.append(
                f'<figure><img alt="{html.escape(name)}" '
                f'src="data:image/png;base64,{data}"/><figcaption>'
                f"{html.escape(name)}</figcaption></figure>"
            )
    style = (
        "body{font-family:sans-serif;max-width:1100px;margin:2em auto;color:#222}"
        "table{border-collapse:collapse;margin:1em 0;font-size:90%}"
        "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}"
        "th{background:#f0f0f0}img{max-width:100%}figure{margin:1em 0}"
    )
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>kvcouple analysis "
        f"{plan_hash[:12]}</title><style>{style}</style></head><body>"
        + "\n".join(body)
        + "</body></html>\n"
    )
