"""Sharded stores (schema version 5, issue 37 point 1): with zarr-python 3 a store of many
documents keeps ``docs_per_shard`` documents of a variable in one Zarr v3 shard (each document
and policy still its own inner chunk). Files per store are O(documents / shard size); plain
xarray reads the same values as from a store of one object per document; the analysis gives
the same numbers; a run stopped or killed mid-shard resumes to an uninterrupted run's store;
a damaged inner chunk is refused naming its document, and only that document is skipped under
``--allow-incomplete``; ``--shard i/N`` parts are whole Zarr shards."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import xarray as xr
import zarr

from kvcouple.analysis import analyze
from kvcouple.cli import main
from kvcouple.errors import StoreError
from kvcouple.store import sharding as sharding_module
from kvcouple.store import writer as writer_module
from kvcouple.store.create import StoreLayout, docs_per_shard
from kvcouple.store.parts import part_documents, parts_overlap
from kvcouple.store.schema import Record
from kvcouple.store.sharding import MAX_DOCS_PER_SHARD
from kvcouple.synth.trace_store import write_synthetic_trace_store

pytestmark = pytest.mark.skipif(
    not hasattr(zarr, "create_array"), reason="sharding is written with zarr-python 3"
)

PAIRS = {
    "a": {"P": np.full((5, 5), 0.2), "Q": np.full((5, 5), 0.2) * 0.7 + 0.3 * np.eye(5), "start": 0},
    "b": {"P": np.full((5, 5), 0.2), "Q": np.full((5, 5), 0.2) * 0.4 + 0.6 * np.eye(5), "start": 1},
}
DOCS = 64  # 4 documents a shard (a sixteenth of the documents)
SETTINGS = {"horizon": 6, "branches": 2, "replicates": 4, "seed": 1}


def synth(path: Path, docs: int = DOCS, **kw) -> Path:
    return write_synthetic_trace_store(path, PAIRS, docs=docs, **SETTINGS, **kw)


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> tuple[Path, Path]:
    """The same run written sharded and with one object per document."""
    root = tmp_path_factory.mktemp("sharding")
    sharded = synth(root / "sharded.zarr")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sharding_module, "_MIN_SHARDS", 10**9)  # one document per object
        plain = synth(root / "plain.zarr")
    return sharded, plain


def files(store: Path) -> int:
    return sum(len(f) for _, _, f in os.walk(store))


def layout(docs: int, record: str = "summary", horizon: int = 64, reps: int = 8) -> StoreLayout:
    ids = [f"d{i}" for i in range(docs)]
    return StoreLayout(ids, ["a", "b"], horizon, 16, 2, reps, 100, Record.parse(record))


def test_documents_per_shard_follow_the_rule():
    assert docs_per_shard(layout(64)) == 4  # a sixteenth of the documents
    assert docs_per_shard(layout(20)) == 1  # few documents: one object each
    assert docs_per_shard(layout(100_000)) == MAX_DOCS_PER_SHARD
    assert docs_per_shard(layout(100_000, "full")) == 1  # megabytes a document already
    # A variable's shard stays under 8 MiB: 2 x 64 x 4096 int32 = 2 MiB a document.
    assert docs_per_shard(layout(100_000, horizon=4096, reps=64)) == 4


def test_parts_are_whole_zarr_shards():
    assert part_documents(10, (1, 2), 3) == [3, 4, 5, 9]
    assert part_documents(4, (1, 2)) == [1, 3]  # one document a shard: i mod N, as before
    assert parts_overlap((0, 2), (0, 4), 40, 4) and parts_overlap((0, 2), (2, 4), 40, 4)
    assert not parts_overlap((0, 2), (1, 4), 40, 4)
    for per_shard in (1, 3, 4):
        for n in (2, 3):
            owners = [
                {d // per_shard for d in part_documents(40, (i, n), per_shard)} for i in range(n)
            ]
            assert set.union(*owners) == set(range(-(-40 // per_shard)))
            assert sum(map(len, owners)) == len(set.union(*owners))  # no shard shared


def test_sharded_store_reads_and_analyses_as_one_object_per_document(stores, tmp_path, capsys):
    sharded, plain = stores
    ds, ref = xr.open_zarr(sharded).load(), xr.open_zarr(plain).load()
    assert ds.identical(ref)
    assert ds.hazard.encoding["shards"][0] == 4 and ds.hazard.encoding["chunks"][:2] == (1, 1)
    assert "shards" not in ref.hazard.encoding or ref.hazard.encoding["shards"] is None
    # 16 shard files a variable instead of 128 (one per document and policy).
    assert len([f for f in os.listdir(sharded / "hazard") if f[0].isdigit()]) == 16
    assert len([f for f in os.listdir(plain / "hazard") if f[0].isdigit()]) == 128
    assert files(sharded) * 3 < files(plain), (files(sharded), files(plain))
    assert main(["info", str(sharded)]) == 0
    out = capsys.readouterr().out
    assert "crc32c on every chunk" in out and "4 documents a stored object (Zarr shards)" in out
    assert main(["info", str(plain)]) == 0
    assert "one stored object per document and policy" in capsys.readouterr().out
    for store, out in ((sharded, "s"), (plain, "p")):
        assert main(["analyze", str(store), "--out", str(tmp_path / out), "--no-figures",
                     "--quiet", "--n-boot", "200"]) == 0  # fmt: skip
    tables = sorted(p.name for p in (tmp_path / "p").glob("*.csv"))
    assert tables
    for name in tables:
        assert (tmp_path / "s" / name).read_text() == (tmp_path / "p" / name).read_text(), name


def test_a_run_stopped_mid_shard_resumes_to_the_uninterrupted_store(stores, tmp_path):
    sharded, _ = stores
    path = tmp_path / "stopped.zarr"
    synth(path, stop_after=6)  # shard 0 whole, shard 1 with 2 of its 4 documents
    done = np.asarray(zarr.open_group(str(path), mode="r")["completed"][...])
    assert done.tolist() == [True] * 6 + [False] * (DOCS - 6)
    synth(path)
    assert xr.open_zarr(path).load().identical(xr.open_zarr(sharded).load())


def test_a_fault_while_writing_a_shard_leaves_its_documents_unfinished(
    stores, tmp_path, monkeypatch
):
    """A write that fails inside a shard (its third variable's file): the shard's documents
    read unfinished (the flags are its last file), the shards before stay done, and a rerun
    completes the store as an uninterrupted run writes it."""
    sharded, _ = stores
    path = tmp_path / "fault.zarr"
    original = writer_module.TraceStoreWriter._write_shard_file
    written: list[tuple[str, int]] = []

    def failing(self, name, k, values):
        if k == 1 and len([w for w in written if w[1] == 1]) == 2:
            raise OSError(f"injected fault writing shard {k} of {name}")
        written.append((name, k))
        return original(self, name, k, values)

    monkeypatch.setattr(writer_module.TraceStoreWriter, "_write_shard_file", failing)
    with pytest.raises(OSError, match="injected fault writing shard 1"):
        synth(path)
    monkeypatch.undo()
    assert ("completed", 0) in written and ("completed", 1) not in written
    done = np.asarray(zarr.open_group(str(path), mode="r")["completed"][...])
    assert done.tolist() == [True] * 4 + [False] * (DOCS - 4)
    synth(path)
    assert xr.open_zarr(path).load().identical(xr.open_zarr(sharded).load())


_WRITE = """
import sys
import numpy as np
from kvcouple.synth.trace_store import write_synthetic_trace_store
pairs = {pairs}
write_synthetic_trace_store(sys.argv[1], pairs, docs={docs}, **{settings})
"""


def test_kill_9_mid_write_resumes_to_the_uninterrupted_store(tmp_path):
    docs = 320  # 20 documents a shard; a few seconds of simulation
    script = _WRITE.format(
        pairs={k: {n: (v.tolist() if isinstance(v, np.ndarray) else v) for n, v in p.items()}
               for k, p in PAIRS.items()},
        docs=docs, settings=SETTINGS,
    )  # fmt: skip
    path, ref = tmp_path / "killed.zarr", tmp_path / "ref.zarr"
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script), str(path)])
    deadline = time.monotonic() + 300
    try:
        while True:  # until some shard is written
            assert proc.poll() is None and time.monotonic() < deadline, "the write ended first"
            if (path / "completed" / "zarr.json").exists():
                done = np.asarray(zarr.open_group(str(path), mode="r")["completed"][...])
                if done.any():
                    break
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    done = np.asarray(zarr.open_group(str(path), mode="r")["completed"][...])
    assert 0 < done.sum() < docs
    assert done.sum() % 20 == 0  # whole shards only
    os.remove(path / ".kvcouple-lock" / "all.json")  # (a stale lock is taken over anyway)
    synth(path, docs=docs)
    synth(ref, docs=docs)
    assert xr.open_zarr(path).load().identical(xr.open_zarr(ref).load())


def _inner_chunk(shard_file: Path, inner: int, count: int) -> tuple[int, int]:
    """Offset and size of inner chunk ``inner`` of a shard (index at the end)."""
    raw = shard_file.read_bytes()
    index = np.frombuffer(raw[-4 - 16 * count : -4], "<u8").reshape(count, 2)
    return int(index[inner, 0]), int(index[inner, 1])


def test_a_damaged_inner_chunk_is_refused_naming_its_document(stores, tmp_path, capsys):
    sharded, _ = stores
    copy = tmp_path / "damaged.zarr"
    import shutil

    shutil.copytree(sharded, copy)
    # Document 5, policy 0: shard 1 (documents 4-7), inner chunk (1, 0) of a (4, 2) grid.
    shard_file = copy / "hazard" / "1.0.0.0"
    offset, size = _inner_chunk(shard_file, 2, 8)
    data = bytearray(shard_file.read_bytes())
    data[offset + size // 2] ^= 0x10
    shard_file.write_bytes(bytes(data))
    pattern = r"document 'doc0005'"
    with pytest.raises(StoreError, match=pattern):
        analyze(copy, n_boot=20)
    result = analyze(copy, n_boot=20, allow_incomplete=True)
    assert [s["doc_id"] for s in result.skipped] == ["doc0005"]
    assert len(result.models[0].docs) == DOCS - 1
    assert main(["info", str(copy), "--check"]) == 1
    assert re.search(pattern, capsys.readouterr().out)


def test_synthetic_documents_do_not_depend_on_their_batch(tmp_path):
    """The synthetic writer simulates 64 documents at once, their uniforms drawn ahead from
    each document's stream: the store equals one simulated a document at a time, drawing call
    by call (and so the stores written before batching). Full records, starts per document."""
    from kvcouple.synth import trace_store

    kw = {"docs": [0, 1, 2, 3, (1, 2)] * 8, "record": "topk:2", "window": 3}
    together = synth(tmp_path / "together.zarr", **kw)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trace_store, "SIMULATED_TOGETHER", 1)
        mp.setattr(trace_store._Streams, "AHEAD_BYTES", 0)
        alone = synth(tmp_path / "alone.zarr", **kw)
    assert xr.open_zarr(together).load().identical(xr.open_zarr(alone).load())


def test_a_shard_held_too_long_is_written_and_completed_later(stores, tmp_path):
    """A slow run writes a shard with the documents it has once the shard was held
    HOLD_SECONDS (here at once: every document), then again as the rest come: each document
    is on disk, flagged, as soon as it is written, and the store equals the uninterrupted one."""
    sharded, _ = stores
    path = tmp_path / "slow.zarr"
    seen: list[int] = []
    original = writer_module.TraceStoreWriter.write_doc

    def write_doc(self, doc, arrays):
        original(self, doc, arrays)
        seen.append(int(np.asarray(zarr.open_group(str(path), mode="r")["completed"][...]).sum()))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sharding_module, "HOLD_SECONDS", -1.0)
        mp.setattr(writer_module.TraceStoreWriter, "write_doc", write_doc)
        synth(path, stop_after=10)
    assert seen == list(range(1, 11))
    synth(path)
    assert xr.open_zarr(path).load().identical(xr.open_zarr(sharded).load())


def test_resuming_a_shard_whose_finished_document_lost_its_chunk_is_refused(tmp_path):
    """Resuming rewrites a shard with its finished documents read back; one whose inner chunk
    the index marks absent would read as fill values and be rewritten as data: refused."""
    import struct

    import google_crc32c

    path = tmp_path / "lost.zarr"
    synth(path, stop_after=6)  # shard 1 holds documents 4 and 5, finished
    shard_file = path / "hazard" / "1.0.0.0"
    raw = shard_file.read_bytes()
    start = len(raw) - 4 - 16 * 8
    entries = list(struct.unpack("<16Q", raw[start:-4]))
    entries[4:6] = [2**64 - 1, 2**64 - 1]  # inner chunk 2 (document 5, policy 0): absent
    index = struct.pack("<16Q", *entries)
    shard_file.write_bytes(raw[:start] + index + struct.pack("<I", google_crc32c.value(index)))
    with pytest.raises(StoreError, match=r"hazard/1\.0\.0\.0 \(inner chunk 2\).*'doc0005'"):
        synth(path)
