"""A local Zarr v3 store is opened and read without zarr-python (``kvcouple.store.stored_array``:
its import is most of a small analysis's start-up): every array reads as zarr-python reads it
(the same values, shapes, chunk keys; an absent chunk or inner chunk as the fill value),
damage is refused naming the chunk, a layout the engine does not decode goes to zarr-python,
and opening and reading a store imports no zarr."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import warnings

import numpy as np
import pytest
import zarr

from kvcouple import _core
from kvcouple.store.geometry import StoreGeometry
from kvcouple.store.stored_array import ChunkDecodeError, LocalGroup, StoredArray
from kvcouple.synth.trace_store import write_synthetic_trace_store

pytestmark = pytest.mark.skipif(
    int(zarr.__version__.split(".")[0]) < 3, reason="stores are Zarr format 3 with zarr-python 3"
)

PAIRS = {
    "a": {"P": np.full((4, 4), 0.25), "Q": np.full((4, 4), 0.25) * 0.5 + 0.5 * np.eye(4)},
    "b": {"P": np.full((4, 4), 0.25), "Q": np.full((4, 4), 0.25) * 0.2 + 0.8 * np.eye(4)},
}
SELECTIONS = [
    (slice(None),),
    (0,),
    (-1,),
    (slice(1, 3),),
    (Ellipsis, 0),
    (slice(0, 2), 1),
    (np.int64(2), Ellipsis),
]


# Summary records of a few documents (a chunk per document and policy), of 40 (shards of two
# documents: an inner chunk per document and policy), and full records.
LAYOUTS = {"summary": ("summary", 7), "sharded": ("summary", 40), "full": ("full", 7)}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def store(request, tmp_path_factory):
    record, docs = LAYOUTS[request.param]
    path = tmp_path_factory.mktemp(request.param) / "run.zarr"
    write_synthetic_trace_store(
        path, PAIRS, horizon=5, branches=2, replicates=3, docs=docs, record=record, seed=3
    )
    assert (StoreGeometry(path).array("hazard").shards is not None) == (request.param == "sharded")
    return path


def same(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype == object or b.dtype.kind in "TU":
        return a.shape == b.shape and [str(x) for x in a.ravel()] == [str(x) for x in b.ravel()]
    return a.dtype == b.dtype and np.array_equal(a, b, equal_nan=a.dtype.kind == "f")


def test_every_array_reads_as_zarr_python_reads_it(store):
    geometry = StoreGeometry(store)
    assert isinstance(geometry.group, LocalGroup)
    group = zarr.open_group(str(store), mode="r")
    assert geometry.group.attrs == dict(group.attrs)
    names = sorted(group.array_keys())
    assert names
    for name in names:
        ours, theirs = geometry.array(name), group[name]
        assert isinstance(ours, StoredArray), name
        assert (ours.shape, ours.chunks, ours.shards) == (
            theirs.shape,
            theirs.chunks,
            theirs.shards,
        )
        cell = (0,) * ours.ndim
        key = ours.metadata.encode_chunk_key(cell)
        assert key == theirs.metadata.encode_chunk_key(cell)
        for sel in SELECTIONS:
            if len([s for s in sel if s is not Ellipsis]) > ours.ndim:
                continue
            try:
                want = theirs[sel]
            except IndexError:
                with pytest.raises(IndexError):
                    ours[sel]
                continue
            assert same(ours[sel], want), (name, sel)


def test_absent_chunks_and_inner_chunks_read_as_the_fill_value(store, tmp_path):
    copy = tmp_path / "copy.zarr"
    shutil.copytree(store, copy)
    geometry = StoreGeometry(copy)
    arr = geometry.array("hazard")
    key, inner = arr._object((1,) + (0,) * (arr.ndim - 1))
    if inner < 0:
        (copy / key).unlink()
    else:  # mark inner chunk `inner` absent in the shard's index (kept at the end)
        raw = bytearray((copy / key).read_bytes())
        count = int(np.prod([s // c for s, c in zip(arr.shards, arr.chunks, strict=True)]))
        start = len(raw) - (16 * count + 4) + 16 * inner
        raw[start : start + 16] = b"\xff" * 16
        index = bytes(raw[len(raw) - (16 * count + 4) : len(raw) - 4])
        raw[-4:] = _core.store_crc32c(index).to_bytes(4, "little")  # the index's own checksum
        (copy / key).write_bytes(bytes(raw))
    theirs = zarr.open_group(str(copy), mode="r")["hazard"][...]
    ours = StoreGeometry(copy).array("hazard")[...]
    assert same(ours, theirs)
    assert (ours[1, 0] == 0).all() and (ours[1, 1] != 0).any()  # the fill value, as zarr reads


def test_damage_is_refused_naming_the_chunk(store, tmp_path):
    copy = tmp_path / "copy.zarr"
    shutil.copytree(store, copy)
    raw = bytearray((copy / "doc_id" / "0").read_bytes())
    raw[5] ^= 0x10
    (copy / "doc_id" / "0").write_bytes(bytes(raw))
    with pytest.raises(ChunkDecodeError, match=r"chunk doc_id/0 fails its crc32c checksum"):
        StoreGeometry(copy).array("doc_id")[...]
    hazard = StoreGeometry(copy).array("hazard")
    key, _ = hazard._object((0,) * hazard.ndim)
    raw = bytearray((copy / key).read_bytes())
    raw[-2] ^= 0x01
    (copy / key).write_bytes(bytes(raw))
    with pytest.raises(ChunkDecodeError, match=rf"chunk {key}.*checksum"):
        StoreGeometry(copy).array("hazard")[...]


def test_a_layout_the_engine_does_not_decode_goes_to_zarr_python(tmp_path):
    path = tmp_path / "g.zarr"
    group = zarr.open_group(str(path), mode="w")
    data = np.arange(24, dtype=np.int32).reshape(4, 6)
    gz = group.create_array(
        "gz", shape=data.shape, dtype=data.dtype, chunks=(2, 3),
        compressors=[zarr.codecs.GzipCodec()],
    )  # fmt: skip
    gz[...] = data
    big = group.create_array(
        "big", shape=(5,), dtype=">f8", chunks=(2,), serializer=zarr.codecs.BytesCodec(endian="big")
    )
    big[...] = np.linspace(0, 1, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        zarr.consolidate_metadata(str(path))
    local = StoreGeometry(path).group
    arr = local["gz"]
    assert isinstance(arr, StoredArray)
    np.testing.assert_array_equal(arr[...], data)
    assert arr.unsupported  # the engine said so: zarr-python read it
    np.testing.assert_array_equal(arr[1:3, 2], data[1:3, 2])
    np.testing.assert_array_equal(np.asarray(local["big"][...]), np.linspace(0, 1, 5))
    meta = json.loads((path / "big" / "zarr.json").read_text())
    assert meta["codecs"][0]["configuration"]["endian"] == "big"


def test_opening_and_reading_a_local_store_imports_no_zarr(store):
    code = (
        "import sys\n"
        "from kvcouple.store.reader import TraceStoreReader\n"
        f"r = TraceStoreReader({str(store)!r})\n"
        "r.require_complete()\n"
        "from kvcouple.analysis.reading import SUMMARY_READ\n"
        "got = r.read_summaries(r.done, SUMMARY_READ)\n"
        "assert got is not None and len(got) == len(r.done)\n"
        "print(sorted(m for m in sys.modules if m == 'zarr' or m.startswith('zarr.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_engine_forced_off_reads_with_zarr_python(store, monkeypatch):
    monkeypatch.setenv("KVCOUPLE_STORE_ENGINE", "zarr")
    geometry = StoreGeometry(store)
    assert not isinstance(geometry.group, LocalGroup)
    assert not isinstance(geometry.array("hazard"), StoredArray)


def test_metadata_it_does_not_take_as_given_goes_to_zarr_python(store, tmp_path):
    # A chunk shape of 0 and a fill value given as a bit pattern are not read here (no division
    # by zero, no fill value taken for a number): the array is zarr-python's.
    copy = tmp_path / "copy.zarr"
    shutil.copytree(store, copy)
    meta = json.loads((copy / "step" / "zarr.json").read_text())
    meta["fill_value"] = "0x00000000"
    (copy / "step" / "zarr.json").write_text(json.dumps(meta))
    meta = json.loads((copy / "lag" / "zarr.json").read_text())
    meta["chunk_grid"]["configuration"]["chunk_shape"] = [0]
    (copy / "lag" / "zarr.json").write_text(json.dumps(meta))
    group = StoreGeometry(copy).group
    assert not isinstance(group["step"], StoredArray)
    assert not isinstance(group["lag"], StoredArray)
    assert isinstance(group["rep"], StoredArray)  # the others as before


def _vlen(*strings: bytes, count: int | None = None) -> bytes:
    n = len(strings) if count is None else count
    body = b"".join(len(s).to_bytes(4, "little") + s for s in strings)
    return n.to_bytes(4, "little") + body


def test_a_vlen_utf8_chunk_is_parsed_by_the_engine_as_zarr_writes_it():
    assert _core.store_vlen_utf8(_vlen(b"doc0", "é".encode(), b"")) == ["doc0", "é", ""]
    assert _core.store_vlen_utf8(_vlen()) == []


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (b"", "no count"),
        (b"\x01\x00", "no count"),
        (_vlen(b"ab") + b"x", "bytes left over"),
        (_vlen(b"ab")[:-1], "runs past the chunk's end"),
        (_vlen(b"\xff"), "not UTF-8"),
        (_vlen(count=10**9), "a count of 1000000000 strings"),
        (_vlen(b"ab", count=2), "runs past the chunk's end"),
    ],
)
def test_a_damaged_vlen_utf8_chunk_is_refused_naming_what_is_wrong(raw: bytes, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        _core.store_vlen_utf8(raw)
