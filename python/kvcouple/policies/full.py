"""``full``: keep every entry (q equals p; the sanity baseline: every hazard must be ~0).

``mode=decode`` runs the decode-time machinery (branches replayed from the prompt, the cache
inspected after every step) without evicting anything: a check that it changes nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcouple.policies.base import Policy, recent_indices
from kvcouple.policies.context import PolicyContext
from kvcouple.policies.decode import DecodeCache, DecodeRule

if TYPE_CHECKING:
    import torch


class KeepAllRule(DecodeRule):
    """Never evicts (its budget is never reached)."""

    def keep(self, caches: list[DecodeCache]) -> list[torch.Tensor]:
        raise AssertionError("full keeps every entry")


class Full(Policy):
    """Keeps the whole prompt cache.

    Parameters are keyword arguments or the ``key=value`` pairs of a spec string parsed by
    :func:`kvcouple.policies.parse_policy` (e.g. ``"full"``).

    Parameters
    ----------
    **params
        ``mode`` and ``every``, accepted as by every policy (see
        :class:`~kvcouple.policies.Policy`); this policy never evicts in either mode.
    """

    name = "full"
    BUDGETED = False

    def select(self, ctx: PolicyContext, keep: int):
        return recent_indices(ctx, keep)

    def decode_rule(self, budget: int, seed: int = 0) -> DecodeRule | None:
        return KeepAllRule(self, 2**62) if self.decode_time else None
