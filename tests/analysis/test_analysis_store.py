"""Damaged, foreign and interrupted stores; recomputation of TVs from full and top-k records;
the ``analyze`` and ``info`` commands."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import zarr

from kvcouple.analysis import analyze
from kvcouple.analysis.report import write_report
from kvcouple.cli import main
from kvcouple.errors import SchemaVersionError, StoreError
from kvcouple.store import SCHEMA_VERSION
from kvcouple.synth.trace_store import write_synthetic_trace_store
from store_helpers import set_root_attr

PAIRS = {
    "a": {"P": np.full((5, 5), 0.2), "Q": np.full((5, 5), 0.2) * 0.7 + 0.3 * np.eye(5), "start": 0},
    "b": {"P": np.full((5, 5), 0.2), "Q": np.full((5, 5), 0.2) * 0.4 + 0.6 * np.eye(5), "start": 1},
}
SETTINGS = dict(horizon=5, branches=2, replicates=20, docs=3, seed=3)


@pytest.fixture(scope="module")
def full_store(tmp_path_factory):
    path = tmp_path_factory.mktemp("full") / "run.zarr"
    return write_synthetic_trace_store(path, PAIRS, record="full", **SETTINGS)


@pytest.fixture
def copy(full_store, tmp_path):
    dst = tmp_path / "copy.zarr"
    shutil.copytree(full_store, dst)
    return dst


def test_full_record_recomputation_agrees(full_store):
    result = analyze(full_store, n_boot=100)
    checks = [d.check for d in result.models[0].docs]
    assert all(c is not None for c in checks)
    # Path rows: every replicate's steps; branch rows: 2 branches x up to 5 lags.
    assert sum(c.rows_checked for c in checks) > 3 * 2 * 20 * 5
    assert max(c.max_abs_diff for c in checks) < 2e-3  # float16 storage rounding only
    assert result.checks() == []


def test_recomputation_reports_a_tampered_hazard(copy):
    g = zarr.open_group(str(copy), mode="r+")
    h = g["hazard"][1, 0]
    h[3, 1] += 0.1  # doc 1, policy a, replicate 3, step 2
    g["hazard"][1, 0] = h
    rows = analyze(copy, n_boot=50).checks()
    assert len(rows) == 1
    r = rows[0]
    assert (r["doc_id"], r["policy"], r["where"], r["rep"], r["index"]) == (
        "doc0001",
        "a",
        "path",
        3,
        2,
    )
    assert r["recorded"] == pytest.approx(r["recomputed"] + 0.1, abs=2e-3)


def test_topk_record_bounds_hold(tmp_path):
    path = write_synthetic_trace_store(tmp_path / "topk.zarr", PAIRS, record="topk:3", **SETTINGS)
    result = analyze(path, n_boot=50)
    assert sum(d.check.rows_checked for d in result.models[0].docs) > 0
    assert result.checks() == []


def test_missing_chunk_is_named(copy):
    (copy / "hazard" / "1.0.0.0").unlink()
    with pytest.raises(StoreError, match=r"chunk hazard/1\.0\.0\.0 .*'hazard'.*doc0001.*missing"):
        analyze(copy, n_boot=50)


def test_missing_distribution_chunk_is_named(copy):
    (copy / "branch_q" / "2.1.0.0.0.0").unlink()
    with pytest.raises(StoreError, match=r"branch_q/2\.1\.0\.0\.0\.0.*doc0002"):
        analyze(copy, n_boot=50)


def test_corrupted_chunk_is_named(copy):
    (copy / "branch_tv" / "2.1.0.0.0").write_bytes(b"not a zstd frame at all")
    with pytest.raises(StoreError, match=r"branch_tv/2\.1\.0\.0\.0.*doc0002.*cannot be decoded"):
        analyze(copy, n_boot=50)


def test_damaged_documents_are_skipped_when_asked(copy, tmp_path, capsys):
    (copy / "hazard" / "1.0.0.0").unlink()
    result = analyze(copy, n_boot=50, allow_incomplete=True)
    assert [d.doc_id for d in result.models[0].docs] == ["doc0000", "doc0002"]
    assert result.skipped[0]["doc_id"] == "doc0001"
    assert "hazard/1.0.0.0" in result.skipped[0]["reason"]
    # The command line: an error naming the chunk without the flag, a report with it.
    assert (
        main(["analyze", str(copy), "--out", str(tmp_path / "r"), "--n-boot", "50", "--no-figures"])
        == 2
    )
    assert "hazard/1.0.0.0" in capsys.readouterr().err
    assert (
        main(
            [
                "analyze",
                str(copy),
                "--out",
                str(tmp_path / "r"),
                "--n-boot",
                "50",
                "--no-figures",
                "--allow-incomplete",
            ]
        )
        == 0
    )
    assert "doc0001" in (tmp_path / "r" / "skipped.csv").read_text()


def _set_schema_version(path, version):
    set_root_attr(path, "schema_version", version)


def test_other_schema_version_is_refused(copy, tmp_path, capsys):
    other = SCHEMA_VERSION + 1
    _set_schema_version(copy, other)
    with pytest.raises(SchemaVersionError, match=f"schema version {other}"):
        analyze(copy)
    assert main(["analyze", str(copy), "--out", str(tmp_path / "r")]) == 2
    assert f"schema version {other}" in capsys.readouterr().err
    assert main(["info", str(copy)]) == 2


def test_interrupted_run(tmp_path, capsys):
    path = tmp_path / "cut.zarr"
    write_synthetic_trace_store(path, PAIRS, record="summary", stop_after=2, **SETTINGS)
    with pytest.raises(StoreError, match=r"1 of 3 documents are unfinished \(doc0002\)"):
        analyze(path)
    result = analyze(path, allow_incomplete=True, n_boot=50)
    assert [d.doc_id for d in result.models[0].docs] == ["doc0000", "doc0001"]
    assert result.skipped == [{"store": str(path), "doc_id": "doc0002", "reason": "unfinished"}]
    assert main(["info", str(path)]) == 0
    assert "2 of 3 done; unfinished: doc0002" in capsys.readouterr().out
    # Resuming writes exactly what an uninterrupted run writes.
    write_synthetic_trace_store(path, PAIRS, record="summary", **SETTINGS)
    whole = write_synthetic_trace_store(
        tmp_path / "whole.zarr", PAIRS, record="summary", **SETTINGS
    )
    a, b = zarr.open_group(str(path)), zarr.open_group(str(whole))
    np.testing.assert_array_equal(a["branch_tokens_q"][...], b["branch_tokens_q"][...])


def test_info_and_check(copy, capsys):
    assert main(["info", str(copy), "--check"]) == 0
    out = capsys.readouterr().out
    assert (
        f"schema v{SCHEMA_VERSION}" in out
        and "3 of 3 done" in out
        and "a, b" in out
        and "full" in out
    )
    (copy / "p" / "0.1.0.0.0").unlink()
    assert main(["info", str(copy), "--check"]) == 1
    assert "p/0.1.0.0.0" in capsys.readouterr().out
    assert main(["info", str(copy), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["documents_done"] == 3


def test_report_files(full_store, tmp_path):
    result = analyze(full_store, n_boot=100)
    out = write_report(result, tmp_path / "rep")
    for name in (
        "summary.csv",
        "per_document.csv",
        "curves.csv",
        "differences.csv",
        "gap_attribution.csv",
        "results.json",
        "report.md",
        "report.html",
    ):
        assert (out / name).stat().st_size > 0, name
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 6
    # One inline script (the per-document table's sorting), nothing fetched.
    assert html.count("<script") == 1 and "<script>" in html and 'src="http' not in html
    summary = (out / "summary.csv").read_text().splitlines()
    assert "plan_hash" in summary[0] and "none,indicator,all,not preregistered" in summary[1]
    data = json.loads((out / "results.json").read_text())
    assert data["meta"]["plan_hash"] == "none"
    assert {r["policy"] for r in data["summary"]} == {"a", "b"}


def test_inconsistent_fields_are_named():
    from kvcouple.analysis.estimates import estimate_unit

    R, T, K, L = 3, 4, 1, 3
    hazard = np.full((R, T), 0.1, np.float32)
    steps = np.ones((R, K), np.int32)
    mism = np.zeros((R, K, L + 1), np.int8)
    tv = np.zeros((R, K, L + 1), np.float32)
    kw = dict(obs_window=L, doc_id="d7", policy="snapkv")
    bad = hazard.copy()
    bad[2, 1] = 1.5
    with pytest.raises(StoreError, match=r"'d7'.*'snapkv'.*1\.5 at replicate 2, step 2"):
        estimate_unit(bad, steps, mism, tv, **kw)
    no_branch = steps.copy()
    no_branch[1] = 0
    with pytest.raises(StoreError, match="replicate 1 diverges .* no branch recorded"):
        estimate_unit(hazard, no_branch, mism, tv, **kw)
    # Divergence at float-noise level without branches is accepted (a `full` policy).
    u = estimate_unit(np.full((R, T), 1e-9), np.zeros((R, K), np.int32), mism, tv, **kw)
    assert u.values["occurrence"] == pytest.approx(4e-9)
    with pytest.raises(ValueError, match="observation window"):
        estimate_unit(hazard, steps, mism, tv, obs_window=L + 1)
