"""The tracer at scale: provenance attributes, the memory plan, ``--dry-run``."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import xarray as xr  # noqa: E402

from kvcouple import __version__  # noqa: E402
from kvcouple.cli import main as cli_main  # noqa: E402
from kvcouple.testing.tiny_models import tiny_model  # noqa: E402
from kvcouple.tracer import Prompt, TraceSettings, trace  # noqa: E402
from kvcouple.tracer.provenance import resolved_revision  # noqa: E402

pytestmark = pytest.mark.torch

from tracer_helpers import model, one_thread  # noqa: E402, F401 - autouse fixture

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _prompt_file(path, lengths):
    rng = np.random.default_rng(3)
    path.write_text(
        "".join(
            json.dumps({"id": f"d{i}", "input_ids": rng.integers(1, 100, n).tolist()}) + "\n"
            for i, n in enumerate(lengths)
        )
    )
    return path


def test_store_carries_provenance(tmp_path):
    m = model("llama")
    prompts = [Prompt("a", tuple(range(1, 13)))]
    trace(
        m,
        prompts,
        ["recent:retain=0.5"],
        TraceSettings(horizon=2),
        tmp_path / "s",
        model_revision="v1",
        progress=False,
    )
    attrs = xr.open_zarr(tmp_path / "s").attrs
    assert attrs["torch_version"] == torch.__version__
    assert attrs["transformers_version"] == transformers.__version__
    assert attrs["kvcouple_version"] == __version__
    assert attrs["device"] == "cpu"
    assert attrs["dtype"] == "float32"
    assert attrs["attn_implementation"] == "sdpa"
    # An in-memory model has no snapshot: the requested revision is what is known.
    assert attrs["model_revision"] == "v1"


def test_revision_resolved_from_a_hub_snapshot(tmp_path, capsys):
    """A model loaded by path from a Hub cache snapshot records the snapshot's commit hash,
    with or without --revision."""
    snapshot = tmp_path / "hub" / "models--org--tiny" / "snapshots" / COMMIT
    model("llama").save_pretrained(snapshot)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(snapshot)
    assert resolved_revision(loaded) == COMMIT
    assert resolved_revision(loaded, "main") == COMMIT
    assert resolved_revision(model("llama"), None) == ""

    prompts = _prompt_file(tmp_path / "p.jsonl", [10])
    out = tmp_path / "run.zarr"
    args = ["trace", "--model", str(snapshot), "--prompts", str(prompts), "--out", str(out)]
    args += ["--policy", "recent:retain=0.5", "--horizon", "2", "--replicates", "1"]
    assert cli_main([*args, "--quiet", "--device", "cpu"]) == 0
    capsys.readouterr()
    assert xr.open_zarr(out).attrs["model_revision"] == COMMIT


# The memory plan ------------------------------------------------------------------------------
def _is_tensor(o: object) -> bool:
    """isinstance, except that a ``weakref.proxy`` whose referent died (left by an earlier test's
    library) raises ReferenceError on any attribute lookup: such an object holds no tensor."""
    try:
        return isinstance(o, torch.Tensor)
    except ReferenceError:
        return False


def _live_tensor_bytes(exclude: set[int]) -> int:
    """Bytes of every distinct CPU tensor storage alive now, except ``exclude`` (the weights)."""
    import gc
    import warnings

    seen = {}
    with warnings.catch_warnings():  # isinstance on deprecated torch module attributes warns
        warnings.simplefilter("ignore")
        tensors = [o for o in gc.get_objects() if _is_tensor(o)]
    for o in tensors:
        if o.device.type == "cpu":
            storage = o.untyped_storage()
            try:
                ptr = storage.data_ptr()
            except RuntimeError:  # a fake tensor left by an earlier torch.compile: no memory
                continue
            if ptr not in exclude:
                seen[ptr] = storage.nbytes()
    return sum(seen.values())


def _traced_peak(monkeypatch, m, prompt, spec, settings) -> int:
    """The most tensor bytes alive at any forward of one traced document (beyond what was
    alive before it: weights, other tests' models)."""
    from kvcouple.tracer import compat, trace_document

    before = _live_tensor_bytes(set())
    peak = [0]
    forward = compat.forward

    def metered(*args, **kw):
        peak[0] = max(peak[0], _live_tensor_bytes(set()) - before)
        return forward(*args, **kw)

    monkeypatch.setattr(compat, "forward", metered)
    trace_document(m, prompt, [spec], settings, seed=1)
    monkeypatch.setattr(compat, "forward", forward)
    return peak[0]


@pytest.mark.parametrize("spec", ["recent:retain=0.5", "snapkv:retain=0.5"])
def test_plan_matches_the_cache_bytes_held_at_the_peak(monkeypatch, spec):
    """A 2,048-token prompt, R=4, K=2 on a tiny model: every tensor alive at each forward of
    the trace (caches, kept entries, captured queries) is counted; the largest count is the
    plan's within 10%, in every cache layout; the split layout's evicted side holds about half
    of what the joint (padded) layout's does at retain=0.5, and the shared layout's rows hold
    only their own columns (the prompt's cache once, not once per replicate)."""
    from kvcouple.policies import parse_policy
    from kvcouple.tracer.memory import ModelShape, Sizes, plan_document

    m = tiny_model("llama", seed=7, max_position_embeddings=4096)
    n, R, K, T, L = 2048, 4, 2, 6, 3
    prompt = np.random.default_rng(0).integers(1, 127, n).tolist()
    shape = ModelShape.of_model(m)
    measured, plans = {}, {}
    for layout in ("split", "joint", "shared"):
        settings = TraceSettings(
            horizon=T, replicates=R, branches=K, window=L, branch_batch=None, cache_layout=layout
        )
        measured[layout] = _traced_peak(monkeypatch, m, prompt, spec, settings)
        plan = plan_document(shape, n, [parse_policy(spec)], Sizes(T, R, K, L, layout), None)
        assert plan.layout == layout
        assert plan.phases["branches"] >= plan.phases["path"]
        planned = plan.cache_bytes + plan.capture
        assert abs(measured[layout] - planned) <= 0.1 * planned, (layout, measured, planned)
        plans[layout] = plan
    # The evicted side: (1024 kept - 1 + T) vs (2047 + T) columns per row.
    assert plans["split"].path_q / plans["joint"].path_q == pytest.approx(0.5, abs=0.01)
    assert plans["split"].path_p <= plans["joint"].path_p  # (positions: one per entry)
    # What the split layout saves, measured, is what the plan says it saves.
    saved = plans["joint"].cache_bytes - plans["split"].cache_bytes
    assert measured["joint"] - measured["split"] == pytest.approx(saved, rel=0.1)
    # Shared: P and Q rows hold R x T columns each; the prompt's cache (and the kept
    # entries) are held once (no buffer of prefix scores: cascade attention). Measured
    # against the joint layout's R copies of the prompt:
    assert plans["shared"].path_p == R * T * shape.token_bytes
    assert measured["shared"] < 0.3 * measured["joint"], measured
    saved = plans["joint"].cache_bytes - plans["shared"].cache_bytes
    assert measured["joint"] - measured["shared"] == pytest.approx(saved, rel=0.1)
    # auto shares on a model whose attention allows it.
    auto = plan_document(shape, n, [parse_policy(spec)], Sizes(T, R, K, L), None)
    assert auto.layout == "shared"


def test_auto_branch_batch_is_the_largest_that_fits():
    from kvcouple.policies import parse_policy
    from kvcouple.tracer.memory import (
        MemoryPlanError,
        ModelShape,
        Sizes,
        choose_branch_batch,
        plan_document,
    )

    shape = ModelShape.of_model(model("llama"))
    pols = [parse_policy("snapkv:retain=0.5"), parse_policy("recent:budget=8")]
    # (joint: the branches' copies of the prompt make the peak grow with the batch)
    sizes = Sizes(horizon=16, replicates=4, branches=3, window=4, layout="joint")
    peaks = [plan_document(shape, 300, pols, sizes, b).peak for b in range(1, 13)]
    assert all(a < b for a, b in zip(peaks, peaks[1:], strict=False))  # grows with the batch
    for b in (1, 5, 12):
        chosen = choose_branch_batch(shape, 300, pols, sizes, peaks[b - 1] + 1, doc_id="d")
        assert chosen.branch_batch == b and chosen.fits
    just_below = choose_branch_batch(shape, 300, pols, sizes, peaks[6] - 1)
    assert just_below.branch_batch == 6
    with pytest.raises(MemoryPlanError, match=r"'d' \(300 prompt tokens\) needs .* at its peak"):
        choose_branch_batch(shape, 300, pols, sizes, peaks[0] - 1, doc_id="d")


def test_a_document_that_cannot_fit_is_refused_before_the_store_is_written(tmp_path):
    from kvcouple.tracer.memory import MemoryPlanError, ModelShape

    m = model("llama")
    weights = ModelShape.of_model(m).weight_bytes
    prompts = [
        Prompt("short", tuple(range(1, 13))),
        Prompt("long", tuple(i % 120 + 1 for i in range(400))),
    ]
    settings = TraceSettings(horizon=4, replicates=2, branches=2, window=2)
    # Enough for the short document, not for the long one.
    with pytest.raises(MemoryPlanError, match="'long' .* needs"):
        trace(m, prompts, ["recent:retain=0.5"], settings, tmp_path / "s", memory=weights + 2**20)
    assert not (tmp_path / "s").exists()
    # With room for everything the same run traces (auto: every branch at once).
    summary = trace(
        m, prompts, ["recent:retain=0.5"], settings, tmp_path / "s", memory=2**30, progress=False
    )
    assert summary.traced == [0, 1]


def test_on_cpu_a_plan_larger_than_the_host_memory_is_refused(tmp_path, monkeypatch):
    """On CPU the caches are host memory: with no --memory given, a document whose plan
    exceeds the host's available memory is refused before anything is written (a huge
    horizon once preallocated tens of GB and failed mid-run)."""
    from kvcouple.tracer import memory
    from kvcouple.tracer.memory import MemoryPlanError, ModelShape

    m = model("llama")
    prompts = [Prompt("d", tuple(range(1, 13)))]
    weights = ModelShape.of_model(m).weight_bytes
    monkeypatch.setattr(memory, "available_memory", lambda: weights + 2**20)
    settings = TraceSettings(horizon=2000, replicates=8, branches=2, window=2)
    with pytest.raises(MemoryPlanError, match=r"'d' .* needs .* shorter --horizon"):
        trace(m, prompts, ["recent:retain=0.5"], settings, tmp_path / "s", progress=False)
    assert not (tmp_path / "s").exists()
    monkeypatch.setattr(memory, "available_memory", lambda: None)  # unknown: no limit
    small = TraceSettings(horizon=3, replicates=2, branches=1, window=1)
    summary = trace(m, prompts, ["recent:retain=0.5"], small, tmp_path / "t", progress=False)
    assert summary.traced == [0]


def test_dry_run_prints_the_plan_and_writes_nothing(tmp_path, capsys):
    model_dir = tmp_path / "tiny"
    model("llama").save_pretrained(model_dir)
    prompts = _prompt_file(tmp_path / "p.jsonl", [40, 90])
    out = tmp_path / "run.zarr"
    base = ["trace", "--model", str(model_dir), "--prompts", str(prompts), "--out", str(out)]
    base += ["--policy", "snapkv:retain=0.5", "--replicates", "4", "--branches", "2"]
    base += ["--horizon", "8", "--window", "3", "--dry-run", "--device", "cpu"]
    assert cli_main(base) == 0
    text = capsys.readouterr().out
    assert "memory plan: 2 layers x 2 KV heads x 16" in text and "0.5 KiB per cached token" in text
    lines = {line.split()[0]: line.split() for line in text.splitlines() if line[:1] == "d"}
    assert lines["d0"][1] == "40" and lines["d1"][1] == "90"
    assert lines["d1"][-2:] == ["8/8", "shared"]  # fits the host; the model allows sharing
    assert not out.exists()
    # Asked for, the joint layout holds R copies of the prompt: a larger plan.
    assert cli_main([*base, "--cache-layout", "joint"]) == 0
    joint = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()}
    assert joint["d1"][-1] == "joint" and float(joint["d1"][4]) > float(lines["d1"][4])  # P rows
    # A budget too small for the longer prompt at one branch a time: refused, exit status 1.
    assert cli_main([*base, "--memory", "0.0005", "--branch-batch", "auto"]) == 1
    text = capsys.readouterr().out
    assert "DOES NOT FIT" in text and "refused: document 'd1'" in text
    assert cli_main([*base, "--branch-batch", "0"]) == 2
    assert "--branch-batch must be >= 1, got 0 (or 'auto')" in capsys.readouterr().err
    assert not out.exists()


def test_gpu_script_cpu_size_path(tmp_path, capsys):
    """benchmarks/gpu_trace.py --tiny: the GPU check's code on CPU, one JSON with a row per
    prompt length (plan, trace and generate throughput, their ratio)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_trace.py"
    spec = importlib.util.spec_from_file_location("gpu_trace", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
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
    for r in rows:
        forced = r["decode"]["off_matrix_attention"]
        assert forced["trace_ms_per_step"] > 0 and forced["ratio_to_generate"] > 0
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
    import importlib.util
    from pathlib import Path

    import kvcouple.tracer as tracer

    real = tracer.trace_document

    def failing(model, prompt, policies, settings, **kw):
        if settings.compile == "graphs":
            raise RuntimeError("boom: cudagraphs")
        return real(model, prompt, policies, settings, **kw)

    monkeypatch.setattr(tracer, "trace_document", failing)
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_trace.py"
    spec = importlib.util.spec_from_file_location("gpu_trace", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "gpu.json"
    args = ["--tiny", "--prompts", "24", "--horizon", "4", "--window", "2", "--compile"]
    report = module.main([*args, "off,graphs", "--short-docs", "2", "--out", str(out)])
    decode = report["results"][0]["decode"]
    assert decode["graphs"] == {"error": "RuntimeError: boom: cudagraphs"}
    assert decode["off"]["trace_ms_per_step"] > 0 and decode["generate_ms_per_step"] > 0
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert "partial" not in report


# Caches that grow in place ---------------------------------------------------------------------
def test_preallocated_cache_equals_the_dynamic_cache_and_writes_in_place():
    """Decoding on a preallocated cache gives the dynamic cache's logits bit for bit, with a
    per-row mask; within capacity the buffer never moves, beyond it the cache grows."""
    from kvcouple.tracer import compat
    from kvcouple.tracer.kvcache import PreallocatedLayer, cache_bytes, cache_with_capacity

    if PreallocatedLayer is None:
        pytest.skip("transformers without cache layers: the plain dynamic cache is used")
    m = model("llama")
    prompt = torch.as_tensor(np.random.default_rng(5).integers(1, 120, (1, 30)))
    with torch.inference_mode():
        prefix = compat.new_cache()
        compat.forward(m, prompt, prefix, torch.arange(30)[None])
        kv = [
            (k.expand(3, -1, -1, -1).contiguous(), v.expand(3, -1, -1, -1).contiguous())
            for k, v in compat.cache_tensors(prefix)
        ]
        plain = compat.cache_from_tensors(kv)
        grown = cache_with_capacity(iter(kv), 5)  # room for 5 more columns
        buffer = grown.layers[0]._k.data_ptr()
        assert cache_bytes(grown) == 2 * 2 * 3 * 2 * 35 * 16 * 4  # layers, K+V, rows, heads
        valid = torch.ones(3, 30, dtype=torch.bool)
        valid[1, :5] = False  # a row with hidden columns, as evicted rows have
        positions = torch.full((3,), 30)
        tokens = torch.tensor([5, 6, 7])
        for step in range(8):
            valid = torch.cat([valid, torch.ones(3, 1, dtype=torch.bool)], 1)
            mask = compat.additive_mask(valid, torch.float32)
            want = compat.forward(m, tokens[:, None], plain, positions[:, None], mask)
            got = compat.forward(m, tokens[:, None], grown, positions[:, None], mask)
            assert torch.equal(want, got)
            assert compat.cache_length(grown) == 31 + step
            moved = grown.layers[0]._k.data_ptr() != buffer
            assert moved == (31 + step > 35)
            positions, tokens = positions + 1, want.argmax(-1)
        for (k0, v0), (k1, v1) in zip(
            compat.cache_tensors(plain), compat.cache_tensors(grown), strict=True
        ):
            assert torch.equal(k0, k1) and torch.equal(v0, v1)


def test_split_layout_equals_a_masked_full_forward():
    """P rows on the full prefix and Q rows on the kept entries only, as two batches: the path
    and a fork at t* give the distributions of a full forward with the evicted prompt entries
    hidden; the Q rows' cache holds about half of the P rows' at retain=0.5."""
    from kvcouple.policies import parse_policy
    from kvcouple.torch_coupling import apply_decoding
    from kvcouple.tracer.kvcache import cache_bytes
    from kvcouple.tracer.layout import SplitRows
    from kvcouple.tracer.prefill import gather_kept, prefill, select
    from tracer_helpers import PROMPT, kept_positions, masked_forward

    m = model("llama")
    n, T, spec = len(PROMPT), 6, "recent:retain=0.5"
    pre = prefill(m, torch.tensor(PROMPT), need_queries=False)
    kept = gather_kept(pre.kv, select(parse_policy(spec), pre))
    everything, evicted = set(range(n)), kept_positions(spec, n)
    rows = SplitRows.start(m, pre.kv, kept, copies=2, steps=T)
    assert cache_bytes(rows.q.cache) / cache_bytes(rows.p.cache) == pytest.approx(
        (len(evicted) - 1 + T) / (n - 1 + T)
    )
    path = [int(x) for x in np.random.default_rng(2).integers(1, 120, T)]
    fed = [PROMPT[-1], *path[:-1]]
    with torch.inference_mode():
        got = [apply_decoding(rows.step(torch.tensor([t] * 4))).numpy() for t in fed]
    for side, keep in ((slice(0, 2), everything), (slice(2, 4), evicted)):
        want = masked_forward(m, PROMPT + path[:-1], n, keep)
        np.testing.assert_allclose(np.stack([g[side] for g in got], 1)[0], want, atol=1e-5)
        np.testing.assert_allclose(np.stack([g[side] for g in got], 1)[1], want, atol=1e-5)

    # Fork replicate 1 at t* = 3 and replicate 0 at t* = 5: re-feed step t*'s token, go on.
    ts = torch.tensor([3, 5])
    column = n - 1 + torch.cat([ts, ts]) - 1
    branch = rows.fork(torch.tensor([1, 0, 3, 2]), column, steps=3)
    own = [[7, 9], [11, 13]]  # tokens after the re-fed one, per branch
    with torch.inference_mode():
        steps = [torch.tensor([fed[2], fed[4]] * 2)]
        steps += [torch.tensor(o * 2) for o in own]
        got = [apply_decoding(branch.step(s)).numpy() for s in steps]
    for b, t_star in enumerate((3, 5)):
        tokens = PROMPT + path[: t_star - 1] + [own[0][b], own[1][b]]
        for side, keep in ((b, everything), (2 + b, evicted)):
            want = masked_forward(m, tokens, n, keep)[t_star - 1 :]
            np.testing.assert_allclose(np.stack([g[side] for g in got]), want, atol=1e-5)


def _dense_attention(query, keys, values, visible, scaling):
    """Plain softmax attention, float64: ``query`` (B, H, q, d); ``keys``/``values`` per row
    (B, kv_heads, S, d); ``visible`` (B, q, S) bool."""
    group = query.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.matmul(query.double(), k.transpose(-1, -2)) * scaling
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    return torch.matmul(torch.softmax(scores, -1), v).transpose(1, 2)


def _attend_by(path: str):
    """``attend_lse`` forced onto one path: CPU flash, the matrix products, or the CUDA
    memory-efficient kernel's adapter over its CPU stand-in (the kernel's contract checked)."""
    import functools

    from kvcouple.testing.efficient_attention import efficient_attention
    from kvcouple.tracer import lse_attention

    if path == "efficient":
        return functools.partial(lse_attention.efficient_lse, kernel=efficient_attention)
    return functools.partial(lse_attention.attend_lse, fused=path == "cpu-flash")


LSE_PATHS = ["cpu-flash", "matrix", "efficient"]


@pytest.mark.parametrize("path", LSE_PATHS)
@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive"])
def test_prefix_attention_equals_attention_over_the_concatenated_cache(
    mask_kind, path, monkeypatch
):
    """Rows in two groups, each group with its own shared prefix (one empty), GQA 8 query heads
    on 2 KV heads, two queries per row, per-row hidden own columns: the prefix-group attention equals
    softmax attention over prefix + own columns, in float64, to float32 rounding; with the
    fused kernel (CPU), the matrix-product path, and CUDA's memory-efficient kernel's adapter."""
    import kvcouple.tracer.prefix as prefix
    from kvcouple.tracer.prefix import PrefixGroup, SharedPrefix, prefix_attention

    monkeypatch.setattr(prefix, "attend_lse", _attend_by(path))

    g = torch.Generator().manual_seed(0)
    B, H, KV, q, d, s = 5, 8, 2, 2, 16, 7
    query = torch.randn(B, H, q, d, generator=g)
    own_k, own_v = torch.randn(B, KV, s, d, generator=g), torch.randn(B, KV, s, d, generator=g)
    prefixes = [
        [(torch.randn(1, KV, n, d, generator=g), torch.randn(1, KV, n, d, generator=g))]
        for n in (11, 0)
    ]
    groups = [PrefixGroup(0, 3, prefixes[0]), PrefixGroup(3, 5, prefixes[1])]
    visible = torch.rand(B, q, s, generator=g) > 0.4
    visible[:, :, -1] = True  # a row always sees the token it was just fed
    if mask_kind == "none":
        visible[:] = True
        mask = None
    elif mask_kind == "bool":
        mask = visible[:, None]
    else:
        mask = torch.zeros(B, 1, q, s).masked_fill(
            ~visible[:, None], torch.finfo(torch.float32).min
        )
    got = prefix_attention(query, own_k, own_v, mask, 0.25, SharedPrefix(groups), 0)
    assert got.shape == (B, q, H, d)
    for grp in groups:
        rows = slice(grp.start, grp.stop)
        n = grp.kv[0][0].shape[2]
        keys = torch.cat([grp.kv[0][0].expand(grp.stop - grp.start, -1, -1, -1), own_k[rows]], 2)
        values = torch.cat([grp.kv[0][1].expand(grp.stop - grp.start, -1, -1, -1), own_v[rows]], 2)
        seen = torch.cat(
            [torch.ones(grp.stop - grp.start, q, n, dtype=torch.bool), visible[rows]], 2
        )
        want = _dense_attention(query[rows], keys, values, seen, 0.25)
        torch.testing.assert_close(got[rows].double(), want, atol=2e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="cover 3 rows of a batch of 5"):
        prefix_attention(query, own_k, own_v, mask, 0.25, SharedPrefix(groups[:1]), 0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_packed_prefix_one_call_equals_attention_over_the_kept_entries(dtype):
    """One document's P rows on its prompt's cache and Q rows on the same cache with the
    evicted entries hidden (per layer and KV head, as ``hidden_entries`` builds them): the
    groups are packed (one prefix call per layer), the result equals dense attention over the
    prompt (P) and over the gathered kept entries (Q) to rounding, and equals the per-group
    loop; with nothing hidden, P and Q rows with equal inputs agree to an ulp."""
    from kvcouple.tracer.prefill import gather_kept, hidden_entries
    from kvcouple.tracer.prefix import PrefixGroup, SharedPrefix, prefix_attention

    g = torch.Generator().manual_seed(3)
    n, H, KV, d, s, n1, keep = 3, 8, 2, 16, 4, 13, 6
    B = 2 * n
    kv = [(torch.randn(1, KV, n1, d, generator=g), torch.randn(1, KV, n1, d, generator=g))]
    kv = [(k.to(dtype), v.to(dtype)) for k, v in kv]
    idx = torch.stack([torch.randperm(n1, generator=g)[:keep].sort().values for _ in range(KV)])
    hidden = hidden_entries(kv, idx[None])
    assert hidden is not None and hidden[0].shape == (1, KV, 1, n1)
    groups = [PrefixGroup(0, n, kv), PrefixGroup(n, B, kv, hidden)]
    shared = SharedPrefix(groups)
    assert shared.packed is not None  # one call for both groups
    query = torch.randn(B, H, 1, d, generator=g, dtype=dtype)
    own_k = torch.randn(B, KV, s, d, generator=g, dtype=dtype)
    own_v = torch.randn(B, KV, s, d, generator=g, dtype=dtype)
    got = prefix_attention(query, own_k, own_v, None, 0.25, shared, 0)
    kept = gather_kept(kv, idx[None])
    tol = dict(atol=1e-12, rtol=1e-12) if dtype == torch.float64 else dict(atol=2e-6, rtol=1e-5)
    for rows, (kp, vp) in ((slice(0, n), kv[0]), (slice(n, B), kept[0])):
        keys = torch.cat([kp.expand(n, -1, -1, -1), own_k[rows]], 2).double()
        values = torch.cat([vp.expand(n, -1, -1, -1), own_v[rows]], 2).double()
        seen = torch.ones(n, 1, keys.shape[2], dtype=torch.bool)
        want = _dense_attention(query[rows].double(), keys, values, seen, 0.25)
        torch.testing.assert_close(got[rows].double(), want, **tol)
    loop = SharedPrefix(groups)
    loop.packed = None  # the per-group calls
    torch.testing.assert_close(prefix_attention(query, own_k, own_v, None, 0.25, loop, 0), got)
    # Nothing hidden (a policy that keeps everything): equal inputs, equal outputs.
    assert hidden_entries(kv, torch.arange(n1).expand(1, KV, n1)) is None
    same = SharedPrefix(
        [PrefixGroup(0, n, kv), PrefixGroup(n, B, kv, [torch.zeros_like(hidden[0])])]
    )
    assert same.packed is not None
    q2, k2, v2 = (
        query[:n].repeat(2, 1, 1, 1),
        own_k[:n].repeat(2, 1, 1, 1),
        own_v[:n].repeat(2, 1, 1, 1),
    )
    out = prefix_attention(q2, k2, v2, None, 0.25, same, 0)
    # (one attention call gives both halves the same bits; the elementwise merge after it may
    # take its vector path for one half and its scalar tail for the other: an ulp at most)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(out[:n], out[n:], atol=4 * eps, rtol=4 * eps)
    # A fork of these rows reuses the packed masks rather than stacking copies.
    fork = shared.of_groups([PrefixGroup(0, 1, kv), PrefixGroup(1, 2, kv, hidden)])
    assert fork.packed is not None and fork.packed[0][2] is shared.packed[0][2]


@pytest.mark.parametrize("path", LSE_PATHS)
def test_a_batch_of_documents_in_one_pack_is_one_call_exact_per_document(path):
    """Three documents of different prompt lengths in one :class:`PromptPack` (padded to the
    longest), each with P rows on its prompt and Q rows on its kept entries: one prefix call
    per layer covers every row, and each row's output equals dense float64 attention over its
    own document's prompt (P) or kept entries (Q) followed by its own columns; the fused
    kernel (CPU) and the matrix-product path (other devices) alike."""
    import kvcouple.tracer.prefix as prefix
    from kvcouple.tracer.prefill import gather_kept, hidden_entries
    from kvcouple.tracer.prefix import PrefixGroup, PromptPack, SharedPrefix, prefix_attention

    g = torch.Generator().manual_seed(7)
    n, H, KV, d, s = 2, 8, 2, 16, 3
    lengths, keep = [9, 13, 6], [4, 7, 6]
    D = len(lengths)
    docs = [
        [(torch.randn(1, KV, m, d, generator=g), torch.randn(1, KV, m, d, generator=g))]
        for m in lengths
    ]
    pack = PromptPack.allocate(docs[0], lengths)
    for i, kv in enumerate(docs):
        pack.put(i, kv)
        assert torch.equal(pack.slot(i)[0][0], kv[0][0])
    idx = [
        torch.stack([torch.randperm(m, generator=g)[:k].sort().values for _ in range(KV)])[None]
        for m, k in zip(lengths, keep, strict=True)
    ]
    views = [pack.slot(i) for i in range(D)]
    groups = [PrefixGroup(i * n, (i + 1) * n, views[i], slot=(pack, i)) for i in range(D)]
    groups += [
        PrefixGroup(
            (D + i) * n, (D + i + 1) * n, views[i], hidden_entries(views[i], idx[i]), (pack, i)
        )
        for i in range(D)
    ]
    shared = SharedPrefix(groups)
    assert shared.packed is not None and shared.packed[0][0].shape[0] == D
    # The masks' rows are stored 16-element aligned, so CUDA's kernel takes them as they are
    # (no padded copy per layer and step).
    masks = shared.packed[0][2]
    assert masks.shape[-1] == max(lengths) and all(st % 16 == 0 for st in masks.stride()[:-1])
    B = 2 * D * n
    query = torch.randn(B, H, 1, d, generator=g)
    own_k, own_v = torch.randn(B, KV, s, d, generator=g), torch.randn(B, KV, s, d, generator=g)
    real = _attend_by(path)
    calls = []

    def attend(*args, **kwargs):
        calls.append(args[1].shape[0])
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(prefix, "attend_lse", attend)
        got = prefix_attention(query, own_k, own_v, None, 0.25, shared, 0)
    assert calls == [B, D]  # the own columns, then every document's prefix at once
    for i in range(D):
        kept = gather_kept(docs[i], idx[i])
        for side, (kp, vp) in ((0, docs[i][0]), (1, kept[0])):
            rows = slice((side * D + i) * n, (side * D + i + 1) * n)
            keys = torch.cat([kp.expand(n, -1, -1, -1), own_k[rows]], 2)
            values = torch.cat([vp.expand(n, -1, -1, -1), own_v[rows]], 2)
            seen = torch.ones(n, 1, keys.shape[2], dtype=torch.bool)
            want = _dense_attention(query[rows], keys, values, seen, 0.25)
            torch.testing.assert_close(got[rows].double(), want, atol=2e-6, rtol=1e-5)
    # A fork of these rows (branches per document differ): documents out of the pack's order,
    # unequal rows per document and side, a document split over two runs. Its rows are
    # gathered into one call and back; each still equals dense attention over its own prefix.
    layout = [(0, 1, 1), (1, 0, 3), (0, 2, 2), (1, 2, 1), (0, 0, 1), (1, 1, 2), (1, 0, 1)]
    fork_groups, fork_kinds, row = [], [], 0
    for side, doc, count in layout:  # (P or Q, document, rows)
        hidden = groups[D + doc].hidden if side else None
        fork_groups.append(PrefixGroup(row, row + count, views[doc], hidden, (pack, doc)))
        fork_kinds += [(side, doc)] * count
        row += count
    fork = shared.of_groups(fork_groups)
    assert fork.packed is not None and fork.gather is not None
    assert fork.packed[0][2] is shared.packed[0][2]  # the source batch's masks, not copies
    Bf = len(fork_kinds)
    qf = torch.randn(Bf, H, 1, d, generator=g)
    kf, vf = torch.randn(Bf, KV, s, d, generator=g), torch.randn(Bf, KV, s, d, generator=g)
    calls.clear()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(prefix, "attend_lse", attend)
        got = prefix_attention(qf, kf, vf, None, 0.25, fork, 0)
    assert calls == [Bf, D]
    for r, (side, doc) in enumerate(fork_kinds):
        kp, vp = docs[doc][0] if side == 0 else gather_kept(docs[doc], idx[doc])[0]
        keys = torch.cat([kp, kf[r : r + 1]], 2)
        values = torch.cat([vp, vf[r : r + 1]], 2)
        seen = torch.ones(1, 1, keys.shape[2], dtype=torch.bool)
        want = _dense_attention(qf[r : r + 1], keys, values, seen, 0.25)
        torch.testing.assert_close(got[r : r + 1].double(), want, atol=2e-6, rtol=1e-5)
    # A fork that leaves a document out is not packed: the call would read a prompt no row
    # attends to (a call per group instead).
    two_docs = [
        PrefixGroup(0, 1, views[1], None, (pack, 1)),
        PrefixGroup(1, 3, views[0], groups[D].hidden, (pack, 0)),
    ]
    assert shared.of_groups(two_docs).packed is None
    # A group whose slot label disagrees with its tensors (document 0's label on document 1's
    # prompt) is not packed: the packed call would attend to the label's prompt.
    mislabelled = [*groups]
    mislabelled[0] = PrefixGroup(0, n, views[1], None, (pack, 0))
    assert SharedPrefix(mislabelled).packed is None
    with pytest.raises(ValueError, match="document 1 has 9 entries, not 13"):
        pack.put(1, docs[0])


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_shared_layout_equals_a_masked_full_forward(attn):
    """P rows over the prompt's cache and Q rows over the kept entries, each held once, in one
    batch: the path and a fork at t* give the distributions of a full forward with the evicted
    prompt entries hidden; the rows' own caches hold only the generated columns."""
    from kvcouple.policies import parse_policy
    from kvcouple.torch_coupling import apply_decoding
    from kvcouple.tracer.layout import SharedRows
    from kvcouple.tracer.memory import ModelShape
    from kvcouple.tracer.prefill import gather_kept, prefill, select
    from tracer_helpers import PROMPT, kept_positions, masked_forward

    m = model("qwen3", attn)
    n, T, spec = len(PROMPT), 6, "recent:retain=0.5"
    pre = prefill(m, torch.tensor(PROMPT), need_queries=False)
    kept = gather_kept(pre.kv, select(parse_policy(spec), pre))
    everything, evicted = set(range(n)), kept_positions(spec, n)
    rows = SharedRows.start(m, pre.kv, kept, copies=2, steps=T)
    assert rows.cache_bytes() == 4 * T * ModelShape.of_model(m).token_bytes
    path = [int(x) for x in np.random.default_rng(2).integers(1, 120, T)]
    fed = [PROMPT[-1], *path[:-1]]
    with torch.inference_mode():
        got = [apply_decoding(rows.step(torch.tensor([t] * 4))).numpy() for t in fed]
    for side, keep in ((slice(0, 2), everything), (slice(2, 4), evicted)):
        want = masked_forward(m, PROMPT + path[:-1], n, keep)
        for r in range(2):
            np.testing.assert_allclose(np.stack([g[side] for g in got], 1)[r], want, atol=1e-5)

    # Fork replicate 1 at t* = 1 (sees only the prefix) and replicate 0 at t* = 5.
    ts = torch.tensor([1, 5])
    column = n - 1 + torch.cat([ts, ts]) - 1
    branch = rows.fork(torch.tensor([1, 0, 3, 2]), column, steps=3)
    own = [[7, 9], [11, 13]]
    with torch.inference_mode():
        steps = [torch.tensor([fed[0], fed[4]] * 2)]
        steps += [torch.tensor(o * 2) for o in own]
        got = [apply_decoding(branch.step(s)).numpy() for s in steps]
    for b, t_star in enumerate((1, 5)):
        tokens = PROMPT + path[: t_star - 1] + [own[0][b], own[1][b]]
        for side, keep in ((b, everything), (2 + b, evicted)):
            want = masked_forward(m, tokens, n, keep)[t_star - 1 :]
            np.testing.assert_allclose(np.stack([g[side] for g in got]), want, atol=1e-5)
    with pytest.raises(ValueError, match="P rows, then Q rows"):
        rows.fork(torch.tensor([2, 0, 3, 1]), column, steps=3)
    with pytest.raises(ValueError, match="only columns already fed"):  # T columns fed so far
        rows.fork(torch.tensor([1, 0, 3, 2]), torch.full((4,), n - 1 + T + 1), steps=3)


def test_shared_prefix_is_refused_where_it_cannot_be_exact():
    """Soft-capped, sink and windowed models never get the shared layout (auto and asked for
    falls back); a forward with a prefix on a model whose attention bypasses the wrapper is
    refused rather than run without the prefix."""
    from kvcouple.tracer import compat
    from kvcouple.tracer.attention import UnsupportedModelError
    from kvcouple.tracer.memory import ModelShape, choose_layout
    from kvcouple.tracer.prefix import PrefixGroup, SharedPrefix

    refused = {
        "gemma2": dict(layer_types=["full_attention"] * 2),  # soft-cap only
        "gpt_oss": dict(layer_types=["full_attention"] * 2),  # sinks only
        "mistral_window": {},
        "bloom": {},  # no attention interface (ALiBi too)
    }
    for arch, kw in refused.items():
        shape = ModelShape.of_model(tiny_model(arch, seed=1, **kw))
        assert not shape.shared_prefix, arch
        assert choose_layout(shape, 40, 20, 2, False, "shared") != "shared", arch
    assert ModelShape.of_model(model("llama")).shared_prefix

    bypass = tiny_model("bloom", seed=1)  # its attention does not dispatch through the interface
    kv = [(torch.zeros(1, 1, 3, 16), torch.zeros(1, 1, 3, 16))] * 2
    prefix = SharedPrefix([PrefixGroup(0, 1, kv)])
    cache = compat.new_cache()
    with pytest.raises(UnsupportedModelError, match="shared prefix"):
        compat.forward(bypass, torch.tensor([[1]]), cache, torch.tensor([[3]]), prefix=prefix)


# Capture only what a policy needs ----------------------------------------------------------------
@pytest.mark.parametrize(
    "spec, kept_queries",
    [
        ("snapkv:retain=0.5,window=4", 4),
        ("tova:retain=0.5", 1),
        ("h2o:retain=0.5", 0),
        ("recent:retain=0.5", None),
    ],
)
def test_prefill_captures_only_what_the_policy_reads(spec, kept_queries):
    """SnapKV keeps its window's queries, TOVA the last one, H2O none (its accumulated
    attention is summed while prefilling), recent nothing at all; the kept sets equal those
    from a capture of every query."""
    from kvcouple.policies import parse_policy
    from kvcouple.tracer.prefill import prefill, select
    from tracer_helpers import PROMPT

    m = model("qwen3")
    policy = parse_policy(spec)
    ids = torch.tensor(PROMPT)
    lean = prefill(m, ids, policy.NEEDS_QUERIES, policies=[policy])
    if kept_queries is None:
        assert lean.capture is None
        return
    full = prefill(m, ids, need_queries=True)
    for layer in range(2):
        assert lean.capture.calls[layer].query.shape[2] == kept_queries
        assert full.capture.calls[layer].query.shape[2] == len(PROMPT) - 1
    assert torch.equal(select(policy, lean), select(policy, full))
    if kept_queries == 0:  # the sums are the same to the bit
        ctx_lean, ctx_full = lean.context(), full.context()
        for layer in range(2):
            assert torch.equal(
                ctx_lean.accumulated_attention(layer), ctx_full.accumulated_attention(layer)
            )
        with pytest.raises(RuntimeError, match="was not captured"):
            lean.capture.attention(0, 0, 3)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral_window"])
def test_split_shared_and_joint_layouts_trace_the_same_document(arch):
    """The split layout (Q rows on their kept entries only, two batches), the shared one (one
    batch over prefixes held once) and the joint one (Q padded and masked) give the same
    records to float noise; models with sliding windows stay in the joint layout."""
    from kvcouple.store import Record
    from kvcouple.tracer import trace_document

    try:
        m = tiny_model(arch, seed=3, max_position_embeddings=512)
    except (ImportError, ValueError) as e:
        pytest.skip(str(e))
    from kvcouple.tracer.memory import ModelShape, choose_layout

    shape = ModelShape.of_model(m)
    assert choose_layout(shape, 40, 20, 2, False, "split") == (
        "joint" if arch == "mistral_window" else "split"
    )
    assert choose_layout(shape, 40, 20, 2, False, "auto") == (
        "joint" if arch == "mistral_window" else "shared"
    )
    prompt = np.random.default_rng(4).integers(1, 120, 40).tolist()
    specs = ["snapkv:retain=0.5,window=4", "recent:retain=0.3"]
    got = {}
    for layout in ("joint", "split", "shared"):
        settings = TraceSettings(
            horizon=6,
            replicates=2,
            branches=2,
            window=3,
            record=Record.parse("topk:5"),
            cache_layout=layout,
        )
        got[layout], _ = trace_document(m, prompt, specs, settings, seed=2)
    for layout in ("split", "shared"):
        for name, a in got["joint"].items():
            b = got[layout][name]
            if a.dtype.kind == "f":
                np.testing.assert_allclose(a, b, atol=2e-5, err_msg=f"{layout}: {name}")
            else:
                np.testing.assert_array_equal(a, b, err_msg=f"{layout}: {name}")
