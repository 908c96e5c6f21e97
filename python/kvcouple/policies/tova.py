"""``tova``: token omission via attention (Oren et al., 2024), one-shot at prefill.

Score: the attention the last prefix query pays to each entry. ``heads=all`` (the default, as
TOVA's paper and code and kvpress's ``TOVAPress``): averaged over every query head of the layer,
one kept set per layer (every KV head keeps the same positions). ``heads=group``: averaged over
the query heads of each GQA group, one kept set per KV head (the GQA-aware form). Ties: the
lower position is kept.
"""

from __future__ import annotations

from kvcouple.policies.base import ScorePolicy
from kvcouple.policies.context import PolicyContext
from kvcouple.policies.decode import DecodeContext
from kvcouple.policies.errors import PolicyError, PolicyParameterError


class TOVA(ScorePolicy):
    """Keeps the entries the last prompt query attends to most.

    Parameters are keyword arguments or the ``key=value`` pairs of a spec string parsed by
    :func:`kvcouple.policies.parse_policy` (e.g. ``"tova:budget=512"``).

    Parameters
    ----------
    heads : str, optional
        ``"all"`` (the default: the mean over every query head, one kept set per layer, as
        TOVA's paper) or ``"group"`` (the mean over each GQA group, one set per KV head).
    **params
        The keys every policy takes (``retain`` or ``budget``, ``mode``, ``every``): see
        :class:`~kvcouple.policies.Policy`.
    """

    name = "tova"
    NEEDS_ATTENTION = True
    PARAMS = {"heads": (str, "all")}

    def validate(self) -> None:
        if self.params["heads"] not in ("all", "group"):
            raise PolicyParameterError(
                f"tova: heads must be 'all' or 'group', got {self.params['heads']!r}"
            )

    def decode_query_window(self) -> int:
        return 1

    def score(self, ctx: PolicyContext, layer: int):
        last = ctx.window_attention(layer, 1)[:, -1]  # (query_heads, length)
        if self.params["heads"] == "group":
            return ctx.group_mean(last)
        if isinstance(ctx, DecodeContext):
            # A column is one position for every head only if the heads hold the same entries,
            # which one kept set per layer guarantees; anything else would mix positions.
            pos = ctx.key_positions[layer]
            if not bool((pos == pos[:1]).all()):
                raise PolicyError("tova:heads=all needs every KV head to hold the same entries")
        return last.mean(0).expand(ctx.num_kv_heads, -1)

    def prompt_queries(self) -> tuple[int | None, bool]:
        return (None if self.decode_time else 1), False
