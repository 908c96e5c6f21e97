"""``knorm``: keep the entries whose keys have the smallest L2 norm (Devoto et al., 2024)."""

from __future__ import annotations

from kvcouple.policies.base import PolicyContext, ScorePolicy


class KNorm(ScorePolicy):
    """Score: minus the key norm (small-norm keys attract attention and are kept)."""

    name = "knorm"

    def score(self, ctx: PolicyContext, layer: int):
        return -ctx.keys[layer].float().norm(dim=-1)
