"""``valuediff``: keep the tokens whose value vectors deviate most, in L2, from the mean value of
the cache (per layer and KV head)."""

from __future__ import annotations

from kvcouple.policies.base import PolicyContext, ScorePolicy


class ValueDiff(ScorePolicy):
    """Score: ``||v_j - mean_j v_j||`` per head.

    Parameters are keyword arguments or the ``key=value`` pairs of a spec string parsed by
    :func:`kvcouple.policies.parse_policy` (e.g. ``"valuediff:retain=0.5"``).

    Parameters
    ----------
    retain : float, optional
        Fraction of the prompt to keep, in ``(0, 1]``. Exactly one of ``retain`` and ``budget``
        must be given.
    budget : int, optional
        Number of prompt entries to keep (>= 1). Exactly one of ``retain`` and ``budget`` must
        be given.
    mode : str, optional
        ``"prefill"`` (the default: evict once, after the prompt) or ``"decode"`` (also keep the
        cache at its budget while generating).
    every : int, optional
        Only with ``mode=decode``: evict back to the budget once every ``every`` generated
        tokens (>= 1; default 1).
    """

    name = "valuediff"

    def score(self, ctx: PolicyContext, layer: int):
        v = ctx.values[layer].float()
        return (v - v.mean(dim=1, keepdim=True)).norm(dim=-1)
