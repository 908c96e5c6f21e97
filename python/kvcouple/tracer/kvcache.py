"""The tracer's caches: every cache function, in one place.

A :class:`TracerCache` is transformers' ``DynamicCache`` (built empty and filled with
``cache.update(keys, values, layer_idx)``, every version from 4.45 on) that also holds each
entry's original position per row, layer and KV head (:func:`cache_positions`), which
sliding-window layers are masked by. Its tensors are read through ``cache.layers[i].keys /
.values`` (4.56+) or ``cache.key_cache[i]`` / ``cache.value_cache[i]`` (older).

Caches grow in place: each layer's keys and values live in a buffer preallocated for the
columns a batch will reach, and a step writes its new column into it. transformers'
``DynamicCache`` grows by ``torch.cat`` every step, which rewrites the whole cache (at 32k
tokens and 16 rows of an 8B model, ~128 GB of memory traffic per step) and briefly holds one
layer twice. A :class:`PreallocatedLayer` is a ``DynamicLayer`` whose ``keys``/``values`` are
views of the filled part of its buffers (made when read; a static step, :func:`prepare_step`,
attends over the whole buffers instead), so everything that reads a dynamic cache (the model's
attention, :func:`cache_tensors`, in-place decode-time eviction) works unchanged. A batch that
outgrows its capacity is moved to a larger buffer (a quarter more, at least 64 columns), never
failing. Entry positions and the decode-time evictor's slot state grow the same way
(:func:`append_columns`). A one-token step writes its column with ``index_copy_`` at the
cache's device-side write column (:attr:`TracerCache.write_column`, one tensor for every
layer), which :func:`advance` moves on after the forward pass; every forward on these
caches goes through :func:`kvcouple.tracer.compat.forward`, which does that.

Needs the cache-layer API of transformers 4.56+ for preallocation; with older releases
:func:`cache_with_capacity` builds the plain dynamic cache (same results, concatenating).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from transformers.cache_utils import DynamicCache

from kvcouple.tracer.model import UnsupportedModelError
from kvcouple.tracer.settings import active_compile_mode

_MIN_GROWTH = 64
_STATIC_SLACK = 1024


class TracerCache(DynamicCache):  # type: ignore[misc]
    """A dynamic cache that knows the original position of each of its entries.

    ``positions``: per layer ``(batch, kv_heads or 1, length)``; ``[]`` while nothing is
    cached (every position known), ``None`` where unknown (a cache built without them: then
    sliding-window layers refuse to run on it). ``position_storage``: the buffers the
    positions are views of (:func:`append_columns`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.positions: list[torch.Tensor] | None = []
        self.position_storage: list[torch.Tensor | None] | None = None
        # The column the next one-token forward writes, on the device, the same for every
        # layer and row of a preallocated cache (None: written by host-side slices).
        self.write_column: torch.Tensor | None = None


def new_cache() -> TracerCache:
    """An empty cache whose layers are created as they are filled."""
    return TracerCache()


def _layer_class() -> Any:
    try:
        from transformers.cache_utils import DynamicLayer
    except ImportError:  # transformers < 4.56: no cache layers
        return None
    return DynamicLayer


def _moved(old: torch.Tensor, length: int, capacity: int) -> torch.Tensor:
    """``old``'s first ``length`` columns in a new uninitialised buffer of ``capacity``."""
    new = old.new_empty(*old.shape[:-2], capacity, old.shape[-1])
    new[..., :length, :] = old[..., :length, :]
    return new


def _filled_view(buffer: str) -> Any:
    """A layer's ``keys``/``values``: the filled columns of ``buffer``, a view made when read;
    assigning anything but None (the base class's reset) is refused."""

    def read(layer: Any) -> torch.Tensor:
        return getattr(layer, buffer)[..., : layer.length, :]

    def assign(layer: Any, value: torch.Tensor | None) -> None:
        if value is not None:
            raise UnsupportedModelError("a preallocated cache layer is written by update()")

    return property(read, assign)


def _make_layer_class(base: Any) -> Any:
    class PreallocatedLayer(base):  # type: ignore[misc, valid-type]
        """A dynamic cache layer whose tensors are views into buffers with room to grow.

        ``length`` (a host integer) is how many columns are filled; ``keys``/``values`` are
        views of them, made when read. Before the first static step the columns past
        ``length`` are zeroed (finite, so a masked score of them is exactly 0 after the
        softmax). While ``whole`` is set (a
        static step, :func:`prepare_step`) a one-token update writes at the device-side
        column and returns the whole buffers: the step's shapes are the capacity's, not the
        filled length's, and the step's mask hides what is not yet written."""

        def __init__(
            self,
            keys: torch.Tensor,
            values: torch.Tensor,
            capacity: int,
            column: torch.Tensor | None = None,
        ):
            super().__init__()
            self.column = column  # the cache's write column (see TracerCache.write_column)
            self.whole = False
            length = int(keys.shape[-2])
            self._k = keys.new_empty(*keys.shape[:-2], max(capacity, length), keys.shape[-1])
            self._v = values.new_empty(*values.shape[:-2], max(capacity, length), values.shape[-1])
            self._k[..., :length, :] = keys
            self._v[..., :length, :] = values
            if active_compile_mode() == "reduce-overhead":
                # CUDA graphs write the step's column into the buffers in place: allowed for
                # inputs at static addresses only (else inductor skips the graphs).
                torch._dynamo.mark_static_address(self._k)
                torch._dynamo.mark_static_address(self._v)
            self.length = length
            self.zeroed = False  # whether the unwritten columns hold zeros (zero_tail)
            self.device = keys.device
            self.is_initialized = True

        # The base class assigns keys/values (None on reset); the buffers are the state here.
        keys = _filled_view("_k")
        values = _filled_view("_v")

        @property
        def capacity(self) -> int:
            return int(self._k.shape[-2])

        def get_seq_length(self, *args: Any) -> int:
            return self.length

        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            if self.whole:  # a static step: room was reserved, advance() moves length on
                assert self.column is not None  # (prepare_step sets whole only with one)
                self._k.index_copy_(-2, self.column, key_states)
                self._v.index_copy_(-2, self.column, value_states)
                return self._k, self._v
            start = self.length
            stop = start + int(key_states.shape[-2])
            if stop > self.capacity:
                self.grow(stop)
            if self.column is not None and stop == start + 1:
                # One token: written at the device-side column (no slices of the buffers).
                self._k.index_copy_(-2, self.column, key_states)
                self._v.index_copy_(-2, self.column, value_states)
            else:
                self._k[..., start:stop, :] = key_states
                self._v[..., start:stop, :] = value_states
            self.length = stop
            return self.keys, self.values

        def grow(self, needed: int) -> None:
            """Room for ``needed`` columns (a quarter more, at least 64 columns more)."""
            capacity = max(needed, self.capacity + max(_MIN_GROWTH, self.capacity // 4))
            self._k = _moved(self._k, self.length, capacity)
            self._v = _moved(self._v, self.length, capacity)
            self.zeroed = False

        def zero_tail(self) -> None:
            # Once, before the first static step: buffers are allocated uninitialised, so
            # pages a growing step never reaches stay untouched.
            if not self.zeroed:
                self._k[..., self.length :, :].zero_()
                self._v[..., self.length :, :].zero_()
                self.zeroed = True

    return PreallocatedLayer


_BASE = _layer_class()
PreallocatedLayer: Any = _make_layer_class(_BASE) if _BASE is not None else None


def cache_with_capacity(
    layers: Iterable[tuple[torch.Tensor, torch.Tensor]],
    room: int,
    positions: list[torch.Tensor] | None = None,
) -> TracerCache:
    """A cache holding the given per-layer ``(keys, values)`` with room for ``room`` more
    columns per layer. ``layers`` may be a generator: each layer's tensors are copied into
    their buffers and can be freed before the next layer is produced. ``positions``: per
    layer, the original position of every entry, ``(batch, kv_heads or 1, length)`` (hidden
    padding may hold anything); ``None`` where they are not known."""
    cache = new_cache()
    if PreallocatedLayer is None:  # no cache layers: a plain dynamic cache, concatenating
        for layer, (k, v) in enumerate(layers):
            cache.update(k, v, layer)
        cache.positions = positions
        return cache
    built = []
    column: torch.Tensor | None = None
    for k, v in layers:
        if column is None:
            column = torch.full((1,), int(k.shape[-2]), dtype=torch.long, device=k.device)
        built.append(PreallocatedLayer(k, v, int(k.shape[-2]) + room, column))
    if len({layer.length for layer in built}) > 1:  # no one column for all
        column = None
        for layer in built:
            layer.column = None
    cache.layers = built
    cache.write_column = column
    # Layers are given, not created on first update.
    if hasattr(cache, "layer_class_to_replicate"):
        cache.layer_class_to_replicate = None
    cache.positions = positions
    return cache


def cache_from_tensors(
    kv: Iterable[tuple[torch.Tensor, torch.Tensor]],
    positions: list[torch.Tensor] | None = None,
    room: int = 0,
) -> TracerCache:
    """:func:`cache_with_capacity` with the positions first (``kv`` may be a generator)."""
    return cache_with_capacity(kv, room, positions)


def prepare_step(cache: Any, static: bool) -> bool:
    """Before a one-token forward pass: whether it is a static step (``static`` asked, a
    preallocated cache with one write column): then every layer has room for the column
    (grown here if not, on the host) and attends over its whole buffer; the step's mask must
    cover :func:`cache_capacity` columns."""
    column = getattr(cache, "write_column", None) if isinstance(cache, TracerCache) else None
    layers = list(getattr(cache, "layers", ())) if column is not None else []
    # Attending over the whole buffer costs its unwritten columns too: static only while they
    # are at most the filled ones plus a slack (a huge horizon grows first, then turns static).
    whole = static and bool(layers)
    whole = whole and layers[0].capacity - layers[0].length <= layers[0].length + _STATIC_SLACK
    for layer in layers:
        if whole and layer.length + 1 > layer.capacity:
            layer.grow(layer.length + 1)
        if whole:
            layer.zero_tail()
        layer.whole = whole
    return whole


def advance(cache: Any, tokens: int) -> None:
    """After a forward pass fed ``tokens`` per row: the cache's device-side write column
    moves on (one in-place add for every layer), and after a static step every layer's
    filled length (on the host)."""
    column = getattr(cache, "write_column", None) if isinstance(cache, TracerCache) else None
    if column is not None:
        column.add_(tokens)
        for layer in cache.layers:
            if layer.whole:
                layer.length += tokens
                layer.whole = False


def cache_capacity(cache: Any) -> int:
    """Columns the first layer's buffers hold (its filled length without preallocation)."""
    layers = getattr(cache, "layers", None)
    if layers and PreallocatedLayer is not None and isinstance(layers[0], PreallocatedLayer):
        return int(layers[0].capacity)
    return cache_length(cache)


def cache_tensors(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer ``(keys, values)`` of a dynamic cache, ``(batch, kv_heads, length, head_dim)``."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return [(layer.keys, layer.values) for layer in layers]
    if hasattr(cache, "key_cache"):
        return list(zip(cache.key_cache, cache.value_cache, strict=False))
    raise UnsupportedModelError(f"cannot read the tensors of a {type(cache).__name__}")


def cache_length(cache: Any) -> int:
    """Filled columns of the first layer (a host integer; no view is made)."""
    layers = getattr(cache, "layers", None)
    if layers and PreallocatedLayer is not None and isinstance(layers[0], PreallocatedLayer):
        return int(layers[0].length)
    return int(cache_tensors(cache)[0][0].shape[-2])


def has_entries(cache: Any) -> bool:
    try:
        return int(cache.get_seq_length()) > 0
    except Exception:  # an empty cache of some versions has no layers to ask
        return False


def cache_positions(cache: Any) -> list[torch.Tensor] | None:
    """Per layer, the original position of each entry of a cache the tracer built or filled:
    ``(batch, kv_heads or 1, length)``; ``None`` if unknown (not a :class:`TracerCache`, one
    built without them, or one whose entries no longer match them)."""
    known = cache.positions if isinstance(cache, TracerCache) else None
    if known is None:
        return None
    lengths = [int(k.shape[-2]) for k, _ in cache_tensors(cache)] if has_entries(cache) else []
    if not known:
        return known if not lengths else None
    if len(known) != len(lengths) or any(
        int(p.shape[-1]) != n for p, n in zip(known, lengths, strict=True)
    ):
        return None
    return known


def extend_positions(
    cache: Any, position_ids: torch.Tensor, layers: int
) -> list[torch.Tensor] | None:
    """Append the fed tokens' positions ``(batch, q)`` to every layer's entry positions
    (before the forward pass that caches them); the positions the pass attends by."""
    known = cache_positions(cache)
    new = position_ids[:, None, :].to(torch.int32)
    storage: list[torch.Tensor | None] | None = None
    if known is None:
        out = None
    elif not known:
        out = [new for _ in range(layers)]
    else:
        rooms = getattr(cache, "position_storage", None)
        if rooms is None or len(rooms) != len(known):
            rooms = [None] * len(known)
        grown = [
            append_columns(p, new.to(p.device), room) for p, room in zip(known, rooms, strict=True)
        ]
        out = [view for view, _ in grown]
        storage = [room for _, room in grown]
    if isinstance(cache, TracerCache):
        cache.positions, cache.position_storage = out, storage
    return out


def forget_positions(cache: Any) -> None:
    """Entry positions are not tracked for this cache (no sliding window needs them)."""
    if isinstance(cache, TracerCache):
        cache.positions = cache.position_storage = None


def append_columns(
    known: torch.Tensor, new: torch.Tensor, storage: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``known`` ``(..., n)`` with ``new`` (broadcast to ``(..., q)``) appended, and the
    storage it is a view of: written in place where ``storage`` (behind ``known``) has room,
    else in a new one with a quarter more (at least 64 columns), as the caches grow. A
    concatenation per step and layer would copy every column. Entry positions of windowed
    models and the decode-time evictor's slot state grow this way."""
    lead, n = known.shape[:-1], int(known.shape[-1])
    q = int(new.shape[-1])
    if (
        storage is None
        or storage.shape[-1] < n + q
        or storage.shape[:-1] != lead
        or storage.data_ptr() != known.data_ptr()
    ):
        storage = known.new_empty(*lead, n + q + max(_MIN_GROWTH, n // 4))
        storage[..., :n] = known
    storage[..., n : n + q] = new.expand(*lead, q)
    return storage[..., : n + q], storage


def fork_cache(
    cache: Any, valid: torch.Tensor | None, index: torch.Tensor, limit: torch.Tensor, steps: int
) -> tuple[Any, torch.Tensor]:
    """A cache of rows ``index`` of ``cache`` that see columns ``< limit`` (per new row, and
    only those ``valid`` showed; None: all), with room for ``steps`` more columns, and the new
    rows' visibility. Only the columns some new row can see are copied, a layer at a time."""
    columns = int(limit.max())
    layers = (
        (k[:, :, :columns].index_select(0, index), v[:, :, :columns].index_select(0, index))
        for k, v in cache_tensors(cache)
    )
    positions = cache_positions(cache)
    if positions is not None:
        positions = [p[..., :columns].index_select(0, index) for p in positions]
    seen = torch.arange(columns, device=limit.device)[None, :] < limit[:, None]
    if valid is not None:
        seen &= valid.index_select(0, index)[:, :columns]
    return cache_with_capacity(layers, steps, positions), seen


def cache_bytes(cache: Any) -> int:
    """Bytes held by a cache's key and value storage (buffers, not just the filled part)."""
    seen: dict[int, int] = {}
    for layer in getattr(cache, "layers", ()):
        for t in (getattr(layer, "_k", None), getattr(layer, "_v", None)):
            if t is not None:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    if not seen:
        for k, v in cache_tensors(cache):
            for t in (k, v):
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())
