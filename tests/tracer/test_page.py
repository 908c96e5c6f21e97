"""PAGE gating: the agreement-drop score, the gate on inputs built to be capacity-bound or
dilution-prone, the score against eager attention weights, and a traced store split by class."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvcouple.policies import (  # noqa: E402
    PolicyContext,
    PolicyError,
    parse_policy,
)
from kvcouple.store import Record  # noqa: E402
from kvcouple.tracer import Prompt, TraceSettings, trace, trace_document  # noqa: E402

pytestmark = pytest.mark.torch

from tracer_helpers import (  # noqa: E402
    PROMPT,
    VOCAB,
    model,
    one_thread,  # noqa: F401 - autouse fixture
)

DIM, KV_HEADS, GROUP, LENGTH = 8, 2, 2, 40


def focused_context(layer_targets: list[list[int]]) -> PolicyContext:
    """Keys ``j`` point along dimension ``j % DIM``; in layer ``l`` query head ``h`` points
    (strongly) along ``layer_targets[l][h]``, so its top-5 keys are exactly the 5 keys of that
    dimension. Heads with one target agree fully (Jaccard 1), distinct targets not at all."""
    keys = torch.zeros(KV_HEADS, LENGTH, DIM)
    keys[:, torch.arange(LENGTH), torch.arange(LENGTH) % DIM] = 1.0
    queries = []
    for targets in layer_targets:
        q = torch.zeros(KV_HEADS * GROUP, LENGTH, DIM)
        for h, d in enumerate(targets):
            q[h, :, d] = 40.0
        queries.append(q)
    return PolicyContext(
        keys=[keys] * len(layer_targets),
        values=[keys] * len(layer_targets),
        query_fn=lambda layer, start: queries[layer][:, start:],
        scaling=1.0,
        num_query_heads=KV_HEADS * GROUP,
    )


AGREE, DISAGREE = [3, 3, 3, 3], [0, 2, 4, 6]


def test_gate_on_constructed_inputs():
    page = parse_policy("page:base=snapkv,retain=0.5,window=4,threshold=0.5,k=5")
    # Capacity-bound: heads agree early and attend to different keys late.
    capacity = focused_context([AGREE, AGREE, DISAGREE, DISAGREE, DISAGREE, DISAGREE])
    np.testing.assert_allclose(page.agreement(capacity).numpy(), [1, 1, 0, 0, 0, 0], atol=1e-6)
    got = page.admit(capacity)
    assert got.capacity_bound is True and got.score == pytest.approx(1.0)
    assert got.policy.name == "full"
    # Dilution-prone: the heads agree in every layer (no drop), or more late than early.
    for layers, want in (([AGREE] * 6, 0.0), ([DISAGREE] * 2 + [AGREE] * 4, -1.0)):
        got = page.admit(focused_context(layers))
        assert got.capacity_bound is False and got.score == pytest.approx(want)
        assert got.policy is page.base
    # Partial agreement: two heads on one set, two on another: 2 of 6 pairs agree.
    half = page.agreement(focused_context([[1, 1, 5, 5]] * 3))
    np.testing.assert_allclose(half.numpy(), [1 / 3] * 3, atol=1e-6)
    # span: the first and last half of the layers here.
    wide = parse_policy("page:base=recent,retain=0.5,k=5,span=0.5,threshold=0.4")
    assert wide.drop(capacity) == pytest.approx(2 / 3)  # early (1,1,0) vs late (0,0,0)


def test_page_spec_and_bad_parameters():
    page = parse_policy("page:base=snapkv,retain=0.5")
    again = parse_policy(page.spec())
    assert again.spec() == page.spec() and again.base.spec() == page.base.spec()
    assert page.base.spec() == parse_policy("snapkv:retain=0.5").spec()
    decode = parse_policy("page:base=streaming,budget=12,mode=decode,threshold=0.2")
    assert decode.decode_time and decode.base.params["budget"] == 12
    for spec, message in [
        ("page:retain=0.5", "needs base="),
        ("page:base=nope,retain=0.5", "unknown base policy 'nope'"),
        ("page:base=page,retain=0.5", "unknown base policy 'page'"),
        ("page:base=snapkv", "exactly one of retain"),
        ("page:base=snapkv,retain=0.5,threshold=2", "threshold must be in"),
        ("page:base=snapkv,retain=0.5,k=0", "k and queries must be >= 1"),
        ("page:base=snapkv,retain=0.5,span=0.9", "span must be in"),
        ("page:base=snapkv,retain=0.5,windw=3", "no parameter windw"),
    ]:
        with pytest.raises(PolicyError, match=message):
            parse_policy(spec)


def eager_drop(arch: str, queries: int, k: int) -> float:
    """The agreement drop from eager attention weights of the prompt prefix (2 layers: the
    first is early, the last late)."""
    with torch.no_grad():
        att = model(arch, "eager")(torch.tensor([PROMPT[:-1]]), output_attentions=True).attentions
    agreement = []
    for a in att:
        votes = a[0, :, -queries:].sum(1)  # (heads, n - 1)
        sets = [set(torch.argsort(v, descending=True, stable=True)[:k].tolist()) for v in votes]
        pairs = [(i, j) for i in range(len(sets)) for j in range(i + 1, len(sets))]
        agreement.append(
            np.mean([len(sets[i] & sets[j]) / len(sets[i] | sets[j]) for i, j in pairs])
        )
    return agreement[0] - agreement[-1]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_traced_gate_score_class_and_eviction(arch):
    """The recorded score equals the eager-weights reference; a threshold below it keeps the
    whole cache (no hazard, nothing evicted), one above it traces exactly the base policy."""
    m = model(arch)
    want = eager_drop(arch, 6, 5)
    settings = TraceSettings(
        horizon=4, replicates=2, branches=1, window=2, record=Record("topk", 4)
    )
    below = f"page:base=snapkv,retain=0.5,window=4,queries=6,k=5,threshold={want - 0.05:.6f}"
    above = f"page:base=snapkv,retain=0.5,window=4,queries=6,k=5,threshold={want + 0.05:.6f}"
    kept, _ = trace_document(m, PROMPT, [below], settings, seed=2)
    evicted, _ = trace_document(m, PROMPT, [above], settings, seed=2)
    base, _ = trace_document(m, PROMPT, ["snapkv:retain=0.5,window=4"], settings, seed=2)
    for arr in (kept, evicted):
        assert arr["gate_score"][0] == pytest.approx(want, abs=1e-6)
    assert kept["gate_class"][0] == 1 and not kept["eviction_applied"][0]
    assert kept["kept_length"][0] == len(PROMPT) and kept["hazard"].max() <= 1e-6
    assert evicted["gate_class"][0] == 0 and evicted["eviction_applied"][0]
    for name in base:
        if name not in ("gate_score", "gate_class"):
            np.testing.assert_array_equal(evicted[name], base[name], err_msg=name)
    assert base["gate_class"][0] == -1 and np.isnan(base["gate_score"][0])


def test_analysis_splits_a_traced_store_by_gate_class(tmp_path):
    from kvcouple.analysis import analyze
    from kvcouple.analysis.gates import split_by_gate_class

    rng = np.random.default_rng(4)
    prompts = [
        Prompt(f"d{i}", tuple(int(t) for t in rng.integers(1, VOCAB - 1, 20))) for i in range(4)
    ]
    m = model("llama")
    # The median drop of these prompts as threshold: both classes occur.
    drops = []
    for p in prompts:
        arr, _ = trace_document(
            m, list(p.input_ids), ["page:base=recent,retain=0.5,k=4"], TraceSettings(horizon=1)
        )
        drops.append(float(arr["gate_score"][0]))
    threshold = float(np.median(drops))
    spec = f"page:base=recent,retain=0.5,k=4,threshold={threshold:.6f}"
    settings = TraceSettings(horizon=4, replicates=2, branches=1, window=2)
    out = tmp_path / "g.zarr"
    trace(m, prompts, [spec, "recent:retain=0.5"], settings, out, progress=False)
    rows = split_by_gate_class(analyze(out, n_boot=20))
    by = {(r["policy"][:4], r["gate_class"]): r for r in rows}
    capacity, dilution = by[("page", "capacity-bound")], by[("page", "dilution-prone")]
    assert capacity["documents"] + dilution["documents"] == 4
    assert capacity["documents"] == sum(d > threshold for d in drops)
    assert capacity["eviction_applied"] == 0 and dilution["eviction_applied"] == 1
    assert capacity["occurrence"] == 0  # kept whole: never diverges
    assert capacity["gate_score"] > threshold >= dilution["gate_score"]
    assert by[("rece", "ungated")]["documents"] == 4
