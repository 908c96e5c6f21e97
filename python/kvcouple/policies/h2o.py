"""``h2o``: heavy hitters plus recent tokens (Zhang et al., 2023).

Score: the attention each entry received, accumulated over every prompt query (averaged over
the query heads of each GQA group). The budget is split: ``recent`` (a fraction, default 0.5)
of it goes to the most recent tokens, the rest to the heaviest hitters among the others.

``mode=prefill`` (default) evicts once after prefill. ``mode=decode`` keeps the cache at the
fixed budget ``k`` (the kept count) during generation too, as in H2O's Algorithm 1: each new
token attends to the at most ``k`` cached entries plus itself, its attention is added to the
accumulated scores, and then every layer and KV head evicts its entry of lowest accumulated
score, never one of the ``recent`` share of most recent positions. With ``recent=1`` this is a
sliding window of ``k`` tokens. ``every=N`` evicts the ``N`` lowest every ``N`` steps. Decode-time
tracing replays each branch's path from the prompt cache (see :mod:`kvcouple.tracer.branches`),
so it costs more than one-shot policies.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcouple.policies.base import Policy, top_indices
from kvcouple.policies.context import PolicyContext
from kvcouple.policies.decode import DecodeCache, DecodeRule, SlotScoreRule
from kvcouple.policies.errors import PolicyParameterError

if TYPE_CHECKING:
    import torch

# Above any accumulated attention: the protected recent share outranks every candidate, and
# among protected entries the oldest goes first.
_PROTECTED = 2.0**40


class H2ORule(SlotScoreRule):
    """H2O's Algorithm 1: accumulate every new query's attention; evict the lowest score
    outside the ``recent`` share of newest positions (the oldest entry if all are protected)."""

    needs_attention = True

    def __init__(self, policy: H2O, budget: int):
        super().__init__(policy, budget)
        self.n_recent = policy.recent_count(budget)

    def start(self, ctx: PolicyContext, idx: torch.Tensor) -> dict[str, list[torch.Tensor]]:
        scores = [
            ctx.group_mean(ctx.accumulated_attention(layer)).gather(1, idx[layer])
            for layer in range(ctx.num_layers)
        ]
        return {"h2o_score": scores}

    def observe(self, cache: DecodeCache) -> None:
        assert cache.attention is not None
        cache.state["h2o_score"] += cache.attention

    def slot_score(self, state: dict[str, torch.Tensor], current: torch.Tensor) -> torch.Tensor:
        pos = state["position"]
        protected = pos > (current - self.n_recent)[:, None, None]
        score = state["h2o_score"].double()
        return score.where(~protected, _PROTECTED + pos.double())


class H2O(Policy):
    """Heavy-hitter oracle.

    Parameters are keyword arguments or the ``key=value`` pairs of a spec string parsed by
    :func:`kvcouple.policies.parse_policy` (e.g. ``"h2o:retain=0.25,mode=decode"``).

    Parameters
    ----------
    recent : float, optional
        Share of the kept entries reserved for the newest positions, in ``[0, 1]`` (default 0.5).
    **params
        The keys every policy takes (``retain`` or ``budget``, ``mode``, ``every``): see
        :class:`~kvcouple.policies.Policy`.
    """

    name = "h2o"
    NEEDS_ATTENTION = True
    PARAMS = {"recent": (float, 0.5)}

    def validate(self) -> None:
        if not 0 <= self.params["recent"] <= 1:
            raise PolicyParameterError(
                f"h2o: recent must be in [0, 1], got {self.params['recent']}"
            )

    def decode_rule(self, budget: int, seed: int = 0) -> DecodeRule | None:
        return H2ORule(self, budget) if self.decode_time else None

    def recent_count(self, keep: int) -> int:
        """Entries of a ``keep`` budget reserved for the most recent tokens."""
        return min(keep, int(self.params["recent"] * keep + 0.5))

    def select(self, ctx: PolicyContext, keep: int):
        import torch

        n = ctx.length
        n_recent = self.recent_count(keep)
        device = ctx.keys[0].device
        tail = torch.arange(n - n_recent, n, device=device).expand(ctx.num_kv_heads, n_recent)
        out = []
        for layer in range(ctx.num_layers):
            score = ctx.group_mean(ctx.accumulated_attention(layer))[:, : n - n_recent]
            out.append(torch.cat([top_indices(score, keep - n_recent), tail], dim=-1))
        return torch.stack(out)

    def prompt_queries(self) -> tuple[int | None, bool]:
        # Accumulated attention only, computed while prefilling (decode-time rules may read
        # the queries too).
        return (None if self.decode_time else 0), True
