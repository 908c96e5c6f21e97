"""The tracer's view of attention, through transformers' attention interface.

Every forward pass the tracer runs goes through :func:`active`: while it is entered, models
whose attention modules dispatch through ``ALL_ATTENTION_FUNCTIONS`` (transformers 4.48+)
run a registered wrapper (``kvcouple_sdpa`` / ``kvcouple_eager``) around their own
implementation. The wrapper sees what the model really attends with: post-RoPE, post-norm
queries and keys (so no-RoPE layers, partial rotary and per-layer norms need no special
case), the layer's ``sliding_window``, ``softcap`` and sinks. It does two things:

- **Sliding windows.** A layer with a window only sees keys at original positions
  ``> query position - window`` (transformers' own rule). The tracer's caches hold every
  entry at its original position (per row, layer and KV head, see :mod:`compat`), so the
  wrapper adds that constraint to whatever mask it is given: eviction and the window combine
  per layer, and the full policy equals the model.
- **Capture.** Inside a :class:`QueryCapture` it records each layer's queries, keys, values
  and call, so that policies get attention probabilities computed by the layer's own eager
  function (the same numbers as ``output_attentions=True``), soft-cap, sinks and window
  included.
- **Shared prefixes.** With a :class:`SharedPrefix` (the ``shared`` cache layout,
  :mod:`kvcouple.tracer.layout`) the cache holds only each row's own suffix; every row also
  attends to its group's prefix, held once for all the group's rows. Cascade attention
  (:func:`prefix_attention`): each group's prefix is one fused attention call for all the
  group's rows (the prefix is read once per step, not once per row) that also returns its
  log-sum-exp, the rows' own columns another, and the two are merged exactly by their
  log-sum-exps. No score tensor as wide as the prefix is materialised where the device has a
  kernel that returns the log-sum-exp (:mod:`kvcouple.tracer.lse_attention`: CPU and CUDA).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from kvcouple.tracer.lse_attention import attend_lse, fused_path
from kvcouple.tracer.model import WRAPPER_PREFIX as _PREFIX
from kvcouple.tracer.model import UnsupportedModelError, facts
from kvcouple.tracer.model import uses_interface as uses_interface

__all__ = [
    "ForwardState",
    "PrefixGroup",
    "QueryCapture",
    "SharedPrefix",
    "UnsupportedModelError",
    "active",
    "allowed_keys",
    "interface_available",
    "prefix_attention",
    "prefix_supported",
    "uses_interface",
]

_STATE = threading.local()


@dataclass
class ForwardState:
    """What the wrapper needs to know about the forward pass in flight."""

    query_positions: torch.Tensor  # (batch, q) original positions of the fed tokens
    key_positions: list[torch.Tensor] | None  # per layer (batch, kv_heads or 1, keys), or None
    prefix: SharedPrefix | None = None  # the prefixes the rows share (shared layout)


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

    def slot(self, i: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Document ``i``'s cache, ``(1, kv_heads, lengths[i], head_dim)`` per layer (views)."""
        n = self.lengths[i]
        return [(k[i : i + 1, :, :n], v[i : i + 1, :, :n]) for k, v in self.kv]


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
        if self.groups and self.groups[0].kv:
            # the device's attention path decided now, eagerly, not inside a compiled step
            k = self.groups[0].kv[0][0]
            fused_path(k.device, k.dtype)

    def _pack(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] | None:
        """Per layer the keys and values ``(documents, kv_heads, length, head_dim)`` and the
        mask ``(documents, 2 kv_heads, 1, length)`` (query head ``2 h + side`` of KV head
        ``h``; None: every entry seen) of one call covering every group, or None where the
        groups do not have that form: ``D`` P groups then ``D`` Q groups, every one of ``n``
        rows, Q group ``i`` on the same prefix as P group ``i`` (one document), and for
        ``D > 1`` the documents in order in one :class:`PromptPack`."""
        G = len(self.groups)
        if G == 0 or G % 2:
            return None
        D = G // 2
        sides, n = self.groups[:D], self.groups[0].stop - self.groups[0].start
        if n == 0 or any(g.stop - g.start != n for g in self.groups):
            return None
        if any(self.groups[D + i].kv is not g.kv for i, g in enumerate(sides)):
            return None
        if not sides[0].kv or any(int(k.shape[-2]) == 0 for g in sides for k, _ in g.kv):
            return None
        pack = None
        if D > 1:
            pack = sides[0].slot[0] if sides[0].slot is not None else None
            if pack is None or len(pack.lengths) != D:
                return None
            if any(
                g.slot is None or g.slot[0] is not pack or g.slot[1] != i
                for i, g in enumerate(sides)
            ):
                return None
        padded = pack is not None and min(pack.lengths) < max(pack.lengths)
        key = (id(pack), *(0 if g.hidden is None else id(g.hidden) for g in self.groups))
        masks = None
        if padded or any(key[1:]):
            if key not in self.stacks:
                held = [pack, *(g.hidden for g in self.groups)]
                self.stacks[key] = (held, [self._masks(i, pack) for i in range(self.layers)])
            masks = self.stacks[key][1]
        kv = sides[0].kv if pack is None else pack.kv
        return [(k, v, None if masks is None else masks[i]) for i, (k, v) in enumerate(kv)]

    def _masks(self, layer: int, pack: PromptPack | None) -> torch.Tensor:
        """Layer ``layer``'s additive masks for :meth:`_pack`: per document and KV head the P
        rows' (padding hidden) and the Q rows' (padding and evicted entries hidden)."""
        D = len(self.groups) // 2
        k = self.groups[0].kv[layer][0] if pack is None else pack.kv[layer][0]
        kv_heads, width = int(k.shape[1]), int(k.shape[2])
        lowest = torch.finfo(k.dtype).min
        out = k.new_full((D, kv_heads, 2, 1, width), lowest)
        for i in range(D):
            n = width if pack is None else pack.lengths[i]
            out[i, :, 0, :, :n] = 0
            hidden = self.groups[D + i].hidden
            out[i, :, 1, :, :n] = 0 if hidden is None else hidden[layer][0]
        return out.reshape(D, 2 * kv_heads, 1, width)

    @property
    def layers(self) -> int:
        return len(self.groups[0].kv)

    def width(self, layer: int) -> int:
        """The longest prefix of ``layer``."""
        return max(int(g.kv[layer][0].shape[-2]) for g in self.groups)


def _current() -> ForwardState | None:
    return getattr(_STATE, "forward", None)


def _captures() -> list[QueryCapture]:
    return list(getattr(_STATE, "captures", ()))


def _registered() -> bool:
    try:
        from transformers.masking_utils import AttentionMaskInterface  # noqa: F401
        from transformers.modeling_utils import AttentionInterface  # noqa: F401
    except ImportError:
        return False
    return True


def _register() -> None:
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    if _PREFIX + "sdpa" in ALL_ATTENTION_FUNCTIONS:
        return
    for base in ("sdpa", "eager"):
        AttentionInterface.register(_PREFIX + base, _make_wrapper(base))
        AttentionMaskInterface.register(_PREFIX + base, ALL_MASK_ATTENTION_FUNCTIONS[base])


def interface_available() -> bool:
    """Whether the installed transformers has the attention and mask interfaces."""
    return _registered()


def _eager_function(module: Any) -> Any:
    fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if fn is None:
        raise UnsupportedModelError(
            f"{type(module).__module__} has no eager_attention_forward for the tracer to score with"
        )
    return fn


def _make_wrapper(base: str) -> Any:
    def wrapper(
        module: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        state = _current()
        if base == "sdpa":
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

            inner = ALL_ATTENTION_FUNCTIONS["sdpa"]
        else:
            inner = _eager_function(module)
        if state is None:
            return inner(module, query, key, value, attention_mask, *args, **kwargs)
        if args:
            raise UnsupportedModelError(
                f"{type(module).__name__} passes positional arguments to its attention function"
            )
        layer = int(module.layer_idx)
        window = kwargs.get("sliding_window")
        if state.prefix is not None:
            _refuse_for_prefix(module, window, kwargs)
            state.prefix.served.add(layer)
            scaling = kwargs.get("scaling")
            scaling = float(scaling) if scaling is not None else float(query.shape[-1] ** -0.5)
            out = prefix_attention(query, key, value, attention_mask, scaling, state.prefix, layer)
            return out, None
        key_pos = None
        if state.key_positions is not None:
            key_pos = state.key_positions[layer][..., : key.shape[-2]]
        if window is not None:
            if key_pos is None:
                raise UnsupportedModelError(
                    f"layer {layer} has a {window}-token sliding window but the tracer does not "
                    "know the original positions of this cache's entries"
                )
            attention_mask = _with_window(
                attention_mask, state.query_positions, key_pos, int(window), query, base
            )
        for capture in _captures():
            capture.record(layer, module, query, key, value, kwargs, state.query_positions, key_pos)
        return inner(module, query, key, value, attention_mask, **kwargs)

    wrapper.__name__ = f"kvcouple_{base}_attention"
    return wrapper


# Keyword arguments of attention functions that change what a layer computes beyond plain
# scaled dot-product attention; a shared prefix refuses them rather than ignore them.
_PREFIX_UNSUPPORTED = ("softcap", "s_aux", "sinks")


def _refuse_for_prefix(module: Any, window: Any, kwargs: dict[str, Any]) -> None:
    name = type(module).__name__
    if window is not None:
        raise UnsupportedModelError(f"{name} has a sliding window: no shared-prefix attention")
    for key in _PREFIX_UNSUPPORTED:
        if kwargs.get(key) is not None:
            raise UnsupportedModelError(f"{name} passes {key}: no shared-prefix attention")
    if _captures():
        raise UnsupportedModelError("queries cannot be captured with shared-prefix attention")


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
        if q == 1 and m.shape[1] == 1:
            pass  # (B, 1, 1, s) broadcasts over (B, kv, group, s)
        elif m.shape[1] == 1:
            m = m.expand(B, 1, q, -1)[:, :, None].expand(B, 1, group, q, -1).reshape(B, 1, gq, -1)
        else:
            m = m.expand(B, -1, q, -1).reshape(B, kv_heads, gq, -1)
    own, own_lse = attend_lse(qg, key, value, m, scaling)  # (B, kv, gq, d), (B, kv, gq)
    if prefix.packed is not None:
        # One call for every group: rows are (side, document, row); per document its P and
        # Q rows are two query heads of each KV head (GQA over one prefix tensor, the rows
        # folded into the query axis): queries (D, 2 kv, n * gq, d).
        kp, vp, hidden = prefix.packed[layer]
        D = int(kp.shape[0])
        n = B // (2 * D)
        # (strides from the tensors' own: the kernels' outputs need not be contiguous)
        S = qg.stride()
        qp = qg.as_strided(
            (D, kv_heads, 2, n, gq, d), (n * S[0], S[1], D * n * S[0], S[0], S[2], S[3])
        ).reshape(D, 2 * kv_heads, n * gq, d)
        pre, pre_lse = attend_lse(qp, kp, vp, hidden, scaling)
        # Merged as (side, document, row, kv, gq, ...): the outputs strided views of the
        # kernel's (D, 2 kv, n * gq, ...), the own part's a view.
        six = (2, D, n, kv_heads, gq)
        o, s_ = pre.stride(), pre_lse.stride()
        pre = pre.as_strided((*six, pre.shape[-1]), (o[1], o[0], gq * o[2], 2 * o[1], o[2], o[3]))
        pre_lse = pre_lse.as_strided((*six, 1), (s_[1], s_[0], gq * s_[2], 2 * s_[1], s_[2], 1))
        weight = torch.sigmoid(pre_lse - own_lse.reshape(*six, 1))
        own6 = own.reshape(*six, own.shape[-1])
        if own6.dtype != weight.dtype:
            own6, pre = own6.to(weight.dtype), pre.to(weight.dtype)
        out = torch.lerp(own6, pre, weight)
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
    weight = torch.sigmoid(pre_lse - own_lse[..., None])
    if own.dtype != weight.dtype:
        own, pre = own.to(weight.dtype), pre.to(weight.dtype)
    return _heads_out(torch.lerp(own, pre, weight), B, heads, q, query.dtype)


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


def allowed_keys(
    query_positions: torch.Tensor, key_positions: torch.Tensor, window: int | None
) -> torch.Tensor:
    """Causal (and sliding-window) visibility by original position:
    ``(batch, kv_heads or 1, q, keys)`` bool."""
    q = query_positions[:, None, :, None]
    k = key_positions[:, :, None, :]
    ok = k <= q
    if window is not None:
        ok = ok & (k > q - window)  # transformers' sliding_window_overlay
    return ok


def _with_window(
    mask: torch.Tensor | None,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    window: int,
    query: torch.Tensor,
    base: str,
) -> torch.Tensor:
    """``mask`` further restricted to the window, per query head: ``(batch, heads, q, keys)``."""
    heads = query.shape[1]
    ok = allowed_keys(query_positions.to(key_positions.device), key_positions, window)
    if ok.shape[1] > 1:  # per KV head -> per query head (head h uses KV head h // group)
        ok = ok.repeat_interleave(heads // ok.shape[1], dim=1)
    keys = key_positions.shape[-1]
    if mask is None:
        if base == "sdpa":
            return ok.expand(-1, heads, -1, -1)
        zero = torch.zeros((), dtype=query.dtype, device=query.device)
        return torch.where(ok, zero, torch.finfo(query.dtype).min).expand(-1, heads, -1, -1)
    mask = mask[..., :keys]
    if mask.dtype == torch.bool:
        return (mask & ok).expand(-1, heads, -1, -1)
    return mask.masked_fill(~ok, torch.finfo(mask.dtype).min).expand(-1, heads, -1, -1)


@contextlib.contextmanager
def active(
    model: Any,
    query_positions: torch.Tensor,
    key_positions: list[torch.Tensor] | None,
    prefix: SharedPrefix | None = None,
) -> Iterator[ForwardState]:
    """Run the enclosed forward pass through the wrapper (where the model allows it). With a
    ``prefix`` every layer must attend through the wrapper (else the prefix would be silently
    ignored): :class:`UnsupportedModelError` otherwise."""
    outer = _current()
    state = ForwardState(query_positions, key_positions, prefix)
    switched = _switch(model)
    if prefix is not None:
        prefix.served.clear()
        if not _wrapped(model):
            raise UnsupportedModelError(
                f"{type(model).__name__}: its attention does not go through the tracer's "
                "wrapper, so it cannot attend to a shared prefix"
            )
    _STATE.forward = state
    try:
        yield state
    finally:
        _STATE.forward = outer
        if switched is not None:
            _set_impl(model, switched)
    if prefix is not None and len(prefix.served) != prefix.layers:
        raise UnsupportedModelError(
            f"{type(model).__name__}: only layers {sorted(prefix.served)} of {prefix.layers} "
            "attended through the tracer's wrapper; a shared prefix needs all of them"
        )


def _configured(model: Any) -> str:
    """The implementation the model's config names right now (the wrapper's, while a tracer
    forward pass runs)."""
    return str(getattr(model.config, "_attn_implementation", None) or "eager")


def _wrapped(model: Any) -> bool:
    return _configured(model).startswith(_PREFIX) and facts(model).attention_interface


def prefix_supported(model: Any) -> bool:
    """Whether shared-prefix attention can serve ``model`` exactly: its attention dispatches
    through the interface with ``sdpa`` or ``eager``, and no layer has a sliding window, a
    logit soft-cap or attention sinks."""
    f = facts(model)
    if f.attn_implementation not in ("sdpa", "eager") or not f.attention_interface:
        return False
    return _registered() and not f.windowed and f.softcap is None and not f.sinks


def _set_impl(model: Any, impl: str) -> None:
    model.config._attn_implementation = impl


def _switch(model: Any) -> str | None:
    """Point the model at the wrapper; returns the implementation to restore, or None."""
    impl = _configured(model)
    if impl.startswith(_PREFIX) or impl not in ("sdpa", "eager"):
        return None
    if not facts(model).attention_interface:
        return None
    if not _registered():
        return None
    _register()
    _set_impl(model, _PREFIX + impl)
    return impl


@dataclass
class _Call:
    module: Any
    query: torch.Tensor  # (batch, heads, q, head_dim)
    key: torch.Tensor  # (batch, kv_heads, keys, head_dim) as the layer attends with
    value: torch.Tensor
    kwargs: dict[str, Any]
    query_positions: torch.Tensor
    key_positions: torch.Tensor | None
    query_start: int = 0  # index of the first query kept (earlier ones were not captured)


def _detached(t: torch.Tensor) -> torch.Tensor:
    """``t`` without its autograd history (tracer passes run without grad, so usually ``t``
    itself: one op fewer per layer and tensor at every decoding step)."""
    return t.detach() if t.requires_grad else t


# Queries per chunk when attention is accumulated over a whole prompt (bounds the memory of
# the (heads, chunk, keys) attention probabilities).
ACCUMULATE_CHUNK = 256


class QueryCapture:
    """Records each layer's attention call during the forward passes it encloses.

    ``with capture: ...`` makes every tracer forward pass inside record into it. Then
    :meth:`attention` gives the layer's own attention probabilities, :meth:`queries` its
    queries (post-RoPE where the layer rotates them).
    """

    def __init__(self, model: Any, keep_queries: int | None = None, accumulate: bool = False):
        """``keep_queries``: keep only each layer's last ``keep_queries`` queries (None: all);
        ``accumulate``: sum each layer's attention over all its queries while recording (in
        chunks of :data:`ACCUMULATE_CHUNK`), for :meth:`accumulated_attention`."""
        f = facts(model)
        if not f.attention_interface or not _registered():
            raise UnsupportedModelError(
                f"{f.name}: its attention does not go "
                "through transformers' attention interface, so policies scored by attention "
                "(snapkv, h2o, tova) cannot see what it attends to"
            )
        self.impl = f.attn_implementation
        self.calls: dict[int, _Call] = {}
        self.keep_queries = keep_queries
        self.accumulate = accumulate
        self.accumulated: dict[int, torch.Tensor] = {}
        self._default_scaling = f.scaling

    def __enter__(self) -> QueryCapture:
        _STATE.captures = _captures() + [self]
        return self

    def __exit__(self, *exc: Any) -> None:
        _STATE.captures = [c for c in _captures() if c is not self]

    def record(
        self,
        layer: int,
        module: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kwargs: dict[str, Any],
        query_positions: torch.Tensor,
        key_positions: torch.Tensor | None,
    ) -> None:
        call = _Call(
            module,
            _detached(query),
            _detached(key),
            _detached(value),
            dict(kwargs),
            query_positions,
            key_positions,
        )
        if call.key_positions is None and key.shape[-2] == query.shape[2]:
            call.key_positions = query_positions[:, None, :]  # a fresh cache: at the queries
        self.calls[layer] = call
        if self.accumulate:
            self.accumulated[layer] = self._accumulate(layer, int(query.shape[2]))
        if self.keep_queries is not None:
            # Keep a copy of the last queries only, so that the whole tensor can be freed.
            start = max(0, int(query.shape[2]) - self.keep_queries)
            call.query = call.query[:, :, start:].clone()
            call.query_positions = call.query_positions[:, start:].clone()
            call.query_start = start

    def _accumulate(self, layer: int, length: int) -> torch.Tensor:
        """Attention each key received, summed over every query, chunk by chunk, in float32
        (the same sums as :meth:`kvcouple.policies.PolicyContext.accumulated_attention`)."""
        total = None
        for start in range(0, length, ACCUMULATE_CHUNK):
            part = self.attention(layer, start, min(start + ACCUMULATE_CHUNK, length)).sum(dim=1)
            total = part if total is None else total + part
        assert total is not None
        return total.to(torch.float32)

    def accumulated_attention(self, layer: int) -> torch.Tensor:
        """``(heads, keys)``: the attention each key received from every query of the
        recorded pass (needs ``accumulate=True``)."""
        if layer not in self.accumulated:
            raise UnsupportedModelError(f"layer {layer}'s accumulated attention was not recorded")
        return self.accumulated[layer]

    def _kept(self, call: _Call, start: int) -> int:
        if start < call.query_start:
            raise RuntimeError(
                f"query {start} was not captured (only the last {self.keep_queries} were kept)"
            )
        return start - call.query_start

    def _call(self, layer: int) -> _Call:
        if layer not in self.calls:
            raise UnsupportedModelError(
                f"layer {layer}'s attention was not seen by the tracer's attention wrapper"
            )
        return self.calls[layer]

    @torch.inference_mode()
    def queries(self, layer: int, start: int = 0) -> torch.Tensor:
        """Queries of positions ``start..`` of batch row 0: ``(heads, len, head_dim)``."""
        call = self._call(layer)
        return call.query[0, :, self._kept(call, start) :]

    @torch.inference_mode()
    def batch_queries(self, layer: int, start: int = 0, rows: slice | None = None) -> torch.Tensor:
        """Queries of the captured batch rows: ``(rows, heads, len, head_dim)``."""
        call = self._call(layer)
        return call.query[rows if rows is not None else slice(None), :, self._kept(call, start) :]

    @property
    def scaling(self) -> float:
        """The first layer's attention scale (known before any forward pass)."""
        if not self.calls:
            return self._default_scaling
        call = self._call(min(self.calls))
        s = call.kwargs.get("scaling")
        return float(s) if s is not None else float(call.query.shape[-1] ** -0.5)

    @torch.inference_mode()
    def attention(self, layer: int, start: int, stop: int) -> torch.Tensor:
        """Attention probabilities of batch row 0's queries ``start..stop-1`` onto every key,
        computed by the layer's own eager function in float32 (causal mask by position, the
        layer's window, soft-cap and sinks): ``(heads, stop - start, keys)``."""
        call = self._call(layer)
        first, last = self._kept(call, start), stop - call.query_start
        q = call.query[:1, :, first:last].float()
        k, v = call.key[:1].float(), call.value[:1].float()
        qpos = call.query_positions[:1, first:last].to(q.device)
        if call.key_positions is not None:
            kpos = call.key_positions[:1].to(q.device)
        else:
            kpos = call.query_positions[:1, None, :].to(q.device)
        ok = allowed_keys(qpos, kpos, call.kwargs.get("sliding_window"))
        heads = q.shape[1]
        if ok.shape[1] > 1:
            ok = ok.repeat_interleave(heads // ok.shape[1], dim=1)
        mask = torch.zeros(ok.shape, dtype=torch.float32, device=q.device)
        mask = mask.masked_fill(~ok, torch.finfo(torch.float32).min)
        kwargs = {k: v for k, v in call.kwargs.items() if k not in ("dropout", "is_causal")}
        module = call.module
        training = module.training
        module.training = False
        try:
            out = _eager_function(module)(module, q, k, v, mask, dropout=0.0, **kwargs)
        finally:
            module.training = training
        weights = out[1]
        if weights is None or weights.shape[-1] != k.shape[-2]:
            raise UnsupportedModelError(
                f"{type(module).__name__}'s eager attention returned no usable weights"
            )
        return weights[0].float()
