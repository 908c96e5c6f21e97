"""The per-document task of an analysis (:func:`analyze_doc`) and where it runs.

Work is split by document (a document is one chunk along ``doc`` in every variable): each task
reads one document's RB-CMC fields, estimates every policy, and for ``full``/``topk`` records
recomputes the hazards and branch TVs from the stored distributions, chunk by chunk. Locally the
tasks run a few at a time on threads (each overlapping its chunk decoding with the Rust
kernels); on a Dask cluster (``client=`` or ``scheduler=``) they run on the workers, which open
the store themselves (so the store's path must be readable from every worker: a shared
filesystem), and only the small per-document results travel back.

**Threads under Dask.** Each worker process runs kvcouple's Rust kernels in its own thread pool.
Every worker's pool is set to that worker's ``nthreads`` (``kvcouple.set_num_threads``) so that
``n_workers x threads`` stays within the machine; to choose it yourself set
``KVCOUPLE_NUM_THREADS`` in the workers' environment, or pass ``worker_threads=``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from kvcouple.analysis.estimates import UnitEstimate, estimate_unit
from kvcouple.analysis.reading import (
    SUMMARY_READ,
    RecomputeCheck,
    recompute_full,
    recompute_topk,
)
from kvcouple.errors import StoreError
from kvcouple.scheduler import check_scheduler as check_scheduler
from kvcouple.scheduler import connect_client as connect_client
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
    units: dict[str, UnitEstimate] | None
    check: RecomputeCheck | None
    error: str | None = None


def analyze_doc(info: TraceStoreReader, doc: int, options: Options) -> DocResult:
    """Everything one document contributes (a Dask task). Store damage is returned, not raised,
    so the caller decides whether to skip the document or stop."""
    doc_id = info.doc_ids[doc]
    try:
        summary = info.read_summary(doc, SUMMARY_READ)
        L = info.window
        obs = L if options.window is None else int(options.window)
        units = {
            pol: estimate_unit(
                summary["hazard"][i],
                summary["branch_step"][i],
                summary["branch_mismatch"][i],
                summary["branch_tv"][i],
                obs_window=obs,
                estimator=options.estimator,
                doc_id=doc_id,
                policy=pol,
            )
            for i, pol in enumerate(info.policies)
        }
        check = None
        if options.recompute and info.record == "full":
            check = recompute_full(info, doc, summary, options.tolerance, options.io_threads)
        elif options.recompute and info.record.startswith("topk"):
            check = recompute_topk(info, doc, summary, options.tolerance)
        return DocResult(doc, doc_id, units, check)
    except StoreError as e:
        return DocResult(doc, doc_id, None, None, str(e))


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


def run_docs(
    tasks: list[tuple[TraceStoreReader, int]],
    options: Options,
    client: Any,
    worker_threads: int | None,
    progress: bool = False,
) -> list[DocResult]:
    """Every task ``(store, document)``'s :func:`analyze_doc`, in task order: a few documents
    in flight on local threads, or one Dask task each on ``client``'s workers."""
    from tqdm import tqdm  # type: ignore[import-untyped]

    bar = tqdm(total=len(tasks), unit="doc", desc="kvcouple analyze", disable=not progress)
    try:
        if client is None:
            # A few documents in flight: a document may be one chunk per variable, and the Rust
            # engine (GIL released) decodes the chunks of all documents in flight on every
            # core. Memory: a few documents' summaries plus a block pair per engine thread.
            from concurrent.futures import ThreadPoolExecutor

            def one(task: tuple[TraceStoreReader, int]) -> DocResult:
                r = analyze_doc(task[0], task[1], options)
                bar.update(1)
                return r

            with ThreadPoolExecutor(max(1, options.io_threads)) as pool:
                return list(pool.map(one, tasks))
        from distributed import as_completed

        client.run(_limit_worker_threads, worker_threads)
        futures = client.map(
            analyze_doc, [t[0] for t in tasks], [t[1] for t in tasks], options=options, pure=False
        )
        for _ in as_completed(futures):
            bar.update(1)
        return list(client.gather(futures))
    finally:
        bar.close()
