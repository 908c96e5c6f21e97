"""``recent``: keep the most recent prompt tokens (a sliding window over the prompt)."""

from __future__ import annotations

from kvcouple.policies.base import Policy, PolicyContext, recent_indices


class Recent(Policy):
    """Keeps the last ``kept`` tokens of the prompt, the same for every layer and head."""

    name = "recent"

    def select(self, ctx: PolicyContext, keep: int):
        return recent_indices(ctx, keep)
