"""The joint cache layout: P rows and Q rows of a batch on one cache tensor per layer.

A :class:`Trajectories` batch holds ``2B`` rows (``B`` P rows, then ``B`` Q rows); each row has
its own visibility mask over the cache's columns and its own position. The Q rows' kept
entries are left-padded to the prefix length and the padding hidden. The other layouts are in
:mod:`kvcouple.tracer.layout`; the coupled step in :mod:`kvcouple.tracer.step`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from kvcouple.tracer import compat
from kvcouple.tracer.kvcache import cache_from_tensors, fork_cache
from kvcouple.tracer.prefill import Prefill
from kvcouple.tracer.rows import CacheRows, StepHook

__all__ = ["Trajectories"]


class Trajectories(CacheRows):
    """A batch of trajectories sharing one cache tensor per layer, with per-row visibility
    ``valid`` ``(rows, columns)`` and per-row ``positions`` (of the next token fed)."""

    valid: torch.Tensor

    def __init__(
        self,
        model: Any,
        cache: Any,
        valid: torch.Tensor,
        positions: torch.Tensor,
        padded: bool,
        hook: StepHook | None = None,
    ):
        """``cache``: a dynamic cache of the rows (see :func:`~kvcouple.tracer.kvcache.
        cache_with_capacity`), whose entry positions (per layer, ``(rows, kv_heads or 1,
        columns)``) let sliding-window layers run; None where eviction while decoding moves
        entries (those layers then refuse)."""
        # Without padding or eviction every row sees every column: no mask needed.
        super().__init__(
            model, cache, valid, positions, masked=padded or hook is not None, hook=hook
        )

    @property
    def padded(self) -> bool:
        return self.masked

    @classmethod
    def start(
        cls,
        model: Any,
        pre: Prefill,
        kept: list[tuple[torch.Tensor, torch.Tensor]],
        copies: int,
        hook: StepHook | None = None,
        idx: torch.Tensor | None = None,
        steps: int = 0,
    ) -> Trajectories:
        """``copies`` P rows on the full prefix cache, then ``copies`` Q rows on the kept entries
        (left-padded to the prefix length, the padding hidden), all about to feed the last
        prompt token at position ``n - 1``. ``idx``: the kept positions ``(layers, kv_heads,
        keep)``, which sliding-window layers need."""
        n1 = pre.prefix_length
        keep = kept[0][0].shape[2]
        device = pre.input_ids.device
        pad = (0, 0, n1 - keep, 0)

        def joint(full: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
            padded = torch.nn.functional.pad(part, pad)
            return torch.cat([full.expand(copies, -1, -1, -1), padded.expand(copies, -1, -1, -1)])

        def layers() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:  # one layer at a time
            for (kp, vp), (kq, vq) in zip(pre.kv, kept, strict=True):
                yield joint(kp, kq), joint(vp, vq)

        valid = torch.ones(2 * copies, n1, dtype=torch.bool, device=device)
        valid[copies:, : n1 - keep] = False
        positions = torch.full((2 * copies,), n1, device=device)
        key_positions = None
        if idx is not None and compat.needs_positions(model):  # only windows need them
            full_pos = torch.arange(n1, device=device, dtype=torch.int32)
            full_pos = full_pos.expand(copies, idx.shape[1], n1)
            key_positions = [
                torch.cat(
                    [
                        full_pos,
                        torch.nn.functional.pad(
                            kept_pos.to(device, torch.int32), (n1 - keep, 0)
                        ).expand(copies, -1, -1),
                    ]
                )
                for kept_pos in idx
            ]
        # Built one layer at a time, with room for the steps to come.
        cache = cache_from_tensors(layers(), key_positions, steps)
        return cls(model, cache, valid, positions, keep < n1, hook)

    def fork(
        self, index: torch.Tensor, visible_before: torch.Tensor, steps: int = 0
    ) -> Trajectories:
        """Copies of rows ``index`` that see only columns ``< visible_before`` (per new row),
        positioned to feed the token of column ``visible_before``, with room for ``steps``
        tokens; only the columns some new row can see are copied."""
        cache, valid = fork_cache(self.cache, self.valid, index, visible_before, steps)
        return Trajectories(self.model, cache, valid, visible_before.clone(), True)
