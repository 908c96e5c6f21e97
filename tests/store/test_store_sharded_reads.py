"""Summary variables stored in Zarr v3 shards of several documents (an inner chunk per document
and policy, as zarr-python 3 writes ``shards=(S, P, ...)``, ``chunks=(1, 1, ...)``) are read
by the Rust engine (``_core.store_decode_chunks`` with inner chunk indices), not by the
zarr-python fallback: the same values, and damage inside a shard named by the shard, the inner
chunk and the document."""

from __future__ import annotations

import json
import re
import shutil
import struct
import warnings

import numpy as np
import pytest
import zarr

from kvcouple import _core
from kvcouple.analysis import analyze
from kvcouple.errors import InvalidInputError, ShapeError, StoreError
from kvcouple.store.reader import TraceStoreReader
from kvcouple.store.schema import SUMMARY_VARIABLES
from kvcouple.synth.trace_store import write_synthetic_trace_store

pytestmark = pytest.mark.skipif(
    int(zarr.__version__.split(".")[0]) < 3, reason="shards are written with zarr-python 3"
)

_rng = np.random.default_rng(4)
_P = _rng.dirichlet(np.ones(5), size=5)
PAIRS = {
    "a": {"P": _P, "Q": 0.6 * _P + 0.4 * _rng.dirichlet(np.ones(5), size=5), "start": 0},
    "b": {"P": _P, "Q": 0.3 * _P + 0.7 * _rng.dirichlet(np.ones(5), size=5), "start": 1},
}
DOCS = 12
PER_SHARD = 5  # three shards: 5, 5 and the last holding 2 documents of 5
POLICIES = 2


def shard_in_place(path, name):
    """``name`` re-written by zarr-python 3 in shards of PER_SHARD documents (every policy), an
    inner chunk per document and policy: the layout of summary stores of many documents."""
    group = zarr.open_group(str(path), mode="r+")
    old = group[name]
    data, attrs, dims = old[...], dict(old.attrs), old.metadata.dimension_names
    rest = data.shape[1:]
    inner_rest = (1,) + rest[1:] if dims[1:2] == ("policy",) else rest
    new = group.create_array(
        name,
        shape=data.shape,
        dtype=data.dtype,
        shards=(PER_SHARD, *rest),
        chunks=(1, *inner_rest),
        compressors=[zarr.codecs.ZstdCodec(level=1), zarr.codecs.Crc32cCodec()],
        chunk_key_encoding={"name": "v2", "separator": "."},
        fill_value=old.fill_value,
        dimension_names=dims,
        config={"write_empty_chunks": True},
        overwrite=True,
    )
    new[...] = data
    new.attrs.update(attrs)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("sharded") / "run.zarr"
    write_synthetic_trace_store(
        path, PAIRS, horizon=6, branches=2, replicates=4, docs=DOCS, record="summary", seed=5
    )
    group = zarr.open_group(str(path), mode="r")
    names = [n for n in SUMMARY_VARIABLES if n in group and n != "completed"]
    for name in names:
        shard_in_place(path, name)
    with warnings.catch_warnings():  # consolidated metadata is not in the v3 spec
        warnings.simplefilter("ignore")
        zarr.consolidate_metadata(str(path))
    meta = json.loads((path / "hazard" / "zarr.json").read_text())
    assert meta["codecs"][0]["name"] == "sharding_indexed"
    assert meta["codecs"][0]["configuration"]["chunk_shape"][:2] == [1, 1]
    return path


@pytest.fixture
def copy(store, tmp_path):
    dst = tmp_path / "copy.zarr"
    shutil.copytree(store, dst)
    return dst


@pytest.fixture(autouse=True)
def engine_on(monkeypatch):
    monkeypatch.setenv("KVCOUPLE_STORE_ENGINE", "auto")


def summary_names(reader):
    return tuple(n for n in SUMMARY_VARIABLES if n in reader.group and n != "completed")


def no_fallback(reader, monkeypatch):
    """Make zarr-python's summary read fail, and count the engine's sharded calls."""

    def fallback(*_):
        raise AssertionError("the engine did not read these variables")

    monkeypatch.setattr(reader.engine_reads, "_read_concurrently", fallback)
    calls = []
    decode = _core.store_decode_chunks

    def counted(*args, **kw):
        calls.append(kw.get("inner"))
        return decode(*args, **kw)

    monkeypatch.setattr(_core, "store_decode_chunks", counted)
    return calls


def test_the_engine_reads_sharded_summaries_as_zarr_python_does(store, monkeypatch):
    reader = TraceStoreReader(store)
    names = summary_names(reader)
    assert {"hazard", "tokens", "branch_tv", "kept_length", "prompt_length"} <= set(names)
    assert reader.engine_reads.geometry.storage_grid("hazard")[:2] == (PER_SHARD, POLICIES)
    calls = no_fallback(reader, monkeypatch)
    group = zarr.open_group(str(store), mode="r")
    expected = {n: group[n][...] for n in names}
    for doc in range(DOCS):
        blocks = reader.read_summary(doc, names)
        for n in names:
            assert blocks[n].dtype == expected[n].dtype, n
            np.testing.assert_array_equal(blocks[n], expected[n][doc], err_msg=f"{n}[{doc}]")
    # Every document of every shard in one call (the last shard is partly outside the array).
    together = reader.read_summaries(list(range(DOCS))[::-1], names)
    assert together is not None
    for doc, blocks in zip(range(DOCS)[::-1], together, strict=True):
        for n in names:
            np.testing.assert_array_equal(blocks[n], expected[n][doc], err_msg=f"{n}[{doc}]")
    assert not reader.engine_reads.no_direct
    # The engine was asked for inner chunks (sharded), not zarr-python.
    assert len(calls) == DOCS + 1 and all(c is not None and max(c) > 0 for c in calls)


def shard_index(path):
    """A shard file's index (offset, nbytes per inner chunk) and where the index starts."""
    raw = path.read_bytes()
    n = int(np.prod([PER_SHARD, POLICIES]))
    start = len(raw) - 16 * n - 4
    entries = struct.unpack(f"<{2 * n}Q", raw[start : start + 16 * n])
    return list(zip(entries[0::2], entries[1::2], strict=True)), start


def test_a_damaged_inner_chunk_is_refused_naming_its_document(copy, monkeypatch):
    # Document 6 is the second of shard 1; policy 1: inner chunk (6 - 5) * 2 + 1 = 3.
    path = copy / "hazard" / "1.0.0.0"
    entries, _ = shard_index(path)
    offset, nbytes = entries[3]
    data = bytearray(path.read_bytes())
    data[offset + nbytes // 2] ^= 0x10
    path.write_bytes(bytes(data))

    reader = TraceStoreReader(copy)
    names = summary_names(reader)
    with pytest.raises(
        StoreError,
        match=r"chunk hazard/1\.0\.0\.0 of variable 'hazard' \(document 'doc0006'\) cannot "
        r"be decoded: it fails its checksum",
    ):
        reader.read_summary(6, names)
    # The engine named it (the inner chunk too) before zarr-python's read did.
    problem = direct_problem(reader, names, 6)
    assert problem[:2] == ("checksum", "hazard/1.0.0.0")
    assert problem[2].startswith("inner chunk 3:"), problem
    # The shard's other documents are intact and still read by the engine.
    no_fallback(reader, monkeypatch)
    group = zarr.open_group(str(copy), mode="r")
    for doc in (5, 7, 8, 9):
        np.testing.assert_array_equal(
            reader.read_summary(doc, names)["hazard"], group["hazard"][doc]
        )
    assert reader.read_summaries([5, 6, 7], names) is None  # the caller goes document by document
    result = analyze(copy, n_boot=20, allow_incomplete=True)
    assert [s["doc_id"] for s in result.skipped] == ["doc0006"]
    assert "it fails its checksum" in result.skipped[0]["reason"]


def direct_problem(reader, names, doc):
    got, supported, problem = reader.engine_reads._read_direct(names, [doc])
    assert got is None and supported
    return problem


def rewrite_index(path, change):
    """Apply ``change`` to a shard file's index entries, its checksum made valid again."""
    import google_crc32c  # zarr-python 3's crc32c

    entries, start = shard_index(path)
    entries = change(entries)
    index = struct.pack(f"<{2 * len(entries)}Q", *(v for e in entries for v in e))
    raw = path.read_bytes()[:start] + index + struct.pack("<I", google_crc32c.value(index))
    path.write_bytes(raw)


@pytest.mark.parametrize(
    "entry, says",
    [
        (
            (2**64 - 1, 2**64 - 1),
            r"kl_pq/1\.0\.0\.0 \(inner chunk 3\) of variable 'kl_pq' "
            r"\(document 'doc0006'\) is missing",
        ),
        (
            (10**12, 90),
            r"kl_pq/1\.0\.0\.0 \(inner chunk 3\) of variable 'kl_pq' \(document 'doc0006'\) "
            r"cannot be decoded: the shard's index points outside the shard",
        ),
    ],
    ids=["absent", "outside-the-shard"],
)
def test_an_inner_chunk_zarr_python_reads_as_fill_is_refused_naming_its_document(copy, entry, says):
    # zarr-python reads both as the fill value, without a word: only the engine sees them.
    path = copy / "kl_pq" / "1.0.0.0"
    rewrite_index(path, lambda e: e[:3] + [entry] + e[4:])
    assert np.all(zarr.open_group(str(copy), mode="r")["kl_pq"][6, 1] == 0)

    reader = TraceStoreReader(copy)
    names = summary_names(reader)
    with pytest.raises(StoreError, match=says):
        reader.read_summary(6, names)
    assert reader.read_summaries(list(range(DOCS)), names) is None
    result = analyze(copy, n_boot=20, allow_incomplete=True)
    assert [s["doc_id"] for s in result.skipped] == ["doc0006"]
    assert re.search(says, result.skipped[0]["reason"])
    # The zarr-python path (info --check, KVCOUPLE_STORE_ENGINE=zarr) reads the shard's index
    # itself: the same document named, not a fill value taken for data.
    for where in (
        reader.validation.check(list(range(DOCS)), data=True),
        [str(e) for e in [_zarr_read_error(copy, names)] if e is not None],
    ):
        assert any("kl_pq/1.0.0.0 (inner chunk 3" in p and "'doc0006'" in p for p in where), where


def _zarr_read_error(store, names):
    """The error of reading document 6 through zarr-python (the engine switched off)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVCOUPLE_STORE_ENGINE", "zarr")
        try:
            TraceStoreReader(store).read_summary(6, names)
        except StoreError as e:
            return e
    return None


def test_a_damaged_shard_index_is_refused(copy):
    path = copy / "tokens" / "2.0.0.0"
    data = bytearray(path.read_bytes())
    data[-10] ^= 0x01  # inside the index: its crc32c no longer matches
    path.write_bytes(bytes(data))
    reader = TraceStoreReader(copy)
    names = summary_names(reader)
    problem = direct_problem(reader, names, 10)
    assert problem[:2] == ("checksum", "tokens/2.0.0.0") and "shard index" in problem[2]
    with pytest.raises(
        StoreError,
        match=r"chunk tokens/2\.0\.0\.0 of variable 'tokens' "
        r"\(document 'doc0010'\) cannot be decoded",
    ):
        reader.read_summary(10, names)


def test_inner_indices_are_checked(store):
    meta = (store / "hazard" / "zarr.json").read_text()
    with pytest.raises(ShapeError, match="one index per key"):
        _core.store_decode_chunks([meta], [0], ["hazard/0.0.0.0"], root=str(store), inner=[])
    with pytest.raises(InvalidInputError, match="-2"):
        _core.store_decode_chunks([meta], [0], ["hazard/0.0.0.0"], root=str(store), inner=[-2])
    # A sharded array's chunk without its inner index (or past the shard) is not read here.
    for inner in ([-1], [PER_SHARD * POLICIES]):
        decoded, problem = _core.store_decode_chunks(
            [meta], [0], ["hazard/0.0.0.0"], root=str(store), inner=inner
        )
        assert decoded == [] and problem is not None and problem[0] == "unsupported"
    decoded, problem = _core.store_decode_chunks(
        [meta], [0, 0], ["hazard/0.0.0.0", "hazard/2.0.0.0"], root=str(store), inner=[3, 1]
    )
    assert problem is None
    group = zarr.open_group(str(store), mode="r")
    np.testing.assert_array_equal(
        np.frombuffer(decoded[0], "<f4").reshape(-1), group["hazard"][1, 1].reshape(-1)
    )
    np.testing.assert_array_equal(
        np.frombuffer(decoded[1], "<f4").reshape(-1), group["hazard"][10, 1].reshape(-1)
    )


def test_grouped_chunks_come_back_joined_in_runs(store):
    """``group=n``: every n consecutive chunks' bytes as one object (a cell of a batch of
    documents), ``runs``: the next ``runs[r]`` chunks' as object r (a variable's stack); the
    same bytes as joining them. A group that does not divide the keys, runs that do not add up
    to them, or both given, are refused."""
    meta = (store / "hazard" / "zarr.json").read_text()
    keys = ["hazard/0.0.0.0", "hazard/2.0.0.0", "hazard/0.0.0.0", "hazard/1.0.0.0"]
    args = ([meta], [0] * 4, keys)
    kw = {"root": str(store), "inner": [3, 1, 0, 2]}
    single, problem = _core.store_decode_chunks(*args, **kw)
    assert problem is None and len(single) == 4
    for n in (1, 2, 4):
        joined, problem = _core.store_decode_chunks(*args, **kw, group=n)
        assert problem is None
        assert [bytes(b) for b in joined] == [
            b"".join(bytes(b) for b in single[i : i + n]) for i in range(0, 4, n)
        ]
    for bad in (0, 3):
        with pytest.raises(ShapeError, match="group must divide"):
            _core.store_decode_chunks(*args, **kw, group=bad)
    for runs in ([4], [1, 3], [0, 2, 2], [1, 1, 1, 1]):
        joined, problem = _core.store_decode_chunks(*args, **kw, runs=runs)
        assert problem is None
        ends = np.cumsum([0, *runs])
        assert [bytes(b) for b in joined] == [
            b"".join(bytes(b) for b in single[a:b]) for a, b in zip(ends[:-1], ends[1:])
        ]
    for bad in ([], [3], [2, 3]):
        with pytest.raises(ShapeError, match="runs must add up"):
            _core.store_decode_chunks(*args, **kw, runs=bad)
    with pytest.raises(InvalidInputError, match="not both"):
        _core.store_decode_chunks(*args, **kw, group=2, runs=[2, 2])


def test_shards_on_object_storage_are_left_to_zarr_python(store, monkeypatch):
    # A shard holds many documents: fetched whole for one, it would cost more than
    # zarr-python's ranged reads of that document's inner chunks.
    reader = TraceStoreReader(store)
    engine = reader.engine_reads
    engine.path = "s3://bucket/run.zarr"  # as the reader of a store on S3 sees it
    monkeypatch.setattr(engine.object_storage, "object_fetcher", lambda: object())
    assert engine._read_direct(summary_names(reader), [3]) == (None, False, None)
    assert engine.no_direct
