"""One writer at a time (issue 37, point 5): a live writer locks what it writes, a second
writer of the same part is refused naming the first, readers say "being written by ...", and
a lock left by a killed process is taken over, so kill -9 and a rerun keep working.

These tests use the synthetic writer (the tracer's writer, no model): the same runs through
``kvcouple trace`` are in ``tests/tracer/test_trace_lock.py``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from kvcouple.cli import main
from kvcouple.errors import StoreError
from kvcouple.store.lock import (
    LOCK_DIR,
    StoreBeingWrittenError,
    StoreLockError,
    WriterLock,
    writer_lock,
    writers,
)
from kvcouple.store.reader import TraceStoreReader
from kvcouple.synth.trace_store import write_synthetic_trace_store

PAIRS = {
    "a": {"P": np.full((5, 5), 0.2), "Q": np.full((5, 5), 0.2) * 0.7 + 0.3 * np.eye(5), "start": 0},
    "b": {"P": np.full((5, 5), 0.2), "Q": np.full((5, 5), 0.2) * 0.4 + 0.6 * np.eye(5), "start": 1},
}
SETTINGS = dict(horizon=6, branches=2, replicates=4, docs=4, seed=3)
HOST = socket.gethostname()

# A synthetic run that stops, alive and holding its lock, before writing document `block`
# until `release` exists (or is killed there): a writer caught in the middle of its run.
_BLOCKED_RUN = """
import sys, time
from pathlib import Path
import numpy as np
from kvcouple.store.writer import TraceStoreWriter
from kvcouple.synth.trace_store import write_synthetic_trace_store

store, ready, release = sys.argv[1:4]
original = TraceStoreWriter.write_doc

def blocked(self, doc, arrays):
    if doc == {block}:
        Path(ready).touch()
        deadline = time.monotonic() + 300
        while not Path(release).exists() and time.monotonic() < deadline:
            time.sleep(0.02)
    return original(self, doc, arrays)

TraceStoreWriter.write_doc = blocked
write_synthetic_trace_store(store, {pairs}, **{settings})
"""


def _pairs_source() -> str:
    return (
        "{"
        + ", ".join(
            f"{k!r}: {{'P': np.array({v['P'].tolist()}), 'Q': np.array({v['Q'].tolist()}), "
            f"'start': {v['start']}}}"
            for k, v in PAIRS.items()
        )
        + "}"
    )


def _start_blocked(tmp_path: Path, store: Path, block: int) -> tuple[subprocess.Popen, Path]:
    ready, release = tmp_path / f"ready{block}", tmp_path / f"release{block}"
    script = _BLOCKED_RUN.format(block=block, pairs=_pairs_source(), settings=SETTINGS)
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script), str(store), str(ready), str(release)],
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the blocked run did not start: {proc.communicate()[1]}")
        time.sleep(0.05)
    return proc, release


def _arrays(path: Path) -> dict[str, np.ndarray]:
    import zarr

    group = zarr.open_group(str(path), mode="r")
    return {name: np.asarray(arr[...]) for name, arr in group.arrays()}


def test_live_writer_refuses_a_second_readers_say_being_written_kill_9_is_taken_over(
    tmp_path, capsys
):
    """The whole cycle on one store: a live writer's lock names it; a second writer (whole
    store or a shard) is refused naming it; analyze and info say "being written by"; plain
    xarray and the integrity checks do not see the lock; kill -9 leaves a stale lock that the
    rerun takes over, and the resumed store equals an uninterrupted run's."""
    import xarray as xr

    store, ref = tmp_path / "run.zarr", tmp_path / "ref.zarr"
    proc, _release = _start_blocked(tmp_path, store, block=2)
    try:
        lock_file = store / LOCK_DIR / "all.json"
        held = json.loads(lock_file.read_text())
        assert held["pid"] == proc.pid and held["host"] == HOST and held["part"] == "all"
        assert held["started"].endswith("Z") and "-c" in held["command"]
        named = f"process {proc.pid} on host {HOST}"

        # A second writer, of the whole store or of a shard of it, is refused naming the first.
        with pytest.raises(StoreLockError, match=f"being written by {named}") as refused:
            write_synthetic_trace_store(store, PAIRS, **SETTINGS)
        assert "Wait for it to finish" in str(refused.value)
        with pytest.raises(StoreLockError, match=named):
            with writer_lock(store, (1, 2), 4):
                pass
        assert sorted(os.listdir(store / LOCK_DIR)) == ["all.json"]  # nothing left behind

        # Readers: being written, not interrupted.
        reader = TraceStoreReader(store)
        assert reader.done == [0, 1]
        with pytest.raises(StoreBeingWrittenError, match=f"being written by {named}") as e:
            reader.require_complete()
        assert "interrupted" not in str(e.value)
        capsys.readouterr()
        assert main(["analyze", str(store), "--out", str(tmp_path / "a"), "--no-figures"]) == 2
        err = capsys.readouterr().err
        assert f"being written by {named}" in err and "interrupted" not in err
        assert main(["info", str(store), "--check"]) == 0  # the lock is no problem
        out = capsys.readouterr().out
        assert f"writing   being written by {named}" in out and "no problems" in out

        # Plain xarray opens the locked store and sees no trace of the lock.
        for consolidated in (True, False):
            ds = xr.open_zarr(store, consolidated=consolidated)
            assert not any("lock" in str(n) for n in [*ds.variables, *ds.attrs])
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -9

    # Killed: the lock is left, stale, and readers say the run was interrupted.
    assert (store / LOCK_DIR / "all.json").exists()
    assert [s for _, s in writers(store)] == ["stale"]
    with pytest.raises(StoreError, match="the run was interrupted") as e:
        TraceStoreReader(store).require_complete()
    assert not isinstance(e.value, StoreBeingWrittenError)
    capsys.readouterr()
    assert main(["info", str(store)]) == 0
    assert "no run holds it" in capsys.readouterr().out

    # The rerun takes the stale lock over, finishes the store, and leaves no lock.
    write_synthetic_trace_store(store, PAIRS, **SETTINGS)
    assert not (store / LOCK_DIR).exists()
    write_synthetic_trace_store(ref, PAIRS, **SETTINGS)
    a, b = _arrays(store), _arrays(ref)
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_the_lock_is_released_on_an_exception_and_after_a_clean_run(tmp_path):
    store = write_synthetic_trace_store(tmp_path / "s.zarr", PAIRS, **SETTINGS)
    assert not (store / LOCK_DIR).exists()  # a finished run leaves no lock
    with pytest.raises(RuntimeError, match="boom"):
        with writer_lock(store, (0, 1), 4) as mine:
            assert mine.pid == os.getpid() and writers(store) == [(mine, "live")]
            raise RuntimeError("boom")
    assert writers(store) == [] and not (store / LOCK_DIR).exists()


def test_shards_lock_their_own_part_and_overlapping_parts_are_refused(tmp_path):
    store = write_synthetic_trace_store(tmp_path / "s.zarr", PAIRS, **SETTINGS)
    with writer_lock(store, (0, 2), 4), writer_lock(store, (1, 2), 4):  # two shards together
        assert sorted(os.listdir(store / LOCK_DIR)) == ["shard-0-of-2.json", "shard-1-of-2.json"]
        named = f"process {os.getpid()} on host {HOST}"
        with pytest.raises(StoreLockError, match=f"{named}.*which writes shard-0-of-2"):
            writer_lock(store, (0, 2), 4).__enter__()  # the same shard
        with pytest.raises(StoreLockError, match="documents of this run's part, all, too"):
            writer_lock(store, (0, 1), 4).__enter__()  # the whole store
        with pytest.raises(StoreLockError, match="documents of this run's part, shard-2-of-4, too"):
            writer_lock(store, (2, 4), 4).__enter__()  # docs 2 is shard 0/2's
        assert len(os.listdir(store / LOCK_DIR)) == 2  # the refused left nothing
    with writer_lock(store, (0, 2), 4), writer_lock(store, (1, 4), 4):  # disjoint: 0,2 | 1
        pass
    assert not (store / LOCK_DIR).exists()


def _plant(store: Path, part: str, **fields) -> Path:
    lock = WriterLock.mine((0, 1) if part == "all" else (0, 2))
    body = json.loads(lock.to_json())
    body.update(fields)
    path = store / LOCK_DIR / f"{part}.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(body))
    return path


def test_stale_locks_are_taken_over_and_locks_elsewhere_are_not(tmp_path):
    store = write_synthetic_trace_store(tmp_path / "s.zarr", PAIRS, **SETTINGS)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    # The process is gone; its id is another process's now (start time differs); the host
    # restarted since; the lock file was cut short: all stale, all taken over.
    for fields in (
        {"pid": gone.pid},
        {"process_start": -5},
        {"boot_id": "another-boot"},
    ):
        _plant(store, "all", **fields)
        assert [s for _, s in writers(store)] == ["stale"], fields
        with writer_lock(store, (0, 1), 4) as mine:
            assert writers(store) == [(mine, "live")]
    (store / LOCK_DIR).mkdir()
    (store / LOCK_DIR / "all.json").write_text('{"pid": 12')
    with writer_lock(store, (0, 1), 4):
        pass
    # A stale lock of an overlapping part is taken over too.
    _plant(store, "shard-0-of-2", pid=gone.pid)
    with writer_lock(store, (0, 1), 4):
        assert sorted(os.listdir(store / LOCK_DIR)) == ["all.json"]

    # On another host nothing can be checked: refused, saying which file to delete.
    path = _plant(store, "all", host="gpu-node-7", pid=4242)
    with pytest.raises(StoreLockError, match="process 4242 on host gpu-node-7") as e:
        write_synthetic_trace_store(store, PAIRS, **SETTINGS)
    assert f"delete {path}" in str(e.value) and "another host" in str(e.value)
    note = TraceStoreReader(store).writing()
    assert note is not None and "being written by process 4242 on host gpu-node-7" in note
    assert f"delete {path}" in note
    path.unlink()  # as the message says
    write_synthetic_trace_store(store, PAIRS, **SETTINGS)


@pytest.mark.s3
def test_object_storage_locks_by_conditional_write(tmp_path):
    from kvcouple.testing.s3 import ServerUnavailable, local_s3

    try:
        server = local_s3()
        url = server.__enter__()
    except ServerUnavailable as e:
        pytest.skip(f"no local S3 server: {e}")
    try:
        store = f"{url}/locked.zarr"
        write_synthetic_trace_store(store, PAIRS, stop_after=1, **SETTINGS)
        with writer_lock(store, (0, 1), 4) as mine:
            named = f"process {mine.pid} on host {HOST}"
            with pytest.raises(StoreLockError, match=f"being written by {named}"):
                write_synthetic_trace_store(store, PAIRS, **SETTINGS)
            with pytest.raises(StoreBeingWrittenError, match=named):
                TraceStoreReader(store).require_complete()
        assert writers(store) == []
        write_synthetic_trace_store(store, PAIRS, **SETTINGS)
        assert TraceStoreReader(store).done == [0, 1, 2, 3]
    finally:
        server.__exit__(None, None, None)
