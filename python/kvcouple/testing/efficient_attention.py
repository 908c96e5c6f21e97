"""A CPU stand-in for CUDA's memory-efficient attention kernel
(``aten._scaled_dot_product_efficient_attention``), with the contract the tracer relies on,
checked as strictly as the kernel checks it: as many query heads as KV heads, an additive
bias of the query's dtype expanded to the full ``(B, H, L, S)`` score shape with its
last-dimension stride 1 and its other strides multiples of 16 elements, and a log-sum-exp
padded to a multiple of 32 queries (the padding NaN here, so that a caller that reads it
fails). Registered as one custom op (``kvcouple_testing::efficient_attention``), so that an
op counter sees one op per call, as it would see the kernel on CUDA.

Tests run :func:`kvcouple.tracer.lse_attention.efficient_lse` through it off CUDA; on CUDA the
real kernel is checked at first use (:func:`kvcouple.tracer.lse_attention.fused_path`).
"""

from __future__ import annotations

import math

import torch

__all__ = ["efficient_attention"]


@torch.library.custom_op("kvcouple_testing::efficient_attention", mutates_args=())
def _efficient_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    B, H, L, d = query.shape
    S = key.shape[2]
    if key.shape[1] != H or value.shape[1] != H:
        raise RuntimeError(f"query heads {H} != key heads {key.shape[1]} (no GQA in this kernel)")
    if key.shape[0] != B or value.shape[0] != B:
        raise RuntimeError(f"query batch {B} != key batch {key.shape[0]} (expand it: stride 0)")
    if bias is not None:
        if bias.dtype != query.dtype:
            raise RuntimeError(f"bias dtype {bias.dtype} != query dtype {query.dtype}")
        if tuple(bias.shape) != (B, H, L, S):
            raise RuntimeError(f"bias shape {tuple(bias.shape)} is not {(B, H, L, S)}")
        if bias.stride(-1) != 1 or any(st % 16 for st in bias.stride()[:-1]):
            raise RuntimeError(f"bias strides {bias.stride()} are not 16-element aligned")
    scores = torch.einsum("bhld,bhsd->bhls", query.double(), key.double()) * scale
    if bias is not None:
        scores = scores + bias.double()
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("bhls,bhsd->bhld", torch.softmax(scores, -1), value.double())
    padded = torch.full((B, H, math.ceil(L / 32) * 32), math.nan, dtype=torch.float32)
    padded[..., :L] = lse.float()
    # the kernel's output layout: (B, L, H, d) in memory
    out = out.to(query.dtype).transpose(1, 2).contiguous().transpose(1, 2)
    return out, padded


@_efficient_attention.register_fake
def _(query, key, value, bias, scale):  # type: ignore[no-untyped-def]
    B, H, L, d = query.shape
    out = query.new_empty((B, L, H, value.shape[-1])).transpose(1, 2)
    return out, query.new_empty((B, H, math.ceil(L / 32) * 32), dtype=torch.float32)


def efficient_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_bias: torch.Tensor | None,
    compute_log_sumexp: bool,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's signature and outputs (output, log-sum-exp, philox seed and offset)."""
    if not compute_log_sumexp or dropout_p or is_causal:
        raise RuntimeError("the stand-in covers compute_log_sumexp=True, no dropout, not causal")
    s = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    out, lse = _efficient_attention(query, key, value, attn_bias, s)
    return out, lse, _NO_SEED, _NO_SEED


_NO_SEED = torch.zeros((), dtype=torch.long)  # (no dropout: the philox state is unused)
