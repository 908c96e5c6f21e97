"""Per decoding step, what a GPU would pay for (kvcouple.testing.op_counter): no host sync in
any layout or decode-time rule, and ATen ops within a loose factor of `generate` on the same
rows (benchmarks/step_ops.py prints the exact figures on a 32-layer model)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytestmark = pytest.mark.torch  # -m "not torch" deselects the module

from kvcouple.policies.snapkv import SnapKV  # noqa: E402
from kvcouple.testing.op_counter import generate_peer, per_step  # noqa: E402
from kvcouple.testing.tiny_models import tiny_model  # noqa: E402
from kvcouple.tracer import TraceSettings, trace_document  # noqa: E402

R = 4
HORIZONS = (3, 7)
PROMPT = np.random.default_rng(0).integers(1, 120, 24).tolist()

# (policy, layout, bound on ops per step against generate's). A 6-layer model: the per-step
# work outside the layers (decoding transform, coupling, records) weighs more than on the
# 32-layer benchmark, so the bounds sit above the benchmark's ratios (these are today's 6-layer
# ratios plus about 10%; decode-time rows include their branches' replayed steps).
CASES = [
    ("snapkv:retain=0.5,window=4", "shared", 1.35),
    ("snapkv:retain=0.5,window=4", "joint", 1.2),
    ("snapkv:retain=0.5,window=4", "split", 2.6),
    ("h2o:retain=0.5,mode=decode", "auto", 2.9),
    ("streaming:retain=0.5,mode=decode", "auto", 2.6),
    ("recent:retain=0.5,mode=decode", "auto", 3.0),
    ("snapkv:retain=0.5,window=4,mode=decode", "auto", 2.9),
]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", num_hidden_layers=6, attn_implementation="sdpa")


@pytest.fixture(scope="module")
def generate_ops(model):
    counts = per_step(generate_peer(model, PROMPT, 2 * R), HORIZONS)
    assert counts.ops_per_step > 0
    return counts.ops_per_step


def _trace(model, policy: str, layout: str, horizon: int):
    settings = TraceSettings(
        horizon=horizon, replicates=R, branches=1, window=0, cache_layout=layout
    )
    return trace_document(model, PROMPT, [policy], settings, seed=1)


@pytest.mark.parametrize(("policy", "layout", "bound"), CASES)
def test_no_host_sync_per_step_and_ops_near_generate(model, generate_ops, policy, layout, bound):
    counts = per_step(lambda h: _trace(model, policy, layout, h), HORIZONS)
    assert counts.syncs_per_step == 0, counts.sync_sites_per_step
    ratio = counts.ops_per_step / generate_ops
    assert 0 < ratio < bound, (policy, layout, counts.ops_per_step, generate_ops)


def test_rescore_rule_rows_folded_into_heads_select_as_row_by_row(model, monkeypatch):
    """RescoreRule runs a per-head policy's selection once over every row (rows folded into
    the KV-head axis): the same records as one selection per row."""
    settings = TraceSettings(horizon=6, replicates=3, branches=2, window=2)
    spec = ["snapkv:budget=9,window=3,kernel=3,mode=decode"]
    folded, _ = trace_document(model, PROMPT, spec, settings, seed=4)
    monkeypatch.setattr(SnapKV, "selects_per_head", lambda self: False)
    by_row, _ = trace_document(model, PROMPT, spec, settings, seed=4)
    assert folded.keys() == by_row.keys()
    for name in folded:
        a, b = np.asarray(folded[name]), np.asarray(by_row[name])
        if a.dtype.kind == "f":
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9, err_msg=name)
        else:
            np.testing.assert_array_equal(a, b, err_msg=name)


def _cuda_kernel_path(monkeypatch) -> None:
    """Cascade attention through CUDA's memory-efficient kernel's adapter over its CPU
    stand-in (one op per kernel call, as on CUDA), the sides as the kernel's batch as where
    the kernel passed its check in that form."""
    import functools

    import kvcouple.tracer.prefix as prefix
    from kvcouple.testing.efficient_attention import efficient_attention
    from kvcouple.tracer.lse_attention import efficient_lse

    kernel = functools.partial(efficient_lse, kernel=efficient_attention)
    monkeypatch.setattr(prefix, "attend_lse", kernel)
    monkeypatch.setattr(prefix, "sides_batched", lambda *a: True)


def test_cuda_kernels_step_costs_the_ops_of_the_cpu_kernels(model, monkeypatch):
    """The shared step through CUDA's kernel (its stand-in) runs the ops of the CPU's flash
    kernel: one call per part and layer, no sliced log-sum-exp, the step's mask expanded once
    a step (each of those per layer would add 6 ops a step on 6 layers)."""
    spec = "snapkv:retain=0.5,window=4"
    cpu = per_step(lambda h: _trace(model, spec, "shared", h), HORIZONS)
    _cuda_kernel_path(monkeypatch)
    cuda = per_step(lambda h: _trace(model, spec, "shared", h), HORIZONS)
    assert cuda.syncs_per_step == 0, cuda.sync_sites_per_step
    assert cuda.ops_per_step <= cpu.ops_per_step + 2, (cuda.ops_per_step, cpu.ops_per_step)


@pytest.mark.parametrize("kernel", ["cpu-flash", "cuda-efficient"])
def test_a_batch_of_documents_costs_the_ops_of_one(model, monkeypatch, kernel):
    """Three documents of different lengths traced as one batch (their prompts in one pack,
    one prefix call per layer for every row): no host sync, and the ops per step of one
    document (the packed call does not grow with the documents), on the CPU's kernel and on
    CUDA's (its stand-in: the sides as the call's batch, every document's KV heads its
    heads)."""
    from kvcouple.policies import parse_policy
    from kvcouple.tracer.batches import trace_documents_records

    if kernel == "cuda-efficient":
        _cuda_kernel_path(monkeypatch)

    rng = np.random.default_rng(2)
    docs = [rng.integers(1, 120, n).tolist() for n in (24, 19, 30)]
    policies = [parse_policy("snapkv:retain=0.5,window=4")]

    def run(horizon: int) -> None:
        settings = TraceSettings(
            horizon=horizon, replicates=R, branches=1, window=0, cache_layout="shared"
        )
        batch = [(ids, i, f"d{i}", settings) for i, ids in enumerate(docs)]
        trace_documents_records(model, batch, policies, seed=1)

    batch = per_step(run, HORIZONS)
    one = per_step(lambda h: _trace(model, "snapkv:retain=0.5,window=4", "shared", h), HORIZONS)
    assert batch.syncs_per_step == 0, batch.sync_sites_per_step
    # (a call per document and side would add about 6 ops per layer and document)
    assert batch.ops_per_step <= one.ops_per_step + 6, (batch.ops_per_step, one.ops_per_step)
