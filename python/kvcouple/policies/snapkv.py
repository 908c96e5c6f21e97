"""``snapkv``: keep what the prompt's last queries attend to (Li et al., 2024).

Per layer: the attention of the last ``window`` prefix queries onto the earlier prefix keys,
summed over the window, pooled along positions per query head (``pool=avg|max`` with
``kernel``, stride 1, same-size padding; avg pooling counts padding as zero), averaged over the
query heads of each GQA group, top-k per KV head. The window itself is always kept and counts
toward the budget.

Short prompts: the observation window is ``w = min(window, length)`` prefix tokens. When the
budget does not exceed the window (``kept - 1 <= w``), only the most recent ``kept - 1``
prefix entries are kept (the window, truncated) and no score is needed.
"""

from __future__ import annotations

from kvcouple.policies.base import Policy, top_indices
from kvcouple.policies.context import PolicyContext
from kvcouple.policies.errors import PolicyParameterError


class SnapKV(Policy):
    """Window-attention voting with pooling.

    Parameters are keyword arguments or the ``key=value`` pairs of a spec string parsed by
    :func:`kvcouple.policies.parse_policy` (e.g. ``"snapkv:budget=512,window=32"``).

    Parameters
    ----------
    window : int, optional
        Number of last prompt queries whose attention votes for the entries to keep (>= 1;
        default 32).
    kernel : int, optional
        Size of the pooling kernel over positions, an odd number >= 1 (default 7).
    pool : str, optional
        Pooling: ``"avg"`` (the default) or ``"max"``.
    **params
        The keys every policy takes (``retain`` or ``budget``, ``mode``, ``every``): see
        :class:`~kvcouple.policies.Policy`.
    """

    name = "snapkv"
    NEEDS_ATTENTION = True
    PARAMS = {"window": (int, 32), "kernel": (int, 7), "pool": (str, "avg")}

    def validate(self) -> None:
        p = self.params
        if p["window"] < 1:
            raise PolicyParameterError(f"snapkv: window must be >= 1, got {p['window']}")
        if p["kernel"] < 1 or p["kernel"] % 2 == 0:
            raise PolicyParameterError(
                f"snapkv: kernel must be an odd number >= 1, got {p['kernel']}"
            )
        if p["pool"] not in ("avg", "max"):
            raise PolicyParameterError(f"snapkv: pool must be 'avg' or 'max', got {p['pool']!r}")

    def selects_per_head(self) -> bool:
        return True

    def decode_query_window(self) -> int:
        return int(self.params["window"])

    def scores(self, ctx: PolicyContext, layer: int, window: int):
        """Pooled, group-averaged votes ``(kv_heads, length - window)`` of one layer."""
        import torch.nn.functional as F

        n = ctx.length
        votes = ctx.window_attention(layer, window)[:, :, : n - window].sum(dim=1)
        k = self.params["kernel"]
        pool = F.avg_pool1d if self.params["pool"] == "avg" else F.max_pool1d
        pooled = pool(votes[:, None, :], kernel_size=k, stride=1, padding=k // 2)[:, 0]
        return ctx.group_mean(pooled)

    def select(self, ctx: PolicyContext, keep: int):
        import torch

        n = ctx.length
        window = min(self.params["window"], n)
        device = ctx.keys[0].device
        if keep <= window:
            idx = torch.arange(n - keep, n, device=device)
            return idx.expand(ctx.num_layers, ctx.num_kv_heads, keep).clone()
        tail = torch.arange(n - window, n, device=device).expand(ctx.num_kv_heads, window)
        out = []
        for layer in range(ctx.num_layers):
            chosen = top_indices(self.scores(ctx, layer, window), keep - window)
            out.append(torch.cat([chosen, tail], dim=-1))
        return torch.stack(out)

    def prompt_queries(self) -> tuple[int | None, bool]:
        # The observation window's queries only (decode-time rules may read more).
        return (None if self.decode_time else self.params["window"]), False
