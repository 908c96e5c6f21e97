"""Coupled generation for one prompt and one policy (SPEC section 4, RB-CMC), on the device.

1. **Overlap path.** P rows (full cache) and Q rows (evicted cache) of ``R`` replicates run as
   one batch of ``2R``; each step both kernels see the same prefix, the path token is drawn
   from the overlap ``min(p, q)`` (``u0 = 1``), and the hazard, KL both ways, entropies and
   top-1 agreement are computed on the device. A step with no overlap (hazard 1) stops the path.
2. **Branches.** ``K`` branch times per replicate are drawn from ``W_{t-1} h_t / O-hat``; each
   branch gets the path's prefix up to ``t*`` (forked from the path's cache, or replayed from
   the prompt when the policy evicts while decoding), draws ``X ~ r^P``, ``Y ~ r^Q``
   (``u0 = 0``), then continues both trajectories with the maximal coupling for ``L`` lags
   (:mod:`kvcouple.tracer.branches`).

Every step of both is :func:`~kvcouple.tracer.step.coupled_step`. Decode-time
eviction (``mode=decode``) is the policy's :class:`~kvcouple.policies.DecodeRule` run by a
:class:`~kvcouple.tracer.decode.DecodeEvictor` on the Q rows after every step. EOS is
absorbing. Every uniform comes from a NumPy generator seeded with ``(seed, doc index, policy
index)``, drawn in a fixed order, so a document's records depend on nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

import numpy as np
import torch

from kvcouple.policies import Admission, DecodeRule, Policy
from kvcouple.store.schema import (
    CAPACITY_BOUND,
    DILUTION_PRONE,
    NO_GATE,
    NO_TOKEN,
    distribution_variables,
)
from kvcouple.tracer.branches import (
    BranchStrategy,
    ForkBranches,
    Path,
    ReplayBranches,
    run_branches,
)
from kvcouple.tracer.decode import DecodeEvictor
from kvcouple.tracer.layout import SharedRows, SplitRows
from kvcouple.tracer.prefill import Prefill, gather_kept, select
from kvcouple.tracer.records import PATH_METRICS, SCHEMA, PathRecords
from kvcouple.tracer.rows import Rows, StepHook
from kvcouple.tracer.settings import (
    Decoding,
    TraceSettings,
    compile_mode,
    compiling,
    without_grad,
)
from kvcouple.tracer.shape import ModelShape, choose_layout
from kvcouple.tracer.step import EosState, coupled_step
from kvcouple.tracer.trajectories import Trajectories

__all__ = [
    "Decoding",
    "PolicyTrace",
    "TraceSettings",
    "branch_times",
    "overlap_path",
    "prepare",
    "random_streams",
    "trace_policy",
]


@without_grad
def overlap_path(
    model: Any,
    pre: Prefill,
    kept: list[tuple[torch.Tensor, torch.Tensor]],
    settings: TraceSettings,
    path_u: torch.Tensor,
    hook: StepHook | None = None,
    idx: torch.Tensor | None = None,
    layout: str | None = None,
) -> Path:
    """The ``R`` overlap paths of one (document, policy); ``hook`` evicts while decoding;
    ``idx`` (the kept positions) lets sliding-window layers run; ``layout``: the cache layout
    (None: chosen here, by :func:`~kvcouple.tracer.shape.choose_layout`)."""
    R, T = settings.replicates, settings.horizon
    if layout is None:
        kept_length = int(kept[0][0].shape[2]) + 1
        layout = choose_layout(
            ModelShape.of_model(model),
            pre.prompt_length,
            kept_length,
            R,
            hook is not None,
            settings.cache_layout,
        )
    rows: Rows
    if layout == "shared":
        rows = SharedRows.start(model, pre.kv, kept if idx is None else idx, R, T)
    elif layout == "split":
        rows = SplitRows.start(model, pre.kv, kept, R, T, idx)
    else:
        rows = Trajectories.start(model, pre, kept, R, hook, idx, steps=T)
    first = torch.full((R,), int(pre.input_ids[-1]), dtype=torch.long, device=path_u.device)
    return run_path(rows, first, settings, path_u)


@without_grad
def run_path(
    rows: Rows, first: torch.Tensor, settings: TraceSettings, path_u: torch.Tensor
) -> Path:
    """The overlap paths of ``rows`` (``B`` P rows then ``B`` Q rows), each starting by feeding
    ``first`` ``(B,)`` (its prompt's last token), with path uniforms ``path_u`` ``(T, B)``."""
    T = settings.horizon
    B = int(first.shape[0])
    device = first.device
    eos = EosState(settings.eos_token_ids, 2 * B, device)
    # Every step's uniforms at once: u0 = 1 (always the overlap branch), u1 the path's.
    u = torch.zeros(T, B, 3, dtype=torch.float64, device=device)
    u[:, :, 0] = 1.0
    u[:, :, 1] = path_u
    tokens = torch.cat([first, first])  # P rows then Q rows: the same token on the path
    records = PathRecords(settings.record, T, B, device)  # every step's, preallocated
    for t, step_u in enumerate(u.unbind(0)):
        step = coupled_step(rows, tokens, settings.decoding, eos, step_u, residuals=False)
        # Raw per-step values; which rows were still alive is applied on the host at the end
        # (fewer ops per step than masking each record on the device).
        records.write(t, step.probs, step.x, step.tv, step.overlap)
        # Every row is fed its draw (the overlap draw), even after its path stopped (a step
        # without overlap): rows are independent and what a stopped row does is blanked on
        # the host, so the device never needs to know which rows are alive.
        tokens = torch.cat([step.x, step.x])
        eos.advance(tokens)
    fed_p = records.fed(first)  # (B, T): P's half (Q's is the same)
    arrays = records.arrays()
    _mask_stopped(arrays)
    # After a stop (a step with no overlap) nothing is observed: blank the distributions.
    stopped = (arrays["tokens"] == NO_TOKEN) & (arrays["hazard"] == 0)
    for name, var in distribution_variables(settings.record).items():
        arrays[name][stopped] = var.fill
    return Path(arrays, arrays["hazard"].astype(np.float64), fed_p, rows)


def _mask_stopped(arrays: dict[str, np.ndarray]) -> None:
    """The path's records from its raw per-step values (``tv``, ``has_overlap``, ``draw``,
    ``(B, T)``): a row is alive at step ``t`` while every earlier step had overlap; the
    hazard is ``tv`` there (1 at a step without overlap, 0 after the stop), the token the
    overlap draw (:data:`NO_TOKEN` from the stop on), and each metric its fill value after
    the stop."""
    tv, has_overlap, draw = arrays.pop("tv"), arrays.pop("has_overlap"), arrays.pop("draw")
    alive = np.ones_like(has_overlap)
    alive[:, 1:] = np.logical_and.accumulate(has_overlap, axis=1)[:, :-1]
    arrays["hazard"] = np.where(alive, np.where(has_overlap, tv, 1.0), 0.0)
    arrays["tokens"] = np.where(alive & has_overlap, draw, NO_TOKEN).astype(draw.dtype)
    for name in PATH_METRICS:
        value = arrays[name]
        arrays[name] = np.where(alive, value, SCHEMA[name].fill).astype(value.dtype)


def branch_times(hazard: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Draw branch times ``t* ~ W_{t-1} h_t / O-hat`` (1-based; 0 where ``O-hat = 0``).

    ``hazard``: ``(R, T)``; ``u``: ``(R, K)`` uniforms. Inverse CDF in time order.
    """
    survival_before = np.cumprod(
        np.concatenate([np.ones_like(hazard[:, :1]), 1 - hazard[:, :-1]], axis=1), axis=1
    )
    weight = survival_before * hazard
    total = weight.sum(axis=1)
    cum = np.cumsum(weight, axis=1)
    out = np.zeros(u.shape, dtype=np.int64)
    for r in range(hazard.shape[0]):
        if total[r] <= 0:
            continue
        idx = (cum[r][None, :] <= (u[r] * total[r])[:, None]).sum(axis=1)
        last_positive = int(np.flatnonzero(weight[r] > 0)[-1])
        out[r] = np.where(idx < hazard.shape[1], idx, last_positive) + 1
    return out


@dataclass
class PolicyTrace:
    """One policy's records for one document: every store variable of the (document, policy)
    region, without the doc/policy axes (``kept_length`` and the gate variables 0-d).

    Attributes
    ----------
    arrays : dict of str to numpy.ndarray
        Each store variable's values for this (document, policy) region.
    generated_tokens : int
        Tokens generated for this document and policy: both kernels' paths and every branch.
    branch_batches : int
        Number of batches the branches were traced in.
    """

    arrays: dict[str, np.ndarray]
    generated_tokens: int
    branch_batches: int


def random_streams(
    seed: int, doc_index: int, policy_index: int, settings: TraceSettings
) -> dict[str, np.ndarray]:
    """Every uniform one (document, policy) uses, drawn in a fixed order."""
    rng = np.random.default_rng([seed, doc_index, policy_index])
    R, K, T, L = settings.replicates, settings.branches, settings.horizon, settings.window
    return {
        "policy_seed": rng.integers(0, 2**62, size=1),
        "path": rng.random((T, R)),
        "branch_time": rng.random((R, K)),
        "branch": rng.random((L + 1, R, K, 3)),
    }


@without_grad
def trace_policy(
    model: Any,
    pre: Prefill,
    policy: Policy,
    settings: TraceSettings,
    seed: int,
    doc_index: int,
    policy_index: int,
) -> PolicyTrace:
    """Coupled generation of one document under one policy.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        The causal LM.
    pre : Prefill
        The prompt's prefill (full cache, and queries when the policy needs them).
    policy : Policy
        The eviction policy (a gated policy decides here what it applies).
    settings : TraceSettings
        Horizon, window, replicates, branches and decoding settings.
    seed : int
        Seed of the run.
    doc_index : int
        The document's index in the run.
    policy_index : int
        The policy's index in the run (with ``seed`` and ``doc_index`` it fixes the random
        streams).

    Returns
    -------
    PolicyTrace
        The store arrays of the (document, policy) region, the generated tokens and the
        number of branch batches.

    Raises
    ------
    ValueError
        The policy selects indices outside the prompt.
    """
    return trace_units(model, [(pre, settings, doc_index)], policy, seed, policy_index)[0]


@dataclass
class Unit:
    """One (document, policy), its eviction and cache layout chosen (:func:`prepare`)."""

    pre: Prefill
    settings: TraceSettings
    streams: dict[str, np.ndarray]
    admission: Admission
    idx: torch.Tensor
    rule: DecodeRule | None
    layout: str

    @property
    def kept_length(self) -> int:
        return int(self.idx.shape[-1]) + 1

    @cached_property
    def kept(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The kept entries as their own tensors (gathered when first asked: the shared
        layout never asks, its Q rows see the prompt's cache with the evicted entries
        hidden)."""
        return gather_kept(self.pre.kv, self.idx)


def prepare(
    shape: ModelShape,
    pre: Prefill,
    policy: Policy,
    settings: TraceSettings,
    seed: int,
    doc: int,
    policy_index: int,
) -> Unit:
    """What one (document, policy) evicts: the policy's admission (a gated policy, page,
    decides per input what it applies), its selection seeded by the (document, policy)'s own
    stream, its decode-time rule, and the cache layout it runs in."""
    streams = random_streams(seed, doc, policy_index, settings)
    policy_seed = int(streams["policy_seed"][0])
    admission = policy.admit(pre.context())
    idx = select(admission.policy, pre, torch.Generator().manual_seed(policy_seed))
    kept_length = int(idx.shape[-1]) + 1
    rule = admission.policy.decode_rule(kept_length, seed=policy_seed)
    layout = choose_layout(
        shape,
        pre.prompt_length,
        kept_length,
        settings.replicates,
        rule is not None,
        settings.cache_layout,
    )
    return Unit(pre, settings, streams, admission, idx, rule, layout)


def trace_units(
    model: Any,
    documents: list[tuple[Prefill, TraceSettings, int]],
    policy: Policy,
    seed: int,
    policy_index: int,
) -> list[PolicyTrace]:
    """:func:`trace_policy` for several documents ``(prefill, settings, doc index)`` (the same
    sizes, branch batches may differ): where every one runs in the shared layout, their overlap
    paths run as one batch (the weights read once per step for all of them), then all their
    branches, forked from it; otherwise one document after another. The records equal
    one-at-a-time tracing to float noise (every uniform is drawn per document). With
    ``TraceSettings.compile`` the decoding steps run compiled (:func:`~kvcouple.tracer.
    settings.compile_mode`)."""
    mode = compile_mode(documents[0][1].compile, documents[0][0].input_ids.device)
    with compiling(mode):
        return _trace_units(model, documents, policy, seed, policy_index)


@without_grad
def _trace_units(
    model: Any,
    documents: list[tuple[Prefill, TraceSettings, int]],
    policy: Policy,
    seed: int,
    policy_index: int,
) -> list[PolicyTrace]:
    shape = ModelShape.of_model(model)
    units = [prepare(shape, pre, policy, s, seed, d, policy_index) for pre, s, d in documents]
    if len(units) == 1 or any(u.layout != "shared" for u in units):
        return [_trace_unit(model, u) for u in units]
    return _trace_shared_batch(model, units)


def _trace_shared_batch(model: Any, units: list[Unit]) -> list[PolicyTrace]:
    """Documents in the shared layout: their overlap paths as one batch, then their branches
    forked from it."""
    settings = units[0].settings
    R, T = settings.replicates, settings.horizon
    device = units[0].pre.input_ids.device
    rows = SharedRows.start_units(
        model, [(u.pre.kv, u.idx) for u in units], R, T, [u.pre.pack for u in units]
    )
    first = torch.tensor([int(u.pre.input_ids[-1]) for u in units for _ in range(R)], device=device)
    path_u = torch.as_tensor(np.concatenate([u.streams["path"] for u in units], axis=1))
    path = run_path(rows, first, settings, path_u.to(device))
    # Every document's branches in one run: its uniforms and branch times are its own, its
    # rows fork from the batch's path (prefix lengths per replicate), and a batch of
    # branches may hold as many as the documents' own batches together (each fits its plan).
    times = np.concatenate(
        [
            branch_times(path.hazard[i * R : (i + 1) * R], u.streams["branch_time"])
            for i, u in enumerate(units)
        ]
    )
    branch_u = np.concatenate([u.streams["branch"] for u in units], axis=1)
    lengths = torch.tensor([u.pre.prefix_length for u in units for _ in range(R)], device=device)
    batches = [u.settings.branch_batch for u in units]
    joint = replace(
        settings,
        replicates=len(units) * R,
        branch_batch=sum(batches) if all(isinstance(b, int) for b in batches) else None,  # type: ignore[arg-type]
    )
    branch_arrays, tokens, batch_count = run_branches(
        ForkBranches(path, lengths),
        path,
        joint,
        times,
        torch.as_tensor(branch_u, device=device),
        units[0].pre.vocab_size,
    )
    # Tokens by each document's share of the branches (the batches counted once, on the first).
    count = [int((times[i * R : (i + 1) * R] > 0).sum()) for i in range(len(units))]
    share = [tokens * c // max(sum(count), 1) for c in count]
    share[-1] += tokens - sum(share)
    out = []
    for i, unit in enumerate(units):
        mine = slice(i * R, (i + 1) * R)
        arrays = {name: a[mine] for name, a in (path.arrays | branch_arrays).items()}
        out.append(_policy_trace(unit, arrays, share[i], batch_count if i == 0 else 0))
    return out


def _trace_unit(model: Any, unit: Unit) -> PolicyTrace:
    """One (document, policy) on its own: the overlap path, then its branches."""
    pre, settings, rule = unit.pre, unit.settings, unit.rule
    device = pre.input_ids.device
    path_u = torch.as_tensor(unit.streams["path"], device=device)
    strategy: BranchStrategy
    if rule is None:
        # (the shared layout's Q rows see the prompt's cache, masked: no kept copy)
        kept = [] if unit.layout == "shared" else unit.kept
        path = overlap_path(model, pre, kept, settings, path_u, idx=unit.idx, layout=unit.layout)
        strategy = ForkBranches(path, pre.prefix_length)
    else:
        decode_rule = rule

        def make_hook(replicates: torch.Tensor) -> DecodeEvictor:
            return DecodeEvictor(model, pre, unit.idx, decode_rule, replicates)

        R = settings.replicates
        hook = make_hook(torch.arange(R, device=device))
        path = overlap_path(model, pre, unit.kept, settings, path_u, hook, layout=unit.layout)
        path.rows = None  # branches replay from the prompt cache; free the path's cache
        strategy = ReplayBranches(model, pre, unit.kept, make_hook)
    return _finish(unit, path, strategy)


def _finish(unit: Unit, path: Path, strategy: BranchStrategy) -> PolicyTrace:
    """The branches of one (document, policy) and its store arrays."""
    pre, settings = unit.pre, unit.settings
    branch_u = torch.as_tensor(unit.streams["branch"], device=pre.input_ids.device)
    times = branch_times(path.hazard, unit.streams["branch_time"])
    branch_arrays, branch_tokens, batches = run_branches(
        strategy, path, settings, times, branch_u, pre.vocab_size
    )
    return _policy_trace(unit, {**path.arrays, **branch_arrays}, branch_tokens, batches)


def _policy_trace(
    unit: Unit, records: dict[str, np.ndarray], branch_tokens: int, batches: int
) -> PolicyTrace:
    """One (document, policy)'s store arrays from its path and branch records."""
    pre, settings, admission = unit.pre, unit.settings, unit.admission
    kept_length = unit.kept_length
    arrays = {
        **records,
        "kept_length": np.asarray(kept_length, dtype=np.int32),
        "gate_score": np.asarray(admission.score, dtype=np.float32),
        "gate_class": np.asarray(
            NO_GATE
            if admission.capacity_bound is None
            else CAPACITY_BOUND
            if admission.capacity_bound
            else DILUTION_PRONE,
            dtype=np.int8,
        ),
        "eviction_applied": np.asarray(
            kept_length < pre.prompt_length
            or (unit.rule is not None and admission.policy.BUDGETED),
            dtype=bool,
        ),
    }
    return PolicyTrace(arrays, 2 * settings.replicates * settings.horizon + branch_tokens, batches)
