"""Documents analysed in batches (``tasks.analyze_docs``: one engine call for a batch's
summaries, one for its distributions) give exactly what one task per document gives, damage
included: the damaged document is named and skipped, the others are unchanged."""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import asdict

import numpy as np
import pytest
import zarr

from kvcouple import _core
from kvcouple.analysis import analyze, tasks
from kvcouple.analysis.tasks import Options, analyze_doc, analyze_docs
from kvcouple.store.reader import TraceStoreReader
from kvcouple.synth.trace_store import write_synthetic_trace_store

_rng = np.random.default_rng(4)
_P = _rng.dirichlet(np.ones(6), size=6)
PAIRS = {
    "a": {"P": _P, "Q": 0.6 * _P + 0.4 * _rng.dirichlet(np.ones(6), size=6), "start": 0},
    "b": {"P": _P, "Q": 0.2 * _P + 0.8 * _rng.dirichlet(np.ones(6), size=6), "start": 2},
}
DOCS = 6


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("batches") / "run.zarr"
    return write_synthetic_trace_store(
        path, PAIRS, horizon=7, branches=2, replicates=6, docs=DOCS, record="full", seed=3
    )


@pytest.fixture
def copy(store, tmp_path):
    dst = tmp_path / "copy.zarr"
    shutil.copytree(store, dst)
    return dst


@pytest.fixture(autouse=True)
def engine_on(monkeypatch):
    monkeypatch.setenv("KVCOUPLE_STORE_ENGINE", "auto")


def _as_plain(r: tasks.DocResult) -> dict:
    units = None if r.units is None else {k: asdict(u) for k, u in r.units.items()}
    check = None if r.check is None else asdict(r.check)
    return {"doc": r.doc, "doc_id": r.doc_id, "units": units, "check": check, "error": r.error}


def _assert_same(a: list[tasks.DocResult], b: list[tasks.DocResult]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        px, py = _as_plain(x), _as_plain(y)
        assert px.keys() == py.keys()
        np.testing.assert_equal(px, py)  # arrays inside compared exactly, NaN equal to NaN


def _counting(monkeypatch, name: str) -> list[int]:
    """Calls of ``_core.<name>``, by how many documents' worth each was given (keys/blocks)."""
    calls: list[int] = []
    real = getattr(_core, name)

    def counted(*args, **kw):
        calls.append(len(args[2]) if name == "store_decode_chunks" else len(args[3]))
        return real(*args, **kw)

    monkeypatch.setattr(_core, name, counted)
    return calls


def test_a_batch_equals_one_task_per_document(store, monkeypatch):
    reader = TraceStoreReader(store)
    options = Options()
    docs = list(range(DOCS))
    one_by_one = [analyze_doc(reader, d, options) for d in docs]
    assert all(r.error is None and r.check is not None for r in one_by_one)
    assert all(r.check.rows_checked > 0 for r in one_by_one)
    fresh = TraceStoreReader(store)  # opening it decodes the completion flags
    decodes = _counting(monkeypatch, "store_decode_chunks")
    tvs = _counting(monkeypatch, "store_blocks_tv")
    batch = analyze_docs(fresh, docs, options)
    _assert_same(batch, one_by_one)
    # The batch took the batched path: one read of the summaries with the scoreboard's
    # top1_agree and one call per pair of variables (path, branches)
    # for every document, not one per document.
    assert len(decodes) == 1 and len(tvs) == 2, (decodes, tvs)
    assert tvs == [DOCS * len(PAIRS)] * 2


def test_analyze_in_batches_equals_analyze_document_by_document(store, monkeypatch):
    batched = analyze(store, n_boot=50, seed=2)
    monkeypatch.setattr(tasks, "LOCAL_BATCH", 1)
    monkeypatch.setattr(tasks, "SUMMARY_BATCH", 1)
    single = analyze(store, n_boot=50, seed=2)
    (b,), (s,) = batched.models, single.models
    _assert_same(b.docs, s.docs)
    assert b.tables and b.tables.keys() == s.tables.keys()
    np.testing.assert_equal(b.tables, s.tables)
    assert batched.checks() == single.checks()


@pytest.mark.parametrize(
    ("name", "index", "value", "message"),
    [
        ("hazard", (3, 1, 0, 2), np.nan, "document 'doc0003'"),  # refused by the estimate
        ("kl_pq", (3, 0, 0, 1), -1.0, "variable 'kl_pq' (document 'doc0003')"),  # value check
        ("p", (3, 0, 1, 2, 0), -0.5, "variable 'p' (document 'doc0003')"),  # a distribution
    ],
)
def test_damage_in_a_batch_names_its_document_and_keeps_the_others(
    copy, name, index, value, message
):
    g = zarr.open_group(str(copy), mode="r+")
    arr = g[name]
    index = index[: arr.ndim]
    block = arr[index[0]]
    block[index[1:]] = value
    arr[index[0]] = block
    reader = TraceStoreReader(copy)
    options = Options()
    docs = list(range(DOCS))
    batch = analyze_docs(reader, docs, options)
    one_by_one = [analyze_doc(TraceStoreReader(copy), d, options) for d in docs]
    _assert_same(batch, one_by_one)
    errors = {r.doc: r.error for r in batch if r.error}
    assert list(errors) == [3], errors
    assert message in errors[3] and name in errors[3], errors[3]
    result = analyze(copy, n_boot=20, allow_incomplete=True)
    assert [d.doc_id for d in result.models[0].docs] == [f"doc{d:04d}" for d in docs if d != 3]


def test_batches_keep_task_order_and_their_store(store):
    a, b = TraceStoreReader(store), TraceStoreReader(store)
    tasks_ = [(a, 0), (a, 1), (a, 2), (b, 0), (a, 3)]
    got = tasks._batches(tasks_, 2)
    assert [(info is a, docs) for info, docs in got] == [
        (True, [0, 1]),
        (True, [2]),
        (False, [0]),
        (True, [3]),
    ]
    assert [(i, d) for info, docs in got for d in docs for i in [info]] == tasks_


def test_a_summary_batch_scoreboard_is_the_documents_scoreboard(tmp_path):
    """Summary records: the analysis folds a batch's scoreboard steps straight from the
    engine's stacks (ScoreBatch); its scoreboard equals the one pooled from every document's
    own doc_scores."""
    from kvcouple.analysis.scoreboard import BatchScores, scoreboard_rows

    path = write_synthetic_trace_store(
        tmp_path / "s.zarr", PAIRS, horizon=7, branches=2, replicates=6, docs=DOCS, seed=3
    )
    reader = TraceStoreReader(path)
    options = Options(window=reader.window)
    batched = analyze_docs(reader, list(range(DOCS)), options)
    assert all(isinstance(r.scores, BatchScores) for r in batched)
    alone = [analyze_doc(reader, d, options) for d in range(DOCS)]
    assert not any(isinstance(r.scores, BatchScores) for r in alone)
    want = scoreboard_rows("m", reader.policies, alone)
    assert scoreboard_rows("m", reader.policies, batched) == want
    result = analyze(path, n_boot=50)
    assert result.models[0].scoreboard == scoreboard_rows(
        result.models[0].model, reader.policies, alone
    )


@pytest.mark.parametrize("progress", [False, True])
def test_a_progress_bar_only_when_asked(store, progress):
    """``progress=False`` (``kvcouple analyze --quiet``) shows no bar and does not import tqdm
    (20 ms of the command's start); ``progress=True`` shows one on stderr."""
    code = (
        "import sys\n"
        "from kvcouple.analysis import analyze\n"
        f"analyze({str(store)!r}, n_boot=20, progress={progress})\n"
        "print('tqdm' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(progress)
    assert ("kvcouple analyze" in out.stderr) == progress
