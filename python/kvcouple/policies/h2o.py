"""``h2o``: heavy hitters plus recent tokens (Zhang et al., 2023).

Score: the attention each entry received, accumulated over every prompt query (averaged over
the query heads of each GQA group). The budget is split: ``recent`` (a fraction, default 0.5)
of it goes to the most recent tokens, the rest to the heaviest hitters among the others.

``mode=prefill`` (default) evicts once after prefill. ``mode=decode`` keeps the cache at the
fixed budget ``k`` (the kept count) during generation too, as in H2O's Algorithm 1: each new
token attends to the at most ``k`` cached entries plus itself, its attention is added to the
accumulated scores, and then every layer and KV head evicts its entry of lowest accumulated
score, never one of the ``recent`` share of most recent positions. With ``recent=1`` this is a
sliding window of ``k + 1`` tokens. Decode-time tracing replays each branch's path from the
prompt cache (see :mod:`kvcouple.tracer.decode_eviction`), so it costs more than one-shot
policies.
"""

from __future__ import annotations

from kvcouple.policies.base import Policy, PolicyContext, PolicyParameterError, top_indices


class H2O(Policy):
    """Heavy-hitter oracle."""

    name = "h2o"
    NEEDS_QUERIES = True
    PARAMS = {"recent": (float, 0.5), "mode": (str, "prefill")}

    def validate(self) -> None:
        if not 0 <= self.params["recent"] <= 1:
            raise PolicyParameterError(
                f"h2o: recent must be in [0, 1], got {self.params['recent']}"
            )
        if self.params["mode"] not in ("prefill", "decode"):
            raise PolicyParameterError(
                f"h2o: mode must be 'prefill' or 'decode', got {self.params['mode']!r}"
            )
        self.decode_time = self.params["mode"] == "decode"

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
