"""Which models the tracer serves exactly, decided once, before the first document.

:func:`check_support` refuses, with one :class:`UnsupportedModelError` naming the
architecture and the reason, any model (and policy kind) the tracer cannot trace exactly:

- attention implementations that take no 4-D masks (flash-attention);
- multi-head latent attention (DeepSeek-V2/V3: the cache holds a compressed latent, not
  per-head keys and values to evict);
- layers that are not softmax attention over a KV cache (linear attention, convolution or
  state-space layers: there is nothing to evict there, and their state cannot be rolled back);
- chunked attention (Llama 4) and ALiBi position biases (built from a 2-D padding mask, so
  the tracer's 4-D masks break them);
- sliding-window layers on a model whose attention does not dispatch through transformers'
  attention interface (the window could not be applied per layer), or on old transformers;
- policies scored by attention (snapkv, h2o, tova) on such models too (nothing to score with);
- decode-time eviction (``mode=decode``) on models with sliding windows (entries move within
  the cache), and attention-scored decode-time eviction on models with attention
  soft-capping or sinks (its per-step scores are plain softmax attention).

Then a three-token probe runs the tracer's own forward passes (prefill, a re-fed token on an
evicted cache, and the attention capture when a policy needs it) and compares them with a
plain masked forward; any exception or (in float32) any difference refuses the model too.
The run layer (:func:`kvcouple.tracer.run.check_model`) then traces a short probe document
under every policy, so an unknown architecture fails before a store exists, never in the
middle of one.

Verdicts are kept in a side table owned by this module (keyed by the model, weakly).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvcouple.tracer import attention, compat
from kvcouple.tracer.model import ModelFacts, UnsupportedModelError, facts, refresh
from kvcouple.tracer.model import layer_windows as layer_windows
from kvcouple.tracer.model import text_config as text_config

__all__ = [
    "ModelSupport",
    "UnsupportedModelError",
    "check_support",
    "describe",
    "layer_windows",
    "text_config",
]

_ATTENTION_LAYERS = {"full_attention", "sliding_attention"}


@dataclass(frozen=True)
class ModelSupport:
    """What the tracer found about a model it accepts."""

    architecture: str
    sliding_windows: tuple[int, ...]  # the distinct windows of its sliding layers
    attention_scores: bool  # whether attention-scored policies can run
    scores_refusal: str  # why not, when they cannot


def _model_refusal(f: ModelFacts) -> str | None:
    """Why the tracer cannot serve this model at all (None when it can, pending the probe)."""
    cfg, impl = f.config, f.attn_implementation
    if impl not in ("sdpa", "eager"):
        return (
            f"attention implementation {impl!r} takes no 4-D attention masks; load the model "
            "with attn_implementation='sdpa' (or 'eager')"
        )
    if getattr(cfg, "is_encoder_decoder", False):
        return "encoder-decoder models are not causal LMs with one KV cache"
    if getattr(cfg, "kv_lora_rank", None):
        return (
            "multi-head latent attention: the cache holds a compressed latent shared by all "
            "heads, not per-head keys and values, and the tracer does not evict from it"
        )
    types = getattr(cfg, "layer_types", None) or []
    other = sorted({str(t) for t in types} - _ATTENTION_LAYERS)
    if other:
        return (
            f"layers of type {', '.join(other)} keep a recurrent or convolution state, not a "
            "KV cache of past tokens, so eviction is not meaningful there"
        )
    if getattr(cfg, "attention_chunk_size", None) or getattr(cfg, "use_chunked_attention", False):
        return "chunked attention is not emulated by the tracer's masks"
    if getattr(cfg, "alibi", False) or cfg.model_type in ("bloom", "mpt"):
        return (
            "ALiBi position biases are built from a 2-D padding mask, which the tracer's 4-D "
            "eviction masks replace"
        )
    if f.windowed:
        if not f.attention_interface:
            return (
                "sliding-window layers, but the attention does not dispatch through "
                "transformers' attention interface, so the tracer cannot apply the window per "
                "layer"
            )
        if not attention.interface_available():
            return "sliding-window layers need transformers >= 4.53 (its attention interfaces)"
    return None


def _scores_refusal(f: ModelFacts) -> str:
    if not f.attention_interface or not attention.interface_available():
        return (
            "its attention does not dispatch through transformers' attention interface, so "
            "policies scored by attention (snapkv, h2o, tova) cannot see what it attends to"
        )
    return ""


def _decode_refusal(f: ModelFacts, scored: bool) -> str:
    """Why decode-time eviction cannot run exactly on this model ("" when it can)."""
    if f.windowed:
        # Evicting while decoding moves entries within the cache, so their positions, which
        # the sliding-window masks are built from, are not tracked.
        return "sliding-window layers"
    if scored and f.softcap:
        return "attention soft-capping (its per-step scores are plain softmax attention)"
    if scored and f.sinks:
        return "attention sinks (its per-step scores are plain softmax attention)"
    return ""


# model -> {(attention implementation, scored, decode-time, specs): verdict}
_VERDICTS: weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], ModelSupport]] = (
    weakref.WeakKeyDictionary()
)


def _refuse_statically(f: ModelFacts, policies: Sequence[Any]) -> str:
    """Refuse what the config alone rules out; returns why scored policies cannot run."""
    why = _model_refusal(f)
    if why:
        raise UnsupportedModelError(f"{f.name}: the tracer cannot serve this model: {why}")
    scores_why = _scores_refusal(f)
    if scores_why and any(getattr(p, "NEEDS_QUERIES", False) for p in policies):
        raise UnsupportedModelError(f"{f.name}: {scores_why}")
    decoding = [p for p in policies if getattr(p, "decode_time", False)]
    if decoding:
        scored = any(getattr(p, "NEEDS_QUERIES", False) for p in decoding)
        decode_why = _decode_refusal(f, scored)
        if decode_why:
            raise UnsupportedModelError(
                f"{f.name}: decode-time eviction (mode=decode) is not exact with this model's "
                f"{decode_why}; use mode=prefill"
            )
    return scores_why


def check_support(model: Any, policies: Sequence[Any] = ()) -> ModelSupport:
    """Refuse (:class:`UnsupportedModelError`) a model or policy the tracer cannot serve
    exactly; return what it found otherwise. Kept per model and kind of policy."""
    needs_scores = any(getattr(p, "NEEDS_QUERIES", False) for p in policies)
    decode = any(getattr(p, "decode_time", False) for p in policies)
    specs = tuple(sorted(p.spec() for p in policies if hasattr(p, "spec")))
    f = facts(model)
    key = (f.attn_implementation, needs_scores, decode, specs)
    known = _VERDICTS.setdefault(model, {})
    if key in known:
        return known[key]
    f = refresh(model)  # a first check: the model as it is now
    scores_why = _refuse_statically(f, policies)
    _probe(model, f, needs_scores)
    windows = tuple(sorted({w for w in f.windows if w is not None}))
    known[key] = ModelSupport(f.model_type, windows, not scores_why, scores_why)
    return known[key]


def _probe(model: Any, f: ModelFacts, needs_scores: bool) -> None:
    """Three tokens through the tracer's forward passes, checked against a plain forward."""
    name, layers = f.name, f.layers
    device = next(model.parameters()).device
    vocab = int(getattr(f.config, "vocab_size", 2))
    ids = (torch.arange(4, device=device) + 1) % max(vocab, 1)
    try:
        with torch.inference_mode():
            cache = compat.new_cache()
            capture = attention.QueryCapture(model) if needs_scores else None
            positions = torch.arange(3, device=device)[None]
            if capture is not None:
                with capture:
                    compat.forward(model, ids[None, :3], cache, positions)
                for layer in range(layers):
                    capture.attention(layer, 0, 3)
            else:
                compat.forward(model, ids[None, :3], cache, positions)
            kv = compat.cache_tensors(cache)
            _check_layout(kv, layers, name)
            dtype = kv[0][0].dtype
            # Re-feed token 3 with entry 1 evicted (the tracer's Q row), as the engine does.
            valid = torch.tensor([[True, False, True, True]], device=device)
            got = compat.forward(
                model,
                ids[None, 3:],
                cache,
                torch.tensor([[3]], device=device),
                compat.additive_mask(valid, dtype),
            )
            allowed = torch.ones(4, 4, dtype=torch.bool, device=device).tril()
            allowed[3, 1] = False
            mask = torch.zeros(4, 4, dtype=dtype, device=device)
            mask = mask.masked_fill(~allowed, torch.finfo(dtype).min)[None, None]
            want = model(
                input_ids=ids[None],
                attention_mask=mask,
                position_ids=torch.arange(4, device=device)[None],
            ).logits[:, -1]
    except UnsupportedModelError as e:
        raise UnsupportedModelError(f"{name}: {e}") from None
    except Exception as e:  # an unknown architecture: refuse before any document
        raise UnsupportedModelError(
            f"{name}: the tracer's probe forward failed ({type(e).__name__}: {e}); this "
            "architecture is not supported"
        ) from None
    windows = [w for w in f.windows if w is not None]
    if windows and min(windows) < 4:
        return  # the plain reference would need the window per layer
    if dtype == torch.float32 and not torch.allclose(got.float(), want.float(), atol=1e-4):
        diff = float((got.float() - want.float()).abs().max())
        raise UnsupportedModelError(
            f"{name}: the tracer's cached, masked forward differs from a plain masked forward "
            f"(max logit difference {diff:.2e}); this architecture is not supported"
        )


def _check_layout(kv: list[tuple[Any, Any]], layers: int, name: str) -> None:
    if len(kv) != layers:
        raise UnsupportedModelError(
            f"{name}: the cache has {len(kv)} layers of keys and values for {layers} layers"
        )
    for layer, (k, v) in enumerate(kv):
        if k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3] or k.shape[2] != 3:
            raise UnsupportedModelError(
                f"{name}: layer {layer}'s cache is not (batch, kv_heads, tokens, dim) keys and "
                f"values per token (keys {tuple(k.shape)}, values {tuple(v.shape)})"
            )


def describe(model: Any) -> str:
    """One line on how the tracer serves this model (for logs and the CLI)."""
    s = check_support(model)
    parts = [s.architecture]
    if s.sliding_windows:
        parts.append(f"sliding windows {', '.join(map(str, s.sliding_windows))} (exact)")
    if not s.attention_scores:
        parts.append("attention-scored policies refused: " + s.scores_refusal)
    return "; ".join(parts)
