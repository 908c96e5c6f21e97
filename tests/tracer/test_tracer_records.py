"""Where records go: whole distributions of the path and the branches to preallocated host
buffers without a per-step synchronisation (issue 12), landing where the synchronous code put
them; every other record into device buffers preallocated for every step (issue 21)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvcouple.store import Record  # noqa: E402
from kvcouple.store.schema import NO_TOKEN  # noqa: E402
from kvcouple.tracer import TraceSettings, trace_document  # noqa: E402
from kvcouple.tracer.records import HostRecords, LagRecords, staged_names  # noqa: E402

pytestmark = pytest.mark.torch

from tracer_helpers import (  # noqa: E402
    PROMPT,
    VOCAB,
    is_tensor,
    kept_positions,
    masked_forward,
    model,
    one_thread,  # noqa: F401 - autouse fixture
)

SPECS = ["recent:retain=0.5", "h2o:retain=0.5,mode=decode"]  # forked and replayed branches


def test_host_records_fill_their_slots_in_order():
    """Rows land in the next slots, ``rows`` picks rows, other records are left in the dict,
    a scatter writes only the slots' places (the rest keeps its fill), ``by_step`` is
    ``(rows, steps, ...)``; on CPU nothing is pinned."""
    staged = HostRecords(["a", "b"], 5, "cpu")
    step0 = {"a": torch.arange(6.0).reshape(3, 2), "b": torch.tensor([1, 2, 3]), "c": 7}
    staged.take(step0, torch.tensor([2, 0]))
    assert step0 == {"c": 7}
    staged.take({"a": torch.full((3, 2), -1.0), "b": torch.tensor([4, 5, 6])}, torch.tensor([1]))
    arrays = staged.arrays()
    np.testing.assert_array_equal(arrays["a"], [[4, 5], [0, 1], [-1, -1]])
    np.testing.assert_array_equal(arrays["b"], [3, 1, 5])
    assert not staged.buffers["a"].is_pinned()
    out = {"a": np.full((2, 3, 2), np.nan), "b": np.full((2, 3), -9)}
    staged.scatter(out, (np.array([0, 1, 1]), np.array([2, 0, 1])))
    np.testing.assert_array_equal(out["b"], [[-9, -9, 3], [1, 5, -9]])
    np.testing.assert_array_equal(out["a"][1, 0], [0, 1])
    assert np.isnan(out["a"][0, :2]).all() and np.isnan(out["a"][1, 2]).all()
    with pytest.raises(ValueError, match="more than 5 rows"):
        staged.take({"a": torch.zeros(3, 2), "b": torch.zeros(3)})

    path = HostRecords(["p"], 3 * 2, "cpu")  # 2 rows, 3 steps
    for t in range(3):
        path.take({"p": torch.tensor([[t, 0], [t, 1]], dtype=torch.float16)})
    by_step = path.by_step(3)["p"]
    assert by_step.shape == (2, 3, 2) and by_step.dtype == np.float16
    np.testing.assert_array_equal(by_step[1, :, 0], [0, 1, 2])
    np.testing.assert_array_equal(by_step[:, 2, 1], [0, 1])

    assert staged_names(Record("full"), "branch_") == ["branch_p", "branch_q"]
    assert staged_names(Record("topk", 3)) == [] and HostRecords([], 4, "cpu").arrays() == {}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
def test_host_records_are_pinned_on_cuda():
    staged = HostRecords(["p"], 4, "cuda")
    value = torch.rand(4, 1000, device="cuda").to(torch.float16)
    staged.take({"p": value}, torch.tensor([3, 1], device="cuda"))
    assert staged.buffers["p"].is_pinned()
    np.testing.assert_array_equal(staged.arrays()["p"], value[[3, 1]].cpu().numpy())


def _observed(arr: dict, settings: TraceSettings) -> tuple[np.ndarray, np.ndarray]:
    """Where the path ``(policy, rep, step)`` and the branches ``(policy, rep, branch, lag)``
    observe a distribution."""
    path = ~((arr["tokens"] == NO_TOKEN) & (arr["hazard"] == 0))
    start = arr["branch_step"][..., None]
    last = np.minimum(settings.window, settings.horizon - start)
    branch = (start > 0) & (np.arange(settings.window + 1) <= last)
    return path, branch


def test_full_and_topk_records_agree():
    """Same seed, ``full`` and ``topk:5``: the same draws; every observed full row sums to 1
    (float16), every other row is the fill; the top-k are the largest entries of the full
    row (their probabilities rounded to float16), the tail mass is the rest."""
    m = model("llama")
    arr = {}
    for record in ("full", "topk:5"):
        settings = TraceSettings(  # batches of 3: groups of rows at different lags
            horizon=6,
            replicates=2,
            branches=2,
            window=3,
            record=Record.parse(record),
            branch_batch=3,
        )
        arr[record], _ = trace_document(m, PROMPT, SPECS, settings, seed=4)
    full, topk = arr["full"], arr["topk:5"]
    for name in ("tokens", "hazard", "branch_step", "branch_tokens_p", "branch_tokens_q"):
        np.testing.assert_array_equal(full[name], topk[name], err_msg=name)
    path, branch = _observed(full, settings)
    assert (full["branch_step"] > 1).any() and branch.sum() > 4
    for prefix, seen in (("", path), ("branch_", branch)):
        for side in ("p", "q"):
            dist = full[f"{prefix}{side}"]
            assert dist.dtype == np.float16 and dist.shape == (*seen.shape, VOCAB)
            sums = dist[seen].astype(np.float64).sum(-1)
            np.testing.assert_allclose(sums, 1.0, atol=3e-3)
            assert np.isnan(dist[~seen]).all()
            ids = topk[f"{prefix}topk_ids_{side}"]
            probs = topk[f"{prefix}topk_probs_{side}"]
            assert (ids[~seen] == NO_TOKEN).all() and np.isnan(probs[~seen]).all()
            rows, ids, probs = dist[seen], ids[seen].astype(np.int64), probs[seen]
            np.testing.assert_array_equal(
                np.take_along_axis(rows, ids, -1), probs.astype(np.float16)
            )
            rest = rows.copy()
            np.put_along_axis(rest, ids, -1, -1)
            assert (np.take_along_axis(rows, ids, -1).min(-1) >= rest.max(-1)).all()
            np.testing.assert_allclose(
                topk[f"{prefix}tail_mass_{side}"][seen], 1 - probs.sum(-1), atol=1e-6
            )


def test_full_records_equal_a_masked_full_forward():
    """``record=full`` (one branch per batch): the path and every branch against a full
    forward with the evicted prompt positions hidden (float16 rounding)."""
    m = model("llama")
    spec, T, L = SPECS[0], 5, 3
    settings = TraceSettings(
        horizon=T, replicates=2, branches=2, window=L, record=Record("full"), branch_batch=1
    )
    arr, _ = trace_document(m, PROMPT, [spec], settings, seed=2)
    n = len(PROMPT)
    kept, everything = kept_positions(spec, n), set(range(n))
    for rep in range(2):
        path = arr["tokens"][0, rep]
        for side, positions in (("p", everything), ("q", kept)):
            want = masked_forward(m, PROMPT + path[:-1].tolist(), n, positions)
            np.testing.assert_allclose(arr[side][0, rep], want, atol=1e-3, rtol=1e-3)
        for k in range(2):
            start = int(arr["branch_step"][0, rep, k])
            lags = min(L, T - start)
            prefix = PROMPT + path[: start - 1].tolist()
            for side, positions in (("p", everything), ("q", kept)):
                own = arr[f"branch_tokens_{side}"][0, rep, k, :lags].tolist()
                want = masked_forward(m, prefix + own, n, positions)[start - 1 : start + lags]
                got = arr[f"branch_{side}"][0, rep, k]
                np.testing.assert_allclose(got[: lags + 1], want, atol=1e-3, rtol=1e-3)
                assert np.isnan(got[lags + 1 :]).all()


def test_path_metrics_equal_the_rust_divergence_kernel_with_ties():
    """The tracer's on-device metrics (KL both ways, entropies, top-1 agreement) equal the
    Rust kernel's on rows with tied maxima (both take the first maximal index), zeros and a
    point mass."""
    from kvcouple.kernels import divergences
    from kvcouple.tracer.records import row_metrics

    p = np.array(
        [
            [0.4, 0.4, 0.2, 0.0],  # tie at 0 and 1: top-1 is 0
            [0.25, 0.25, 0.25, 0.25],
            [0.0, 0.0, 1.0, 0.0],
            [0.1, 0.3, 0.3, 0.3],  # tie at 1..3: top-1 is 1
        ]
    )
    q = np.array(
        [
            [0.3, 0.5, 0.1, 0.1],  # top-1 is 1: disagrees with p's first maximum
            [0.25, 0.25, 0.25, 0.25],  # all tied: agrees (index 0)
            [0.1, 0.1, 0.7, 0.1],
            [0.2, 0.4, 0.4, 0.0],  # top-1 is 1: agrees
        ]
    )
    entropy, kl, top = (t.numpy() for t in row_metrics(torch.from_numpy(np.concatenate([p, q]))))
    want = divergences(p, q)
    top1_agree = top[:4] == top[4:]
    np.testing.assert_array_equal(top1_agree, [False, True, True, True])
    np.testing.assert_array_equal(top1_agree, want.top1_agree)
    np.testing.assert_allclose(entropy[:4], want.entropy_p, atol=1e-12)
    np.testing.assert_allclose(entropy[4:], want.entropy_q, atol=1e-12)
    finite = np.isfinite(want.kl_pq)
    np.testing.assert_allclose(kl[:4][finite], want.kl_pq[finite], atol=1e-12)
    assert np.isinf(kl[:4][~finite]).all() and (~finite).any()  # q = 0 < p: infinite
    np.testing.assert_allclose(kl[4:], want.kl_qp, atol=1e-12)


@pytest.mark.parametrize("record", ["summary", "topk:5", "full"])
@pytest.mark.parametrize("layout", ["shared", "joint"])
def test_a_path_step_holds_no_more_tensors_than_the_last(monkeypatch, record, layout):
    """The path's records go into buffers preallocated for every step: from the third step
    on, as many tensors are alive at each path step as at the one before (a list of each
    step's records would grow by one per variable and step)."""
    import gc

    import kvcouple.tracer.engine as engine

    live: list[int] = []
    step = engine.coupled_step

    def counted(*args, **kwargs):
        gc.collect()
        live.append(sum(1 for o in gc.get_objects() if is_tensor(o)))
        return step(*args, **kwargs)

    T = 10
    settings = TraceSettings(
        horizon=T, replicates=2, branches=1, window=2, record=Record.parse(record),
        cache_layout=layout,
    )  # fmt: skip
    m = model("llama")
    trace_document(m, PROMPT, ["snapkv:retain=0.5"], settings, seed=3)  # (the model's probe)
    monkeypatch.setattr(engine, "coupled_step", counted)
    trace_document(m, PROMPT, ["snapkv:retain=0.5"], settings, seed=3)
    assert len(live) == T  # the path's steps (the branches step elsewhere)
    assert len(set(live[2:])) == 1, live


def test_lag_records_write_each_row_at_its_lag_and_cast_on_the_host():
    """Row ``i`` lands at its own lag, a row writing the spare column leaves its fills, the
    store's dtypes come back, and the mismatch is the tokens' (fill where none recorded)."""
    from kvcouple.store.schema import NO_MISMATCH

    fills = {
        "branch_tv": np.full((2, 3), np.nan, np.float32),
        "branch_tokens_p": np.full((2, 3), NO_TOKEN, np.int32),
        "branch_tokens_q": np.full((2, 3), NO_TOKEN, np.int32),
        "branch_mismatch": np.full((2, 3), NO_MISMATCH, np.int8),
        "branch_topk_ids_p": np.full((2, 3, 2), NO_TOKEN, np.int32),
    }
    records = LagRecords(fills, "cpu")
    steps = [  # (lag per row: 3 is the spare column), tv, x, y, top-2 ids
        ([0, 3], [0.5, 0.9], [4, 8], [5, 8], [[1, 2], [3, 4]]),
        ([1, 0], [0.25, 0.125], [6, 7], [6, 9], [[5, 6], [7, 8]]),
        ([3, 1], [0.75, 1e-40], [1, 2], [1, 2], [[9, 9], [9, 9]]),
    ]
    for lag, tv, x, y, ids in steps:
        records.write(
            {
                "branch_tv": torch.tensor(tv, dtype=torch.float64),
                "branch_tokens_p": torch.tensor(x),
                "branch_tokens_q": torch.tensor(y),
                "branch_topk_ids_p": torch.tensor(ids),
            },
            torch.tensor(lag),
        )
    out = records.arrays()
    assert {n: a.dtype for n, a in out.items()} == {n: a.dtype for n, a in fills.items()}
    np.testing.assert_array_equal(
        out["branch_tv"], [[0.5, 0.25, np.nan], [0.125, np.float32(1e-40), np.nan]]
    )
    np.testing.assert_array_equal(out["branch_tokens_p"], [[4, 6, -1], [7, 2, -1]])
    np.testing.assert_array_equal(out["branch_tokens_q"], [[5, 6, -1], [9, 2, -1]])
    np.testing.assert_array_equal(out["branch_mismatch"], [[1, 0, -1], [1, 0, -1]])
    np.testing.assert_array_equal(
        out["branch_topk_ids_p"][:, :2], [[[1, 2], [5, 6]], [[7, 8], [9, 9]]]
    )
    assert (out["branch_topk_ids_p"][:, 2] == NO_TOKEN).all()
