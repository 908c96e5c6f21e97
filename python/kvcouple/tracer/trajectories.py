"""The one coupled step every part of the tracer runs.

A :class:`Trajectories` batch holds ``2B`` rows (``B`` P rows, then ``B`` Q rows) on one cache
tensor per layer; each row has its own visibility mask over the cache's columns and its own
position. :func:`coupled_step` is the step: feed one token per row, apply the decoding
transform, make finished rows a point mass on their EOS (:class:`EosState`), and couple row
``i`` of P with row ``i`` of Q with the maximal coupling. The overlap path, the branches forked
from the path's cache and the branches replayed from the prompt all call it; what differs is
only which token each row is fed, which uniforms it gets, and what is recorded.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kvcouple.torch_coupling import couple_rows
from kvcouple.tracer import compat
from kvcouple.tracer.kvcache import fork_cache
from kvcouple.tracer.prefill import Prefill
from kvcouple.tracer.settings import Decoding


class StepHook(Protocol):
    """Something that watches every step of a batch and may change its cache (decode-time
    eviction): ``capture()`` wraps the forward pass, ``after_step`` runs after it."""

    def capture(self) -> AbstractContextManager[Any]: ...

    def after_step(self, rows: Trajectories) -> None: ...


class Rows(Protocol):
    """``B`` P rows then ``B`` Q rows in some cache layout (:class:`Trajectories`: one joint
    batch; :class:`~kvcouple.tracer.layout.SplitRows`: P and Q as two batches)."""

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per row; returns ``(2B, vocab)`` logits."""
        ...

    def fork(self, index: torch.Tensor, visible_before: torch.Tensor, steps: int = 0) -> Rows:
        """Copies of rows ``index`` that see the path columns before ``visible_before`` (P's
        columns), positioned to feed the token of that column, with room for ``steps``."""
        ...


class Trajectories:
    """A batch of trajectories sharing one cache tensor per layer, with per-row visibility
    ``valid`` ``(rows, columns)`` and per-row ``positions`` (of the next token fed)."""

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
        self.model = model
        self.cache = cache
        self.valid = valid
        self.positions = positions
        # Without padding or eviction every row sees every column: no mask needed.
        self.padded = padded or hook is not None
        self.dtype = compat.cache_tensors(cache)[0][0].dtype
        self.hook = hook

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
        cache = compat.cache_from_tensors(layers(), key_positions, steps)
        return cls(model, cache, valid, positions, keep < n1, hook)

    def fork(
        self, index: torch.Tensor, visible_before: torch.Tensor, steps: int = 0
    ) -> Trajectories:
        """Copies of rows ``index`` that see only columns ``< visible_before`` (per new row),
        positioned to feed the token of column ``visible_before``, with room for ``steps``
        tokens; only the columns some new row can see are copied."""
        cache, valid = fork_cache(self.cache, self.valid, index, visible_before, steps)
        return Trajectories(self.model, cache, valid, visible_before.clone(), True)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per row; returns ``(rows, vocab)`` logits."""
        ones = torch.ones(self.valid.shape[0], 1, dtype=torch.bool, device=self.valid.device)
        self.valid = torch.cat([self.valid, ones], dim=1)
        mask = compat.additive_mask(self.valid, self.dtype) if self.padded else None
        if self.hook is None:
            logits = compat.forward(
                self.model, tokens[:, None], self.cache, self.positions[:, None], mask
            )
        else:
            with self.hook.capture():
                logits = compat.forward(
                    self.model, tokens[:, None], self.cache, self.positions[:, None], mask
                )
            self.hook.after_step(self)
        self.positions = self.positions + 1
        return logits


class EosState:
    """Absorbing EOS per row: once a row emits one of ``ids`` its kernel is a point mass on it."""

    def __init__(self, ids: tuple[int, ...] | None, rows: int, device: torch.device):
        self.ids = torch.tensor(ids or (), dtype=torch.long, device=device)
        self.done = torch.zeros(rows, dtype=torch.bool, device=device)
        self.last = torch.zeros(rows, dtype=torch.long, device=device)

    def absorb(self, probs: torch.Tensor) -> torch.Tensor:
        if not self.ids.numel():
            return probs
        point = torch.nn.functional.one_hot(self.last, probs.shape[-1]).to(probs.dtype)
        return torch.where(self.done[:, None], point, probs)

    def advance(self, tokens: torch.Tensor, active: torch.Tensor) -> None:
        """Rows where ``active`` emitted ``tokens``; those that hit an EOS id are done."""
        if not self.ids.numel():
            return
        newly = active & ~self.done & torch.isin(tokens, self.ids)
        self.last = torch.where(newly, tokens, self.last)
        self.done = self.done | newly


@dataclass
class CoupledStep:
    """One coupled step of ``B`` row pairs: both kernels, the coupled draws, TV and overlap."""

    p: torch.Tensor  # (B, vocab)
    q: torch.Tensor
    x: torch.Tensor  # (B,) P's token
    y: torch.Tensor  # (B,) Q's token
    tv: torch.Tensor  # (B,) float64
    overlap: torch.Tensor  # (B,) float64, sum min(p, q)


def coupled_step(
    rows: Rows,
    tokens: torch.Tensor,
    decoding: Decoding,
    eos: EosState,
    u: torch.Tensor,
) -> CoupledStep:
    """Feed ``tokens`` ``(2B,)`` (P rows then Q rows), transform, absorb EOS, couple with the
    uniforms ``u`` ``(B, 3)`` (``u0 = 1``: the overlap; ``u0 = 0``: the residuals). The caller
    records what it needs and then calls ``eos.advance``."""
    probs = eos.absorb(decoding.probs(rows.step(tokens)))
    half = probs.shape[0] // 2
    p, q = probs[:half], probs[half:]
    x, y, tv, overlap = couple_rows(p, q, u)
    return CoupledStep(p, q, x, y, tv, overlap)
