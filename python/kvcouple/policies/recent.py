"""``recent``: keep the most recent prompt tokens (a sliding window over the prompt).

``mode=decode``: a sliding window while generating too; each eviction keeps the ``kept``
newest entries.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcouple.policies.base import Policy, recent_indices
from kvcouple.policies.context import PolicyContext
from kvcouple.policies.decode import DecodeRule, SlotScoreRule

if TYPE_CHECKING:
    import torch


class RecentRule(SlotScoreRule):
    """Keep the newest entries."""

    def slot_score(self, state: dict[str, torch.Tensor], current: torch.Tensor) -> torch.Tensor:
        return state["position"].double()


class Recent(Policy):
    """Keeps the last ``kept`` tokens of the prompt, the same for every layer and head.

    Parameters are keyword arguments or the ``key=value`` pairs of a spec string parsed by
    :func:`kvcouple.policies.parse_policy` (e.g. ``"recent:retain=0.5"``).

    Parameters
    ----------
    **params
        The keys every policy takes (``retain`` or ``budget``, ``mode``, ``every``): see
        :class:`~kvcouple.policies.Policy`.
    """

    name = "recent"

    def select(self, ctx: PolicyContext, keep: int):
        return recent_indices(ctx, keep)

    def decode_rule(self, budget: int, seed: int = 0) -> DecodeRule | None:
        return RecentRule(self, budget) if self.decode_time else None
