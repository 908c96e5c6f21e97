"""The background writer (issue 24 point 5): a bounded queue, back-pressure, errors raised in
the caller, tracing overlapped with writing, and kill -9 during a background write resuming to
the store of an uninterrupted run."""

import errno
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from kvcouple.store.background import BackgroundWriter, host_record_bytes, queue_bound
from kvcouple.store.create import StoreLayout
from kvcouple.store.schema import Record


class _SlowWriter:
    """Stands in for a TraceStoreWriter: each write takes ``seconds``; ``fail`` raises."""

    def __init__(self, seconds: float, fail: int | None = None):
        self.seconds, self.fail = seconds, fail
        self.written: list[int] = []
        self.threads: set[str] = set()

    def write_doc(self, doc, arrays):
        self.threads.add(threading.current_thread().name)
        time.sleep(self.seconds)
        if doc == self.fail:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "store/hazard")
        self.written.append(doc)


def test_bounded_queue_back_pressure_and_order():
    slow = _SlowWriter(0.05)
    with BackgroundWriter(slow, max_pending=2) as bg:  # type: ignore[arg-type]
        for d in range(8):  # much faster than the writer: the queue fills
            bg.write_doc(d, {"x": np.zeros(1000, np.float32)})
    stats = bg.stats
    assert slow.written == list(range(8))
    assert slow.threads == {"kvcouple-store-writer"}
    assert stats.documents == 8 and stats.bytes == 8 * 4000
    assert 1 <= stats.peak_pending <= 2 + 1  # queued + the one being written
    assert stats.peak_bytes <= 3 * 4000
    assert stats.blocked_seconds > 0  # back-pressure: the caller waited for room
    with pytest.raises(RuntimeError, match="closed"):
        bg.write_doc(9, {})


def test_a_failed_write_is_raised_in_the_caller_as_it_was():
    slow = _SlowWriter(0.01, fail=2)
    with pytest.raises(OSError) as raised:
        with BackgroundWriter(slow, max_pending=1) as bg:  # type: ignore[arg-type]
            for d in range(6):
                bg.write_doc(d, {"x": np.zeros(10)})
    assert raised.value.errno == errno.ENOSPC
    assert 2 not in slow.written and slow.written[:2] == [0, 1]
    # Nothing after the failure is written (the caller stops at the next write_doc or close).
    assert all(d < 2 for d in slow.written)


def test_host_bytes_follow_the_layout():
    layout = StoreLayout(
        ["a"], ["full", "recent:retain=0.5"], 4, 2, 2, 3, 1000, Record.parse("full")
    )
    with_records = host_record_bytes(layout, 2, queue_bound([2, 1]))
    summary = host_record_bytes(
        StoreLayout(["a"], ["full", "recent:retain=0.5"], 4, 2, 2, 3, 1000), 2, 2
    )
    # p, q: (policy, rep, step, vocab); branch_p, branch_q: (policy, rep, branch, lag, vocab); float16
    full_bytes = 2 * (2 * 3 * 4 * 1000 + 2 * 3 * 2 * 3 * 1000) * 2
    assert with_records - summary == (2 + 2 + 2) * full_bytes


def test_the_memory_plan_counts_records_on_the_host():
    from kvcouple.tracer.memory import host_footprint, host_refusal

    layout = StoreLayout(["a"], ["full"], 4, 2, 2, 3, 1000, Record.parse("full"))
    need = host_record_bytes(layout, 3, 3)  # batches of 3: 3 tracing, 3 queued, 1 + 1
    assert host_footprint(layout, [3, 1], available=need * 2).fits
    tight = host_footprint(layout, [3, 1], available=need)  # the 10% margin leaves too little
    assert tight.records == need and not tight.fits
    assert "--doc-batch" in host_refusal(tight) and "3 traced at once" in host_refusal(tight)
    assert host_footprint(layout, [1], available=need).fits  # one at a time: 4 documents' worth


torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
zarr = pytest.importorskip("zarr")
pytestmark = pytest.mark.torch  # -m "not torch" deselects the module

from kvcouple.testing.tiny_models import tiny_model  # noqa: E402
from kvcouple.tracer import Prompt, TraceSettings, trace  # noqa: E402

VOCAB = 32000
SETTINGS = dict(horizon=8, replicates=2, branches=1, window=2, doc_batch=1)


def _prompts(count: int) -> list[Prompt]:
    rng = np.random.default_rng(5)
    return [
        Prompt(f"d{i}", tuple(int(t) for t in rng.integers(1, VOCAB, 10))) for i in range(count)
    ]


def _arrays(path) -> dict:
    group = zarr.open_group(str(path), mode="r")
    return {name: np.asarray(a[...]) for name, a in group.arrays()}


@pytest.mark.torch
def test_tracing_overlaps_writing_with_a_32k_vocabulary(tmp_path):
    """record=full on a tiny model with a 32k vocabulary: documents are written on the
    writer's thread while the next one traces, never more queued than the bound."""
    torch.set_num_threads(1)
    model = tiny_model("llama", seed=3, vocab_size=VOCAB)
    settings = TraceSettings(**SETTINGS, record=Record.parse("full"))  # type: ignore[arg-type]
    summary = trace(
        model, _prompts(4), ["recent:retain=0.5"], settings, tmp_path / "s.zarr", progress=False
    )
    stats = summary.writer
    assert stats is not None and stats.documents == 4
    assert stats.peak_pending <= queue_bound([1] * 4) + 1
    assert stats.bytes > 4 * 2 * 8 * VOCAB * 2  # the full records went through it
    assert stats.overlap_seconds > 0  # some writing happened while the tracer ran
    done = np.asarray(zarr.open_group(str(tmp_path / "s.zarr"), mode="r")["completed"][...])
    assert done.all()


_KILLED_RUN = """
import os, signal, sys
import numpy as np, torch
from kvcouple.store.schema import Record
from kvcouple.store.writer import TraceStoreWriter
from kvcouple.testing.tiny_models import tiny_model
from kvcouple.tracer import Prompt, TraceSettings, trace
import threading

original = TraceStoreWriter.write_doc

def killed(self, doc, arrays):
    if doc == {kill_doc}:
        # In the writer's thread, half of the document's variables on disk: then kill -9.
        assert threading.current_thread().name == "kvcouple-store-writer"
        names = sorted(arrays)[: len(arrays) // 2]
        for name in names:
            self._group[name][doc] = np.asarray(arrays[name]).astype(self._vars[name][1])
        os.kill(os.getpid(), signal.SIGKILL)
    return original(self, doc, arrays)

TraceStoreWriter.write_doc = killed
torch.set_num_threads(1)
rng = np.random.default_rng(5)
prompts = [Prompt(f"d{{i}}", tuple(int(t) for t in rng.integers(1, {vocab}, 10))) for i in range(4)]
model = tiny_model("llama", seed=3, vocab_size={vocab})
trace(model, prompts, ["recent:retain=0.5"], TraceSettings(**{settings}, record=Record.parse("full")),
      sys.argv[1], progress=False)
"""


@pytest.mark.torch
def test_kill_9_during_a_background_write_resumes_to_an_uninterrupted_store(tmp_path):
    killed, ref = tmp_path / "killed.zarr", tmp_path / "ref.zarr"
    script = _KILLED_RUN.format(kill_doc=2, vocab=VOCAB, settings=SETTINGS)
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), str(killed)],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == -9, proc.stderr[-2000:]
    done = np.asarray(zarr.open_group(str(killed), mode="r")["completed"][...])
    assert done.tolist() == [True, True, False, False]
    torch.set_num_threads(1)
    model = tiny_model("llama", seed=3, vocab_size=VOCAB)
    settings = TraceSettings(**SETTINGS, record=Record.parse("full"))  # type: ignore[arg-type]
    summary = trace(model, _prompts(4), ["recent:retain=0.5"], settings, killed, progress=False)
    assert sorted(summary.traced) == [2, 3]
    trace(model, _prompts(4), ["recent:retain=0.5"], settings, ref, progress=False)
    a, b = _arrays(killed), _arrays(ref)
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


@pytest.mark.torch
def test_dry_run_prints_the_host_memory_of_records(tmp_path, capsys):
    import json

    from kvcouple.cli import main as cli_main

    model_dir = tmp_path / "tiny"
    tiny_model("llama", seed=3, vocab_size=VOCAB).save_pretrained(model_dir)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"id": p.id, "input_ids": list(p.input_ids)}) + "\n" for p in _prompts(3)
        )
    )
    argv = ["trace", "--model", str(model_dir), "--prompts", str(prompts), "--out"]
    argv += [str(tmp_path / "run.zarr"), "--policy", "recent:retain=0.5", "--replicates", "2"]
    argv += ["--branches", "2", "--horizon", "8", "--window", "2", "--dry-run", "--device", "cpu"]
    argv += ["--doc-batch", "2", "--record", "full"]
    assert cli_main(argv) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("host memory"))
    layout = StoreLayout(["-"], ["recent:retain=0.5"], 8, 2, 2, 2, VOCAB, Record.parse("full"))
    # Batches of 2 documents: 2 tracing, 2 queued, 1 writing, 1 for the encoder.
    assert f"{host_record_bytes(layout, 2, 2) / 2**20:.1f} MiB at most" in line
    assert "2 tracing, 2 queued" in line
    assert not (tmp_path / "run.zarr").exists()


@pytest.mark.torch
def test_a_run_whose_records_do_not_fit_the_host_is_refused_before_tracing(tmp_path, monkeypatch):
    import kvcouple.tracer.memory as memory

    # Room for one document's records, not for the four a run holds at once.
    layout = StoreLayout(["-"], ["recent:retain=0.5"], 8, 2, 1, 2, VOCAB, Record.parse("full"))
    monkeypatch.setattr(memory, "available_memory", lambda: host_record_bytes(layout, 0, 1))
    model = tiny_model("llama", seed=3, vocab_size=VOCAB)
    settings = TraceSettings(**SETTINGS, record=Record.parse("full"))
    with pytest.raises(memory.FootprintTooLargeError, match="host memory"):
        trace(model, _prompts(2), ["recent:retain=0.5"], settings, tmp_path / "run.zarr")
    assert not (tmp_path / "run.zarr").exists()
