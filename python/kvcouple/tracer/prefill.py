"""Prefill a prompt once and build the evicted cache of each policy from it.

The prompt ``c`` of ``n`` tokens is prefilled without its last token (positions ``0..n-2``);
that prefix cache is what policies evict from. The last prompt token is then fed at position
``n-1`` on top of the full cache (giving ``p_1``) and on top of the evicted cache (giving
``q_1``), so the evicted model's first distribution already sees the eviction. Positions are
the original ones: the first generated token sits at position ``n`` whatever was evicted.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvcouple.errors import InvalidInputError
from kvcouple.policies import Policy, PolicyContext
from kvcouple.policies.base import query_needs
from kvcouple.policies.context import LayerInputCapture
from kvcouple.tracer import compat, support
from kvcouple.tracer.attention import QueryCapture
from kvcouple.tracer.kvcache import cache_tensors, new_cache
from kvcouple.tracer.model import facts, vocab_size
from kvcouple.tracer.prefix import PromptPack
from kvcouple.tracer.settings import without_grad


class PromptTooShortError(InvalidInputError):
    """A prompt with fewer than two tokens (nothing to evict before the re-fed last token)."""


@dataclass
class Prefill:
    """The full prefix cache of one prompt (batch of one) and what policies may ask of it."""

    input_ids: torch.Tensor  # (n,) the whole prompt
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (1, kv_heads, n-1, head_dim)
    capture: QueryCapture | None
    num_query_heads: int
    vocab_size: int
    layer_inputs: LayerInputCapture | None = None  # for policies with NEEDS_LAYER_INPUTS
    pack: tuple[PromptPack, int] | None = None  # ``kv`` is this slot of a batch's pack

    @property
    def prompt_length(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def prefix_length(self) -> int:
        return self.prompt_length - 1

    def context(self, generator: torch.Generator | None = None) -> PolicyContext:
        cap = self.capture
        return PolicyContext(
            keys=[k[0] for k, _ in self.kv],
            values=[v[0] for _, v in self.kv],
            query_fn=None if cap is None else cap.queries,
            scaling=None if cap is None else cap.scaling,
            num_query_heads=self.num_query_heads,
            generator=generator,
            attention_fn=None if cap is None else cap.attention,
            accumulated_fn=cap.accumulated_attention
            if cap is not None and cap.accumulate
            else None,
            layer_inputs_fn=None if self.layer_inputs is None else self.layer_inputs.get,
        )


def num_query_heads(model: Any) -> int:
    return facts(model).query_heads


@without_grad
def prefill(
    model: Any,
    input_ids: torch.Tensor,
    needs_attention: bool,
    doc: str = "",
    policies: Sequence[Policy] | None = None,
) -> Prefill:
    """Run the prompt minus its last token through the model once. With ``policies`` the
    capture holds only what they read (their last queries, accumulated attention computed
    while prefilling); otherwise every query when ``needs_attention``."""
    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1)
    n = int(ids.shape[0])
    if n < 2:
        raise PromptTooShortError(
            f"prompt {doc!r} has {n} token(s); the tracer needs at least 2 (the last prompt "
            "token is re-fed after eviction)"
        )
    support.check_support(model, [_ScoredPolicy()] if needs_attention else [])
    device = next(model.parameters()).device
    ids = ids.to(device)
    cache = new_cache()
    positions = torch.arange(n - 1, device=device)[None]
    keep, accumulate = None, False
    if policies is not None:
        needs_attention, keep, accumulate = query_needs(policies)
    capture = QueryCapture(model, keep, accumulate) if needs_attention else None
    inputs = None
    if any(p.NEEDS_LAYER_INPUTS for p in policies or ()):
        inputs = LayerInputCapture(model)
    with capture or contextlib.nullcontext(), inputs or contextlib.nullcontext():
        compat.forward(model, ids[None, :-1], cache, positions)
    return Prefill(
        ids,
        cache_tensors(cache),
        capture,
        num_query_heads(model),
        vocab_size(model),
        inputs,
    )


def prefill_documents(
    model: Any,
    prompts: Sequence[torch.Tensor],
    needs_attention: bool,
    doc_ids: Sequence[str],
    policies: Sequence[Policy] | None = None,
) -> list[Prefill]:
    """:func:`prefill` of each prompt of a batch; two or more share one :class:`PromptPack`
    (each document's ``kv`` a view of its slot, padded to the longest prompt), so that the
    shared layout attends to every document's prompt in one call. Packed one document at a
    time: at most one document's cache is held beyond the pack."""
    pres: list[Prefill] = []
    pack = None
    lengths = [int(torch.as_tensor(ids).numel()) - 1 for ids in prompts]
    for i, (ids, doc) in enumerate(zip(prompts, doc_ids, strict=True)):
        pre = prefill(model, ids, needs_attention, doc=doc, policies=policies)
        if len(prompts) > 1:
            if pack is None:
                pack = PromptPack.allocate(pre.kv, lengths)
            pack.put(i, pre.kv)
            pre.kv, pre.pack = pack.slot(i), (pack, i)
        pres.append(pre)
    return pres


class _ScoredPolicy:
    """Stands for "some policy scored by attention" in the support check."""

    NEEDS_ATTENTION = True


@without_grad
def select(policy: Policy, pre: Prefill, generator: torch.Generator | None = None) -> torch.Tensor:
    """The policy's kept prefix indices ``(layers, kv_heads, kept - 1)``, checked."""
    keep = policy.kept_count(pre.prompt_length) - 1
    ctx = pre.context(generator)
    idx = policy.select(ctx, keep)
    want = (ctx.num_layers, ctx.num_kv_heads, keep)
    if tuple(idx.shape) != want:
        raise ValueError(
            f"policy {policy.spec()} returned indices of shape {tuple(idx.shape)}, expected {want}"
        )
    if keep and (int(idx.min()) < 0 or int(idx.max()) >= pre.prefix_length):
        raise ValueError(f"policy {policy.spec()} returned indices outside the prompt")
    if keep > 1 and bool((torch.sort(idx, dim=-1).values.diff(dim=-1) == 0).any()):
        # (an entry kept twice would count twice in the kept cache's softmax)
        raise ValueError(f"policy {policy.spec()} returned an index twice in a layer and head")
    return idx


def gather_kept(
    kv: list[tuple[torch.Tensor, torch.Tensor]], idx: torch.Tensor
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The kept entries per layer and KV head: ``(1, kv_heads, keep, head_dim)`` each."""
    out = []
    for layer, (k, v) in enumerate(kv):
        index = idx[layer].to(k.device)[None, :, :, None]
        out.append(
            (
                torch.gather(k, 2, index.expand(1, -1, -1, k.shape[-1])),
                torch.gather(v, 2, index.expand(1, -1, -1, v.shape[-1])),
            )
        )
    return out


def hidden_entries(
    kv: list[tuple[torch.Tensor, torch.Tensor]], idx: torch.Tensor
) -> list[torch.Tensor] | None:
    """Per layer an additive ``(1, kv_heads, 1, n - 1)`` mask in the cache's dtype hiding
    the prefix entries that ``idx`` ``(layers, kv_heads, keep)`` does not keep (``finfo.min``;
    0 where kept); None where every entry is kept. Attention over the masked prompt's cache is
    attention over the kept entries (:func:`gather_kept`), with no copy of them."""
    k = kv[0][0]
    layers, kv_heads, length = len(kv), int(k.shape[1]), int(k.shape[2])
    index = idx.to(device=k.device, dtype=torch.long)
    seen = torch.zeros((layers, kv_heads, length), dtype=torch.bool, device=k.device)
    seen.scatter_(2, index, True)
    if bool(seen.all()):
        return None
    hidden = torch.zeros(seen.shape, dtype=k.dtype, device=k.device)
    hidden.masked_fill_(~seen, torch.finfo(k.dtype).min)
    return [hidden[layer][None, :, None, :] for layer in range(layers)]
