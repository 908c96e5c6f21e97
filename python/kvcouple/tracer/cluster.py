"""A run on a Dask cluster: :func:`kvcouple.tracer.run.trace` with ``client=`` (``kvcouple
trace --scheduler``).

The setup (EOS, the engine probe, the store created or resumed) runs on one worker; the client
holds the store's writer lock, plans the run against the smallest worker's free memory (or
``memory``; :mod:`kvcouple.tracer.planner`, the plan of one process) and submits one task per
document batch; each task traces its batch and writes its documents
(:func:`~kvcouple.tracer.batches.write_batch`, the step of one process). The Dask side (models
on workers, their memory, futures with retries, progress events) is
:mod:`kvcouple.tracer.distributed`'s.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm  # type: ignore[import-untyped]

from kvcouple.policies import Policy
from kvcouple.store import StoreLayout, TraceStoreWriter
from kvcouple.store.geometry import is_url
from kvcouple.store.lock import visible, writer_lock
from kvcouple.store.text import TextTables
from kvcouple.tracer.batches import (
    BatchDocument,
    Written,
    batch_documents,
    check_model,
    with_model_eos,
    write_batch,
)
from kvcouple.tracer.distributed import (
    WORKER_MODELS,
    WorkerInfo,
    WorkerModel,
    check_fits,
    local_path,
    release_models,
    report,
    run_tasks,
    worker_address,
    worker_info,
)
from kvcouple.tracer.identity import store_identity
from kvcouple.tracer.memory import DocumentFootprint
from kvcouple.tracer.model import refresh
from kvcouple.tracer.planner import Budget, plan_run, run_policies
from kvcouple.tracer.prompts import Prompt
from kvcouple.tracer.settings import TraceSettings
from kvcouple.tracer.shape import ModelShape
from kvcouple.tracer.summary import RunSummary


@dataclass(frozen=True)
class _Setup:
    """What the setup task tells the client: the run's settings (EOS resolved), its store
    identity, the model's shape and which documents the store already has."""

    settings: TraceSettings
    layout: StoreLayout
    attrs: dict[str, Any]
    shape: ModelShape
    completed: np.ndarray
    docs_per_shard: int


def _setup_task(
    spec: WorkerModel,
    prompts: Sequence[Prompt],
    policies: list[Policy],
    settings: TraceSettings,
    out: str,
    seed: int,
    model_id: str,
    model_revision: str,
    text: TextTables | None = None,
) -> _Setup:
    """On one worker: the steps of :func:`~kvcouple.tracer.run.trace` before its batches (EOS, the engine probe,
    the store identity, the store created or resumed)."""
    model = WORKER_MODELS.get(spec)
    refresh(model)
    settings = with_model_eos(model, settings)
    check_model(model, policies)
    layout, attrs = store_identity(
        model, prompts, policies, settings, seed, model_id, model_revision
    )
    writer = TraceStoreWriter.open(out, layout, attrs, text)
    shape = ModelShape.of_model(model)
    return _Setup(settings, layout, attrs, shape, writer.completed(), writer.docs_per_shard)


@dataclass(frozen=True)
class _Batch:
    """One document batch of a task: its index in the plan (progress events name it), its
    documents, those of them the run writes, and their footprints."""

    index: int
    docs: list[BatchDocument]
    write: list[int]
    footprints: list[DocumentFootprint]


def _batch_task(
    spec: WorkerModel,
    batches: list[_Batch],
    policies: list[Policy],
    out: str,
    layout: StoreLayout,
    attrs: dict[str, Any],
    seed: int,
    topic: str,
) -> tuple[list[Written], str, int]:
    """Document batches on a worker (one, or consecutive ones sharing a Zarr shard: a shard
    is written by one task, whole): each traced whole, the documents of its ``write`` the
    store still lacks written. A retried task finds in the store what its lost attempt
    finished before the worker died (or before the client had its result): those are reported
    all the same, not rewritten, so the run's summary counts every document once. Returns the
    documents written, the worker and the models it has loaded in this run."""
    writer = TraceStoreWriter.open(out, layout, attrs)
    done = writer.completed()
    model = WORKER_MODELS.get(spec)
    refresh(model)
    check_fits([f for b in batches for f in b.footprints], model)
    writer.expect([d for b in batches for d in b.write if not done[d]])
    written: list[Written] = []
    with writer:  # the shards it holds are written on the way out, also after an error
        for b in batches:
            policy = iter(range(len(policies)))
            on_policy = functools.partial(_report_policy, topic, b.index, policy)
            kept = [d for d in b.write if done[d]]
            written += write_batch(
                model, b.docs, b.write, policies, writer, seed, on_policy, kept=kept
            )
    return written, worker_address(), WORKER_MODELS.loads


def _report_policy(topic: str, index: int, policy: Iterator[int]) -> None:
    report(topic, [index, next(policy)])


def _shard_groups(batches: list[list[int]], docs_per_shard: int) -> list[list[int]]:
    """The plan's batches (by index) grouped into tasks: consecutive batches that share a Zarr
    shard go together, so that no two tasks write the same stored object."""
    groups: list[list[int]] = []
    shards: set[int] = set()
    for i, batch in enumerate(batches):
        mine = {d // docs_per_shard for d in batch}
        if groups and mine & shards:
            groups[-1].append(i)
            shards |= mine
        else:
            groups.append([i])
            shards = mine
    return groups


def trace_on_cluster(
    client: Any,
    spec: WorkerModel,
    prompts: Sequence[Prompt],
    policies: Sequence[Policy | str],
    settings: TraceSettings,
    out: str | os.PathLike[str],
    *,
    seed: int,
    model_id: str,
    model_revision: str,
    shard: tuple[int, int],
    max_docs: int | None,
    progress: bool,
    memory: int | None,
    tokenizer: Any = None,
) -> RunSummary:
    """:func:`~kvcouple.tracer.run.trace`'s steps with the model on the workers: the setup on
    one worker, the plans against the smallest worker's free memory (or ``memory``), then one
    task a batch."""
    pols = run_policies(policies, prompts)
    out = str(out) if is_url(str(out)) else Path(out)
    where = str(out) if isinstance(out, str) else local_path(out)
    client.run(release_models)  # what an interrupted run left loaded: loads count per run
    # No retries: what fails here is the model, the policies or the store, not the worker
    # (a lost worker's task is rescheduled by the scheduler all the same).
    text = None if tokenizer is None else TextTables.of(tokenizer, [p.input_ids for p in prompts])
    setup = client.submit(
        _setup_task, spec, list(prompts), pols, settings, where, seed, model_id, model_revision,
        text, pure=False,
    ).result()  # fmt: skip
    # The client holds the lock of its part while the workers write it (kvcouple.store.lock),
    # where it sees the store (not a folder only the workers share: docs/store.md).
    lock = (
        writer_lock(where, shard, len(prompts), docs_per_shard=setup.docs_per_shard)
        if visible(where)
        else contextlib.nullcontext()
    )
    with lock:
        return _run_on_cluster(
            client, spec, prompts, pols, setup, where, out, seed=seed, shard=shard,
            max_docs=max_docs, progress=progress, memory=memory,
        )  # fmt: skip


def _run_on_cluster(
    client: Any,
    spec: WorkerModel,
    prompts: Sequence[Prompt],
    pols: list[Policy],
    setup: _Setup,
    where: str,
    out: str | Path,
    *,
    seed: int,
    shard: tuple[int, int],
    max_docs: int | None,
    progress: bool,
    memory: int | None,
) -> RunSummary:
    """:func:`trace_on_cluster` once the store exists and its part is locked: the plans,
    then one task a batch."""
    settings = setup.settings
    infos: dict[str, WorkerInfo] = client.run(worker_info, spec, setup.shape.weight_bytes)
    budget = Budget.cluster(setup.shape, infos, memory)
    run = plan_run(
        setup.shape, prompts, pols, settings, budget, shard, docs_per_shard=setup.docs_per_shard
    )
    todo = [d for d in run.documents if not setup.completed[d]]
    summary = RunSummary(out, len(prompts), skipped=len(run.documents) - len(todo))
    if max_docs is not None:
        todo = todo[:max_docs]
    chosen = set(todo)
    topic = f"kvcouple-trace-{os.getpid()}-{time.time_ns()}"
    tasks, weight = [], {}
    for group in _shard_groups(run.batches, setup.docs_per_shard):
        batches = []
        for i in group:
            batch = run.batches[i]
            write = [d for d in batch if d in chosen]
            if write:
                docs = batch_documents(prompts, settings, run.footprints, batch)
                batches.append(_Batch(i, docs, write, [run.footprints[d] for d in batch]))
                weight[i] = len(write)
        if batches:
            args = (spec, batches, pols, where, setup.layout, setup.attrs, seed, topic)
            tasks.append((f"{topic}-batch-{group[0]}", args))
    counted: set[tuple[int, int]] = set()  # (batch, policy): a retried task counts once
    total = sum(weight.values()) * len(pols)
    bar = tqdm(total=total, unit="doc-policy", disable=not progress, desc="kvcouple trace")
    start = time.perf_counter()

    def on_event(event: list[int]) -> None:
        if tuple(event) not in counted:
            counted.add((event[0], event[1]))
            bar.update(weight[event[0]])

    def on_result(result: tuple[list[Written], str, int]) -> None:
        written, worker, loads = result
        for w in written:
            summary.add(w)
        summary.model_loads[worker] = max(loads, summary.model_loads.get(worker, 0))
        elapsed = time.perf_counter() - start
        bar.set_postfix(tok_s=f"{summary.generated_tokens / max(elapsed, 1e-9):.0f}")

    try:
        run_tasks(client, _batch_task, tasks, topic=topic, on_event=on_event, on_result=on_result)
        bar.update(total - bar.n)  # events still in flight when the last result came
    finally:
        bar.close()
    summary.finish(pols, time.perf_counter() - start)
    for worker, loads in client.run(release_models).items():
        summary.model_loads[worker] = max(loads, summary.model_loads.get(worker, 0))
    return summary
