"""Decode-time eviction (``mode=decode``): what a policy's :class:`DecodeRule` sees of the
evicted rows' cache after each generated token (:class:`DecodeCache`) and the generic rules:
:class:`SlotScoreRule` (keep the highest slot scores) and :class:`RescoreRule` (re-run the
policy's own selection on each row's current cache, seen as a :class:`DecodeContext`).
Policies with a rule of their own (``recent``, ``streaming``, ``h2o``, ``full``) define it in
their module."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from kvcouple.policies.context import PolicyContext
from kvcouple.policies.errors import PolicyError

if TYPE_CHECKING:
    import torch


class RulePolicy(Protocol):
    """What a rule uses of its policy (every :class:`kvcouple.policies.Policy` is one; named
    structurally so that this module, which ``policies.base`` builds rules from, need not
    import it back)."""

    params: dict[str, Any]

    def spec(self) -> str: ...

    def select(self, ctx: PolicyContext, keep: int) -> torch.Tensor: ...

    def decode_query_window(self) -> int: ...

    def selects_per_head(self) -> bool: ...


@dataclass
class DecodeContext(PolicyContext):
    """A :class:`PolicyContext` over one row's cache while decoding (for :class:`RescoreRule`).

    Keys and values are the entries the row holds now, sorted by original position per KV head
    (``key_positions[l]``: ``(kv_heads, length)``). Queries are those of the most recent tokens
    (``recent_queries[l]``: ``(query_heads, W, head_dim)``, oldest first, at
    ``query_positions``, ``(W,)`` or per query head ``(query_heads, W)``), so :meth:`window_attention` is the attention of the last ``window``
    generated (or prompt) tokens, causal by original position. Accumulated attention over every
    query is not kept while decoding. The attributes not listed below are those of
    :class:`PolicyContext`.

    Attributes
    ----------
    key_positions : list of torch.Tensor
        Per layer, ``(kv_heads, length)`` original positions of the held entries.
    recent_queries : list of torch.Tensor
        Per layer, ``(query_heads, W, head_dim)`` queries of the most recent tokens, oldest
        first.
    query_positions : torch.Tensor or None
        Original positions of those queries: ``(W,)``, or ``(query_heads, W)`` when rows
        were folded into the head axis (:class:`RescoreRule`).
    """

    key_positions: list[torch.Tensor] = field(default_factory=list)
    recent_queries: list[torch.Tensor] = field(default_factory=list)
    query_positions: torch.Tensor | None = None

    def window_attention(self, layer: int, window: int) -> torch.Tensor:
        import torch

        key = ("window", layer, window)
        if key in self._cache:
            return self._cache[key]
        queries = self.recent_queries[layer]
        if self.query_positions is None or window > queries.shape[1]:
            raise PolicyError(
                f"window attention of the last {window} queries needs them buffered while "
                f"decoding, but only {0 if self.query_positions is None else queries.shape[1]} "
                "are (see Policy.decode_query_window)"
            )
        q = queries[:, queries.shape[1] - window :].float()
        k = self.keys[layer].float().repeat_interleave(self.group_size, dim=0)
        scale = self.scaling if self.scaling is not None else q.shape[-1] ** -0.5
        logits = torch.matmul(q, k.transpose(-1, -2)) * scale  # (query_heads, window, length)
        key_pos = self.key_positions[layer].repeat_interleave(self.group_size, dim=0)
        query_pos = self.query_positions[..., self.query_positions.shape[-1] - window :]
        if query_pos.dim() == 1:
            query_pos = query_pos[None]
        logits = logits.masked_fill(key_pos[:, None, :] > query_pos[:, :, None], float("-inf"))
        self._cache[key] = torch.softmax(logits, dim=-1)
        return self._cache[key]

    def accumulated_attention(self, layer: int, chunk: int = 256) -> torch.Tensor:
        raise PolicyError(
            "accumulated attention over every query is not available while decoding; a policy "
            "that needs it brings its own DecodeRule (as h2o does)"
        )


@dataclass
class DecodeCache:
    """What a :class:`DecodeRule` sees of the evicted rows' cache of one layer after a step.

    The cache is a batch of ``B`` rows of ``S`` slots; a row attends to its ``visible`` slots
    (the same for every KV head), and per KV head a slot holds one entry whose original position
    is ``state["position"]``. ``state`` holds slot-aligned ``(B, kv_heads, S)`` tensors that move
    with their entries when the cache is compacted: ``position`` always, plus what the rule's
    :meth:`DecodeRule.start` added (new slots start at 0). ``attention`` (when the rule asks for
    it) is the newest query's attention over the slots, averaged over each GQA group; ``queries``
    (when the rule asks for a query window) are the post-RoPE queries of the most recent tokens,
    ``(B, query_heads, W, head_dim)``, oldest first, at ``query_positions`` ``(W,)`` per row
    ``(B, W)``.

    Attributes
    ----------
    layer : int
        The layer index.
    keys : torch.Tensor
        ``(B, kv_heads, S, head_dim)`` cached keys.
    values : torch.Tensor
        ``(B, kv_heads, S, head_dim)`` cached values.
    visible : torch.Tensor
        ``(B, S)`` bool: the slots each row attends to.
    state : dict of str to torch.Tensor
        Slot-aligned ``(B, kv_heads, S)`` tensors: ``position`` plus the rule's own state.
    current : torch.Tensor
        ``(B,)`` position of the token just fed.
    rows : torch.Tensor
        ``(B,)`` the trajectory each row follows (for reproducible randomness).
    scaling : float
        The attention scale.
    num_query_heads : int
        Number of query heads.
    attention : torch.Tensor or None
        The newest query's attention over the slots, averaged over each GQA group, when the
        rule asks for it (``None`` otherwise).
    queries : torch.Tensor or None
        ``(B, query_heads, W, head_dim)`` post-RoPE queries of the most recent tokens, when
        the rule asks for a query window (``None`` otherwise).
    query_positions : torch.Tensor or None
        ``(B, W)`` positions of those queries (``None`` without a query window).
    held : int or None
        Slots every row holds visible, the same for each row (the tracer knows it on the host,
        so a rule need not read it back from the device); ``None``: unknown.
    current_position : int or None
        ``current``, when every row fed the same position (known on the host); ``None``:
        unknown.
    row_ids : tuple of int or None
        ``rows`` on the host (``None``: unknown).
    all_layers_state : dict of str to torch.Tensor or None
        ``state`` of every layer stacked, ``(layers, B, kv_heads, S)`` (of which ``state`` is
        layer ``layer``'s view), where the tracer holds it that way (``None``: not held so).
    """

    layer: int
    keys: torch.Tensor  # (B, kv_heads, S, head_dim)
    values: torch.Tensor
    visible: torch.Tensor  # (B, S) bool
    state: dict[str, torch.Tensor]
    current: torch.Tensor  # (B,) position of the token just fed
    rows: torch.Tensor  # (B,) the trajectory each row follows (for reproducible randomness)
    scaling: float
    num_query_heads: int
    attention: torch.Tensor | None = None
    queries: torch.Tensor | None = None
    query_positions: torch.Tensor | None = None
    held: int | None = None
    current_position: int | None = None
    row_ids: tuple[int, ...] | None = None
    all_layers_state: dict[str, torch.Tensor] | None = None

    @property
    def positions(self) -> torch.Tensor:
        return self.state["position"]


class DecodeRule:
    """A policy's rule for keeping the cache at its budget while generating.

    The tracer calls :meth:`start` once (per-slot state of the kept prompt entries),
    :meth:`observe` after every step, and :meth:`keep` whenever a row holds ``every`` entries
    more than the budget; :meth:`keep` returns, per layer, the ``budget`` slots each row and KV
    head keeps, ``(B, kv_heads, budget)`` indices of visible slots.

    Parameters
    ----------
    policy : RulePolicy
        The policy the rule belongs to (its ``every`` parameter sets how often it evicts).
    budget : int
        Entries each row, layer and KV head keeps.
    """

    needs_attention: ClassVar[bool] = False

    def __init__(self, policy: RulePolicy, budget: int):
        self.policy = policy
        self.budget = budget
        self.every = int(policy.params.get("every") or 1)

    @property
    def query_window(self) -> int:
        """How many recent queries :meth:`keep` needs buffered (0: none)."""
        return 0

    def start(self, ctx: PolicyContext, idx: torch.Tensor) -> dict[str, list[torch.Tensor]]:
        """Slot state of the kept prompt entries ``idx`` ``(layers, kv_heads, keep)``: name ->
        per-layer ``(kv_heads, keep)`` tensors. Default: none beyond positions."""
        return {}

    def observe(self, cache: DecodeCache) -> None:
        """Update slot state after a step (in place). Default: nothing."""

    def keep(self, caches: list[DecodeCache]) -> list[torch.Tensor]:
        raise NotImplementedError


class SlotScoreRule(DecodeRule):
    """Keeps the ``budget`` visible slots of highest :meth:`score` per row and KV head (ties:
    the lower position, as at prefill).

    Parameters
    ----------
    policy : RulePolicy
        The policy the rule belongs to (its ``every`` parameter sets how often it evicts).
    budget : int
        Entries each row, layer and KV head keeps.
    """

    def score(self, cache: DecodeCache) -> torch.Tensor:
        """``(B, kv_heads, S)`` float64 scores; higher is kept. Default:
        :meth:`slot_score` of the layer's state."""
        return self.slot_score(cache.state, cache.current)

    def slot_score(self, state: dict[str, torch.Tensor], current: torch.Tensor) -> torch.Tensor:
        """Scores from the slot state alone, elementwise: ``state`` tensors ``(..., B,
        kv_heads, S)``, ``current`` ``(B,)``. A rule that defines it (rather than
        :meth:`score`) is scored for every layer at once."""
        raise NotImplementedError

    def _layer_scores(self, caches: list[DecodeCache]) -> torch.Tensor:
        """``(layers, B, kv_heads, S)``: one :meth:`slot_score` over every layer's state
        where the tracer holds it stacked, else :meth:`score` per layer."""
        import torch

        stacked = caches[0].all_layers_state
        if stacked is not None and type(self).slot_score is not SlotScoreRule.slot_score:
            return self.slot_score(stacked, caches[0].current)
        return torch.stack([self.score(cache) for cache in caches])

    def keep(self, caches: list[DecodeCache]) -> list[torch.Tensor]:
        import torch

        # Every layer at once: (layers, B, kv_heads, S).
        score = self._layer_scores(caches).to(torch.float64)
        first = caches[0]
        if all(cache.visible is first.visible for cache in caches):
            visible = first.visible[None, :, None, :]
        else:
            visible = torch.stack([cache.visible for cache in caches])[:, :, None, :]
        score = score.masked_fill(~visible, float("-inf"))
        # Slots by position, then a stable sort by score: ties keep the lower position.
        stacked = caches[0].all_layers_state
        if stacked is not None:
            positions = stacked["position"]
        else:
            positions = torch.stack([cache.positions for cache in caches])
        by_position = torch.argsort(positions, dim=-1, stable=True)
        ranked = torch.argsort(score.gather(-1, by_position), dim=-1, descending=True, stable=True)
        return list(by_position.gather(-1, ranked[..., : self.budget]).unbind(0))


class RescoreRule(DecodeRule):
    """The generic rule: every ``every`` steps, re-run the policy's own :meth:`Policy.select`
    on each row's current cache (a :class:`DecodeContext`) and keep what it keeps.

    No host round trip: the rows' visible slots are found by a sort (every row holds the same
    number, :attr:`DecodeCache.held`), not by ``nonzero``. A policy whose selection treats every
    KV head on its own (:meth:`Policy.selects_per_head`) sees the whole batch as one context,
    its rows folded into the KV-head axis (row ``b``'s KV head ``h`` is head ``b * kv_heads +
    h``; its query heads follow, so GQA groups stay aligned): one ``select`` call for every row.
    Others (randomised ones draw per row) get one context per row.

    Parameters
    ----------
    policy : RulePolicy
        The policy whose :meth:`Policy.select` is re-run.
    budget : int
        Entries each row, layer and KV head keeps.
    seed : int, optional
        Seed of the per-row generators given to randomised policies (default 0).
    """

    def __init__(self, policy: RulePolicy, budget: int, seed: int = 0):
        super().__init__(policy, budget)
        self.seed = seed

    @property
    def query_window(self) -> int:
        return self.policy.decode_query_window()

    def _generator(self, row: int, current: int) -> torch.Generator:
        import torch

        # Randomised policies draw from (seed, trajectory, position): a replayed branch evicts
        # exactly as its path did.
        return torch.Generator().manual_seed(
            (self.seed * 1_000_003 + row * 65_537 + current) % 2**63
        )

    def keep(self, caches: list[DecodeCache]) -> list[torch.Tensor]:
        import torch

        first = caches[0]
        rows = first.visible.shape[0]
        held = first.held
        if held is None:  # not known on the host: read back (a sync)
            counts = first.visible.sum(-1)
            held = int(counts[0])
            if not bool((counts == held).all()):
                raise ValueError("RescoreRule needs every row to hold as many entries")
        # Per layer, each row's visible slots by original position, per KV head: hidden
        # slots sort last (a position no entry has), then the first ``held`` are kept.
        hidden = torch.iinfo(torch.int64).max
        stacked = first.all_layers_state
        if stacked is not None and all(c.visible is first.visible for c in caches):
            # every layer at once: (layers, B, kv, S)
            pos = (
                stacked["position"]
                .to(torch.int64)
                .masked_fill(~first.visible[None, :, None, :], hidden)
            )
            order_all = torch.argsort(pos, dim=-1, stable=True)[..., :held]  # (layers, B, kv, V)
            orders = list(order_all.unbind(0))
            kept_positions = pos.gather(3, order_all)
            key_positions = list(kept_positions.unbind(0))
            flat_positions = list(kept_positions.flatten(1, 2).unbind(0))
        else:
            order_all = None
            pos_each = [
                c.positions.to(torch.int64).masked_fill(~c.visible[:, None, :], hidden)
                for c in caches
            ]
            orders = [torch.argsort(p, dim=-1, stable=True)[..., :held] for p in pos_each]
            key_positions = [p.gather(2, o) for p, o in zip(pos_each, orders, strict=True)]
            flat_positions = [p.flatten(0, 1) for p in key_positions]
        keys, values = [], []
        for cache, order in zip(caches, orders, strict=True):  # (B, kv, V) per layer
            index = order[..., None].expand(-1, -1, -1, cache.keys.shape[-1])
            keys.append(cache.keys.gather(2, index))
            values.append(cache.values.gather(2, index))
        kv_heads = first.keys.shape[1]
        if self.policy.selects_per_head():
            queries = [
                c.queries.flatten(0, 1) for c in caches if c.queries is not None
            ]  # (B * query_heads, W, D)
            query_positions = None
            if first.query_positions is not None:
                heads = first.num_query_heads
                query_positions = first.query_positions.repeat_interleave(
                    heads, dim=0, output_size=rows * heads
                )
            ctx = DecodeContext(
                keys=[k.flatten(0, 1) for k in keys],
                values=[v.flatten(0, 1) for v in values],
                scaling=first.scaling,
                num_query_heads=rows * first.num_query_heads,
                key_positions=flat_positions,
                recent_queries=queries,
                query_positions=query_positions,
            )
            idx = self.policy.select(ctx, self.budget)  # (layers, B * kv_heads, budget)
            idx = idx.to(first.keys.device).view(len(caches), rows, kv_heads, -1)
            if order_all is not None:
                return list(order_all.gather(3, idx).unbind(0))
            return [order.gather(2, i) for order, i in zip(orders, idx, strict=True)]
        row_ids = first.row_ids if first.row_ids is not None else tuple(first.rows.tolist())
        current = first.current_position
        kept: list[list[torch.Tensor]] = [[] for _ in caches]
        for b in range(rows):
            ctx = DecodeContext(
                keys=[k[b] for k in keys],
                values=[v[b] for v in values],
                scaling=first.scaling,
                num_query_heads=first.num_query_heads,
                generator=self._generator(
                    row_ids[b], current if current is not None else int(first.current[b])
                ),
                key_positions=[p[b] for p in key_positions],
                recent_queries=[c.queries[b] for c in caches if c.queries is not None],
                query_positions=None if first.query_positions is None else first.query_positions[b],
            )
            idx = self.policy.select(ctx, self.budget)  # (layers, kv_heads, budget)
            for layer, order in enumerate(orders):
                kept[layer].append(order[b].gather(1, idx[layer].to(order.device)))
        return [torch.stack(k) for k in kept]
