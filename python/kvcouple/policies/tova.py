"""``tova``: token omission via attention (Oren et al., 2024), one-shot at prefill.

Score: the attention the last prefix query pays to each entry, averaged over the query heads of
each GQA group (TOVA averages over all heads of a layer; per KV head is the GQA-aware form).
"""

from __future__ import annotations

from kvcouple.policies.base import PolicyContext, ScorePolicy


class TOVA(ScorePolicy):
    """Keeps the entries the last prompt query attends to most.

    Parameters are keyword arguments or the ``key=value`` pairs of a spec string parsed by
    :func:`kvcouple.policies.parse_policy` (e.g. ``"tova:budget=512"``).

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

    name = "tova"
    NEEDS_QUERIES = True

    def decode_query_window(self) -> int:
        return 1

    def score(self, ctx: PolicyContext, layer: int):
        return ctx.group_mean(ctx.window_attention(layer, 1)[:, -1])

    def prompt_queries(self) -> tuple[int | None, bool]:
        return (None if self.decode_time else 1), False
