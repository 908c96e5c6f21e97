"""A whole tracing run: documents x policies into one trace store, resumable and shardable.

Each document is prefilled once and traced under every policy; its records are written as one
region of the store and marked completed last. Rerunning the same command skips completed
documents, and because every random draw depends only on ``(seed, doc index, policy index)``
the finished store equals an uninterrupted run. ``shard=(i, n)`` traces documents whose index
is ``i`` modulo ``n``, so ``n`` processes can fill one store.

Documents are traced in batches (:func:`document_batches`, ``TraceSettings.doc_batch``): the
overlap paths of a batch's documents run as one batch of rows in the shared cache layout, so
a step reads the weights once for all of them. Batches are fixed by the shard's documents,
not by what is left to do: a resumed run traces a partly written batch whole again (and
writes only what is missing), so its records are those of an uninterrupted run (bit for bit
when the batches are the same: the same ``doc_batch`` and, for ``auto`` on CUDA, the same
free memory; else to float noise, as any change of batch).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import time
import weakref
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm  # type: ignore[import-untyped]

from kvcouple.errors import InvalidInputError
from kvcouple.policies import Policy, parse_policy
from kvcouple.store import StoreLayout, TraceStoreWriter
from kvcouple.store.background import BackgroundWriter, DocumentWriter, WriterStats, queue_bound
from kvcouple.store.identity import run_identity
from kvcouple.store.lock import visible, writer_lock
from kvcouple.store.reader import is_url
from kvcouple.store.text import TextTables
from kvcouple.store.writer import VocabularyMismatchError as VocabularyMismatchError
from kvcouple.tracer.distributed import (
    WORKER_MODELS,
    WorkerInfo,
    WorkerModel,
    check_fits,
    local_path,
    release_models,
    report,
    run_budget,
    run_tasks,
    worker_address,
    worker_info,
)
from kvcouple.tracer.engine import trace_units
from kvcouple.tracer.memory import (
    DocumentPlan,
    MemoryPlanError,
    document_budget,
    host_refusal,
    plan_documents,
    plan_host,
    plan_loaded,
    run_sizes,
)
from kvcouple.tracer.model import facts, refresh
from kvcouple.tracer.model import model_eos_ids as model_eos_ids
from kvcouple.tracer.prefill import prefill_documents
from kvcouple.tracer.prompts import Prompt
from kvcouple.tracer.provenance import provenance
from kvcouple.tracer.settings import TraceSettings
from kvcouple.tracer.shape import ModelShape
from kvcouple.tracer.support import ModelSupport, UnsupportedModelError, check_support


@dataclass
class DocumentTrace:
    """One document under every policy: its store arrays (no ``doc`` axis; ``policy`` first),
    the tokens generated (both sides) and the branch batches run."""

    arrays: dict[str, np.ndarray]
    generated_tokens: int
    branch_batches: int


@dataclass
class Written:
    """What a document written to the store adds to the run's summary."""

    doc: int
    generated_tokens: int
    branch_batches: int
    occurrence: np.ndarray  # per policy: the mean over replicates of P(tau <= T)


def with_model_eos(model: Any, settings: TraceSettings) -> TraceSettings:
    """``settings`` with its EOS ids resolved: ``None`` means the model's own."""
    if settings.eos_token_ids is not None:
        return settings
    return replace(settings, eos_token_ids=facts(model).eos_ids)


# model -> the (attention implementation, policy specs) whose probe document has run.
_PROBED: weakref.WeakKeyDictionary[Any, set[tuple[Any, ...]]] = weakref.WeakKeyDictionary()


def check_model(model: Any, policies: Sequence[Policy]) -> ModelSupport:
    """Refuse a model or policy the tracer cannot serve (:func:`~kvcouple.tracer.support.
    check_support`), then trace a short probe document under every policy, plus an evicting
    one: whatever would fail mid-store fails here, before a store exists."""
    support = check_support(model, policies)
    key = (facts(model).attn_implementation, tuple(sorted(p.spec() for p in policies)))
    probed = _PROBED.setdefault(model, set())
    if key not in probed:
        _probe_engine(model, list(policies))
        probed.add(key)
    return support


def _probe_engine(model: Any, policies: list[Policy]) -> None:
    """Every policy once through the real tracer (prefill, selection, overlap path and a
    branch) on a short prompt, all in one batch; where that fails, one at a time, so that the
    failure names its policy."""
    f = facts(model)
    vocab = int(getattr(f.config, "vocab_size", 2))
    ids = torch.tensor([(3 * i + 1) % max(vocab, 1) for i in range(8)])
    settings = TraceSettings(
        horizon=2, replicates=1, branches=1, window=1, eos_token_ids=(), branch_batch=None
    )
    probe = [(ids, 0, "probe", settings)]
    every = list({p.spec(): p for p in [parse_policy("recent:budget=3"), *policies]}.values())
    with torch.inference_mode():
        try:  # every policy in one batch (one prefill); a failure is then named policy by policy
            _trace_batch(model, probe, every, seed=0)
            return
        except Exception as e:  # noqa: BLE001 - retried one at a time below, and named there
            together = e
        for policy in every:
            try:
                _trace_batch(model, probe, [policy], seed=0)
            except UnsupportedModelError as e:
                raise UnsupportedModelError(f"{f.name}: {policy.spec()}: {e}") from None
            except Exception as e:
                raise UnsupportedModelError(
                    f"{f.name}: the tracer's probe run of {policy.spec()} failed "
                    f"({type(e).__name__}: {e}); this architecture is not supported"
                ) from None
    # Each alone ran, together they did not (as the run would trace them): refuse that.
    raise UnsupportedModelError(
        f"{f.name}: the tracer's probe run of the policies together failed "
        f"({type(together).__name__}: {together}); trace them in separate runs"
    ) from None


def trace_documents_records(
    model: Any,
    documents: Sequence[tuple[Any, int, str, TraceSettings]],
    policies: Sequence[Policy],
    *,
    seed: int = 0,
    on_policy: Callable[[], object] | None = None,
) -> list[DocumentTrace]:
    """Trace a batch of documents ``(input_ids, doc index, doc id, settings)`` under every
    policy (settings differ at most in their branch batch; EOS ids ``None``: the model's);
    each policy's overlap paths run as one batch where the cache layout allows it
    (:func:`~kvcouple.tracer.engine.trace_units`). ``on_policy()`` is called after each
    policy."""
    check_model(model, policies)  # kept per model: refuses before any work
    documents = [(ids, d, i, with_model_eos(model, s)) for ids, d, i, s in documents]
    return _trace_batch(model, documents, policies, seed=seed, on_policy=on_policy)


def _trace_batch(
    model: Any,
    documents: Sequence[tuple[Any, int, str, TraceSettings]],
    policies: Sequence[Policy],
    *,
    seed: int,
    on_policy: Callable[[], object] | None = None,
) -> list[DocumentTrace]:
    """:func:`trace_documents_records` of a model and policies already checked."""
    need = any(p.NEEDS_QUERIES for p in policies)
    pres = prefill_documents(
        model,
        [torch.as_tensor(ids, dtype=torch.long) for ids, _, _, _ in documents],
        need,
        [doc_id for _, _, doc_id, _ in documents],
        policies,
    )
    units = [(pre, s, d) for pre, (_, d, _, s) in zip(pres, documents, strict=True)]
    traces = []  # per policy, per document
    for i, pol in enumerate(policies):
        traces.append(trace_units(model, units, pol, seed, i))
        if on_policy is not None:
            on_policy()
    out = []
    for j, pre in enumerate(pres):
        mine = [per_policy[j] for per_policy in traces]
        arrays = {name: np.stack([t.arrays[name] for t in mine]) for name in mine[0].arrays}
        arrays["prompt_length"] = np.asarray(pre.prompt_length, dtype=np.int32)
        out.append(
            DocumentTrace(
                arrays,
                sum(t.generated_tokens for t in mine),
                sum(t.branch_batches for t in mine),
            )
        )
    return out


# Rows of a batch of documents at most (2R per document): beyond this a decoding step is no
# longer bound by reading the weights, so more documents would not come for free.
MAX_DOC_ROWS = 128


def _pack_padding(plans: dict[int, DocumentPlan], members: list[int]) -> int:
    """Bytes the batch's prompt pack holds beyond its prompts' caches (each padded to the
    longest, :func:`~kvcouple.tracer.prefill.prefill_documents`)."""
    longest = max(plans[b].prompt_length for b in members)
    return sum(
        (longest - plans[b].prompt_length)
        * plans[b].prompt_cache
        // max(plans[b].prompt_length - 1, 1)
        for b in members
    )


def document_batches(
    documents: Sequence[int], plans: dict[int, DocumentPlan], settings: TraceSettings
) -> list[list[int]]:
    """The shard's documents in batches, in order: ``settings.doc_batch`` documents at most
    (``"auto"``: up to :data:`MAX_DOC_ROWS` rows on a device whose memory is known, one at a
    time otherwise), and never more than fit the plans' budget together (the sum of their
    planned peaks, a bound: they share the activations, plus the padding of their prompt
    pack), of prompt lengths within a factor of two (the pack pads every prompt to the
    longest, and a batch's prefix call reads that width for every document). Policies whose layout is not shared
    (decode-time eviction, windowed models) trace a batch's documents one at a time
    (:func:`~kvcouple.tracer.engine.trace_units`)."""
    budget = next((p.budget for p in plans.values() if p.budget is not None), None)
    if settings.doc_batch == "auto":
        most = max(1, MAX_DOC_ROWS // (2 * settings.replicates)) if budget is not None else 1
    else:
        most = int(settings.doc_batch)
    batches: list[list[int]] = []
    total = 0
    for d in documents:
        peak = plans[d].peak
        members = [*(batches[-1] if batches else []), d]
        lengths = [plans[b].prompt_length for b in members]
        similar = max(lengths) <= 2 * min(lengths)
        if (
            batches
            and len(batches[-1]) < most
            and similar
            and (budget is None or total + peak + _pack_padding(plans, members) <= budget)
        ):
            batches[-1].append(d)
            total += peak
        else:
            batches.append([d])
            total = peak
    return batches


def trace_document(
    model: Any,
    input_ids: Sequence[int],
    policies: Sequence[Policy | str],
    settings: TraceSettings,
    *,
    seed: int = 0,
    doc_index: int = 0,
    doc_id: str = "",
    on_policy: Callable[[], object] | None = None,
) -> tuple[dict[str, np.ndarray], int]:
    """Trace one prompt under every policy. Returns the store arrays of this document (no
    ``doc`` axis; ``policy`` first) and the number of generated tokens (both sides).
    ``on_policy()`` is called after each policy (for progress bars).

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A Hugging Face causal LM the tracer supports.
    input_ids : sequence of int
        The prompt's token ids.
    policies : sequence of Policy or str
        Policies, or specs given to :func:`~kvcouple.policies.parse_policy`.
    settings : TraceSettings
        Horizon, window, replicates, branches and decoding settings.
    seed : int
        Seed of the run. Default 0.
    doc_index : int
        The document's index in the run (its random streams depend on it). Default 0.
    doc_id : str
        The document's id, named in messages. Default ``""``.
    on_policy : callable, optional
        Called with no arguments after each policy. Default None.

    Returns
    -------
    tuple of (dict of str to numpy.ndarray, int)
        The document's store arrays and the number of generated tokens.

    Raises
    ------
    kvcouple.policies.UnknownPolicyError
        A policy spec names no registered policy.
    kvcouple.policies.PolicyParameterError
        A policy spec with a bad parameter.
    kvcouple.tracer.attention.UnsupportedModelError
        The tracer cannot serve ``model`` with these policies.
    kvcouple.tracer.prefill.PromptTooShortError
        The prompt is too short.
    """
    pols = [parse_policy(p) if isinstance(p, str) else p for p in policies]
    refresh(model)
    if settings.branch_batch == "auto":
        (plan,) = plan_loaded(model, [(doc_id, len(input_ids))], pols, settings)
        settings = replace(settings, branch_batch=plan.branch_batch)
    ids = torch.as_tensor(list(input_ids), dtype=torch.long)
    (doc,) = trace_documents_records(
        model, [(ids, doc_index, doc_id, settings)], pols, seed=seed, on_policy=on_policy
    )
    return doc.arrays, doc.generated_tokens


@dataclass
class RunSummary:
    """What one invocation of :func:`trace` did."""

    store: Path | str  # a local path, or an object-storage URL
    documents: int
    traced: list[int] = field(default_factory=list)
    skipped: int = 0
    generated_tokens: int = 0
    branch_batches: int = 0
    seconds: float = 0.0
    occurrence: dict[str, float] = field(default_factory=dict)
    # Worker address -> models it loaded during the run (a Dask run; {} in one process).
    model_loads: dict[str, int] = field(default_factory=dict)
    writer: WriterStats | None = None  # the background writer's counters (one process)
    _occurrence: dict[int, np.ndarray] = field(default_factory=dict, repr=False)

    def add(self, written: Written) -> None:
        """Count a document written."""
        self.traced.append(written.doc)
        self.generated_tokens += written.generated_tokens
        self.branch_batches += written.branch_batches
        self._occurrence[written.doc] = written.occurrence

    def finish(self, policies: Sequence[Policy], seconds: float) -> None:
        """The mean occurrence per policy, over the documents in index order (the same sum
        whatever order they were written in)."""
        self.seconds = seconds
        self.traced.sort()
        if self.traced:
            mean = np.mean([self._occurrence[d] for d in self.traced], axis=0).tolist()
            self.occurrence = dict(zip([p.spec() for p in policies], mean, strict=True))

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0

    def format(self) -> str:
        lines = [
            f"store: {self.store}",
            f"documents: {len(self.traced)} traced, {self.skipped} already done, "
            f"{self.documents} in the run",
            f"generated tokens (both sides): {self.generated_tokens} in {self.seconds:.1f} s "
            f"({self.tokens_per_second:.1f} tokens/s)",
            f"branch batches: {self.branch_batches}",
        ]
        for spec, value in self.occurrence.items():
            lines.append(f"  {spec}: mean occurrence estimate P(tau <= T) = {value:.4f}")
        return "\n".join(lines)


def parse_shard(text: str) -> tuple[int, int]:
    """``"i/N"`` -> ``(i, N)`` with ``0 <= i < N``."""
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise InvalidInputError(f"--shard must look like i/N (e.g. 0/2), got {text!r}") from None
    if n < 1 or not 0 <= i < n:
        raise InvalidInputError(f"--shard {text}: need 0 <= i < N")
    return i, n


def prompts_digest(prompts: Sequence[Prompt]) -> str:
    """SHA-256 of the documents' ids and token ids: a resumed run must trace the same prompts."""
    text = json.dumps([[p.id, list(p.input_ids)] for p in prompts], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


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
    kvcouple.tracer.memory.MemoryPlanError
        A document, or on a cluster a batch on the worker that took it, cannot fit.
    """
    if client is not None:
        spec = model if isinstance(model, WorkerModel) else WorkerModel.of(model, model_revision)
        return _trace_on_cluster(  # the client holds the writer lock; its workers write
            client, spec, prompts, policies, settings, out, seed=seed, model_id=model_id,
            model_revision=model_revision, shard=shard, max_docs=max_docs,
            progress=progress, memory=memory, tokenizer=tokenizer,
        )  # fmt: skip
    refresh(model)
    settings = with_model_eos(model, settings)
    pols = _run_policies(policies, prompts)
    check_model(model, pols)  # before the store exists: never a store with a crashed document
    out = str(out) if is_url(str(out)) else Path(out)  # object storage: s3://bucket/run.zarr
    layout, attrs = store_identity(model, prompts, pols, settings, seed, model_id, model_revision)
    index, count = shard
    mine = [d for d in range(len(prompts)) if d % count == index]
    # Planned before the store is touched: a document that cannot fit is refused up front.
    documents = [(prompts[d].id, len(prompts[d].input_ids)) for d in mine]
    plans = dict(zip(mine, plan_loaded(model, documents, pols, settings, memory), strict=True))
    # The records held on the host (tracing, queued, writing) are planned too.
    host = plan_host(layout, [len(b) for b in document_batches(mine, plans, settings)])
    if not host.fits:
        raise MemoryPlanError(f"refusing to trace: {host_refusal(host)}")
    writer = TraceStoreWriter.open(out, layout, attrs, store_text(tokenizer, prompts, layout))
    # One writer of this part at a time (kvcouple.store.lock): held until the last write.
    with writer_lock(out, shard, len(prompts)):
        done = writer.completed()
        todo = [d for d in mine if not done[d]]
        summary = RunSummary(out, len(prompts), skipped=len(mine) - len(todo))
        if max_docs is not None:
            todo = todo[:max_docs]
        chosen = set(todo)
        batches = [
            (batch, [d for d in batch if d in chosen])
            for batch in document_batches(mine, plans, settings)
        ]
        # Written behind the tracing (store.background): a batch writes while the next traces.
        with BackgroundWriter(writer, queue_bound([len(b) for b, _ in batches])) as background:
            _write_batches(
                model, prompts, pols, settings, plans, batches, background, summary, seed, progress
            )
    summary.writer = background.stats
    summary.seconds += background.stats.drain_seconds  # the run ends once its records are written
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return summary


@dataclass(frozen=True)
class _Setup:
    """What the setup task tells the client: the run's settings (EOS resolved), its store
    identity, the model's shape and which documents the store already has."""

    settings: TraceSettings
    layout: StoreLayout
    attrs: dict[str, Any]
    shape: ModelShape
    completed: np.ndarray


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
    """On one worker: the steps of :func:`trace` before its batches (EOS, the engine probe,
    the store identity, the store created or resumed)."""
    model = WORKER_MODELS.get(spec)
    refresh(model)
    settings = with_model_eos(model, settings)
    check_model(model, policies)
    layout, attrs = store_identity(
        model, prompts, policies, settings, seed, model_id, model_revision
    )
    writer = TraceStoreWriter.open(out, layout, attrs, text)
    return _Setup(settings, layout, attrs, ModelShape.of_model(model), writer.completed())


def _batch_task(
    spec: WorkerModel,
    docs: list[tuple[int, Sequence[int], str, TraceSettings]],
    write: list[int],
    plans: list[DocumentPlan],
    policies: list[Policy],
    out: str,
    layout: StoreLayout,
    attrs: dict[str, Any],
    seed: int,
    topic: str,
    index: int,
) -> tuple[list[Written], str, int]:
    """One document batch on a worker: traced whole, the documents of ``write`` the store
    still lacks written. A retried task finds in the store what its lost attempt finished
    before the worker died (or before the client had its result): those are reported all the
    same, not rewritten, so the run's summary counts every document once. Returns the
    documents of ``write``, the worker and the models it has loaded in this run."""
    writer = TraceStoreWriter.open(out, layout, attrs)
    done = writer.completed()
    model = WORKER_MODELS.get(spec)
    refresh(model)
    check_fits(plans, model)
    policy = iter(range(len(policies)))
    on_policy = lambda: report(topic, [index, next(policy)])  # noqa: E731
    kept = [d for d in write if done[d]]
    written = write_batch(model, docs, write, policies, writer, seed, on_policy, kept=kept)
    return written, worker_address(), WORKER_MODELS.loads


def _trace_on_cluster(
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
    """:func:`trace`'s steps with the model on the workers: the setup on one worker, the
    plans against the smallest worker's free memory (or ``memory``), then one task a batch."""
    pols = _run_policies(policies, prompts)
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
    lock = writer_lock(where, shard, len(prompts)) if visible(where) else contextlib.nullcontext()
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
    """:func:`_trace_on_cluster` once the store exists and its part is locked: the plans,
    then one task a batch."""
    settings = setup.settings
    index, count = shard
    mine = [d for d in range(len(prompts)) if d % count == index]
    infos: dict[str, WorkerInfo] = client.run(worker_info, spec, setup.shape.weight_bytes)
    # Every worker's plan is the same plan: the smallest free memory, or the given memory.
    budget = (
        run_budget(infos.values()) if memory is None else document_budget(setup.shape, None, memory)
    )
    documents = [(prompts[d].id, len(prompts[d].input_ids)) for d in mine]
    found = plan_documents(
        setup.shape, documents, pols, run_sizes(settings), settings.branch_batch, budget
    )
    plans = dict(zip(mine, found, strict=True))
    todo = [d for d in mine if not setup.completed[d]]
    summary = RunSummary(out, len(prompts), skipped=len(mine) - len(todo))
    if max_docs is not None:
        todo = todo[:max_docs]
    chosen = set(todo)
    topic = f"kvcouple-trace-{os.getpid()}-{time.time_ns()}"
    tasks, weight = [], {}
    for i, batch in enumerate(document_batches(mine, plans, settings)):
        write = [d for d in batch if d in chosen]
        if write:
            docs = _batch_documents(prompts, settings, plans, batch)
            args = (spec, docs, write, [plans[d] for d in batch], pols, where, setup.layout,
                    setup.attrs, seed, topic, i)  # fmt: skip
            tasks.append((f"{topic}-batch-{i}", args))
            weight[i] = len(write)
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


def _run_policies(policies: Sequence[Policy | str], prompts: Sequence[Prompt]) -> list[Policy]:
    """The run's policies, parsed; refuses none, one given twice, or no prompts."""
    pols = [parse_policy(p) if isinstance(p, str) else p for p in policies]
    if not pols:
        raise InvalidInputError("give at least one policy")
    specs = [p.spec() for p in pols]
    if len(set(specs)) != len(specs):
        raise InvalidInputError(f"a policy is given twice: {specs}")
    if not prompts:
        raise InvalidInputError("no prompts to trace")
    return pols


def store_text(tokenizer: Any, prompts: Sequence[Prompt], layout: StoreLayout) -> TextTables | None:
    """The text a new store keeps (the prompts' ids, every token's bytes): None without a
    tokenizer."""
    if tokenizer is None:
        return None
    return TextTables.of(tokenizer, [p.input_ids for p in prompts], layout.vocab_size)


def store_identity(
    model: Any,
    prompts: Sequence[Prompt],
    policies: Sequence[Policy],
    settings: TraceSettings,
    seed: int,
    model_id: str,
    model_revision: str,
) -> tuple[StoreLayout, dict[str, Any]]:
    """The store layout and run attributes of a traced run (EOS ids resolved)."""
    return run_identity(
        [p.id for p in prompts],
        [(p.spec(), p.name, p.params) for p in policies],
        horizon=settings.horizon,
        window=settings.window,
        branches=settings.branches,
        replicates=settings.replicates,
        vocab_size=facts(model).vocab,
        record=settings.record,
        model_id=model_id,
        seed=seed,
        decoding=settings.decoding.as_dict(),
        eos_token_id=list(settings.eos_token_ids or ()),
        source="model",
        prompts_sha256=prompts_digest(prompts),
        # Versions, device, dtype, attention implementation, the resolved model revision.
        **provenance(model, model_revision),
    )


def write_batch(
    model: Any,
    batch: Sequence[tuple[int, Sequence[int], str, TraceSettings]],
    write: Sequence[int],
    policies: Sequence[Policy],
    writer: DocumentWriter,
    seed: int,
    on_policy: Callable[[], object] | None = None,
    *,
    kept: Collection[int] = (),
) -> list[Written]:
    """Trace a batch ``(doc index, token ids, doc id, settings)`` whole and write the
    documents in ``write`` (a resumed batch is traced whole again: its records are an
    uninterrupted run's), but for those in ``kept``, already in the store: reported only.
    The step of a single process and of a Dask task alike."""
    docs = [(ids, d, doc_id, s) for d, ids, doc_id, s in batch]
    traced = _trace_batch(model, docs, policies, seed=seed, on_policy=on_policy)
    out = []
    for (d, *_), doc in zip(batch, traced, strict=True):
        if d in write:
            if d not in kept:
                writer.write_doc(d, doc.arrays)
            hazard = doc.arrays["hazard"].astype(np.float64)  # (policy, rep, step)
            occurrence = (1 - np.prod(1 - hazard, axis=-1)).mean(axis=-1)
            out.append(Written(d, doc.generated_tokens, doc.branch_batches, occurrence))
    return out


def _batch_documents(
    prompts: Sequence[Prompt],
    settings: TraceSettings,
    plans: dict[int, DocumentPlan],
    batch: list[int],
) -> list[tuple[int, Sequence[int], str, TraceSettings]]:
    """A batch's documents as :func:`write_batch` takes them (each at its planned branch batch)."""
    return [
        (
            d,
            prompts[d].input_ids,
            prompts[d].id,
            replace(settings, branch_batch=plans[d].branch_batch),
        )
        for d in batch
    ]


def _write_batches(
    model: Any,
    prompts: Sequence[Prompt],
    policies: list[Policy],
    settings: TraceSettings,
    plans: dict[int, DocumentPlan],
    batches: list[tuple[list[int], list[int]]],
    writer: DocumentWriter,
    summary: RunSummary,
    seed: int,
    progress: bool,
) -> None:
    """Each batch ``(documents, those to write)`` through :func:`write_batch`, in order."""
    start = time.perf_counter()
    total = sum(len(write) for _, write in batches) * len(policies)
    bar = tqdm(total=total, unit="doc-policy", disable=not progress, desc="kvcouple trace")
    try:
        for batch, write in batches:
            if not write:
                continue
            docs = _batch_documents(prompts, settings, plans, batch)
            update = functools.partial(bar.update, len(write))
            for written in write_batch(model, docs, write, policies, writer, seed, update):
                summary.add(written)
            elapsed = time.perf_counter() - start
            bar.set_postfix(tok_s=f"{summary.generated_tokens / max(elapsed, 1e-9):.0f}")
    finally:
        bar.close()
    summary.finish(policies, time.perf_counter() - start)
