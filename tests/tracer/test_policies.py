"""Eviction policies: kept counts, shapes, GQA, determinism, parsing and bad parameters."""

import pytest

torch = pytest.importorskip("torch")

from kvcouple.policies import (  # noqa: E402
    POLICIES,
    PolicyContext,
    PolicyError,
    PolicyParameterError,
    ScorePolicy,
    UnknownPolicyError,
    kept_count,
    parse_policy,
    register_policy,
)

pytestmark = pytest.mark.torch

LAYERS, KV_HEADS, GROUP, DIM = 3, 2, 3, 8

SPECS = [
    "full",
    "snapkv:retain=0.5",
    "snapkv:budget=20,window=4,kernel=3,pool=max",
    "recent:retain=0.5",
    "streaming:sinks=4,retain=0.5",
    "h2o:retain=0.4",
    "h2o:budget=9,recent=0.25",
    "random:retain=0.5,seed=3",
    "knorm:retain=0.3",
    "tova:budget=7",
    "tova:budget=7,heads=group",
    "observed:retain=0.5",
    "valuediff:retain=0.6",
]


def make_context(length: int, seed: int = 0) -> PolicyContext:
    gen = torch.Generator().manual_seed(seed)
    keys = [torch.randn(KV_HEADS, length, DIM, generator=gen) for _ in range(LAYERS)]
    values = [torch.randn(KV_HEADS, length, DIM, generator=gen) for _ in range(LAYERS)]
    queries = [torch.randn(KV_HEADS * GROUP, length, DIM, generator=gen) for _ in range(LAYERS)]
    return PolicyContext(
        keys=keys,
        values=values,
        query_fn=lambda layer, start: queries[layer][:, start:],
        scaling=DIM**-0.5,
        num_query_heads=KV_HEADS * GROUP,
        generator=torch.Generator().manual_seed(seed + 1),
    )


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("prompt_length", [2, 5, 40, 101])
def test_kept_counts_shapes_and_range(spec, prompt_length):
    policy = parse_policy(spec)
    kept = policy.kept_count(prompt_length)
    assert 1 <= kept <= prompt_length
    ctx = make_context(prompt_length - 1)
    idx = policy.select(ctx, kept - 1)
    assert idx.shape == (LAYERS, KV_HEADS, kept - 1)
    assert idx.dtype == torch.long
    if kept > 1:
        assert int(idx.min()) >= 0 and int(idx.max()) < prompt_length - 1
        # ascending and unique per head
        assert bool((idx[..., 1:] > idx[..., :-1]).all())


@pytest.mark.parametrize("spec", SPECS)
def test_deterministic(spec):
    a = parse_policy(spec).select(make_context(60, seed=5), 20)
    b = parse_policy(spec).select(make_context(60, seed=5), 20)
    assert torch.equal(a, b)


def test_kept_count_rounding():
    assert kept_count(10, 0.5, None) == 5
    assert kept_count(9, 0.5, None) == 5  # 4.5 rounds half up
    assert kept_count(7, 0.1, None) == 1  # 0.7 -> 1
    assert kept_count(3, 0.01, None) == 1  # clamped to >= 1
    assert kept_count(100, None, 512) == 100  # clamped to the prompt
    assert parse_policy("full").kept_count(17) == 17


def test_recent_and_streaming_select_positions():
    ctx = make_context(20)
    idx = parse_policy("recent:budget=6").select(ctx, 5)
    assert idx[0, 0].tolist() == [15, 16, 17, 18, 19]
    idx = parse_policy("streaming:sinks=2,budget=6").select(ctx, 5)
    assert idx[2, 1].tolist() == [0, 1, 17, 18, 19]
    # A budget below the sinks keeps only the first tokens.
    idx = parse_policy("streaming:sinks=4,budget=3").select(ctx, 2)
    assert idx[0, 0].tolist() == [0, 1]


def test_snapkv_keeps_window_and_gqa_group_mean():
    ctx = make_context(50)
    policy = parse_policy("snapkv:budget=21,window=8,kernel=1")
    idx = policy.select(ctx, 20)
    window = list(range(42, 50))
    for layer in range(LAYERS):
        for head in range(KV_HEADS):
            assert idx[layer, head, -8:].tolist() == window
    # Independent recomputation: per query head window attention, summed, group-averaged.
    q = ctx.query_fn(1, 0)
    k = ctx.keys[1].repeat_interleave(GROUP, dim=0)
    logits = q @ k.transpose(-1, -2) * DIM**-0.5
    causal = torch.ones(50, 50, dtype=torch.bool).tril()
    att = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)
    votes = att[:, -8:, :42].sum(1).reshape(KV_HEADS, GROUP, 42).mean(1)
    want = torch.sort(torch.topk(votes, 12, dim=-1).indices, dim=-1).values
    assert torch.equal(idx[1, :, :12], want)
    # Budget within the window: the most recent entries only.
    assert parse_policy("snapkv:budget=4,window=8").select(ctx, 3)[0, 0].tolist() == [47, 48, 49]


def test_knorm_valuediff_random_semantics():
    ctx = make_context(30)
    idx = parse_policy("knorm:budget=6").select(ctx, 5)
    norms = ctx.keys[0][1].norm(dim=-1)
    assert set(idx[0, 1].tolist()) == set(torch.argsort(norms)[:5].tolist())
    idx = parse_policy("valuediff:budget=6").select(ctx, 5)
    v = ctx.values[2][0]
    dev = (v - v.mean(0)).norm(dim=-1)
    assert set(idx[2, 0].tolist()) == set(torch.argsort(dev, descending=True)[:5].tolist())
    a = parse_policy("random:budget=6,seed=1").select(make_context(30), 5)
    b = parse_policy("random:budget=6,seed=2").select(make_context(30), 5)
    assert not torch.equal(a, b)
    assert not torch.equal(a[0], a[1])  # layers draw their own subsets


def test_h2o_keeps_recent_share_and_heavy_hitters():
    ctx = make_context(40)
    idx = parse_policy("h2o:budget=11,recent=0.5").select(ctx, 10)
    assert idx[0, 0, -5:].tolist() == [35, 36, 37, 38, 39]
    acc = ctx.group_mean(ctx.accumulated_attention(0))[:, :35]
    want = set(torch.topk(acc[1], 5).indices.tolist())
    assert set(idx[0, 1, :5].tolist()) == want
    # accumulated attention: every query distributes mass 1
    total = ctx.accumulated_attention(0).sum(-1)
    torch.testing.assert_close(total, torch.full_like(total, 40.0))


def test_parse_errors():
    with pytest.raises(UnknownPolicyError, match="unknown policy 'snapk'.*snapkv"):
        parse_policy("snapk:retain=0.5")
    with pytest.raises(PolicyParameterError, match="no parameter windw.*window"):
        parse_policy("snapkv:retain=0.5,windw=3")
    with pytest.raises(PolicyParameterError, match="exactly one of retain"):
        parse_policy("recent")
    with pytest.raises(PolicyParameterError, match="exactly one of retain"):
        parse_policy("recent:retain=0.5,budget=3")
    with pytest.raises(PolicyParameterError, match="retain must be in"):
        parse_policy("recent:retain=1.5")
    with pytest.raises(PolicyParameterError, match="not a valid int"):
        parse_policy("snapkv:budget=ten")
    with pytest.raises(PolicyParameterError, match="pool"):
        parse_policy("snapkv:retain=0.5,pool=median")
    with pytest.raises(PolicyParameterError, match="odd"):
        parse_policy("snapkv:retain=0.5,kernel=4")
    with pytest.raises(PolicyParameterError, match="param=value"):
        parse_policy("recent:0.5")
    with pytest.raises(PolicyParameterError, match="no parameter"):
        parse_policy("full:retain=0.5")
    with pytest.raises(PolicyError):
        parse_policy("h2o:retain=0.5,mode=sometimes")
    assert issubclass(PolicyError, ValueError)


def test_spec_round_trip():
    for spec in SPECS:
        policy = parse_policy(spec)
        again = parse_policy(policy.spec())
        assert again.spec() == policy.spec() and again.params == policy.params


def test_plugin_scorer():
    @register_policy
    class KeyMean(ScorePolicy):
        name = "test-keymean"
        PARAMS = {"sign": (float, 1.0)}

        def score(self, ctx, layer):
            return self.params["sign"] * ctx.keys[layer].mean(-1)

    try:
        ctx = make_context(25)
        idx = parse_policy("test-keymean:budget=5,sign=-1").select(ctx, 4)
        want = torch.argsort(ctx.keys[0][0].mean(-1))[:4]
        assert idx[0, 0].tolist() == sorted(want.tolist())
    finally:
        POLICIES.pop("test-keymean")


def test_needs_queries_still_reads_and_sets_needs_attention_with_a_warning():
    """NEEDS_QUERIES, the former name of NEEDS_ATTENTION (deprecated, one release): read on a
    class or an instance, and set by a plug-in written before the rename."""
    snapkv = POLICIES["snapkv"]
    with pytest.warns(DeprecationWarning, match="use 'NEEDS_ATTENTION'"):
        assert snapkv.NEEDS_QUERIES is snapkv.NEEDS_ATTENTION is True
    with pytest.warns(DeprecationWarning, match="use 'NEEDS_ATTENTION'"):
        assert parse_policy("recent:retain=0.5").NEEDS_QUERIES is False
    with pytest.warns(DeprecationWarning, match="use 'NEEDS_ATTENTION'"):

        class OldPlugin(ScorePolicy):
            name = "test-old-plugin"
            NEEDS_QUERIES = True

    assert OldPlugin.NEEDS_ATTENTION is True
    assert OldPlugin(retain=0.5).prompt_queries() == (None, False)


def _plain_attention(ctx: PolicyContext, layer: int) -> torch.Tensor:
    """Causal softmax attention of every prefix query: ``(query_heads, length, length)``."""
    n = ctx.length
    q = ctx.query_fn(layer, 0)
    k = ctx.keys[layer].repeat_interleave(GROUP, dim=0)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    logits = (q @ k.transpose(-1, -2) * DIM**-0.5).masked_fill(~causal, float("-inf"))
    return torch.softmax(logits, dim=-1)


def test_accumulated_and_window_attention_are_causal():
    """Independent recomputation of the attention that SnapKV, H2O and TOVA score with."""
    ctx = make_context(37)
    for layer in range(LAYERS):
        att = _plain_attention(ctx, layer)
        torch.testing.assert_close(ctx.accumulated_attention(layer), att.sum(1))
        torch.testing.assert_close(ctx.window_attention(layer, 5), att[:, -5:])


def test_tova_keeps_what_the_last_query_attends_to():
    ctx = make_context(30)
    group = parse_policy("tova:budget=8,heads=group").select(ctx, 7)
    every = parse_policy("tova:budget=8").select(ctx, 7)  # heads=all, the default
    assert parse_policy("tova:budget=8").spec() == "tova:budget=8,heads=all"
    for layer in range(LAYERS):
        last = _plain_attention(ctx, layer)[:, -1]  # (query_heads, 30)
        per_group = last.reshape(KV_HEADS, GROUP, 30).mean(1)
        want = torch.sort(torch.topk(per_group, 7, dim=-1).indices, dim=-1).values
        assert torch.equal(group[layer], want), layer
        # One set per layer from the mean over every query head, as TOVA's own code.
        want = torch.sort(torch.topk(last.mean(0), 7).indices).values
        assert torch.equal(every[layer], want.expand(KV_HEADS, 7)), layer
    assert not torch.equal(group, every)  # the two conventions do differ on this context
    with pytest.raises(PolicyParameterError, match="heads must be"):
        parse_policy("tova:budget=8,heads=kv")


def test_observed_divides_by_the_queries_that_see_each_key():
    ctx = make_context(30)
    idx = parse_policy("observed:budget=9").select(ctx, 8)
    for layer in range(LAYERS):
        att = _plain_attention(ctx, layer)  # (query_heads, 30, 30)
        mean_seen = att.sum(1) / torch.arange(30, 0, -1)  # key j is seen by queries j..29
        score = mean_seen.reshape(KV_HEADS, GROUP, 30).mean(1)
        want = torch.sort(torch.topk(score, 8, dim=-1).indices, dim=-1).values
        assert torch.equal(idx[layer], want), layer
    # The division matters: the plain sum (H2O's score, no recent share) keeps other entries.
    plain = parse_policy("h2o:budget=9,recent=0").select(ctx, 8)
    assert not torch.equal(idx, plain)
    with pytest.raises(PolicyParameterError, match="mode=decode is not supported"):
        parse_policy("observed:budget=9,mode=decode")


def test_h2o_recent_share_rounds_half_up():
    policy = parse_policy("h2o:budget=10,recent=0.5")
    assert [policy.recent_count(k) for k in (9, 5, 4, 1)] == [5, 3, 2, 1]
    ctx = make_context(40)
    idx = policy.select(ctx, 9)
    assert idx[1, 0, -5:].tolist() == [35, 36, 37, 38, 39]
    acc = ctx.group_mean(ctx.accumulated_attention(1))[:, :35]
    for head in range(KV_HEADS):
        want = torch.sort(torch.topk(acc[head], 4).indices).values
        assert idx[1, head, :4].tolist() == want.tolist()


def test_kvpress_policy_without_kvpress_says_how_to_install():
    """Where kvpress cannot be imported (not installed, or a transformers it does not accept),
    a ``kvpress:`` spec fails when parsed, naming the extra. With kvpress, see
    tests/interop/test_kvpress.py."""
    from kvcouple.errors import MissingExtraError

    try:
        import kvpress  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("kvpress is importable here: tests/interop/test_kvpress.py covers it")
    with pytest.raises(MissingExtraError, match=r"pip install 'kvcouple\[kvpress\]'"):
        parse_policy("kvpress:KnormPress,compression_ratio=0.5")
    # A spec's first item without "=" is an error for every other policy.
    with pytest.raises(PolicyParameterError, match="param=value"):
        parse_policy("snapkv:SnapKVPress,retain=0.5")


@pytest.mark.parametrize(
    "spec",
    [
        "streaming:budget=6,sinks=2,mode=decode",
        "recent:budget=6,mode=decode",
        "h2o:budget=6,mode=decode",
    ],
)
def test_decode_rules_keep_the_same_scored_over_all_layers_at_once(spec):
    """A rule scored from slot state alone (``slot_score``) is scored once over every layer's
    stacked state when the tracer holds it so; it keeps what scoring each layer keeps."""
    import dataclasses

    from kvcouple.policies import DecodeCache, parse_policy

    gen = torch.Generator().manual_seed(3)
    layers, B, kv, S, d = 3, 2, 2, 11, 4
    rule = parse_policy(spec).decode_rule(6)
    position = torch.stack([torch.randperm(S, generator=gen) for _ in range(layers * B * kv)])
    stacked = {
        "position": position.view(layers, B, kv, S),
        "h2o_score": torch.rand(layers, B, kv, S, generator=gen),
    }
    visible = torch.ones(B, S, dtype=torch.bool)
    visible[1, 3] = False
    current = torch.full((B,), S)
    caches = [
        DecodeCache(
            layer=layer,
            keys=torch.zeros(B, kv, S, d),
            values=torch.zeros(B, kv, S, d),
            visible=visible,
            state={k: v[layer] for k, v in stacked.items()},
            current=current,
            rows=torch.arange(B),
            scaling=0.5,
            num_query_heads=kv,
        )
        for layer in range(layers)
    ]
    per_layer = rule.keep(caches)
    at_once = rule.keep([dataclasses.replace(c, all_layers_state=stacked) for c in caches])
    for a, b in zip(per_layer, at_once, strict=True):
        assert torch.equal(a, b)
    assert not bool((per_layer[0][1] == 3).any())  # a hidden slot is never kept


@pytest.mark.parametrize(
    "spec", ["snapkv:budget=6,window=3,mode=decode", "knorm:budget=6,mode=decode"]
)
def test_rescore_rule_keeps_the_same_with_the_stacked_slot_state(spec):
    """RescoreRule sorts every layer's slots at once from the stacked slot state; it keeps
    what sorting each layer's own state keeps."""
    import dataclasses

    from kvcouple.policies import DecodeCache, parse_policy

    gen = torch.Generator().manual_seed(4)
    layers, B, kv, H, S, d, W = 3, 2, 2, 4, 11, 4, 3
    rule = parse_policy(spec).decode_rule(6)
    position = torch.stack([torch.randperm(S, generator=gen) for _ in range(layers * B * kv)])
    stacked = {"position": position.view(layers, B, kv, S)}
    visible = torch.ones(B, S, dtype=torch.bool)
    visible[:, 4] = False  # every row holds as many entries
    caches = [
        DecodeCache(
            layer=layer,
            keys=torch.randn(B, kv, S, d, generator=gen),
            values=torch.randn(B, kv, S, d, generator=gen),
            visible=visible,
            state={k: v[layer] for k, v in stacked.items()},
            current=torch.full((B,), S),
            rows=torch.arange(B),
            scaling=0.5,
            num_query_heads=H,
            queries=torch.randn(B, H, W, d, generator=gen),
            query_positions=torch.arange(S - W, S).expand(B, -1),
            held=S - 1,
            current_position=S,
            row_ids=(0, 1),
        )
        for layer in range(layers)
    ]
    per_layer = rule.keep(caches)
    at_once = rule.keep([dataclasses.replace(c, all_layers_state=stacked) for c in caches])
    for a, b in zip(per_layer, at_once, strict=True):
        assert torch.equal(a, b)
    assert not bool((per_layer[1] == 4).any())  # a hidden slot is never kept
