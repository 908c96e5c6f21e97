"""Softmax attention that also returns its log-sum-exp (cascade attention merges two such
calls exactly, :func:`kvcouple.tracer.prefix.prefix_attention`), on each device's fastest
path that gives the same numbers:

- **CPU**: PyTorch's flash attention for CPU (``_scaled_dot_product_flash_attention_for_cpu``):
  GQA and a mask per query head taken directly, the log-sum-exp returned, no score tensor.
- **CUDA**: the memory-efficient kernel (``_scaled_dot_product_efficient_attention`` with
  ``compute_log_sumexp``): an additive bias of any broadcast, the log-sum-exp returned
  (padded to 32 queries). It takes as many query heads as KV heads, so grouped query heads
  are one call each (a view of the queries, no copy of the keys); its bias must be expanded
  to the full score shape with 16-element-aligned rows (as SDPA itself does before calling
  it). It is used only after a **self-check** on this device, dtype and head size
  (:func:`fused_path`):
  the kernel against the matrix path on a small problem with every feature the tracer uses
  (grouped heads, a mask per query head, a misaligned key count); a kernel that raises or
  disagrees is not used, with one warning, and the matrix path runs instead.
- **elsewhere** (or ``fused=False``): matrix products and a softmax by hand, 19 ATen ops.

``KVCOUPLE_ATTENTION=matrix`` in the environment when kvcouple is imported forces the matrix
path everywhere (a user's escape hatch, and how a GPU run measures what the fused kernel
buys).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["attend_lse", "attend_lse_matrix", "efficient_lse", "fused_path", "sides_batched"]

# Fused-path decisions by (device, dtype, head size): "cpu-flash", "cuda-efficient" or "matrix".
_DECIDED: dict[tuple[torch.device, torch.dtype, int], str] = {}
# Whether the kernel takes a packed call's sides as its batch (sides_batched), by the same key.
_SIDES: dict[tuple[torch.device, torch.dtype, int], bool] = {}
# The memory-efficient kernel's bias rows must start 16-element aligned (SDPA pads to this);
# masks made once per batch are stored so (:mod:`kvcouple.tracer.prefix`).
MASK_ALIGNMENT = 16
_EFFICIENT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Read once at import (a compiled step does not read the environment).
FORCE_MATRIX = os.environ.get("KVCOUPLE_ATTENTION", "").strip().lower() == "matrix"


def _efficient_kernel() -> Callable[..., Any]:
    return torch.ops.aten._scaled_dot_product_efficient_attention  # type: ignore[no-any-return]


def attend_lse(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    fused: bool | None = None,
    padded_lse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of ``query`` ``(B, h, L, d)`` over ``key``/``value`` ``(B, kv, S,
    d)`` (``h`` a multiple of ``kv``: query heads ``g * h / kv ...`` share KV head ``g``;
    ``S >= 1``; ``mask``: additive, broadcastable to ``(B, h, L, S)``, never hiding every
    key of a query) and its log-sum-exp: ``(B, h, L, d)`` in the query's dtype and ``(B, h,
    L)`` in float32 (float64 for float64 inputs). ``fused``: None, the device's fused kernel
    where it passed its self-check (see the module); False, the matrix path; True, the
    device's fused kernel without the check (tests). ``padded_lse``: the log-sum-exp may be
    ``(B, h, L')`` with ``L' >= L``, its first ``L`` entries the values (a caller that reads
    it through a strided view of its own saves the slice)."""
    path = fused_path(query.device, query.dtype, int(query.shape[-1])) if fused is None else None
    if fused is True:
        path = "cpu-flash" if query.device.type == "cpu" else "cuda-efficient"
    if query.shape[-1] != value.shape[-1]:
        path = "matrix"  # both kernels want one head size for keys and values
    if path == "cpu-flash":
        if mask is not None and mask.dtype != query.dtype:
            mask = mask.to(query.dtype)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, False, attn_mask=mask, scale=scaling
        )
        return out, lse
    if path == "cuda-efficient":
        return efficient_lse(query, key, value, mask, scaling, padded_lse=padded_lse)
    return attend_lse_matrix(query, key, value, mask, scaling)


def fused_path(device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """The path :func:`attend_lse` takes on ``device`` for ``dtype``: ``"cpu-flash"``,
    ``"cuda-efficient"`` (once its self-check passed here) or ``"matrix"``. Decided once
    per device, dtype and head size (the kernel has a variant per head size), eagerly (inside a compiled region an undecided device takes the
    matrix path: the check runs kernels, which is not for tracing)."""
    if FORCE_MATRIX:
        return "matrix"
    if device.type == "cpu":
        return "cpu-flash"
    if device.type != "cuda" or dtype not in _EFFICIENT_DTYPES:
        return "matrix"
    key = (device, dtype, head_dim)
    path = _DECIDED.get(key)
    if path is None:
        if torch.compiler.is_compiling():
            return "matrix"
        path = _DECIDED[key] = _self_check(device, dtype, head_dim)
    return path


def sides_batched(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether a packed prefix call takes its two sides (P and Q rows) as the kernel's batch,
    the prompts' keys and values broadcast over it with stride 0 and the documents' KV heads
    as its heads (one call for every document, no stacks:
    :func:`kvcouple.tracer.prefix.prefix_attention`): on CUDA's memory-efficient
    path, once the kernel has matched the matrix path in that form here
    (:func:`_sides_check`; else the per-head calls, the same kernel). Decided eagerly, as
    :func:`fused_path`."""
    if fused_path(device, dtype, head_dim) != "cuda-efficient":
        return False
    key = (device, dtype, head_dim)
    ok = _SIDES.get(key)
    if ok is None:
        if torch.compiler.is_compiling():
            return False
        ok = _SIDES[key] = _sides_check(device, dtype, head_dim)
    return ok


def _sides_check(
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int = 64,
    kernel: Callable[..., Any] | None = None,
) -> bool:
    """The kernel (``kernel``: a stand-in, for tests) through :func:`efficient_lse` in the
    sides form: queries ``(2, kv, L, d)``, one prompt's keys broadcast over the batch (stride
    0), a bias per side and KV head stored as the packed masks are (sides interleaved within
    16-element-aligned rows), against the matrix path on copies."""
    g = torch.Generator(device="cpu").manual_seed(1)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    kv, L, S, d = 2, 5, 37, head_dim

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    query, key, value = rand(2, kv, L, d), rand(1, kv, S, d), rand(1, kv, S, d)
    hidden = torch.rand(kv, 2, 1, S, generator=g) < 0.3
    hidden[..., -1] = False  # every query sees a key
    stored = torch.zeros(kv, 2, 1, S + (-S % MASK_ALIGNMENT), dtype=dtype)
    stored[..., :S].masked_fill_(hidden, torch.finfo(dtype).min)
    bias = stored.to(device)[..., :S].transpose(0, 1)  # (2, kv, 1, S), as the packs store it
    try:
        out, lse = efficient_lse(query, key, value, bias, 0.125, kernel)
        want, want_lse = attend_lse_matrix(
            query,
            key.expand(2, -1, -1, -1).contiguous(),
            value.expand(2, -1, -1, -1).contiguous(),
            bias.contiguous(),
            0.125,
        )
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception:  # any failure: the per-head form, which passed its own check, is used
        return False
    out_err = float((out.float() - want.float()).abs().max())
    lse_err = float((lse.float() - want_lse.float()).abs().max())
    return bool(out_err <= tol and lse_err <= tol)


def _self_check(
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int = 64,
    kernel: Callable[..., Any] | None = None,
) -> str:
    """``"cuda-efficient"`` if the memory-efficient kernel (``kernel``: a stand-in, for tests),
    through :func:`efficient_lse`, matches the matrix path here on the two forms the tracer
    calls it in: grouped heads with a mask per query head over a misaligned key count (the
    packed prefix call: the bias padded), and one query head per KV head with one mask row
    broadcast over rows and heads (the own columns: the bias taken as it is); else
    ``"matrix"``, with a warning naming why."""
    g = torch.Generator(device="cpu").manual_seed(0)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    reason = ""
    for B, kv, group, L, S, mask_heads, mask_rows in (
        (2, 2, 2, 3, 37, 4, 2),
        (3, 2, 1, 4, 64, 1, 1),
    ):
        d = head_dim

        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

        query, key, value = rand(B, kv * group, L, d), rand(B, kv, S, d), rand(B, kv, S, d)
        hidden = torch.rand(mask_rows, mask_heads, 1, S, generator=g) < 0.3
        hidden[..., -1] = False  # every query sees a key
        lowest = torch.finfo(dtype).min
        mask = torch.zeros(hidden.shape, dtype=dtype).masked_fill(hidden, lowest).to(device)
        try:
            out, lse = efficient_lse(query, key, value, mask, 0.125, kernel)
            want, want_lse = attend_lse_matrix(query, key, value, mask, 0.125)
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # a kernel's asynchronous error surfaces here
        except Exception as e:  # any failure of an unchecked kernel: do not use it
            reason = f"{type(e).__name__}: {e}"
            break
        out_err = float((out.float() - want.float()).abs().max())
        lse_err = float((lse.float() - want_lse.float()).abs().max())
        if not (out_err <= tol and lse_err <= tol):  # (NaN fails too)
            reason = (
                f"it differs from the matrix path by {out_err:.3g} (output), {lse_err:.3g} (lse)"
            )
            break
    if not reason:
        return "cuda-efficient"
    warnings.warn(
        f"kvcouple: the memory-efficient attention kernel failed its check on {device} "
        f"({dtype}, head size {head_dim}): {reason}; shared-prefix attention uses matrix products instead",
        RuntimeWarning,
        stacklevel=3,
    )
    return "matrix"


def efficient_lse(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    kernel: Callable[..., Any] | None = None,
    padded_lse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attend_lse` by the memory-efficient kernel (``kernel``: its stand-in, for tests
    off CUDA): one call per query head of each KV head, the bias aligned and expanded as the
    kernel requires, the log-sum-exp's padding cut (kept with ``padded_lse``)."""
    kernel = _efficient_kernel() if kernel is None else kernel
    B, h, L, d = query.shape
    kv_heads, S = int(key.shape[1]), int(key.shape[2])
    if key.shape[0] != B:  # one prompt for every query batch: broadcast, stride 0 (no copy)
        key, value = key.expand(B, -1, -1, -1), value.expand(B, -1, -1, -1)
    group = h // kv_heads
    bias = None
    if mask is not None:
        bias = mask if mask.dtype == query.dtype else mask.to(query.dtype)
        if bias.dim() < 4:
            bias = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))
        if any(st % MASK_ALIGNMENT for st, n in zip(bias.stride()[:-1], bias.shape[:-1]) if n > 1):
            # a fresh tensor with rows padded to the alignment, viewed back to S columns
            pad = -S % MASK_ALIGNMENT
            bias = torch.nn.functional.pad(bias, (0, pad))[..., :S]
        if group > 1 and bias.shape[1] == h:
            bias = bias.unflatten(1, (kv_heads, group))
    if group == 1:
        out, lse = _efficient_call(kernel, query, key, value, bias, (B, h, L, S), scaling)
        return out, lse if padded_lse else lse[..., :L]
    # query head j of every KV head: strided views of the queries (and of a bias per head)
    queries = query.unflatten(1, (kv_heads, group)).unbind(2)
    biases = bias.unbind(2) if bias is not None and bias.dim() == 5 else [bias] * group
    outs, lses = [], []
    for part, part_bias in zip(queries, biases, strict=True):
        out, lse = _efficient_call(
            kernel, part, key, value, part_bias, (B, kv_heads, L, S), scaling
        )
        outs.append(out)
        lses.append(lse)
    out = torch.stack(outs, dim=2).view(B, h, L, -1)
    lse = torch.stack(lses, dim=2)
    return out, (lse if padded_lse else lse[..., :L]).flatten(1, 2)


def _efficient_call(
    kernel: Callable[..., Any],
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bias: torch.Tensor | None,
    shape: tuple[int, int, int, int],
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    if bias is not None and tuple(bias.shape) != shape:
        bias = bias.expand(shape)  # the kernel reads the bias at the full score shape
    out, lse = kernel(query, key, value, bias, True, 0.0, False, scale=scaling)[:2]
    return out, lse


def attend_lse_matrix(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attend_lse` by matrix products and a softmax by hand (any device and dtype)."""
    B, h, L, d = query.shape
    kv_heads, S = int(key.shape[1]), int(key.shape[2])
    group = h // kv_heads  # query heads per KV head (GQA: heads g * group ... share KV head g)
    wide = torch.float64 if query.dtype == torch.float64 else torch.float32
    # The group's queries folded into the query axis: one product per (row, KV head), in 3-d
    # (fewer ops than a broadcast 4-d matmul).
    q3 = query.reshape(B * kv_heads, group * L, d)
    raw = torch.bmm(q3, key.reshape(B * kv_heads, S, d).transpose(1, 2))
    if mask is None:
        scores = raw.to(wide) * scaling
    else:
        m = mask
        if group > 1 and (m.shape[1] == h or m.shape[-2] != 1):
            # a mask per query head, or per query: broadcast over (kv, group, L)
            per_head = m.shape[1] == h
            m = m.view(m.shape[0], kv_heads, group, *m.shape[2:]) if per_head else m[:, :, None]
            raw = raw.view(B, kv_heads, group, L, S)
        else:
            raw = raw.view(B, kv_heads, group * L, S)
        # scale and mask in one op, in the wide dtype (the mask's promotion does the cast)
        scores = torch.add(m if m.dtype == wide else m.to(wide), raw, alpha=scaling)
    # The softmax with its log-sum-exp in as few passes as it takes: exp(s - max) once,
    # normalised after the product (as fused kernels do); in 3-d, (row x KV head, query, key).
    scores = scores.view(B * kv_heads, group * L, S)
    top = scores.amax(dim=-1, keepdim=True)
    weights = torch.exp(scores - top)
    total = weights.sum(dim=-1, keepdim=True)
    if weights.dtype != value.dtype:
        weights = weights.to(value.dtype)
    out = torch.bmm(weights, value.reshape(B * kv_heads, S, -1)) / total
    lse = (top + torch.log(total)).view(B, h, L)
    out = out.view(B, h, L, -1)
    return (out if out.dtype == query.dtype else out.to(query.dtype)), lse
