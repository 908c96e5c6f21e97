"""Several documents per batch: their overlap paths run as one batch of rows over prefixes
held once (the shared cache layout); records equal one-at-a-time tracing to float noise, and a
resumed run equals an uninterrupted one exactly."""

from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import xarray as xr  # noqa: E402

from kvcouple.store import Record  # noqa: E402
from kvcouple.tracer import Prompt, TraceSettings, trace  # noqa: E402

pytestmark = pytest.mark.torch

from tracer_helpers import model, one_thread  # noqa: E402, F401 - autouse fixture

SPECS = ["snapkv:retain=0.5,window=4", "recent:retain=0.3", "h2o:retain=0.5,mode=decode"]


def _prompts(lengths):
    rng = np.random.default_rng(1)
    return [Prompt(f"d{i}", tuple(rng.integers(1, 120, n).tolist())) for i, n in enumerate(lengths)]


def _settings(doc_batch):
    return TraceSettings(
        horizon=6,
        replicates=2,
        branches=2,
        window=3,
        record=Record.parse("topk:5"),
        doc_batch=doc_batch,
    )


def _assert_same(a, b, exact=False):
    for name in a.data_vars:
        x, y = a[name].values, b[name].values
        if x.dtype.kind == "f" and not exact:
            np.testing.assert_allclose(x, y, atol=2e-5, err_msg=name)
        else:
            np.testing.assert_array_equal(x, y, err_msg=name)


def test_batched_documents_equal_one_at_a_time(tmp_path, monkeypatch):
    """Five documents of different lengths, three at a time: every one-shot policy runs its
    overlap paths and then its branches as batches of 3 and 2 documents (decode-time eviction
    one at a time), and the store equals tracing one document at a time."""
    from kvcouple.tracer.layout import SharedRows

    m = model("qwen3")
    prompts = _prompts([20, 33, 27, 41, 25])
    units = []
    start_units = SharedRows.start_units.__func__

    packed = []

    def spy(cls, model, sides, copies, steps, slots=None):
        rows = start_units(cls, model, sides, copies, steps, slots)
        if copies == 2:  # (not the support check's trial trace, R = 1)
            units.append(len(sides))
            packed.append(rows.shared.packed is not None)
        return rows

    monkeypatch.setattr(SharedRows, "start_units", classmethod(spy))
    fork = SharedRows.fork
    fork_groups = []

    def fork_spy(self, index, visible_before, steps=0):
        forked = fork(self, index, visible_before, steps)
        fork_groups.append(len(forked.shared.groups))
        return forked

    monkeypatch.setattr(SharedRows, "fork", fork_spy)
    trace(m, prompts, SPECS, _settings(3), tmp_path / "b3.zarr", progress=False)
    assert units == [3, 3, 2, 2]  # two one-shot policies x two batches of documents
    # Every batch's prompts are one pack: one prefix call per layer for all its rows.
    assert packed == [True] * 4
    # The branches of a batch's documents fork together: a prefix group per document and side.
    assert max(fork_groups) == 6
    units.clear()
    trace(m, prompts, SPECS, _settings(1), tmp_path / "b1.zarr", progress=False)
    assert units == [1] * 10  # one document at a time, still shared
    _assert_same(xr.open_zarr(tmp_path / "b1.zarr"), xr.open_zarr(tmp_path / "b3.zarr"))


def test_a_resumed_partial_batch_equals_an_uninterrupted_run(tmp_path):
    """Stopped after two documents of a batch of three, the resumed run traces the batch whole
    again and writes only the third: the store is bit for bit the uninterrupted one."""
    m = model("llama")
    prompts = _prompts([18, 25, 30, 22])
    specs = SPECS[:2]
    ref, part = tmp_path / "ref.zarr", tmp_path / "part.zarr"
    trace(m, prompts, specs, _settings(3), ref, progress=False)
    first = trace(m, prompts, specs, _settings(3), part, progress=False, max_docs=2)
    assert first.traced == [0, 1]
    second = trace(m, prompts, specs, _settings(3), part, progress=False)
    assert second.traced == [2, 3] and second.skipped == 2
    _assert_same(xr.open_zarr(ref), xr.open_zarr(part), exact=True)


def test_document_batches_follow_the_memory_plan():
    from kvcouple.tracer.memory import DocumentFootprint
    from kvcouple.tracer.planner import MAX_DOC_ROWS, document_batches

    def plan(peak, budget, tokens=10):
        return DocumentFootprint(
            "", tokens, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, peak, "path", budget=budget
        )

    docs = list(range(6))
    # CPU (no budget): auto traces one at a time; a number is taken as given.
    unknown = {d: plan(10, None) for d in docs}
    assert document_batches(docs, unknown, _settings("auto")) == [[d] for d in docs]
    assert document_batches(docs, unknown, _settings(4)) == [[0, 1, 2, 3], [4, 5]]
    # A budget: documents join a batch while their peaks fit it together.
    peaks = [30, 30, 30, 50, 60, 10]
    fitted = {d: plan(p, 100) for d, p in zip(docs, peaks, strict=True)}
    assert document_batches(docs, fitted, _settings("auto")) == [[0, 1, 2], [3], [4, 5]]
    # auto: at most MAX_DOC_ROWS rows (2R per document).
    small = {d: plan(1, 10**9) for d in range(100)}
    batches = document_batches(range(100), small, _settings("auto"))
    assert max(len(b) for b in batches) == MAX_DOC_ROWS // 4
    assert [d for b in batches for d in b] == list(range(100))
    # Prompts within a factor of two share a batch (their prefix scores are as wide as the
    # longest): 100, 150, 200 | 600 | 260, 300.
    tokens = [100, 150, 200, 600, 260, 300]
    mixed = {d: plan(1, 10**9, n) for d, n in zip(docs, tokens, strict=True)}
    assert document_batches(docs, mixed, _settings(6)) == [[0, 1, 2], [3], [4, 5]]


@pytest.mark.parametrize("bad", [0, -1, "3", True])
def test_doc_batch_must_be_positive_or_auto(bad):
    with pytest.raises(ValueError, match="doc_batch must be >= 1 or 'auto'"):
        _settings(bad)


@pytest.mark.parametrize("doc_batch", [1, 3])
def test_keeping_everything_is_exactly_no_hazard_in_the_shared_layout(doc_batch):
    """``full`` in the shared layout, one document at a time and three in one pack (padded
    prompts): P and Q rows attend to the same prefix tensor with equal inputs, so every
    hazard is exactly 0 and no branch is drawn (float noise would draw spurious branches)."""
    from kvcouple.policies import parse_policy
    from kvcouple.tracer.batches import trace_documents_records

    m = model("llama")
    prompts = _prompts([20, 33, 27])
    settings = replace(_settings(doc_batch), cache_layout="shared")
    docs = [(list(p.input_ids), i, p.id, settings) for i, p in enumerate(prompts)]
    batches = [docs] if doc_batch == 3 else [[d] for d in docs]
    for batch in batches:
        for out in trace_documents_records(m, batch, [parse_policy("full")], seed=2):
            assert np.all(out.arrays["hazard"] == 0)
            assert np.all(out.arrays["branch_step"] == 0)


@pytest.mark.parametrize("path", ["matrix", "efficient"])
def test_every_cascade_attention_path_traces_the_same_records(path, monkeypatch):
    """Three documents in one pack and their branches (forks, where rows per document differ:
    a call per group), traced with cascade attention on the matrix path and on CUDA's
    memory-efficient kernel's adapter (over the kernel's CPU stand-in, which refuses what the
    kernel refuses): the records equal those of the CPU's flash kernel to float noise. Every
    form in which the tracer calls attention with its log-sum-exp goes through the path."""
    import functools

    import kvcouple.tracer.prefix as prefix
    from kvcouple.policies import parse_policy
    from kvcouple.testing.efficient_attention import efficient_attention
    from kvcouple.tracer.batches import trace_documents_records
    from kvcouple.tracer.lse_attention import attend_lse, efficient_lse

    m = model("llama")
    prompts = _prompts([20, 33, 27])
    settings = replace(_settings(3), cache_layout="shared")
    docs = [(list(p.input_ids), i, p.id, settings) for i, p in enumerate(prompts)]
    policies = [parse_policy(s) for s in SPECS[:2]]
    want = list(trace_documents_records(m, docs, policies, seed=2))
    calls = []
    forced = (
        functools.partial(attend_lse, fused=False)
        if path == "matrix"
        else functools.partial(efficient_lse, kernel=efficient_attention)
    )

    def counted(*args, **kwargs):
        calls.append(args[1].shape[0])
        return forced(*args, **kwargs)

    monkeypatch.setattr(prefix, "attend_lse", counted)
    got = list(trace_documents_records(m, docs, policies, seed=2))
    assert 3 in calls  # the packed call over three documents ran through the path
    assert len(got) == len(want) > 0
    for a, b in zip(want, got, strict=True):
        assert a.arrays.keys() == b.arrays.keys()
        assert (b.arrays["branch_step"] > 0).any()  # branches ran (forks took the path too)
        for name, x in a.arrays.items():
            y = b.arrays[name]
            if x.dtype.kind == "f":
                np.testing.assert_allclose(x, y, atol=2e-5, err_msg=f"{path}: {name}")
            else:
                np.testing.assert_array_equal(x, y, err_msg=f"{path}: {name}")


def test_forks_of_some_of_a_batchs_documents_are_packed_and_equal_one_at_a_time(
    tmp_path, monkeypatch
):
    """Branch batches smaller than a batch's branches fork a range of its documents: each such
    fork is one packed prefix call over that range of the pack (a view), and the store equals
    tracing one document at a time."""
    from kvcouple.tracer.layout import SharedRows

    m = model("llama")
    prompts = _prompts([20, 33, 27, 25])
    fork = SharedRows.fork
    widths = []

    def fork_spy(self, index, visible_before, steps=0):
        forked = fork(self, index, visible_before, steps)
        packed = forked.shared.packed
        widths.append(None if packed is None else int(packed[0][0].shape[0]))
        return forked

    monkeypatch.setattr(SharedRows, "fork", fork_spy)
    settings = replace(_settings(4), cache_layout="shared", branch_batch=3)
    trace(m, prompts, SPECS[:2], settings, tmp_path / "b3.zarr", progress=False)
    assert None not in widths  # every fork packed
    assert any(1 < w < 4 for w in widths)  # forks of some documents: a range of the pack
    one = replace(settings, doc_batch=1)
    trace(m, prompts, SPECS[:2], one, tmp_path / "b1.zarr", progress=False)
    _assert_same(xr.open_zarr(tmp_path / "b1.zarr"), xr.open_zarr(tmp_path / "b3.zarr"))
