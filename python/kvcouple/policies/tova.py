"""``tova``: token omission via attention (Oren et al., 2024), one-shot at prefill.

Score: the attention the last prefix query pays to each entry, averaged over the query heads of
each GQA group (TOVA averages over all heads of a layer; per KV head is the GQA-aware form).
"""

from __future__ import annotations

from kvcouple.policies.base import ScorePolicy
from kvcouple.policies.context import PolicyContext


class TOVA(ScorePolicy):
    """Keeps the entries the last prompt query attends to most.

    Parameters are keyword arguments or the ``key=value`` pairs of a spec string parsed by
    :func:`kvcouple.policies.parse_policy` (e.g. ``"tova:budget=512"``).

    Parameters
    ----------
    **params
        The keys every policy takes (``retain`` or ``budget``, ``mode``, ``every``): see
        :class:`~kvcouple.policies.Policy`.
    """

    name = "tova"
    NEEDS_QUERIES = True

    def decode_query_window(self) -> int:
        return 1

    def score(self, ctx: PolicyContext, layer: int):
        return ctx.group_mean(ctx.window_attention(layer, 1)[:, -1])

    def prompt_queries(self) -> tuple[int | None, bool]:
        return (None if self.decode_time else 1), False
