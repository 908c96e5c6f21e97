"""What :func:`kvcouple.analysis.analyze` returns: one :class:`ModelResult` per store (its
documents, tables, bootstrap and scoreboard) inside an :class:`AnalysisResult`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvcouple.analysis.bootstrap import Bootstrap
from kvcouple.analysis.estimates import Table
from kvcouple.analysis.tasks import DocResult
from kvcouple.store.reader import TraceStoreReader

__all__ = ["AnalysisResult", "DocumentsReady", "ModelResult", "StoreDocuments"]


@dataclass
class ModelResult:
    """The analysis of one store (one model)."""

    model: str
    store: str
    policies: list[str]
    horizon: int
    window: int  # stored L
    obs_window: int  # L_w used for the window/tail split
    docs: list[DocResult]
    tables: dict[str, list[dict[str, Any]]]
    bootstrap: Bootstrap | None = None
    table: Table | None = None
    # The scoreboard's rows (kvcouple.analysis.scoreboard), pooled as the documents came back.
    scoreboard: list[dict[str, Any]] | None = None
    # Each document's mean over its path steps, aligned with ``docs``: {"kl_pq": {policy:
    # means}, "same_top": ...} (ScoreboardPool.doc_means; report.html's per-document table).
    path_means: dict[str, dict[str, np.ndarray]] | None = None
    # The reader the analysis opened (its storage options, and the documents as it found
    # them): the report's text views read through it rather than opening the store again.
    reader: TraceStoreReader | None = field(default=None, compare=False, repr=False)

    def open_reader(self) -> TraceStoreReader:
        """The analysis's reader of the store, or a new one (a result built by hand)."""
        if self.reader is None:
            self.reader = TraceStoreReader(self.store)
        return self.reader


@dataclass(frozen=True)
class StoreDocuments:
    """One store's analysed documents, each with its estimates (its :class:`DocResult`'s
    ``units``), as they stand once read and before the statistics."""

    model: str
    policies: list[str]
    horizon: int
    docs: list[DocResult]


@dataclass(frozen=True)
class DocumentsReady:
    """What :func:`kvcouple.analysis.analyze` hands its ``on_documents`` callback once every
    document is read and before the statistics run: the per-document estimates of every store
    and the stamps every output row carries (those of the :class:`AnalysisResult` to come).
    Its documents are the result's (``models[i].docs``); nothing in them changes after."""

    models: list[StoreDocuments]
    estimator: str
    doc_set: str
    plan_hash: str
    preregistration: str

    @classmethod
    def of(cls, result: AnalysisResult) -> DocumentsReady:
        """The documents of a finished analysis, as its ``on_documents`` was handed them."""
        return cls(
            [StoreDocuments(m.model, m.policies, m.horizon, m.docs) for m in result.models],
            result.estimator,
            result.doc_set,
            result.plan_hash,
            result.preregistration,
        )


@dataclass
class AnalysisResult:
    """The result of :func:`kvcouple.analysis.analyze`: one entry per store, plus the plan's tests.

    Attributes
    ----------
    models : list of ModelResult
        The analysis of each store (one model per store), in the order the stores were given.
    estimator : str
        The per-unit estimator used: ``"indicator"`` or ``"tv"``.
    doc_set : str
        The documents analysed: ``"all"``, ``"exploratory"`` or ``"confirmatory"``.
    plan_hash : str
        SHA-256 hash of the completed plan content, or ``"none"`` without a plan.
    plan_name : str or None
        The plan's name, or ``None`` without a plan.
    tests : list of dict
        One row per comparison the plan registers (empty without a plan).
    skipped : list of dict
        Documents left out of the analysis (for example damaged or unfinished ones), each
        with the reason.
    settings : dict
        Every number-changing setting used, with the recomputation settings and the store
        paths (``"stores"``).
    preregistration : str
        ``"preregistered: ..."`` or ``"not preregistered: <why>"``; stamped on every output.
        Default ``"not preregistered: no plan"``.
    pooled : dict
        Gap attribution pooled across models (key ``"gap_attribution"``) when the settings
        ask for pooling; empty otherwise.
    """

    models: list[ModelResult]
    estimator: str
    doc_set: str
    plan_hash: str
    plan_name: str | None
    tests: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[dict[str, str]] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)
    # "preregistered: ..." or "not preregistered: <why>", stamped on every output.
    preregistration: str = "not preregistered: no plan"
    pooled: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def checks(self) -> list[dict[str, Any]]:
        """Recomputation summary per model and the disagreements themselves."""
        rows = []
        for m in self.models:
            for d in m.docs:
                if d.check is None:
                    continue
                for x in d.check.disagreements:
                    rows.append({"model": m.model, **x.__dict__})
        return rows
