"""kvcouple's ``kvpress:`` policies against kvpress's own pipeline (prefill): the same kept
entries per layer and KV head, for every kvpress ScorerPress that runs on a tiny Llama on CPU;
and ``tova:heads=all`` / ``observed`` against TOVAPress / ObservedAttentionPress.

kvpress pins transformers < 5.3, so this runs in its own environment (``.ci/kvpress_job.sh``);
elsewhere it is skipped. kvpress's side is its pipeline's prefill: ``with press(model):
model.model(input_ids=context, past_key_values=cache)``, with the prompt prefix as the context
(kvcouple evicts from the prompt minus its re-fed last token). Its kept entries are read back
from the compressed cache by matching each kept key to the uncompressed cache's keys.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
kvpress = pytest.importorskip("kvpress", exc_type=ImportError)

from transformers import DynamicCache  # noqa: E402

from kvcouple.policies import PolicyParameterError, parse_policy  # noqa: E402
from kvcouple.testing import tiny_model  # noqa: E402
from kvcouple.tracer.prefill import prefill, select  # noqa: E402

pytestmark = pytest.mark.torch

PROMPT = torch.tensor(np.random.default_rng(1).integers(1, 127, size=49).tolist())
RATIO = 0.5

# Fields that make a press run on a 48-token context (defaults assume thousands of tokens).
FIELDS = {
    "SnapKVPress": "window_size=8,kernel_size=5",
    "StreamingLLMPress": "n_sink=4",
    "RandomPress": "seed=3",
    "LagKVPress": "lag_size=8,n_sink=2",
    "CURPress": "num_sinks=2,local_window_size=4",
    "ExpectedAttentionPress": "n_future_positions=16,n_sink=2",
    "CapPress": "n_future_positions=16,n_sink=2",
    "CompactorPress": "sink_size_start=2,sink_size_end=2,chunk_size=16,sketch_dimension=8",
    "LeverageScorePress": "sketch_dimension=8",
    "NonCausalAttnPress": "chunk_size=16",
}
# Presses whose score reads the layer's attention weights: kvpress needs eager attention.
EAGER = {"ObservedAttentionPress"}
# Presses that cannot run here at all, and why.
CANNOT_RUN = {
    "ExpectedAttentionStatsPress": "loads query statistics from the Hugging Face hub",
    "KVzapPress": "loads its scoring model from the Hugging Face hub",
    "QFilterPress": "loads its filters from the Hugging Face hub",
}
# Scorer presses kvcouple refuses up front, and the words of the refusal.
REFUSED = {
    "PyramidKVPress": "overrides ScorerPress.compress",
    "CriticalKVPress": "wraps another press",
}


def scorer_presses() -> list[str]:
    return sorted(
        n
        for n in dir(kvpress)
        if isinstance(getattr(kvpress, n), type)
        and issubclass(getattr(kvpress, n), kvpress.ScorerPress)
        and n != "ScorerPress"
    )


def model(attn: str):
    # A fresh model per side: kvpress sets attributes on the model's attention modules.
    return tiny_model("llama", seed=7, attn_implementation=attn, num_hidden_layers=3)


def kvpress_kept(press, attn: str, make=None, prompt=None) -> torch.Tensor:
    """Positions kvpress keeps, ``(layers, kv_heads, kept)`` sorted (on the tiny Llama unless
    ``make(attn)`` builds another model; on ``prompt``, default PROMPT)."""
    prompt = PROMPT if prompt is None else prompt
    prefix = prompt[None, :-1]
    m = (make or model)(attn)
    full = DynamicCache()
    with torch.no_grad():
        m.model(input_ids=prefix, past_key_values=full)
    torch.manual_seed(0)  # presses that draw from the global generator draw alike on both sides
    cache = DynamicCache()
    with torch.no_grad(), press(m):
        m.model(input_ids=prefix, past_key_values=cache)
    out = []
    for layer in range(len(cache.layers)):
        kept, every = cache.layers[layer].keys[0], full.layers[layer].keys[0]  # (kv, k|n, d)
        dist = (kept[:, :, None, :] - every[:, None, :, :]).abs().amax(-1)  # (kv, k, n)
        assert float(dist.min(-1).values.max()) < 1e-4, "a kept key matches no cached key"
        out.append(torch.sort(dist.argmin(-1), dim=-1).values)
    return torch.stack(out)


def kvcouple_kept(spec: str, attn: str, make=None, prompt=None) -> torch.Tensor:
    policy = parse_policy(spec)
    prompt = PROMPT if prompt is None else prompt
    pre = prefill((make or model)(attn), prompt, policy.NEEDS_ATTENTION, policies=[policy])
    torch.manual_seed(0)
    return select(policy, pre).cpu()


@pytest.mark.parametrize("name", scorer_presses())
def test_kvpress_policy_keeps_what_kvpress_keeps(name):
    fields = FIELDS.get(name, "")
    spec = f"kvpress:{name},compression_ratio={RATIO}" + (f",{fields}" if fields else "")
    if name in REFUSED:
        with pytest.raises(PolicyParameterError, match=REFUSED[name]):
            parse_policy(spec)
        return
    if name in CANNOT_RUN:
        pytest.skip(f"{name} {CANNOT_RUN[name]} (nothing is downloaded here)")
    policy = parse_policy(spec)
    attn = "eager" if name in EAGER else "sdpa"
    want = kvpress_kept(policy.press, attn)
    got = kvcouple_kept(spec, attn)
    n1 = PROMPT.shape[0] - 1
    assert got.shape == want.shape == (3, 2, int(n1 * (1 - RATIO)))
    assert torch.equal(got, want), f"{name}: kvcouple {got.tolist()} vs kvpress {want.tolist()}"


def test_observed_equals_observed_attention_press():
    want = kvpress_kept(kvpress.ObservedAttentionPress(compression_ratio=RATIO), "eager")
    for attn in ("eager", "sdpa"):  # kvcouple's capture scores with eager attention either way
        got = kvcouple_kept(f"observed:budget={want.shape[-1] + 1}", attn)
        assert torch.equal(got, want), attn


def test_tova_heads_all_equals_tova_press_but_for_the_last_entry():
    """TOVAPress always keeps the context's last entry (scored above every other, as its own
    comment says); TOVA's rule and kvcouple may evict it. Identical whenever kvcouple keeps it;
    otherwise the sets differ by exactly that entry and kvcouple's lowest-scored kept one."""
    want = kvpress_kept(kvpress.TOVAPress(compression_ratio=RATIO), "sdpa")
    keep = want.shape[-1]
    got = kvcouple_kept(f"tova:budget={keep + 1},heads=all", "sdpa")
    last = PROMPT.shape[0] - 2
    pol = parse_policy(f"tova:budget={keep + 1}")
    ctx = prefill(model("sdpa"), PROMPT, True, policies=[pol]).context()
    swapped = 0
    for layer in range(got.shape[0]):
        assert torch.equal(got[layer], got[layer, :1].expand_as(got[layer]))  # one set per layer
        mine, theirs = set(got[layer, 0].tolist()), set(want[layer, 0].tolist())
        if last in mine:
            assert mine == theirs, layer
            continue
        swapped += 1
        score = pol.score(ctx, layer)[0]
        lowest = min(mine, key=lambda p: (float(score[p]), -p))
        assert theirs == (mine - {lowest}) | {last}, layer
    # With the forced entry given back, kvpress's press through kvcouple is identical.
    tova_press = kvcouple_kept(f"kvpress:TOVAPress,compression_ratio={RATIO}", "sdpa")
    assert torch.equal(tova_press, want)
    print(
        f"tova:heads=all vs TOVAPress: {swapped} of {got.shape[0]} layers differ by the last entry"
    )


def test_refusals_before_any_model():
    with pytest.raises(PolicyParameterError, match="AdaKVPress is not a scorer press"):
        parse_policy("kvpress:AdaKVPress,compression_ratio=0.5")
    with pytest.raises(PolicyParameterError, match="has no press 'Nope'"):
        parse_policy("kvpress:Nope")
    with pytest.raises(PolicyParameterError, match="has no field windw"):
        parse_policy("kvpress:SnapKVPress,windw=3")
    with pytest.raises(PolicyParameterError, match="mode=decode"):
        parse_policy("kvpress:SnapKVPress,compression_ratio=0.5,mode=decode")
    spec = parse_policy("kvpress:SnapKVPress,compression_ratio=0.5").spec()
    assert spec == "kvpress:SnapKVPress,compression_ratio=0.5,window_size=64,kernel_size=5"
    assert parse_policy(spec).spec() == spec


def test_cli_trace_with_a_kvpress_press_and_analysis(tmp_path, capsys, monkeypatch):
    """``kvcouple trace --policy kvpress:KnormPress,...`` on the embedded model, next to the
    built-in ``knorm``; the analysis reads the store; a non-scorer press is refused before any
    model loads (the model path does not exist)."""
    import json

    import xarray as xr

    from kvcouple.cli import main
    from kvcouple.models import default_prompts_path

    lines = default_prompts_path().read_text().splitlines()[:2]
    prompts = tmp_path / "two.jsonl"
    prompts.write_text("\n".join(lines) + "\n")
    out, report = tmp_path / "run.zarr", tmp_path / "analysis"
    spec = "kvpress:KnormPress,compression_ratio=0.5"
    args = ["trace", "--prompts", str(prompts), "--out", str(out), "--quiet"]
    args += ["--policy", spec, "--policy", "knorm:retain=0.5", "--horizon", "3"]
    args += ["--replicates", "2", "--branches", "1"]
    assert main(args) == 0
    ds = xr.open_zarr(out)
    assert list(ds["policy"].values) == [spec, "knorm:retain=0.5"]
    assert bool(ds["completed"].all())
    analyze = ["analyze", str(out), "--out", str(report), "--not-preregistered"]
    assert main([*analyze, "--n-boot", "50", "--no-figures", "--quiet"]) == 0
    results = json.loads((report / "results.json").read_text())
    assert spec in json.dumps(results)
    capsys.readouterr()

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("kvcouple.models.load_model", no_load)
    monkeypatch.setattr("kvcouple.tracer.cli.load_model", no_load)  # the name trace calls
    bad = ["trace", "--prompts", str(prompts), "--out", str(tmp_path / "x.zarr")]
    assert main([*bad, "--policy", "kvpress:AdaKVPress"]) == 2
    err = capsys.readouterr().err
    assert "AdaKVPress is not a scorer press" in err and "loaded" not in err
    assert not (tmp_path / "x.zarr").exists()


def test_kvpress_imported_after_kvcouple_attended():
    """kvpress wraps every registered attention function when first imported; kvcouple's own
    entries (registered by an earlier trace) stay kvcouple's, so tracing goes on working."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        """
        import sys
        import torch
        assert "kvpress" not in sys.modules
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        from kvcouple.policies import parse_policy
        from kvcouple.testing import tiny_model
        from kvcouple.tracer.prefill import prefill, select
        m = tiny_model("llama", seed=7, attn_implementation="sdpa")
        ids = torch.arange(1, 30)
        snap = parse_policy("snapkv:budget=9,window=4")
        select(snap, prefill(m, ids, True, policies=[snap]))  # registers kvcouple_sdpa
        ours = ALL_ATTENTION_FUNCTIONS["kvcouple_sdpa"]
        press = parse_policy("kvpress:SnapKVPress,budget=9,window_size=4")  # imports kvpress
        assert "kvpress" in sys.modules and ALL_ATTENTION_FUNCTIONS["kvcouple_sdpa"] is ours
        idx = select(press, prefill(m, ids, False, policies=[press]))
        print(tuple(idx.shape))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("(2, 2, 8)")  # (layers, kv_heads, kept - 1)


@pytest.mark.parametrize("press, builtin", [("KnormPress", "knorm"), ("StreamingLLMPress", None)])
def test_kvpress_policy_while_decoding(tmp_path, press, builtin):
    """``mode=decode`` re-scores the current cache with the press's own score, as kvpress's
    DecodingPress does: ``kvpress:KnormPress`` traces exactly as the built-in ``knorm`` (the
    same kept entries at every step, so the same store); presses reading hidden states are
    refused with mode=decode (test_refusals_before_any_model)."""
    import xarray as xr

    from kvcouple.tracer import Prompt, TraceSettings, trace

    m = model("sdpa")
    prompts = [Prompt("a", tuple(PROMPT.tolist())), Prompt("b", tuple(PROMPT.tolist()[::-1]))]
    settings = TraceSettings(horizon=6, replicates=2, branches=1, window=4)
    spec = f"kvpress:{press},budget=12,mode=decode" + (",n_sink=2" if builtin is None else "")
    trace(m, prompts, [spec], settings, tmp_path / "press.zarr", seed=0, progress=False)
    ds = xr.open_zarr(tmp_path / "press.zarr")
    assert bool(ds["completed"].all())
    if builtin is None:
        return
    trace(
        m,
        prompts,
        [f"{builtin}:budget=12,mode=decode"],
        settings,
        tmp_path / "own.zarr",
        seed=0,
        progress=False,
    )
    own = xr.open_zarr(tmp_path / "own.zarr")
    for name in ds.data_vars:
        if ds[name].dtype.kind in "fiub":
            np.testing.assert_array_equal(ds[name].values, own[name].values, err_msg=name)


# On a real model (SmolLM2-135M-Instruct, the real_model fixture) and a real prompt of 500+
# tokens: kvcouple's own policies keep what kvpress's presses keep on its real attention.
REAL = {
    "snapkv": ("snapkv:budget={b},window=16,kernel=5,pool=avg", "SnapKVPress", {"window_size": 16, "kernel_size": 5}, "sdpa"),
    "streaming": ("streaming:sinks=4,budget={b}", "StreamingLLMPress", {"n_sink": 4}, "sdpa"),
    "knorm": ("knorm:budget={b}", "KnormPress", {}, "sdpa"),
    "observed": ("observed:budget={b}", "ObservedAttentionPress", {}, "eager"),
}  # fmt: skip


@pytest.fixture(scope="module")
def real(smollm2_dir):
    from kvcouple.models import load_tokenizer
    from kvcouple.testing.real_model import stdlib_documents

    doc = stdlib_documents(load_tokenizer(smollm2_dir), 1)[0]  # 530-930 tokens, chat template

    def make(attn):  # a fresh model per side: kvpress sets attributes on attention modules
        from kvcouple.models import load_model

        return load_model(smollm2_dir, device="cpu", attn_implementation=attn)[0]

    return make, torch.tensor(doc["input_ids"])


@pytest.mark.real_model
@pytest.mark.parametrize("name", sorted(REAL))
def test_policies_keep_what_kvpress_keeps_on_a_real_model(real, name):
    make, prompt = real
    assert prompt.shape[0] >= 500
    spec, press, fields, attn = REAL[name]
    want = kvpress_kept(
        getattr(kvpress, press)(compression_ratio=RATIO, **fields), attn, make, prompt
    )
    spec = spec.format(b=want.shape[-1] + 1)
    got = kvcouple_kept(spec, attn, make, prompt)
    assert got.shape == want.shape
    differ = (~(got == want).all(-1)).nonzero().tolist()
    if differ and name == "knorm":
        # Layer 0's key of a repeated token has one norm at every position (RoPE keeps norms):
        # such ties may be broken either way. Where the sets differ, only tied entries may.
        pol = parse_policy(spec)
        ctx = prefill(make(attn), prompt, False, policies=[pol]).context()
        for layer, h in differ:
            score = pol.score(ctx, layer)[h].double()
            swapped = sorted(set(got[layer, h].tolist()) ^ set(want[layer, h].tolist()))
            spread = float(score[swapped].max() - score[swapped].min())
            assert spread <= 1e-5 * float(score.abs().max()), (layer, h, swapped, spread)
        return
    assert not differ, f"{name}: (layer, head) pairs that differ: {differ}"


@pytest.mark.real_model
def test_tova_heads_all_keeps_what_tova_press_keeps_on_a_real_model(real):
    """As on the tiny model: equal wherever kvcouple keeps the context's last entry, else the
    sets differ by exactly that entry and kvcouple's lowest-scored kept one."""
    make, prompt = real
    want = kvpress_kept(kvpress.TOVAPress(compression_ratio=RATIO), "sdpa", make, prompt)
    got = kvcouple_kept(f"tova:budget={want.shape[-1] + 1},heads=all", "sdpa", make, prompt)
    last = prompt.shape[0] - 2
    pol = parse_policy(f"tova:budget={want.shape[-1] + 1}")
    ctx = prefill(make("sdpa"), prompt, True, policies=[pol]).context()
    for layer in range(got.shape[0]):
        mine, theirs = set(got[layer, 0].tolist()), set(want[layer, 0].tolist())
        if last in mine:
            assert mine == theirs, layer
            continue
        score = pol.score(ctx, layer)[0]
        lowest = min(mine, key=lambda p: (float(score[p]), -p))
        assert theirs == (mine - {lowest}) | {last}, layer
