"""``knorm``: keep the entries whose keys have the smallest L2 norm (Devoto et al., 2024)."""

from __future__ import annotations

from kvcouple.policies.base import ScorePolicy
from kvcouple.policies.context import PolicyContext


class KNorm(ScorePolicy):
    """Score: minus the key norm (small-norm keys attract attention and are kept).

    Parameters are keyword arguments or the ``key=value`` pairs of a spec string parsed by
    :func:`kvcouple.policies.parse_policy` (e.g. ``"knorm:retain=0.5"``).

    Parameters
    ----------
    **params
        The keys every policy takes (``retain`` or ``budget``, ``mode``, ``every``): see
        :class:`~kvcouple.policies.Policy`.
    """

    name = "knorm"

    def selects_per_head(self) -> bool:
        return True

    def score(self, ctx: PolicyContext, layer: int):
        return -ctx.keys[layer].float().norm(dim=-1)
