"""The analysis as tidy tables: flat rows (one list per table) that go unchanged to CSV, JSON
and the report's Markdown. Every row carries the plan hash, the estimator, the document set and
the preregistration stamp (:func:`table_meta`)."""

from __future__ import annotations

import csv
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, overload

import numpy as np

from kvcouple import _core
from kvcouple.analysis.estimates import SCALARS
from kvcouple.analysis.reading import TOLERANCE
from kvcouple.analysis.results import (
    AnalysisResult,
    DocumentsReady,
    ModelResult,
    StoreDocuments,
)
from kvcouple.analysis.scoreboard import scoreboard_rows
from kvcouple.analysis.units import UnitView


def table_meta(result: AnalysisResult | DocumentsReady) -> dict[str, Any]:
    """The columns every row carries: plan hash, estimator, document set, preregistration."""
    return {
        "plan_hash": result.plan_hash,
        "estimator": result.estimator,
        "doc_set": result.doc_set,
        "preregistration": result.preregistration,
    }


def tidy_tables(
    result: AnalysisResult, per_document: bool = True
) -> dict[str, list[dict[str, Any]]]:
    """Every table as a list of flat rows (the same rows go to CSV, JSON and Markdown);
    without ``per_document``, that table is left empty for the caller, who has its rows
    (:class:`~kvcouple.analysis.report.DocumentFiles`: 100k documents, 40 ms to make again)."""
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
    if per_document:
        out["per_document"] = per_document_table(result.models, meta)  # type: ignore[assignment]
    for name, rows in result.pooled.items():  # across models: "model" names the pool
        out[name] += [{**row, **meta} for row in rows]
    out["recompute_check"] = [{**r, **meta} for r in result.checks()]
    out["tests"] = [{**r, **meta} for r in result.tests]
    out["skipped"] = [{**r, **meta} for r in result.skipped]
    return out


def _scalar_columns(horizon: int) -> tuple[list[str], np.ndarray]:
    """The per-document table's scalar columns (each then its ``_se``) and each scalar's
    divisor: one unit per column name, the sharp interval a fraction of T here as in
    summary.csv (the registry's ``_fraction`` name), the other scalars counts (tokens)."""
    fractions = ("interval_lower", "interval_upper")
    names = [f"{k}_fraction" if k in fractions else k for k in SCALARS]
    scale = np.array([float(horizon) if k in fractions else 1.0 for k in SCALARS])
    return [c for n in names for c in (n, f"{n}_se")], scale


def per_document_table(
    models: Sequence[ModelResult | StoreDocuments], meta: dict[str, Any]
) -> Rows:
    """The per-document table (``per_document.csv``): every model's rows one after another,
    each carrying ``meta``. The same rows from the :class:`DocumentsReady` an analysis hands
    its ``on_documents`` callback as from its result."""
    return Rows.chain([_per_document(m, meta) for m in models])


def _per_document(m: ModelResult | StoreDocuments, meta: dict[str, Any]) -> Rows:
    """One row per (document, policy) of model ``m``: its scalars and their standard errors,
    median tau and whether the tail was observed. Read as columns from the table the units
    live in (:class:`~kvcouple.analysis.units.UnitView`), else unit by unit; the rows are
    made when iterated (:class:`Rows`)."""
    columns, scale = _scalar_columns(m.horizon)
    docs = [d for d in m.docs if d.units is not None]
    views = [d.units for d in docs if isinstance(d.units, UnitView)]
    table = views[0].columns if views else None
    if len(views) != len(docs) or any(v.columns is not table for v in views):
        table = None
    made: list[list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = []

    def per_policy() -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        # Gathered when the rows are first made (in DocumentFiles' thread, beside the
        # statistics, which only read the table), then kept.
        if made:
            return made[0]
        out: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        slots = np.fromiter((v.slot for v in views), np.int64, len(views))
        for pol in m.policies:
            if table is not None:
                values, stderr = table.scalar_rows(slots, pol)
                k = table.layout.policies.index(pol)
                median = table.median_tau[slots, k]
                tail = table.tail_observed[slots, k]
            else:
                units = [d.units[pol] for d in docs]  # type: ignore[index]
                n = len(SCALARS)
                values = np.array([[u.values[k] for k in SCALARS] for u in units]).reshape(-1, n)
                stderr = np.array([[u.stderr[k] for k in SCALARS] for u in units]).reshape(-1, n)
                median = np.array([u.median_tau for u in units], np.float64)
                tail = np.array([u.tail_observed for u in units], bool)
            both = np.empty((len(docs), 2 * len(SCALARS)))
            both[:, 0::2], both[:, 1::2] = values / scale, stderr / scale
            out.append((both, median, tail))
        made.append(out)
        return made[0]

    keys = ["model", "doc_id", "policy", *columns, "median_tau", "tail_observed", *meta]
    rest = list(meta.values())
    ids = [d.doc_id for d in docs]

    def rows() -> Iterator[dict[str, Any]]:
        for i, doc_id in enumerate(ids):
            for pol, (both, median, tail) in zip(m.policies, per_policy(), strict=True):
                row = [m.model, doc_id, pol, *both[i].tolist(), float(median[i]), bool(tail[i])]
                yield dict(zip(keys, row + rest, strict=True))

    def text() -> ColumnRows | None:
        # The same rows column-wise (document-major, as rows() makes them).
        labels = [[m.model], [str(i) for i in ids], list(m.policies), *([v] for v in rest)]
        if not all(isinstance(v, str) for v in rest):
            return None
        n, P, width = len(ids), len(m.policies), len(columns) + 1
        numbers = np.empty((n, P, width))
        for k, (both, median, _) in enumerate(per_policy()):
            numbers[:, k, :-1], numbers[:, k, -1] = both, median
        codes = np.zeros((n, P, len(labels)), np.uint32)
        codes[:, :, 1] = np.arange(n, dtype=np.uint32)[:, None]
        codes[:, :, 2] = np.arange(P, dtype=np.uint32)[None, :]
        flags = np.stack([tail for _, _, tail in per_policy()], axis=1).astype(bool)
        spec = [("model", "label", 0), ("doc_id", "label", 1), ("policy", "label", 2)]
        spec += [(c, "number", j) for j, c in enumerate([*columns, "median_tau"])]
        spec += [("tail_observed", "flag", 0)]
        spec += [(k, "label", 3 + j) for j, k in enumerate(meta)]
        return ColumnRows(
            spec,
            numbers.reshape(n * P, width),
            flags.reshape(n * P, 1),
            codes.reshape(n * P, len(labels)),
            labels,
        )

    return Rows(keys, len(ids) * len(m.policies), rows, text)


@dataclass(frozen=True)
class ColumnRows:
    """A table's rows column-wise: ``columns`` (name, kind, j) in order, each reading column j
    of ``numbers`` (rows x width), ``flags`` or ``codes`` (indices into ``labels[j]``). The
    Rust writer takes them so (:class:`kvcouple._core.TextColumns`), and a reader of
    many rows takes a column as an array (:meth:`column`)."""

    columns: list[tuple[str, str, int]]
    numbers: np.ndarray
    flags: np.ndarray
    codes: np.ndarray
    labels: list[list[str]]

    def __len__(self) -> int:
        return int(self.numbers.shape[0])

    def column(self, name: str) -> np.ndarray:
        """Column ``name`` over the rows: floats, bools, or (labels) an object array of str."""
        for key, kind, j in self.columns:
            if key == name:
                if kind == "number":
                    return self.numbers[:, j]
                if kind == "flag":
                    return self.flags[:, j]
                return np.asarray(self.labels[j], dtype=object)[self.codes[:, j]]
        raise KeyError(name)

    def text(self, fmt: str, start: int, stop: int) -> bytes:
        """Rows ``start..stop`` as ``fmt`` text: "csv" (as ``csv.writer`` writes them) or
        "json" (as ``json.dumps`` writes a list of the row dicts, between its brackets, with
        non-finite numbers null)."""
        return self._engine.text(fmt, start, stop)

    def append_to(self, csv_path: Path, json_path: Path, threads: int = 0) -> None:
        """Every row appended to ``csv_path`` as CSV and to ``json_path`` as JSON rows (the
        bytes :meth:`text` gives), in one pass in Rust with the GIL released throughout, on at
        most ``threads`` of the kernels' threads (0: all)."""
        self._engine.append_to(csv_path, json_path, threads=threads)

    @cached_property
    def _engine(self) -> _core.TextColumns:
        # The Rust writer's copy of the labels, made once for every block and format.
        return _core.TextColumns(
            self.columns,
            np.ascontiguousarray(self.numbers, np.float64),
            np.ascontiguousarray(self.flags, np.bool_),
            np.ascontiguousarray(self.codes, np.uint32),
            self.labels,
        )

    def blocks(self, fmt: str, rows: int = 1 << 12) -> Iterator[bytes]:
        """All rows as ``fmt`` text, ``rows`` at a time (JSON: the blocks joined by ", ")."""
        for start in range(0, len(self), rows):
            yield self.text(fmt, start, min(start + rows, len(self)))

    @staticmethod
    def chain(parts: Sequence[ColumnRows]) -> ColumnRows | None:
        """The rows of ``parts`` (the same columns) one after another; None when they differ."""
        if not parts or any(p.columns != parts[0].columns for p in parts):
            return None
        if len(parts) == 1:  # one model: its columns as they are (no copy of 200k rows)
            return parts[0]
        labels: list[list[str]] = [[] for _ in parts[0].labels]
        codes = []
        for p in parts:
            offsets = np.array([len(lab) for lab in labels], np.uint32)
            codes.append(p.codes + offsets)
            for j, lab in enumerate(p.labels):
                labels[j] += lab
        return ColumnRows(
            parts[0].columns,
            np.concatenate([p.numbers for p in parts]),
            np.concatenate([p.flags for p in parts]),
            np.concatenate(codes),
            labels,
        )


class Rows(Sequence[dict[str, Any]]):
    """A table's rows made when iterated, from arrays the analysis holds (the per-document
    table: as dicts, ~2 kB a row, 100k documents x 2 policies would hold ~400 MB). Every row
    has the columns ``keys`` in order; each pass over it builds the rows again."""

    def __init__(
        self,
        keys: list[str],
        length: int,
        make: Callable[[], Iterator[dict[str, Any]]],
        text: Callable[[], ColumnRows | None] | None = None,
    ):
        """``text``: the same rows column-wise (:class:`ColumnRows`), for the CSV and JSON
        writers; None where they are not at hand."""
        self.keys, self.length, self.make = list(keys), int(length), make
        self._text = text
        self._columns: ColumnRows | None = None

    def text_columns(self) -> ColumnRows | None:
        """The rows column-wise, made when first asked (None: write them row by row)."""
        if self._text is not None:
            self._columns, self._text = self._text(), None
        return self._columns

    @staticmethod
    def chain(parts: list[Rows]) -> Rows:
        """The rows of ``parts`` (which share their columns) one after another."""
        keys = parts[0].keys if parts else []
        if any(part.keys != keys for part in parts):
            raise ValueError("chained rows must have the same columns")

        def rows() -> Iterator[dict[str, Any]]:
            for part in parts:
                yield from part

        def text() -> ColumnRows | None:
            columns = [p.text_columns() for p in parts]
            if any(c is None for c in columns):
                return None
            return ColumnRows.chain([c for c in columns if c is not None])

        return Rows(keys, sum(len(p) for p in parts), rows, text)

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self.make()

    @overload
    def __getitem__(self, i: int) -> dict[str, Any]: ...
    @overload
    def __getitem__(self, i: slice) -> list[dict[str, Any]]: ...
    def __getitem__(self, i: int | slice) -> dict[str, Any] | list[dict[str, Any]]:
        if isinstance(i, slice):
            return list(self)[i]
        n = self.length
        if not -n <= i < n:
            raise IndexError(i)
        return next(itertools.islice(iter(self), i % n, None))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Rows | list):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __repr__(self) -> str:
        return f"Rows({self.length} rows x {len(self.keys)} columns)"


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


def write_csv_header(path: Path, keys: list[str]) -> None:
    """A CSV file of the header row ``keys`` alone (rows are appended after it)."""
    with path.open("w", newline="") as f:
        csv.writer(f).writerow(keys)


def write_csv(path: Path, rows: Sequence[dict[str, Any]], columns: list[str] | None = None) -> None:
    """``rows`` as CSV; an empty table is its header alone (``columns`` and the meta keys)."""
    text = rows.text_columns() if isinstance(rows, Rows) and rows.keys else None
    if isinstance(rows, Rows) and text is not None:
        # Column-wise in Rust, a block of rows at a time (the bytes csv.writer writes).
        write_csv_header(path, rows.keys)
        with path.open("ab") as fb:
            for block in text.blocks("csv"):
                fb.write(block)
        return
    if isinstance(rows, Rows) and rows.keys:
        # Columns known, every row in their order: streamed, never held.
        with path.open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(rows.keys)
            w.writerows(row.values() for row in rows)
        return
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    if not keys and columns is not None:
        keys = columns + [k for k in _META_KEYS if k not in columns]
    with path.open("w", newline="") as f:
        dw = csv.DictWriter(f, fieldnames=keys)
        dw.writeheader()
        dw.writerows(rows)


def json_safe(v: Any) -> Any:
    """``v`` with every non-finite float (nested in dicts and lists) replaced by None."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: _safe(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_safe(x) for x in v]
    return v


def _safe(x: Any) -> Any:
    # json_safe, with the common leaves (finite floats, strings, ints) returned at once.
    t = type(x)
    if t is float:
        return x if x - x == 0.0 else None  # inf - inf and nan - nan are nan
    if t is str or t is int or t is bool or x is None:
        return x
    return json_safe(x)
