"""``trace(..., client=)`` and ``kvcouple trace --scheduler`` on a Dask ``LocalCluster`` of two
worker processes (one thread each) with the embedded model: the store equals a single
process's array by array (local and ``s3://``), a worker killed mid-run and an interrupted
client both end in the same store, each worker loads the model once per run, and an address
nobody listens on fails in seconds.

Marked ``dask`` (select with ``-m dask``): the cluster's processes each import torch, which
is CPU-heavy on a small machine.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

pytest.importorskip("distributed")
torch = pytest.importorskip("torch")

import cloudpickle  # noqa: E402
from distributed import Client, LocalCluster, WorkerPlugin  # noqa: E402

from kvcouple.cli import main as cli_main  # noqa: E402
from kvcouple.models import default_prompts_path, load_model  # noqa: E402
from kvcouple.policies import parse_policy  # noqa: E402
from kvcouple.testing.s3 import ServerUnavailable, local_s3  # noqa: E402
from kvcouple.tracer import TraceSettings, load_prompts, trace  # noqa: E402
from kvcouple.tracer.distributed import (  # noqa: E402
    WorkerInfo,
    WorkerModel,
    check_fits,
    format_workers,
    gpu_resources,
    run_budget,
)
from kvcouple.tracer.memory import FootprintTooLargeError, human, loaded_footprints  # noqa: E402
from kvcouple.tracer.planner import document_batches  # noqa: E402

pytestmark = [pytest.mark.dask, pytest.mark.torch]

POLICIES = ["snapkv:retain=0.5", "recent:retain=0.5"]
KW = {"seed": 3, "model_id": "kvcouple-default", "progress": False}
# Two documents a batch, so a lost task leaves a batch half done.
SMALL = TraceSettings(horizon=4, replicates=2, branches=1, window=2, doc_batch=2)
LONG = TraceSettings(horizon=24, replicates=4, branches=2, window=4, doc_batch=2)


@pytest.fixture(scope="module")
def model_and_prompts():
    old = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers (Dask gives each worker process one thread)
    model, tokenizer = load_model(None, device="cpu")
    yield model, load_prompts(default_prompts_path(), tokenizer)
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def bucket():
    """``s3://...`` of a moto server, or None; started before the cluster so that the
    workers inherit its endpoint and credentials."""
    try:
        with local_s3() as url:
            yield url
    except ServerUnavailable:
        yield None


@pytest.fixture(scope="module")
def client(bucket):
    with (
        LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as cluster,
        Client(cluster) as c,
    ):
        yield c


def arrays(store):
    import zarr

    group = zarr.open_group(str(store), mode="r")
    return {name: np.asarray(a[...]) for name, a in group.arrays()}, dict(group.attrs)


def assert_same_store(a, b):
    """Every array and attribute of two stores equal (NaN where NaN)."""
    arr_a, attrs_a = arrays(a)
    arr_b, attrs_b = arrays(b)
    assert sorted(arr_a) == sorted(arr_b)
    assert attrs_a == attrs_b
    for name in arr_a:
        assert arr_a[name].dtype == arr_b[name].dtype, name
        np.testing.assert_array_equal(arr_a[name], arr_b[name], err_msg=name)
    assert arr_a["completed"].all()


def _batch_needs(model, prompts, settings):
    """Each document batch of a run (by document id) and its plan's peak, as the client
    forms them before submitting."""
    docs = [(p.id, len(p.input_ids)) for p in prompts]
    plans = dict(
        enumerate(loaded_footprints(model, docs, [parse_policy(p) for p in POLICIES], settings))
    )
    batches = document_batches(list(plans), plans, settings)
    return plans, {
        tuple(plans[d].doc_id for d in b): sum(plans[d].peak for d in b) for b in batches
    }


def test_two_workers_equal_one_process_local_and_s3(
    model_and_prompts, client, bucket, tmp_path, monkeypatch
):
    import kvcouple.tracer.cluster as cluster_module

    model, prompts = model_and_prompts
    prompts = prompts[:4]
    start = time.perf_counter()
    ref = trace(model, prompts, POLICIES, SMALL, tmp_path / "ref.zarr", **KW)
    one = time.perf_counter() - start
    bars = []

    class Bar(cluster_module.tqdm):  # the client's progress bars, recorded
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            bars.append(self)

    monkeypatch.setattr(cluster_module, "tqdm", Bar)
    start = time.perf_counter()
    run = trace(
        model, prompts, POLICIES, SMALL, tmp_path / "dask.zarr", client=client,
        **{**KW, "progress": True},
    )  # fmt: skip
    two = time.perf_counter() - start
    # One bar on the client, over documents x policies, full at the end.
    assert [(b.total, b.n, b.unit) for b in bars] == [(4 * len(POLICIES),) * 2 + ("doc-policy",)]
    print(f"one process {one:.2f} s, two workers {two:.2f} s (setup and model loads included)")
    assert run.traced == ref.traced == [0, 1, 2, 3]
    assert run.generated_tokens == ref.generated_tokens
    assert run.occurrence == pytest.approx(ref.occurrence, abs=1e-12)
    # Each worker loaded the model once in this run (the setup's worker too, only once).
    assert sorted(run.model_loads.values()) == [1, 1], run.model_loads
    assert_same_store(tmp_path / "ref.zarr", tmp_path / "dask.zarr")
    # Rerunning finds the store done; the next run loads again, once a worker.
    again = trace(model, prompts, POLICIES, SMALL, tmp_path / "dask.zarr", client=client, **KW)
    assert again.traced == [] and again.skipped == 4
    if bucket is None:
        pytest.skip("no local S3 server (moto[server], s3fs)")
    spec = WorkerModel.of(model)
    url = f"{bucket}/dask.zarr"
    remote = trace(spec, prompts, POLICIES, SMALL, url, client=client, **KW)
    assert remote.traced == [0, 1, 2, 3]
    assert sorted(remote.model_loads.values()) == [1, 1], remote.model_loads
    assert_same_store(tmp_path / "ref.zarr", url)


def test_two_workers_write_a_sharded_store_equal_to_one_process(
    model_and_prompts, client, tmp_path
):
    """48 documents: 3 a Zarr shard. Tasks are whole shards (batches of 2 documents that share
    a shard run as one task), so the two workers never write the same stored object."""
    import dataclasses

    import xarray as xr

    from kvcouple.tracer.cluster import _shard_groups

    model, prompts = model_and_prompts
    many = [dataclasses.replace(prompts[i % len(prompts)], id=f"doc{i}") for i in range(48)]
    ref = trace(model, many, POLICIES, SMALL, tmp_path / "ref.zarr", **KW)
    run = trace(model, many, POLICIES, SMALL, tmp_path / "dask.zarr", client=client, **KW)
    assert run.traced == ref.traced == list(range(48))
    assert sorted(run.model_loads.values()) == [1, 1], run.model_loads
    assert_same_store(tmp_path / "ref.zarr", tmp_path / "dask.zarr")
    assert xr.open_zarr(tmp_path / "dask.zarr").hazard.encoding["shards"][0] == 3
    # The grouping itself: batches sharing a shard go together, others apart.
    assert _shard_groups([[0, 1], [2, 3], [4, 5], [6, 7]], 3) == [[0, 1, 2], [3]]
    assert _shard_groups([[0, 1], [2], [3, 4]], 1) == [[0], [1], [2]]


class KillAfterDocument(WorkerPlugin):
    """On the workers: the worker that writes document ``doc`` is killed (SIGKILL) right after
    that document's ``completed`` flag, once in the cluster's life (``marker``): the rest of
    its batch is not written and the task's result never reaches the client."""

    name = "kvcouple-test-kill-after-document"

    def __init__(self, marker: str, doc: int) -> None:
        self.marker = marker
        self.doc = doc

    def setup(self, worker) -> None:
        from kvcouple.store.writer import TraceStoreWriter

        self.original = original = TraceStoreWriter.write_doc
        marker, victim = self.marker, self.doc

        def write_doc(writer, doc, arrays):
            original(writer, doc, arrays)
            if doc != victim:
                return
            try:  # once only, whichever worker (a replacement too) writes it again
                fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                return
            os.write(fd, f"{doc} {os.getpid()}".encode())
            os.close(fd)
            os.kill(os.getpid(), signal.SIGKILL)  # its nanny starts a new worker

        TraceStoreWriter.write_doc = write_doc

    def teardown(self, worker) -> None:
        from kvcouple.store.writer import TraceStoreWriter

        TraceStoreWriter.write_doc = self.original


def test_worker_killed_after_its_first_document_ends_in_the_same_store(
    model_and_prompts, client, tmp_path
):
    """The worker tracing the batch of documents 0 and 1 dies after writing document 0. The
    lost task is retried: its batch is traced again, document 0 kept (and counted once in the
    summary), document 1 written."""
    model, prompts = model_and_prompts
    prompts = prompts[:4]
    _, needs = _batch_needs(model, prompts, SMALL)
    assert tuple(p.id for p in prompts[:2]) in needs  # a batch of two: the kill halves it
    ref, out = tmp_path / "ref.zarr", tmp_path / "killed.zarr"
    one = trace(model, prompts, POLICIES, SMALL, ref, **KW)
    marker = tmp_path / "killed"
    # The plugin's class travels by value (workers need not import the test module).
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    before = set(client.scheduler_info()["workers"])
    client.register_plugin(KillAfterDocument(str(marker), 0))
    try:
        run = trace(model, prompts, POLICIES, SMALL, out, client=client, **KW)
    finally:
        client.unregister_worker_plugin(KillAfterDocument.name)
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
        client.wait_for_workers(2, timeout=120)  # the replacement, for the next tests
    doc, pid = map(int, marker.read_text().split())
    print(f"killed worker pid {pid} after document {doc}")
    assert doc == 0
    assert pid not in client.run(os.getpid).values()
    assert set(client.scheduler_info()["workers"]) != before  # one worker was replaced
    assert sorted(run.traced) == [0, 1, 2, 3]  # the killed worker's document counted once
    assert run.generated_tokens == one.generated_tokens
    assert run.occurrence == pytest.approx(one.occurrence, abs=1e-12)
    assert_same_store(ref, out)
    assert set(run.model_loads.values()) <= {0, 1}, run.model_loads  # once a worker at most


def test_interrupted_client_reruns_to_the_same_store(model_and_prompts, client, tmp_path):
    import zarr

    model, prompts = model_and_prompts
    docs = tmp_path / "docs.jsonl"
    # Five batches: when the client stops, at most the two running ones still finish.
    lines = [json.dumps({"id": p.id, "input_ids": list(p.input_ids)}) for p in prompts[:10]]
    docs.write_text("\n".join(lines) + "\n")
    args = ["trace", "--prompts", str(docs), "--quiet", "--seed", "3", "--device", "cpu"]
    args += [x for p in POLICIES for x in ("--policy", p)]
    args += ["--horizon", "24", "--replicates", "4", "--branches", "2", "--window", "4"]
    args += ["--doc-batch", "2"]
    out = tmp_path / "interrupted.zarr"
    address = client.scheduler.address
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvcouple.cli", *args, "--out", str(out), "--scheduler", address],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            if np.asarray(zarr.open_group(str(out), mode="r")["completed"][...]).any():
                break
        except Exception:  # the store is not there yet
            pass
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    _drain(client)  # tasks already running when the client left still finish
    finished = np.asarray(zarr.open_group(str(out), mode="r")["completed"][...])
    print(f"interrupted (exit {proc.returncode}) with {finished.sum()} of 10 documents done")
    assert not finished.all(), "the run finished before it was interrupted"
    assert proc.returncode != 0, err.decode()
    assert cli_main([*args, "--out", str(out), "--scheduler", address]) == 0
    ref = tmp_path / "ref.zarr"
    assert cli_main([*args, "--out", str(ref)]) == 0
    assert_same_store(ref, out)


def _drain(client, timeout: float = 120) -> None:
    """Wait until no worker runs a task."""
    deadline = time.monotonic() + timeout
    while any(client.processing().values()) and time.monotonic() < deadline:
        time.sleep(0.1)


def test_unreachable_scheduler_fails_in_seconds(tmp_path, capsys):
    start = time.monotonic()
    code = cli_main(
        ["trace", "--policy", "full", "--out", str(tmp_path / "x.zarr"),
         "--scheduler", "tcp://127.0.0.1:1"]
    )  # fmt: skip
    elapsed = time.monotonic() - start
    err = capsys.readouterr().err.strip()
    assert code != 0 and elapsed < 15, (code, elapsed)
    assert len(err.splitlines()) == 1 and "not reachable" in err, err
    assert not (tmp_path / "x.zarr").exists()


def test_a_batch_the_device_cannot_hold_fails_with_the_plans_figure(model_and_prompts, monkeypatch):
    """A worker checks a batch against its device's free memory before tracing it; off CUDA
    there is no figure, so the budget is set here."""
    import kvcouple.tracer.distributed as distributed

    model, prompts = model_and_prompts
    docs = [(p.id, len(p.input_ids)) for p in prompts[:2]]
    plans = loaded_footprints(model, docs, [parse_policy(p) for p in POLICIES], SMALL)
    need = sum(p.peak for p in plans)
    monkeypatch.setattr(distributed, "device_budget", lambda device: need - 1)
    with pytest.raises(FootprintTooLargeError, match=r"needs .*MiB at its peak"):
        check_fits(plans, model)
    monkeypatch.setattr(distributed, "device_budget", lambda device: need)
    check_fits(plans, model)  # exactly the plan's figure fits


def test_gpu_workers_take_one_batch_each_and_refuse_one_beyond_their_memory(
    model_and_prompts, tmp_path, monkeypatch
):
    """Workers that declare ``GPU=1`` (``dask-cuda``'s do): each batch task asks for one, and
    the run equals one process's. A worker whose device has less free than a batch's plan
    fails that task with the plan's figure (a FootprintTooLargeError, no tracing, no out-of-memory),
    and the run stops with nothing written. The worker is a thread of this process, so that
    its device's free memory can be set here (off CUDA it is not known)."""
    import zarr

    import kvcouple.tracer.distributed as distributed

    model, prompts = model_and_prompts
    prompts = prompts[:4]
    plans, needs = _batch_needs(model, prompts, SMALL)
    assert len(needs) > 1, needs
    with (
        LocalCluster(
            n_workers=1, threads_per_worker=2, processes=False, resources={"GPU": 1},
            dashboard_address=":0",
        ) as cluster,
        Client(cluster) as gpu,
    ):  # fmt: skip
        assert gpu_resources(gpu) == {"GPU": 1}
        one = trace(model, prompts, POLICIES, SMALL, tmp_path / "ref.zarr", **KW)
        run = trace(model, prompts, POLICIES, SMALL, tmp_path / "gpu.zarr", client=gpu, **KW)
        assert run.traced == one.traced == [0, 1, 2, 3]
        assert_same_store(tmp_path / "ref.zarr", tmp_path / "gpu.zarr")
        # Free memory below the smaller batch's plan: the first task to run fails for good.
        free = min(needs.values()) - 1
        monkeypatch.setattr(distributed, "device_budget", lambda device: free)
        with pytest.raises(FootprintTooLargeError) as refused:
            trace(model, prompts, POLICIES, SMALL, tmp_path / "small.zarr", client=gpu, **KW)
    message = str(refused.value)
    assert f"has {human(free)} free for a batch" in message, message
    assert any(
        f"needs {human(need)} at its peak" in message and all(repr(i) in message for i in ids)
        for ids, need in needs.items()
    ), (message, needs)
    done = np.asarray(zarr.open_group(str(tmp_path / "small.zarr"), mode="r")["completed"][...])
    assert not done.any()


def test_gpu_resources_only_where_every_worker_declares_one(client):
    assert gpu_resources(client) is None  # the plain cluster: threads decide, no resource


def test_the_plan_per_worker_names_the_batches_a_smaller_device_cannot_take(model_and_prompts):
    model, prompts = model_and_prompts
    plans, needs = _batch_needs(model, prompts[:6], SMALL)
    batches = document_batches(list(plans), plans, SMALL)
    small = sorted(needs.values())[len(needs) // 2]  # fits the smaller half of the batches
    gib = 2**30
    infos = {
        "tcp://10.0.0.1:1": WorkerInfo("cuda:0 (big)", 80 * gib, 70 * gib),
        "tcp://10.0.0.2:1": WorkerInfo("cuda:0 (small)", small + gib, small),
    }
    text = format_workers(infos, batches, plans).splitlines()
    n = len(batches)
    assert text[0] == f"workers: 2; {n} batches, about {n / 2:.1f} each"
    assert text[1] == (
        f"  tcp://10.0.0.1:1: cuda:0 (big), free {human(80 * gib)}, for a batch "
        f"{human(70 * gib)}: fits {n} of {n} batches"
    )
    fits = sum(need <= small for need in needs.values())
    assert 0 < fits < n
    assert text[2] == (
        f"  tcp://10.0.0.2:1: cuda:0 (small), free {human(small + gib)}, for a batch "
        f"{human(small)}: fits {fits} of {n} batches (the others would fail on this worker)"
    )
    assert run_budget(infos.values()) == small  # what the run plans its batches with


def test_dry_run_prints_the_plan_per_worker(client, tmp_path, capsys):
    address = client.scheduler.address
    args = ["trace", "--policy", "snapkv:retain=0.5", "--horizon", "4", "--replicates", "2"]
    args += ["--doc-batch", "2", "--out", str(tmp_path / "dry.zarr"), "--dry-run"]
    assert cli_main([*args, "--scheduler", address]) == 0
    out = capsys.readouterr().out
    workers = client.scheduler_info()["workers"]
    assert len(workers) == 2
    batches = int(out.split("document batches: ")[1].split(" ")[0])
    assert f"workers: 2; {batches} batches, about {batches / 2:.1f} each" in out
    for address in workers:  # each worker's device, memory and the batches it can take
        line = next(x for x in out.splitlines() if x.strip().startswith(address))
        assert "cpu, free memory not known (no limit)" in line
        assert f"fits {batches} of {batches} batches" in line
    assert not (tmp_path / "dry.zarr").exists()


def test_half_written_document_is_retraced_and_bad_resume_refused(
    model_and_prompts, client, tmp_path
):
    import zarr

    from kvcouple.errors import StoreError

    model, prompts = model_and_prompts
    prompts = prompts[:4]
    ref, out = tmp_path / "ref.zarr", tmp_path / "half.zarr"
    trace(model, prompts, POLICIES, SMALL, ref, **KW)
    first = trace(model, prompts, POLICIES, SMALL, out, client=client, max_docs=3, **KW)
    assert first.traced == [0, 1, 2]
    group = zarr.open_group(str(out), mode="r+")
    group["tokens"][1] = 99  # written, but its completed flag never set: a worker died here
    group["completed"][1] = False
    again = trace(model, prompts, POLICIES, SMALL, out, client=client, **KW)
    assert again.traced == [1, 3] and again.skipped == 2
    assert_same_store(ref, out)
    # Resuming with another seed is refused by the setup task, with the store's own error.
    with pytest.raises(StoreError, match="seed"):
        trace(model, prompts, POLICIES, SMALL, out, client=client, **{**KW, "seed": 4})


def test_a_plugin_file_with_a_scheduler_is_refused_by_name(client, tmp_path, capsys):
    plugin = tmp_path / "my_policies.py"
    plugin.write_text("")
    args = ["trace", "--policy", "full", "--out", str(tmp_path / "p.zarr")]
    args += ["--plugin", str(plugin), "--scheduler", client.scheduler.address]
    assert cli_main(args) != 0
    err = capsys.readouterr().err
    assert "workers' PYTHONPATH" in err and "--plugin my_policies" in err, err
    assert not (tmp_path / "p.zarr").exists()
