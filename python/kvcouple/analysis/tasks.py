"""The per-document task of an analysis (:func:`analyze_doc`) and where it runs.

Work is split by document (a document is one chunk along ``doc`` in every variable): each task
reads one document's RB-CMC fields, estimates every policy, and for ``full``/``topk`` records
recomputes the hazards and branch TVs from the stored distributions, chunk by chunk. Documents
are taken in batches (:func:`analyze_docs`: one engine call reads a batch's summaries, one
decodes and compares all its distributions): locally a few batches in flight on threads; on a
Dask cluster (``client=`` or ``scheduler=``) they run on the workers, which open
the store themselves (so the store's path must be readable from every worker: a shared
filesystem), and only the small per-document results travel back.

**Threads under Dask.** Each worker process runs kvcouple's Rust kernels in its own thread pool.
Every worker's pool is set to that worker's ``nthreads`` (``kvcouple.set_num_threads``) so that
``n_workers x threads`` stays within the machine; to choose it yourself set
``KVCOUPLE_NUM_THREADS`` in the workers' environment, or pass ``worker_threads=``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvcouple.analysis.estimates import (
    BatchUnits,
    UnitEstimate,
    estimate_units,
    observation_window,
)
from kvcouple.analysis.reading import (
    SUMMARY_READ,
    RecomputeCheck,
    recompute_full,
    recompute_full_engine,
    recompute_topk,
)
from kvcouple.analysis.scoreboard import (
    TOP_DELTA,
    BatchScores,
    DocScores,
    ScoreBatch,
    doc_scores,
)
from kvcouple.errors import StoreError
from kvcouple.scheduler import check_scheduler as check_scheduler
from kvcouple.scheduler import connect_client as connect_client
from kvcouple.store.engine_reads import SummaryBatch
from kvcouple.store.reader import TraceStoreReader


@dataclass(frozen=True)
class Options:
    """Per-document settings (picklable: they travel to Dask workers).

    Parameters
    ----------
    window : int or None, optional
        Observation window L_w, in decode steps, for the window/tail split. ``None``
        (the default) uses the window L stored in the trace store.
    estimator : str, optional
        Per-unit estimator: ``"indicator"`` (the default) or ``"tv"``.
    recompute : bool, optional
        Recompute stored divergences from the stored distributions and record any
        disagreement (default ``True``). Only stores recorded as ``"full"`` or ``"topk..."``
        can be recomputed.
    tolerance : float or None, optional
        Largest allowed absolute difference between a stored and a recomputed value.
        ``None`` (the default) uses a per-quantity default tolerance.
    io_threads : int, optional
        Threads used to read one document's arrays during recomputation (default 2).
    """

    window: int | None = None  # observation window L_w (default: the store's L)
    estimator: str = "indicator"
    recompute: bool = True
    tolerance: float | None = None
    io_threads: int = 2


@dataclass
class DocResult:
    doc: int
    doc_id: str
    # policy -> estimates; after kvcouple.analysis.analyze, a view of the table's row
    # (kvcouple.analysis.units.UnitView).
    units: Mapping[str, UnitEstimate] | None
    check: RecomputeCheck | None
    error: str | None = None
    # The path's scoreboard values per policy (kvcouple.analysis.scoreboard; a batch's:
    # BatchScores views); analyze folds them into the store's scoreboard
    # (ModelResult.scoreboard) and drops them.
    scores: Mapping[str, DocScores] | None = None


# Folds a batch of one store's results into the caller's accumulators (run_docs).
Fold = Callable[[TraceStoreReader, list[DocResult]], list[DocResult]]


def analyze_doc(reader: TraceStoreReader, doc: int, options: Options) -> DocResult:
    """Everything one document contributes (a Dask task). Store damage is returned, not raised,
    so the caller decides whether to skip the document or stop."""
    doc_id = reader.doc_ids[doc]
    try:
        summary = reader.read_summary(doc, SUMMARY_READ)
        units = _units(reader, [doc], [summary], options)[0]
        check = None
        if options.recompute and reader.record == "full":
            deltas: list[dict[int, np.ndarray]] = []
            check = recompute_full(
                reader, doc, summary, options.tolerance, options.io_threads, deltas
            )
            summary = _with_top_delta([summary], deltas)[0]
        elif options.recompute and reader.record.startswith("topk"):
            check = recompute_topk(reader, doc, summary, options.tolerance)
        return DocResult(doc, doc_id, units, check, scores=doc_scores(reader, doc, summary))
    except StoreError as e:
        return DocResult(doc, doc_id, None, None, str(e))


def analyze_docs(reader: TraceStoreReader, docs: list[int], options: Options) -> list[DocResult]:
    """:func:`analyze_doc` of several documents of one store as one task: their summaries read
    in one engine call and their distributions recomputed in another (every block of every
    document on every core), so that the per-call costs are paid once per batch rather than
    per document. Where anything in the batch is damaged (or the engine cannot read the
    store) the batch is redone document by document: the same results and messages as
    :func:`analyze_doc`, the damage named and only its document skipped."""
    together = _analyze_together(reader, docs, options) if len(docs) > 1 else None
    if together is not None:
        return together
    return [analyze_doc(reader, d, options) for d in docs]


def _analyze_together(
    reader: TraceStoreReader, docs: list[int], options: Options
) -> list[DocResult] | None:
    try:
        # The scoreboard's top1_agree in the same engine call; where that cannot be (a store
        # re-written without its all-False chunks has none), read apart (_agreement).
        summaries: Sequence[dict[str, Any]] | None = reader.read_summaries(
            docs, (*SUMMARY_READ, AGREEMENT)
        )
        agreed = summaries is not None
        if summaries is None:
            summaries = reader.read_summaries(docs, SUMMARY_READ)
        if summaries is None:
            return None
        units = _units(reader, docs, summaries, options)
        checks: list[RecomputeCheck | None] = [None] * len(docs)
        if options.recompute and reader.record == "full":
            deltas: list[dict[int, np.ndarray]] = []
            fused = recompute_full_engine(reader, docs, summaries, options.tolerance, deltas)
            if fused is None:
                return None
            checks = list(fused)
            summaries = _with_top_delta(summaries, deltas)
        elif options.recompute and reader.record.startswith("topk"):
            checks = [
                recompute_topk(reader, d, s, options.tolerance)
                for d, s in zip(docs, summaries, strict=True)
            ]
        agree = None if agreed else _agreement(reader, docs)
        if agree is not None:
            summaries = [{**s, AGREEMENT: a} for s, a in zip(summaries, agree, strict=True)]
        scores: list[Mapping[str, DocScores]]
        if agreed and reader.record == "summary" and isinstance(summaries, SummaryBatch):
            # No distributions to read: the batch's steps straight from its stacks.
            batch = ScoreBatch(reader.policies, summaries.stacks)
            scores = [BatchScores(batch, k) for k in range(len(docs))]
        else:
            scores = [doc_scores(reader, d, s) for d, s in zip(docs, summaries, strict=True)]
    except StoreError:
        return None
    ids = reader.doc_ids
    return [
        DocResult(d, ids[d], u, c, scores=sc)
        for d, u, c, sc in zip(docs, units, checks, scores, strict=True)
    ]


def _with_top_delta(
    summaries: Sequence[dict[str, np.ndarray]], deltas: list[dict[int, np.ndarray]]
) -> Sequence[dict[str, Any]]:
    """The summaries with the path's top-token deltas the recomputation decoded (the
    scoreboard's ``delta_p``: :func:`kvcouple.analysis.scoreboard.doc_scores`), where it
    gave them."""
    if len(deltas) != len(summaries):
        return summaries
    return [{**s, TOP_DELTA: d} for s, d in zip(summaries, deltas, strict=True)]


def _agreement(reader: TraceStoreReader, docs: list[int]) -> list[np.ndarray] | None:
    """The batch's ``top1_agree`` in one engine call (the scoreboard's same_top); None where
    the engine cannot, or a chunk is missing (each document is then read on its own, and a
    missing one only loses its same_top)."""
    try:
        got = reader.read_summaries(docs, (AGREEMENT,))
    except StoreError:
        return None
    return None if got is None else [g[AGREEMENT] for g in got]


def _units(
    reader: TraceStoreReader,
    docs: list[int],
    summaries: Sequence[dict[str, np.ndarray]],
    options: Options,
) -> list[BatchUnits]:
    """Every policy's RB-CMC units of a batch of documents from their summaries (one Rust
    call)."""
    return estimate_units(
        summaries,
        [reader.doc_ids[d] for d in docs],
        reader.policies,
        obs_window=observation_window(reader.window, options.window),
        estimator=options.estimator,
    )


def _limit_worker_threads(threads: int | None = None, dask_worker: Any = None) -> int:
    """Run on each Dask worker (``client.run`` passes ``dask_worker``): size kvcouple's Rust
    pool to the worker's thread budget."""
    import kvcouple

    n = threads
    if n is None:
        env = os.environ.get("KVCOUPLE_NUM_THREADS")
        if env:
            n = int(env)
        else:
            n = dask_worker.state.nthreads if dask_worker is not None else 0
    kvcouple.set_num_threads(int(n))
    return kvcouple.get_num_threads()


# Documents per local task (analyze_docs): enough blocks per engine call to fill the cores and
# to share the per-call costs; few enough that the batches in flight keep every core busy.
# Summary records are small (a few kB a document): their batches are larger, so that the
# per-call costs (one engine call, one value check per variable) are shared by more; 256
# documents are a whole shard of a large store.
LOCAL_BATCH = 8
SUMMARY_BATCH = 256
# Summary batches in flight beyond io_threads, locally (run_docs).
SUMMARY_EXTRA_IN_FLIGHT = 1

# The scoreboard's path variable read with the summaries (same_top).
AGREEMENT = "top1_agree"


def _batch_size(reader: TraceStoreReader) -> int:
    return SUMMARY_BATCH if reader.record == "summary" else LOCAL_BATCH


def _batches(
    tasks: list[tuple[TraceStoreReader, int]], size: int | Callable[[TraceStoreReader], int]
) -> list[tuple[TraceStoreReader, list[int]]]:
    """Consecutive tasks of one store, ``size`` documents at most per batch (or
    ``size(store)``), in task order."""
    out: list[tuple[TraceStoreReader, list[int]]] = []
    caps: dict[int, int] = {}  # each store's size, asked once
    for reader, doc in tasks:
        cap = caps.get(id(reader))
        if cap is None:
            cap = caps[id(reader)] = size(reader) if callable(size) else size
        if out and out[-1][0] is reader and len(out[-1][1]) < cap:
            out[-1][1].append(doc)
        else:
            out.append((reader, [doc]))
    return out


class _NoBar:
    """No progress shown (tqdm not imported: 20 ms of the command's start)."""

    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress_bar(total: int) -> Any:
    from tqdm import tqdm  # type: ignore[import-untyped]

    return tqdm(total=total, unit="doc", desc="kvcouple analyze")


def run_docs(
    tasks: list[tuple[TraceStoreReader, int]],
    options: Options | Mapping[TraceStoreReader, Options],
    client: Any,
    worker_threads: int | None,
    progress: bool = False,
    fold: Fold | None = None,
) -> list[DocResult]:
    """Every task ``(store, document)``'s :func:`analyze_doc`, in task order, by batches of a
    store's documents (:func:`analyze_docs`): a few in flight on local threads, or one Dask
    task each on ``client``'s workers (batches small enough that every worker thread gets
    several). ``options``: one for every store, or each store's own (its observation window
    resolved). ``fold(store, results)`` is called on each batch as it comes back (from any
    thread) and its return value kept instead: the caller folds the heavy parts into its own
    accumulators, so memory does not grow with every document's arrays."""
    keep: Fold = fold if fold is not None else (lambda _store, results: results)
    if isinstance(options, Options):
        each: dict[TraceStoreReader, Options] = {reader: options for reader, _ in tasks}
    else:
        each = dict(options)
    of = each.__getitem__
    threads_per_batch = max((o.io_threads for o in each.values()), default=1)
    bar = _progress_bar(len(tasks)) if progress else _NoBar()
    try:
        if client is None:
            # A few batches in flight: each batch's engine calls decode its chunks on every
            # core (GIL released) while another batch's Python part runs. Memory: a batch's
            # summaries plus a block pair per engine thread.
            from concurrent.futures import ThreadPoolExecutor

            def one(batch: tuple[TraceStoreReader, list[int]]) -> list[DocResult]:
                r = keep(batch[0], analyze_docs(batch[0], batch[1], of(batch[0])))
                bar.update(len(batch[1]))
                return r

            # Summary records: one batch more in flight, whose Python part fills the core the
            # engine's read leaves idle (its own Python holds the GIL part of the time).
            summary = all(reader.record == "summary" for reader in each)
            in_flight = max(1, threads_per_batch) + (SUMMARY_EXTRA_IN_FLIGHT if summary else 0)
            with ThreadPoolExecutor(in_flight) as pool:
                return [r for rs in pool.map(one, _batches(tasks, _batch_size)) for r in rs]
        from distributed import as_completed

        client.run(_limit_worker_threads, worker_threads)
        # Batches too, but small enough that every worker thread gets several.
        threads = max(1, sum(client.nthreads().values()))
        spread = len(tasks) // (4 * threads)
        batches = _batches(tasks, lambda r: max(1, min(_batch_size(r), spread)))
        futures = client.map(
            analyze_docs,
            [b[0] for b in batches],
            [b[1] for b in batches],
            [of(b[0]) for b in batches],
            pure=False,
        )
        index = {f.key: i for i, f in enumerate(futures)}
        done: list[list[DocResult]] = [[] for _ in batches]
        for f in as_completed(futures):
            i = index[f.key]
            done[i] = keep(batches[i][0], f.result())
            f.release()  # folded: the worker's copy is not needed any more
            bar.update(len(batches[i][1]))
        return [r for rs in done for r in rs]
    finally:
        bar.close()
