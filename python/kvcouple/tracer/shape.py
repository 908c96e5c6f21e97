"""What of a model decides the tracer's memory and cache layout: :class:`ModelShape` (pure
numbers, from the model's facts) and :func:`choose_layout` (the layout of one document and
policy). The per-document engine chooses its layout here; the memory footprint
(:mod:`kvcouple.tracer.memory`) counts with the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvcouple.tracer.model import ModelFacts, facts

__all__ = ["ModelShape", "choose_layout"]


@dataclass(frozen=True)
class ModelShape:
    """What of a model decides the tracer's memory."""

    layers: int
    kv_heads: int
    head_dim: int
    query_heads: int
    hidden: int
    intermediate: int
    vocab: int
    itemsize: int
    weight_bytes: int
    attn_implementation: str = "sdpa"
    windowed: bool = False  # some layer has a sliding window: caches track entry positions
    shared_prefix: bool = False  # shared-prefix attention serves it (attention.prefix_supported)

    @property
    def token_bytes(self) -> int:
        """One cached token of one row: keys and values of every layer and KV head."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.itemsize

    @classmethod
    def of_facts(cls, f: ModelFacts, itemsize: int, weight_bytes: int, shared: bool) -> ModelShape:
        """The shape of a model from its facts, dtype size and weights (``shared``: whether
        shared-prefix attention serves it)."""
        return cls(
            layers=f.layers,
            kv_heads=f.kv_heads,
            head_dim=f.head_dim,
            query_heads=f.query_heads,
            hidden=f.hidden,
            intermediate=f.intermediate,
            vocab=f.vocab,
            itemsize=itemsize,
            weight_bytes=weight_bytes,
            attn_implementation=f.attn_implementation,
            windowed=f.windowed,
            shared_prefix=shared,
        )

    @classmethod
    def of_model(cls, model: Any) -> ModelShape:
        """The shape of a loaded model; its weights are counted as they are held."""
        # Deferred: attention needs torch, and the plan from numbers must import without it.
        from kvcouple.tracer.attention import prefix_supported

        tensors = [*model.parameters(), *model.buffers()]
        weight_bytes = sum(t.numel() * t.element_size() for t in tensors)
        itemsize = next(model.parameters()).element_size()
        return cls.of_facts(facts(model), itemsize, weight_bytes, prefix_supported(model))

    @classmethod
    def of_unloaded(cls, config: Any, dtype: Any) -> ModelShape:
        """The shape of a model from its config alone (``dtype``: a ``torch.dtype``): weights
        counted on the meta device."""
        import torch
        from transformers import AutoModelForCausalLM

        from kvcouple.tracer.attention import prefix_supported  # deferred: needs torch

        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(config)
        itemsize = torch.empty((), dtype=dtype).element_size()
        numel = sum(t.numel() for t in [*meta.parameters(), *meta.buffers()])
        return cls.of_facts(facts(meta), itemsize, numel * itemsize, prefix_supported(meta))


def choose_layout(
    shape: ModelShape,
    prompt_length: int,
    kept_length: int,
    replicates: int,
    decode_time: bool,
    setting: str = "auto",
) -> str:
    """The cache layout of one (document, policy) (:mod:`kvcouple.tracer.layout`):

    - ``"shared"``: one batch; P rows attend to the prompt's cache and Q rows to the kept
      entries, each held once, plus their own columns (one softmax over both);
    - ``"split"``: P rows and Q rows as two batches, Q holding only its kept entries;
    - ``"joint"``: one batch, Q rows padded to the prefix length and masked.

    ``auto`` shares wherever the model allows it (:attr:`ModelShape.shared_prefix`): it holds
    and reads the least. Otherwise it splits when the padded columns the joint layout would
    read every step outweigh the weights the split layout's second forward pass reads again
    (both passes are bound by memory traffic when decoding): on an 8B model at retain=0.5 and
    R=8, prompts from about 30k tokens. ``shared`` on a model it cannot serve falls back the
    same way. Decode-time eviction changes the Q rows' cache in place and stays joint, and so
    do models with sliding-window layers (whatever the setting).
    """
    if decode_time or shape.windowed:
        return "joint"
    if setting in ("auto", "shared") and shape.shared_prefix:
        return "shared"
    if kept_length >= prompt_length:
        return "joint"
    if setting in ("joint", "split"):
        return setting
    padded = replicates * (prompt_length - kept_length) * shape.token_bytes
    return "split" if padded >= shape.weight_bytes else "joint"
