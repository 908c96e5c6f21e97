"""numpy's huge-page advice is off while an analysis runs (``kvcouple.analysis.memory``):
inside ``analyze`` and ``kvcouple analyze``, never where the user set
NUMPY_MADVISE_HUGEPAGE, and as it was once the last of any concurrent analyses leaves."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvcouple.analysis import analyze, memory
from kvcouple.analysis import engine as engine_module
from kvcouple.analysis.memory import small_pages
from kvcouple.synth.trace_store import write_synthetic_trace_store

# numpy's own switch (numpy 2: numpy._core; numpy 1.x: numpy.core), as the module finds it.
SWITCH = memory._SWITCH
pytestmark = pytest.mark.skipif(SWITCH is None, reason="this numpy has no huge-page switch")


def advice() -> bool:
    assert SWITCH is not None
    before = SWITCH(True)
    SWITCH(before)
    return bool(before)


@pytest.fixture(autouse=True)
def advice_on(monkeypatch):
    monkeypatch.delenv("NUMPY_MADVISE_HUGEPAGE", raising=False)
    if SWITCH is None:
        yield
        return
    before = SWITCH(True)
    yield
    SWITCH(before)


def test_off_inside_and_restored_after():
    with small_pages():
        assert advice() is False
        with small_pages():  # nested: still off, and the outer restores
            assert advice() is False
        assert advice() is False
    assert advice() is True


def test_the_users_setting_is_kept(monkeypatch):
    monkeypatch.setenv("NUMPY_MADVISE_HUGEPAGE", "1")
    with small_pages():
        assert advice() is True
    assert advice() is True


def test_concurrent_analyses_restore_what_the_first_found():
    # A enters, B enters, A leaves (B still running: still off), B leaves: restored.
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen: list[bool] = []

    def a() -> None:
        with small_pages():
            a_in.set()
            b_in.wait()
        a_out.set()

    def b() -> None:
        a_in.wait()
        with small_pages():
            b_in.set()
            a_out.wait()
            seen.append(advice())

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == [False] and advice() is True


def test_analyze_runs_with_the_advice_off(tmp_path, monkeypatch):
    pairs = {"a": {"P": np.full((4, 4), 0.25), "Q": np.full((4, 4), 0.1) + 0.6 * np.eye(4)}}
    store = write_synthetic_trace_store(tmp_path / "s.zarr", pairs, horizon=5, branches=1,
                                        replicates=4, docs=3, seed=1)  # fmt: skip
    seen: list[bool] = []
    real = engine_module._read_documents

    def watched(*args, **kwargs):
        seen.append(advice())
        return real(*args, **kwargs)

    monkeypatch.setattr(engine_module, "_read_documents", watched)
    analyze(store, n_boot=20)
    assert seen == [False] and advice() is True
