"""``random``: a uniformly random subset per layer and KV head (a null baseline).

Seeded: the subset depends on ``seed`` and on the tracer's per-document generator, so the same
command gives the same subsets.
"""

from __future__ import annotations

from kvcouple.policies.base import Policy
from kvcouple.policies.context import PolicyContext
from kvcouple.policies.errors import PolicyParameterError


class Random(Policy):
    """Keeps a uniformly random subset of ``kept - 1`` prefix entries per layer and head.

    Parameters are keyword arguments or the ``key=value`` pairs of a spec string parsed by
    :func:`kvcouple.policies.parse_policy` (e.g. ``"random:retain=0.5,seed=1"``).

    Parameters
    ----------
    seed : int, optional
        Seed of the random selection, in ``[0, 2**32)`` (default 0).
    **params
        The keys every policy takes (``retain`` or ``budget``, ``mode``, ``every``): see
        :class:`~kvcouple.policies.Policy`.
    """

    name = "random"
    PARAMS = {"seed": (int, 0)}

    def validate(self) -> None:
        # Mixed with the per-document stream as seed * 1_000_003 + r (r < 2**31) into a
        # torch generator seed (< 2**63): checked here, before any model is loaded.
        seed = self.params["seed"]
        if not 0 <= seed < 2**32:
            raise PolicyParameterError(f"policy 'random': seed must be in [0, 2**32), got {seed}")

    def select(self, ctx: PolicyContext, keep: int):
        import torch

        gen = torch.Generator().manual_seed(self.params["seed"])
        if ctx.generator is not None:
            # Mix in the per-document stream so documents get different subsets.
            gen.manual_seed(
                self.params["seed"] * 1_000_003
                + int(torch.randint(2**31, (1,), generator=ctx.generator))
            )
        scores = torch.rand(ctx.num_layers, ctx.num_kv_heads, ctx.length, generator=gen)
        idx = torch.sort(torch.topk(scores, keep, dim=-1).indices, dim=-1).values
        return idx.to(ctx.keys[0].device)
