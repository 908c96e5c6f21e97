"""A whole tracing run: documents x policies into one trace store, resumable and shardable.

Each document is prefilled once and traced under every policy; its records are written as one
region of the store and marked completed last. Rerunning the same command skips completed
documents, and because every random draw depends only on ``(seed, doc index, policy index)``
the finished store equals an uninterrupted run. ``shard=(i, n)`` traces documents whose index
is ``i`` modulo ``n``, so ``n`` processes can fill one store.

:func:`trace` plans the run (:mod:`kvcouple.tracer.planner`: every document's memory footprint,
the document batches, the records' host memory) before a store exists, then traces batch after
batch (:func:`~kvcouple.tracer.batches.write_batch`) with a background writer; with a Dask
``client`` the same steps run on the cluster (:mod:`kvcouple.tracer.cluster`). A resumed run
traces a partly written batch whole again (and writes only what is missing), so its records
are those of an uninterrupted run (bit for bit when the batches are the same: the same
``doc_batch`` and, for ``auto`` on CUDA, the same free memory; else to float noise, as any
change of batch).
"""

from __future__ import annotations

import functools
import importlib
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm  # type: ignore[import-untyped]

from kvcouple.deprecation import warn_renamed
from kvcouple.policies import Policy
from kvcouple.store import TraceStoreWriter
from kvcouple.store.background import BackgroundWriter, DocumentWriter, queue_bound
from kvcouple.store.geometry import is_url
from kvcouple.store.lock import writer_lock
from kvcouple.tracer.batches import batch_documents, with_model_eos, write_batch
from kvcouple.tracer.batches import check_model as _check_model
from kvcouple.tracer.cluster import trace_on_cluster
from kvcouple.tracer.distributed import WorkerModel
from kvcouple.tracer.identity import store_identity, store_text
from kvcouple.tracer.memory import FootprintTooLargeError, host_refusal
from kvcouple.tracer.model import refresh
from kvcouple.tracer.planner import Budget, RunPlan, plan_run, run_policies
from kvcouple.tracer.prompts import Prompt
from kvcouple.tracer.settings import TraceSettings
from kvcouple.tracer.shape import ModelShape
from kvcouple.tracer.summary import RunSummary

# Names this module held before the run was split by job: importable here for one release
# (with a DeprecationWarning), at home in the module named.
_MOVED = {
    "check_model": "kvcouple.tracer.batches",
    "trace_document": "kvcouple.tracer.batches",
    "document_batches": "kvcouple.tracer.planner",
}


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        warn_renamed(f"kvcouple.tracer.run.{name}", f"{_MOVED[name]}.{name}", "moved")
        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module 'kvcouple.tracer.run' has no attribute {name!r}")


def trace(
    model: Any,
    prompts: Sequence[Prompt],
    policies: Sequence[Policy | str],
    settings: TraceSettings,
    out: str | os.PathLike[str],
    *,
    seed: int = 0,
    model_id: str = "",
    model_revision: str = "",
    shard: tuple[int, int] = (0, 1),
    max_docs: int | None = None,
    progress: bool = True,
    memory: int | None = None,
    client: Any = None,
    tokenizer: Any = None,
) -> RunSummary:
    """Trace every prompt under every policy into the store at ``out`` (created or resumed).

    Before anything is traced every document is planned (:mod:`kvcouple.tracer.memory`)
    against ``memory``: a document that cannot fit is refused up front, and
    ``branch_batch="auto"`` takes each document's largest branch batch that fits.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A causal LM, e.g. from :func:`kvcouple.models.load_model`.
    prompts : sequence of Prompt
        From :func:`kvcouple.tracer.load_prompts`.
    policies : sequence of Policy or str
        Eviction policies or their specs (``"snapkv:retain=0.5"``).
    settings : TraceSettings
        Horizon T, replicates R, branches K, window L, decoding, record level, EOS ids.
    out : path
        The trace store (``.zarr``), local or ``s3://``; rerunning resumes it.
    seed : int, default 0
        Every random draw depends only on (seed, document index, policy index).
    model_id, model_revision : str
        Recorded in the store's attributes.
    shard : (int, int), default (0, 1)
        ``(i, n)``: trace the documents whose index is ``i`` mod ``n`` (n processes, one store).
    max_docs : int, optional
        Stop after this many newly traced documents (the rest stay unfinished).
    progress : bool, default True
        Show a progress bar.
    memory : int, optional
        Bytes of device memory the run may use, weights included (default: the CUDA device's
        free memory; unknown on CPU).
    client : distributed.Client, optional
        Trace on this Dask cluster (docs/distributed-tracing.md): each document batch is one
        task; every worker loads the model once (``model`` may then be a
        :class:`~kvcouple.tracer.distributed.WorkerModel`; a loaded model stands for its
        source, dtype and attention) and writes its documents into ``out``, which every
        worker must reach (a shared filesystem or ``s3://``). The store equals one
        process's.
    tokenizer : transformers tokenizer, optional
        The model's: the store keeps the prompts' ids and every token's bytes, so that its
        text can be shown without the model (``kvcouple show``, the report). None: no text.

    Returns
    -------
    RunSummary
        Documents traced and skipped, generated tokens, seconds, mean occurrence per policy
        (``summary.format()`` prints it).

    Raises
    ------
    kvcouple.errors.InvalidInputError
        No policies or prompts, a policy given twice, a vocabulary that differs from a resumed
        store's.
    kvcouple.errors.StoreError
        ``out`` exists with other settings (the first difference is named).
    kvcouple.store.lock.StoreLockError
        Another live run writes the same part of ``out`` (or one sharing documents with it);
        the message names its process, host and start time.
    kvcouple.tracer.memory.FootprintTooLargeError
        A document, or on a cluster a batch on the worker that took it, cannot fit.
    """
    if client is not None:
        spec = model if isinstance(model, WorkerModel) else WorkerModel.of(model, model_revision)
        return trace_on_cluster(  # the client holds the writer lock; its workers write
            client, spec, prompts, policies, settings, out, seed=seed, model_id=model_id,
            model_revision=model_revision, shard=shard, max_docs=max_docs,
            progress=progress, memory=memory, tokenizer=tokenizer,
        )  # fmt: skip
    refresh(model)
    settings = with_model_eos(model, settings)
    pols = run_policies(policies, prompts)
    _check_model(model, pols)  # before the store exists: never a store with a crashed document
    out = str(out) if is_url(str(out)) else Path(out)  # object storage: s3://bucket/run.zarr
    layout, attrs = store_identity(model, prompts, pols, settings, seed, model_id, model_revision)
    # Planned before the store is touched: a document that cannot fit is refused up front, and
    # so is a run whose records (tracing, queued, writing) the host cannot hold.
    shape = ModelShape.of_model(model)
    budget = Budget.local(shape, next(model.parameters()).device, memory)
    run = plan_run(shape, prompts, pols, settings, budget, shard)
    if run.host is not None and not run.host.fits:
        raise FootprintTooLargeError(f"refusing to trace: {host_refusal(run.host)}")
    writer = TraceStoreWriter.open(out, layout, attrs, store_text(tokenizer, prompts, layout))
    # One writer of this part at a time (kvcouple.store.lock): held until the last write.
    with writer_lock(out, shard, len(prompts), docs_per_shard=writer.docs_per_shard):
        done = writer.completed()
        todo = [d for d in run.documents if not done[d]]
        summary = RunSummary(out, len(prompts), skipped=len(run.documents) - len(todo))
        if max_docs is not None:
            todo = todo[:max_docs]
        writer.expect(todo)
        # Written behind the tracing (store.background): a batch writes while the next traces.
        bound = queue_bound([len(b) for b in run.batches])
        with BackgroundWriter(writer, bound) as background:
            _write_batches(
                model, prompts, pols, settings, run, set(todo), background, summary, seed, progress
            )
    summary.writer = background.stats
    summary.seconds += background.stats.drain_seconds  # the run ends once its records are written
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return summary


def _write_batches(
    model: Any,
    prompts: Sequence[Prompt],
    policies: list[Policy],
    settings: TraceSettings,
    run: RunPlan,
    chosen: set[int],
    writer: DocumentWriter,
    summary: RunSummary,
    seed: int,
    progress: bool,
) -> None:
    """Each batch of the plan through :func:`~kvcouple.tracer.batches.write_batch`, in order,
    writing the documents ``chosen``."""
    start = time.perf_counter()
    batches = [(batch, [d for d in batch if d in chosen]) for batch in run.batches]
    total = sum(len(write) for _, write in batches) * len(policies)
    bar = tqdm(total=total, unit="doc-policy", disable=not progress, desc="kvcouple trace")
    try:
        for batch, write in batches:
            if not write:
                continue
            docs = batch_documents(prompts, settings, run.footprints, batch)
            update = functools.partial(bar.update, len(write))
            for written in write_batch(model, docs, write, policies, writer, seed, update):
                summary.add(written)
            elapsed = time.perf_counter() - start
            bar.set_postfix(tok_s=f"{summary.generated_tokens / max(elapsed, 1e-9):.0f}")
    finally:
        bar.close()
    summary.finish(policies, time.perf_counter() - start)
