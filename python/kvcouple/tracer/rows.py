"""Rows of trajectories on a cache, and the one step that feeds them a token.

A batch of rows holds ``B`` P rows then ``B`` Q rows in some cache layout
(:class:`~kvcouple.tracer.trajectories.Trajectories`: one joint batch;
:class:`~kvcouple.tracer.layout.SplitRows`: two batches; :class:`~kvcouple.tracer.layout.
SharedRows`: prefixes held once). Every layout's batches are :class:`CacheRows`: one cache,
per-row visibility of its columns and per-row positions, stepped by :meth:`CacheRows.step`
(the new column, the mask, the forward pass, an optional :class:`StepHook`).
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from kvcouple.tracer import compat
from kvcouple.tracer.kvcache import cache_capacity, cache_length, cache_tensors
from kvcouple.tracer.lse_attention import MASK_ALIGNMENT
from kvcouple.tracer.prefix import SharedPrefix


class StepHook(Protocol):
    """Something that watches every step of a batch and may change its cache (decode-time
    eviction): ``capture()`` wraps the forward pass, ``after_step`` runs after it."""

    def capture(self) -> AbstractContextManager[Any]: ...

    def after_step(self, rows: Any) -> None: ...


class Rows(Protocol):
    """``B`` P rows then ``B`` Q rows in some cache layout."""

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per row; returns ``(2B, vocab)`` logits."""
        ...

    def fork(self, index: torch.Tensor, visible_before: torch.Tensor, steps: int = 0) -> Rows:
        """Copies of rows ``index`` that see the path columns before ``visible_before`` (P's
        columns), positioned to feed the token of that column, with room for ``steps``."""
        ...


def new_column(
    valid: torch.Tensor | None, dtype: torch.dtype, masked: bool = True
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Per-row visibility with the column a step is about to write (visible to its own row),
    and the step's additive mask (None unless ``masked``); (None, None) where every row sees
    every column (``valid`` None)."""
    if valid is None:
        return None, None
    ones = torch.ones(valid.shape[0], 1, dtype=torch.bool, device=valid.device)
    valid = torch.cat([valid, ones], dim=1)
    return valid, compat.additive_mask(valid, dtype) if masked else None


class CacheRows:
    """Rows sharing one cache: per-row visibility ``valid`` ``(rows, columns)`` (None: every
    column), per-row ``positions`` (of the next token fed), the prefixes they attend to first
    (``prefix``, the shared layout) and a :class:`StepHook`.

    Without a hook a step is static where the cache allows it (:func:`~kvcouple.tracer.
    compat.static_step`): the forward pass attends over the cache's whole preallocated
    capacity, the new column is made visible in place at the device-side write column, and
    the mask is as wide as the capacity. Every step of a batch then has the same shapes (one
    compilation, one CUDA graph). A hook's steps (decode-time eviction) grow their views."""

    def __init__(
        self,
        model: Any,
        cache: Any,
        valid: torch.Tensor | None,
        positions: torch.Tensor,
        *,
        masked: bool = True,
        hook: StepHook | None = None,
        prefix: SharedPrefix | None = None,
        dtype: torch.dtype | None = None,
    ):
        self.model, self.cache, self.positions = model, cache, positions
        self.valid = valid
        self.masked = masked  # False: every row sees every column, no mask needed
        self.hook = hook
        self.prefix = prefix
        self.dtype = dtype if dtype is not None else cache_tensors(cache)[0][0].dtype
        self._columns: torch.Tensor | None = None  # arange over the capacity (static steps)
        self._open = self._hidden = torch.zeros(())  # a static mask's two values (set with it)

    @property
    def valid(self) -> torch.Tensor | None:
        """``(rows, filled columns)``: a view of the visibility storage (writes go through)."""
        if self._visible is None:
            return None
        return self._visible[:, : cache_length(self.cache)]

    @valid.setter
    def valid(self, valid: torch.Tensor | None) -> None:
        self._visible = valid

    def _static_mask(self) -> torch.Tensor:
        """The mask of a static step over the cache's capacity: the columns each row sees,
        with the one being written, in place of ``valid`` plus a concatenated column."""
        capacity = cache_capacity(self.cache)
        # Masks are stored with 16-element-aligned rows (compat.additive_mask): the columns
        # past the capacity are hidden and outside the view.
        stored = capacity + (-capacity % MASK_ALIGNMENT)
        column = self.cache.write_column
        rows = int(self.positions.shape[0])
        if self._visible is None:  # every row sees the written columns, and this one
            if self._columns is None or self._columns.shape[0] != stored:
                self._columns = torch.arange(stored, device=column.device)
                self._open = torch.zeros((), dtype=self.dtype, device=column.device)
                self._hidden = torch.full_like(self._open, torch.finfo(self.dtype).min)
            # One row broadcast over the batch, additive as compat.additive_mask makes it.
            seen = torch.where(self._columns <= column, self._open, self._hidden)
            return compat.aligned_rows(seen.view(1, stored), capacity)
        if self._visible.shape[1] != stored:  # the cache grew: so does the storage
            grown = self._visible.new_zeros(rows, stored)
            kept = min(int(self._visible.shape[1]), capacity)
            grown[:, :kept] = self._visible[:, :kept]
            self._visible = grown
        visible = self._visible.index_fill_(1, column, True)
        return compat.additive_mask(visible[:, :capacity], self.dtype)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per row; returns ``(rows, vocab)`` logits."""
        whole = self.hook is None and compat.static_step(self.model, self.cache)
        if whole:
            mask: torch.Tensor | None = self._static_mask()
        else:
            self.valid, mask = new_column(self.valid, self.dtype, self.masked)
        capture = self.hook.capture() if self.hook is not None else contextlib.nullcontext()
        with capture:
            logits = compat.forward(
                self.model,
                tokens[:, None],
                self.cache,
                self.positions[:, None],
                mask,
                prefix=self.prefix,
                # (compiled in a compiled run, unless a hook captures inside the pass)
                step=self.hook is None,
                whole=whole,
            )
        if self.hook is not None:
            self.hook.after_step(self)
        self.positions = self.positions + 1
        return logits
