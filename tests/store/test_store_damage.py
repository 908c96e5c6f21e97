"""Each damage of issue 8 gives a StoreError naming its place, from ``analyze`` and from
``info --check``: never a traceback, never numbers."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import zarr

from kvcouple.analysis import analyze
from kvcouple.cli import main
from kvcouple.errors import ResourceLimitError, StoreError
from kvcouple.store.reader import TraceStoreReader
from kvcouple.synth.trace_store import write_synthetic_trace_store
from store_helpers import set_root_attr

PAIRS = {
    "a": {"P": np.full((5, 5), 0.2), "Q": np.full((5, 5), 0.2) * 0.7 + 0.3 * np.eye(5), "start": 0},
    "b": {"P": np.full((5, 5), 0.2), "Q": np.full((5, 5), 0.2) * 0.4 + 0.6 * np.eye(5), "start": 1},
}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("dmg") / "run.zarr"
    return write_synthetic_trace_store(
        path, PAIRS, horizon=6, branches=2, replicates=8, docs=3, record="full", seed=1
    )


@pytest.fixture
def copy(store, tmp_path):
    dst = tmp_path / "copy.zarr"
    shutil.copytree(store, dst)
    return dst


def set_attr(path, key, value=None, *, delete=False):
    """Edit a group attribute the way a user's editor would (every metadata document)."""
    set_root_attr(path, key, value, delete=delete)


def refused(path, tmp_path, capsys, pattern):
    """analyze raises StoreError matching ``pattern``; both commands exit non-zero saying it."""
    with pytest.raises(StoreError, match=pattern):
        analyze(path, n_boot=20)
    capsys.readouterr()
    assert main(["analyze", str(path), "--out", str(tmp_path / "r"), "--no-figures"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "E[M]/T" not in err
    assert main(["info", str(path), "--check"]) in (1, 2)
    out = capsys.readouterr()
    import re

    assert re.search(pattern, out.out + out.err), out


def test_intact_store_checks_clean(store, capsys):
    assert main(["info", str(store), "--check"]) == 0
    assert "no problems" in capsys.readouterr().out


def test_mismatch_out_of_range(copy, tmp_path, capsys):
    g = zarr.open_group(str(copy), mode="r+")
    g["branch_mismatch"][1, 0] = np.full(g["branch_mismatch"].shape[2:], 100, np.int8)
    refused(
        copy,
        tmp_path,
        capsys,
        r"chunk branch_mismatch/1\.0\.0\.0\.0 of variable 'branch_mismatch' \(document 'doc0001'\) holds 100.*\{-1, 0, 1\}",
    )
    # --allow-incomplete skips just that document.
    result = analyze(copy, n_boot=20, allow_incomplete=True)
    assert [d.doc_id for d in result.models[0].docs] == ["doc0000", "doc0002"]


def test_hazard_and_token_out_of_range(copy, tmp_path, capsys):
    g = zarr.open_group(str(copy), mode="r+")
    t = g["tokens"][2, 1]
    t[0, 0] = 5  # vocabulary of 5: ids 0..4
    g["tokens"][2, 1] = t
    refused(
        copy,
        tmp_path,
        capsys,
        r"tokens/2\.1\.0\.0 .*'doc0002'.*holds 5 at \(2, 1, 0, 0\).*\[-1, 5\)",
    )


def test_branch_step_past_the_horizon(copy, tmp_path, capsys):
    g = zarr.open_group(str(copy), mode="r+")
    s = g["branch_step"][0, 0]
    s[1, 1] = 7
    g["branch_step"][0, 0] = s
    refused(copy, tmp_path, capsys, r"branch_step/0\.0\.0\.0 .*'doc0000'.*holds 7.*\[0, 6\]")


def test_missing_policy_coordinate_chunk(copy, tmp_path, capsys):
    (copy / "policy" / "0").unlink()
    refused(copy, tmp_path, capsys, r"chunk policy/0 of variable 'policy' is missing")


def test_horizon_attribute_edited(copy, tmp_path, capsys):
    set_attr(copy, "horizon", 3)
    refused(copy, tmp_path, capsys, r"attribute 'horizon' is 3 but dimension 'step' has 6")


def test_horizon_attribute_too_large(copy, tmp_path, capsys):
    set_attr(copy, "horizon", 12)
    refused(copy, tmp_path, capsys, r"attribute 'horizon' is 12 but dimension 'step' has 6")


def test_window_attribute_missing(copy, tmp_path, capsys):
    set_attr(copy, "window", delete=True)
    refused(copy, tmp_path, capsys, r"attribute 'window' is missing")


def test_corrupt_completed_chunk(copy, tmp_path, capsys):
    (copy / "completed" / "1").write_bytes(b"garbage, not zstd")
    refused(copy, tmp_path, capsys, r"chunk completed/1 of variable 'completed'.*cannot be decoded")
    assert "asyncio" not in capsys.readouterr().err
    result = analyze(copy, n_boot=20, allow_incomplete=True)
    assert [d.doc_id for d in result.models[0].docs] == ["doc0000", "doc0002"]
    assert [s["doc_id"] for s in result.skipped] == ["doc0001"]


def test_missing_distribution_chunk_found_by_check(copy, capsys):
    (copy / "branch_p" / "2.0.0.0.0.0").unlink()
    assert main(["info", str(copy), "--check"]) == 1
    assert "branch_p/2.0.0.0.0.0" in capsys.readouterr().out


def test_n_boot_beyond_memory_is_refused(store, tmp_path, capsys):
    with pytest.raises(ResourceLimitError, match=r"--n-boot 1000000000 .* GB of memory"):
        analyze(store, n_boot=1_000_000_000)
    out = tmp_path / "r"
    assert main(["analyze", str(store), "--out", str(out), "--n-boot", "1000000000"]) == 2
    assert "--n-boot 1000000000" in capsys.readouterr().err


def test_every_rule_names_a_schema_variable():
    from kvcouple.store.schema import RULES, Record, variables

    known = set(variables(Record("full"))) | set(variables(Record("topk", 2)))
    assert set(RULES) <= known, set(RULES) - known


def test_reader_is_picklable(store):
    import pickle

    r = pickle.loads(pickle.dumps(TraceStoreReader(store)))
    np.testing.assert_array_equal(
        r.read_doc("hazard", 1), TraceStoreReader(store).read_doc("hazard", 1)
    )
