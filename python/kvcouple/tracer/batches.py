"""Tracing a batch of documents: the engine probe, every policy over the batch, its records.

:func:`trace_documents_records` prefills a batch's documents once and runs each policy's overlap paths as
one batch of rows where the cache layout allows it (:func:`~kvcouple.tracer.engine.
trace_units`); :func:`write_batch` hands the documents the store lacks to a writer, the step a
single process (:mod:`kvcouple.tracer.run`) and a Dask task (:mod:`kvcouple.tracer.cluster`)
take alike. :func:`check_model` traces a short probe document first, so that what would fail
mid-store fails before a store exists. :func:`trace_document` is one prompt, in memory.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from kvcouple.policies import Policy, parse_policy
from kvcouple.store.background import DocumentWriter
from kvcouple.tracer.engine import trace_units
from kvcouple.tracer.memory import DocumentFootprint, loaded_footprints
from kvcouple.tracer.model import facts, refresh
from kvcouple.tracer.prefill import prefill_documents
from kvcouple.tracer.prompts import Prompt
from kvcouple.tracer.settings import TraceSettings
from kvcouple.tracer.support import ModelSupport, UnsupportedModelError, check_support

# A document of a batch as the tracer takes it: (doc index, token ids, doc id, settings).
BatchDocument = tuple[int, Sequence[int], str, TraceSettings]


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
    need = any(p.NEEDS_ATTENTION for p in policies)
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
        (footprint,) = loaded_footprints(model, [(doc_id, len(input_ids))], pols, settings)
        settings = replace(settings, branch_batch=footprint.branch_batch)
    ids = torch.as_tensor(list(input_ids), dtype=torch.long)
    (doc,) = trace_documents_records(
        model, [(ids, doc_index, doc_id, settings)], pols, seed=seed, on_policy=on_policy
    )
    return doc.arrays, doc.generated_tokens


def write_batch(
    model: Any,
    batch: Sequence[BatchDocument],
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


def batch_documents(
    prompts: Sequence[Prompt],
    settings: TraceSettings,
    footprints: dict[int, DocumentFootprint],
    batch: list[int],
) -> list[BatchDocument]:
    """A batch's documents as :func:`write_batch` takes them (each at its planned branch batch)."""
    return [
        (
            d,
            prompts[d].input_ids,
            prompts[d].id,
            replace(settings, branch_batch=footprints[d].branch_batch),
        )
        for d in batch
    ]
