"""A store re-written by plain xarray (any chunking, Zarr v2 or v3, sharded) is the same store:
the analysis must give the same per-document results, to 1e-12, as on the original."""

from __future__ import annotations

import numpy as np
import pytest
import xarray as xr
import zarr

pytest.importorskip("dask", reason="xarray re-chunks through dask")

from kvcouple.analysis import analyze
from kvcouple.store.reader import TraceStoreReader
from kvcouple.synth.trace_store import write_synthetic_trace_store

ZARR3 = int(zarr.__version__.split(".")[0]) >= 3

_rng = np.random.default_rng(5)
_P = _rng.dirichlet(np.ones(6), size=6)
PAIRS = {
    "a": {"P": _P, "Q": 0.7 * _P + 0.3 * _rng.dirichlet(np.ones(6), size=6), "start": 0},
    "b": {"P": _P, "Q": 0.4 * _P + 0.6 * _rng.dirichlet(np.ones(6), size=6), "start": 0},
}
DOCS = 5


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    path = tmp_path_factory.mktemp("orig") / "run.zarr"
    write_synthetic_trace_store(
        path,
        PAIRS,
        horizon=6,
        branches=2,
        replicates=12,
        docs=list(range(DOCS)),
        record="full",
        seed=11,
    )
    return path


def rewrite(src, dst, chunks, *, zarr_format=None, shards=None):
    """What a user does: open with xarray, re-chunk, write a new store."""
    ds = xr.open_zarr(str(src))
    encoding = {}
    if shards:
        # One shard per (document, policy) (the dask chunks), ``chunks`` inside each shard.
        ds = ds.chunk({d: (1 if d in ("doc", "policy") else -1) for d in ds.dims})
    else:
        ds = ds.chunk(chunks)
    for name, v in ds.variables.items():
        v.encoding = {}
        if shards and v.dims[:2] == ("doc", "policy"):
            encoding[name] = {
                "shards": (1, 1) + v.shape[2:],
                "chunks": (1, 1)
                + tuple(min(chunks.get(d, n), n) for d, n in zip(v.dims[2:], v.shape[2:])),
            }
    kw = {} if zarr_format is None else {"zarr_format": zarr_format}
    ds.to_zarr(str(dst), mode="w", encoding=encoding, consolidated=True, **kw)
    return dst


def per_doc(path):
    result = analyze(path, n_boot=20)
    out = {}
    for d in result.models[0].docs:
        for pol, u in d.units.items():
            out[(d.doc_id, pol)] = (
                dict(u.values),
                u.survival.copy(),
                u.tv_lag_num.copy(),
                (d.check.rows_checked, d.check.max_abs_diff),
            )
    return out


def assert_same(a, b):
    assert a.keys() == b.keys()
    for key in a:
        va, sa, ta, ca = a[key]
        vb, sb, tb, cb = b[key]
        for name in va:
            np.testing.assert_allclose(
                vb[name], va[name], rtol=0, atol=1e-12, err_msg=f"{key} {name}"
            )
        np.testing.assert_allclose(sb, sa, rtol=0, atol=1e-12)
        np.testing.assert_allclose(tb, ta, rtol=0, atol=1e-12)
        assert cb[0] == ca[0], key
        assert cb[1] == pytest.approx(ca[1], abs=1e-12)


@pytest.fixture(scope="module")
def expected(original):
    exp = per_doc(original)
    # The documents really differ (element 0 of a chunk read for every document would not).
    occ = {k[0]: v[0]["occurrence"] for k, v in exp.items() if k[1] == "a"}
    assert len(set(np.round(list(occ.values()), 12))) == DOCS
    return exp


LAYOUTS = {
    "doc1_v2": dict(chunks={"doc": 1}, zarr_format=2),
    "doc3_v2": dict(chunks={"doc": 3}, zarr_format=2),
    "docall_v2": dict(chunks={"doc": DOCS}, zarr_format=2),
    "steps_v2": dict(chunks={"doc": 2, "step": 4, "rep": 5, "lag": 2, "vocab": 4}, zarr_format=2),
    "doc3_v3": dict(chunks={"doc": 3, "step": 4}, zarr_format=3),
    "sharded_v3": dict(
        chunks={"rep": 4, "step": 3, "lag": 3, "vocab": 3}, zarr_format=3, shards=True
    ),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_rechunked_store_gives_identical_results(original, expected, tmp_path, layout):
    spec = LAYOUTS[layout]
    if spec.get("zarr_format") == 3 and not ZARR3:
        pytest.skip("Zarr v3 stores need zarr-python 3")
    dst = rewrite(
        original,
        tmp_path / f"{layout}.zarr",
        spec["chunks"],
        zarr_format=spec.get("zarr_format"),
        shards=spec.get("shards"),
    )
    reader = TraceStoreReader(dst)
    if spec.get("shards"):
        assert reader.storage_grid("p")[:2] == (1, 1) and reader.decode_grid("p")[-1] == 3
    assert_same(expected, per_doc(dst))


def test_missing_chunk_in_a_rechunked_store_names_every_document_it_holds(original, tmp_path):
    dst = rewrite(original, tmp_path / "d3.zarr", {"doc": 3}, zarr_format=2)
    (dst / "hazard" / "1.0.0.0").unlink()  # documents 3 and 4
    result = analyze(dst, n_boot=20, allow_incomplete=True)
    assert [d.doc_id for d in result.models[0].docs] == ["doc0000", "doc0001", "doc0002"]
    assert {s["doc_id"] for s in result.skipped} == {"doc0003", "doc0004"}
    assert all("hazard/1.0.0.0" in s["reason"] for s in result.skipped)


def test_rust_engine_and_zarr_python_agree(original, expected, tmp_path, monkeypatch):
    """The fused Rust pass and the zarr-python fallback give the same per-document results."""
    monkeypatch.setenv("KVCOUPLE_STORE_ENGINE", "zarr")
    assert_same(expected, per_doc(original))
    dst = rewrite(original, tmp_path / "d3.zarr", {"doc": 3, "step": 4}, zarr_format=2)
    assert_same(expected, per_doc(dst))


def test_codec_zarrs_lacks_falls_back_with_a_notice(original, expected, tmp_path, capsys):
    import numcodecs

    ds = xr.open_zarr(str(original))
    for v in ds.variables.values():
        v.encoding = {}
    dst = tmp_path / "lz4.zarr"
    key, codec = ("compressors", (numcodecs.LZ4(),)) if ZARR3 else ("compressor", numcodecs.LZ4())
    enc = {n: {key: codec} for n in ("p", "q", "branch_p", "branch_q")}
    ds.to_zarr(str(dst), mode="w", encoding=enc, consolidated=True, zarr_format=2)
    capsys.readouterr()
    assert_same(expected, per_doc(dst))
    notices = [line for line in capsys.readouterr().err.splitlines() if "Rust store engine" in line]
    assert len(notices) == 1 and "zarr-python" in notices[0]


def test_corrupt_distribution_chunk_is_named_by_the_engine(original, tmp_path):
    from kvcouple.errors import StoreError

    dst = rewrite(original, tmp_path / "d1.zarr", {"doc": 1}, zarr_format=2)
    (dst / "q" / "3.1.0.0.0").write_bytes(b"\x00" * 40)
    with pytest.raises(
        StoreError,
        match=r"chunk q/3\.1\.0\.0\.0 of variable 'q' \(document 'doc0003'\) cannot be decoded",
    ):
        analyze(dst, n_boot=20)
    (dst / "q" / "3.1.0.0.0").unlink()
    with pytest.raises(
        StoreError, match=r"chunk q/3\.1\.0\.0\.0 of variable 'q' \(document 'doc0003'\) is missing"
    ):
        analyze(dst, n_boot=20)
