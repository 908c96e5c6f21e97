"""The tracer's forward pass, and what it assumes of transformers across the versions it supports.

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
  entries): the cache tracks each entry's original position per row, layer and KV head
  (:mod:`kvcouple.tracer.kvcache`), and windows are applied by position.

The cache functions live in :mod:`kvcouple.tracer.kvcache` and are imported from there.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

import torch

from kvcouple.tracer import attention, kvcache
from kvcouple.tracer.lse_attention import MASK_ALIGNMENT
from kvcouple.tracer.model import facts
from kvcouple.tracer.prefix import SharedPrefix
from kvcouple.tracer.settings import active_compile_mode

__all__ = ["additive_mask", "aligned_rows", "forward", "needs_positions", "static_step"]


def needs_positions(model: Any) -> bool:
    """Whether some layer has a sliding window, so caches must track entry positions (they
    are dropped otherwise: they would only cost memory)."""
    return facts(model).windowed


def forward(
    model: Any,
    input_ids: torch.Tensor,
    cache: Any,
    position_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    last_only: bool = True,
    prefix: SharedPrefix | None = None,
    step: bool = False,
    whole: bool = False,
) -> torch.Tensor:
    """One forward pass that appends to ``cache``; returns the logits of the last position
    ``(batch, vocab)`` (or every position with ``last_only=False``). ``prefix``: the prefixes
    the rows attend to before ``cache`` (the shared layout). ``step``: a decoding step, which
    runs compiled while a compiled run is in progress (:func:`~kvcouple.tracer.settings.
    compiling`). ``whole``: a static step prepared by :func:`static_step` (the mask covers
    the cache's capacity).

    The host's bookkeeping (lengths, positions, the write column) happens here, around the
    model call, so that a compiled call sees the same shapes at every step of a batch."""
    f = facts(model)
    params = f.forward_parameters
    kw: dict[str, Any] = {
        "input_ids": input_ids,
        "position_ids": position_ids,
        "attention_mask": attention_mask,
        "use_cache": True,
    }
    kw["cache" if "cache" in params else "past_key_values"] = cache
    if "cache_position" in params:
        column = getattr(cache, "write_column", None) if whole else None
        if column is not None:
            kw["cache_position"] = column  # the device-side column: no host value per step
        else:
            start = kvcache.cache_length(cache) if kvcache.has_entries(cache) else 0
            kw["cache_position"] = torch.arange(
                start, start + input_ids.shape[1], device=input_ids.device
            )
    if last_only:
        if "logits_to_keep" in params:
            kw["logits_to_keep"] = 1
        elif "num_logits_to_keep" in params:
            kw["num_logits_to_keep"] = 1
    if f.windowed:
        positions = kvcache.extend_positions(cache, position_ids, f.layers)
    else:
        positions = None
        kvcache.forget_positions(cache)
    mode = active_compile_mode() if step else None
    if mode is None or mode in _FAILED:
        logits = _call(model, kw, positions, prefix, last_only)
    else:
        try:
            logits = _compiled(mode)(model, kw, positions, prefix, last_only)
        except Exception as e:
            if not _is_compile_failure(e):
                raise
            # Eager is the fallback: the failure came while compiling, before the step's
            # graph ran, and the step's one write (at the device-side column) is idempotent.
            _compile_failed(mode, e)
            logits = _call(model, kw, positions, prefix, last_only)
    kvcache.advance(cache, int(input_ids.shape[1]))
    return logits


def static_step(model: Any, cache: Any) -> bool:
    """Prepare ``cache`` for a static one-token step (:func:`kvcouple.tracer.kvcache.
    prepare_step`): every layer attends over its whole preallocated buffer, so each step of a
    batch has the same shapes. Not for windowed models (their entry positions grow)."""
    return kvcache.prepare_step(cache, not facts(model).windowed)


def _call(
    model: Any,
    kw: dict[str, Any],
    positions: list[torch.Tensor] | None,
    prefix: SharedPrefix | None,
    last_only: bool,
) -> torch.Tensor:
    with attention.active(model, kw["position_ids"], positions, prefix):
        logits = model(**kw).logits
    return logits[:, -1] if last_only else logits


# One compiled model call per torch.compile mode, for the process's life. A static step
# attends over the batch's preallocated capacity, so every step of a batch has one shape: it
# compiles (and, with CUDA graphs, records) once however many steps follow. Across batches
# (other prompt lengths, other row counts) dynamo's automatic dynamic shapes make the second
# shape's graph dynamic instead of compiling once per document.
_COMPILED: dict[str, Any] = {}


# Modes whose compilation failed in this process (why): their steps run eagerly.
_FAILED: dict[str, str] = {}


def _is_compile_failure(e: BaseException) -> bool:
    """Whether ``e`` is torch.compile failing (dynamo, or its backend, which dynamo wraps),
    not the step itself. Dynamo raised it, so it is imported (torch imports it lazily: ~1 s
    that an eager run never pays)."""
    exc = sys.modules.get("torch._dynamo.exc")
    return exc is not None and isinstance(e, exc.TorchDynamoException)


def _compile_failed(mode: str, e: BaseException) -> None:
    inner = getattr(e, "inner_exception", None)  # what a failing backend raised
    shown = inner if isinstance(inner, BaseException) else e
    lines = str(shown).strip().splitlines()
    why = f"{type(shown).__name__}: {lines[0] if lines else ''}"
    _FAILED[mode] = why
    warnings.warn(
        f"kvcouple: the decoding step failed to compile with torch.compile(mode={mode!r}) "
        f"({why[:300]}); it runs eagerly for the rest of this process (--compile off "
        "skips the attempt)",
        RuntimeWarning,
        stacklevel=3,
    )


def _compiled(mode: str) -> Any:
    fn = _COMPILED.get(mode)
    if fn is None:
        fn = torch.compile(_call, mode=mode)
        _COMPILED[mode] = fn
    return fn


def additive_mask(valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A ``(batch, 1, 1, keys)`` additive mask from a ``(batch, keys)`` bool mask of visible
    keys, its rows stored 16-element aligned (a view of ``keys`` columns): CUDA's attention
    kernels take such a mask as it is, and would pad a copy of any other in every layer."""
    rows, keys = (int(n) for n in valid.shape)
    stored = keys + (-keys % MASK_ALIGNMENT)
    mask = torch.zeros((rows, stored), dtype=dtype, device=valid.device)
    mask[:, :keys].masked_fill_(~valid, torch.finfo(dtype).min)
    return aligned_rows(mask, keys)


def aligned_rows(mask: torch.Tensor, keys: int) -> torch.Tensor:
    """``(batch, 1, 1, keys)`` view of a ``(batch, stored)`` mask (``stored`` a multiple of
    16, ``>= keys``): every stride aligned, the size-1 axes' too (the kernels check them all)."""
    stored = int(mask.shape[-1])
    return mask.as_strided((int(mask.shape[0]), 1, 1, keys), (stored, stored, stored, 1))
