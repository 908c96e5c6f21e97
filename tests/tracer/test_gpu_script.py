"""benchmarks/gpu_trace.py, the GPU check, on CPU: its JSON, and a failing mode recorded
rather than losing the run."""

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.torch

from tracer_helpers import one_thread  # noqa: E402, F401 - autouse fixture


def _script():
    """benchmarks/gpu_trace.py as a module (it is a script, not part of the package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_trace.py"
    spec = importlib.util.spec_from_file_location("gpu_trace", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_script_cpu_size_path(tmp_path, capsys):
    """benchmarks/gpu_trace.py --tiny: the GPU check's code on CPU, one JSON with a row per
    prompt length (plan, trace and generate throughput, their ratio)."""
    module = _script()
    out = tmp_path / "gpu.json"
    args = ["--tiny", "--prompts", "24,40", "--horizon", "4", "--window", "2", "--out", str(out)]
    report = module.main(args)
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert report["device"] == "cpu" and report["settings"] == {
        "R": 2,
        "K": 4,
        "L": 2,
        "T": 4,
        "policy": "snapkv:retain=0.5,window=32,kernel=7,pool=avg",
    }
    rows = report["results"]
    assert [r["prompt_tokens"] for r in rows] == [24, 40]
    for r in rows:
        # The overlap path alone generates 2RT tokens; branches add more.
        assert r["trace_tokens"] > 2 * 2 * 4
        assert r["ratio"] == pytest.approx(r["trace_tokens_per_s"] / r["generate_tokens_per_s"])
        assert r["branch_batch"] == 8 and r["plan_peak_bytes"] > 0
        assert r["cache_layout"] == "shared"
        assert r["peak_bytes"] is None  # no device memory counter on CPU
    assert rows[1]["plan_peak_bytes"] > rows[0]["plan_peak_bytes"]
    assert rows[0]["shared_over_joint"] == pytest.approx(
        rows[0]["trace_tokens_per_s"] / rows[0]["joint_trace_tokens_per_s"]
    )
    assert "shared_over_joint" not in rows[1]  # the shortest prompt only
    # The eager step with cascade attention's matrix path forced, beside the fused kernel's.
    assert report["attention_path"] == "cpu-flash"
    assert report["sides_batched"] is False  # (CUDA's efficient kernel only)
    for r in rows:
        forced = r["decode"]["off_matrix_attention"]
        assert "error" not in forced
        # A difference of two wall times (clipped at 0 when a busy machine makes the shorter
        # horizon slower): its sign is timing, not the script's; the ratio follows it.
        ms = forced["trace_ms_per_step"]
        assert ms >= 0 and forced["over_floor"] == pytest.approx(ms / r["decode"]["floor_ms"])
        assert (forced["ratio_to_generate"] is None) == (ms == 0)
    from kvcouple.tracer import lse_attention

    assert lse_attention.FORCE_MATRIX is False  # restored
    short = report["short_documents"]
    assert short["documents"] == 3 and short["prompt_tokens"] == 32
    assert short["ratio"] == pytest.approx(short["one_at_a_time_s"] / short["batched_s"])
    assert report["wall_s"] > 0 and "ratio to generate" in capsys.readouterr().out


def test_gpu_script_records_a_failing_mode_and_goes_on(tmp_path, monkeypatch):
    """A compile mode that raises on the device (here `graphs`, made to fail) is recorded in
    the JSON with its error, and the other modes, generate and the JSON still come: one lent
    GPU run must not be lost to one failure."""
    import kvcouple.tracer as tracer

    real = tracer.trace_document

    def failing(model, prompt, policies, settings, **kw):
        if settings.compile == "graphs":
            raise RuntimeError("boom: cudagraphs")
        return real(model, prompt, policies, settings, **kw)

    monkeypatch.setattr(tracer, "trace_document", failing)
    module = _script()
    out = tmp_path / "gpu.json"
    args = ["--tiny", "--prompts", "24", "--horizon", "4", "--window", "2", "--compile"]
    report = module.main([*args, "off,graphs", "--short-docs", "2", "--out", str(out)])
    decode = report["results"][0]["decode"]
    assert decode["graphs"] == {"error": "RuntimeError: boom: cudagraphs"}
    # Measured (timings are differences of wall times, >= 0: their size is not the test's).
    assert decode["off"]["trace_ms_per_step"] >= 0 and decode["generate_ms_per_step"] >= 0
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert "partial" not in report


def test_gpu_script_measures_every_length_eagerly_before_compiling(tmp_path, monkeypatch):
    """The compiled modes (minutes of compilation on an 8B model) come after the eager step
    at every prompt length, so a lent GPU's budget measures every length first."""
    import kvcouple.tracer as tracer

    real = tracer.trace_document
    calls: list[tuple[str, int]] = []

    def recorded(model, prompt, policies, settings, **kw):
        calls.append((settings.compile, len(prompt)))
        if settings.compile == "graphs":
            raise RuntimeError("not compiled in this test")
        return real(model, prompt, policies, settings, **kw)

    monkeypatch.setattr(tracer, "trace_document", recorded)
    module = _script()
    args = ["--tiny", "--prompts", "24,40", "--horizon", "4", "--window", "2", "--compile"]
    report = module.main([*args, "off,graphs", "--short-docs", "2"])
    compiled = [i for i, (mode, _) in enumerate(calls) if mode == "graphs"]
    eager_40 = [i for i, (mode, n) in enumerate(calls) if mode == "off" and n == 40]
    assert compiled and eager_40 and min(compiled) > max(eager_40)
    for row in report["results"]:  # each length's compiled mode recorded beside its eager one
        assert row["decode"]["graphs"] == {"error": "RuntimeError: not compiled in this test"}
        assert row["decode"]["off"]["trace_ms_per_step"] >= 0
