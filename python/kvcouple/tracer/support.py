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
plain masked forward; any exception, a difference beyond rounding, or a model whose output
does not change when an entry is masked refuses the model too. Rounding is measured, not
assumed: the same re-fed token without eviction, cached against plain, gives this model's
noise in its dtype (:class:`ProbeMeasure`; docs/tracer.md has the figures).
The run layer (:func:`kvcouple.tracer.batches.check_model`) then traces a short probe document
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
from kvcouple.tracer.kvcache import cache_tensors, new_cache
from kvcouple.tracer.model import ModelFacts, UnsupportedModelError, facts, refresh

__all__ = [
    "ModelSupport",
    "ProbeMeasure",
    "UnsupportedModelError",
    "check_support",
    "describe",
]

_ATTENTION_LAYERS = {"full_attention", "sliding_attention"}


@dataclass(frozen=True)
class ModelSupport:
    """What the tracer found about a model it accepts."""

    architecture: str
    sliding_windows: tuple[int, ...]  # the distinct windows of its sliding layers
    attention_scores: bool  # whether attention-scored policies can run
    scores_refusal: str  # why not, when they cannot
    probe: ProbeMeasure | None = None  # the probe's figures (None: not comparable, windows < 4)


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
    if scores_why and any(getattr(p, "NEEDS_ATTENTION", False) for p in policies):
        raise UnsupportedModelError(f"{f.name}: {scores_why}")
    decoding = [p for p in policies if getattr(p, "decode_time", False)]
    if decoding:
        scored = any(getattr(p, "NEEDS_ATTENTION", False) for p in decoding)
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
    needs_scores = any(getattr(p, "NEEDS_ATTENTION", False) for p in policies)
    decode = any(getattr(p, "decode_time", False) for p in policies)
    specs = tuple(sorted(p.spec() for p in policies if hasattr(p, "spec")))
    f = facts(model)
    key = (f.attn_implementation, needs_scores, decode, specs)
    known = _VERDICTS.setdefault(model, {})
    if key in known:
        return known[key]
    f = refresh(model)  # a first check: the model as it is now
    scores_why = _refuse_statically(f, policies)
    measure = _probe(model, f, needs_scores)
    windows = tuple(sorted({w for w in f.windows if w is not None}))
    known[key] = ModelSupport(f.model_type, windows, not scores_why, scores_why, measure)
    return known[key]


# The probe's tolerance (docs/tracer.md, "How exact is exact"), on the total variation between
# next-token distributions, the quantity the tracer records: a difference is rounding when it
# is within NOISE_FACTOR times the noise measured on the same model, dtype and thread count
# (the same re-fed token without an eviction, cached against plain), or within sqrt(eps) of
# the dtype (3.5e-4 in float32, 0.031 in float16, 0.088 in bfloat16), whichever is larger.
# The noise itself must be within sqrt(eps): a tracer bug that touches both rows must not
# widen its own tolerance.
NOISE_FACTOR = 8.0


def _tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(0.5 * (a.double().softmax(-1) - b.double().softmax(-1)).abs().sum())


@dataclass(frozen=True)
class ProbeMeasure:
    """The probe's figures: total variations between next-token distributions, and the
    largest logit difference beside them."""

    difference: float  # the tracer's evicted row against a plain forward through the same mask
    noise: float  # the same without eviction: cached against plain, pure rounding
    effect: float  # what the eviction changes: plain masked against plain unmasked
    tolerance: float
    logit_difference: float  # max |logit| difference of the evicted rows
    scale: float  # the largest |logit|

    @classmethod
    def of(cls, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> ProbeMeasure:
        """From ``(2, vocab)`` logits computed in ``dtype``: row 0 with entry 0 evicted, row 1
        with nothing evicted (``got`` through the tracer's cached forward, ``want`` through a
        plain forward)."""
        noise = _tv(got[1], want[1])
        tolerance = max(NOISE_FACTOR * noise, torch.finfo(dtype).eps ** 0.5)
        return cls(
            difference=_tv(got[0], want[0]),
            noise=noise,
            effect=_tv(want[0], want[1]),
            tolerance=tolerance,
            logit_difference=float((got[0].double() - want[0].double()).abs().max()),
            scale=float(want.double().abs().max()),
        )


def _probe(model: Any, f: ModelFacts, needs_scores: bool) -> ProbeMeasure | None:
    """Three tokens through the tracer's forward passes, checked against a plain forward: two
    rows, one re-feeding token 3 with entry 0 evicted (the tracer's Q row; the first entry,
    an attention sink in trained models, so the mask visibly acts), one with nothing evicted
    (the rounding noise of this model, dtype and thread count)."""
    name, layers = f.name, f.layers
    device = next(model.parameters()).device
    vocab = int(getattr(f.config, "vocab_size", 2))
    # Ordinary tokens spread over the vocabulary (low ids are often special tokens).
    ids = ((torch.arange(4, device=device) * 7919 + 101) % max(vocab, 1))[None].expand(2, 4)
    try:
        with torch.inference_mode():
            cache = new_cache()
            capture = attention.QueryCapture(model) if needs_scores else None
            positions = torch.arange(3, device=device)[None].expand(2, 3)
            if capture is not None:
                with capture:
                    compat.forward(model, ids[:, :3], cache, positions)
                for layer in range(layers):
                    capture.attention(layer, 0, 3)
            else:
                compat.forward(model, ids[:, :3], cache, positions)
            kv = cache_tensors(cache)
            _check_layout(kv, layers, name)
            dtype = kv[0][0].dtype
            valid = torch.ones(2, 4, dtype=torch.bool, device=device)
            valid[0, 0] = False
            got = compat.forward(
                model,
                ids[:, 3:],
                cache,
                torch.full((2, 1), 3, device=device),
                compat.additive_mask(valid, dtype),
            )
            allowed = torch.ones(2, 4, 4, dtype=torch.bool, device=device).tril()
            allowed[0, 3, 0] = False
            mask = torch.zeros(2, 4, 4, dtype=dtype, device=device)
            mask = mask.masked_fill(~allowed, torch.finfo(dtype).min)[:, None]
            want = model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=torch.arange(4, device=device)[None].expand(2, 4),
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
        return None  # the plain reference would need the window per layer
    m = ProbeMeasure.of(got, want, dtype)
    dt = str(dtype).removeprefix("torch.")
    floor = torch.finfo(dtype).eps ** 0.5
    if not m.noise <= floor:  # beyond rounding already without eviction: not noise to trust
        raise UnsupportedModelError(
            f"{name}: the tracer's cached forward differs from a plain forward in {dt} even "
            f"with nothing evicted: total variation {m.noise:.3g} between their next-token "
            f"distributions, beyond rounding (sqrt(eps) of {dt}: {floor:.3g}); this "
            "architecture is not supported"
        )
    if not m.difference <= m.tolerance:  # NaN is a mismatch too
        raise UnsupportedModelError(
            f"{name}: the tracer's cached, masked forward differs from a plain masked forward "
            f"in {dt}: total variation {m.difference:.3g} between their next-token "
            f"distributions (max logit difference {m.logit_difference:.3g} at logits up to "
            f"{m.scale:.3g}), tolerance {m.tolerance:.3g} (the larger of {NOISE_FACTOR:g} x the "
            f"rounding noise {m.noise:.3g} measured without eviction and sqrt(eps) of {dt}); "
            "this architecture is not supported"
        )
    if not m.effect > m.tolerance:
        raise UnsupportedModelError(
            f"{name}: masking a cache entry does not change the model's next-token distribution "
            f"in {dt} (total variation {m.effect:.3g}, tolerance {m.tolerance:.3g}): the model "
            "ignores its attention mask, so evictions would not take effect; this architecture "
            "is not supported"
        )
    return m


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
