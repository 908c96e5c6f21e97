"""A write that fails in the middle of a document (a full disk, a lost mount): the document must
read as unfinished everywhere (``completed``, ``kvcouple info``, ``kvcouple analyze``) and a rerun
must complete it, byte for byte equal to an uninterrupted run.

The interruption tests elsewhere stop between documents; only a fault inside ``write_doc`` tells
a writer that sets ``completed`` last from one that sets it first.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import zarr

from kvcouple.analysis import analyze
from kvcouple.cli import main
from kvcouple.errors import StoreError
from kvcouple.store import StoreLayout, TraceStoreWriter, variables
from kvcouple.synth.trace_store import write_synthetic_trace_store

PAIRS = {
    "a": {"P": np.full((4, 4), 0.25), "Q": np.full((4, 4), 0.25) * 0.6 + 0.4 * np.eye(4)},
    "b": {"P": np.full((4, 4), 0.25), "Q": np.full((4, 4), 0.25) * 0.3 + 0.7 * np.eye(4)},
}
SETTINGS = dict(horizon=4, branches=2, replicates=6, docs=3, seed=2, record="topk:2")


class InjectedWriteError(OSError):
    """The fault the tests inject."""


def _selects_doc(key: object, doc: int) -> bool:
    first = key[0] if isinstance(key, tuple) and key else key
    if isinstance(first, slice):
        return first.start == doc and (first.stop is None or first.stop == doc + 1)
    return isinstance(first, int | np.integer) and int(first) == doc


def fail_mid_document(monkeypatch, doc: int, nth: int) -> list[str]:
    """Make the ``nth`` array write into document ``doc`` raise; returns the arrays written
    into that document (so a test can check the fault fired where it meant)."""
    original = zarr.Array.__setitem__
    seen: list[str] = []

    def setitem(self, key, value):
        if _selects_doc(key, doc):
            seen.append(str(getattr(self, "path", None) or getattr(self, "name", "?")))
            if len(seen) == nth:
                raise InjectedWriteError(f"injected fault writing {seen[-1]} of document {doc}")
        return original(self, key, value)

    monkeypatch.setattr(zarr.Array, "__setitem__", setitem)
    return seen


def tree_bytes(root: Path) -> dict[str, bytes]:
    """Every file of a store, by relative path."""
    return {str(f.relative_to(root)): f.read_bytes() for f in root.rglob("*") if f.is_file()}


def assert_same_store(a: Path, b: Path) -> None:
    ta, tb = tree_bytes(a), tree_bytes(b)
    assert sorted(ta) == sorted(tb)
    differ = [k for k in ta if ta[k] != tb[k]]
    assert not differ, f"files differ: {differ[:10]}"


def test_fault_in_the_middle_of_a_document(tmp_path, monkeypatch, capsys):
    cut, whole = tmp_path / "cut.zarr", tmp_path / "whole.zarr"
    seen = fail_mid_document(monkeypatch, doc=1, nth=3)
    with pytest.raises(InjectedWriteError):
        write_synthetic_trace_store(cut, PAIRS, **SETTINGS)
    assert len(seen) == 3, f"the writer no longer writes documents through zarr arrays: {seen}"
    monkeypatch.undo()

    # The flags: document 0 finished, 1 half-written, 2 never started.
    done = np.asarray(zarr.open_group(str(cut), mode="r")["completed"][...], bool)
    assert done.tolist() == [True, False, False]

    assert main(["info", str(cut), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["documents_done"] == 1 and info["documents"] == 3
    assert info["unfinished"] == ["doc0001", "doc0002"]
    assert main(["info", str(cut)]) == 0
    assert "1 of 3 done; unfinished: doc0001, doc0002" in capsys.readouterr().out

    out = tmp_path / "report"
    args = ["analyze", str(cut), "--out", str(out), "--n-boot", "20", "--no-figures"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "2 of 3 documents are unfinished" in err and "doc0001" in err
    assert main([*args, "--allow-incomplete"]) == 0
    capsys.readouterr()
    result = analyze(cut, allow_incomplete=True, n_boot=20)
    assert [d.doc_id for d in result.models[0].docs] == ["doc0000"]
    assert [s["doc_id"] for s in result.skipped] == ["doc0001", "doc0002"]

    # Rerunning the same command finishes the store exactly as an uninterrupted run writes it.
    write_synthetic_trace_store(cut, PAIRS, **SETTINGS)
    write_synthetic_trace_store(whole, PAIRS, **SETTINGS)
    assert np.asarray(zarr.open_group(str(cut), mode="r")["completed"][...]).all()
    assert_same_store(cut, whole)


@pytest.mark.parametrize("nth", [1, 2])
def test_fault_at_the_first_writes_of_the_first_document(tmp_path, monkeypatch, nth):
    """Nothing finished yet: the store exists, no document is done, a rerun completes it."""
    cut, whole = tmp_path / "cut.zarr", tmp_path / "whole.zarr"
    seen = fail_mid_document(monkeypatch, doc=0, nth=nth)
    with pytest.raises(InjectedWriteError):
        write_synthetic_trace_store(cut, PAIRS, **{**SETTINGS, "docs": 2})
    assert len(seen) == nth
    monkeypatch.undo()
    assert not np.asarray(zarr.open_group(str(cut), mode="r")["completed"][...]).any()
    write_synthetic_trace_store(cut, PAIRS, **{**SETTINGS, "docs": 2})
    write_synthetic_trace_store(whole, PAIRS, **{**SETTINGS, "docs": 2})
    assert_same_store(cut, whole)


def test_resume_refuses_other_settings(tmp_path):
    """A rerun with other run-defining settings would mix two runs in one store: refused,
    naming the setting, and nothing is written."""
    path = tmp_path / "s.zarr"
    write_synthetic_trace_store(path, PAIRS, **{**SETTINGS, "stop_after": 1})
    before = tree_bytes(path)
    for key, value in (("seed", 3), ("replicates", 7), ("horizon", 5), ("record", "summary")):
        with pytest.raises(StoreError, match=key):
            write_synthetic_trace_store(path, PAIRS, **{**SETTINGS, key: value})
    assert tree_bytes(path) == before
    write_synthetic_trace_store(path, PAIRS, **SETTINGS)
    assert np.asarray(zarr.open_group(str(path), mode="r")["completed"][...]).all()


def test_write_doc_refuses_wrong_shapes(tmp_path):
    """A document whose arrays do not fit the layout is refused before anything is written."""
    layout = StoreLayout(
        doc_ids=["a", "b"],
        policies=["full"],
        horizon=3,
        window=1,
        branches=1,
        replicates=2,
        vocab_size=5,
    )
    path = tmp_path / "w.zarr"
    writer = TraceStoreWriter.open(path, layout, {"model_id": "m", "seed": 0})
    sizes = layout.sizes()
    arrays = {
        name: np.zeros(tuple(sizes[d] for d in var[0][1:]), var[1])
        for name, var in variables(layout.record).items()
        if name != "completed"
    }
    before = tree_bytes(path)
    for name in ("hazard", "branch_tv", "kept_length"):
        bad = dict(arrays)
        bad[name] = np.zeros((*arrays[name].shape[:-1], arrays[name].shape[-1] + 1))
        with pytest.raises(StoreError, match=name):
            writer.write_doc(1, bad)
        bad[name] = np.zeros(arrays[name].shape[:-1])  # an axis missing
        with pytest.raises(StoreError, match=name):
            writer.write_doc(1, bad)
    missing = {k: v for k, v in arrays.items() if k != "tokens"}
    with pytest.raises(StoreError, match="tokens"):
        writer.write_doc(1, missing)
    assert tree_bytes(path) == before
    assert not writer.completed().any()
    writer.write_doc(1, arrays)
    assert writer.completed().tolist() == [False, True]
