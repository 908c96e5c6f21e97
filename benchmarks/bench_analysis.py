"""Analysis throughput at scale: ``kvcouple analyze`` vs plain Zarr decoding of the same store.

For each size (GB on disk) a synthetic ``full`` store is generated (vocab 128,256, float16,
zstd; see ``make_synthetic_store.py``), then measured in fresh subprocesses:

- **plain decode**: read every chunk of every variable through Zarr and discard it ("read
  everything, compute nothing"), with 1 and with N reader threads; the faster is the baseline;
- **analysis**: :func:`kvcouple.analysis.analyze` with recomputation of every hazard and branch
  TV from the stored distributions (the Rust kernel), estimates and bootstrap.

Throughput is bytes on disk / wall seconds. Prints GB/s, the ratio analysis / plain decode
(target >= 0.70), peak RSS of each subprocess, and seconds per GB across sizes (linear time,
flat memory). The page cache is warm for both (the store was just written or read).

    python benchmarks/bench_analysis.py --sizes 1 8 --dir /tmp/kvbench
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from itertools import product
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _cpu_seconds() -> float:
    """User + system CPU time of this process, all threads (robust to a shared machine)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def plain_decode(store: str, threads: int) -> dict[str, float]:
    import xarray  # noqa: F401  (as the analysis: imported before the clock starts)
    import zarr

    group = zarr.open_group(store, mode="r")
    jobs = []
    for name in group.array_keys():
        arr = group[name]
        grid = [range(0, n, c) for n, c in zip(arr.shape, arr.chunks, strict=True)]
        for starts in product(*grid):
            jobs.append(
                (arr, tuple(slice(s, s + c) for s, c in zip(starts, arr.chunks, strict=True)))
            )
    t, cpu = time.perf_counter(), _cpu_seconds()
    decoded = 0
    with ThreadPoolExecutor(threads) as pool:
        for nbytes in pool.map(lambda j: j[0][j[1]].nbytes, jobs):
            decoded += nbytes
    return {
        "seconds": time.perf_counter() - t,
        "cpu_seconds": _cpu_seconds() - cpu,
        "decoded_bytes": decoded,
        "peak_rss_mb": _peak_rss_mb(),
    }


def run_analysis(store: str, io_threads: int) -> dict[str, float]:
    import xarray  # noqa: F401  (imports are start-up cost, not throughput; decode pays them too)
    import zarr  # noqa: F401

    from kvcouple.analysis import analyze

    t, cpu = time.perf_counter(), _cpu_seconds()
    result = analyze(store, n_boot=200, io_threads=io_threads)
    seconds, cpu = time.perf_counter() - t, _cpu_seconds() - cpu
    checks = [d.check for d in result.models[0].docs]
    return {
        "seconds": seconds,
        "cpu_seconds": cpu,
        "decoded_bytes": sum(c.bytes_read for c in checks),
        "rows_checked": sum(c.rows_checked for c in checks),
        "disagreements": len(result.checks()),
        "peak_rss_mb": _peak_rss_mb(),
    }


def _subprocess(mode: str, store: str, threads: int) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, __file__, f"--_{mode}", store, "--threads", str(threads)],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=float, nargs="+", default=[1.0, 8.0], help="GB on disk")
    ap.add_argument("--dir", default="/tmp/kvbench")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--repeats", type=int, default=2, help="alternating runs of each")
    ap.add_argument("--_decode", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_analyze", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a._decode:
        print(json.dumps(plain_decode(a._decode, a.threads)))
        return 0
    if a._analyze:
        print(json.dumps(run_analysis(a._analyze, a.threads)))
        return 0

    sys.path.insert(0, str(HERE))
    from make_synthetic_store import make_store, store_bytes

    rows = []
    for gb in a.sizes:
        store = Path(a.dir) / f"full_{gb:g}gb.zarr"
        if not store.exists():
            t = time.perf_counter()
            make_store(store, gb)
            print(f"generated {store} in {time.perf_counter() - t:.0f} s", flush=True)
        size = store_bytes(store)
        # Alternate the two (the machine may be shared) and keep each one's best run.
        decodes, analyses = [], []
        for _ in range(a.repeats):
            decodes += [_subprocess("decode", str(store), n) for n in sorted({1, a.threads})]
            analyses.append(_subprocess("analyze", str(store), a.threads))
        decode = min(decodes, key=lambda r: r["seconds"])
        analysis = min(analyses, key=lambda r: r["seconds"])
        d_gbs, a_gbs = size / decode["seconds"] / 1e9, size / analysis["seconds"] / 1e9
        rows.append((gb, size, decode, analysis, d_gbs, a_gbs))
        print(
            f"{size / 1e9:6.2f} GB on disk ({decode['decoded_bytes'] / 1e9:.2f} GB decoded): "
            f"plain decode {d_gbs:.3f} GB/s ({decode['seconds']:.1f} s, peak RSS "
            f"{decode['peak_rss_mb']:.0f} MB); analysis {a_gbs:.3f} GB/s "
            f"({analysis['seconds']:.1f} s, peak RSS {analysis['peak_rss_mb']:.0f} MB, "
            f"{analysis['rows_checked']} rows recomputed, {analysis['disagreements']} "
            f"disagreements); ratio {a_gbs / d_gbs:.2f}; CPU seconds per GB: decode "
            f"{decode['cpu_seconds'] / (size / 1e9):.2f}, analysis "
            f"{analysis['cpu_seconds'] / (size / 1e9):.2f} (CPU ratio "
            f"{decode['cpu_seconds'] / analysis['cpu_seconds']:.2f})",
            flush=True,
        )
    if len(rows) > 1:
        per_gb = [r[3]["seconds"] / (r[1] / 1e9) for r in rows]
        print(
            "analysis seconds per GB: "
            + ", ".join(f"{x:.2f}" for x in per_gb)
            + f" (max/min {max(per_gb) / min(per_gb):.2f}; linear time means ~1)"
        )
        rss = [r[3]["peak_rss_mb"] for r in rows]
        print("analysis peak RSS MB: " + ", ".join(f"{x:.0f}" for x in rss))
    return 0


if __name__ == "__main__":
    sys.exit(main())
