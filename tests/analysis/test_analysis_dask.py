"""The Dask path (a LocalCluster with two worker processes) gives results identical to the
local path, and sizes each worker's Rust thread pool to the worker's threads."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvcouple.analysis import analyze
from kvcouple.synth.trace_store import write_synthetic_trace_store

distributed = pytest.importorskip("distributed")

PAIRS = {
    "a": {
        "P": np.full((4, 4), 0.25),
        "Q": 0.6 * np.full((4, 4), 0.25) + 0.4 * np.eye(4),
        "start": 0,
    },
    "b": {
        "P": np.full((4, 4), 0.25),
        "Q": 0.3 * np.full((4, 4), 0.25) + 0.7 * np.eye(4),
        "start": 2,
    },
}


def _two_workers():
    """A LocalCluster of two single-threaded worker processes."""
    return distributed.LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None
    )


def _canonical(result):
    tables = {m.model: m.tables for m in result.models}
    per_doc = [
        (d.doc_id, pol, u.values, u.stderr, u.survival.tolist(), u.tv_lag_num.tolist())
        for m in result.models
        for d in m.docs
        for pol, u in d.units.items()
    ]
    checks = [
        (d.doc_id, d.check.rows_checked, d.check.max_abs_diff)
        for m in result.models
        for d in m.docs
    ]
    return json.dumps([tables, per_doc, checks, result.checks()], default=str)


def test_dask_equals_local(tmp_path):
    path = write_synthetic_trace_store(
        tmp_path / "run.zarr",
        PAIRS,
        horizon=6,
        replicates=30,
        branches=2,
        docs=[0, 1, 2, 3, 1],
        record="full",
        seed=4,
    )
    local = analyze(path, n_boot=200)
    with (
        _two_workers() as cluster,
        distributed.Client(cluster) as client,
    ):
        remote = analyze(path, n_boot=200, client=client)
        threads = client.run(lambda: __import__("kvcouple").get_num_threads())
        assert sorted(threads.values()) == [1, 1]
        via_address = analyze(path, n_boot=200, scheduler=cluster.scheduler_address)
    assert _canonical(remote) == _canonical(local)
    assert _canonical(via_address) == _canonical(local)


def test_dask_tasks_are_batches_of_documents_with_the_same_results(tmp_path, monkeypatch):
    """Documents travel to the workers in batches (a few per worker thread): 16 documents on
    2 worker threads are 8 tasks of 2, and the results are the local path's."""
    from kvcouple.analysis import tasks

    path = write_synthetic_trace_store(
        tmp_path / "run.zarr", PAIRS, horizon=5, replicates=8, branches=2, docs=16, record="full"
    )
    local = analyze(path, n_boot=100)
    sizes: list[list[int]] = []
    real = tasks._batches

    def recorded(tasks_, size):
        got = real(tasks_, size)
        sizes.append([len(docs) for _, docs in got])
        return got

    monkeypatch.setattr(tasks, "_batches", recorded)
    with (
        _two_workers() as cluster,
        distributed.Client(cluster) as client,
    ):
        remote = analyze(path, n_boot=100, client=client)
    assert sizes == [[2] * 8]
    assert _canonical(remote) == _canonical(local)
