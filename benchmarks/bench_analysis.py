"""Analysis throughput at scale, against the floors measured side by side on the same files.

For each size (GB on disk) a synthetic ``full`` store is generated (vocab 128,256, float16,
zstd; see ``make_synthetic_store.py``), then measured in fresh subprocesses (page cache warm
for all, the store was just written or read):

- **analysis**: :func:`kvcouple.analysis.analyze`, recomputing every hazard and branch TV from
  the stored distributions (the Rust store engine), estimates and bootstrap;
- **raw decode floor**: every chunk file of every array read and decompressed with numcodecs
  on all cores, nothing computed ("read everything, compute nothing");
- **zarrs decode floor**: the engine's own decode of every distribution block, nothing computed;
- peak RSS of each (flat across sizes means memory is bounded by chunks, not the store).

Then, on a small store: the analysis from a local S3 server (moto, 127.0.0.1) against the same
store on local disk; and in memory, the TV-only kernel against the plain memory pass (convert
and sum, the speed of light) and against all divergences. ``--codecs`` measures candidate
codecs (ratio, decode GB/s on one thread) on 128k-vocabulary rows and, where a traced store is
given (``--model-store``), on the model's own rows.

    python benchmarks/bench_analysis.py --sizes 1 8 --dir /tmp/kvbench
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def _peak_rss_mb() -> float:
    """Peak resident memory of this process image (VmHWM: ru_maxrss would carry over the
    parent's peak across fork and exec)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _bytes_codecs(meta_file: Path) -> list[object]:
    """An array's byte codecs as numcodecs codecs, in decoding order: the compressor (Zarr
    format 2), or the codecs after ``bytes`` reversed (format 3: crc32c, then zstd)."""
    import numcodecs

    meta = json.loads(meta_file.read_text())
    if meta_file.name == ".zarray":
        return [numcodecs.get_codec(meta["compressor"])] if meta.get("compressor") else []
    if meta.get("node_type") != "array":
        return []
    out: list[object] = []
    for c in reversed(meta["codecs"]):
        config = c.get("configuration", {})
        if c["name"] == "crc32c":
            out.append(numcodecs.CRC32C())  # verified, as every reader does
        elif c["name"] == "zstd":
            out.append(numcodecs.Zstd(level=config.get("level", 1)))
    return out


def raw_decode(store: str, threads: int) -> dict[str, float]:
    """Every chunk file checked and decompressed with its array's codecs (numcodecs), all
    threads."""
    jobs = []
    for meta_file in [*Path(store).glob("*/.zarray"), *Path(store).glob("*/zarr.json")]:
        codecs = _bytes_codecs(meta_file)
        for f in meta_file.parent.iterdir():
            if not f.name.startswith(".") and f.name != "zarr.json":
                jobs.append((f, codecs))
    t, cpu = time.perf_counter(), _cpu_seconds()

    def one(job: tuple[Path, list[object]]) -> int:
        data = job[0].read_bytes()
        for codec in job[1]:
            data = codec.decode(data)  # type: ignore[attr-defined]
        return len(data)

    with ThreadPoolExecutor(threads) as pool:
        decoded = sum(pool.map(one, jobs))
    return {
        "seconds": time.perf_counter() - t,
        "cpu_seconds": _cpu_seconds() - cpu,
        "decoded_bytes": decoded,
        "peak_rss_mb": _peak_rss_mb(),
    }


def zarrs_decode(store: str) -> dict[str, float]:
    """The engine's decode of every distribution block of every document, nothing computed."""
    from kvcouple.store.reader import TraceStoreReader

    r = TraceStoreReader(store)
    t, cpu = time.perf_counter(), _cpu_seconds()
    decoded = 0
    for pn, qn in (("p", "q"), ("branch_p", "branch_q")):
        sels = [
            (d, pol, *sel)
            for d in r.done
            for pol in range(len(r.policies))
            for sel in r.blocks(pn, d, pol)
        ]
        rows = r.rows_tv(pn, qn, sels, decode_only=True)
        assert rows is not None, "the engine cannot read this store"
        decoded += 2 * rows.size * r.array(pn).shape[-1] * r.array(pn).dtype.itemsize
    return {
        "seconds": time.perf_counter() - t,
        "cpu_seconds": _cpu_seconds() - cpu,
        "decoded_bytes": decoded,
        "peak_rss_mb": _peak_rss_mb(),
    }


def run_analysis(store: str, threads: int) -> dict[str, float]:
    import xarray  # noqa: F401  (imports are start-up cost, not throughput)
    import zarr  # noqa: F401

    from kvcouple.analysis import analyze

    t, cpu = time.perf_counter(), _cpu_seconds()
    result = analyze(store, n_boot=200, io_threads=threads)
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


MODES = {"analyze": run_analysis, "raw": raw_decode, "zarrs": lambda s, _t: zarrs_decode(s)}


def _subprocess(mode: str, store: str, threads: int) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, __file__, "--_run", mode, store, "--threads", str(threads)],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _best(mode: str, store: str, threads: int, repeats: int) -> dict[str, float]:
    return min(
        (_subprocess(mode, store, threads) for _ in range(repeats)), key=lambda r: r["seconds"]
    )


def sizes_table(a: argparse.Namespace) -> list[tuple[float, int, dict, dict, dict]]:
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
        raw = _best("raw", str(store), a.threads, a.repeats)
        zs = _best("zarrs", str(store), a.threads, a.repeats)
        an = _best("analyze", str(store), a.threads, a.repeats)
        floor = min(raw["seconds"], zs["seconds"])
        gbs = {k: size / r["seconds"] / 1e9 for k, r in (("raw", raw), ("zarrs", zs), ("an", an))}
        print(
            f"{size / 1e9:6.2f} GB on disk ({an['decoded_bytes'] / 1e9:.2f} GB decoded), "
            f"{a.threads} threads: analysis {gbs['an']:.3f} GB/s; raw decode floor (numcodecs, "
            f"every chunk file) {gbs['raw']:.3f} GB/s; zarrs decode floor {gbs['zarrs']:.3f} GB/s; "
            f"analysis / floor {floor / an['seconds']:.2f} (goal >= 0.7); peak RSS MB: analysis "
            f"{an['peak_rss_mb']:.0f}, raw decode {raw['peak_rss_mb']:.0f}, zarrs decode "
            f"{zs['peak_rss_mb']:.0f}; {an['rows_checked']} rows recomputed, "
            f"{an['disagreements']} disagreements; CPU s/GB analysis "
            f"{an['cpu_seconds'] / (size / 1e9):.2f}, raw decode {raw['cpu_seconds'] / (size / 1e9):.2f}",
            flush=True,
        )
        rows.append((gb, size, an, raw, zs))
    if len(rows) > 1:
        per_gb = [r[2]["seconds"] / (r[1] / 1e9) for r in rows]
        rss = [r[2]["peak_rss_mb"] for r in rows]
        print(
            "analysis seconds per GB: "
            + ", ".join(f"{x:.2f}" for x in per_gb)
            + f" (max/min {max(per_gb) / min(per_gb):.2f}); analysis peak RSS MB: "
            + ", ".join(f"{x:.0f}" for x in rss)
            + f" (max/min {max(rss) / min(rss):.2f}; flat means ~1)"
        )
    return rows


def s3_vs_local(a: argparse.Namespace) -> None:
    sys.path.insert(0, str(HERE))
    from kvcouple.testing.s3 import ServerUnavailable, local_s3
    from make_synthetic_store import make_store, store_bytes

    store = Path(a.dir) / f"full_{a.s3_gb:g}gb.zarr"
    if not store.exists():
        make_store(store, a.s3_gb)
    size = store_bytes(store)
    try:
        with local_s3() as bucket:
            import s3fs

            url = f"{bucket}/bench.zarr"
            t = time.perf_counter()
            s3fs.S3FileSystem().put(str(store), url[5:], recursive=True)
            up = time.perf_counter() - t
            remote = _best("analyze", url, a.threads, a.repeats)
    except ServerUnavailable as e:
        print(f"S3: skipped ({e})")
        return
    local = _best("analyze", str(store), a.threads, a.repeats)
    print(
        f"S3 (moto on 127.0.0.1, zarr-python + s3fs) vs local disk, {size / 1e9:.2f} GB: "
        f"analysis {size / remote['seconds'] / 1e9:.3f} GB/s from S3, "
        f"{size / local['seconds'] / 1e9:.3f} GB/s local; S3 / local time "
        f"{remote['seconds'] / local['seconds']:.2f} (goal <= 2); upload {size / up / 1e9:.3f} GB/s; "
        f"peak RSS MB S3 {remote['peak_rss_mb']:.0f}, local {local['peak_rss_mb']:.0f}",
        flush=True,
    )


def _time(fn, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def kernels_in_memory(a: argparse.Namespace) -> None:
    import torch

    import kvcouple

    sys.path.insert(0, str(HERE))
    from make_synthetic_store import _distributions

    p, q = _distributions(torch.Generator().manual_seed(1), a.rows)
    gb = 2 * p.nbytes / 1e9
    tv = _time(lambda: kvcouple.total_variation(p, q))
    plain = _time(lambda: kvcouple.plain_pass(p, q))
    allq = _time(lambda: kvcouple.divergences(p, q, renormalize=True))
    print(
        f"in memory, {a.rows} rows x 128,256 float16 ({gb:.2f} GB): TV-only "
        f"{gb / tv:.2f} GB/s, plain memory pass {gb / plain:.2f} GB/s, all divergences "
        f"{gb / allq:.2f} GB/s; TV-only / plain pass time {tv / plain:.2f} (goal <= 2), "
        f"all divergences / TV-only {allq / tv:.2f}",
        flush=True,
    )


CODECS = {
    "none": None,
    "zstd-1": ("Zstd", {"level": 1}),
    "zstd-3": ("Zstd", {"level": 3}),
    "blosc-lz4-shuffle": ("Blosc", {"cname": "lz4", "clevel": 5, "shuffle": 1}),
    "blosc-zstd-1-shuffle": ("Blosc", {"cname": "zstd", "clevel": 1, "shuffle": 1}),
    "blosc-zstd-3-bitshuffle": ("Blosc", {"cname": "zstd", "clevel": 3, "shuffle": 2}),
    "gzip-1": ("GZip", {"level": 1}),
}


def codec_table(rows: np.ndarray, label: str) -> None:
    import numcodecs

    raw = np.ascontiguousarray(rows).tobytes()
    print(f"codecs on {label} ({len(raw) / 1e6:.0f} MB raw, one thread):")
    for name, spec in CODECS.items():
        if spec is None:
            print(f"  {name:24s} ratio 1.00")
            continue
        codec = getattr(numcodecs, spec[0])(**spec[1])
        enc = codec.encode(raw)
        t = _time(lambda c=codec, e=enc: c.decode(e), 3)
        print(
            f"  {name:24s} ratio {len(raw) / len(enc):.2f}  decode {len(raw) / t / 1e9:.2f} GB/s raw"
        )


def codecs(a: argparse.Namespace) -> None:
    import torch

    sys.path.insert(0, str(HERE))
    from make_synthetic_store import _distributions

    p, _ = _distributions(torch.Generator().manual_seed(2), 128)
    codec_table(p, "synthetic 128k-vocabulary rows")
    if a.model_store:
        import zarr

        g = zarr.open_group(a.model_store, mode="r")
        rows = np.asarray(g["p"][...])
        rows = rows[np.isfinite(rows).all(-1)]
        codec_table(rows, f"the model's rows from {a.model_store}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=float, nargs="*", default=[1.0, 8.0], help="GB on disk")
    ap.add_argument("--dir", default="/tmp/kvbench")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--repeats", type=int, default=2, help="best of this many runs of each")
    ap.add_argument("--s3-gb", type=float, default=0.25, help="size of the S3 comparison (0: skip)")
    ap.add_argument("--rows", type=int, default=256, help="rows of the in-memory kernel test")
    ap.add_argument("--codecs", action="store_true", help="also measure candidate codecs")
    ap.add_argument("--model-store", default=None, help="a traced full store for --codecs")
    ap.add_argument("--keep", action="store_true", help="keep the generated stores")
    ap.add_argument("--_run", nargs=2, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a._run:
        mode, store = a._run
        print(json.dumps(MODES[mode](store, a.threads)))
        return 0
    Path(a.dir).mkdir(parents=True, exist_ok=True)
    kernels_in_memory(a)
    if a.codecs:
        codecs(a)
    if a.s3_gb > 0:
        s3_vs_local(a)
    sizes_table(a)
    if not a.keep:
        shutil.rmtree(a.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
