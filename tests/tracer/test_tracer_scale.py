"""The tracer at scale: provenance attributes, the memory footprint, ``--dry-run``."""

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

from tracer_helpers import is_tensor, model, one_thread  # noqa: E402, F401 - autouse fixture

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


# The memory footprint ------------------------------------------------------------------------------
def _live_tensor_bytes(exclude: set[int]) -> int:
    """Bytes of every distinct CPU tensor storage alive now, except ``exclude`` (the weights)."""
    import gc
    import warnings

    seen = {}
    # isinstance on deprecated torch module attributes warns, and so does the data pointer of
    # a fake tensor left by an earlier torch.compile (it holds no memory: skipped).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tensors = [o for o in gc.get_objects() if is_tensor(o)]
        for o in tensors:
            if o.device.type != "cpu" or type(o).__name__ == "FakeTensor":
                continue
            storage = o.untyped_storage()
            try:
                ptr = storage.data_ptr()
            except RuntimeError:  # a fake storage: no memory
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
    from kvcouple.tracer.memory import ModelShape, Sizes, document_footprint

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
        plan = document_footprint(shape, n, [parse_policy(spec)], Sizes(T, R, K, L, layout), None)
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
    auto = document_footprint(shape, n, [parse_policy(spec)], Sizes(T, R, K, L), None)
    assert auto.layout == "shared"


def test_auto_branch_batch_is_the_largest_that_fits():
    from kvcouple.policies import parse_policy
    from kvcouple.tracer.memory import (
        FootprintTooLargeError,
        ModelShape,
        Sizes,
        choose_branch_batch,
        document_footprint,
    )

    shape = ModelShape.of_model(model("llama"))
    pols = [parse_policy("snapkv:retain=0.5"), parse_policy("recent:budget=8")]
    # (joint: the branches' copies of the prompt make the peak grow with the batch)
    sizes = Sizes(horizon=16, replicates=4, branches=3, window=4, layout="joint")
    peaks = [document_footprint(shape, 300, pols, sizes, b).peak for b in range(1, 13)]
    assert all(a < b for a, b in zip(peaks, peaks[1:], strict=False))  # grows with the batch
    for b in (1, 5, 12):
        chosen = choose_branch_batch(shape, 300, pols, sizes, peaks[b - 1] + 1, doc_id="d")
        assert chosen.branch_batch == b and chosen.fits
    just_below = choose_branch_batch(shape, 300, pols, sizes, peaks[6] - 1)
    assert just_below.branch_batch == 6
    with pytest.raises(
        FootprintTooLargeError, match=r"'d' \(300 prompt tokens\) needs .* at its peak"
    ):
        choose_branch_batch(shape, 300, pols, sizes, peaks[0] - 1, doc_id="d")


def test_a_document_that_cannot_fit_is_refused_before_the_store_is_written(tmp_path):
    from kvcouple.tracer.memory import FootprintTooLargeError, ModelShape

    m = model("llama")
    weights = ModelShape.of_model(m).weight_bytes
    prompts = [
        Prompt("short", tuple(range(1, 13))),
        Prompt("long", tuple(i % 120 + 1 for i in range(400))),
    ]
    settings = TraceSettings(horizon=4, replicates=2, branches=2, window=2)
    # Enough for the short document, not for the long one.
    with pytest.raises(FootprintTooLargeError, match="'long' .* needs"):
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
    from kvcouple.tracer.memory import FootprintTooLargeError, ModelShape

    m = model("llama")
    prompts = [Prompt("d", tuple(range(1, 13)))]
    weights = ModelShape.of_model(m).weight_bytes
    monkeypatch.setattr(memory, "available_memory", lambda: weights + 2**20)
    settings = TraceSettings(horizon=2000, replicates=8, branches=2, window=2)
    with pytest.raises(FootprintTooLargeError, match=r"'d' .* needs .* shorter --horizon"):
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
    assert (
        "memory footprint: 2 layers x 2 KV heads x 16" in text
        and "0.5 KiB per cached token" in text
    )
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
    with pytest.raises(SystemExit) as exit:  # argparse's usage error (kvcouple.cliargs)
        cli_main([*base, "--branch-batch", "0"])
    assert exit.value.code == 2
    assert "argument --branch-batch: 0 is not an integer >= 1 (or 'auto')" in (
        capsys.readouterr().err
    )
    assert not out.exists()


# Caches that grow in place ---------------------------------------------------------------------
def test_preallocated_cache_equals_the_dynamic_cache_and_writes_in_place():
    """Decoding on a preallocated cache gives the dynamic cache's logits bit for bit, with a
    per-row mask; within capacity the buffer never moves, beyond it the cache grows."""
    from kvcouple.tracer import compat, kvcache
    from kvcouple.tracer.kvcache import PreallocatedLayer, cache_bytes, cache_with_capacity

    if PreallocatedLayer is None:
        pytest.skip("transformers without cache layers: the plain dynamic cache is used")
    m = model("llama")
    prompt = torch.as_tensor(np.random.default_rng(5).integers(1, 120, (1, 30)))
    with torch.inference_mode():
        prefix = kvcache.new_cache()
        compat.forward(m, prompt, prefix, torch.arange(30)[None])
        kv = [
            (k.expand(3, -1, -1, -1).contiguous(), v.expand(3, -1, -1, -1).contiguous())
            for k, v in kvcache.cache_tensors(prefix)
        ]
        plain = kvcache.cache_from_tensors(kv)
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
            assert kvcache.cache_length(grown) == 31 + step
            moved = grown.layers[0]._k.data_ptr() != buffer
            assert moved == (31 + step > 35)
            positions, tokens = positions + 1, want.argmax(-1)
        for (k0, v0), (k1, v1) in zip(
            kvcache.cache_tensors(plain), kvcache.cache_tensors(grown), strict=True
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
    pre = prefill(m, torch.tensor(PROMPT), needs_attention=False)
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
    pre = prefill(m, torch.tensor(PROMPT), needs_attention=False)
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
    from kvcouple.tracer import compat, kvcache
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
    cache = kvcache.new_cache()
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
    lean = prefill(m, ids, policy.NEEDS_ATTENTION, policies=[policy])
    if kept_queries is None:
        assert lean.capture is None
        return
    full = prefill(m, ids, needs_attention=True)
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
