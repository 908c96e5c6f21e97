"""Attention with its log-sum-exp on every path (kvcouple.tracer.lse_attention): CPU flash, the
matrix products, and CUDA's memory-efficient kernel through its adapter (over the kernel's CPU
stand-in, which checks the kernel's contract: equal heads, an aligned bias at the full score
shape, a padded log-sum-exp); the self-check that guards the real kernel; the path chosen."""

from __future__ import annotations

import pytest
import torch

from kvcouple.testing.efficient_attention import efficient_attention
from kvcouple.tracer import lse_attention
from kvcouple.tracer.lse_attention import attend_lse, attend_lse_matrix, efficient_lse


def _dense(query, key, value, mask, scaling):
    """float64 softmax attention with GQA by repetition, and its log-sum-exp."""
    group = query.shape[1] // key.shape[1]
    k = key.double().repeat_interleave(group, 1)
    v = value.double().repeat_interleave(group, 1)
    scores = query.double() @ k.transpose(-1, -2) * scaling
    if mask is not None:
        scores = scores + mask.double()
    return torch.softmax(scores, -1) @ v, torch.logsumexp(scores, -1)


def _problem(group, keys, mask_kind, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    B, kv, L, d = 3, 2, 4, 16
    h = kv * group

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    query, key, value = rand(B, h, L, d), rand(B, kv, keys, d), rand(B, kv, keys, d)
    shapes = {
        "none": None,
        "row": (B, 1, 1, keys),
        "head": (B, h, 1, keys),
        "query": (B, 1, L, keys),
    }
    mask = None
    if shapes[mask_kind] is not None:
        hidden = torch.rand(*shapes[mask_kind], generator=g) < 0.4
        hidden[..., -1] = False  # every query sees a key
        mask = torch.zeros(hidden.shape, dtype=dtype).masked_fill(hidden, torch.finfo(dtype).min)
    return query, key, value, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("keys", [32, 37])
@pytest.mark.parametrize("mask_kind", ["none", "row", "head", "query"])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_every_path_equals_dense_attention_and_its_log_sum_exp(group, mask_kind, keys, dtype):
    """GQA groups 1, 2 and 4; masks per row, per query head and per query; a key count the
    kernel's bias alignment fits and one it does not: each path's output and log-sum-exp equal
    float64 attention to the dtype's rounding."""
    query, key, value, mask = _problem(group, keys, mask_kind, dtype)
    want, want_lse = _dense(query, key, value, mask, 0.25)
    paths = {
        "cpu-flash": attend_lse(query, key, value, mask, 0.25, fused=True),
        "matrix": attend_lse(query, key, value, mask, 0.25, fused=False),
        "efficient": efficient_lse(query, key, value, mask, 0.25, kernel=efficient_attention),
    }
    tol = 2e-6 if dtype == torch.float32 else 2e-2
    for name, (out, lse) in paths.items():
        assert out.shape == query.shape and out.dtype == dtype, name
        assert lse.shape == query.shape[:3] and lse.dtype == torch.float32, name
        torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol, msg=name)
        torch.testing.assert_close(lse.double(), want_lse, atol=tol, rtol=tol, msg=name)


def test_the_stand_in_refuses_what_the_kernel_refuses():
    """So that the adapter's passing tests mean something: the stand-in raises on grouped
    heads, a bias not at the full score shape, and a misaligned bias."""
    query, key, value, mask = _problem(2, 37, "head", torch.float32)
    with pytest.raises(RuntimeError, match="no GQA"):
        efficient_attention(query, key, value, None, True)
    q1 = query[:, :2]
    with pytest.raises(RuntimeError, match="shape"):
        efficient_attention(q1, key, value, mask[:, :2], True)
    with pytest.raises(RuntimeError, match="aligned"):
        efficient_attention(q1, key, value, mask[:, :2].expand(-1, -1, 4, -1), True)


def test_the_self_check_takes_the_kernel_only_when_it_agrees(monkeypatch):
    """The kernel's stand-in passes; one whose log-sum-exp is off by 0.1, one whose output is
    off, one that raises, and one that fails only on the second form the tracer calls it in
    are refused with a warning naming why (the matrix path then)."""
    cpu = torch.device("cpu")
    assert (
        lse_attention._self_check(cpu, torch.float32, 64, efficient_attention) == "cuda-efficient"
    )
    assert (
        lse_attention._self_check(cpu, torch.bfloat16, 128, efficient_attention) == "cuda-efficient"
    )

    def lse_off(*args, **kwargs):
        out, lse, s, o = efficient_attention(*args, **kwargs)
        return out, lse + 0.1, s, o

    def out_off(*args, **kwargs):
        out, lse, s, o = efficient_attention(*args, **kwargs)
        return out * 1.01, lse, s, o

    def raises(*args, **kwargs):
        raise RuntimeError("no kernel image is available for execution on the device")

    def no_broadcast(query, key, value, bias, *args, **kwargs):
        # a kernel that cannot read a bias broadcast over heads (the own columns' form)
        if bias is not None and bias.stride(1) == 0:
            raise RuntimeError("attn_bias is not correctly aligned (strideH)")
        return efficient_attention(query, key, value, bias, *args, **kwargs)

    cases = [
        (lse_off, "differs"),
        (out_off, "differs"),
        (raises, "no kernel image"),
        (no_broadcast, "strideH"),
    ]
    for kernel, why in cases:
        with pytest.warns(RuntimeWarning, match=why):
            assert lse_attention._self_check(cpu, torch.float32, 64, kernel) == "matrix"


def test_the_path_is_decided_once_per_device_and_dtype_and_never_while_compiling(monkeypatch):
    checks = []

    def check(device, dtype, head_dim, kernel=None):
        checks.append((str(device), dtype, head_dim))
        return "cuda-efficient"

    monkeypatch.setattr(lse_attention, "_self_check", check)
    monkeypatch.setattr(lse_attention, "_DECIDED", {})
    cuda = torch.device("cuda:0")  # only its type and name are read: no GPU needed
    assert lse_attention.fused_path(torch.device("cpu"), torch.float32, 128) == "cpu-flash"
    assert lse_attention.fused_path(cuda, torch.float64, 128) == "matrix"  # no float64 kernel
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert lse_attention.fused_path(cuda, torch.bfloat16, 128) == "matrix"  # undecided, compiling
    assert checks == []
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    for _ in range(3):
        assert lse_attention.fused_path(cuda, torch.bfloat16, 128) == "cuda-efficient"
    assert checks == [("cuda:0", torch.bfloat16, 128)]
    assert lse_attention.fused_path(cuda, torch.bfloat16, 64) == "cuda-efficient"
    assert checks[-1] == ("cuda:0", torch.bfloat16, 64)  # its own check: another kernel variant
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert lse_attention.fused_path(cuda, torch.bfloat16, 128) == "cuda-efficient"  # decided before
    monkeypatch.setattr(lse_attention, "FORCE_MATRIX", True)
    assert lse_attention.fused_path(cuda, torch.bfloat16, 128) == "matrix"
    assert lse_attention.fused_path(torch.device("cpu"), torch.float32, 128) == "matrix"


def test_keys_and_values_of_different_head_sizes_take_the_matrix_path():
    """(MLA-style models: the kernels want one head size.)"""
    query, key, _, mask = _problem(2, 20, "head", torch.float32)
    value = torch.randn(*key.shape[:-1], 24)
    out, lse = attend_lse(query, key, value, mask, 0.25, fused=True)
    want, want_lse = attend_lse_matrix(query, key, value, mask, 0.25)
    assert out.shape[-1] == 24
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, want_lse)


@pytest.mark.parametrize("layout", ["shared", "joint"])
def test_step_masks_are_stored_aligned_so_no_layer_pads_them(layout, monkeypatch):
    """Every mask a decoding step hands to attention has 16-element-aligned strides on every
    axis but the last (the size-1 axes too: CUDA's kernels check them all), whatever the
    cache's capacity; so on CUDA's memory-efficient path (counted here through its stand-in)
    no layer pads a copy of it. Branch batches (a mask per row) included."""
    import functools

    import kvcouple.tracer.prefix as prefix
    from kvcouple.testing.efficient_attention import efficient_attention
    from kvcouple.testing.op_counter import count_ops
    from kvcouple.testing.tiny_models import tiny_model
    from kvcouple.tracer import TraceSettings, compat, trace_document
    from kvcouple.tracer.lse_attention import MASK_ALIGNMENT, efficient_lse

    monkeypatch.setattr(
        prefix, "attend_lse", functools.partial(efficient_lse, kernel=efficient_attention)
    )
    masks, pads = [], []
    forward = compat.forward

    def recorded(model, input_ids, cache, position_ids, attention_mask=None, *a, **kw):
        if not kw.get("step"):
            return forward(model, input_ids, cache, position_ids, attention_mask, *a, **kw)
        if attention_mask is not None:
            masks.append(attention_mask)
        with count_ops() as counts:  # the decoding steps' ops (set-up may pad caches)
            out = forward(model, input_ids, cache, position_ids, attention_mask, *a, **kw)
        pads.append(counts.by_op["aten.pad"])
        return out

    monkeypatch.setattr(compat, "forward", recorded)
    model = tiny_model("llama", num_hidden_layers=2, attn_implementation="sdpa")
    prompt = list(range(3, 44))  # 41 tokens: capacities that are not multiples of 16
    settings = TraceSettings(horizon=9, replicates=3, branches=2, window=4, cache_layout=layout)
    trace_document(model, prompt, ["snapkv:retain=0.5,window=4"], settings, seed=1)
    assert masks
    assert any(m.shape[0] > 1 for m in masks)  # a mask per row (branches) among them
    assert any(m.shape[-1] % MASK_ALIGNMENT for m in masks)  # misaligned widths among them
    for m in masks:
        assert all(s % MASK_ALIGNMENT == 0 for s in m.stride()[:-1]), (m.shape, m.stride())
        assert m.stride()[-1] == 1
    assert len(pads) >= len(masks) and sum(pads) == 0


def test_the_sides_form_is_taken_only_where_the_kernel_agrees():
    """One document's sides as the kernel's batch (the prompt broadcast with stride 0) is
    checked on its own: taken with a kernel that computes it right, not with one that
    refuses a broadcast batch or gets it wrong; never off CUDA's efficient path."""
    from kvcouple.testing.efficient_attention import efficient_attention
    from kvcouple.tracer import lse_attention

    cpu = torch.device("cpu")
    assert lse_attention._sides_check(cpu, torch.float32, 64, kernel=efficient_attention)
    assert lse_attention._sides_check(cpu, torch.bfloat16, 128, kernel=efficient_attention)

    def no_broadcast(query, key, *args, **kwargs):
        if key.stride(0) == 0:
            raise RuntimeError("key batch stride 0")
        return efficient_attention(query, key, *args, **kwargs)

    def off(query, key, value, *args, **kwargs):
        out, lse, *rest = efficient_attention(query, key, value, *args, **kwargs)
        return (out * 1.01, lse, *rest)

    assert not lse_attention._sides_check(cpu, torch.float32, 64, kernel=no_broadcast)
    assert not lse_attention._sides_check(cpu, torch.float32, 64, kernel=off)
    assert not lse_attention.sides_batched(cpu, torch.float32, 64)  # CPU runs its flash kernel
