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
- **Shared prefixes.** With a :class:`~kvcouple.tracer.prefix.SharedPrefix` (the ``shared`` cache layout,
  :mod:`kvcouple.tracer.layout`) the cache holds only each row's own suffix; every row also
  attends to its group's prefix, held once for all the group's rows. Cascade attention
  (:func:`~kvcouple.tracer.prefix.prefix_attention`): each group's prefix is one fused attention call for all the
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
from dataclasses import dataclass
from typing import Any

import torch

from kvcouple.tracer.model import WRAPPER_PREFIX as _PREFIX
from kvcouple.tracer.model import UnsupportedModelError, facts
from kvcouple.tracer.model import uses_interface as uses_interface
from kvcouple.tracer.prefix import SharedPrefix, prefix_attention

__all__ = [
    "ForwardState",
    "QueryCapture",
    "UnsupportedModelError",
    "active",
    "allowed_keys",
    "interface_available",
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
