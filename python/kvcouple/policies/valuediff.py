"""``valuediff``: keep the tokens whose value vectors deviate most, in L2, from the mean value of
the cache (per layer and KV head)."""

from __future__ import annotations

from kvcouple.policies.base import ScorePolicy
from kvcouple.policies.context import PolicyContext


class ValueDiff(ScorePolicy):
    """Score: ``||v_j - mean_j v_j||`` per head.

    Parameters are keyword arguments or the ``key=value`` pairs of a spec string parsed by
    :func:`kvcouple.policies.parse_policy` (e.g. ``"valuediff:retain=0.5"``).

    Parameters
    ----------
    **params
        The keys every policy takes (``retain`` or ``budget``, ``mode``, ``every``): see
        :class:`~kvcouple.policies.Policy`.
    """

    name = "valuediff"

    def selects_per_head(self) -> bool:
        return True

    def score(self, ctx: PolicyContext, layer: int):
        v = ctx.values[layer].float()
        return (v - v.mean(dim=1, keepdim=True)).norm(dim=-1)
