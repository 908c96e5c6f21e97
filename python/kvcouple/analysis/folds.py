"""One store's accumulators while its documents are read (:class:`StoreFold`: the table's
rows and the scoreboard), and the store once read (:func:`finish_stores`: the undamaged
documents, the table's moments, the rows moved into place), for
:func:`kvcouple.analysis.engine.analyze`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvcouple.analysis import intervals
from kvcouple.analysis.estimates import BatchUnits, Table, observation_window
from kvcouple.analysis.moments import TableMoments
from kvcouple.analysis.scoreboard import BatchScores, DocScores, ScoreboardPool
from kvcouple.analysis.tasks import DocResult
from kvcouple.analysis.units import TableLayout, UnitColumns, UnitView
from kvcouple.errors import StoreError
from kvcouple.resources import check_memory
from kvcouple.store.reader import TraceStoreReader


class StoreFold:
    """One store's accumulators while its documents are read: the table's rows
    (:class:`~kvcouple.analysis.units.UnitColumns`) and the scoreboard, one slot per selected
    document. Each returning result's units become a view of its row and its scoreboard
    arrays are pooled and dropped, so memory is the table plus a few numbers per document."""

    def __init__(self, reader: TraceStoreReader, selected: list[int], cfg: dict[str, Any]) -> None:
        T, L = reader.horizon, reader.window
        self.obs_window = observation_window(L, cfg["window"])
        split = None if cfg["early_late_split"] == "half" else int(cfg["early_late_split"])
        layout = TableLayout.of(reader.policies, T, L + 1, self.obs_window, split)
        check_memory(
            f"the table of {len(selected)} documents x {layout.width} quantities",
            8 * len(selected) * layout.width,
        )
        self.reader = reader
        self.selected = selected
        self.slot = {d: i for i, d in enumerate(selected)}
        # The Gram matrix of Gaussian-limit resamples is made while the rows come in.
        many = len(selected) >= intervals.GAUSSIAN_MIN_DOCS
        gaussian = cfg["ci_method"] == "studentized" and many
        self.columns = UnitColumns(layout, len(selected), moments=gaussian)
        self.scoreboard = ScoreboardPool(reader.policies, len(selected))

    def fold(self, results: list[DocResult]) -> list[DocResult]:
        # A batch's scores go in at once where the batch came back whole; others one by one.
        scored: list[tuple[int, Mapping[str, DocScores]]] = []
        score_batches: dict[int, list[tuple[int, BatchScores]]] = {}
        for r in results:
            if isinstance(r.scores, BatchScores):
                score_batches.setdefault(id(r.scores.batch), []).append(
                    (self.slot[r.doc], r.scores)
                )
            elif r.scores:
                scored.append((self.slot[r.doc], r.scores))
        for whole in score_batches.values():
            batch = whole[0][1].batch
            if [v.d for _, v in whole] == list(range(batch.docs)):
                self.scoreboard.put_batch([slot for slot, _ in whole], batch)
            else:
                scored += whole
        self.scoreboard.put_many([slot for slot, _ in scored], [s for _, s in scored])
        # Units of one engine batch go in at once; others (built elsewhere) one by one.
        batches: dict[int, list[DocResult]] = {}
        for r in results:
            if isinstance(r.units, BatchUnits):
                batches.setdefault(id(r.units.batch), []).append(r)
            elif r.units is not None:
                r.units = self.columns.put(self.slot[r.doc], r.units)
            r.scores = None
        for group in batches.values():
            units = [r.units for r in group if isinstance(r.units, BatchUnits)]
            views = self.columns.put_batch([self.slot[r.doc] for r in group], units)
            for r, view in zip(group, views, strict=True):
                r.units = view
        self.columns.settle(self.slot[r.doc] for r in results)
        return results


@dataclass
class FinishedStore:
    """One store's documents once read: the undamaged ones, in slot order in its table, with
    the table's moments (made while reading, where the Gaussian limit needs them)."""

    label: str
    store: StoreFold
    docs: list[DocResult]
    moments: TableMoments | None
    table: Table


def finish_stores(
    labels: list[str],
    folds: list[StoreFold],
    results: list[DocResult],
    strict: bool,
    skipped: list[dict[str, str]],
) -> list[FinishedStore]:
    """Step 4: per store, its documents' results (a damaged one raises when ``strict``, else
    is added to ``skipped``), the table's moments and its rows moved into place."""
    finished = []
    pos = 0
    for label, store in zip(labels, folds, strict=True):
        reader, sel = store.reader, store.selected
        docs = results[pos : pos + len(sel)]
        pos += len(sel)
        bad = [d for d in docs if d.error is not None]
        if bad and strict:
            more = f" (and {len(bad) - 1} more damaged documents)" if len(bad) > 1 else ""
            raise StoreError(f"{bad[0].error}{more}")
        for d in bad:
            skipped.append({"store": reader.path, "doc_id": d.doc_id, "reason": str(d.error)})
        good = [d for d in docs if d.error is None]
        if not good:
            raise StoreError(f"{reader.path}: no finished, undamaged documents to analyse")
        columns = store.columns
        views = [d.units for d in good]
        if not all(isinstance(v, UnitView) and v.columns is columns for v in views):
            raise RuntimeError("a document's units were not folded into its store's table")
        moments = columns.moments()  # before finish() moves the rows
        columns.finish([v for v in views if isinstance(v, UnitView)])
        table = columns.table([d.doc_id for d in good])
        finished.append(FinishedStore(label, store, good, moments, table))
    return finished
