"""Consistency of analysis outputs: a synthetic store with a TV = 1 step, header-only empty
tables, one unit per column name."""

from __future__ import annotations

import csv

import numpy as np
import pytest
import zarr

from kvcouple import synth
from kvcouple.analysis import analyze, write_report
from kvcouple.synth.trace_store import write_synthetic_trace_store

# From state 1 the kernels share no token (TV = 1): the overlap path ends there.
TV1 = {"P": np.array([[0.5, 0.5], [1.0, 0.0]]), "Q": np.array([[0.6, 0.4], [0.0, 1.0]]), "start": 0}
T = 6


@pytest.fixture(scope="module")
def tv1_store(tmp_path_factory):
    path = tmp_path_factory.mktemp("tv1") / "run.zarr"
    return write_synthetic_trace_store(path, {"tv1": TV1}, horizon=T, replicates=400, docs=4)


def test_tv1_store_has_zero_hazard_after_the_stop_and_is_analysed(tv1_store):
    hazard = np.asarray(zarr.open_group(str(tv1_store), mode="r")["hazard"][...], np.float64)
    assert np.isfinite(hazard).all()
    stopped = np.cumsum(hazard >= 1.0, axis=-1) - (hazard >= 1.0) > 0  # steps after a TV=1 step
    assert stopped.any(), "the repro must reach the TV = 1 state"
    assert (hazard[stopped] == 0).all()
    result = analyze(tv1_store, n_boot=200)
    truth = synth.exact(synth.pair_from_mapping(TV1), horizon=T)
    for d in result.models[0].docs:
        u = d.units["tv1"]
        for q in ("occurrence", "occupation", "expected_mismatches"):
            assert abs(u.values[q] - getattr(truth, q)) <= 4.5 * u.stderr[q] + 1e-6, q


def test_empty_tables_are_header_only_and_units_agree(tv1_store, tmp_path):
    result = analyze(tv1_store, n_boot=100)
    out = write_report(result, tmp_path / "out", figures=False, html_report=False)
    for name in ("tests", "skipped", "recompute_check"):
        with (out / f"{name}.csv").open() as f:
            rows = list(csv.reader(f))
        assert len(rows) == 1, name  # the header alone
        assert "empty" not in rows[0] and "plan_hash" in rows[0], (name, rows[0])
    with (out / "tests.csv").open() as f:
        assert {"comparison", "p_value", "p_adjusted"} <= set(next(csv.reader(f)))
    # interval_lower/upper_fraction are fractions of T in both files: the summary is their mean.
    with (out / "per_document.csv").open() as f:
        per_doc = list(csv.DictReader(f))
    with (out / "summary.csv").open() as f:
        summary = {r["quantity"]: r for r in csv.DictReader(f)}
    for name in ("interval_lower_fraction", "interval_upper_fraction"):
        mean = np.mean([float(r[name]) for r in per_doc])
        assert 0 <= mean <= 1
        assert mean == pytest.approx(float(summary[name]["estimate"]), rel=1e-9)
