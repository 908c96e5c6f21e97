"""The run planner: what a run traces and within what memory, before anything is traced.

One plan for :func:`kvcouple.tracer.run.trace` (in one process or on a Dask cluster) and for
``kvcouple trace --dry-run`` (from the model's config, no weights loaded): the run's policies
checked (:func:`run_policies`), the shard's documents (:func:`shard_documents`), each
document's memory footprint against the budget (:class:`Budget`: the device's free memory, the
smallest worker's, or ``--memory``), the document batches (:func:`document_batches`) and the
host memory their records take (:func:`plan_run` gives all of it as a :class:`RunPlan`).

Batches are fixed by the shard's documents, not by what is left to do: a resumed run traces a
partly written batch whole again (and writes only what is missing), so its records are those of
an uninterrupted run.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvcouple.errors import InvalidInputError
from kvcouple.policies import Policy, parse_policy
from kvcouple.store import StoreLayout
from kvcouple.store.background import format_host
from kvcouple.store.create import docs_per_shard as store_docs_per_shard
from kvcouple.store.parts import part_documents
from kvcouple.tracer.distributed import WorkerInfo, format_workers, run_budget
from kvcouple.tracer.memory import (
    DocumentFootprint,
    GiB,
    HostFootprint,
    document_budget,
    document_footprints,
    format_footprints,
    host_footprint,
    host_limit,
    host_refusal,
    human,
    refusal,
    run_sizes,
)
from kvcouple.tracer.prompts import Prompt
from kvcouple.tracer.settings import TraceSettings
from kvcouple.tracer.shape import ModelShape

# Rows of a batch of documents at most (2R per document): beyond this a decoding step is no
# longer bound by reading the weights, so more documents would not come for free.
MAX_DOC_ROWS = 128


def run_policies(policies: Sequence[Policy | str], prompts: Sequence[Prompt]) -> list[Policy]:
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


def parse_shard(text: str) -> tuple[int, int]:
    """``"i/N"`` -> ``(i, N)`` with ``0 <= i < N``."""
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise InvalidInputError(f"--shard must look like i/N (e.g. 0/2), got {text!r}") from None
    if n < 1 or not 0 <= i < n:
        raise InvalidInputError(f"--shard {text}: need 0 <= i < N")
    return i, n


def shard_documents(documents: int, shard: tuple[int, int], docs_per_shard: int = 1) -> list[int]:
    """The indices of the shard ``(i, n)``'s documents: whole Zarr shards of ``docs_per_shard``
    documents, those whose index is ``i`` modulo ``n`` (:mod:`kvcouple.store.parts`)."""
    return part_documents(documents, shard, docs_per_shard)


def _pack_padding(footprints: Mapping[int, DocumentFootprint], members: list[int]) -> int:
    """Bytes the batch's prompt pack holds beyond its prompts' caches (each padded to the
    longest, :func:`~kvcouple.tracer.prefill.prefill_documents`)."""
    longest = max(footprints[b].prompt_length for b in members)
    return sum(
        (longest - footprints[b].prompt_length)
        * footprints[b].prompt_cache
        // max(footprints[b].prompt_length - 1, 1)
        for b in members
    )


def document_batches(
    documents: Iterable[int], footprints: Mapping[int, DocumentFootprint], settings: TraceSettings
) -> list[list[int]]:
    """The shard's documents in batches, in order: ``settings.doc_batch`` documents at most
    (``"auto"``: up to :data:`MAX_DOC_ROWS` rows on a device whose memory is known, one at a
    time otherwise), and never more than fit the footprints' budget together (the sum of their
    planned peaks, a bound: they share the activations, plus the padding of their prompt
    pack), of prompt lengths within a factor of two (the pack pads every prompt to the
    longest, and a batch's prefix call reads that width for every document). Policies whose
    layout is not shared (decode-time eviction, windowed models) trace a batch's documents one
    at a time (:func:`~kvcouple.tracer.engine.trace_units`)."""
    budget = next((p.budget for p in footprints.values() if p.budget is not None), None)
    if settings.doc_batch == "auto":
        most = max(1, MAX_DOC_ROWS // (2 * settings.replicates)) if budget is not None else 1
    else:
        most = int(settings.doc_batch)
    batches: list[list[int]] = []
    total = 0
    for d in documents:
        peak = footprints[d].peak
        members = [*(batches[-1] if batches else []), d]
        lengths = [footprints[b].prompt_length for b in members]
        similar = max(lengths) <= 2 * min(lengths)
        if (
            batches
            and len(batches[-1]) < most
            and similar
            and (budget is None or total + peak + _pack_padding(footprints, members) <= budget)
        ):
            batches[-1].append(d)
            total += peak
        else:
            batches.append([d])
            total = peak
    return batches


@dataclass(frozen=True)
class Budget:
    """Bytes a document may use (None: unknown), where that figure comes from, and on CPU
    without one the host memory bound (:func:`~kvcouple.tracer.memory.host_limit`)."""

    document: int | None
    where: str
    host: int | None = None
    workers: Mapping[str, WorkerInfo] | None = None  # on a cluster: each worker's device

    @classmethod
    def local(
        cls, shape: ModelShape, device: Any, memory: int | None, *, loaded: bool = True
    ) -> Budget:
        """On this machine's ``device``: of ``memory`` bytes when given, else of its free
        memory (the weights reserved unless ``loaded``)."""
        document = document_budget(shape, device, memory, loaded=loaded)
        if memory is not None:
            return cls(document, f"{memory / GiB:g} GiB given")
        if document is not None:
            return cls(document, f"free memory of {device}")
        host = host_limit(device)
        if host is None:
            return cls(None, "unknown on CPU: no limit")
        return cls(None, f"on CPU: bounded by the host's {human(host)}, less the margin", host)

    @classmethod
    def cluster(
        cls, shape: ModelShape, workers: Mapping[str, WorkerInfo], memory: int | None
    ) -> Budget:
        """On a cluster: every worker's plan is the same plan, of ``memory`` bytes when given,
        else of the smallest worker's free memory."""
        if memory is not None:
            given = f"{memory / GiB:g} GiB given"
            return cls(document_budget(shape, None, memory), given, None, workers)
        budget = run_budget(workers.values())
        if budget is None:
            return cls(None, "unknown on CPU workers: no limit", None, workers)
        return cls(budget, "the smallest worker's free memory", None, workers)


@dataclass(frozen=True)
class RunPlan:
    """A run's plan: the shard's documents, their memory footprints, their batches (none while a
    document does not fit) and the host memory of their records (checked only in one process:
    on a cluster the workers hold them)."""

    shape: ModelShape
    budget: Budget
    documents: list[int]
    footprints: dict[int, DocumentFootprint]
    batches: list[list[int]]
    layout: StoreLayout
    host: HostFootprint | None
    docs_per_shard: int = 1

    @property
    def refused(self) -> list[str]:
        """Why the run cannot go ahead: each document that does not fit, then the host."""
        out = ["refused: " + refusal(p) for p in self.footprints.values() if not p.fits]
        if self.host is not None and not self.host.fits:
            out.append("refused: " + host_refusal(self.host))
        return out

    def format(self) -> str:
        """The dry run's report: the memory footprints, the batches, the host line, the workers and
        what is refused."""
        footprints = [self.footprints[d] for d in self.documents]
        lines = [format_footprints(self.shape, footprints, self.budget.document, self.budget.where)]
        if all(p.fits for p in footprints):
            ids = ["+".join(self.footprints[d].doc_id for d in b) for b in self.batches]
            more = ", ..." if len(ids) > 8 else ""
            lines.append(f"document batches: {len(ids)} ({', '.join(ids[:8])}{more})")
            lines.append(self._host_line())
            if self.budget.workers is not None:
                lines.append(
                    format_workers(dict(self.budget.workers), self.batches, self.footprints)
                )
        return "\n".join([*lines, *self.refused])

    def _host_line(self) -> str:
        line = format_host(self.layout, [len(b) for b in self.batches])
        if self.host is None:
            return line
        if self.host.budget is None:
            return f"{line}; host memory available: unknown"
        return f"{line}; {human(self.host.budget)} available (less the margin)"


def plan_run(
    shape: ModelShape,
    prompts: Sequence[Prompt],
    policies: Sequence[Policy],
    settings: TraceSettings,
    budget: Budget,
    shard: tuple[int, int] = (0, 1),
    *,
    refuse: bool = True,
    docs_per_shard: int | None = None,
) -> RunPlan:
    """Plan the shard's documents of a run. ``refuse``: a document that does not fit raises
    :class:`~kvcouple.tracer.memory.FootprintTooLargeError` (else its plan says so, for the dry
    run).
    The records are planned on this host unless the budget is a cluster's. The shard's
    documents are whole Zarr shards of the store the run writes (:mod:`kvcouple.store.parts`):
    ``docs_per_shard`` where the store says it (a Dask run's workers opened it), else as this
    process would create it."""
    per_shard = docs_per_shard or store_docs_per_shard(
        StoreLayout(
            [p.id for p in prompts],
            [p.spec() for p in policies],
            settings.horizon,
            settings.window,
            settings.branches,
            settings.replicates,
            shape.vocab,
            settings.record,
        )  # fmt: skip
    )
    mine = shard_documents(len(prompts), shard, per_shard)
    documents = [(prompts[d].id, len(prompts[d].input_ids)) for d in mine]
    found = document_footprints(
        shape, documents, policies, run_sizes(settings), settings.branch_batch,
        budget.document, refuse=refuse, host=budget.host,
    )  # fmt: skip
    footprints = dict(zip(mine, found, strict=True))
    fits = all(p.fits for p in found)
    batches = document_batches(mine, footprints, settings) if fits else []
    # The records' host memory depends on the layout's sizes per document, not on the ids.
    layout = StoreLayout(
        ["-"], [p.spec() for p in policies], settings.horizon, settings.window,
        settings.branches, settings.replicates, shape.vocab, settings.record,
    )  # fmt: skip
    on_cluster = budget.workers is not None
    host = None if on_cluster or not fits else host_footprint(layout, [len(b) for b in batches])
    return RunPlan(shape, budget, mine, footprints, batches, layout, host, per_shard)
