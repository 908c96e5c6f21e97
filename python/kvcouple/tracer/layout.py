"""Cache layouts beyond the joint one: P and Q rows as two batches (split), or one batch whose
rows share their side's prefix (shared).

**split.**
In the joint layout (:class:`~kvcouple.tracer.trajectories.Trajectories`) P rows and Q rows
share one cache tensor per layer, so the evicted Q rows are left-padded back to the prompt's
length and the padding masked: eviction saves neither memory nor attention work. Here the P
rows hold the full prefix and the Q rows only the kept entries; each step runs the two batches
one after the other (two forward passes, the weights read twice) and returns their logits as
one ``(2B, vocab)`` batch, P rows first, exactly like the joint layout. Neither batch needs an
attention mask on the overlap path (every cached entry is visible); forks mask the path's
columns from ``t*`` on, per row.

**shared.** Every P row's prefix is the prompt's cache and every Q row's the same cache with
the policy's evicted entries hidden (or the kept entries as their own tensors): held once,
not once per replicate. The batch's cache holds only each row's own columns (the tokens fed
from the last prompt token on), and attention over a row's prefix and its own columns is one
softmax over both (:func:`kvcouple.tracer.prefix.prefix_attention`: one prefix call per
layer for every row, the documents' prompts in one
:class:`~kvcouple.tracer.prefix.PromptPack`). P and Q rows run as one batch (the
weights read once per step), and a fork copies none of the prefix. At 32k tokens, R=8, on an
8B model the P rows' cache falls from 32 GiB to the prompt's 4 GiB plus 8 x T columns. It
needs a model whose every layer attends through the tracer's wrapper without a window,
soft-cap or sinks (:func:`kvcouple.tracer.attention.prefix_supported`).

Caches are preallocated for the columns they will reach (:mod:`kvcouple.tracer.kvcache`), and
a fork copies only the columns its rows can see. Decode-time eviction changes the Q rows'
cache while decoding and keeps the joint layout.
"""

from __future__ import annotations

from typing import Any

import torch

from kvcouple.tracer import compat
from kvcouple.tracer.kvcache import cache_bytes, cache_from_tensors, cache_length, fork_cache
from kvcouple.tracer.prefill import hidden_entries
from kvcouple.tracer.prefix import PrefixGroup, PromptPack, SharedPrefix
from kvcouple.tracer.rows import CacheRows

# A Q side in the shared layout: the kept entries' own tensors per layer, or their positions
# ``(layers, kv_heads, keep)`` in the prompt's cache.
Kept = list[tuple[torch.Tensor, torch.Tensor]] | torch.Tensor


class _Batch(CacheRows):
    """Rows sharing one cache: per-row visibility (None: every column) and positions."""

    def fork(self, index: torch.Tensor, limit: torch.Tensor, steps: int) -> _Batch:
        """Copies of rows ``index`` seeing columns ``< limit`` (per new row), with room for
        ``steps`` more."""
        cache, seen = fork_cache(self.cache, self.valid, index, limit, steps)
        return _Batch(self.model, cache, seen, torch.zeros_like(limit))


class SplitRows:
    """``B`` P rows then ``B`` Q rows, stepped as two batches (see the module docstring).

    ``gap``: how many columns the Q rows' cache has fewer than the P rows' before the
    generated tokens (prefix length minus kept entries), to map path columns between them.
    """

    def __init__(self, p: _Batch, q: _Batch, gap: int):
        self.p, self.q, self.gap = p, q, gap

    @classmethod
    def start(
        cls,
        model: Any,
        prefix: list[tuple[torch.Tensor, torch.Tensor]],
        kept: list[tuple[torch.Tensor, torch.Tensor]],
        copies: int,
        steps: int,
        idx: torch.Tensor | None = None,
    ) -> SplitRows:
        """``copies`` P rows on the ``prefix`` cache and ``copies`` Q rows on the ``kept``
        entries (both ``(1, kv_heads, length, head_dim)`` per layer), with room for ``steps``
        tokens, about to feed the last prompt token at position ``n - 1``. ``idx``: the kept
        positions ``(layers, kv_heads, keep)``, which sliding-window layers need."""
        n1, keep = int(prefix[0][0].shape[2]), int(kept[0][0].shape[2])
        device = prefix[0][0].device
        positions = torch.full((copies,), n1, device=device)
        p_pos = q_pos = None
        if idx is not None and compat.needs_positions(model):  # only windows need them
            every = torch.arange(n1, device=device, dtype=torch.int32).expand(copies, 1, n1)
            p_pos = [every for _ in range(len(prefix))]
            q_pos = [i.to(device, torch.int32).expand(copies, -1, -1) for i in idx]

        def rows(kv: list[tuple[torch.Tensor, torch.Tensor]], pos: Any) -> _Batch:
            layers = ((k.expand(copies, -1, -1, -1), v.expand(copies, -1, -1, -1)) for k, v in kv)
            return _Batch(model, cache_from_tensors(layers, pos, steps), None, positions)

        return cls(rows(prefix, p_pos), rows(kept, q_pos), n1 - keep)

    @property
    def rows(self) -> int:
        return int(self.p.positions.shape[0])

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per row (``2B``: P rows then Q rows); returns ``(2B, vocab)``."""
        half = tokens.shape[0] // 2
        return torch.cat([self.p.step(tokens[:half]), self.q.step(tokens[half:])])

    def fork(self, index: torch.Tensor, visible_before: torch.Tensor, steps: int = 0) -> SplitRows:
        """Copies of rows ``index`` (``B`` P rows, then the ``B`` matching Q rows, numbered as
        in the joint layout: Q row ``i`` is ``B + i``) seeing only the path columns before
        ``visible_before`` (in P's columns, which are positions), positioned to feed the token
        of that column, with room for ``steps`` tokens."""
        half = index.shape[0] // 2
        p_index, q_index = index[:half], index[half:] - self.rows
        if bool((p_index >= self.rows).any()) or bool((q_index < 0).any()):
            raise ValueError("fork index must list P rows, then Q rows")
        p = self.p.fork(p_index, visible_before[:half], steps)
        q = self.q.fork(q_index, visible_before[half:] - self.gap, steps)
        p.positions = visible_before[:half].clone()
        q.positions = visible_before[half:].clone()
        return SplitRows(p, q, self.gap)

    def cache_bytes(self) -> int:
        return cache_bytes(self.p.cache) + cache_bytes(self.q.cache)


class SharedRows(CacheRows):
    """P rows then Q rows in one batch whose cache holds only each row's own columns; every row
    attends first to its group's prefix (see the module docstring).

    Rows come in units (one per document of the batch): unit ``u``'s ``copies`` P rows attend
    to its prompt's cache and its ``copies`` Q rows, at the same place in the second half, to
    its kept entries. A row's own column ``j`` is P column ``offsets[row] + j`` (the unit's
    prefix length, ``n - 1``), as in the joint layout.
    """

    def __init__(
        self,
        model: Any,
        cache: Any,
        valid: torch.Tensor | None,
        positions: torch.Tensor,
        groups: list[PrefixGroup] | SharedPrefix,
        offsets: torch.Tensor,
    ):
        shared = groups if isinstance(groups, SharedPrefix) else SharedPrefix(groups)
        super().__init__(
            model, cache, valid, positions, prefix=shared, dtype=shared.groups[0].kv[0][0].dtype
        )
        self.offsets = offsets
        self.shared = shared

    @classmethod
    def start(
        cls,
        model: Any,
        prefix: list[tuple[torch.Tensor, torch.Tensor]],
        kept: Kept,
        copies: int,
        steps: int,
    ) -> SharedRows:
        """``copies`` P rows on ``prefix`` (``(1, kv_heads, length, head_dim)`` per layer,
        held, not copied) and ``copies`` Q rows on ``kept``: either the kept entries as their
        own tensors (the same shape per layer), or their positions ``(layers, kv_heads,
        keep)`` in ``prefix``, which the Q rows then attend to with every other entry hidden
        (P and Q rows in one prefix call per layer, :class:`SharedPrefix`). Own caches empty
        with room for ``steps`` tokens, about to feed the last prompt token at position
        ``n - 1``."""
        return cls.start_units(model, [(prefix, kept)], copies, steps)

    @classmethod
    def start_units(
        cls,
        model: Any,
        units: list[tuple[list[tuple[torch.Tensor, torch.Tensor]], Kept]],
        copies: int,
        steps: int,
        slots: list[tuple[PromptPack, int] | None] | None = None,
    ) -> SharedRows:
        """:meth:`start` for several ``(prefix, kept)`` units (documents) in one batch: the P
        rows of every unit in order, then their Q rows in the same order. ``slots``: where
        each unit's prefix lies in a :class:`PromptPack` (the units' prompts in order in one
        pack: one prefix call per layer for the whole batch)."""
        first = units[0][0]
        device = first[0][0].device
        rows = 2 * copies * len(units)
        empty = (
            (
                k.new_empty(rows, k.shape[1], 0, k.shape[3]),
                v.new_empty(rows, v.shape[1], 0, v.shape[3]),
            )
            for k, v in first
        )
        cache = cache_from_tensors(empty, None, steps)
        half = copies * len(units)
        where = slots or [None] * len(units)
        groups = [
            PrefixGroup(u * copies, (u + 1) * copies, p, slot=where[u])
            for u, (p, _) in enumerate(units)
        ]
        for u, (p, kept) in enumerate(units):
            start, stop = half + u * copies, half + (u + 1) * copies
            if isinstance(kept, torch.Tensor):
                groups.append(PrefixGroup(start, stop, p, hidden_entries(p, kept), where[u]))
            else:
                groups.append(PrefixGroup(start, stop, kept))
        lengths = torch.tensor([int(p[0][0].shape[2]) for p, _ in units], device=device)
        offsets = lengths.repeat_interleave(copies).repeat(2)
        return cls(model, cache, None, offsets.clone(), groups, offsets)

    @property
    def rows(self) -> int:
        return int(self.positions.shape[0]) // 2

    def fork(self, index: torch.Tensor, visible_before: torch.Tensor, steps: int = 0) -> SharedRows:
        """Copies of rows ``index`` (``B`` P rows, then the ``B`` matching Q rows) seeing only
        the path columns before ``visible_before`` (P's columns), positioned to feed the token
        of that column, with room for ``steps`` tokens; the prefixes are shared, not copied."""
        half = index.shape[0] // 2
        if bool((index[:half] >= self.rows).any()) or bool((index[half:] < self.rows).any()):
            raise ValueError("fork index must list P rows, then Q rows")
        offsets = self.offsets[index]
        own = visible_before - offsets
        if bool((own < 0).any()) or int(own.max()) > cache_length(self.cache):
            # (a column mapping that disagrees with the rows' would read the wrong columns)
            raise ValueError("a fork must see the whole prefix and only columns already fed")
        cache, seen = fork_cache(self.cache, self.valid, index, own, steps)
        return SharedRows(
            self.model,
            cache,
            seen,
            visible_before.clone(),
            self.shared.of_groups(self._groups_of(index)),
            offsets,
        )

    def _groups_of(self, index: torch.Tensor) -> list[PrefixGroup]:
        """The prefix groups of rows ``index``: runs of consecutive rows of one group."""
        group_of = [0] * (2 * self.rows)
        for g, group in enumerate(self.shared.groups):
            group_of[group.start : group.stop] = [g] * (group.stop - group.start)
        groups: list[PrefixGroup] = []
        for row, source in enumerate(index.tolist()):
            source_group = self.shared.groups[group_of[source]]
            last = groups[-1] if groups else None
            if (
                last is not None
                and last.kv is source_group.kv
                and last.hidden is source_group.hidden
                and last.stop == row
            ):
                last.stop = row + 1
            else:
                groups.append(
                    PrefixGroup(
                        row, row + 1, source_group.kv, source_group.hidden, source_group.slot
                    )
                )
        return groups

    def cache_bytes(self) -> int:
        """Bytes of the rows' own caches (the prefixes are the prompts' and the kept caches)."""
        return cache_bytes(self.cache)
