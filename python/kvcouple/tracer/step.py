"""The one coupled step every part of the tracer runs, and absorbing EOS.

:func:`coupled_step` feeds one token per row of a :class:`~kvcouple.tracer.rows.Rows` batch
(``B`` P rows then ``B`` Q rows, any layout), applies the decoding transform, makes finished
rows a point mass on their EOS (:class:`EosState`), and couples row ``i`` of P with row ``i``
of Q with the maximal coupling. The overlap path, the branches forked from the path's cache
and the branches replayed from the prompt all call it; what differs is only which token each
row is fed, which uniforms it gets, and what is recorded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcouple.torch_coupling import couple_rows
from kvcouple.tracer.rows import Rows
from kvcouple.tracer.settings import Decoding


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

    def advance(self, tokens: torch.Tensor, active: torch.Tensor | None = None) -> None:
        """Rows where ``active`` (None: every row) emitted ``tokens``; those that hit an EOS id
        are done. ``last`` follows every row until it is done (it is read only where done)."""
        if not self.ids.numel():
            return
        self.last = torch.where(self.done, self.last, tokens)
        hit = torch.isin(tokens, self.ids)
        self.done = self.done | (hit if active is None else active & hit)


@dataclass
class CoupledStep:
    """One coupled step of ``B`` row pairs: both kernels, the coupled draws, TV and overlap."""

    probs: torch.Tensor  # (2B, vocab): P rows then Q rows (records are made from it at once)
    p: torch.Tensor  # (B, vocab), a view of probs
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
    residuals: bool = True,
) -> CoupledStep:
    """Feed ``tokens`` ``(2B,)`` (P rows then Q rows), transform, absorb EOS, couple with the
    uniforms ``u`` ``(B, 3)`` (``u0 = 1``: the overlap; ``u0 = 0``: the residuals;
    ``residuals=False``: the path, which only draws from the overlap). The caller records
    what it needs and then calls ``eos.advance``."""
    probs = eos.absorb(decoding.probs(rows.step(tokens)))
    half = probs.shape[0] // 2
    p, q = probs.split(half)
    x, y, tv, overlap = couple_rows(p, q, u, residuals)
    return CoupledStep(probs, p, q, x, y, tv, overlap)
