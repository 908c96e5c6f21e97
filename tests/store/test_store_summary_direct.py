"""Summary variables read and decoded by the Rust engine (``_core.store_decode_chunks``) give
exactly zarr-python's values; a variable the engine cannot read so (another codec, several
documents per chunk) falls back to zarr-python with the same analysis."""

from __future__ import annotations

import shutil
import warnings

import numpy as np
import pytest
import zarr

from kvcouple.analysis import analyze
from kvcouple.store.reader import TraceStoreReader
from kvcouple.store.schema import SUMMARY_VARIABLES
from kvcouple.synth.trace_store import write_synthetic_trace_store

ZARR3 = int(zarr.__version__.split(".")[0]) >= 3

_rng = np.random.default_rng(2)
_P = _rng.dirichlet(np.ones(5), size=5)
PAIRS = {
    "a": {"P": _P, "Q": 0.6 * _P + 0.4 * _rng.dirichlet(np.ones(5), size=5), "start": 0},
    "b": {"P": _P, "Q": 0.3 * _P + 0.7 * _rng.dirichlet(np.ones(5), size=5), "start": 1},
}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("direct") / "run.zarr"
    return write_synthetic_trace_store(
        path, PAIRS, horizon=6, branches=2, replicates=5, docs=4, record="summary", seed=9
    )


@pytest.fixture(autouse=True)
def engine_on(monkeypatch):
    monkeypatch.setenv("KVCOUPLE_STORE_ENGINE", "auto")


def test_the_engine_reads_every_summary_variable_as_zarr_python_does(store, monkeypatch):
    reader = TraceStoreReader(store)
    names = tuple(n for n in SUMMARY_VARIABLES if n in reader.group)
    assert {"hazard", "tokens", "branch_tv", "kept_length", "eviction_applied"} <= set(names)

    def no_fallback(*_):
        raise AssertionError("the engine did not read these variables")

    monkeypatch.setattr(reader.engine_reads, "_read_concurrently", no_fallback)
    group = zarr.open_group(str(store), mode="r")
    for doc in range(reader.group["doc_id"].shape[0]):
        blocks = reader.read_summary(doc, names)
        for n in names:
            expected = group[n][doc]
            assert blocks[n].dtype == expected.dtype, n
            np.testing.assert_array_equal(blocks[n], expected, err_msg=f"{n}[{doc}]")
            assert blocks[n].flags.writeable  # a copy the caller may keep
    assert not reader.engine_reads.no_direct


def rewrite(path, name, *, chunks_of_docs=1, codec="zstd", chunks=None):
    """``name`` re-written by zarr-python with another codec, several documents per chunk or
    other ``chunks``, its attributes and dimension names kept."""
    group = zarr.open_group(str(path), mode="r+")
    old = group[name]
    data, attrs, dims = old[...], dict(old.attrs), old.metadata.dimension_names
    compressors = [
        zarr.codecs.GzipCodec() if codec == "gzip" else zarr.codecs.ZstdCodec(),
        zarr.codecs.Crc32cCodec(),
    ]
    new = group.create_array(
        name,
        shape=data.shape,
        dtype=data.dtype,
        chunks=chunks or (chunks_of_docs,) + data.shape[1:],
        compressors=compressors,
        fill_value=old.fill_value,
        dimension_names=dims,
        overwrite=True,
    )
    new[...] = data
    new.attrs.update(attrs)
    with warnings.catch_warnings():  # consolidated metadata is not in the v3 spec
        warnings.simplefilter("ignore")
        zarr.consolidate_metadata(str(path))


@pytest.mark.skipif(not ZARR3, reason="rewrites arrays with zarr-python 3's API")
@pytest.mark.parametrize(
    "name, change",
    [("hazard", {"codec": "gzip"}), ("tokens", {"chunks_of_docs": 2})],
    ids=["gzip", "two-docs-per-chunk"],
)
def test_a_layout_the_engine_does_not_read_falls_back_to_the_same_analysis(
    store, tmp_path, name, change
):
    copy = tmp_path / "copy.zarr"
    shutil.copytree(store, copy)
    rewrite(copy, name, **change)
    reader = TraceStoreReader(copy)
    group = zarr.open_group(str(store), mode="r")
    blocks = reader.read_summary(1, (name, "kl_pq"))
    assert reader.engine_reads.no_direct  # it fell back, and stays so for this reader
    np.testing.assert_array_equal(blocks[name], group[name][1])
    np.testing.assert_array_equal(blocks["kl_pq"], group["kl_pq"][1])

    before, after = per_doc(store), per_doc(copy)
    assert before.keys() == after.keys() and len(before) == 4 * len(PAIRS)
    for key, values in before.items():
        assert after[key] == values, key  # exactly: the same stored numbers


@pytest.mark.skipif(not ZARR3, reason="rewrites arrays with zarr-python 3's API")
@pytest.mark.parametrize(
    "chunks",
    [(1, 1, 2, 4), (1, 2, 2, 6), (1, 1, 5, 6)],
    ids=["padded-cells", "replicates-split", "a-cell-per-policy"],
)
def test_a_batch_reads_any_one_document_chunking_as_zarr_python_does(
    store, tmp_path, monkeypatch, chunks
):
    """A batch's stacks, whatever cells a document's chunk is cut into: padded edge cells and
    cells splitting a later axis are placed cell by cell; cells splitting only the policy axis
    are asked document after document and their run taken as the stack."""
    copy = tmp_path / "copy.zarr"
    shutil.copytree(store, copy)
    rewrite(copy, "hazard", chunks=chunks)
    reader = TraceStoreReader(copy)

    def no_fallback(*_):
        raise AssertionError("the engine did not read these variables")

    monkeypatch.setattr(reader.engine_reads, "_read_concurrently", no_fallback)
    names = ("hazard", "branch_tv", "kept_length", "tokens")
    docs = [3, 0, 2]
    got = reader.read_summaries(docs, names)
    assert got is not None and not reader.engine_reads.no_direct
    group = zarr.open_group(str(store), mode="r")
    for k, doc in enumerate(docs):
        for n in names:
            np.testing.assert_array_equal(got[k][n], group[n][doc], err_msg=f"{n}[{doc}]")


def per_doc(path):
    result = analyze(path, n_boot=50)
    return {
        (d.doc_id, pol): dict(u.values) for d in result.models[0].docs for pol, u in d.units.items()
    }
