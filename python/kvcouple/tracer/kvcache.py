"""Caches that grow in place: each layer's keys and values live in a buffer preallocated for
the columns a batch will reach, and a step writes its new column into it.

transformers' ``DynamicCache`` grows by ``torch.cat`` every step, which rewrites the whole
cache (at 32k tokens and 16 rows of an 8B model, ~128 GB of memory traffic per step) and
briefly holds one layer twice. A :class:`PreallocatedLayer` is a ``DynamicLayer`` whose
``keys``/``values`` are views of the filled part of its buffers, so everything that reads a
dynamic cache (the model's attention, :func:`kvcouple.tracer.compat.cache_tensors`, in-place
decode-time eviction) works unchanged. A batch that outgrows its capacity is moved to a larger
buffer (a quarter more, at least 64 columns), never failing.

Needs the cache-layer API of transformers 4.56+; with older releases :func:`cache_with_capacity`
builds the plain dynamic cache (same results, concatenating).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from kvcouple.tracer import compat

_MIN_GROWTH = 64


def _layer_class() -> Any:
    try:
        from transformers.cache_utils import DynamicLayer
    except ImportError:  # transformers < 4.56: no cache layers
        return None
    return DynamicLayer


def _make_layer_class(base: Any) -> Any:
    class PreallocatedLayer(base):  # type: ignore[misc, valid-type]
        """A dynamic cache layer whose tensors are views into buffers with room to grow."""

        def __init__(self, keys: torch.Tensor, values: torch.Tensor, capacity: int):
            super().__init__()
            length = int(keys.shape[-2])
            self._k = keys.new_empty(*keys.shape[:-2], max(capacity, length), keys.shape[-1])
            self._v = values.new_empty(*values.shape[:-2], max(capacity, length), values.shape[-1])
            self._k[..., :length, :] = keys
            self._v[..., :length, :] = values
            self.device = keys.device
            self.is_initialized = True
            self._view(length)

        @property
        def capacity(self) -> int:
            return int(self._k.shape[-2])

        def _view(self, length: int) -> None:
            self.keys = self._k[..., :length, :]
            self.values = self._v[..., :length, :]

        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            start = int(self.keys.shape[-2])
            stop = start + int(key_states.shape[-2])
            if stop > self.capacity:
                self._grow(max(stop, self.capacity + max(_MIN_GROWTH, self.capacity // 4)))
            self._k[..., start:stop, :] = key_states
            self._v[..., start:stop, :] = value_states
            self._view(stop)
            return self.keys, self.values

        def _grow(self, capacity: int) -> None:
            length = int(self.keys.shape[-2])
            for name in ("_k", "_v"):
                old = getattr(self, name)
                new = old.new_empty(*old.shape[:-2], capacity, old.shape[-1])
                new[..., :length, :] = old[..., :length, :]
                setattr(self, name, new)
            self._view(length)

    return PreallocatedLayer


_BASE = _layer_class()
PreallocatedLayer: Any = _make_layer_class(_BASE) if _BASE is not None else None


def cache_with_capacity(
    layers: Iterable[tuple[torch.Tensor, torch.Tensor]],
    room: int,
    positions: list[torch.Tensor] | None = None,
) -> Any:
    """A dynamic cache holding the given per-layer ``(keys, values)`` with room for ``room``
    more columns per layer. ``layers`` may be a generator: each layer's tensors are copied
    into their buffers and can be freed before the next layer is produced. ``positions``: per
    layer, each entry's original position (see :func:`kvcouple.tracer.compat.cache_from_tensors`)."""
    cache = compat.new_cache()
    if PreallocatedLayer is None:  # no cache layers: a plain dynamic cache, concatenating
        for layer, (k, v) in enumerate(layers):
            cache.update(k, v, layer)
        cache.kvcouple_positions = positions
        return cache
    cache.layers = [PreallocatedLayer(k, v, int(k.shape[-2]) + room) for k, v in layers]
    # Layers are given, not created on first update.
    if hasattr(cache, "layer_class_to_replicate"):
        cache.layer_class_to_replicate = None
    cache.kvcouple_positions = positions
    return cache


def fork_cache(
    cache: Any, valid: torch.Tensor | None, index: torch.Tensor, limit: torch.Tensor, steps: int
) -> tuple[Any, torch.Tensor]:
    """A cache of rows ``index`` of ``cache`` that see columns ``< limit`` (per new row, and
    only those ``valid`` showed; None: all), with room for ``steps`` more columns, and the new
    rows' visibility. Only the columns some new row can see are copied, a layer at a time."""
    columns = int(limit.max())
    layers = (
        (k[:, :, :columns].index_select(0, index), v[:, :, :columns].index_select(0, index))
        for k, v in compat.cache_tensors(cache)
    )
    positions = compat.cache_positions(cache)
    if positions is not None:
        positions = [p[..., :columns].index_select(0, index) for p in positions]
    seen = torch.arange(columns, device=limit.device)[None, :] < limit[:, None]
    if valid is not None:
        seen &= valid.index_select(0, index)[:, :columns]
    return compat.cache_from_tensors(layers, positions, steps), seen


def cache_bytes(cache: Any) -> int:
    """Bytes held by a cache's key and value storage (buffers, not just the filled part)."""
    seen: dict[int, int] = {}
    for layer in getattr(cache, "layers", ()):
        for t in (getattr(layer, "_k", None), getattr(layer, "_v", None)):
            if t is not None:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    if not seen:
        for k, v in compat.cache_tensors(cache):
            for t in (k, v):
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())
