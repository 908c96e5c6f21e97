"""``observed``: kvpress's ``ObservedAttentionPress`` scoring, one-shot at prefill.

Score: the attention each entry received, summed over every prompt query and divided by the
number of queries that can see it (``length - position`` under the causal mask), i.e. the mean
attention it received while visible; averaged over the query heads of each GQA group; top-k per
KV head, no protected recent share. Prefill only (``mode=decode`` is refused). H2O's heavy hitters (``h2o``) use the plain sum instead,
which favours early entries (they are seen by more queries). Ties: the lower position is kept.
"""

from __future__ import annotations

from kvcouple.policies.base import ScorePolicy
from kvcouple.policies.context import PolicyContext
from kvcouple.policies.errors import PolicyParameterError


class Observed(ScorePolicy):
    """Keeps the entries of highest mean observed attention.

    Parameters are keyword arguments or the ``key=value`` pairs of a spec string parsed by
    :func:`kvcouple.policies.parse_policy` (e.g. ``"observed:retain=0.5"``).

    Parameters
    ----------
    **params
        The keys every policy takes (``retain`` or ``budget``, ``mode``, ``every``): see
        :class:`~kvcouple.policies.Policy`.
    """

    name = "observed"
    NEEDS_ATTENTION = True

    def validate(self) -> None:
        if self.decode_time:
            # Its score needs every query's attention; while decoding only recent queries are
            # kept (h2o:mode=decode accumulates attention step by step instead).
            raise PolicyParameterError(
                "observed: mode=decode is not supported (its score sums the attention of every "
                "query, which is not kept while decoding); use h2o:mode=decode"
            )

    def score(self, ctx: PolicyContext, layer: int):
        import torch

        total = ctx.accumulated_attention(layer)  # (query_heads, length)
        n = ctx.length
        seen_by = torch.arange(n, 0, -1, device=total.device, dtype=total.dtype)
        return ctx.group_mean(total / seen_by)

    def prompt_queries(self) -> tuple[int | None, bool]:
        # Accumulated attention only, summed while prefilling.
        return (None if self.decode_time else 0), True
