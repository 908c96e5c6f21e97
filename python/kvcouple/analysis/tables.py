"""The analysis as tidy tables: flat rows (one list per table) that go unchanged to CSV, JSON
and the report's Markdown. Every row carries the plan hash, the estimator, the document set and
the preregistration stamp (:func:`table_meta`)."""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

from kvcouple.analysis.estimates import SCALARS
from kvcouple.analysis.reading import TOLERANCE
from kvcouple.analysis.results import AnalysisResult
from kvcouple.analysis.scoreboard import scoreboard_rows


def table_meta(result: AnalysisResult) -> dict[str, Any]:
    """The columns every row carries: plan hash, estimator, document set, preregistration."""
    return {
        "plan_hash": result.plan_hash,
        "estimator": result.estimator,
        "doc_set": result.doc_set,
        "preregistration": result.preregistration,
    }


def tidy_tables(result: AnalysisResult) -> dict[str, list[dict[str, Any]]]:
    """Every table as a list of flat rows (the same rows go to CSV, JSON and Markdown)."""
    meta = table_meta(result)
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
            "scoreboard",
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
                    fraction = k in ("interval_lower", "interval_upper")
                    scale = m.horizon if fraction else 1
                    name = f"{k}_fraction" if fraction else k  # the registry's name for /T
                    row[name] = u.values[k] / scale
                    row[f"{name}_se"] = u.stderr[k] / scale
                row["median_tau"] = u.median_tau
                row["tail_observed"] = u.tail_observed
                out["per_document"].append({**row, **meta})
        board = (
            m.scoreboard
            if m.scoreboard is not None
            else scoreboard_rows(m.model, m.policies, m.docs)
        )
        out["scoreboard"] += [{**row, **meta} for row in board]
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
    "scoreboard": ["model", "policy", "quantity", "statistic", "estimate", "se", "n_docs", "steps"],
}  # fmt: skip


def write_csv(path: Path, rows: list[dict[str, Any]], columns: list[str] | None = None) -> None:
    """``rows`` as CSV; an empty table is its header alone (``columns`` and the meta keys)."""
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    if not keys and columns is not None:
        keys = columns + [k for k in _META_KEYS if k not in columns]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def json_safe(v: Any) -> Any:
    """``v`` with every non-finite float (nested in dicts and lists) replaced by None."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: json_safe(x) for k, x in v.items()}
    if isinstance(v, list):
        return [json_safe(x) for x in v]
    return v
