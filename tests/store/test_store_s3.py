"""Object storage round trip against a real S3-compatible server on 127.0.0.1 (moto in server
mode): trace into ``s3://``, then ``analyze`` and ``info`` from it, with the same numbers as
the same run written to local disk."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from kvcouple.analysis import analyze
from kvcouple.cli import main
from kvcouple.errors import StoreError
from kvcouple.store.reader import TraceStoreReader
from kvcouple.synth.trace_store import write_synthetic_trace_store
from kvcouple.testing.s3 import ServerUnavailable, local_s3

pytestmark = pytest.mark.s3

PAIRS = {
    "a": {"P": np.full((5, 5), 0.2), "Q": np.full((5, 5), 0.2) * 0.7 + 0.3 * np.eye(5), "start": 0},
}
SETTINGS = dict(horizon=5, branches=2, replicates=6, docs=[0, 1, 2], seed=4, record="full")


@pytest.fixture(scope="module")
def bucket():
    try:
        with local_s3() as url:
            yield url
    except ServerUnavailable as e:
        pytest.skip(f"no local S3 server: {e}")


def _results(path):
    r = analyze(path, n_boot=20)
    return {
        (d.doc_id, p): (u.values["occurrence"], d.check.rows_checked, d.check.max_abs_diff)
        for d in r.models[0].docs
        for p, u in d.units.items()
    }


def test_synthetic_run_to_s3_and_back(bucket, tmp_path, capsys):
    url = f"{bucket}/synth.zarr"
    write_synthetic_trace_store(url, PAIRS, stop_after=2, **SETTINGS)
    reader = TraceStoreReader(url)
    assert reader.done == [0, 1] and reader.unfinished() == [2]
    # Resuming finishes it; the result equals a local run, document by document.
    write_synthetic_trace_store(url, PAIRS, **SETTINGS)
    local = write_synthetic_trace_store(tmp_path / "local.zarr", PAIRS, **SETTINGS)
    remote = _results(url)
    assert remote == _results(local)
    assert all(v[1] > 0 for v in remote.values())
    capsys.readouterr()
    assert main(["info", url, "--check"]) == 0
    out = capsys.readouterr().out
    assert "3 of 3 done" in out and "object storage" in out and "no problems" in out


def test_a_sharded_store_on_s3_resumes_and_reads_as_on_disk(bucket, tmp_path):
    """48 summary documents: 3 a Zarr shard (written whole by zarr-python on object storage,
    by the Rust encoder on disk). Stopped mid-shard and resumed, the store on S3 holds what
    the local one holds, and analyses alike."""
    import xarray as xr

    settings = {**SETTINGS, "docs": 48, "record": "summary"}
    url = f"{bucket}/sharded.zarr"
    write_synthetic_trace_store(url, PAIRS, stop_after=7, **settings)
    assert TraceStoreReader(url).done == list(range(7))
    write_synthetic_trace_store(url, PAIRS, **settings)
    local = write_synthetic_trace_store(tmp_path / "local.zarr", PAIRS, **settings)
    remote = xr.open_zarr(url, storage_options=None).load()
    assert remote.hazard.encoding["shards"][0] == 3
    assert remote.identical(xr.open_zarr(local).load())
    a, b = analyze(url, n_boot=20), analyze(local, n_boot=20)
    assert [d.doc_id for d in a.models[0].docs] == [d.doc_id for d in b.models[0].docs]
    for da, db in zip(a.models[0].docs, b.models[0].docs, strict=True):
        assert da.units["a"].values["occurrence"] == db.units["a"].values["occurrence"]


def _all_tvs(reader, p_name, q_name):
    """Every row TV of every document of a distribution pair, by document, through the
    Rust engine (None where it could not read the store)."""
    out = {}
    for doc in range(reader.dims["doc"]):
        sels = [
            (doc, pol, *sel)
            for pol in range(len(reader.policies))
            for sel in reader.blocks(p_name, doc, pol)
        ]
        out[doc] = reader.rows_tv(p_name, q_name, sels)
    return out


def test_s3_is_read_through_the_engine(bucket, tmp_path, capsys):
    """Hazard and branch distributions on S3 are fetched concurrently and decoded by the Rust
    engine (not zarr-python): the same TVs as the local store, array by array, one request
    per chunk object, and the same analysis."""
    url = f"{bucket}/engine.zarr"
    write_synthetic_trace_store(url, PAIRS, **SETTINGS)
    local = write_synthetic_trace_store(tmp_path / "local.zarr", PAIRS, **SETTINGS)
    remote, here = TraceStoreReader(url), TraceStoreReader(local)
    requests = 0
    for p_name, q_name in (("p", "q"), ("branch_p", "branch_q")):
        got, want = _all_tvs(remote, p_name, q_name), _all_tvs(here, p_name, q_name)
        assert got.keys() == want.keys()
        for doc in want:
            assert got[doc] is not None and want[doc] is not None, (p_name, doc)
            assert got[doc].shape == want[doc].shape and got[doc].size > 0
            np.testing.assert_array_equal(got[doc], want[doc])
            requests += 2 * len(
                [s for pol in range(len(here.policies)) for s in here.blocks(p_name, doc, pol)]
            )
    n, nbytes, _ = remote.remote_reads
    assert n == requests and nbytes > 0
    # A reader that fetched ahead still pickles (Dask workers reopen it from the URL).
    again = pickle.loads(pickle.dumps(remote))
    np.testing.assert_array_equal(_all_tvs(again, "p", "q")[0], _all_tvs(here, "p", "q")[0])
    assert "cannot read" not in capsys.readouterr().err  # no fallback to zarr-python
    assert _results(url) == _results(local)


def test_the_engine_client_fetches_what_fsspec_fetches(bucket, tmp_path):
    """With the server's endpoint and credentials in the environment (as ``local_s3`` sets
    them), the engine's own client fetches the chunk objects: every object of the store comes
    back byte for byte as through zarr's fsspec store, an absent one as None, in order."""
    import s3fs

    url = f"{bucket}/client.zarr"
    write_synthetic_trace_store(url, PAIRS, **SETTINGS)
    reader = TraceStoreReader(url)
    assert reader.fetched_by == "engine"
    root = url[5:]
    keys = sorted(k[len(root) + 1 :] for k in s3fs.S3FileSystem().find(root))
    assert len(keys) > 50
    keys = keys[::-1] + ["p/9.9.9.9.9"]
    got = reader.fetch_objects(keys)
    assert got == reader.object_storage.fetch_with_zarr(keys)
    assert got[-1] is None and all(g is not None for g in got[:-1])
    # Pickled for a Dask worker, a reader makes its own client there.
    again = pickle.loads(pickle.dumps(reader))
    assert again.fetch_objects(keys[:3]) == got[:3]


def test_a_store_that_only_fsspec_can_read_gives_the_same_analysis(bucket, tmp_path):
    """A storage option only s3fs knows sends the fetches through fsspec: same numbers."""
    url = f"{bucket}/via_fsspec.zarr"
    write_synthetic_trace_store(url, PAIRS, **SETTINGS)
    opts = {"default_block_size": 2**20}
    assert TraceStoreReader(url, opts).fetched_by == "fsspec"
    r = analyze(url, n_boot=20, storage_options=opts)
    got = {
        (d.doc_id, p): u.values["occurrence"] for d in r.models[0].docs for p, u in d.units.items()
    }
    want = {k: v[0] for k, v in _results(url).items()}
    assert got == want and len(got) == 3


def test_a_store_on_a_server_that_went_away_is_refused_naming_it():
    """The reader is opened, then the server stops: the next fetch fails within seconds
    with a StoreError naming the store and the object (no three-minute retry)."""
    import time

    try:
        with local_s3(bucket="gone") as b:
            url = f"{b}/gone.zarr"
            write_synthetic_trace_store(url, PAIRS, **SETTINGS)
            reader = TraceStoreReader(url)
            assert reader.fetched_by == "engine"
    except ServerUnavailable as e:
        pytest.skip(f"no local S3 server: {e}")
    t = time.monotonic()
    with pytest.raises(
        StoreError, match=r"s3://gone/gone\.zarr: cannot fetch 1 chunk objects \(first p/0"
    ):
        reader.fetch_objects(["p/0.0.0.0.0"])
    assert time.monotonic() - t < 60


def test_damaged_distribution_chunk_on_s3_is_named(bucket):
    """A flipped byte in a ``p`` chunk object fails its checksum and a deleted one is
    missing, each named by chunk and document, on the engine's S3 path."""
    import s3fs

    fs = s3fs.S3FileSystem()
    url = f"{bucket}/damaged_p.zarr"
    write_synthetic_trace_store(url, PAIRS, **SETTINGS)
    key = f"{url[5:]}/p/1.0.0.0.0"
    data = bytearray(fs.cat_file(key))
    data[len(data) // 2] ^= 0x40
    fs.pipe_file(key, bytes(data))
    with pytest.raises(
        StoreError, match=r"chunk p/1\.0\.0\.0\.0 of variable 'p' \(document 'doc0001'\) .*checksum"
    ):
        analyze(url, n_boot=20)
    fs.rm(key)
    with pytest.raises(
        StoreError, match=r"chunk p/1\.0\.0\.0\.0 of variable 'p' \(document 'doc0001'\) is missing"
    ):
        analyze(url, n_boot=20)


def test_damage_on_s3_is_named(bucket):
    import s3fs

    url = f"{bucket}/damaged.zarr"
    write_synthetic_trace_store(url, PAIRS, **SETTINGS)
    s3fs.S3FileSystem().rm(f"{url[5:]}/hazard/1.0.0.0")
    with pytest.raises(
        Exception,
        match=r"chunk hazard/1\.0\.0\.0 of variable 'hazard' \(document 'doc0001'\) is missing",
    ):
        analyze(url, n_boot=20)


@pytest.mark.torch
def test_trace_a_model_into_s3(bucket, tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from kvcouple.store import Record
    from kvcouple.testing.tiny_models import tiny_model
    from kvcouple.tracer import Prompt, TraceSettings, trace

    rng = np.random.default_rng(9)
    prompts = [Prompt(f"doc{i}", tuple(int(t) for t in rng.integers(1, 120, 12))) for i in range(2)]
    settings = TraceSettings(horizon=4, replicates=2, branches=1, window=2, record=Record("full"))
    m = tiny_model("qwen3", seed=7)
    url = f"{bucket}/traced.zarr"
    local = tmp_path / "traced.zarr"
    for out in (url, local):
        trace(
            m,
            prompts,
            ["snapkv:retain=0.5,window=4"],
            settings,
            out,
            model_id="tiny",
            progress=False,
        )
    assert TraceStoreReader(url).done == [0, 1]
    a, b = _results(url), _results(local)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k][0] == pytest.approx(b[k][0], abs=1e-12) and a[k][1] == b[k][1]
