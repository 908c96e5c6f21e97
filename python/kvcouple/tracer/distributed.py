"""Tracing on a Dask cluster: what a worker keeps and reports, and the client's task loop.

:func:`kvcouple.tracer.run.trace` with ``client=`` (``kvcouple trace --scheduler``) makes each
document batch one Dask task; this module holds the Dask side of it, and nothing of the
tracing itself (that is :mod:`kvcouple.tracer.run`'s, the same code a single process runs):

- :class:`WorkerModel` says how a worker loads the run's model; :data:`WORKER_MODELS`, one per
  worker process, loads each ``(source, revision, dtype, device, attention)`` once and keeps it
  for the run (released when the run ends), counting its loads.
- :func:`worker_info` reports a worker's device and free memory (the plan across workers, the
  dry run); :func:`check_fits` refuses a batch the worker's device cannot hold, with the memory
  plan's figure, before anything is allocated.
- :func:`run_tasks` submits the batches as futures with Dask retries (a lost worker's task is
  rescheduled by Dask itself), on one ``GPU`` resource each where the workers declare it, and
  feeds one progress bar from the workers' per-policy events.

dask and distributed are imported only when a function needs them (the ``dask`` extra).
"""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvcouple.errors import require
from kvcouple.models import load_model
from kvcouple.tracer.memory import (
    DEFAULT_MARGIN,
    DocumentFootprint,
    FootprintTooLargeError,
    device_budget,
    human,
)
from kvcouple.tracer.model import facts
from kvcouple.tracer.provenance import device_name, resolved_revision

# Dask retries of a task that raised (a lost worker's task is rescheduled by the scheduler
# itself, up to its ``distributed.scheduler.allowed-failures``).
RETRIES = 2


@dataclass(frozen=True)
class WorkerModel:
    """How a worker loads the run's model (and the key of its cache): a Hub id or a path every
    worker can read, the revision, dtype and attention implementation, and the device (None:
    the worker's GPU, ``cuda`` as dask-cuda or ``CUDA_VISIBLE_DEVICES`` gives it, else cpu)."""

    source: str
    revision: str | None = None
    dtype: str | None = None
    attn_implementation: str = "sdpa"
    device: str | None = None

    @classmethod
    def of(cls, model: Any, revision: str | None = None) -> WorkerModel:
        """The spec of a loaded model: its source, dtype and attention (any device)."""
        source = getattr(model, "name_or_path", "") or getattr(model.config, "_name_or_path", "")
        if not source:
            raise ValueError("the model names no source (name_or_path): give a WorkerModel")
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        rev = resolved_revision(model, revision) or None
        return cls(str(source), rev, dtype, facts(model).attn_implementation)

    def worker_device(self) -> torch.device:
        """The device this spec puts the model on, in the calling process."""
        if self.device is not None:
            return torch.device(self.device)
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def cache_key(self) -> tuple[str, str | None, str | None, str, str]:
        """What a worker's cache tells models apart by (the device as resolved there)."""
        device = str(self.worker_device())
        return (self.source, self.revision, self.dtype, self.attn_implementation, device)

    def load(self) -> Any:
        extra: dict[str, Any] = {"attn_implementation": self.attn_implementation}
        if self.revision:
            extra["revision"] = self.revision
        model, _ = load_model(self.source, device=self.worker_device(), dtype=self.dtype, **extra)
        return model


class WorkerModels:
    """The models one worker process holds, loaded once per key and kept until released."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # two threads of one worker must not load twice
        self._models: dict[tuple[Any, ...], Any] = {}
        self.loads = 0

    def get(self, spec: WorkerModel) -> Any:
        key = spec.cache_key()
        with self._lock:
            if key not in self._models:
                self._models[key] = spec.load()
                self.loads += 1
            return self._models[key]

    def loaded(self, spec: WorkerModel) -> bool:
        return spec.cache_key() in self._models

    def release(self) -> int:
        """Drop every model (their device memory back to the device); the loads counted."""
        with self._lock:
            loads, self.loads = self.loads, 0
            self._models.clear()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return loads


WORKER_MODELS = WorkerModels()


def release_models() -> int:
    """Run on every worker when a run ends (``client.run``): its models released; the number
    of loads it made during the run."""
    return WORKER_MODELS.release()


@dataclass(frozen=True)
class WorkerInfo:
    """One worker's device and what a document batch may use of it."""

    device: str  # e.g. "cuda:0 (NVIDIA H200)" or "cpu"
    free: int | None  # free device memory in bytes (None: not known, CPU)
    budget: int | None  # bytes a batch may use (weights reserved if not loaded yet)


def worker_info(spec: WorkerModel, weight_bytes: int) -> WorkerInfo:
    """This worker's device and free memory (run on every worker by ``client.run``)."""
    device = spec.worker_device()
    if device.type != "cuda" or not torch.cuda.is_available():
        return WorkerInfo(device.type, None, None)
    free, _ = torch.cuda.mem_get_info(device)
    reserve = 0 if WORKER_MODELS.loaded(spec) else weight_bytes
    name = f"{device} ({device_name(device)})"
    return WorkerInfo(name, int(free), device_budget(device, DEFAULT_MARGIN, reserve=reserve))


def run_budget(infos: Iterable[WorkerInfo]) -> int | None:
    """The budget the run plans with: the smallest worker's (any worker can take any batch,
    and the batches do not depend on which one does); None when no worker's is known."""
    known = [i.budget for i in infos if i.budget is not None]
    return min(known) if known else None


def check_fits(footprints: Sequence[DocumentFootprint], model: Any) -> None:
    """Refuse a batch whose planned peak (the sum of its documents' peaks) exceeds what this
    process's device has free now: :class:`FootprintTooLargeError` with the figures."""
    device = next(model.parameters()).device
    budget = device_budget(device)
    need = sum(p.peak for p in footprints)
    if budget is None or need <= budget:
        return
    worker = worker_address()
    worker = f"worker {worker}: " if worker else ""
    ids = ", ".join(repr(p.doc_id) for p in footprints)
    raise FootprintTooLargeError(
        f"{worker}{device} ({device_name(device)}) has {human(budget)} free for a batch, but "
        f"the memory footprint of documents {ids} needs {human(need)} at its peak "
        f"(largest: {human(max(p.peak for p in footprints))}); give the run less --memory, or "
        "workers with more free device memory"
    )


def worker_address() -> str:
    """The Dask worker's address inside a worker, else ``""``."""
    try:
        from distributed import get_worker

        return str(get_worker().address)
    except (ImportError, ValueError):
        return ""


def report(topic: str, event: list[int]) -> None:
    """Log a progress event to the client (a no-op outside a Dask worker)."""
    try:
        from distributed import get_worker

        worker = get_worker()
    except (ImportError, ValueError):
        return
    worker.log_event(topic, event)


def gpu_resources(client: Any) -> dict[str, int] | None:
    """``{"GPU": 1}`` when every worker declares a GPU resource (``--resources GPU=1``; then a
    worker runs one batch at a time whatever its threads), else None."""
    try:
        info = client.scheduler_info(n_workers=-1)  # every worker, not the first few
    except TypeError:  # distributed before 2025: every worker already
        info = client.scheduler_info()
    workers = info["workers"].values()
    if workers and all(w.get("resources", {}).get("GPU", 0) >= 1 for w in workers):
        return {"GPU": 1}
    return None


def run_tasks(
    client: Any,
    fn: Callable[..., Any],
    tasks: Sequence[tuple[str, tuple[Any, ...]]],
    *,
    topic: str,
    on_event: Callable[[list[int]], None],
    on_result: Callable[[Any], None],
) -> None:
    """Submit ``fn(*args)`` for each ``(key, args)`` with Dask retries (and a GPU each where the
    workers declare one), call ``on_event`` for each event workers log under ``topic`` and
    ``on_result`` with each result as it arrives. The first task that fails for good cancels
    the rest and its error is raised."""
    distributed = require("distributed", "trace --scheduler")
    resources = gpu_resources(client)
    client.subscribe_topic(topic, lambda event: on_event(list(event[1])))
    futures = [
        client.submit(fn, *args, key=key, pure=False, retries=RETRIES, resources=resources)
        for key, args in tasks
    ]
    try:
        for future in distributed.as_completed(futures):
            on_result(future.result())  # raises the task's own error (after its retries)
            # Its result is the client's now: a worker lost later must not rerun the batch.
            future.release()
    finally:
        client.cancel([f for f in futures if not f.done()])
        client.unsubscribe_topic(topic)


def format_workers(
    infos: dict[str, WorkerInfo],
    batches: Sequence[Sequence[int]],
    footprints: dict[int, DocumentFootprint],
) -> str:
    """The dry run's plan per worker: device, free memory, and the batches it could take."""
    needs = [sum(footprints[d].peak for d in b) for b in batches]
    n = len(infos)
    lines = [f"workers: {n}; {len(batches)} batches, about {len(batches) / max(n, 1):.1f} each"]
    for address, info in sorted(infos.items()):
        fits = len(needs) if info.budget is None else sum(need <= info.budget for need in needs)
        memory = (
            "free memory not known (no limit)"
            if info.budget is None
            else f"free {human(info.free)}, for a batch {human(info.budget)}"
        )
        lines.append(
            f"  {address}: {info.device}, {memory}: fits {fits} of {len(batches)} batches"
            + ("" if fits == len(batches) else " (the others would fail on this worker)")
        )
    return "\n".join(lines)


def local_path(out: str | os.PathLike[str]) -> str:
    """A local store path as every worker on this machine reads it (absolute)."""
    return os.path.abspath(os.fspath(out))
