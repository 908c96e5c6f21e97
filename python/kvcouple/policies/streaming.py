"""``streaming``: attention sinks plus recent tokens (StreamingLLM).

Keeps the first ``sinks`` prompt tokens and the most recent ones, ``kept`` in all. When the
budget is smaller than ``sinks`` (plus the re-fed last token) only the first tokens fit.

``mode=decode`` is StreamingLLM as published: the sinks plus a rolling window while
generating; each eviction keeps the sinks (positions ``< sinks``) and the newest entries.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcouple.policies.base import Policy, recent_indices
from kvcouple.policies.context import PolicyContext
from kvcouple.policies.decode import DecodeRule, SlotScoreRule
from kvcouple.policies.errors import PolicyParameterError

if TYPE_CHECKING:
    import torch

# Above any position: sinks outrank every other entry, older sinks first among themselves.
_SINK = 2.0**40


class StreamingRule(SlotScoreRule):
    """Sinks first, then the newest entries."""

    def slot_score(self, state: dict[str, torch.Tensor], current: torch.Tensor) -> torch.Tensor:
        pos = state["position"].double()
        sink = state["position"] < self.policy.params["sinks"]
        return pos + sink * (_SINK - 2 * pos)


class Streaming(Policy):
    """``sinks`` first tokens + most recent tokens.

    Parameters are keyword arguments or the ``key=value`` pairs of a spec string parsed by
    :func:`kvcouple.policies.parse_policy` (e.g. ``"streaming:budget=256,sinks=4"``).

    Parameters
    ----------
    sinks : int, optional
        Number of first prompt tokens always kept (>= 0; default 4).
    **params
        The keys every policy takes (``retain`` or ``budget``, ``mode``, ``every``): see
        :class:`~kvcouple.policies.Policy`.
    """

    name = "streaming"
    PARAMS = {"sinks": (int, 4)}

    def validate(self) -> None:
        if self.params["sinks"] < 0:
            raise PolicyParameterError(f"streaming: sinks must be >= 0, got {self.params['sinks']}")

    def select(self, ctx: PolicyContext, keep: int):
        return recent_indices(ctx, keep, first=self.params["sinks"])

    def decode_rule(self, budget: int, seed: int = 0) -> DecodeRule | None:
        return StreamingRule(self, budget) if self.decode_time else None
