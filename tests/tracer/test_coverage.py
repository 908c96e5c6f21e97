"""The model-coverage matrix: every architecture is traced exactly or refused up front.

Tiny random models (float32, CPU) of each architecture (the issue's twenty and eight more) in ``COVERAGE_ARCHS``, with sliding
windows shorter than the prompt where the family has them. For each:

- refused: the support check names the architecture and the reason, and ``trace`` refuses
  before it creates a store;
- exact: ``full`` gives the model's own distributions (its sliding windows included) with
  hazard 0; ``recent``/``streaming`` give P and Q equal to a plain forward with the evicted
  entries hidden and each layer's window applied (<= 1e-5, original positions); ``p_1`` is
  the same under every policy; SnapKV, H2O and TOVA keep exactly the entries that eager
  ``output_attentions`` weights select.

docs/tracer.md's table is generated from the same support check and compared here.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvcouple.policies import parse_policy  # noqa: E402
from kvcouple.store import Record  # noqa: E402
from kvcouple.testing.coverage import BEGIN, END, coverage_rows, coverage_table  # noqa: E402
from kvcouple.testing.tiny_models import (  # noqa: E402
    COVERAGE_ARCHS,
    EAGER_ONLY,
    TINY_WINDOW,
    tiny_model,
)
from kvcouple.torch_coupling import apply_decoding  # noqa: E402
from kvcouple.tracer import TraceSettings, trace, trace_document  # noqa: E402
from kvcouple.tracer.model import facts, layer_windows  # noqa: E402
from kvcouple.tracer.prefill import prefill, select  # noqa: E402
from kvcouple.tracer.prompts import Prompt  # noqa: E402
from kvcouple.tracer.support import UnsupportedModelError, check_support  # noqa: E402

pytestmark = pytest.mark.torch

VOCAB = 128
PROMPT = [int(x) for x in np.random.default_rng(3).integers(1, VOCAB - 1, size=21)]
UNIFORM = ["recent:budget=6", "streaming:sinks=2,retain=0.4"]  # both evict inside the window
SCORED = [
    "snapkv:retain=0.5,window=4,kernel=3",
    "h2o:budget=9,recent=0.3",
    "tova:budget=8,heads=group",
]

# What the matrix must find: the refusal reason's key words, or None for exact.
EXPECTED_REFUSALS = {
    "deepseek_v3": "latent attention",
    "falcon_alibi": "ALiBi",
    "bloom": "ALiBi",
    "lfm2": "convolution state",
}
# Refused for scored policies where the installed transformers' model bypasses the attention
# interface (falcon before transformers 5.25 did; it dispatches through it since).
SCORES_REFUSED = {"falcon": "attention interface"}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
    model.cache_clear()  # later tests count live tensors (tests/tracer/test_tracer_scale.py)


@functools.cache
def model(arch: str, attn: str | None = None):
    return tiny_model(arch, seed=7, attn_implementation=attn)


def topk_dists(arr: dict, side: str, policy: int, rep: int) -> np.ndarray:
    ids = arr[f"topk_ids_{side}"][policy, rep].astype(np.int64)
    out = np.zeros((ids.shape[0], VOCAB))
    np.put_along_axis(out, ids, arr[f"topk_probs_{side}"][policy, rep], axis=1)
    return out


def masked_forward(m, tokens: list[int], n: int, kept: set[int]) -> np.ndarray:
    """Plain forward where queries from the last prompt token on cannot see evicted prompt
    positions; each layer's own sliding window applied (per-layer masks)."""
    L = len(tokens)
    allowed = torch.ones(L, L, dtype=torch.bool).tril()
    hidden = torch.tensor([j < n - 1 and j not in kept for j in range(L)])
    allowed[n - 1 :, :] &= ~hidden[None, :]
    windows = layer_windows(m.config)
    pos = torch.arange(L)
    sliding = allowed.clone()
    if any(w is not None for w in windows):
        (window,) = {w for w in windows if w is not None}
        sliding &= pos[None, :] > pos[:, None] - window

    def additive(ok):
        return torch.zeros(L, L).masked_fill(~ok, torch.finfo(torch.float32).min)[None, None]

    if all(w is None for w in windows):
        mask = additive(allowed)
    elif all(w is not None for w in windows):
        mask = additive(sliding)
    else:
        mask = {"full_attention": additive(allowed), "sliding_attention": additive(sliding)}
    with torch.no_grad():
        logits = m(
            input_ids=torch.tensor([tokens]), attention_mask=mask, position_ids=pos[None]
        ).logits[0, n - 1 :]
    return apply_decoding(logits).numpy()


def kept_positions(spec: str, n: int) -> set[int]:
    from kvcouple.policies import PolicyContext

    policy = parse_policy(spec)
    zeros = [torch.zeros(2, n - 1, 16)]
    idx = policy.select(PolicyContext(zeros, zeros), policy.kept_count(n) - 1)
    return set(idx[0, 0].tolist()) | {n - 1}


def _status(arch: str) -> str:
    if arch in EXPECTED_REFUSALS:
        return "refused"
    if arch in SCORES_REFUSED and not facts(model(arch)).attention_interface:
        return "scores-refused"
    return "exact"


@pytest.mark.parametrize("arch", COVERAGE_ARCHS)
def test_refused_up_front(arch, tmp_path):
    m = model(arch)
    if _status(arch) != "refused":
        check_support(m, [parse_policy(s) for s in UNIFORM])
        return
    with pytest.raises(UnsupportedModelError, match=EXPECTED_REFUSALS[arch]) as err:
        check_support(m)
    assert m.config.model_type in str(err.value)
    out = tmp_path / "s.zarr"
    with pytest.raises(UnsupportedModelError):
        trace(m, [Prompt("d", tuple(PROMPT))], ["full"], TraceSettings(horizon=2), out)
    assert not out.exists()  # refused before the store was created


@pytest.mark.parametrize("arch", COVERAGE_ARCHS)
def test_scored_policies_exact_or_refused(arch, tmp_path):
    """SnapKV/H2O/TOVA keep what eager attention weights select (or are refused up front)."""
    if _status(arch) == "refused":
        pytest.skip("architecture refused")
    m = model(arch)
    pols = [parse_policy(s) for s in SCORED]
    if _status(arch) == "scores-refused":
        with pytest.raises(UnsupportedModelError, match=SCORES_REFUSED[arch]):
            check_support(m, pols)
        out = tmp_path / "s.zarr"
        with pytest.raises(UnsupportedModelError):
            trace(m, [Prompt("d", tuple(PROMPT))], SCORED[:1], TraceSettings(horizon=2), out)
        assert not out.exists()
        return
    pre = prefill(m, torch.tensor(PROMPT), needs_attention=True)
    eager = m if arch in EAGER_ONLY else model(arch, "eager")
    with torch.no_grad():
        att = eager(torch.tensor([PROMPT[:-1]]), output_attentions=True).attentions
    n1 = len(PROMPT) - 1
    kv_heads = pre.kv[0][0].shape[1]

    def grouped(x):  # (heads, n) -> (kv_heads, n)
        return x.reshape(kv_heads, -1, x.shape[-1]).mean(1)

    def top(scores, keep):
        order = torch.argsort(scores, dim=-1, descending=True, stable=True)
        return torch.sort(order[:, :keep], dim=-1).values

    snap, h2o, tova = pols
    w, k = snap.params["window"], snap.params["kernel"]
    keep = snap.kept_count(len(PROMPT)) - 1
    got = {p.name: select(p, pre) for p in pols}
    assert len(att) == len(got["snapkv"])
    for layer, a in enumerate(att):
        a = a[0].float()  # (heads, n1, n1)
        votes = a[:, -w:, : n1 - w].sum(1)
        pooled = torch.nn.functional.avg_pool1d(votes[:, None], k, 1, k // 2)[:, 0]
        want = torch.cat(
            [top(grouped(pooled), keep - w), torch.arange(n1 - w, n1).expand(kv_heads, w)], -1
        )
        assert torch.equal(got["snapkv"][layer], want), f"snapkv layer {layer}"
        recent = h2o.recent_count(8)
        heavy = grouped(a.sum(1))[:, : n1 - recent]
        want = torch.cat(
            [top(heavy, 8 - recent), torch.arange(n1 - recent, n1).expand(kv_heads, recent)], -1
        )
        assert torch.equal(got["h2o"][layer], want), f"h2o layer {layer}"
        assert torch.equal(got["tova"][layer], top(grouped(a[:, -1]), 7)), f"tova layer {layer}"


@pytest.mark.parametrize("arch", COVERAGE_ARCHS)
def test_traces_equal_masked_plain_forward(arch):
    """full = the model (windows included), hazard 0; uniform evictions = masked plain forward
    with per-layer windows; p_1 identical across policies."""
    if _status(arch) == "refused":
        pytest.skip("architecture refused")
    m = model(arch)
    specs = ["full", *UNIFORM] + (SCORED[:1] if _status(arch) == "exact" else [])
    # No absorbing EOS: the traced kernels are compared with the model's own after every
    # token, an EOS included (trace_document absorbs at the model's EOS by default).
    settings = TraceSettings(
        horizon=4,
        replicates=2,
        branches=1,
        window=1,
        record=Record("topk", VOCAB),
        eos_token_ids=(),
    )
    arr, _ = trace_document(m, PROMPT, specs, settings, seed=5)
    n = len(PROMPT)
    windows = [w for w in layer_windows(m.config) if w is not None]
    if windows:
        assert min(windows) == TINY_WINDOW < n  # the window matters for this prompt
    everything = set(range(n))
    assert arr["hazard"][0].max() <= 1e-6
    for rep in range(2):
        path = arr["tokens"][0, rep]
        with torch.no_grad():  # the model's own masks, windows included
            plain = apply_decoding(
                m(torch.tensor([PROMPT + path[:-1].tolist()])).logits[0, n - 1 :]
            )
        np.testing.assert_allclose(topk_dists(arr, "p", 0, rep), plain.numpy(), atol=1e-5)
        np.testing.assert_allclose(topk_dists(arr, "q", 0, rep), plain.numpy(), atol=1e-5)
    p1 = np.stack([topk_dists(arr, "p", i, 0)[0] for i in range(len(specs))])
    np.testing.assert_allclose(p1, np.broadcast_to(p1[0], p1.shape), atol=1e-6)
    for i, spec in enumerate(UNIFORM, start=1):
        kept = kept_positions(spec, n)
        for rep in range(2):
            path = arr["tokens"][i, rep]
            alive = int((path >= 0).sum())
            tokens = PROMPT + path[: max(alive, 1) - 1].tolist()
            q_want = masked_forward(m, tokens, n, kept)
            p_want = masked_forward(m, tokens, n, everything)
            steps = q_want.shape[0]
            np.testing.assert_allclose(topk_dists(arr, "q", i, rep)[:steps], q_want, atol=1e-5)
            np.testing.assert_allclose(topk_dists(arr, "p", i, rep)[:steps], p_want, atol=1e-5)
            # The branch (its own cache copy, path hidden from t* on, one lag of its own).
            start = int(arr["branch_step"][i, rep, 0])
            if start == 0:
                continue
            lags = min(1, settings.horizon - start)
            prefix = PROMPT + path[: start - 1].tolist()
            for side, positions in (("p", everything), ("q", kept)):
                own = arr[f"branch_tokens_{side}"][i, rep, 0, :lags].tolist()
                want = masked_forward(m, prefix + own, n, positions)[start - 1 : start + lags]
                ids = arr[f"branch_topk_ids_{side}"][i, rep, 0, : lags + 1].astype(np.int64)
                got = np.zeros((lags + 1, VOCAB))
                np.put_along_axis(
                    got, ids, arr[f"branch_topk_probs_{side}"][i, rep, 0, : lags + 1], axis=1
                )
                np.testing.assert_allclose(got, want, atol=1e-5)
        assert arr["hazard"][i].max() > 1e-4  # the eviction changes something


def test_docs_table_is_generated_from_the_matrix():
    rows = coverage_rows()
    status = {r.arch: r.status for r in rows}
    assert [r.arch for r in rows] == list(COVERAGE_ARCHS)
    for arch in COVERAGE_ARCHS:
        want = {
            "refused": "refused",
            "scores-refused": "exact (attention-scored policies refused)",
            "exact": "exact",
        }[_status(arch)]
        assert status[arch] == want, arch
    docs = (Path(__file__).resolve().parents[2] / "docs" / "tracer.md").read_text()
    assert BEGIN in docs and END in docs
    table = docs[docs.index(BEGIN) : docs.index(END) + len(END)]

    def body(text: str) -> list[str]:
        return [line for line in text.splitlines() if line.startswith("| `")]

    assert body(table) == body(coverage_table(rows)), "run scripts/coverage_table.py"


def test_cli_gemma3_sliding_window_full_hazard_zero_and_same_p1(tmp_path, capsys):
    """Done-when: `kvcouple trace` on a tiny Gemma-3 whose window (8) is shorter than the
    prompt gives `full` hazard 0 and `p_1` identical across policies; a refused architecture
    exits 2 with the reason before creating a store."""
    import json

    import xarray as xr

    from kvcouple.cli import main as cli_main

    model_dir = tmp_path / "gemma3"
    model("gemma3_text").save_pretrained(model_dir)
    rng = np.random.default_rng(11)
    prompts = tmp_path / "docs.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"id": f"d{i}", "input_ids": rng.integers(1, VOCAB - 1, size=n).tolist()})
            + "\n"
            for i, n in enumerate((19, 27))
        )
    )
    out = tmp_path / "run.zarr"
    base = ["trace", "--model", str(model_dir), "--prompts", str(prompts), "--quiet"]
    base += ["--device", "cpu", "--horizon", "4", "--replicates", "2", "--record", f"topk:{VOCAB}"]
    policies = ["full", "recent:budget=6", "snapkv:retain=0.5,window=4", "h2o:budget=9"]
    args = [*base, "--out", str(out)] + [a for p in policies for a in ("--policy", p)]
    assert cli_main(args) == 0
    ds = xr.open_zarr(out)
    assert float(ds["hazard"].sel(policy="full").max()) <= 1e-6
    assert float(ds["hazard"].max()) > 1e-3  # the evicting policies do change something
    ids = ds["topk_ids_p"].isel(step=0).values  # (doc, policy, rep, k)
    probs = ds["topk_probs_p"].isel(step=0).values
    p1 = np.zeros(ids.shape[:-1] + (VOCAB,))
    np.put_along_axis(p1, ids.astype(np.int64), probs, axis=-1)
    np.testing.assert_allclose(p1, np.broadcast_to(p1[:, :1, :1], p1.shape), atol=1e-6)

    refused = tmp_path / "deepseek"
    model("deepseek_v3").save_pretrained(refused)
    out2 = tmp_path / "refused.zarr"
    args = ["trace", "--model", str(refused), "--prompts", str(prompts), "--quiet"]
    assert cli_main([*args, "--device", "cpu", "--policy", "full", "--out", str(out2)]) == 2
    err = capsys.readouterr().err
    assert "deepseek_v3" in err and "latent attention" in err
    assert not out2.exists()


def test_engine_that_loses_positions_is_refused_up_front(monkeypatch, tmp_path):
    """If the engine built a cache without the entries' original positions, a sliding-window
    model could not be traced: the probe run in the support check finds that before the store
    exists (never a document crashed mid-store)."""
    from kvcouple.tracer import kvcache, layout, trajectories

    build = kvcache.cache_from_tensors
    for rows in (layout, trajectories):  # where the row layouts build their caches
        monkeypatch.setattr(
            rows, "cache_from_tensors", lambda kv, positions=None, room=0: build(kv, room=room)
        )
    m = tiny_model("gemma3_text", seed=7)  # fresh: no cached support verdict
    out = tmp_path / "s.zarr"
    with pytest.raises(UnsupportedModelError, match="original positions"):
        trace(m, [Prompt("d", tuple(PROMPT))], ["full"], TraceSettings(horizon=2), out)
    assert not out.exists()
    ok = tiny_model("llama", seed=7)  # no window: positions are not needed
    check_support(ok, [parse_policy("recent:budget=3")])


@pytest.mark.parametrize(
    ("arch", "spec", "reason"),
    [
        ("gemma3_text", "recent:budget=6,mode=decode", "sliding-window"),
        ("gemma2", "h2o:budget=6,mode=decode", "sliding-window"),
    ],
)
def test_decode_time_eviction_refused_where_inexact(arch, spec, reason):
    with pytest.raises(UnsupportedModelError, match=reason):
        check_support(model(arch), [parse_policy(spec)])


def test_decode_time_eviction_refused_with_sinks_or_softcap():
    capped = tiny_model("gemma2", seed=7, layer_types=["full_attention"] * 2)
    with pytest.raises(UnsupportedModelError, match="soft-capping"):
        check_support(capped, [parse_policy("h2o:budget=6,mode=decode")])
    check_support(capped, [parse_policy("recent:budget=6,mode=decode")])  # no scores: exact
    sinks = tiny_model("gpt_oss", seed=7, layer_types=["full_attention"] * 2)
    with pytest.raises(UnsupportedModelError, match="sinks"):
        check_support(sinks, [parse_policy("h2o:budget=6,mode=decode")])
