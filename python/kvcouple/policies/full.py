"""``full``: keep every entry (q equals p; the sanity baseline: every hazard must be ~0)."""

from __future__ import annotations

from kvcouple.policies.base import Policy, PolicyContext, recent_indices


class Full(Policy):
    """Keeps the whole prompt cache."""

    name = "full"
    BUDGETED = False

    def select(self, ctx: PolicyContext, keep: int):
        return recent_indices(ctx, keep)
