"""Decode-time eviction in the tracer: a policy's :class:`~kvcouple.policies.DecodeRule`
applied to the Q rows of a :class:`~kvcouple.tracer.trajectories.Trajectories` batch.

The cache tensor keeps one shape for the whole batch. After each step the evictor appends the
new entry's slot state, shows the rule the Q rows' cache (:class:`DecodeCache`), and once a row
holds ``every`` entries more than the budget, asks the rule which ``budget`` entries each KV
head keeps. It then compacts: the row's first ``budget`` visible columns ("home") end up holding
the kept entries (kept entries from later columns move into the home slots of evicted ones, per
KV head), and the later columns are hidden for that row, so the usual per-row attention mask
does the rest. Slot state (original positions, the rule's scores) moves with its entry.
"""

from __future__ import annotations

import contextlib
import math
from contextlib import AbstractContextManager
from typing import Any

import torch

from kvcouple.policies import DecodeCache, DecodeRule
from kvcouple.tracer.attention import QueryCapture
from kvcouple.tracer.kvcache import append_columns, cache_tensors
from kvcouple.tracer.prefill import Prefill
from kvcouple.tracer.trajectories import Trajectories


class DecodeEvictor:
    """Keeps ``copies`` Q rows (those after the first ``copies`` rows of a batch) at the
    rule's budget. ``replicates[i]``: the path replicate Q row ``i`` follows (so randomised
    rules draw the same on the path and on its replayed branches)."""

    def __init__(
        self,
        model: Any,
        pre: Prefill,
        idx: torch.Tensor,
        rule: DecodeRule,
        replicates: torch.Tensor,
    ):
        copies = int(replicates.shape[0])
        self.rule = rule
        self.rows = slice(copies, 2 * copies)
        self.replicates = replicates
        self.row_ids = tuple(int(r) for r in replicates.tolist())  # once, for seeded rules
        window = rule.query_window
        # Queries are captured for the rule's attention scores or its query window.
        capture = rule.needs_attention or window > 0
        self._capture = QueryCapture(model) if capture else None
        ctx = pre.context()
        self.group = ctx.group_size
        self.num_query_heads = pre.num_query_heads
        self.scaling = self._capture.scaling if self._capture is not None else 1.0
        n1, keep = pre.prefix_length, idx.shape[-1]
        pad = n1 - keep
        # Every Q row starts with the same ``keep`` entries at the same position and is fed one
        # token per step, so how many entries each holds and where it is are known here, on
        # the host: eviction is decided without reading the device (checked on the device,
        # asynchronously, in after_step).
        self.held = int(keep)
        self.position = int(n1)
        self._layers = ctx.num_layers
        started = rule.start(ctx, idx)
        # Slot state of every layer in one tensor per name, ``(layers, Bq, kv_heads, S)``: a
        # step appends its column, and an eviction moves its entries, for all layers at once.
        slots = {"position": torch.nn.functional.pad(idx, (pad, 0), value=-1)}
        for name, values in started.items():
            slots[name] = torch.nn.functional.pad(
                torch.stack([v.float() for v in values]), (pad, 0)
            )
        self.slots = {k: v[:, None].expand(-1, copies, -1, -1).clone() for k, v in slots.items()}
        # Slot state grows by a column per step: views into buffers with room to grow (a
        # concatenation per step would copy it all, like a dynamic cache).
        self._storage: dict[str, torch.Tensor | None] = dict.fromkeys(self.slots)
        # The most recent queries (prompt queries first), for rules with a query window.
        self.window = window
        self.queries: list[torch.Tensor] = []
        self.query_positions: torch.Tensor | None = None
        if window > 0:
            if pre.capture is None:
                raise ValueError(
                    f"policy {rule.policy.spec()} needs the prompt's queries while decoding"
                )
            first = max(0, n1 - (window - 1))
            for layer in range(ctx.num_layers):
                if first < n1:
                    q = pre.capture.queries(layer, first)  # (heads, n1 - first, head_dim)
                else:  # a window of one: only the newest query, captured at the next step
                    head_dim = pre.kv[layer][0].shape[-1]
                    q = pre.kv[layer][0].new_zeros(pre.num_query_heads, 0, head_dim)
                self.queries.append(q.expand(copies, -1, -1, -1).clone())
            device = idx.device
            self.query_positions = torch.arange(first, n1, device=device).expand(copies, -1)

    @property
    def state(self) -> list[dict[str, torch.Tensor]]:
        """Per layer, the slot state rules see (views of :attr:`slots`)."""
        return [{k: v[layer] for k, v in self.slots.items()} for layer in range(self._layers)]

    def capture(self) -> AbstractContextManager[Any]:
        return self._capture if self._capture is not None else contextlib.nullcontext()

    @torch.inference_mode()
    def after_step(self, rows: Trajectories) -> None:
        valid = rows.valid[self.rows]  # (Bq, S) including the new column
        current = rows.positions[self.rows]  # position of the token just fed
        self.held += 1
        # (an async check: a device assertion, no host round trip)
        torch._assert_async((valid.sum(-1) == self.held).all() & (current == self.position).all())
        caches = []
        zeros = torch.zeros(current.shape[0], 1, 1, device=current.device)  # new slots' scores
        fed = current[:, None, None]
        for name, tensor in self.slots.items():
            new = fed if name == "position" else zeros
            self.slots[name], self._storage[name] = append_columns(tensor, new, self._storage[name])
        hidden = None
        if self.rule.needs_attention:  # once for every layer: 0 where visible, -inf where not
            hidden = torch.zeros(valid.shape, device=valid.device).masked_fill_(~valid, -math.inf)
            hidden = hidden[:, None, None, :]  # (Bq, 1, 1, S)
        for layer, (keys, values) in enumerate(cache_tensors(rows.cache)):
            kq, vq = keys[self.rows], values[self.rows]  # views into the cache
            state = {name: tensor[layer] for name, tensor in self.slots.items()}
            q = None
            if self._capture is not None:
                q = self._capture.batch_queries(layer, rows=self.rows)  # (Bq, H, 1, D)
            attention = None
            if self.rule.needs_attention:
                assert q is not None and hidden is not None
                # The query heads of a GQA group as rows against their KV head (no copies).
                qg = q.reshape(q.shape[0], -1, self.group, q.shape[-1]).float()
                logits = torch.matmul(qg, kq.float().transpose(-1, -2))
                # scaled and masked in one op: hidden + scaling * logits
                probs = torch.softmax(torch.add(hidden, logits, alpha=self.scaling), dim=-1)
                attention = probs.mean(2)  # (Bq, kv_heads, S)
            queries = query_positions = None
            if self.window > 0:
                assert q is not None and self.query_positions is not None
                known = self.queries[layer]
                queries = torch.cat([known, q if q.dtype == known.dtype else q.to(known.dtype)], 2)
                queries = queries[:, :, -self.window :]
                self.queries[layer] = queries
                if layer == 0:
                    positions = torch.cat([self.query_positions, current[:, None]], dim=1)
                    self.query_positions = positions[:, -self.window :]
                query_positions = self.query_positions
            cache = DecodeCache(
                layer=layer,
                keys=kq,
                values=vq,
                visible=valid,
                state=state,
                current=current,
                rows=self.replicates,
                scaling=self.scaling,
                num_query_heads=self.num_query_heads,
                attention=attention,
                queries=queries,
                query_positions=query_positions,
                held=self.held,
                current_position=self.position,
                row_ids=self.row_ids,
                all_layers_state=self.slots,
            )
            self.rule.observe(cache)
            caches.append(cache)
        self.position += 1
        if self.held - self.rule.budget < self.rule.every:
            return
        # Every row is over its budget by ``every``: all of them evict.
        kept = self.rule.keep(caches)
        home = valid & (valid.cumsum(-1) <= self.rule.budget)
        _compact(
            caches, self.slots, torch.stack(kept), home, valid & ~home, self.held - self.rule.budget
        )
        rows.valid[self.rows] = home
        self.held = self.rule.budget


def _compact(
    caches: list[DecodeCache],
    slots: dict[str, torch.Tensor],
    keep: torch.Tensor,
    home: torch.Tensor,
    tail: torch.Tensor,
    width: int,
) -> None:
    """Move the kept entries of ``tail`` columns (``width`` per row) into the ``home`` slots of
    evicted entries, per layer, row and KV head, in place (``keep``: ``(layers, B, kv_heads,
    budget)``), with the ``slots`` state ``(layers, B, kv_heads, S)`` that goes with them.

    At most ``width`` entries move per row and head (as many home entries are evicted as tail
    entries are kept), so ``width`` columns are copied, not the cache: where each entry goes is
    found for every layer at once, the slot state moves in one copy per name, and keys and
    values in one per layer (each layer's cache is its own tensor)."""
    shape = keep.shape[:-1] + home.shape[-1:]  # (layers, B, kv_heads, S)
    kept = torch.zeros(shape, dtype=torch.bool, device=keep.device).scatter_(3, keep, True)
    hole = home[None, :, None, :] & ~kept
    mover = tail[None, :, None, :] & kept
    holes = torch.argsort((~hole).to(torch.int8), dim=-1, stable=True)[..., :width]  # holes first
    movers = torch.argsort((~mover).to(torch.int8), dim=-1, stable=True)[..., :width]
    count = hole.sum(-1, keepdim=True)
    # (an entry the rule kept outside the visible slots would break the count: checked on the
    # device, asynchronously)
    torch._assert_async((count == mover.sum(-1, keepdim=True)).all())
    rank = torch.arange(width, device=keep.device)
    sources = torch.where(rank < count, movers, holes)  # beyond the count: a hole onto itself
    for tensor in slots.values():
        tensor.scatter_(3, holes, tensor.gather(3, sources))
    # head_dim -> per layer (sources, holes) as wide as the cache's entries
    wide: dict[int, tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]] = {}
    for layer, cache in enumerate(caches):
        for tensor in (cache.keys, cache.values):
            d = int(tensor.shape[-1])
            if d not in wide:
                full = (*sources.shape, d)
                wide[d] = (
                    sources[..., None].expand(full).unbind(0),
                    holes[..., None].expand(full).unbind(0),
                )
            src, to = wide[d]
            tensor.scatter_(2, to[layer], tensor.gather(2, src[layer]))
