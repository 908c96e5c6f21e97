"""One writer at a time, through ``kvcouple trace`` as a user runs it (issue 37, point 5): a
second trace of a store being written (or of the same shard) is refused naming the first,
two ``--shard`` traces run together, ``analyze`` during a live trace says the store is being
written, and the lock a kill -9 leaves is taken over by the rerun, whose store equals an
uninterrupted run's. Each on a store of one object per document and on a sharded one (many
documents per Zarr shard: a kill loses the shard held in memory, ``--shard`` parts are whole
Zarr shards). The lock itself: ``tests/store/test_store_lock.py``."""

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

pytest.importorskip("torch")
pytest.importorskip("transformers")

import xarray as xr  # noqa: E402

from kvcouple.cli import main as cli_main  # noqa: E402
from kvcouple.store.lock import LOCK_DIR  # noqa: E402
from kvcouple.store.parts import part_documents  # noqa: E402
from kvcouple.testing.tiny_models import tiny_model  # noqa: E402

pytestmark = pytest.mark.torch

VOCAB = 64
HOST = socket.gethostname()

# `kvcouple trace ARGS` whose writer stops, alive and holding the lock, before writing
# document `block` until `release` exists (or it is killed there).
_BLOCKED_TRACE = """
import sys, time
from pathlib import Path
from kvcouple.cli import main
from kvcouple.store.writer import TraceStoreWriter

block, ready, release = int(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
original = TraceStoreWriter.write_doc

def blocked(self, doc, arrays):
    if doc == block:
        ready.touch()
        deadline = time.monotonic() + 300
        while not release.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
    return original(self, doc, arrays)

TraceStoreWriter.write_doc = blocked
sys.exit(main(sys.argv[4:]))
"""


# 4 documents: one stored object per document; 48: a sharded store, 3 documents a shard
# (kvcouple.store.create.docs_per_shard), whose --shard parts are whole shards.
DOCS = {4: 1, 48: 3}


@pytest.fixture(params=sorted(DOCS), ids=lambda n: f"{n}docs")
def n_docs(request) -> int:
    return request.param


@pytest.fixture
def trace_args(tmp_path, n_docs) -> list[str]:
    model_dir = tmp_path / "tiny"
    tiny_model("llama", seed=3, vocab_size=VOCAB).save_pretrained(model_dir)
    rng = np.random.default_rng(5)
    prompts = tmp_path / "docs.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"id": f"d{i}", "input_ids": [int(t) for t in rng.integers(1, VOCAB, 9)]})
            + "\n"
            for i in range(n_docs)
        )
    )
    return [
        "trace", "--model", str(model_dir), "--prompts", str(prompts), "--quiet",
        "--policy", "recent:retain=0.5", "--horizon", "8", "--replicates", "2",
        "--branches", "1", "--window", "2", "--seed", "3", "--device", "cpu",
    ]  # fmt: skip


class _Blocked:
    """A ``kvcouple trace`` process held before writing document ``block``."""

    def __init__(self, tmp_path: Path, args: list[str], block: int):
        self.ready, self.release = tmp_path / f"ready{block}", tmp_path / f"release{block}"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(_BLOCKED_TRACE), str(block), str(self.ready),
             str(self.release), *args],
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        self.named = f"process {self.proc.pid} on host {HOST}"

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 300
        while not self.ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise AssertionError(f"the trace did not start: {self.proc.communicate()[1]}")
            time.sleep(0.05)

    def finish(self) -> int:
        self.release.touch()
        _, err = self.proc.communicate(timeout=300)
        assert self.proc.returncode == 0, err[-2000:]
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.communicate()


def _same_store(store: Path, ref: Path, n_docs: int) -> None:
    """The stores are identical, and sharded as the document count says."""
    run = xr.open_zarr(store).load()
    assert run.identical(xr.open_zarr(ref).load())
    per_shard = DOCS[n_docs]
    assert (run.hazard.encoding.get("shards") or (1,))[0] == per_shard
    shard_files = [f for f in os.listdir(store / "hazard") if f[0].isdigit()]
    assert len(shard_files) == -(-n_docs // per_shard)


def test_second_trace_refused_analyze_says_being_written_kill_9_taken_over(
    tmp_path, trace_args, n_docs, capsys
):
    store, ref = tmp_path / "run.zarr", tmp_path / "ref.zarr"
    out = ["--out", str(store)]
    # Held in its third shard (sharded: the first two written, the third's first documents
    # held in memory and lost to the kill).
    first = _Blocked(tmp_path, [*trace_args, *out], block=2 * DOCS[n_docs] + 1)
    try:
        first.wait_ready()
        held = json.loads((store / LOCK_DIR / "all.json").read_text())
        assert held["pid"] == first.proc.pid and held["host"] == HOST
        assert "trace" in held["command"] and held["started"]
        capsys.readouterr()
        # A second trace of the same store, or of a shard of it: refused naming the first.
        for extra in ([], ["--shard", "1/2"]):
            assert cli_main([*trace_args, *out, *extra]) == 2
            err = capsys.readouterr().err
            assert f"is being written by {first.named} (since " in err, err
            assert "Wait for it to finish" in err
        # analyze and info during the live trace: being written, not interrupted.
        assert cli_main(["analyze", str(store), "--out", str(tmp_path / "a"), "--no-figures"]) == 2
        err = capsys.readouterr().err
        assert f"the store is being written by {first.named}" in err and "interrupted" not in err
        assert cli_main(["info", str(store)]) == 0
        assert f"being written by {first.named}" in capsys.readouterr().out
    finally:
        first.kill()
    assert first.proc.returncode == -9
    assert (store / LOCK_DIR / "all.json").exists()  # left by the killed process: stale
    assert cli_main(["analyze", str(store), "--out", str(tmp_path / "b"), "--no-figures"]) == 2
    assert "the run was interrupted" in capsys.readouterr().err
    # The rerun takes the stale lock over and finishes the store as an uninterrupted run.
    assert cli_main([*trace_args, *out]) == 0
    assert not (store / LOCK_DIR).exists()
    assert cli_main([*trace_args, "--out", str(ref)]) == 0
    _same_store(store, ref, n_docs)


def test_two_shard_traces_run_together_and_a_second_of_a_shard_is_refused(
    tmp_path, trace_args, n_docs, capsys
):
    store, ref = tmp_path / "run.zarr", tmp_path / "ref.zarr"
    out = ["--out", str(store)]
    # Shard i/2 writes the documents of every other Zarr shard (4 documents: 0 and 2 | 1 and
    # 3): both held mid-run, at the first document of their second Zarr shard.
    per_shard = DOCS[n_docs]
    shards = [
        _Blocked(
            tmp_path,
            [*trace_args, *out, "--shard", f"{i}/2"],
            block=part_documents(n_docs, (i, 2), per_shard)[per_shard],
        )
        for i in (0, 1)
    ]
    try:
        for s in shards:
            s.wait_ready()
        locks = sorted(os.listdir(store / LOCK_DIR))
        assert locks == ["shard-0-of-2.json", "shard-1-of-2.json"]
        pids = [json.loads((store / LOCK_DIR / n).read_text())["pid"] for n in locks]
        assert pids == [s.proc.pid for s in shards]
        capsys.readouterr()
        for i, s in enumerate(shards):
            assert cli_main([*trace_args, *out, "--shard", f"{i}/2"]) == 2
            err = capsys.readouterr().err
            assert f"being written by {s.named}" in err and f"writes shard-{i}-of-2" in err
        for s in shards:
            s.finish()
    finally:
        for s in shards:
            s.kill()
    assert not (store / LOCK_DIR).exists()
    assert cli_main([*trace_args, "--out", str(ref)]) == 0
    _same_store(store, ref, n_docs)
