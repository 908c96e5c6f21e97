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
``skipped.csv`` (an empty table is its header alone), ``results.json`` (all of it: first the
per-document table, which :class:`DocumentFiles` writes while the statistics run, then
``meta`` and the other tables), ``report.md``, ``figures/*.png`` and ``report.html``
(self-contained: figures embedded as base64 PNG).

This module writes every file; the rows come from :mod:`kvcouple.analysis.tables`, the
report's Markdown from :mod:`kvcouple.analysis.report_sections` (its words from
:mod:`kvcouple.analysis.report_words`), the HTML page from :mod:`kvcouple.analysis.report_html`
and the figures from :mod:`kvcouple.analysis.figures`.
"""

from __future__ import annotations

import itertools
import json
import os
import tempfile
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

from kvcouple import _core
from kvcouple.analysis.figures import make_figures
from kvcouple.analysis.report_html import html_page
from kvcouple.analysis.report_sections import markdown_report
from kvcouple.analysis.report_words import report_title
from kvcouple.analysis.results import AnalysisResult, DocumentsReady
from kvcouple.analysis.tables import (
    EMPTY_COLUMNS,
    Rows,
    json_safe,
    per_document_table,
    table_meta,
    tidy_tables,
    write_csv,
    write_csv_header,
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


def _append_json(path: Path, payload: dict[str, Any]) -> None:
    """``payload``'s keys after those already in ``path`` (its first, written by
    :class:`DocumentFiles`), then the object's end: one top-level key per line (readable at a
    glance) and each value compact, by the C encoder (an indented dump takes Python's, ~10x
    slower: seconds for the per-document table of 10k documents). A table is written a block
    of rows at a time, so the text of 100k documents' rows is never held whole. Non-finite
    floats are null."""
    with path.open("a") as f:
        for key, value in payload.items():
            f.write(f",\n{json.dumps(str(key))}: ")
            _write_json_value(f, value)
        f.write("\n}\n")


def _write_json_value(f: IO[str], value: Any) -> None:
    """One value of ``results.json`` at the position of ``f`` (a text file)."""
    text = value.text_columns() if isinstance(value, Rows) else None
    if text is not None:  # column-wise in Rust (ASCII: json.dumps's escapes)
        f.write("[")
        f.flush()
        for j, text_block in enumerate(text.blocks("json")):
            f.buffer.write(b", " if j else b"")  # type: ignore[attr-defined]  # ASCII
            f.buffer.write(text_block)  # type: ignore[attr-defined]
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


def _remove(paths: list[Path]) -> None:
    for path in paths:
        path.unlink(missing_ok=True)


class DocumentFiles:
    """The per-document table's files, written in a thread while the statistics run:
    ``per_document.csv``, and ``results.json`` up to the end of its first key,
    ``per_document`` (at 100k documents, about 90 MB and 200 MB of text: formatted in Rust
    with the GIL released, on the cores the statistics leave idle). Pass :meth:`start` as
    :func:`~kvcouple.analysis.analyze`'s ``on_documents`` and this object to
    :func:`write_report`, which waits for the thread and finishes ``results.json``;
    :func:`write_report` alone starts one itself, so the files are the same either way.

    The files are written under temporary names in ``out`` and renamed into place when the
    report is written: where the analysis fails, :meth:`discard` removes them and the files
    of an earlier report in ``out`` are left as they were."""

    def __init__(self, out: str | os.PathLike[str]) -> None:
        self.out = Path(out)
        self.ready: DocumentsReady | None = None
        self.rows: Rows | None = None
        self._parts: dict[str, Path] = {}  # final name -> temporary file
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self, ready: DocumentsReady) -> None:
        """Start writing the documents of ``ready`` (once)."""
        if self._thread is not None:
            raise RuntimeError("DocumentFiles.start was called twice")
        _out_dir(self.out)
        self.ready = ready
        self.rows = per_document_table(ready.models, table_meta(ready))
        for name in ("per_document.csv", "results.json"):
            fd, part = tempfile.mkstemp(prefix=f".{name}.", suffix=".part", dir=self.out)
            os.close(fd)
            self._parts[name] = Path(part)
        self._thread = threading.Thread(
            target=self._write, args=(self.rows,), name="kvcouple-documents", daemon=True
        )
        self._thread.start()

    def _write(self, rows: Rows) -> None:
        csv_part, json_part = self._parts["per_document.csv"], self._parts["results.json"]
        try:
            text = rows.text_columns()
            if text is not None and rows.keys:
                # Both files in one pass in Rust, the GIL released throughout (it is the
                # statistics' meanwhile), on the cores the statistics leave: on two, a second
                # formatting thread only took the statistics' core from them.
                write_csv_header(csv_part, rows.keys)
                json_part.write_text('{\n"per_document": [')
                text.append_to(csv_part, json_part, threads=max(1, _core.get_num_threads() - 1))
                with json_part.open("a") as f:
                    f.write("]")
                return
            write_csv(csv_part, rows)
            with json_part.open("w") as f:
                f.write('{\n"per_document": ')
                _write_json_value(f, rows)
        except BaseException as e:  # raised where the caller waits (wait)
            self._error = e

    def wait(self, result: AnalysisResult) -> Rows:
        """The rows, once written; raises what the thread raised, or ``ValueError`` where
        ``result`` is not the analysis they were started for."""
        if self._thread is None or self.ready is None or self.rows is None:
            raise RuntimeError("DocumentFiles.start was not called (analyze's on_documents)")
        self._thread.join()
        if self._error is not None:
            raise self._error
        ready = self.ready
        same = len(ready.models) == len(result.models) and all(
            m.docs is r.docs and m.model == r.model and m.policies == r.policies
            for m, r in zip(result.models, ready.models, strict=False)
        )
        if not same or table_meta(ready) != table_meta(result):
            raise ValueError("the per-document files were started for another analysis")
        return self.rows

    def part(self, name: str) -> Path:
        """Where file ``name`` is being written until :meth:`commit`."""
        return self._parts[name]

    def commit(self) -> None:
        """Rename the finished files into place. Where one replaces an earlier report's file,
        that file keeps a hidden name until a thread removes it: freeing a large file's pages
        (results.json, 200 MB at 100k documents) made the renames take 0.2 s. The thread is
        not a daemon: the interpreter waits for it before exiting."""
        replaced = []
        for name, part in list(self._parts.items()):
            final = _output(self.out, name)
            old = final.with_name(f".{name}.{os.getpid()}.replaced")
            try:
                os.link(final, old)
                replaced.append(old)
            except OSError:  # no earlier file, or a file system without hard links
                pass
            os.replace(part, final)
            del self._parts[name]
        if replaced:
            threading.Thread(
                target=_remove, args=(replaced,), name="kvcouple-replaced-files"
            ).start()

    def discard(self) -> None:
        """Wait for the thread and remove what it wrote (the analysis or the report failed)."""
        if self._thread is not None:
            self._thread.join()
        for part in self._parts.values():
            part.unlink(missing_ok=True)
        self._parts.clear()


def _out_dir(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise InvalidInputError(f"out = {out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)


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
    documents: DocumentFiles | None = None,
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
    documents : DocumentFiles, optional
        The per-document files, started while ``result`` was analysed (``analyze``'s
        ``on_documents``): waited for and used rather than written again.

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
    if documents is None:
        documents = DocumentFiles(out)
        documents.start(DocumentsReady.of(result))
    elif documents.out != out:
        documents.discard()
        raise ValueError(f"the per-document files were started in {documents.out}, not {out}")
    try:
        _write_report(result, out, figures, html_report, documents)
    except BaseException:
        documents.discard()
        raise
    return out


def _write_report(
    result: AnalysisResult,
    out: Path,
    figures: bool,
    html_report: bool,
    documents: DocumentFiles,
) -> None:
    _out_dir(out)
    tables = tidy_tables(result, per_document=False)
    # The per-document table's files are being written (DocumentFiles); the rest follow.
    tables["per_document"] = documents.wait(result)  # type: ignore[assignment]
    for rows in tables.values():  # made once, before the two writers below share it
        if isinstance(rows, Rows):
            rows.text_columns()
    rest = {k: v for k, v in tables.items() if k != "per_document"}
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
        **rest,
    }
    # results.json's other keys and the other CSVs in two threads while the figures are drawn.
    with ThreadPoolExecutor(2) as pool:
        writers = [
            pool.submit(_append_json, documents.part("results.json"), payload),
            pool.submit(_write_csvs, out, rest),
        ]
        images = _draw_figures(result, tables, out) if figures else {}
        for done in writers:
            done.result()
    documents.commit()
    md = markdown_report(result, tables, list(images))
    _output(out, "report.md").write_text(md)
    if html_report:
        page = with_text(html_page(md, images, report_title(result)), result, tables)
        _output(out, "report.html").write_text(page)
