"""What the tracer assumes of transformers, in one place, across the versions it supports.

- The cache is a ``transformers.cache_utils.DynamicCache`` built empty and filled with
  ``cache.update(keys, values, layer_idx)`` (every version from 4.45 on). Its tensors are read
  and replaced through ``cache.layers[i].keys/.values`` (4.56+) or ``cache.key_cache[i]`` /
  ``cache.value_cache[i]`` (older).
- The forward keyword for the cache is ``cache`` (transformers 5.x) or ``past_key_values``
  (older); ``cache_position`` is passed only where the model's forward still takes it.
- A 4-D float attention mask ``(batch, 1, query, key)`` (0 = attend, dtype minimum = hidden)
  is used as given (transformers returns prepared 4-D masks untouched). This needs the
  ``sdpa`` or ``eager`` attention implementation (flash-attention takes no 4-D masks).
- Attention modules expose ``q_proj``, ``head_dim``, ``layer_idx``, optionally ``scaling``
  and ``q_norm`` (Qwen3), and receive ``hidden_states`` and ``position_embeddings=(cos, sin)``
  as keywords (or, in older releases such as Mistral in 4.45, ``position_ids`` and their own
  ``rotary_emb``); their modeling module defines ``apply_rotary_pos_emb(q, k, cos, sin)``.
  This holds for Llama, Mistral, Qwen2 and Qwen3 (and most Llama-like models).
- Every layer is full attention over a plain dynamic cache: sliding-window layers (Mistral with
  ``sliding_window`` set, Qwen2 with ``use_sliding_window``) and hybrid caches (Gemma 2/3) are
  not emulated; the tracer's masks give those layers full attention.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import torch

from kvcouple.errors import InvalidInputError


class UnsupportedModelError(InvalidInputError):
    """A model whose cache or attention the tracer does not know how to handle."""


def _forward_parameters(model: Any) -> set[str]:
    cached = getattr(model, "_kvcouple_forward_params", None)
    if cached is None:
        cached = set(inspect.signature(model.forward).parameters)
        try:
            model._kvcouple_forward_params = cached
        except AttributeError:  # pragma: no cover - exotic wrappers
            pass
    return cached


def new_cache() -> Any:
    """An empty dynamic cache whose layers are created as they are filled."""
    from transformers.cache_utils import DynamicCache

    return DynamicCache()


def cache_from_tensors(kv: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """A dynamic cache holding the given per-layer ``(keys, values)``."""
    cache = new_cache()
    for layer, (k, v) in enumerate(kv):
        cache.update(k, v, layer)
    return cache


def cache_tensors(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer ``(keys, values)`` of a dynamic cache, ``(batch, kv_heads, length, head_dim)``."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return [(layer.keys, layer.values) for layer in layers]
    if hasattr(cache, "key_cache"):
        return list(zip(cache.key_cache, cache.value_cache, strict=False))
    raise UnsupportedModelError(f"cannot read the tensors of a {type(cache).__name__}")


def cache_length(cache: Any) -> int:
    return int(cache_tensors(cache)[0][0].shape[-2])


def forward(
    model: Any,
    input_ids: torch.Tensor,
    cache: Any,
    position_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    last_only: bool = True,
) -> torch.Tensor:
    """One forward pass that appends to ``cache``; returns the logits of the last position
    ``(batch, vocab)`` (or every position with ``last_only=False``)."""
    params = _forward_parameters(model)
    kw: dict[str, Any] = {
        "input_ids": input_ids,
        "position_ids": position_ids,
        "attention_mask": attention_mask,
        "use_cache": True,
    }
    kw["cache" if "cache" in params else "past_key_values"] = cache
    if "cache_position" in params:
        start = cache_length(cache) if _has_entries(cache) else 0
        kw["cache_position"] = torch.arange(
            start, start + input_ids.shape[1], device=input_ids.device
        )
    if last_only:
        if "logits_to_keep" in params:
            kw["logits_to_keep"] = 1
        elif "num_logits_to_keep" in params:
            kw["num_logits_to_keep"] = 1
    logits = model(**kw).logits
    return logits[:, -1] if last_only else logits


def _has_entries(cache: Any) -> bool:
    try:
        return cache.get_seq_length() > 0
    except Exception:  # an empty cache of some versions has no layers to ask
        return False


def additive_mask(valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A ``(batch, 1, 1, keys)`` additive mask from a ``(batch, keys)`` bool mask of visible keys."""
    mask = torch.zeros(valid.shape, dtype=dtype, device=valid.device)
    mask = mask.masked_fill(~valid, torch.finfo(dtype).min)
    return mask[:, None, None, :]


def attention_modules(model: Any) -> list[Any]:
    """The self-attention modules of a decoder, in layer order."""
    found = [
        m
        for m in model.modules()
        if hasattr(m, "q_proj") and hasattr(m, "k_proj") and hasattr(m, "layer_idx")
    ]
    found.sort(key=lambda m: m.layer_idx)
    if not found:
        raise UnsupportedModelError(
            f"{type(model).__name__}: no attention modules with q_proj/k_proj/layer_idx found; "
            "policies that need attention (snapkv, h2o, tova) cannot run on this model"
        )
    return found


class QueryCapture:
    """Record each attention module's input during a forward pass, then rebuild its post-RoPE
    queries on demand (for policies that score entries by attention)."""

    def __init__(self, model: Any):
        self.modules = attention_modules(model)
        self.hidden: dict[int, torch.Tensor] = {}
        self.rope: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._handles: list[Any] = []

    def __enter__(self) -> QueryCapture:
        for i, module in enumerate(self.modules):
            self._handles.append(module.register_forward_pre_hook(self._hook(i), with_kwargs=True))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, index: int) -> Any:
        def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            rope = kwargs.get("position_embeddings")
            if rope is None and len(args) > 1 and isinstance(args[1], tuple):
                rope = args[1]
            rotary = getattr(module, "rotary_emb", None)
            position_ids = kwargs.get("position_ids")
            if (
                rope is None
                and rotary is not None
                and position_ids is not None
                and hidden is not None
            ):
                rope = rotary(hidden, position_ids)  # older models rotate inside attention
            if hidden is None or rope is None:
                raise UnsupportedModelError(
                    f"{type(module).__name__} did not receive hidden_states and "
                    "position_embeddings; attention-scored policies need them"
                )
            self.hidden[index] = hidden.detach()
            self.rope[index] = (rope[0].detach(), rope[1].detach())

        return hook

    @torch.inference_mode()
    def queries(self, layer: int, start: int = 0) -> torch.Tensor:
        """Post-RoPE queries of positions ``start..`` of batch row 0: ``(heads, len, head_dim)``."""
        return self.batch_queries(layer, start, rows=slice(0, 1))[0]

    @torch.inference_mode()
    def batch_queries(self, layer: int, start: int = 0, rows: slice | None = None) -> torch.Tensor:
        """Post-RoPE queries of the captured batch rows: ``(rows, heads, len, head_dim)``."""
        module = self.modules[layer]
        rows = rows if rows is not None else slice(None)
        hidden = self.hidden[layer][rows, start:]
        cos, sin = (t[:, start:] for t in self.rope[layer])
        if cos.shape[0] > 1:
            cos, sin = cos[rows], sin[rows]
        head_dim = module.head_dim
        q = module.q_proj(hidden).view(hidden.shape[0], hidden.shape[1], -1, head_dim)
        if getattr(module, "q_norm", None) is not None:
            q = module.q_norm(q)
        q = q.transpose(1, 2)
        rotate = getattr(sys.modules[type(module).__module__], "apply_rotary_pos_emb", None)
        if rotate is None:
            raise UnsupportedModelError(
                f"{type(module).__module__} has no apply_rotary_pos_emb; cannot rebuild queries"
            )
        q, _ = rotate(q, q, cos, sin)
        return q

    @property
    def scaling(self) -> float:
        module = self.modules[0]
        return float(getattr(module, "scaling", module.head_dim**-0.5))
