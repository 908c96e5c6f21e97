"""Cascade attention over shared prefixes (kvcouple.tracer.prefix): groups, packed calls,
prompt packs and gathered forks equal dense float64 attention on every attention path (CPU
flash, matrix products, CUDA's memory-efficient kernel through its CPU stand-in)."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.torch

from tracer_helpers import one_thread  # noqa: E402, F401 - autouse fixture


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


@pytest.mark.parametrize("path", [*LSE_PATHS, "efficient-sides"])
def test_a_batch_of_documents_in_one_pack_is_one_call_exact_per_document(path, monkeypatch):
    """Three documents of different prompt lengths in one :class:`PromptPack` (padded to the
    longest), each with P rows on its prompt and Q rows on its kept entries: one prefix call
    per layer covers every row, and each row's output equals dense float64 attention over its
    own document's prompt (P) or kept entries (Q) followed by its own columns; the fused
    kernel (CPU), the matrix-product path (other devices) and CUDA's kernel alike, the last
    also with the sides as its batch (``efficient-sides``: the pack broadcast over them with
    stride 0, every document's KV heads as the call's heads)."""
    import kvcouple.tracer.prefix as prefix
    from kvcouple.tracer.prefill import gather_kept, hidden_entries
    from kvcouple.tracer.prefix import PrefixGroup, PromptPack, SharedPrefix, prefix_attention

    sides = path == "efficient-sides"
    monkeypatch.setattr(prefix, "sides_batched", lambda *a: sides)
    path = "efficient" if sides else path

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
    assert (shared.sides is not None) == sides
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
        # (the sides form: a batch of 2, the pack broadcast over it)
        calls.append(args[1].shape[0] if args[1].stride(0) else -args[1].shape[1])
        return real(*args, **kwargs)

    prefix_call = -D * KV if sides else D  # every document's prefix at once

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(prefix, "attend_lse", attend)
        got = prefix_attention(query, own_k, own_v, None, 0.25, shared, 0)
    assert calls == [B, prefix_call]  # the own columns, then every document's prefix
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
    def forked(layout):
        """The fork of groups ``(P or Q, document, rows)`` in order, and each row's (side,
        document)."""
        fork_groups, kinds, row = [], [], 0
        for side, doc, count in layout:
            hidden = groups[D + doc].hidden if side else None
            fork_groups.append(PrefixGroup(row, row + count, views[doc], hidden, (pack, doc)))
            kinds += [(side, doc)] * count
            row += count
        return shared.of_groups(fork_groups), kinds

    def check_fork(fork, kinds, prefix_call):
        """Two attention calls, and every row equal to dense attention over its own prefix."""
        Bf = len(kinds)
        qf = torch.randn(Bf, H, 1, d, generator=g)
        kf, vf = torch.randn(Bf, KV, s, d, generator=g), torch.randn(Bf, KV, s, d, generator=g)
        calls.clear()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(prefix, "attend_lse", attend)
            got = prefix_attention(qf, kf, vf, None, 0.25, fork, 0)
        assert calls == [Bf, prefix_call]
        for r, (side, doc) in enumerate(kinds):
            kp, vp = docs[doc][0] if side == 0 else gather_kept(docs[doc], idx[doc])[0]
            keys = torch.cat([kp, kf[r : r + 1]], 2)
            values = torch.cat([vp, vf[r : r + 1]], 2)
            seen = torch.ones(1, 1, keys.shape[2], dtype=torch.bool)
            want = _dense_attention(qf[r : r + 1], keys, values, seen, 0.25)
            torch.testing.assert_close(got[r : r + 1].double(), want, atol=2e-6, rtol=1e-5)

    fork, kinds = forked(
        [(0, 1, 1), (1, 0, 3), (0, 2, 2), (1, 2, 1), (0, 0, 1), (1, 1, 2), (1, 0, 1)]
    )
    assert fork.packed is not None and fork.gather is not None
    assert fork.packed[0][2] is shared.packed[0][2]  # the source batch's masks, not copies
    assert (fork.sides is not None) == sides
    check_fork(fork, kinds, prefix_call)
    # A fork of some of the documents is one call over the range of the pack from the first
    # with rows to the last (views of the pack and of the batch's masks): documents left out
    # at an end are not read, one left out inside the range (document 1 of 0 and 2) is.
    for (first, second), width in (((1, 0), 2), ((0, 2), 3), ((2, 1), 2)):
        part, kinds = forked([(0, first, 2), (1, second, 2), (0, second, 2)])
        assert part.packed is not None and part.gather is not None
        assert part.packed[0][0].shape[0] == width
        lo = min(first, second)
        assert part.packed[0][0].data_ptr() == pack.kv[0][0][lo].data_ptr()  # a view
        assert part.packed[0][2].data_ptr() == shared.packed[0][2][lo].data_ptr()
        check_fork(part, kinds, -width * KV if sides else width)
    # A group whose slot label disagrees with its tensors (document 0's label on document 1's
    # prompt) is not packed: the packed call would attend to the label's prompt.
    mislabelled = [*groups]
    mislabelled[0] = PrefixGroup(0, n, views[1], None, (pack, 0))
    assert SharedPrefix(mislabelled).packed is None
    with pytest.raises(ValueError, match="document 1 has 9 entries, not 13"):
        pack.put(1, docs[0])


@pytest.mark.parametrize("hide", [True, False])
@pytest.mark.parametrize("fork", [False, True])
def test_one_documents_sides_as_the_kernels_batch_equal_dense_attention(hide, fork, monkeypatch):
    """CUDA's kernel takes one document's P and Q rows as its batch, the prompt broadcast over
    it with stride 0 (``sides_batched``; here through the kernel's stand-in, which refuses a
    batch that is not the queries'): one kernel call per layer, no stacks, and every row
    equals dense float64 attention over its prompt (P) or kept entries (Q) and its own
    columns; also for a fork with unequal rows per side (gathered), and with nothing hidden."""

    import kvcouple.tracer.prefix as prefix
    from kvcouple.testing.efficient_attention import efficient_attention
    from kvcouple.tracer import lse_attention
    from kvcouple.tracer.prefill import gather_kept, hidden_entries
    from kvcouple.tracer.prefix import PrefixGroup, SharedPrefix, prefix_attention

    calls = []

    def efficient(query, key, *args, **kwargs):
        calls.append((tuple(query.shape), key.stride(0)))
        return lse_attention.efficient_lse(query, key, *args, kernel=efficient_attention, **kwargs)

    monkeypatch.setattr(prefix, "attend_lse", efficient)
    monkeypatch.setattr(prefix, "sides_batched", lambda *a: True)
    g = torch.Generator().manual_seed(5)
    H, KV, d, s, n1, keep = 8, 2, 16, 4, 21, 9
    kv = [(torch.randn(1, KV, n1, d, generator=g), torch.randn(1, KV, n1, d, generator=g))]
    idx = torch.stack([torch.randperm(n1, generator=g)[:keep].sort().values for _ in range(KV)])
    if not hide:
        idx = torch.arange(n1).expand(KV, n1)
    hidden = hidden_entries(kv, idx[None]) if hide else [torch.zeros(1, KV, 1, n1)]
    p_rows, q_rows = (2, 3) if fork else (3, 3)
    B = p_rows + q_rows
    groups = [PrefixGroup(0, p_rows, kv), PrefixGroup(p_rows, B, kv, hidden)]
    shared = SharedPrefix(groups)
    assert shared.packed is not None and shared.sides is not None
    assert (shared.gather is not None) == fork
    own_k, own_v = torch.randn(B, KV, s, d, generator=g), torch.randn(B, KV, s, d, generator=g)
    kept = gather_kept(kv, idx[None])
    # One query per row (a decoding step), then two on the same prefix (the sides' masks are
    # expanded per query count, not once for good).
    for q in (1, 2, 1):
        calls.clear()
        query = torch.randn(B, H, q, d, generator=g)
        got = prefix_attention(query, own_k, own_v, None, 0.25, shared, 0)
        prefix_calls = [c for c in calls if c[0][0] == 2]
        assert len(prefix_calls) == 1 and prefix_calls[0][1] == 0  # one call, prompt broadcast
        for rows, (kp, vp) in ((slice(0, p_rows), kv[0]), (slice(p_rows, B), kept[0])):
            m = rows.stop - rows.start
            keys = torch.cat([kp.expand(m, -1, -1, -1), own_k[rows]], 2).double()
            values = torch.cat([vp.expand(m, -1, -1, -1), own_v[rows]], 2).double()
            seen = torch.ones(m, q, keys.shape[2], dtype=torch.bool)
            want = _dense_attention(query[rows].double(), keys, values, seen, 0.25)
            torch.testing.assert_close(got[rows].double(), want, atol=2e-6, rtol=1e-5)
    # The per-head form of the same kernel gives the same rows.
    monkeypatch.setattr(prefix, "sides_batched", lambda *a: False)
    per_head = SharedPrefix(groups)
    assert per_head.sides is None
    torch.testing.assert_close(
        prefix_attention(query, own_k, own_v, None, 0.25, per_head, 0), got, atol=2e-6, rtol=1e-5
    )


def test_a_trace_with_the_sides_as_the_kernels_batch_records_what_cpu_flash_records(
    monkeypatch,
):
    """One document traced with its packed prefix calls in the sides form (through the
    kernel's stand-in), path and forked branches: the records equal those of the CPU's flash
    kernel to float noise."""

    import numpy as np

    import kvcouple.tracer.prefix as prefix
    from kvcouple.testing.efficient_attention import efficient_attention
    from kvcouple.testing.tiny_models import tiny_model
    from kvcouple.tracer import TraceSettings, lse_attention, trace_document

    m = tiny_model("llama", num_hidden_layers=2, attn_implementation="sdpa")
    prompt = np.random.default_rng(1).integers(1, 120, 29).tolist()
    settings = TraceSettings(horizon=7, replicates=3, branches=2, window=3, cache_layout="shared")
    spec = ["snapkv:retain=0.5,window=4"]
    want, _ = trace_document(m, prompt, spec, settings, seed=4)
    broadcast = []

    def efficient(query, key, *args, **kwargs):
        broadcast.append(key.stride(0) == 0 and query.shape[0] == 2)
        return lse_attention.efficient_lse(query, key, *args, kernel=efficient_attention, **kwargs)

    monkeypatch.setattr(prefix, "attend_lse", efficient)
    monkeypatch.setattr(prefix, "sides_batched", lambda *a: True)
    got, _ = trace_document(m, prompt, spec, settings, seed=4)
    assert any(broadcast)
    assert want.keys() == got.keys()
    for name in want:
        a, b = np.asarray(want[name]), np.asarray(got[name])
        if a.dtype.kind == "f":
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5, err_msg=name)
        else:
            np.testing.assert_array_equal(a, b, err_msg=name)


def test_a_batch_of_documents_traced_with_the_sides_as_the_kernels_batch_records_as_cpu_flash(
    monkeypatch,
):
    """Three documents of different prompt lengths traced as one batch (one prompt pack) with
    their packed prefix calls in the sides form (every document's KV heads as the heads of one
    kernel call, through the stand-in), path and forked branches: every document's records
    equal those of the CPU's flash kernel to float noise."""
    import numpy as np

    import kvcouple.tracer.prefix as prefix
    from kvcouple.policies import parse_policy
    from kvcouple.testing.efficient_attention import efficient_attention
    from kvcouple.testing.tiny_models import tiny_model
    from kvcouple.tracer import TraceSettings, lse_attention
    from kvcouple.tracer.batches import trace_documents_records

    m = tiny_model("llama", num_hidden_layers=2, attn_implementation="sdpa")
    rng = np.random.default_rng(2)
    settings = TraceSettings(
        horizon=6, replicates=2, branches=2, window=3, cache_layout="shared", branch_batch=3
    )
    batch = [
        (rng.integers(1, 120, length).tolist(), i, f"d{i}", settings)
        for i, length in enumerate((29, 22, 17))
    ]
    policies = [parse_policy("snapkv:retain=0.5,window=4")]
    want = trace_documents_records(m, batch, policies, seed=6)
    heads = []

    def efficient(query, key, *args, **kwargs):
        if key.stride(0) == 0:
            heads.append(int(key.shape[1]))
        return lse_attention.efficient_lse(query, key, *args, kernel=efficient_attention, **kwargs)

    monkeypatch.setattr(prefix, "attend_lse", efficient)
    monkeypatch.setattr(prefix, "sides_batched", lambda *a: True)
    got = trace_documents_records(m, batch, policies, seed=6)
    kv_heads = m.config.num_key_value_heads
    assert 3 * kv_heads in heads  # the path: every document in one call
    for doc_want, doc_got in zip(want, got, strict=True):
        assert doc_want.arrays.keys() == doc_got.arrays.keys()
        for name in doc_want.arrays:
            a, b = np.asarray(doc_want.arrays[name]), np.asarray(doc_got.arrays[name])
            if a.dtype.kind == "f":
                np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5, err_msg=name)
            else:
                np.testing.assert_array_equal(a, b, err_msg=name)


@pytest.mark.parametrize("path", LSE_PATHS)
def test_a_fork_of_documents_shorter_than_the_pack_hides_its_padding(path, monkeypatch):
    """A fork of the pack's two short documents, P rows only (no mask of their own): the call
    covers that range of the pack, as wide as its longest document, so the padding past each
    short prompt is masked; every row equals dense float64 attention over its own prompt."""
    import kvcouple.tracer.prefix as prefix
    from kvcouple.tracer.prefix import PrefixGroup, PromptPack, SharedPrefix, prefix_attention

    monkeypatch.setattr(prefix, "attend_lse", _attend_by(path))
    g = torch.Generator().manual_seed(3)
    KV, d, H, s = 2, 16, 4, 3
    lengths = [13, 6, 6]
    docs = [
        [(torch.randn(1, KV, m, d, generator=g), torch.randn(1, KV, m, d, generator=g))]
        for m in lengths
    ]
    pack = PromptPack.allocate(docs[0], lengths)
    for i, kv in enumerate(docs):
        pack.put(i, kv)
    groups = [
        PrefixGroup(2 * j, 2 * j + 2, pack.slot(i), None, (pack, i)) for j, i in enumerate((1, 2))
    ]
    fork = SharedPrefix(groups)
    assert fork.packed is not None and fork.packed[0][0].shape[:3] == (2, KV, 13)
    query = torch.randn(4, H, 1, d, generator=g)
    own_k, own_v = torch.randn(4, KV, s, d, generator=g), torch.randn(4, KV, s, d, generator=g)
    got = prefix_attention(query, own_k, own_v, None, 0.25, fork, 0)
    for r, doc in enumerate((1, 1, 2, 2)):
        kp, vp = docs[doc][0]
        keys = torch.cat([kp, own_k[r : r + 1]], 2)
        values = torch.cat([vp, own_v[r : r + 1]], 2)
        seen = torch.ones(1, 1, keys.shape[2], dtype=torch.bool)
        want = _dense_attention(query[r : r + 1], keys, values, seen, 0.25)
        torch.testing.assert_close(got[r : r + 1].double(), want, atol=2e-6, rtol=1e-5)
