"""Shared prefixes (the ``shared`` cache layout, :mod:`kvcouple.tracer.layout`): the rows of a
batch hold only their own columns and all attend, before them, to a prefix they share (their
document's prompt cache, held once, with a policy's evicted entries hidden by a mask for the
Q rows).

- :class:`PromptPack`: a batch's documents' prompt caches in one padded tensor per layer;
- :class:`PrefixGroup`: rows that share one prefix; :class:`SharedPrefix`: a batch's groups,
  **packed** into one attention call per layer where they have that form;
- :func:`prefix_attention`: cascade attention over a row's prefix and its own columns, two
  attention calls that each return their log-sum-exp (:mod:`kvcouple.tracer.lse_attention`),
  merged exactly.

:mod:`kvcouple.tracer.attention`'s wrapper calls :func:`prefix_attention` for models that
dispatch through transformers' attention interface.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvcouple.tracer.lse_attention import MASK_ALIGNMENT, attend_lse, fused_path, sides_batched

__all__ = ["PrefixGroup", "PromptPack", "SharedPrefix", "prefix_attention"]


@dataclass(eq=False)
class PromptPack:
    """The prompt caches of a batch's documents in one tensor per layer, ``(documents,
    kv_heads, longest, head_dim)``, each padded after its ``lengths[i]`` entries (zeros, never
    seen): document ``i``'s cache is the view :meth:`slot` of it. Shared-layout attention then
    covers every document of the batch in one call (:class:`SharedPrefix`)."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]
    lengths: list[int]

    @classmethod
    def allocate(
        cls, like: list[tuple[torch.Tensor, torch.Tensor]], lengths: list[int]
    ) -> PromptPack:
        """An empty pack shaped after one document's cache ``like``, for ``lengths``."""
        longest = max(lengths)
        kv = [
            (
                k.new_zeros(len(lengths), k.shape[1], longest, k.shape[3]),
                v.new_zeros(len(lengths), v.shape[1], longest, v.shape[3]),
            )
            for k, v in like
        ]
        return cls(kv, list(lengths))

    def put(self, i: int, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy document ``i``'s cache into its slot."""
        for (pk, pv), (k, v) in zip(self.kv, kv, strict=True):
            if int(k.shape[2]) != self.lengths[i]:
                raise ValueError(f"document {i} has {k.shape[2]} entries, not {self.lengths[i]}")
            pk[i : i + 1, :, : k.shape[2]].copy_(k)
            pv[i : i + 1, :, : v.shape[2]].copy_(v)

    def part(self, documents: slice) -> PromptPack:
        """Documents ``documents`` (a range) of the pack: views of its tensors."""
        return PromptPack(
            [(k[documents], v[documents]) for k, v in self.kv], self.lengths[documents]
        )

    def slot(self, i: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Document ``i``'s cache, ``(1, kv_heads, lengths[i], head_dim)`` per layer (views)."""
        n = self.lengths[i]
        return [(k[i : i + 1, :, :n], v[i : i + 1, :, :n]) for k, v in self.kv]


# A packed call's form: the pack (None: one document's prefix), per document its Q rows' mask,
# the row gathers into the call's order and back (None: the rows are in that order), and the
# pack's documents the call covers (None: all of them).
_Form = tuple[
    PromptPack | None,
    list[list[torch.Tensor] | None],
    tuple[torch.Tensor, torch.Tensor, int] | None,
    slice | None,
]


@dataclass
class PrefixGroup:
    """Rows ``start:stop`` of a batch attend, before their own cache, to ``kv``: per layer the
    ``(1, kv_heads, length, head_dim)`` keys and values of a prefix they all share.

    ``hidden``: per layer an additive ``(1, kv_heads, 1, length)`` mask (``finfo.min`` at the
    entries the rows do not see, 0 elsewhere; None: every entry seen). A policy's kept cache
    is the prompt's cache with its evicted entries hidden, so that P and Q rows of a document
    attend to one tensor, in one call (:class:`SharedPrefix`)."""

    start: int
    stop: int
    kv: list[tuple[torch.Tensor, torch.Tensor]]
    hidden: list[torch.Tensor] | None = None
    slot: tuple[PromptPack, int] | None = None  # where ``kv`` lies in a batch's pack


@dataclass
class SharedPrefix:
    """The prefix groups of a batch, in row order (they cover every row once), and the
    layers that used them.

    Where every group has as many rows and the same prefix tensors (one document: its P rows
    see the prompt's cache, its Q rows the same cache with the evicted entries hidden), the
    groups are **packed**: per layer the prefix expanded to ``(groups, kv_heads, length,
    head_dim)`` (a view, no copy) and the groups' masks stacked, so that every row's prefix
    attention is one call (:func:`prefix_attention`). Built once per batch (and per fork), not
    per step."""

    groups: list[PrefixGroup]
    served: set[int] = field(default_factory=set)
    # Packed masks by the groups' masks (a fork whose groups have the masks of its source
    # batch's reuses its stacks rather than holding copies): shared with :meth:`of_groups`.
    # (keyed by the masks' ids; each entry holds its masks, so that no id is reused)
    stacks: dict[tuple[int, ...], tuple[list[Any], list[torch.Tensor]]] = field(
        default_factory=dict
    )

    def of_groups(self, groups: list[PrefixGroup]) -> SharedPrefix:
        """The prefix of another batch of these groups' rows (a fork), sharing the packed
        masks already built."""
        return SharedPrefix(groups, stacks=self.stacks)

    def __post_init__(self) -> None:
        stop = 0
        for g in self.groups:
            if g.start != stop or g.stop < g.start:
                raise ValueError("prefix groups must cover consecutive rows, in order")
            stop = g.stop
        self.rows = stop
        self.packed = self._pack()
        self.sides: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] | None = None
        self._step_bias: tuple[torch.Tensor, torch.Tensor] | None = None
        self._sides_bias: dict[int, tuple[int, torch.Tensor]] = {}  # layer: (rows, mask)
        if self.groups and self.groups[0].kv:
            # the device's attention path decided now, eagerly, not inside a compiled step
            k = self.groups[0].kv[0][0]
            fused_path(k.device, k.dtype, int(k.shape[-1]))
            if self.packed is not None and sides_batched(k.device, k.dtype, int(k.shape[-1])):
                forms = [_sides_form(*layer) for layer in self.packed]
                if all(form is not None for form in forms):
                    self.sides = forms  # type: ignore[assignment]

    def _pack(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] | None:
        """Per layer the keys and values ``(documents, kv_heads, length, head_dim)`` and the
        mask ``(documents, 2 kv_heads, 1, length)`` (query head ``2 h + side`` of KV head
        ``h``; None: every entry seen) of one call covering every group, or None where the
        groups have no such form (:meth:`_in_order`, :meth:`_gathered`). Sets ``gather``:
        None where the rows are already in the call's order, else the row gathers."""
        self.gather: tuple[torch.Tensor, torch.Tensor, int] | None = None
        if not self.groups or not self.groups[0].kv:
            return None
        form = self._in_order() or self._gathered()
        if form is None:
            return None
        pack, hiddens, gather, part = form
        whole = pack
        if pack is not None and part is not None:
            pack = pack.part(part)
        kv = self.groups[0].kv if pack is None else pack.kv
        if any(int(k.shape[-2]) == 0 for k, _ in kv):
            return None
        # (against the tensors' width: a part of a pack is as wide as the pack's longest)
        padded = pack is not None and min(pack.lengths) < int(pack.kv[0][0].shape[-2])
        key = (id(pack), *(0 if h is None else id(h) for h in hiddens))
        masks = None
        if padded or any(key[1:]):
            if whole is not None:  # views of the masks a batch stacked for the whole pack
                span = part if part is not None else slice(0, len(whole.lengths))
                masks = self._part_masks(whole, span, hiddens)
            if masks is None and part is not None:  # (not kept: they would pile up per fork)
                masks = [self._masks(i, pack, hiddens) for i in range(self.layers)]
            elif masks is None:
                if key not in self.stacks:
                    held = [pack, *hiddens]
                    self.stacks[key] = (
                        held,
                        [self._masks(i, pack, hiddens) for i in range(self.layers)],
                    )
                masks = self.stacks[key][1]
        self.gather = gather
        return [(k, v, None if masks is None else masks[i]) for i, (k, v) in enumerate(kv)]

    def _part_masks(
        self, pack: PromptPack, part: slice, hiddens: list[list[torch.Tensor] | None]
    ) -> list[torch.Tensor] | None:
        """Per layer the documents ``part`` of the masks a batch stacked for the whole
        ``pack`` (views; the stacks themselves for every document), where its Q rows' masks
        are ``hiddens`` (None: no Q rows here, any mask will do); None where no batch stacked
        them."""
        whole = part.start == 0 and part.stop == len(pack.lengths)
        for held, masks in self.stacks.values():
            if held[0] is pack and len(held) == 1 + len(pack.lengths):
                if all(h is None or held[1 + part.start + j] is h for j, h in enumerate(hiddens)):
                    return masks if whole else [m[part] for m in masks]
        return None

    def _in_order(self) -> _Form | None:
        """The rows already in the packed call's order: ``D`` P groups then ``D`` Q groups,
        every one of ``n`` rows, Q group ``i`` on the same prefix as P group ``i`` (one
        document), and for ``D > 1`` the documents in order in one :class:`PromptPack`."""
        G = len(self.groups)
        if G % 2:
            return None
        D = G // 2
        sides, n = self.groups[:D], self.groups[0].stop - self.groups[0].start
        if n == 0 or any(g.stop - g.start != n for g in self.groups):
            return None
        if any(self.groups[D + i].kv is not g.kv for i, g in enumerate(sides)):
            return None
        pack = None
        if D > 1:
            pack = sides[0].slot[0] if sides[0].slot is not None else None
            if pack is None or len(pack.lengths) != D:
                return None
            if any(not _in_slot(g, pack, i) for i, g in enumerate(sides)):
                return None
        return pack, [self.groups[D + i].hidden for i in range(D)], None, None

    def _gathered(self) -> _Form | None:
        """Rows of one document's prefix or of one pack's documents in any order and number
        (a fork of a batch of documents: branches per document differ): gathered into the
        call's order, ``(side, document, slot)`` with ``n`` slots each (the most rows any
        document has on a side; unused slots repeat row 0, their outputs dropped), and back.
        P rows see no hidden entries, Q rows their document's one mask. The call covers the
        range of the pack's documents from the first with rows to the last (a fork of some
        documents' branches: a view of the pack)."""
        first = self.groups[0]
        pack = first.slot[0] if first.slot is not None else None
        D = 1 if pack is None else len(pack.lengths)
        rows: list[list[list[int]]] = [[[] for _ in range(D)] for _ in range(2)]
        hiddens: list[list[torch.Tensor] | None] = [None] * D
        for g in self.groups:
            if pack is None:
                if g.kv is not first.kv or g.slot is not None:
                    return None
                doc = 0
            else:
                doc = g.slot[1] if g.slot is not None else -1
                if not _in_slot(g, pack, doc):
                    return None
            side = 0 if g.hidden is None else 1
            if side and hiddens[doc] is not None and hiddens[doc] is not g.hidden:
                return None  # two masks on one document
            if side:
                hiddens[doc] = g.hidden
            rows[side][doc].extend(range(g.start, g.stop))
        present = [i for i in range(D) if rows[0][i] or rows[1][i]]
        part = None
        if present[-1] + 1 - present[0] < D:
            # The call covers the range of the pack from the first document with rows to the
            # last. A document without rows inside it (no branches) is read for nothing, once
            # per layer: cheaper than a call per group and side, by the op counts (a host-bound
            # GPU step pays ~13 us an op; an 8B model's 4k-token prompt is ~0.15 ms to read).
            part = slice(present[0], present[-1] + 1)
            rows = [side[part] for side in rows]
            hiddens = hiddens[part]
            D = part.stop - part.start
        n = max(len(r) for side in rows for r in side)
        slot_rows = [0] * (2 * D * n)
        row_slot = [0] * self.rows
        for side in range(2):
            for doc in range(D):
                for j, row in enumerate(rows[side][doc]):
                    slot_rows[(side * D + doc) * n + j] = row
                    row_slot[row] = (side * D + doc) * n + j
        device = first.kv[0][0].device
        gather = (
            torch.tensor(slot_rows, dtype=torch.long, device=device),
            torch.tensor(row_slot, dtype=torch.long, device=device),
            n,
        )
        return pack, hiddens, gather, part

    def _masks(
        self, layer: int, pack: PromptPack | None, hiddens: list[list[torch.Tensor] | None]
    ) -> torch.Tensor:
        """Layer ``layer``'s additive masks for :meth:`_pack`: per document and KV head the P
        rows' (padding hidden) and the Q rows' (padding and the document's ``hiddens``
        entries hidden)."""
        D = len(hiddens)
        k = self.groups[0].kv[layer][0] if pack is None else pack.kv[layer][0]
        kv_heads, width = int(k.shape[1]), int(k.shape[2])
        lowest = torch.finfo(k.dtype).min
        # Rows stored 16-element aligned (a view of ``width`` columns): the CUDA kernel needs
        # its bias rows aligned, and would otherwise pad a copy every layer and step.
        stored = width + (-width % MASK_ALIGNMENT)
        out = k.new_full((D, kv_heads, 2, 1, stored), lowest)
        for i in range(D):
            n = width if pack is None else pack.lengths[i]
            out[i, :, 0, :, :n] = 0
            hidden = hiddens[i]
            out[i, :, 1, :, :n] = 0 if hidden is None else hidden[layer][0]
        return out.view(D, 2 * kv_heads, 1, stored)[..., :width]

    def step_bias(self, mask: torch.Tensor, shape: tuple[int, int, int, int]) -> torch.Tensor:
        """The step's mask expanded to the own columns' score ``shape`` (a view), once per
        step: every layer of a step gets the same mask, and CUDA's kernel reads its bias at
        the full score shape (one expand a step, not one a layer)."""
        if torch.compiler.is_compiling():  # (no state kept while tracing)
            return mask.expand(shape)
        last = self._step_bias
        if last is None or last[0] is not mask or tuple(last[1].shape) != shape:
            last = self._step_bias = (mask, mask.expand(shape))
        return last[1]

    def sides_at(
        self, layer: int, rows: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Layer ``layer``'s sides form (:attr:`sides`) with its mask expanded to the call's
        ``rows`` queries (a view, made once per layer and row count: a batch's rows do not
        change from step to step)."""
        assert self.sides is not None
        key, value, bias = self.sides[layer]
        if bias is None:
            return key, value, bias
        made = self._sides_bias.get(layer)
        if made is None or made[0] != rows:
            made = (rows, bias.expand(-1, -1, rows, -1))
            if not torch.compiler.is_compiling():  # (no state kept while tracing)
                self._sides_bias[layer] = made
        return key, value, made[1]

    @property
    def layers(self) -> int:
        return len(self.groups[0].kv)

    def width(self, layer: int) -> int:
        """The longest prefix of ``layer``."""
        return max(int(g.kv[layer][0].shape[-2]) for g in self.groups)


def _sides_form(
    key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """A packed layer of ``D`` documents (keys and values ``(D, kv, S, d)``, mask ``(D, 2 kv,
    1, S)`` or None) with its sides as the batch and its documents' KV heads as the heads:
    keys and values ``(2, D kv, S, d)`` broadcast over the sides (stride 0), the mask ``(2,
    D kv, 1, S)`` (query head ``2 h + side`` of document ``i`` is side ``side``, head ``i kv
    + h``). Views, made once per batch; None where the pack's documents and heads do not
    merge into one axis without a copy (the per-head calls run instead)."""
    D, kv_heads, S = (int(x) for x in key.shape[:3])
    try:
        k = key.view(1, D * kv_heads, S, key.shape[-1])
        v = value.view(1, D * kv_heads, S, value.shape[-1])
        bias = None
        if mask is not None:
            sides = mask.unflatten(1, (kv_heads, 2)).permute(2, 0, 1, 3, 4)
            bias = sides.view(2, D * kv_heads, 1, S)
    except RuntimeError:  # strides that do not merge: would need a copy
        return None
    return k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1), bias


def _in_slot(g: PrefixGroup, pack: PromptPack, doc: int) -> bool:
    """Whether ``g``'s prefix is document ``doc``'s slot of ``pack``, by its tensors, not only
    by its label: the packed call reads the pack, so a label that disagreed with the tensors
    would attend to another document's prompt (such groups are not packed)."""
    if g.slot is None or g.slot[0] is not pack or g.slot[1] != doc:
        return False
    return len(g.kv) == len(pack.kv) and all(
        int(k.shape[-2]) == pack.lengths[doc]
        and k.data_ptr() == pk[doc].data_ptr()
        and v.data_ptr() == pv[doc].data_ptr()
        for (k, v), (pk, pv) in zip(g.kv, pack.kv, strict=True)
    )


def prefix_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    prefix: SharedPrefix,
    layer: int,
) -> torch.Tensor:
    """Attention of ``query`` ``(B, heads, q, d)`` over each row's group prefix followed by
    its own ``key``/``value`` ``(B, kv_heads, s, d)`` (visible where ``mask`` ``(B, 1 or
    heads, q, >= s)`` allows; None: everywhere; a row always sees its newest column). Returns
    ``(B, q, heads, d_v)`` like transformers' attention functions.

    Cascade attention: the prefix part and the own part are two softmax attentions, each with
    its log-sum-exp ``lse_p``, ``lse_o``; attention over both is exactly ``o_p w + o_o (1 -
    w)`` with ``w = exp(lse_p) / (exp(lse_p) + exp(lse_o)) = sigmoid(lse_p - lse_o)``, in
    float32. Query heads sharing a KV head are one set of query rows (GQA without copies), and
    a group's rows are folded into the query axis so that its prefix is read once per layer.
    """
    B, heads, q, d = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    gq = group * q
    # Query heads h = kv * group + j share KV head kv: rows of (B, kv_heads, group * q, d).
    qg = query.reshape(B, kv_heads, gq, d)
    if prefix.rows != B:
        raise ValueError(f"prefix groups cover {prefix.rows} rows of a batch of {B}")
    m = None
    if mask is not None:
        m = mask if mask.shape[-1] == key.shape[-2] else mask[..., : key.shape[-2]]
        if m.dtype == torch.bool:
            m = torch.zeros(m.shape, dtype=query.dtype, device=m.device).masked_fill(
                ~m, torch.finfo(query.dtype).min
            )
        if q == 1 and m.shape[1] == 1:  # (B, 1, 1, s) broadcasts over (B, kv, group, s)
            m = prefix.step_bias(m, (B, kv_heads, gq, int(m.shape[-1])))
        elif m.shape[1] == 1:
            m = m.expand(B, 1, q, -1)[:, :, None].expand(B, 1, group, q, -1).reshape(B, 1, gq, -1)
        else:
            m = m.expand(B, -1, q, -1).reshape(B, kv_heads, gq, -1)
    # (B, kv, gq, d), (B, kv, >= gq): the log-sum-exps are read through strided views (their
    # padding, where a kernel pads them, never sliced off)
    own, own_lse = attend_lse(qg, key, value, m, scaling, padded_lse=True)
    if prefix.packed is not None:
        ordered = qg if prefix.gather is None else qg.index_select(0, prefix.gather[0])
        pre, pre_lse = _packed_prefix(ordered, prefix, layer, scaling)
        six = tuple(pre.shape[:5])  # (side, document, row, kv, gq)
        D, n = six[1], six[2]
        if prefix.gather is not None:  # back to the rows' order: (B, kv, gq, ...)
            back = prefix.gather[1]
            pre = pre.reshape(2 * D * n, kv_heads, gq, -1).index_select(0, back)
            pre_lse = pre_lse.reshape(2 * D * n, kv_heads, gq, 1).index_select(0, back)
            return _heads_out(
                _merged(own, _lse_rows(own_lse, gq), pre, pre_lse), B, heads, q, query.dtype
            )
        own6 = own.reshape(*six, own.shape[-1])
        ls = own_lse.stride()
        own6_lse = own_lse.as_strided((*six, 1), (D * n * ls[0], n * ls[0], ls[0], ls[1], ls[2], 1))
        out = _merged(own6, own6_lse, pre, pre_lse)
        return _heads_out(out, B, heads, q, query.dtype)
    # Otherwise a call per group. Every row's queries, a group's rows consecutive: (1, kv, B *
    # gq, d).
    qt = qg.transpose(0, 1).reshape(1, kv_heads, B * gq, d)
    outs, lses = [], []
    for g in prefix.groups:
        if g.stop == g.start:
            continue
        kp, vp = g.kv[layer]
        hidden = None if g.hidden is None else g.hidden[layer]
        part = qt[:, :, g.start * gq : g.stop * gq]
        if kp.shape[-2]:
            out, lse = attend_lse(part, kp, vp, hidden, scaling)
        else:  # an empty prefix: weight 0
            out = own.new_zeros(1, kv_heads, (g.stop - g.start) * gq, own.shape[-1])
            lse = own_lse.new_full((1, kv_heads, (g.stop - g.start) * gq), float("-inf"))
        outs.append(out)
        lses.append(lse)
    pre = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    pre_lse = lses[0] if len(lses) == 1 else torch.cat(lses, dim=2)
    pre, pre_lse = _rows_first(pre, B), _rows_first(pre_lse, B, trailing=True)
    own_lse = _lse_rows(own_lse, gq)
    return _heads_out(_merged(own, own_lse, pre, pre_lse), B, heads, q, query.dtype)


def _packed_prefix(
    ordered: torch.Tensor, prefix: SharedPrefix, layer: int, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The prefix part of every row of a packed batch, in one call: ``ordered`` ``(2 D n, kv,
    gq, d)``, the rows in the call's (side, document, row) order; returns the outputs ``(2,
    D, n, kv, gq, d_v)`` and log-sum-exps ``(2, D, n, kv, gq, 1)``, strided views of the
    kernel's. Per document its P and Q rows are two query heads of each KV head (GQA over one
    prefix tensor, the rows folded into the query axis): queries ``(D, 2 kv, n gq, d)``; or,
    with :attr:`SharedPrefix.sides`, the sides are the call's batch."""
    kp, vp, hidden = prefix.packed[layer]  # type: ignore[index]
    _, kv_heads, gq, d = (int(x) for x in ordered.shape)
    D = int(kp.shape[0])
    n = int(ordered.shape[0]) // (2 * D)
    # (strides from the tensors' own: the kernels' outputs need not be contiguous)
    S = ordered.stride()
    six = (2, D, n, kv_heads, gq)
    if prefix.sides is not None:
        # CUDA's kernel: the sides are the call's batch, the prompts broadcast over it, and
        # the documents' KV heads its heads (sides_batched): queries (2, D kv, n * gq, d),
        # one call for every document.
        ks, vs, bias = prefix.sides_at(layer, n * gq)
        qs = ordered.as_strided(
            (2, D, kv_heads, n, gq, d), (D * n * S[0], n * S[0], S[1], S[0], S[2], S[3])
        ).reshape(2, D * kv_heads, n * gq, d)
        pre, pre_lse = attend_lse(qs, ks, vs, bias, scaling, padded_lse=True)
        o, s_ = pre.stride(), pre_lse.stride()
        pre = pre.as_strided(
            (*six, pre.shape[-1]), (o[0], kv_heads * o[1], gq * o[2], o[1], o[2], o[3])
        )
        pre_lse = pre_lse.as_strided(
            (*six, 1), (s_[0], kv_heads * s_[1], gq * s_[2], s_[1], s_[2], 1)
        )
        return pre, pre_lse
    qp = ordered.as_strided(
        (D, kv_heads, 2, n, gq, d), (n * S[0], S[1], D * n * S[0], S[0], S[2], S[3])
    ).reshape(D, 2 * kv_heads, n * gq, d)
    pre, pre_lse = attend_lse(qp, kp, vp, hidden, scaling, padded_lse=True)
    # Merged as (side, document, row, kv, gq, ...): the outputs strided views of the kernel's
    # (D, 2 kv, n * gq, ...), the own part's a view.
    o, s_ = pre.stride(), pre_lse.stride()
    pre = pre.as_strided((*six, pre.shape[-1]), (o[1], o[0], gq * o[2], 2 * o[1], o[2], o[3]))
    pre_lse = pre_lse.as_strided((*six, 1), (s_[1], s_[0], gq * s_[2], 2 * s_[1], s_[2], 1))
    return pre, pre_lse


def _merged(
    own: torch.Tensor, own_lse: torch.Tensor, pre: torch.Tensor, pre_lse: torch.Tensor
) -> torch.Tensor:
    """The two parts' softmax attentions merged exactly by their log-sum-exps (shapes that
    broadcast): ``own + w (pre - own)``, ``w = sigmoid(lse_pre - lse_own)``, in float32."""
    weight = torch.sigmoid(pre_lse - own_lse)
    if own.dtype != weight.dtype:
        own, pre = own.to(weight.dtype), pre.to(weight.dtype)
    return torch.lerp(own, pre, weight)


def _lse_rows(lse: torch.Tensor, rows: int) -> torch.Tensor:
    """A log-sum-exp ``(B, kv, >= rows)`` as ``(B, kv, rows, 1)``: one strided view."""
    st = lse.stride()
    return lse.as_strided((*lse.shape[:2], rows, 1), (st[0], st[1], st[2], 1))


def _heads_out(out: torch.Tensor, B: int, heads: int, q: int, dtype: torch.dtype) -> torch.Tensor:
    """``(B, kv, gq, d_v)`` as transformers' ``(B, q, heads, d_v)``; at ``q == 1`` that is the
    same order, so one view (or copy) does it."""
    out = out.reshape(B, 1, heads, -1) if q == 1 else out.reshape(B, heads, q, -1).transpose(1, 2)
    return out if out.dtype == dtype else out.to(dtype)


def _rows_first(t: torch.Tensor, rows: int, trailing: bool = False) -> torch.Tensor:
    """``(1, kv, rows * n, ...)`` (the rows in order along the third axis) as ``(rows, kv, n,
    ...)`` (``trailing``: with a last axis of size 1 added): one strided view."""
    kv, M = int(t.shape[1]), int(t.shape[2])
    n = M // rows
    size = [rows, kv, n, *t.shape[3:]]
    stride = [n * t.stride(2), t.stride(1), t.stride(2), *t.stride()[3:]]
    return t.as_strided(size + [1], stride + [1]) if trailing else t.as_strided(size, stride)
