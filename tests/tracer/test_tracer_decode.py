"""Decode-time eviction (``mode=decode``) for every policy, against a direct reference.

The reference simulates decoding with an eager model: at every step one full forward of the
sequence so far, where each query from the last prompt token on sees, per layer and KV head,
exactly the entries that were cached when it was fed (a per-layer, per-head mask set by a
pre-hook on each attention module). Its last row gives the evicted kernel ``q_t`` and, from the
eager attention weights and the cached keys and values, the scores each policy's rule uses;
the reference then evicts by the policy's published rule (ties: the lower position kept). The tracer's kept set after every
step and its ``q_t`` must equal the reference's.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvcouple.policies import POLICIES, ScorePolicy, parse_policy, register_policy  # noqa: E402
from kvcouple.store import Record  # noqa: E402
from kvcouple.torch_coupling import apply_decoding  # noqa: E402
from kvcouple.tracer import (  # noqa: E402
    TraceSettings,
    kvcache,  # noqa: E402
    trace_document,
)
from kvcouple.tracer.decode import DecodeEvictor  # noqa: E402
from kvcouple.tracer.engine import overlap_path  # noqa: E402
from kvcouple.tracer.prefill import gather_kept, prefill, select  # noqa: E402

pytestmark = pytest.mark.torch

from tracer_helpers import (  # noqa: E402
    PROMPT,
    VOCAB,
    model,
    one_thread,  # noqa: F401 - autouse fixture
)

T = 8


class KeyMean(ScorePolicy):
    """A plug-in scorer (the mean of each key's components), decoded by the generic rule."""

    name = "test-decode-keymean"

    def score(self, ctx, layer):
        return ctx.keys[layer].float().mean(-1)


@pytest.fixture(scope="module", autouse=True)
def plugin():
    register_policy(KeyMean)
    yield
    POLICIES.pop(KeyMean.name)


class RecordingEvictor(DecodeEvictor):
    """Notes row 0's kept positions per layer and KV head after every step."""

    history: list

    def after_step(self, rows):
        super().after_step(rows)
        valid = rows.valid[self.rows][0]
        self.__dict__.setdefault("history", []).append(
            [
                [frozenset(positions[0, h][valid].tolist()) for h in range(positions.shape[1])]
                for positions in (state["position"] for state in self.state)
            ]
        )


def traced(m, spec):
    """Row 0 of a decode-time overlap path: kept sets after each step, tokens, q_t."""
    pre = prefill(m, torch.tensor(PROMPT), needs_attention=True)
    policy = parse_policy(spec)
    idx = select(policy, pre, torch.Generator().manual_seed(0))
    budget = idx.shape[-1] + 1
    evictor = RecordingEvictor(m, pre, idx, policy.decode_rule(budget), torch.arange(1))
    settings = TraceSettings(horizon=T, replicates=1, record=Record("topk", VOCAB))
    path_u = torch.as_tensor(np.random.default_rng(5).random((T, 1)))
    path = overlap_path(m, pre, gather_kept(pre.kv, idx), settings, path_u, evictor)
    ids = path.arrays["topk_ids_q"][0].astype(np.int64)
    q = np.zeros((T, VOCAB))
    np.put_along_axis(q, ids, path.arrays["topk_probs_q"][0], axis=1)
    return idx, budget, evictor.history, path.arrays["tokens"][0].tolist(), q


def masked_step(eager, seq, n1, visible_rows):
    """One eager forward of ``seq``; query rows ``r >= n1`` see ``visible_rows[r][l][h]``."""
    size = len(seq)
    modules = sorted(
        (m for m in eager.modules() if hasattr(m, "q_proj") and hasattr(m, "layer_idx")),
        key=lambda m: m.layer_idx,
    )
    kv_heads = len(visible_rows[n1][0])
    group = eager.config.num_attention_heads // kv_heads
    masks = []
    for layer in range(len(modules)):
        allowed = torch.ones(kv_heads, size, size, dtype=torch.bool).tril()
        for r in range(n1, size):
            for h in range(kv_heads):
                row = torch.zeros(size, dtype=torch.bool)
                row[sorted(visible_rows[r][layer][h])] = True
                allowed[h, r] = row
        allowed = allowed.repeat_interleave(group, dim=0)[None]
        masks.append(
            torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
        )

    def hook(layer):
        def set_mask(module, args, kwargs):
            kwargs["attention_mask"] = masks[layer]
            return args, kwargs

        return set_mask

    handles = [
        m.register_forward_pre_hook(hook(i), with_kwargs=True) for i, m in enumerate(modules)
    ]
    try:
        with torch.no_grad():
            out = eager(
                input_ids=torch.tensor([seq]),
                position_ids=torch.arange(size)[None],
                output_attentions=True,
                use_cache=True,
            )
    finally:
        for h in handles:
            h.remove()
    cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
    kv = kvcache.cache_tensors(cache)
    attention = [a[0, :, -1].reshape(kv_heads, group, size).mean(1) for a in out.attentions]
    last_queries = [a[0, :, -1] for a in out.attentions]  # (query heads, size)
    return apply_decoding(out.logits[0, -1:])[0].numpy(), attention, last_queries, kv


def reference(eager, spec, idx, budget, tokens):
    policy = parse_policy(spec)
    name, params = policy.name, policy.params
    every = params["every"] or 1
    n1 = len(PROMPT) - 1
    layers, kv_heads = idx.shape[:2]
    group = eager.config.num_attention_heads // kv_heads
    kept = [[set(idx[layer, h].tolist()) for h in range(kv_heads)] for layer in range(layers)]
    score = [[{} for _ in range(kv_heads)] for _ in range(layers)]
    if name == "h2o":  # accumulated attention of every prompt query
        with torch.no_grad():
            att = eager(torch.tensor([PROMPT[:-1]]), output_attentions=True).attentions
        for layer, a in enumerate(att):
            heavy = a[0].sum(1).reshape(kv_heads, group, n1).mean(1)
            for h in range(kv_heads):
                score[layer][h] = {p: float(heavy[h, p]) for p in kept[layer][h]}
    seq = list(PROMPT) + tokens[:-1]
    visible_rows = {}
    history, qs = [], []
    for g in range(1, T + 1):
        i = n1 + g - 1  # position of the token fed at step g
        visible = [[kept[layer][h] | {i} for h in range(kv_heads)] for layer in range(layers)]
        visible_rows[i] = visible
        q, attention, last_queries, kv = masked_step(eager, seq[: i + 1], n1, visible_rows)
        qs.append(q)
        for layer in range(layers):
            for h in range(kv_heads):
                vis = visible[layer][h]
                s = score[layer][h]
                s[i] = 0.0
                for p in vis:
                    s[p] = s.get(p, 0.0) + float(attention[layer][h, p])
                if len(vis) - budget < every:
                    kept[layer][h] = set(vis)
                    continue
                order = sorted(vis)
                keys, values = kv[layer][0][0, h], kv[layer][1][0, h]
                if name == "recent":
                    keep = order[-budget:]
                elif name == "streaming":
                    sinks = [p for p in order if p < params["sinks"]][:budget]
                    rest = [p for p in order if p >= params["sinks"]]
                    keep = sinks + rest[len(rest) - (budget - len(sinks)) :]
                elif name == "h2o":
                    recent = policy.recent_count(budget)
                    rank = {p: (1, p) if p > i - recent else (0, s[p], -p) for p in vis}
                    keep = sorted(vis, key=rank.get)[-budget:]
                elif name == "tova" and params["heads"] == "group":
                    keep = sorted(vis, key=lambda p: (float(attention[layer][h, p]), -p))[-budget:]
                elif name == "tova":  # heads=all: every KV head holds the same entries
                    every_head = attention[layer].mean(0)  # groups are equal: the mean of all
                    keep = sorted(vis, key=lambda p: (float(every_head[p]), -p))[-budget:]
                elif name == "snapkv":  # window=1: the newest query's votes, pooled by position
                    assert params["window"] == 1
                    a = last_queries[layer][h * group : (h + 1) * group][:, order[:-1]]
                    k = params["kernel"]
                    pooled = torch.nn.functional.avg_pool1d(
                        a[:, None], kernel_size=k, stride=1, padding=k // 2
                    )[:, 0].mean(0)
                    top = torch.argsort(pooled, descending=True, stable=True)[: budget - 1]
                    keep = [order[j] for j in top.tolist()] + [order[-1]]
                elif name == "knorm":
                    keep = sorted(vis, key=lambda p: (-float(keys[p].norm()), -p))[-budget:]
                elif name == "valuediff":
                    mean = values[order].mean(0)
                    keep = sorted(vis, key=lambda p: (float((values[p] - mean).norm()), -p))[
                        -budget:
                    ]
                elif name == KeyMean.name:
                    keep = sorted(vis, key=lambda p: (float(keys[p].mean()), -p))[-budget:]
                kept[layer][h] = set(keep)
        history.append([[frozenset(k) for k in layer] for layer in kept])
    return history, np.stack(qs)


SPECS = [
    "recent:budget=10,mode=decode",
    "streaming:sinks=3,budget=10,mode=decode",
    "h2o:budget=10,recent=0.3,mode=decode",
    "h2o:budget=9,recent=0.5,mode=decode,every=3",
    "tova:budget=10,mode=decode,heads=group",
    "tova:budget=10,mode=decode",
    "snapkv:budget=10,window=1,kernel=3,mode=decode",
    "snapkv:budget=11,window=1,kernel=1,mode=decode,every=2",
    "knorm:budget=10,mode=decode,every=2",
    "valuediff:budget=10,mode=decode",
    "test-decode-keymean:budget=10,mode=decode",
]


# Not Qwen3: its key RMSNorm makes every key norm (knorm's score) equal up to float noise.
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("spec", SPECS)
def test_kept_sets_and_kernel_match_the_reference(arch, spec):
    m, eager = model(arch), model(arch, "eager")
    idx, budget, history, tokens, q = traced(m, spec)
    assert min(tokens) >= 0
    want_history, want_q = reference(eager, spec, idx, budget, tokens)
    n1 = len(PROMPT) - 1
    for g, (got, want) in enumerate(zip(history, want_history, strict=True), start=1):
        assert got == want, f"step {g}"
        sizes = {len(k) for layer in got for k in layer}
        every = parse_policy(spec).params["every"] or 1
        assert max(sizes) < budget + every, f"step {g}: {sizes}"
    # Something was evicted from the generated part or the cache kept its budget throughout.
    assert all(len(k) <= budget + 2 for layer in history[-1] for k in layer)
    assert any(p < n1 for layer in history[-1] for k in layer for p in k)
    np.testing.assert_allclose(q, want_q, atol=1e-5)


def test_full_with_mode_decode_has_no_hazard():
    """``full`` through the whole decode-time machinery (the evictor inspecting the cache after
    every step, masks on every row) evicts nothing: every hazard is 0, no branch is drawn, and
    the path is the one ``full`` draws without it."""
    settings = TraceSettings(
        horizon=6, replicates=2, branches=2, window=3, record=Record("topk", 4)
    )
    decode, _ = trace_document(model("llama"), PROMPT, ["full:mode=decode"], settings, seed=3)
    plain, _ = trace_document(model("llama"), PROMPT, ["full"], settings, seed=3)
    assert decode["hazard"].max() <= 1e-6
    assert (decode["branch_step"] == 0).all()
    assert not decode["eviction_applied"][0]
    np.testing.assert_array_equal(decode["tokens"], plain["tokens"])
    np.testing.assert_allclose(decode["entropy_q"], plain["entropy_p"], atol=1e-5)


@pytest.mark.parametrize(
    "spec", ["streaming:budget=12,mode=decode", "snapkv:retain=0.5,window=4,mode=decode,every=2"]
)
def test_decode_branches_replay_their_path(spec):
    """Branches replayed from the prompt (per batch of one or all at once) see the same q as
    the path at t*: lag 0's Q distribution equals the path's q at t*."""
    import dataclasses

    settings = TraceSettings(
        horizon=6, replicates=2, branches=2, window=2, record=Record("topk", VOCAB)
    )
    m = model("llama")
    arr, _ = trace_document(m, PROMPT, [spec], settings, seed=8)
    one, _ = trace_document(
        m, PROMPT, [spec], dataclasses.replace(settings, branch_batch=1), seed=8
    )
    for name in arr:
        np.testing.assert_allclose(arr[name], one[name], atol=1e-5, err_msg=name)
    checked = 0
    for rep in range(2):
        for k in range(2):
            t = int(arr["branch_step"][0, rep, k])
            if t == 0:
                continue
            np.testing.assert_allclose(
                arr["branch_topk_probs_q"][0, rep, k, 0],
                arr["topk_probs_q"][0, rep, t - 1],
                atol=1e-5,
            )
            np.testing.assert_array_equal(
                arr["branch_topk_ids_q"][0, rep, k, 0], arr["topk_ids_q"][0, rep, t - 1]
            )
            checked += 1
    assert checked > 0
