"""Summary stores of many documents for ``bench_analysis.py --docs``: each function is one mode
run in its own process (written by the synthetic writer, read by the engine, analysed), so its
peak memory is its own."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from measure import cpu_seconds, peak_rss_mb


def summary_pairs() -> dict[str, dict[str, object]]:
    """Two synthetic Markov pairs (vocabulary 6) standing for two policies."""
    rng = np.random.default_rng(0)
    vocab = 6
    P = rng.dirichlet(np.ones(vocab), size=vocab)

    def towards(w: float) -> np.ndarray:
        return (1 - w) * P + w * rng.dirichlet(np.ones(vocab) * 0.3, size=vocab)

    return {
        "snapkv:retain=0.5": {"P": P, "Q": towards(0.15), "start": 0},
        "recent:retain=0.5": {"P": P, "Q": towards(0.3), "start": 0},
    }


def write_summary_store(store: str, threads: int) -> dict[str, float]:
    """A summary store of ``docs`` documents x 2 policies (T=64, R=8, K=2, L=T), every
    document simulated (its own start state and stream) and written by the synthetic writer
    (``kvcouple synth trace-store``: the tracer's store writer)."""
    from kvcouple.synth.trace_store import write_synthetic_trace_store

    docs = int(Path(store).name.split("_")[1].split(".")[0])
    t, cpu = time.perf_counter(), cpu_seconds()
    write_synthetic_trace_store(
        store, summary_pairs(), horizon=64, window=64, branches=2, replicates=8,
        docs=[d % 6 for d in range(docs)], seed=1,
    )  # fmt: skip
    seconds = time.perf_counter() - t
    return {
        "seconds": seconds,
        "cpu_seconds": cpu_seconds() - cpu,
        "units_per_second": 2 * docs / seconds,
        "peak_rss_mb": peak_rss_mb(),
    }


def store_footprint(store: Path) -> dict[str, float]:
    """Files, bytes on disk (file-system blocks) and bytes of data (every array's values)."""
    import zarr

    files, on_disk = 0, 0
    for root, _, names in os.walk(store):
        for name in names:
            files += 1
            on_disk += os.stat(os.path.join(root, name)).st_blocks * 512
    group = zarr.open_group(str(store), mode="r")
    data = sum(a.nbytes for _, a in group.arrays())
    return {"files": files, "bytes_on_disk": on_disk, "bytes_of_data": data}


def run_summary_analysis(store: str, threads: int) -> dict[str, float]:
    """:func:`kvcouple.analysis.analyze` with its defaults (2000 resamples, studentized)."""
    import xarray  # noqa: F401  (imports are start-up cost, not throughput)
    import zarr  # noqa: F401

    from kvcouple.analysis import analyze

    t, cpu = time.perf_counter(), cpu_seconds()
    result = analyze(store, recompute=False)
    seconds = time.perf_counter() - t
    return {
        "seconds": seconds,
        "cpu_seconds": cpu_seconds() - cpu,
        "documents": len(result.models[0].docs),
        "peak_rss_mb": peak_rss_mb(),
    }


def engine_summary_read(store: str, threads: int) -> dict[str, float]:
    """The engine's read of everything the analysis reads of the store: its open (metadata,
    coordinates, completion flags) and every document's summary variables with the
    scoreboard's ``top1_agree`` (decoded and checked, in the analysis's batches: 256
    documents, a shard's), nothing computed."""
    from kvcouple.analysis.reading import SUMMARY_READ
    from kvcouple.analysis.tasks import AGREEMENT, SUMMARY_BATCH
    from kvcouple.store.reader import TraceStoreReader

    t, cpu = time.perf_counter(), cpu_seconds()
    r = TraceStoreReader(store)
    done = r.done
    for i in range(0, len(done), SUMMARY_BATCH):
        got = r.read_summaries(done[i : i + SUMMARY_BATCH], (*SUMMARY_READ, AGREEMENT))
        assert got is not None, "the engine cannot read this store"
    return {
        "seconds": time.perf_counter() - t,
        "cpu_seconds": cpu_seconds() - cpu,
        "documents": len(done),
        "peak_rss_mb": peak_rss_mb(),
    }
