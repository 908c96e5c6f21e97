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
plain masked forward; any exception or (in float32) any difference refuses the model too, so
an unknown architecture fails here, never in the middle of a store.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvcouple.tracer import attention
from kvcouple.tracer.attention import UnsupportedModelError

__all__ = ["ModelSupport", "UnsupportedModelError", "check_support", "describe"]

_ATTENTION_LAYERS = {"full_attention", "sliding_attention"}


@dataclass(frozen=True)
class ModelSupport:
    """What the tracer found about a model it accepts."""

    architecture: str
    sliding_windows: tuple[int, ...]  # the distinct windows of its sliding layers
    attention_scores: bool  # whether attention-scored policies can run
    scores_refusal: str  # why not, when they cannot


def text_config(model: Any) -> Any:
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def _name(model: Any) -> str:
    return f"{type(model).__name__} ({getattr(text_config(model), 'model_type', '?')})"


def layer_windows(cfg: Any) -> list[int | None]:
    """Each layer's sliding window as the model's config declares it (None: full attention)."""
    n = int(cfg.num_hidden_layers)
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if types is not None:
        return [window if t == "sliding_attention" else None for t in types]
    if window and getattr(cfg, "use_sliding_window", True):
        return [int(window)] * n
    return [None] * n


def _model_refusal(model: Any) -> str | None:
    """Why the tracer cannot serve this model at all (None when it can, pending the probe)."""
    cfg = text_config(model)
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
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
    if any(w is not None for w in layer_windows(cfg)):
        if not attention.uses_interface(model):
            return (
                "sliding-window layers, but the attention does not dispatch through "
                "transformers' attention interface, so the tracer cannot apply the window per "
                "layer"
            )
        if not attention.interface_available():
            return "sliding-window layers need transformers >= 4.53 (its attention interfaces)"
    return None


def _scores_refusal(model: Any) -> str:
    if not attention.uses_interface(model) or not attention.interface_available():
        return (
            "its attention does not dispatch through transformers' attention interface, so "
            "policies scored by attention (snapkv, h2o, tova) cannot see what it attends to"
        )
    return ""


def _decode_refusal(model: Any, scored: bool) -> str:
    """Why decode-time eviction cannot run exactly on this model ("" when it can)."""
    cfg = text_config(model)
    if any(w is not None for w in layer_windows(cfg)):
        # Evicting while decoding moves entries within the cache, so their positions, which
        # the sliding-window masks are built from, are not tracked.
        return "sliding-window layers"
    if scored and getattr(cfg, "attn_logit_softcapping", None):
        return "attention soft-capping (its per-step scores are plain softmax attention)"
    if scored and any(name.endswith("sinks") for name, _ in model.named_parameters()):
        return "attention sinks (its per-step scores are plain softmax attention)"
    return ""


def check_support(model: Any, policies: Sequence[Any] = ()) -> ModelSupport:
    """Refuse (:class:`UnsupportedModelError`) a model or policy the tracer cannot serve
    exactly; return what it found otherwise. Cached on the model per kind of policy."""
    needs_scores = any(getattr(p, "NEEDS_QUERIES", False) for p in policies)
    decode = any(getattr(p, "decode_time", False) for p in policies)
    impl = getattr(model.config, "_attn_implementation", None)
    specs = tuple(sorted(p.spec() for p in policies if hasattr(p, "spec")))
    key = (impl, needs_scores, decode, specs)
    cached = getattr(model, "_kvcouple_support", {})
    if key in cached:
        return cached[key]
    if getattr(model, "_kvcouple_probing", False):  # the probe's own trace
        return _PROBING
    name = _name(model)
    why = _model_refusal(model)
    if why:
        raise UnsupportedModelError(f"{name}: the tracer cannot serve this model: {why}")
    scores_why = _scores_refusal(model)
    if needs_scores and scores_why:
        raise UnsupportedModelError(f"{name}: {scores_why}")
    if decode:
        scored = any(
            getattr(p, "decode_time", False) and getattr(p, "NEEDS_QUERIES", False)
            for p in policies
        )
        decode_why = _decode_refusal(model, scored)
        if decode_why:
            raise UnsupportedModelError(
                f"{name}: decode-time eviction (mode=decode) is not exact with this model's "
                f"{decode_why}; use mode=prefill"
            )
    _probe(model, name, needs_scores)
    _probe_engine(model, name, [p for p in policies if hasattr(p, "spec")])
    windows = tuple(sorted({w for w in layer_windows(text_config(model)) if w is not None}))
    result = ModelSupport(
        str(getattr(text_config(model), "model_type", "")), windows, not scores_why, scores_why
    )
    try:
        model._kvcouple_support = {**cached, key: result}
    except AttributeError:  # pragma: no cover - exotic wrappers
        pass
    return result


def _probe(model: Any, name: str, needs_scores: bool) -> None:
    """Three tokens through the tracer's forward passes, checked against a plain forward."""
    import torch

    from kvcouple.tracer import compat

    cfg = text_config(model)
    device = next(model.parameters()).device
    vocab = int(getattr(cfg, "vocab_size", 2))
    ids = (torch.arange(4, device=device) + 1) % max(vocab, 1)
    layers = int(cfg.num_hidden_layers)
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
    windows = [w for w in layer_windows(cfg) if w is not None]
    if windows and min(windows) < 4:
        return  # the plain reference would need the window per layer
    if dtype == torch.float32 and not torch.allclose(got.float(), want.float(), atol=1e-4):
        diff = float((got.float() - want.float()).abs().max())
        raise UnsupportedModelError(
            f"{name}: the tracer's cached, masked forward differs from a plain masked forward "
            f"(max logit difference {diff:.2e}); this architecture is not supported"
        )


_PROBING = ModelSupport("", (), True, "")


def _probe_engine(model: Any, name: str, policies: list[Any]) -> None:
    """Every given policy once through the real tracer (prefill, selection, overlap path and a
    branch) on a short prompt, plus an evicting one: whatever would fail mid-store fails here."""
    import torch

    from kvcouple.policies import parse_policy
    from kvcouple.tracer.engine import TraceSettings
    from kvcouple.tracer.run import trace_document

    cfg = text_config(model)
    vocab = int(getattr(cfg, "vocab_size", 2))
    prompt = [(3 * i + 1) % max(vocab, 1) for i in range(8)]
    probes = [parse_policy("recent:budget=3"), *policies]
    settings = TraceSettings(horizon=2, replicates=1, branches=1, window=1, eos_token_ids=())
    model._kvcouple_probing = True
    try:
        with torch.inference_mode():
            for policy in probes:  # one at a time: a failure names its policy
                try:
                    trace_document(model, prompt, [policy], settings)
                except UnsupportedModelError as e:
                    raise UnsupportedModelError(f"{name}: {policy.spec()}: {e}") from None
                except Exception as e:
                    raise UnsupportedModelError(
                        f"{name}: the tracer's probe run of {policy.spec()} failed "
                        f"({type(e).__name__}: {e}); this architecture is not supported"
                    ) from None
    finally:
        model._kvcouple_probing = False


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
