"""``knorm``: keep the entries whose keys have the smallest L2 norm (Devoto et al., 2024)."""

from __future__ import annotations

from kvcouple.policies.base import PolicyContext, ScorePolicy


class KNorm(ScorePolicy):
    """Score: minus the key norm (small-norm keys attract attention and are kept).

    Parameters are keyword arguments or the ``key=value`` pairs of a spec string parsed by
    :func:`kvcouple.policies.parse_policy` (e.g. ``"knorm:retain=0.5"``).

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

    name = "knorm"

    def score(self, ctx: PolicyContext, layer: int):
        return -ctx.keys[layer].float().norm(dim=-1)
