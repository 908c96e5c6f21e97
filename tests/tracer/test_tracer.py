"""The tracer on tiny random models of four architectures (Llama, Qwen2, Qwen3, Mistral; GQA).

The six properties the tracer must hold: the full policy has no hazard and the model's own
distributions; uniform evictions equal a masked full forward; SnapKV's kept indices equal a
plain recomputation from eager attention weights; first-step marginals follow p and q;
kill-and-resume and sharded runs equal an uninterrupted run; bad input is refused clearly.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from scipy import stats  # noqa: E402

from kvcouple.policies import parse_policy  # noqa: E402
from kvcouple.store import Record  # noqa: E402
from kvcouple.testing.tiny_models import TINY_ARCHS  # noqa: E402
from kvcouple.torch_coupling import apply_decoding  # noqa: E402
from kvcouple.tracer import (  # noqa: E402
    TraceSettings,
    trace_document,
)
from kvcouple.tracer.prefill import prefill, select  # noqa: E402

pytestmark = pytest.mark.torch

from tracer_helpers import (  # noqa: E402
    PROMPT,
    VOCAB,
    distributions,
    kept_positions,
    masked_forward,
    model,
    one_thread,  # noqa: F401 - autouse fixture
)


# 1 ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_full_policy_no_hazard_and_model_distributions(arch):
    m = model(arch)
    T = 6
    settings = TraceSettings(
        horizon=T, replicates=3, branches=1, window=2, record=Record("topk", VOCAB)
    )
    arr, _ = trace_document(m, PROMPT, ["full"], settings, seed=1)
    assert arr["hazard"].max() <= 1e-6
    assert arr["kept_length"][0] == len(PROMPT)
    for rep in range(3):
        path = arr["tokens"][0, rep]
        assert (path >= 0).all()
        seq = torch.tensor([PROMPT + path[:-1].tolist()])
        with torch.no_grad():
            want = apply_decoding(m(seq).logits[0, len(PROMPT) - 1 :]).numpy()
        np.testing.assert_allclose(distributions(arr, "p", 0, rep), want, atol=1e-5)
        np.testing.assert_allclose(distributions(arr, "q", 0, rep), want, atol=1e-5)
        entropy = -(want * np.log(np.where(want > 0, want, 1))).sum(-1)
        np.testing.assert_allclose(arr["entropy_p"][0, rep], entropy, atol=1e-5)
        assert arr["top1_agree"][0, rep].all()


# 2 ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", TINY_ARCHS)
@pytest.mark.parametrize("spec", ["recent:retain=0.5", "streaming:sinks=3,retain=0.4"])
def test_uniform_eviction_equals_masked_full_forward(arch, spec):
    """The overlap path and every branch (each side on its own prefix) against a full forward
    with the evicted positions hidden from the queries from the last prompt token on."""
    m = model(arch)
    T, L = 5, 3
    settings = TraceSettings(
        horizon=T, replicates=2, branches=2, window=L, record=Record("topk", VOCAB)
    )
    arr, _ = trace_document(m, PROMPT, [spec], settings, seed=2)
    n = len(PROMPT)
    kept = kept_positions(spec, n)
    everything = set(range(n))
    assert arr["kept_length"][0] == len(kept) < n
    for rep in range(2):
        path = arr["tokens"][0, rep]
        q_want = masked_forward(m, PROMPT + path[:-1].tolist(), n, kept)
        np.testing.assert_allclose(distributions(arr, "q", 0, rep), q_want, atol=1e-5)
        p_want = masked_forward(m, PROMPT + path[:-1].tolist(), n, everything)
        np.testing.assert_allclose(distributions(arr, "p", 0, rep), p_want, atol=1e-5)
        tv = 0.5 * np.abs(p_want - q_want).sum(-1)
        np.testing.assert_allclose(arr["hazard"][0, rep], tv, atol=1e-5)
        assert arr["hazard"][0, rep].max() > 1e-3  # the eviction changes something
        for k in range(2):
            start = int(arr["branch_step"][0, rep, k])
            assert 1 <= start <= T
            lags = min(L, T - start)
            prefix = PROMPT + path[: start - 1].tolist()
            want = {}
            for side, positions in (("p", everything), ("q", kept)):
                own = arr[f"branch_tokens_{side}"][0, rep, k, :lags].tolist()
                want[side] = masked_forward(m, prefix + own, n, positions)[start - 1 : start + lags]
                ids = arr[f"branch_topk_ids_{side}"][0, rep, k, : lags + 1].astype(np.int64)
                got = np.zeros((lags + 1, VOCAB))
                probs = arr[f"branch_topk_probs_{side}"][0, rep, k, : lags + 1]
                np.put_along_axis(got, ids, probs, axis=1)
                np.testing.assert_allclose(got, want[side], atol=1e-5)
            tv = 0.5 * np.abs(want["p"] - want["q"]).sum(-1)
            np.testing.assert_allclose(arr["branch_tv"][0, rep, k, 1 : lags + 1], tv[1:], atol=1e-5)
            assert (arr["branch_mismatch"][0, rep, k, lags + 1 :] == -1).all()
            assert np.isnan(arr["branch_tv"][0, rep, k, lags + 1 :]).all()


# 3 ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", TINY_ARCHS)
@pytest.mark.parametrize(
    "spec", ["snapkv:retain=0.5,window=6,kernel=5", "snapkv:budget=12,window=4,kernel=3,pool=max"]
)
def test_snapkv_indices_match_eager_attention(arch, spec):
    policy = parse_policy(spec)
    pre = prefill(model(arch), torch.tensor(PROMPT), needs_attention=True)
    idx = select(policy, pre)
    eager = model(arch, "eager")
    with torch.no_grad():
        out = eager(torch.tensor([PROMPT[:-1]]), output_attentions=True)
    n1 = len(PROMPT) - 1
    w, k = policy.params["window"], policy.params["kernel"]
    keep = policy.kept_count(len(PROMPT)) - 1
    pool = (
        torch.nn.functional.avg_pool1d
        if policy.params["pool"] == "avg"
        else torch.nn.functional.max_pool1d
    )
    for layer, att in enumerate(out.attentions):
        votes = att[0, :, -w:, : n1 - w].sum(1)  # (heads, n1 - w)
        pooled = pool(votes[:, None], kernel_size=k, stride=1, padding=k // 2)[:, 0]
        grouped = pooled.reshape(2, -1, n1 - w).mean(1)  # 2 KV heads
        # Documented tie rule (max pooling makes exact ties): the lower position first.
        order = torch.argsort(grouped, dim=-1, descending=True, stable=True)
        top = torch.sort(order[:, : keep - w], dim=-1).values
        want = torch.cat([top, torch.arange(n1 - w, n1).expand(2, w)], dim=-1)
        assert torch.equal(idx[layer], want), f"layer {layer}"


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_h2o_and_tova_indices_match_eager_attention(arch):
    """Scores from every prompt query (H2O, observed) and from the last one (TOVA, both head
    conventions), recomputed from eager attention weights."""
    pre = prefill(model(arch), torch.tensor(PROMPT), needs_attention=True)
    with torch.no_grad():
        attentions = model(arch, "eager")(
            torch.tensor([PROMPT[:-1]]), output_attentions=True
        ).attentions
    n1 = len(PROMPT) - 1
    h2o, tova = parse_policy("h2o:budget=11,recent=0.3"), parse_policy("tova:budget=9,heads=group")
    h2o_idx, tova_idx = select(h2o, pre), select(tova, pre)
    tova_all = select(parse_policy("tova:budget=9,heads=all"), pre)
    observed = select(parse_policy("observed:budget=9"), pre)
    for layer, att in enumerate(attentions):
        heavy = att[0].sum(1).reshape(2, -1, n1).mean(1)  # accumulated, group-averaged
        recent = h2o.recent_count(10)
        order = torch.argsort(heavy[:, : n1 - recent], dim=-1, descending=True, stable=True)
        chosen = torch.sort(order[:, : 10 - recent], dim=-1).values
        want = torch.cat([chosen, torch.arange(n1 - recent, n1).expand(2, recent)], dim=-1)
        assert torch.equal(h2o_idx[layer], want), f"h2o layer {layer}"
        last = att[0, :, -1].reshape(2, -1, n1).mean(1)
        order = torch.argsort(last, dim=-1, descending=True, stable=True)
        assert torch.equal(tova_idx[layer], torch.sort(order[:, :8], dim=-1).values), (
            f"tova {layer}"
        )
        # heads=all: one set per layer from the mean over every query head.
        order = torch.argsort(att[0, :, -1].mean(0), descending=True, stable=True)
        want = torch.sort(order[:8]).values.expand(2, 8)
        assert torch.equal(tova_all[layer], want), f"tova heads=all {layer}"
        # observed: accumulated attention over the queries that see each key, group-averaged.
        seen = att[0].sum(1) / torch.arange(n1, 0, -1)
        order = torch.argsort(seen.reshape(2, -1, n1).mean(1), dim=-1, descending=True, stable=True)
        assert torch.equal(observed[layer], torch.sort(order[:, :8], dim=-1).values), (
            f"observed {layer}"
        )


# 4 ------------------------------------------------------------------------------------------
# The coupling kernel's law is tested in tests/kernels/test_coupling.py. What tracing adds: the
# kernel is fed this model's p (full cache) and q (policy's cache) on every architecture, the
# branch tokens are the residual draws of the right side, and the replicates draw fresh uniforms.
def _first_step(arch, R):
    m = model(arch)
    spec = "recent:retain=0.3"
    settings = TraceSettings(horizon=1, replicates=R, branches=1, window=0)
    arr, _ = trace_document(m, PROMPT, [spec], settings, seed=3)
    n = len(PROMPT)
    p = masked_forward(m, PROMPT, n, set(range(n)))[0]
    q = masked_forward(m, PROMPT, n, kept_positions(spec, n))[0]
    return arr, p, q


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_first_step_couples_this_models_p_and_q(arch):
    arr, p, q = _first_step(arch, 64)
    h = arr["hazard"][0, :, 0]
    np.testing.assert_allclose(h, 0.5 * np.abs(p - q).sum(), atol=1e-5)
    assert 0.2 < h[0] < 0.95
    z = arr["tokens"][0, :, 0]
    x = arr["branch_tokens_p"][0, :, 0, 0]
    y = arr["branch_tokens_q"][0, :, 0, 0]
    assert (arr["branch_step"][0] == 1).all() and (x != y).all()
    # Supports: the overlap draw from min(p, q), the residuals from (p - q)+ and (q - p)+; a
    # swapped side or a stale distribution lands outside them.
    assert (np.minimum(p, q)[z] > 0).all()
    assert (p[x] > q[x]).all() and (q[y] > p[y]).all()
    assert len(set(z.tolist())) > 1  # fresh uniforms per replicate


def test_first_step_marginals_follow_p_and_q():
    """The SMC draw's marginals on one architecture, by chi-square over 3,000 replicates."""
    R = 3000
    arr, p, q = _first_step("qwen3", R)
    h = arr["hazard"][0, :, 0]
    z = arr["tokens"][0, :, 0]
    x = arr["branch_tokens_p"][0, :, 0, 0]
    y = arr["branch_tokens_q"][0, :, 0, 0]
    # The SMC draw: residuals with probability h, else the overlap token.
    coin = np.random.default_rng(11).random(R) < h
    for tokens, law in ((np.where(coin, x, z), p), (np.where(coin, y, z), q)):
        observed = np.bincount(tokens, minlength=VOCAB)
        expected = law * R
        big = expected >= 5
        obs = np.append(observed[big], observed[~big].sum())
        exp = np.append(expected[big], expected[~big].sum())
        assert stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue > 1e-3
    overlap = np.minimum(p, q) / np.minimum(p, q).sum()
    big = overlap * R >= 5
    observed = np.bincount(z, minlength=VOCAB)
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(overlap[big] * R, overlap[~big].sum() * R)
    assert stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue > 1e-3


def test_eos_is_absorbing():
    settings = TraceSettings(
        horizon=5, replicates=3, branches=2, window=4, eos_token_ids=tuple(range(VOCAB))
    )
    arr, _ = trace_document(model("qwen3"), PROMPT, ["recent:retain=0.3"], settings, seed=4)
    tokens = arr["tokens"][0]
    assert (tokens == tokens[:, :1]).all()  # the first token is EOS, repeated
    assert (arr["hazard"][0, :, 1:] == 0).all()
    assert (arr["branch_step"][0] == 1).all()  # only step 1 can diverge
    for side in ("p", "q"):
        b = arr[f"branch_tokens_{side}"][0]
        assert (b == b[..., :1]).all()
    assert (arr["branch_mismatch"][0] == 1).all()
