"""The memory footprint: the peak device memory of tracing one document, known before tracing
it (the run planner, :mod:`kvcouple.tracer.planner`, sets it against the budget).

From the model's shape (layers, KV heads, head size, hidden and MLP widths, vocabulary), the
dtype, the prompt length, the policies and ``R, K, L, T`` and the branch batch, the footprint
adds up what the tracer holds in each phase of a document and takes the largest:

- **prefill**: the prompt's prefix cache (batch 1), what attention-scored policies read of the
  prompt (their last queries; accumulated attention, summed while prefilling), and the
  prefill's activations;
- **select**: the prefix cache, the capture and the costliest scorer's attention buffers;
- **path** (per policy): the prefix cache, the policy's kept cache (in the shared layout a
  mask of the prompt's cache instead), the overlap path's P rows and Q rows at their final
  length (P: ``n - 1 + T`` columns; Q: its kept entries plus ``T`` in the split layout,
  ``n - 1 + T`` in the joint one, ``T`` in the shared one), and one decoding step's
  activations;
- **branches**: the path phase plus one batch of forks (P and Q rows copied from their
  replicates with room for their steps, at most ``L`` columns more); decode-time policies
  **replay** each batch from the prompt cache after the path's cache is freed.

Caches are preallocated (:mod:`kvcouple.tracer.kvcache`), so cache bytes follow the tracer's
layout exactly (``tests/tracer/test_tracer_scale.py`` checks the footprint against every tensor
alive in a traced document); activations are estimates with some headroom. Weights are not part of a
document's peak: they are resident already, and the free memory the batch is chosen against
excludes them.

``branch_batch="auto"`` picks the largest batch of branches whose peak fits the budget (free
device memory less a margin); a document that does not fit even at batch 1 raises
:class:`FootprintTooLargeError` with the figures, before anything is traced.

**Host memory.** Records wait on the host between the device and the store: the batch being
traced, the writer's queue (a batch), the document being written and the encoder's buffers
(:func:`kvcouple.store.background.host_record_bytes`; ``record=full`` on a 128k vocabulary is
about 1.6 GB a document). :func:`host_footprint` sets that against the host's available memory less
the same margin; a run whose records do not fit is refused before anything is traced
(:class:`FootprintTooLargeError`, :func:`host_refusal`), and ``--dry-run`` prints both figures.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvcouple.deprecation import module_getattr
from kvcouple.errors import InvalidInputError
from kvcouple.policies import Policy
from kvcouple.policies.base import query_needs
from kvcouple.resources import available_memory
from kvcouple.store.background import document_bytes, host_record_bytes, queue_bound
from kvcouple.store.create import StoreLayout
from kvcouple.tracer.shape import ModelShape, choose_layout

__all__ = [
    "DEFAULT_MARGIN",
    "GiB",
    "DocumentFootprint",
    "HostFootprint",
    "FootprintTooLargeError",
    "ModelShape",
    "Sizes",
    "choose_branch_batch",
    "choose_layout",
    "device_budget",
    "document_budget",
    "host_limit",
    "format_footprints",
    "host_refusal",
    "human",
    "document_footprint",
    "document_footprints",
    "host_footprint",
    "loaded_footprints",
    "run_sizes",
    "refusal",
]

GiB = 2**30

# Share of the budget kept free for the allocator's fragmentation and what the footprint does not
# model (CUDA context, library workspaces).
DEFAULT_MARGIN = 0.1

# float64 (rows, vocab) temporaries alive at once in one decoding step: the decoding
# transform, the coupling sampler and the per-step metrics (see torch_coupling, engine).
_VOCAB_TEMPORARIES = 12


class FootprintTooLargeError(InvalidInputError):
    """A document whose trace cannot fit the device memory, even one branch at a time."""


@dataclass(frozen=True)
class Sizes:
    """The run's sizes a footprint depends on (a subset of ``TraceSettings``)."""

    horizon: int
    replicates: int
    branches: int
    window: int
    layout: str = "auto"  # the cache layout: auto, joint, split or shared (see choose_layout)


@dataclass
class DocumentFootprint:
    """The peak device memory of one document, in bytes, by component."""

    doc_id: str
    prompt_length: int
    branch_batch: int  # branches traced at once (decode-time policies replay all at once)
    branch_count: int  # R x K
    prompt_cache: int  # the prefix cache, batch 1
    kept_cache: int  # the largest evicted cache of one policy, batch 1
    capture: int  # captured query inputs of attention-scored policies
    scoring: int  # the costliest scorer's attention buffers (while selecting)
    path_p: int  # P rows of the overlap path at their final length
    path_q: int  # Q rows of the overlap path at their final length
    branches: int  # one batch of branches at its final length
    activations: int  # the largest of the prefill's and one decoding step's
    peak: int
    phase: str  # the phase where the peak is
    budget: int | None = None  # bytes the document may use (None: unknown)
    phases: dict[str, int] = field(default_factory=dict)
    layout: str = "joint"  # the cache layout of the policy with the largest peak
    # On CPU, where the device budget is unknown: the host memory available (less the margin),
    # a bound the document must stay within; it does not choose batches (CPU runs batch the
    # same whatever memory is free, so their records do not depend on it).
    host: int | None = None

    @property
    def limit(self) -> int | None:
        """The bound the peak must stay within: the budget, else the host memory (CPU)."""
        return self.budget if self.budget is not None else self.host

    @property
    def fits(self) -> bool:
        return self.limit is None or self.peak <= self.limit

    @property
    def cache_bytes(self) -> int:
        """Cache bytes held at the peak of the branch phase (the instrumented quantity)."""
        return self.prompt_cache + self.kept_cache + self.path_p + self.path_q + self.branches


def human(b: int | None) -> str:
    """Bytes as GiB or MiB."""
    if b is None:
        return "unknown"
    return f"{b / GiB:.2f} GiB" if abs(b) >= GiB else f"{b / 2**20:.1f} MiB"


def _capture_bytes(shape: ModelShape, policies: Sequence[Policy], n1: int) -> int:
    """What the prefill's capture keeps: the last queries the policies read, and each
    layer's accumulated attention (float32) where they read that."""
    needed, keep, accumulate = query_needs(policies)
    if not needed:
        return 0
    queries = n1 if keep is None else min(keep, n1)
    per_layer = shape.query_heads * queries * shape.head_dim * shape.itemsize
    if accumulate:
        per_layer += shape.query_heads * n1 * 4
    return shape.layers * per_layer


def _scoring_bytes(shape: ModelShape, policies: Sequence[Policy], n1: int) -> tuple[int, int]:
    """Attention buffers of scoring, float32: (while selecting, while prefilling). Window
    scorers keep every layer's window attention until selection ends; accumulated attention
    is summed during the prefill, 256 queries at a time."""
    needed, keep, accumulate = query_needs(policies)
    if not needed:
        return 0, 0
    heads = shape.query_heads
    keys = 2 * heads * n1 * shape.head_dim * 4  # keys and values in float32
    window = n1 if keep is None else min(keep, n1)
    select = shape.layers * heads * window * n1 * 4 + 2 * heads * window * n1 * 4 + keys
    if keep is None:  # some scorer may read every query: chunked like accumulated attention
        select = max(select, 3 * heads * min(256, n1) * n1 * 4 + keys)
    during_prefill = 3 * heads * min(256, n1) * n1 * 4 + keys if accumulate else 0
    return select, during_prefill


def _prefill_activations(shape: ModelShape, n: int) -> int:
    per_token = (
        4 * shape.hidden
        + 4 * shape.intermediate
        + 2 * (shape.query_heads + 2 * shape.kv_heads) * shape.head_dim
    )
    act = n * per_token * shape.itemsize
    if shape.attn_implementation == "eager":
        act += 2 * shape.query_heads * n * n * 4  # the full attention matrix, float32
    return act


def _decode_activations(shape: ModelShape, rows: int, length: int, shared: bool = False) -> int:
    """One decoding step of ``rows`` rows over a cache of ``length`` entries (``shared``: the
    prefix attention's float32 scores and their exponentials, and the probabilities)."""
    vocab = rows * shape.vocab * (shape.itemsize + 8 * _VOCAB_TEMPORARIES)
    per_head = 8 + shape.itemsize if shared else 4
    attention = rows * length * (shape.query_heads * per_head + shape.itemsize + 1)
    return vocab + attention


@dataclass
class _PolicyFootprint:
    layout: str
    kept: int
    path_p: int
    path_q: int
    branches: int
    phases: dict[str, int]
    activations: list[int]


def _policy_footprint(
    shape: ModelShape, n: int, policy: Policy, sizes: Sizes, batch: int, held: int
) -> _PolicyFootprint:
    """The path and branch phases of one policy (``held``: prefix cache and capture)."""
    T, R, L = sizes.horizon, sizes.replicates, sizes.window
    n1, c = n - 1, shape.token_bytes
    k1 = policy.kept_count(n) - 1  # kept prefix entries (the re-fed last token is fed again)
    layout = choose_layout(shape, n, k1 + 1, R, policy.decode_time, sizes.layout)
    # The kept entries: their own copy, or in the shared layout a mask hiding the evicted
    # entries of the prompt's cache, per layer and KV head, and its stack with the P rows'.
    kept = 3 * shape.layers * shape.kv_heads * n1 * shape.itemsize if layout == "shared" else k1 * c
    held += kept
    q_columns = k1 if layout == "split" else n1  # joint: Q rows padded to the prefix length

    def rows(count: int, columns: int, q_side: bool) -> int:
        """Cache bytes of ``count`` rows of ``columns`` entries, with the entries' original
        positions (int32 per layer, per KV head except the split layout's P rows) that
        one-shot policies keep on models with sliding-window layers."""
        if policy.decode_time or not shape.windowed:
            return count * columns * c
        heads = shape.kv_heads if q_side or layout == "joint" else 1
        return count * columns * (c + 4 * shape.layers * heads)

    if layout == "shared":
        # The prefix is the prompt's cache (held already): the rows hold their own columns
        # only, and a fork copies none of the prefix.
        path_p = path_q = R * T * c
        path_act = _decode_activations(shape, 2 * R, n1 + T, shared=True)
        branches = 2 * batch * (T + L) * c
        fork_act = _decode_activations(shape, 2 * batch, n1 + T + L, shared=True)
        phases = {
            "path": held + path_p + path_q + path_act,
            "branches": held + path_p + path_q + branches + fork_act,
        }
        return _PolicyFootprint(
            layout, kept, path_p, path_q, branches, phases, [path_act, fork_act]
        )
    path_p, path_q = rows(R, n1 + T, False), rows(R, q_columns + T, True)
    path_act = _decode_activations(shape, 2 * R, n1 + T)
    if policy.decode_time:
        # The evictor keeps a float32 score and an int64 position per entry and KV head; the
        # branches replay from the prompt cache after the path's cache is freed.
        def evictor(count: int) -> int:
            return count * shape.layers * shape.kv_heads * (n1 + T) * 12

        branches = 2 * batch * (n1 + T) * c
        replay_act = _decode_activations(shape, 2 * batch, n1 + T)
        phases = {
            "path": held + path_p + path_q + evictor(R) + path_act,
            "replay": held + branches + evictor(batch) + replay_act,
        }
        return _PolicyFootprint(
            layout, kept, path_p, path_q, branches, phases, [path_act, replay_act]
        )
    # A batch of forks copies the path columns its rows can see, one layer at a time, into
    # caches with room for its steps: at most n - 1 + T + L columns (Q: its own columns).
    branches = rows(batch, n1 + T + L, False) + rows(batch, q_columns + T + L, True)
    copying = 2 * batch * (n1 + T) * c // shape.layers
    fork_act = _decode_activations(shape, 2 * batch, n1 + T + L)
    phases = {
        "path": held + path_p + path_q + path_act,
        "branches": held + path_p + path_q + branches + max(copying, fork_act),
    }
    return _PolicyFootprint(layout, kept, path_p, path_q, branches, phases, [path_act, fork_act])


def document_footprint(
    shape: ModelShape,
    prompt_length: int,
    policies: Sequence[Policy],
    sizes: Sizes,
    branch_batch: int | None,
    *,
    doc_id: str = "",
    budget: int | None = None,
    host: int | None = None,
) -> DocumentFootprint:
    """The peak of one document at a given branch batch (None: every branch at once);
    its components are those of the policy with the largest peak."""
    n = prompt_length
    n1 = n - 1
    count = sizes.replicates * sizes.branches
    batch = count if branch_batch is None else min(branch_batch, count)
    prompt = n1 * shape.token_bytes
    capture = _capture_bytes(shape, policies, n1)
    scoring, accumulating = _scoring_bytes(shape, policies, n1)
    prefill_act = _prefill_activations(shape, n1) + accumulating
    phases = {"prefill": prompt + capture + prefill_act, "select": prompt + capture + scoring}
    footprints = [_policy_footprint(shape, n, p, sizes, batch, prompt + capture) for p in policies]
    top = max(footprints, key=lambda p: max(p.phases.values()))
    phases.update(top.phases)
    phase = max(phases, key=lambda k: phases[k])
    return DocumentFootprint(
        doc_id=doc_id,
        prompt_length=n,
        branch_batch=batch,
        branch_count=count,
        prompt_cache=prompt,
        kept_cache=top.kept,
        capture=capture,
        scoring=scoring,
        path_p=top.path_p,
        path_q=top.path_q,
        branches=top.branches,
        activations=max([prefill_act, *(a for p in footprints for a in p.activations)]),
        peak=phases[phase],
        phase=phase,
        budget=budget,
        host=host,
        phases=phases,
        layout=top.layout,
    )


def choose_branch_batch(
    shape: ModelShape,
    prompt_length: int,
    policies: Sequence[Policy],
    sizes: Sizes,
    budget: int,
    *,
    doc_id: str = "",
) -> DocumentFootprint:
    """The footprint at the largest branch batch whose peak fits ``budget``; raises
    :class:`FootprintTooLargeError` when even one branch at a time does not fit."""
    footprint = lambda b: document_footprint(  # noqa: E731
        shape, prompt_length, policies, sizes, b, doc_id=doc_id, budget=budget
    )
    lo_footprint = footprint(1)
    if not lo_footprint.fits:
        raise FootprintTooLargeError(refusal(lo_footprint))
    count = sizes.replicates * sizes.branches
    lo, hi = 1, count
    while lo < hi:  # the peak grows with the batch: bisect for the largest that fits
        mid = (lo + hi + 1) // 2
        if footprint(mid).fits:
            lo = mid
        else:
            hi = mid - 1
    return footprint(lo)


def refusal(footprint: DocumentFootprint) -> str:
    """Why a document cannot be traced, with the figures."""
    f = footprint
    return (
        f"document {f.doc_id!r} ({f.prompt_length} prompt tokens) needs "
        f"{human(f.peak)} of {'device' if f.budget is not None else 'host'} memory at its "
        f"peak ({f.phase}, branch batch {f.branch_batch}) but {human(f.limit)} are "
        f"available to it: prompt cache "
        f"{human(f.prompt_cache)}, P rows {human(f.path_p)}, Q rows {human(f.path_q)}, "
        f"branches {human(f.branches)}, query capture {human(f.capture)}, activations "
        f"{human(f.activations)}. Use fewer --replicates, a shorter --horizon, a shorter "
        "prompt, or more --memory"
    )


def device_budget(device: Any, margin: float = DEFAULT_MARGIN, reserve: int = 0) -> int | None:
    """Bytes a document may use on ``device``: free memory (plus what torch's allocator holds
    unused) less ``reserve`` (weights not loaded yet), less a ``margin`` share. None off CUDA."""
    import torch  # optional heavy dependency: the footprint itself is arithmetic on numbers

    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    free, _ = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int((free - reserve) * (1 - margin))


def host_limit(device: Any, margin: float = DEFAULT_MARGIN) -> int | None:
    """On CPU, the host memory available now less a ``margin`` share: the bound a document's
    footprint must stay within there (the caches are host memory); None on other devices."""
    import torch  # optional heavy dependency: the footprint itself is arithmetic on numbers

    if torch.device(device).type != "cpu":
        return None
    available = available_memory()
    return None if available is None else int(available * (1 - margin))


def document_budget(
    shape: ModelShape,
    device: Any,
    memory: int | None = None,
    *,
    loaded: bool = True,
    margin: float = DEFAULT_MARGIN,
) -> int | None:
    """Bytes one document may use: of ``memory`` (the device memory the run may use in all,
    weights included) when given, else of the device's free memory (weights already resident
    when ``loaded``); None when unknown (CPU without ``memory``)."""
    if memory is not None:
        return int(memory * (1 - margin)) - shape.weight_bytes
    return device_budget(device, margin, reserve=0 if loaded else shape.weight_bytes)


def document_footprints(
    shape: ModelShape,
    documents: Sequence[tuple[str, int]],
    policies: Sequence[Policy],
    sizes: Sizes,
    branch_batch: int | str | None,
    budget: int | None,
    *,
    refuse: bool = True,
    host: int | None = None,
) -> list[DocumentFootprint]:
    """A footprint per ``(doc_id, prompt_length)``. ``branch_batch="auto"`` chooses the batch
    against ``budget`` (every branch at once when the budget is unknown). A document that does
    not fit ``budget`` (or, where it is unknown, ``host``: :func:`host_limit`) raises
    :class:`FootprintTooLargeError` (``refuse=False``: its footprint says so instead)."""
    footprints = []
    for doc_id, n in documents:
        if branch_batch == "auto" and budget is not None:
            try:
                footprints.append(
                    choose_branch_batch(shape, n, policies, sizes, budget, doc_id=doc_id)
                )
                continue
            except FootprintTooLargeError:
                if refuse:
                    raise
                batch: int | None = 1
        else:
            batch = None if branch_batch == "auto" else int(branch_batch) if branch_batch else None
        footprint = document_footprint(
            shape, n, policies, sizes, batch, doc_id=doc_id, budget=budget, host=host
        )
        if refuse and not footprint.fits:
            raise FootprintTooLargeError(refusal(footprint))
        footprints.append(footprint)
    return footprints


def format_footprints(
    shape: ModelShape, footprints: Sequence[DocumentFootprint], budget: int | None, where: str
) -> str:
    """The footprints as a table, one document a line (GiB, or MiB when every peak is below
    1 GiB)."""
    unit, name = (
        (GiB, "GiB") if max((p.peak for p in footprints), default=0) >= GiB else (2**20, "MiB")
    )

    def f(b: int) -> str:
        return f"{b / unit:.2f}" if unit == GiB else f"{b / unit:.1f}"

    lines = [
        f"memory footprint: {shape.layers} layers x {shape.kv_heads} KV heads x {shape.head_dim}, "
        f"{shape.itemsize}-byte dtype: {shape.token_bytes / 1024:.1f} KiB per cached token; "
        f"weights {human(shape.weight_bytes)}",
        f"available to a document: {human(budget)} ({where}); figures in {name}",
        f"{'doc':<16}{'tokens':>8}{'prompt':>9}{'kept':>8}{'P rows':>9}{'Q rows':>9}"
        f"{'branches':>10}{'capture':>9}{'activ.':>9}{'peak':>9}  {'phase':<9}{'batch':>9}"
        f"  layout",
    ]
    for p in footprints:
        lines.append(
            f"{p.doc_id[:15]:<16}{p.prompt_length:>8}{f(p.prompt_cache):>9}"
            f"{f(p.kept_cache):>8}{f(p.path_p):>9}{f(p.path_q):>9}"
            f"{f(p.branches):>10}{f(p.capture):>9}{f(p.activations):>9}"
            f"{f(p.peak):>9}  {p.phase:<9}{f'{p.branch_batch}/{p.branch_count}':>9}"
            f"  {p.layout}" + ("" if p.fits else "  DOES NOT FIT")
        )
    return "\n".join(lines)


def loaded_footprints(
    model: Any,
    documents: Sequence[tuple[str, int]],
    policies: Sequence[Policy],
    settings: Any,
    memory: int | None = None,
    *,
    refuse: bool = True,
) -> list[DocumentFootprint]:
    """:func:`document_footprints` for a loaded model on its device, with a run's
    ``TraceSettings``."""
    shape = ModelShape.of_model(model)
    device = next(model.parameters()).device
    budget = document_budget(shape, device, memory)
    host = host_limit(device) if budget is None else None
    sizes = run_sizes(settings)
    return document_footprints(
        shape, documents, policies, sizes, settings.branch_batch, budget, refuse=refuse, host=host
    )


def run_sizes(settings: Any) -> Sizes:
    """The :class:`Sizes` of a run's ``TraceSettings``."""
    return Sizes(
        settings.horizon,
        settings.replicates,
        settings.branches,
        settings.window,
        getattr(settings, "cache_layout", "auto"),
    )


@dataclass(frozen=True)
class HostFootprint:
    """Host memory a run's records take at most, against what the host has."""

    records: int  # bytes of records held at once (host_record_bytes)
    per_document: int  # bytes of one document's records
    batch: int  # documents traced at once (the largest batch)
    budget: int | None  # available host memory less the margin (None: unknown)

    @property
    def fits(self) -> bool:
        return self.budget is None or self.records <= self.budget


def host_footprint(
    layout: StoreLayout,
    batch_sizes: Sequence[int],
    available: int | None = None,
    margin: float = DEFAULT_MARGIN,
) -> HostFootprint:
    """The host side of the footprint: records of the largest batch tracing, a queued batch, one
    document writing and one for the encoder, against ``available`` bytes (default: the host's
    available memory now) less ``margin``."""
    batch = max(batch_sizes, default=1) or 1
    records = host_record_bytes(layout, batch, queue_bound(list(batch_sizes)))
    per_document = document_bytes(layout)
    if available is None:
        available = available_memory()
    budget = None if available is None else int(available * (1 - margin))
    return HostFootprint(records, per_document, batch, budget)


def host_refusal(footprint: HostFootprint) -> str:
    """Why a run's records cannot be held on this host, and what to change."""
    return (
        f"the records need {human(footprint.records)} of host memory at most ({human(footprint.per_document)}"
        f" a document, {footprint.batch} traced at once, a batch queued for the writer), more than "
        f"the {human(footprint.budget)} available (less a {DEFAULT_MARGIN:.0%} margin). Trace fewer "
        "documents at once (--doc-batch), or record less (--record summary or topk:K)"
    )


# The former names (the "memory plan"; "plan" is the analysis plan and the run plan), for one
# release (deprecated).
__getattr__ = module_getattr(
    __name__,
    {
        "MemoryPlanError": "FootprintTooLargeError",
        "DocumentPlan": "DocumentFootprint",
        "HostPlan": "HostFootprint",
        "plan_document": "document_footprint",
        "plan_documents": "document_footprints",
        "plan_loaded": "loaded_footprints",
        "plan_host": "host_footprint",
        "format_plan": "format_footprints",
    },
    globals(),
)
