"""What a policy sees of one prompt's cache after prefill (:class:`PolicyContext`): per-layer
keys and values and, on demand, the prompt's queries and attention probabilities, and (for
policies that run another library's scorer on the layer itself, such as ``kvpress:``) what each
attention layer was called with (:class:`LayerInputs`, recorded by :class:`LayerInputCapture`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvcouple.policies.errors import PolicyError

if TYPE_CHECKING:
    import torch


@dataclass
class LayerInputs:
    """What one attention layer was called with while the prompt prefix was prefilled.

    Attributes
    ----------
    module : torch.nn.Module
        The model's attention module of that layer.
    hidden_states : torch.Tensor
        ``(1, length, hidden)``: the hidden states that entered it (after the layer's norm).
    kwargs : dict
        Its forward keyword arguments (``position_embeddings``, ``attention_mask``,
        ``cache_position``, ``past_key_values``, ...), ``hidden_states`` included.
    model : torch.nn.Module
        The whole model (for scorers that set themselves up from it).
    rotary_emb : torch.nn.Module or None
        The model's rotary embedding module, when it has one.
    """

    module: Any
    hidden_states: torch.Tensor
    kwargs: dict[str, Any]
    model: Any
    rotary_emb: Any = None


class LayerInputCapture:
    """Records, while entered, what every attention layer of ``model`` is called with (a
    forward pre-hook on each module with a ``layer_idx``; removed on exit). Batch row 0 only:
    the tracer prefills one prompt at a time. :meth:`get` gives a layer's :class:`LayerInputs`.

    Parameters
    ----------
    model : torch.nn.Module
        A transformers causal language model.
    """

    def __init__(self, model: Any):
        self.model = model
        self.inputs: dict[int, LayerInputs] = {}
        self._handles: list[Any] = []
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
        self.rotary_emb = getattr(decoder, "rotary_emb", None)

    def _hook(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        if hidden is None:
            return
        kw = dict(kwargs)
        kw["hidden_states"] = hidden[:1].detach()
        layer = int(module.layer_idx)
        self.inputs[layer] = LayerInputs(
            module, kw["hidden_states"], kw, self.model, self.rotary_emb
        )

    def __enter__(self) -> LayerInputCapture:
        for m in self.model.modules():
            # Attention modules: a layer index and an attention scale (decoder layers have no
            # scale).
            if hasattr(m, "layer_idx") and hasattr(m, "scaling"):
                self._handles.append(m.register_forward_pre_hook(self._hook, with_kwargs=True))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def get(self, layer: int) -> LayerInputs:
        """The recorded inputs of ``layer``."""
        if layer not in self.inputs:
            raise PolicyError(f"layer {layer}'s attention inputs were not recorded")
        return self.inputs[layer]


@dataclass
class PolicyContext:
    """What a policy sees of one prompt's cache (batch of one), per layer.

    ``keys[l]`` and ``values[l]``: ``(kv_heads, length, head_dim)``. ``query_fn(l, start)``
    returns the post-RoPE queries of prefix positions ``start..length-1`` of layer ``l`` as
    ``(query_heads, length - start, head_dim)``; ``scaling`` is the attention scale.
    ``attention_fn(l, start, stop)``, when given, returns the layer's own attention
    probabilities of prefix queries ``start..stop-1`` onto every prefix key,
    ``(query_heads, stop - start, length)`` (the tracer computes them with the layer's eager
    attention, so windows, soft-capping and sinks are included); without it attention is
    recomputed from ``query_fn``, ``keys`` and ``scaling`` as plain causal softmax attention.
    ``generator`` is a seeded CPU generator for randomised policies.

    Attributes
    ----------
    keys : list of torch.Tensor
        Per layer, ``(kv_heads, length, head_dim)`` cached keys.
    values : list of torch.Tensor
        Per layer, ``(kv_heads, length, head_dim)`` cached values.
    query_fn : callable or None
        ``query_fn(l, start)``: post-RoPE queries of prefix positions ``start..length-1``.
    scaling : float or None
        The attention scale (``None``: ``head_dim ** -0.5``).
    num_query_heads : int or None
        Number of query heads (``None``: as many as KV heads).
    generator : torch.Generator or None
        Seeded CPU generator for randomised policies.
    attention_fn : callable or None
        ``attention_fn(l, start, stop)``: the layer's own attention probabilities.
    accumulated_fn : callable or None
        ``accumulated_fn(l)``: the accumulated attention of layer ``l``, when the tracer
        computed it during prefill.
    layer_inputs_fn : callable or None
        ``layer_inputs_fn(l)``: what layer ``l``'s attention module was called with
        (:class:`LayerInputs`), when the tracer recorded it (policies with
        ``NEEDS_LAYER_INPUTS``).
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    query_fn: Callable[[int, int], torch.Tensor] | None = None
    scaling: float | None = None
    num_query_heads: int | None = None
    generator: torch.Generator | None = None
    attention_fn: Callable[[int, int, int], torch.Tensor] | None = None
    # The accumulated attention of layer l, when the tracer computed it during prefill.
    accumulated_fn: Callable[[int], torch.Tensor] | None = None
    layer_inputs_fn: Callable[[int], LayerInputs] | None = None
    _cache: dict[Any, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def num_kv_heads(self) -> int:
        return int(self.keys[0].shape[0])

    @property
    def length(self) -> int:
        return int(self.keys[0].shape[1])

    @property
    def group_size(self) -> int:
        heads = self.num_query_heads or self.num_kv_heads
        return heads // self.num_kv_heads

    def group_mean(self, scores: torch.Tensor) -> torch.Tensor:
        """Average ``(query_heads, ...)`` scores over each GQA group: ``(kv_heads, ...)``."""
        return scores.reshape(self.num_kv_heads, self.group_size, *scores.shape[1:]).mean(1)

    def _queries(self, layer: int, start: int) -> torch.Tensor:
        if self.query_fn is None:
            raise RuntimeError("this policy needs the prompt's queries, which were not captured")
        return self.query_fn(layer, start)

    def _attention(self, layer: int, start: int, stop: int) -> torch.Tensor:
        """Causal attention probabilities of prefix queries ``start..stop-1`` onto every key:
        ``(query_heads, stop - start, length)`` in float32."""
        import torch

        if self.attention_fn is not None:
            return self.attention_fn(layer, start, stop).float()
        q = self._queries(layer, start)[:, : stop - start].float()
        k = self.keys[layer].float().repeat_interleave(self.group_size, dim=0)
        scale = self.scaling if self.scaling is not None else q.shape[-1] ** -0.5
        logits = torch.matmul(q, k.transpose(-1, -2)) * scale
        query_pos = torch.arange(start, stop, device=q.device)[:, None]
        key_pos = torch.arange(self.length, device=q.device)[None, :]
        logits = logits.masked_fill(key_pos > query_pos, float("-inf"))
        return torch.softmax(logits, dim=-1)

    def layer_inputs(self, layer: int) -> LayerInputs:
        """What layer ``layer``'s attention module was called with during prefill."""
        if self.layer_inputs_fn is None:
            raise PolicyError(
                "this policy needs each attention layer's inputs (hidden states, module), which "
                "were not recorded (they are at prefill for policies with NEEDS_LAYER_INPUTS, "
                "not while decoding)"
            )
        return self.layer_inputs_fn(layer)

    def attention(self, layer: int) -> torch.Tensor:
        """Attention probabilities of every prefix query onto every prefix key, causal:
        ``(query_heads, length, length)`` in float32 (as :meth:`window_attention`)."""
        return self._attention(layer, 0, self.length)

    def window_attention(self, layer: int, window: int) -> torch.Tensor:
        """Attention of the last ``window`` prefix queries: ``(query_heads, window, length)``."""
        key = ("window", layer, window)
        if key not in self._cache:
            self._cache[key] = self._attention(layer, self.length - window, self.length)
        return self._cache[key]

    def accumulated_attention(self, layer: int, chunk: int = 256) -> torch.Tensor:
        """Attention each key received, summed over every prefix query: ``(query_heads, length)``
        (the H2O score). Computed in chunks of queries to bound memory."""
        import torch

        key = ("accumulated", layer)
        if key not in self._cache and self.accumulated_fn is not None:
            self._cache[key] = self.accumulated_fn(layer)
        if key not in self._cache:
            total = None
            for start in range(0, self.length, chunk):
                stop = min(start + chunk, self.length)
                part = self._attention(layer, start, stop).sum(dim=1)
                total = part if total is None else total + part
            assert total is not None
            self._cache[key] = total.to(torch.float32)
        return self._cache[key]
