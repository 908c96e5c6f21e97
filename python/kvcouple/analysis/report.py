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

This module writes every file; the rows come from :mod:`kvcouple.analysis.tables`, the
report's Markdown from :mod:`kvcouple.analysis.report_sections` (its words from
:mod:`kvcouple.analysis.report_words`), the HTML page from :mod:`kvcouple.analysis.report_html`
and the figures from :mod:`kvcouple.analysis.figures`.
"""

from __future__ import annotations

import itertools
import json
import os
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvcouple.analysis.figures import make_figures
from kvcouple.analysis.report_html import html_page
from kvcouple.analysis.report_sections import markdown_report
from kvcouple.analysis.report_words import report_title
from kvcouple.analysis.results import AnalysisResult
from kvcouple.analysis.tables import (
    EMPTY_COLUMNS,
    Rows,
    json_safe,
    table_meta,
    tidy_tables,
    write_csv,
)
from kvcouple.analysis.text_html import with_text
from kvcouple.errors import InvalidInputError, MissingExtraError, require


def _output(out: Path, name: str) -> Path:
    """``out / name``, with a symbolic link there removed so that writing cannot follow it."""
    path = out / name
    if path.is_symlink():
        path.unlink()
    return path


JSON_BLOCK = 4096  # rows of a large table encoded at a time


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    """``payload`` as JSON, one top-level key per line (readable at a glance) and each value
    compact: the C encoder (an indented dump takes Python's, ~10x slower: seconds for the
    per-document table of 10k documents). A table is written a block of rows at a time, so
    the text of 100k documents' rows is never held whole. Non-finite floats are null."""
    with path.open("w") as f:
        f.write("{")
        for i, (key, value) in enumerate(payload.items()):
            f.write(",\n" if i else "\n")
            f.write(f"{json.dumps(str(key))}: ")
            text = value.text_columns() if isinstance(value, Rows) else None
            if text is not None:  # column-wise in Rust (ASCII: json.dumps's escapes)
                f.write("[")
                f.flush()
                for j, text_block in enumerate(text.blocks("json")):
                    f.buffer.write(b", " if j else b"")  # ASCII: the same text either way
                    f.buffer.write(text_block)
                f.write("]")
            elif isinstance(value, Rows):
                f.write("[")
                rows = iter(value)
                first = True
                while block := list(itertools.islice(rows, JSON_BLOCK)):
                    f.write(("" if first else ",") + _dumps(block)[1:-1])
                    first = False
                f.write("]")
            else:
                f.write(_dumps(value))
        f.write("\n}\n")


def _write_csvs(out: Path, tables: dict[str, Any]) -> None:
    for name, rows in tables.items():
        write_csv(_output(out, f"{name}.csv"), rows, EMPTY_COLUMNS.get(name))


def _draw_figures(result: AnalysisResult, tables: dict[str, Any], out: Path) -> dict[str, bytes]:
    """The figures (``figures/*.png``), by name; none, with a warning, without matplotlib."""
    try:
        require("matplotlib", "the report's figures")
    except MissingExtraError as e:
        warnings.warn(f"{e}; writing the report without figures", stacklevel=3)
        return {}
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
    return make_figures(tables, folder, stamp)


def _dumps(value: Any) -> str:
    return json.dumps(json_safe(value), default=str)


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
    for rows in tables.values():  # made once, before the two writers below share it
        if isinstance(rows, Rows):
            rows.text_columns()
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
    # results.json and the CSVs in two threads (both format in Rust and write with the GIL
    # released: at 100k documents, 200 MB and 90 MB of text) while the figures are drawn.
    with ThreadPoolExecutor(2) as pool:
        written = [
            pool.submit(_write_json, _output(out, "results.json"), payload),
            pool.submit(_write_csvs, out, tables),
        ]
        images = _draw_figures(result, tables, out) if figures else {}
        for done in written:
            done.result()
    md = markdown_report(result, tables, list(images))
    _output(out, "report.md").write_text(md)
    if html_report:
        page = with_text(html_page(md, images, report_title(result)), result, tables)
        _output(out, "report.html").write_text(page)
    return out
