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
- Attention that dispatches through ``ALL_ATTENTION_FUNCTIONS`` (transformers 4.48+) runs
  through :mod:`kvcouple.tracer.attention`'s wrapper during every tracer forward pass: it adds
  each layer's sliding window (by original position) to the mask and records what
  attention-scored policies need. Models that do not dispatch through it (Falcon) run as they
  are; :mod:`kvcouple.tracer.support` refuses what that cannot serve exactly.
- Every layer keeps every entry in a plain dynamic cache (no sliding-window layers that drop
  entries): the tracer tracks each entry's original position per row, layer and KV head
  (:func:`cache_positions`), and windows are applied by position.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

import torch

from kvcouple.tracer import attention
from kvcouple.tracer.attention import QueryCapture, UnsupportedModelError

__all__ = [
    "QueryCapture",
    "UnsupportedModelError",
    "additive_mask",
    "append_columns",
    "cache_from_tensors",
    "cache_length",
    "cache_positions",
    "cache_tensors",
    "forward",
    "needs_positions",
    "new_cache",
]


def needs_positions(model: Any) -> bool:
    """Whether some layer has a sliding window, so caches must track entry positions (they
    are dropped otherwise: they would only cost memory)."""
    from kvcouple.tracer.support import layer_windows, text_config

    return any(w is not None for w in layer_windows(text_config(model)))


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

    cache: Any = DynamicCache()
    cache.kvcouple_positions = []  # nothing cached yet: every position is known
    return cache


def cache_from_tensors(
    kv: Iterable[tuple[torch.Tensor, torch.Tensor]],
    positions: list[torch.Tensor] | None = None,
    room: int = 0,
) -> Any:
    """A dynamic cache holding the given per-layer ``(keys, values)``, preallocated with room
    for ``room`` more columns (:mod:`kvcouple.tracer.kvcache`; ``kv`` may be a generator).

    ``positions``: per layer, the original position of every entry, ``(batch, kv_heads or 1,
    length)`` (hidden padding may hold anything); ``None`` where they are not known (then
    sliding-window layers refuse to run on this cache).
    """
    from kvcouple.tracer.kvcache import cache_with_capacity

    return cache_with_capacity(kv, room, positions)


def cache_positions(cache: Any) -> list[torch.Tensor] | None:
    """Per layer, the original position of each entry of a cache the tracer built or filled:
    ``(batch, kv_heads or 1, length)``; ``None`` if unknown (a cache built without them, or
    whose entries no longer match them)."""
    known = getattr(cache, "kvcouple_positions", None)
    if known is None:
        return None
    lengths = [int(k.shape[-2]) for k, _ in cache_tensors(cache)] if _has_entries(cache) else []
    if not known:
        return known if not lengths else None
    if len(known) != len(lengths) or any(
        int(p.shape[-1]) != n for p, n in zip(known, lengths, strict=True)
    ):
        return None
    return known


def _extend_positions(
    cache: Any, position_ids: torch.Tensor, layers: int
) -> list[torch.Tensor] | None:
    """Append the fed tokens' positions to every layer's entry positions."""
    known = cache_positions(cache)
    new = position_ids[:, None, :].to(torch.int32)
    if known is None:
        out = None
    elif not known:
        out = [new for _ in range(layers)]
    else:
        storage = getattr(cache, "kvcouple_position_storage", None)
        if storage is None or len(storage) != len(known):
            storage = [None] * len(known)
        grown = [
            append_columns(p, new.to(p.device), room)
            for p, room in zip(known, storage, strict=True)
        ]
        out = [view for view, _ in grown]
        cache.kvcouple_position_storage = [room for _, room in grown]
    cache.kvcouple_positions = out
    return out


def append_columns(
    known: torch.Tensor, new: torch.Tensor, storage: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``known`` ``(rows, heads, n)`` with ``new`` ``(rows, 1, q)`` appended, and the storage
    it is a view of: written in place where ``storage`` (behind ``known``) has room, else in a
    new one with a quarter more (at least 64 columns), as the caches grow
    (:mod:`kvcouple.tracer.kvcache`). A concatenation per step and layer would copy every
    column. Entry positions of windowed models and the decode-time evictor's slot state grow
    this way."""
    rows, heads, n = known.shape
    q = new.shape[-1]
    if (
        storage is None
        or storage.shape[-1] < n + q
        or storage.shape[:2] != known.shape[:2]
        or storage.data_ptr() != known.data_ptr()
    ):
        storage = known.new_empty(rows, heads, n + q + max(64, n // 4))
        storage[..., :n] = known
    storage[..., n : n + q] = new.expand(rows, heads, q)
    return storage[..., : n + q], storage


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
    prefix: attention.SharedPrefix | None = None,
) -> torch.Tensor:
    """One forward pass that appends to ``cache``; returns the logits of the last position
    ``(batch, vocab)`` (or every position with ``last_only=False``). ``prefix``: the prefixes
    the rows attend to before ``cache`` (the shared layout)."""
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
    if needs_positions(model):
        positions = _extend_positions(cache, position_ids, _num_layers(model))
    else:
        positions = cache.kvcouple_positions = None
    with attention.active(model, position_ids, positions, prefix):
        logits = model(**kw).logits
    return logits[:, -1] if last_only else logits


def _num_layers(model: Any) -> int:
    cfg = (
        model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    )
    return int(cfg.num_hidden_layers)


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
