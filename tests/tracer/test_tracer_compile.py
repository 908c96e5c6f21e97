"""TraceSettings(compile=...) / --compile: the decoding step through torch.compile equals eager
to float noise, and compiles once per batch shape, however many steps follow."""

from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytestmark = pytest.mark.torch  # -m "not torch" deselects the module

from kvcouple.testing.tiny_models import tiny_model  # noqa: E402
from kvcouple.tracer import TraceSettings, compat, trace_document  # noqa: E402
from kvcouple.tracer.settings import compile_mode  # noqa: E402

PROMPT = np.random.default_rng(0).integers(1, 120, 20).tolist()
SPEC = ["snapkv:retain=0.5,window=4"]


def test_compile_choices_and_modes():
    assert compile_mode("off", "cuda") is None
    assert compile_mode("auto", "cpu") is None  # eager is the default on CPU
    assert compile_mode("auto", "cuda") == "default"
    assert compile_mode("graphs", "cuda") == "reduce-overhead"
    assert compile_mode("graphs", "cpu") == "default"  # inductor
    with pytest.raises(ValueError, match="compile must be off, auto or graphs"):
        TraceSettings(horizon=2, compile="always")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="compile must be"):
        compile_mode("on", "cpu")


def _assert_records_agree(eager, compiled, rtol=1e-5, atol=1e-6):
    assert eager.keys() == compiled.keys()
    for name in eager:
        a, b = np.asarray(eager[name]), np.asarray(compiled[name])
        if a.dtype.kind == "f":
            np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=name)
        else:
            np.testing.assert_array_equal(a, b, err_msg=name)


@pytest.fixture
def counting_compile(monkeypatch):
    """The compiled step through a backend that counts the graphs it is given (dynamo's own
    eager backend: fast, the same guards and recompilations as inductor's)."""
    import torch._dynamo

    graphs: list[int] = []

    def backend(gm, example_inputs):
        graphs.append(len(example_inputs))
        return gm.forward

    torch._dynamo.reset()
    # Every new shape recompiles (no automatic dynamic shapes): the count then shows that
    # each step of a batch has the same shapes (a growing cache would compile every step).
    compiled: dict[str, object] = {}
    monkeypatch.setattr(
        compat,
        "_compiled",
        lambda mode: compiled.setdefault(mode, torch.compile(compat._call, backend=backend)),
    )
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
        yield graphs
    torch._dynamo.reset()


@pytest.mark.parametrize("layout", ["joint", "shared"])
def test_compiled_step_compiles_once_per_batch_shape(counting_compile, layout):
    """32 steps compile a handful of graphs (the path's batch, the branches' batch, the
    shared layout's prefix groups), not one per step: the cache grows by a column a step
    without a recompilation, and the same run again compiles nothing."""
    model = tiny_model("llama", num_hidden_layers=2, attn_implementation="sdpa")
    settings = TraceSettings(
        horizon=32, replicates=2, branches=1, window=0, cache_layout=layout, compile="graphs"
    )
    compiled, _ = trace_document(model, PROMPT, SPEC, settings, seed=1)
    first = len(counting_compile)
    # One graph per batch shape: the path's batch and the branches' (shared: and the first
    # step's, whose rows' own caches start empty), however many of the 32 steps each runs.
    assert 0 < first <= 3, counting_compile
    trace_document(model, PROMPT, SPEC, settings, seed=1)
    assert len(counting_compile) == first, counting_compile
    eager, _ = trace_document(model, PROMPT, SPEC, replace(settings, compile="off"), seed=1)
    _assert_records_agree(eager, compiled)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_inductor_step_equals_eager(arch):
    """The decoding step compiled by inductor on CPU (compile="graphs"), 32 steps with forked
    branches: every record equals eager's to float noise, on two architectures."""
    import torch._dynamo

    torch._dynamo.reset()
    compat._COMPILED.clear()
    model = tiny_model(arch, num_hidden_layers=2, attn_implementation="sdpa")
    settings = TraceSettings(horizon=32, replicates=2, branches=1, window=2, cache_layout="joint")
    eager, _ = trace_document(model, PROMPT, SPEC, settings, seed=1)
    compiled, _ = trace_document(model, PROMPT, SPEC, replace(settings, compile="graphs"), seed=1)
    _assert_records_agree(eager, compiled)
    compat._COMPILED.clear()
    torch._dynamo.reset()


def test_stores_with_and_without_compile_agree(counting_compile, tmp_path):
    """`trace` with compile="graphs" writes the store eager writes, to float noise (both
    layouts a run picks: shared for snapkv, joint rows for decode-time h2o, which steps eager)."""
    xr = pytest.importorskip("xarray")
    pytest.importorskip("zarr")
    from kvcouple.tracer import Prompt, trace

    model = tiny_model("qwen2", num_hidden_layers=2, attn_implementation="sdpa")
    rng = np.random.default_rng(3)
    prompts = [Prompt(f"d{i}", tuple(int(t) for t in rng.integers(1, 120, 14 + i))) for i in (0, 1)]
    policies = ["snapkv:retain=0.5,window=4", "h2o:retain=0.5,mode=decode"]
    settings = TraceSettings(horizon=6, replicates=2, branches=2, window=2)
    kw = {"seed": 2, "model_id": "tiny", "progress": False}
    trace(model, prompts, policies, settings, tmp_path / "eager.zarr", **kw)
    trace(model, prompts, policies, replace(settings, compile="graphs"), tmp_path / "c.zarr", **kw)
    assert counting_compile  # the step did run compiled
    eager = xr.open_zarr(tmp_path / "eager.zarr").load()
    compiled = xr.open_zarr(tmp_path / "c.zarr").load()
    assert set(eager.data_vars) == set(compiled.data_vars)
    _assert_records_agree(
        {k: eager[k].values for k in eager.data_vars},
        {k: compiled[k].values for k in compiled.data_vars},
    )


def _compiled_with(monkeypatch, backend):
    """compat's compiled step through ``backend``, in a fresh process state."""
    import torch._dynamo

    torch._dynamo.reset()
    compiled: dict[str, object] = {}
    monkeypatch.setattr(compat, "_FAILED", {})
    monkeypatch.setattr(
        compat,
        "_compiled",
        lambda mode: compiled.setdefault(mode, torch.compile(compat._call, backend=backend)),
    )


def test_a_step_that_fails_to_compile_runs_eagerly_after_one_warning(monkeypatch):
    """Eager is the fallback: a backend that fails makes one RuntimeWarning naming the mode
    and why, and every step then runs eagerly (the records are eager's, bit for bit)."""
    calls = []

    def failing(gm, example_inputs):
        calls.append(1)
        raise RuntimeError("this backend refuses every graph")

    _compiled_with(monkeypatch, failing)
    model = tiny_model("llama", num_hidden_layers=2, attn_implementation="sdpa")
    settings = TraceSettings(
        horizon=8, replicates=2, branches=1, window=2, cache_layout="joint", compile="graphs"
    )
    with pytest.warns(RuntimeWarning, match="failed to compile") as seen:
        got, _ = trace_document(model, PROMPT, SPEC, settings, seed=1)
    ours = [w for w in seen if "failed to compile" in str(w.message)]
    assert len(ours) == 1 and "this backend refuses" in str(ours[0].message)
    assert calls == [1]  # tried once, not at every step
    assert compat._FAILED
    torch._dynamo.reset()
    eager, _ = trace_document(model, PROMPT, SPEC, replace(settings, compile="off"), seed=1)
    _assert_records_agree(eager, got, rtol=0, atol=0)


def test_an_error_of_the_step_itself_is_not_hidden_by_the_fallback(monkeypatch):
    def broken(*args):
        raise ValueError("the step itself failed")

    monkeypatch.setattr(compat, "_FAILED", {})
    monkeypatch.setattr(compat, "_compiled", lambda mode: broken)
    model = tiny_model("llama", num_hidden_layers=2, attn_implementation="sdpa")
    settings = TraceSettings(horizon=4, replicates=2, branches=1, window=2, compile="graphs")
    with pytest.raises(ValueError, match="the step itself failed"):
        trace_document(model, PROMPT, SPEC, settings, seed=1)
    assert not compat._FAILED
