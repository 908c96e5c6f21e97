"""Analysis throughput at scale, against the floors measured side by side on the same files.

For each size (GB on disk) a synthetic ``full`` store is generated (vocab 128,256, float16,
zstd + crc32c; see ``make_synthetic_store.py``), then measured in fresh subprocesses (page
cache warm for all, the store was just written or read):

- **CLI end to end**: ``kvcouple analyze STORE --out DIR --no-figures --quiet`` as a user runs
  it (start-up, imports, validation, recomputation, estimates, bootstrap, tables), timed from
  outside the process;
- **analysis**: :func:`kvcouple.analysis.analyze` in a process whose imports are done;
- **engine only**: the Rust store engine's recomputation of every hazard and branch TV
  (decode, checksum, value checks and TV of every block), nothing else;
- **raw decode floor**: every chunk file of every array read and decompressed with numcodecs
  on all cores, nothing computed ("read everything, compute nothing");
- **engine decode floor**: the engine's own decode of every distribution block, nothing
  computed;
- the **fixed cost**: the CLI on one-document stores (summary and full records), beside Python
  starting and importing numpy alone (and numpy with zarr-python);
- peak RSS of each (flat across sizes means memory is bounded by chunks, not the store).

Ratios are against the decode floor (the faster of the two decoders) measured in the same
run: 1.0 means the analysis costs no more than reading the store. On a shared machine, the
CPU-seconds ratio is the steadier one.

Then, on a small store: the analysis from a local S3 server (moto, 127.0.0.1) against the same
store on local disk; and in memory, the TV-only kernel against the plain memory pass (convert
and sum, the speed of light) and against all divergences. ``--codecs`` measures candidate
codecs (ratio, decode GB/s on one thread) on 128k-vocabulary rows and, where a traced store is
given (``--model-store``), on the model's own rows.

    python benchmarks/bench_analysis.py --sizes 1.5 8 --dir /tmp/kvbench

``--docs N [N ...]`` instead measures stores of many documents: for each N a summary store of
N documents x 2 policies (T=64, R=8, K=2, branches to the horizon), every document simulated
and written by ``kvcouple synth trace-store``'s writer (the tracer's: sharded, schema version
5), then analysed with the default settings (2000 resamples, studentized intervals) against the
engine's read of the same store (everything the analysis reads: the store's open with its
completion flags, every document's summary variables and the scoreboard's ``top1_agree``,
decoded and checked, nothing computed: the read floor). Printed per N: files, bytes on disk (file-system blocks)
over bytes of data, write units (document, policy) per second, the read's and the analysis's
seconds, read / analysis (the fraction of the floor the analysis runs at) and peak RSS; then
``kvcouple analyze`` end to end (start-up, CSVs, results.json and report.md, ``--no-figures``)
against the same floor, and as a user runs it by default (the figures and report.html with its
text views too). Every mode takes turns with the others; besides the ratio of the best runs,
the floor over the command within each turn (and their median) is printed: on a machine
whose speed drifts over minutes, the steadier figure.

    python benchmarks/bench_analysis.py --docs 10000 100000 --dir /tmp/kvbench
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from codec_candidates import codecs  # noqa: E402  (the benchmarks folder)
from measure import best_seconds, cpu_seconds, peak_rss_mb  # noqa: E402
from summary_stores import (  # noqa: E402
    engine_summary_read,
    run_summary_analysis,
    store_footprint,
    write_summary_store,
)


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
    t, cpu = time.perf_counter(), cpu_seconds()

    def one(job: tuple[Path, list[object]]) -> int:
        data = job[0].read_bytes()
        for codec in job[1]:
            data = codec.decode(data)  # type: ignore[attr-defined]
        return len(data)

    with ThreadPoolExecutor(threads) as pool:
        decoded = sum(pool.map(one, jobs))
    return {
        "seconds": time.perf_counter() - t,
        "cpu_seconds": cpu_seconds() - cpu,
        "decoded_bytes": decoded,
        "peak_rss_mb": peak_rss_mb(),
    }


def engine_pass(store: str, decode_only: bool) -> dict[str, float]:
    """The engine over every distribution block of every document: the TVs (decode, checksum,
    value checks, TV), or with ``decode_only`` the decode alone."""
    from kvcouple.store.reader import TraceStoreReader

    r = TraceStoreReader(store)
    t, cpu = time.perf_counter(), cpu_seconds()
    decoded = 0
    for pn, qn in (("p", "q"), ("branch_p", "branch_q")):
        sels = [
            (d, pol, *sel)
            for d in r.done
            for pol in range(len(r.policies))
            for sel in r.blocks(pn, d, pol)
        ]
        rows = r.rows_tv(pn, qn, sels, decode_only=decode_only)
        assert rows is not None, "the engine cannot read this store"
        decoded += 2 * rows.size * r.array(pn).shape[-1] * r.array(pn).dtype.itemsize
    return {
        "seconds": time.perf_counter() - t,
        "cpu_seconds": cpu_seconds() - cpu,
        "decoded_bytes": decoded,
        "peak_rss_mb": peak_rss_mb(),
    }


def user_env() -> dict[str, str]:
    """The environment of a measured child: as on a user's machine, where Python caches the
    modules' bytecode (a sandbox that sets PYTHONDONTWRITEBYTECODE compiles every module on
    every start: +0.1 s of fixed cost)."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def run_cli(store: str, threads: int, figures: bool = False) -> dict[str, float]:
    """``kvcouple analyze`` in a child process, timed from outside it (start-up included);
    its CPU seconds and peak RSS from the child's resource usage. ``figures``: as a user runs
    it, with the figures and report.html (else ``--no-figures``: the CSVs, results.json and
    report.md)."""
    out = Path(store).parent / f"{Path(store).name}.cli-out"
    cmd = [sys.executable, "-m", "kvcouple.cli", "analyze", store, "--out", str(out)]
    cmd += [*([] if figures else ["--no-figures"]), "--quiet", "--io-threads", str(threads)]
    log = Path(store).parent / f"{Path(store).name}.cli-stderr"
    t = time.perf_counter()
    with log.open("wb") as err:
        child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=user_env())
        # This child's own usage (RUSAGE_CHILDREN would be the largest of every child so far).
        _, status, r = os.wait4(child.pid, 0)
    seconds = time.perf_counter() - t
    if status != 0:
        raise RuntimeError(f"kvcouple analyze failed ({status}): {log.read_text()[-2000:]}")
    log.unlink()
    shutil.rmtree(out, ignore_errors=True)
    return {
        "seconds": seconds,
        "cpu_seconds": r.ru_utime + r.ru_stime,
        "peak_rss_mb": r.ru_maxrss / 1024.0,
    }


def run_analysis(store: str, threads: int) -> dict[str, float]:
    import xarray  # noqa: F401  (imports are start-up cost, not throughput)
    import zarr  # noqa: F401

    from kvcouple.analysis import analyze

    t, cpu = time.perf_counter(), cpu_seconds()
    result = analyze(store, n_boot=200, io_threads=threads)
    seconds, cpu = time.perf_counter() - t, cpu_seconds() - cpu
    checks = [d.check for d in result.models[0].docs]
    return {
        "seconds": seconds,
        "cpu_seconds": cpu,
        "decoded_bytes": sum(c.bytes_read for c in checks),
        "rows_checked": sum(c.rows_checked for c in checks),
        "disagreements": len(result.checks()),
        "peak_rss_mb": peak_rss_mb(),
    }


def summary_scale(a: argparse.Namespace) -> None:
    """``--docs``: summary stores of each size written, then analysed against the engine's
    read of the same store (the read floor)."""
    print("| documents x 2 policies (T=64, R=8, K=2) | files | bytes on disk / of data | "
          "write (units/s) | write peak RSS (MB) | engine read (s) | analysis (s) | "
          "read / analysis | read peak RSS (MB) | analysis peak RSS (MB) | "
          "`kvcouple analyze` (s) | read / CLI | CLI peak RSS (MB) | "
          "with figures and report.html (s) | read / that | its peak RSS (MB) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    # CPU seconds beside the wall clock: on a shared machine the steadier ratio.
    cpu_lines: list[str] = []
    turn_lines: list[str] = []
    for docs in a.docs:
        store = Path(a.dir) / f"summary_{docs}.zarr"
        write = None
        if not (a.reuse and (store / "zarr.json").exists()):
            shutil.rmtree(store, ignore_errors=True)
            write = _subprocess("summary-write", str(store), a.threads)
        size = store_footprint(store)
        # Best of --repeats, every mode taking turns: the read, the analysis, the command end
        # to end (start-up, the CSVs and the report; no figures) and as a user runs it (the
        # figures and report.html with its text views too).
        modes = ["summary-read", "summary-analyze", "cli", "cli-figures"]
        runs = _turns(modes, str(store), a.threads, a.repeats)
        read, analysis, cli, full = (_fastest(runs[m]) for m in modes)
        # The floor over the command within each turn: on a machine whose speed drifts over
        # minutes, steadier than the ratio of two bests taken in different turns.
        paired = sorted(r["seconds"] / c["seconds"] for r, c in zip(runs["summary-read"],
                        runs["cli"], strict=True))  # fmt: skip
        turn_lines.append(
            f"{docs} documents, floor / command within each turn: "
            + ", ".join(f"{x:.2f}" for x in paired)
            + f" (median {statistics.median(paired):.2f})"
        )
        written = (
            "reused | reused"
            if write is None
            else f"{write['units_per_second']:.0f} | {write['peak_rss_mb']:.0f}"
        )
        print(f"| {docs} | {size['files']} | {size['bytes_on_disk'] / size['bytes_of_data']:.2f} "
              f"| {written} "
              f"| {read['seconds']:.1f} | {analysis['seconds']:.1f} "
              f"| {read['seconds'] / analysis['seconds']:.2f} | {read['peak_rss_mb']:.0f} "
              f"| {analysis['peak_rss_mb']:.0f} | {cli['seconds']:.1f} "
              f"| {read['seconds'] / cli['seconds']:.2f} | {cli['peak_rss_mb']:.0f} "
              f"| {full['seconds']:.1f} | {read['seconds'] / full['seconds']:.2f} "
              f"| {full['peak_rss_mb']:.0f} |",
              flush=True)  # fmt: skip
        cpu = {
            k: r["cpu_seconds"]
            for k, r in (
                ("read", read),
                ("analysis", analysis),
                ("CLI", cli),
                ("with figures", full),
            )
        }
        cpu_lines.append(f"{docs} documents, CPU seconds: " + ", ".join(
            f"{k} {v:.1f}" + ("" if k == "read" else f" (read / that {cpu['read'] / v:.2f})")
            for k, v in cpu.items()))  # fmt: skip
    for line in cpu_lines + turn_lines:
        print(line)


MODES = {
    "summary-analyze": run_summary_analysis,
    "summary-read": engine_summary_read,
    "summary-write": write_summary_store,
    "cli": run_cli,
    "cli-figures": lambda s, t: run_cli(s, t, figures=True),
    "analyze": run_analysis,
    "engine": lambda s, _t: engine_pass(s, decode_only=False),
    "raw": raw_decode,
    "zarrs": lambda s, _t: engine_pass(s, decode_only=True),
}


def _subprocess(mode: str, store: str, threads: int) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, __file__, "--_run", mode, store, "--threads", str(threads)],
        check=True,
        capture_output=True,
        text=True,
        env=user_env(),
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _turns(modes: list[str], store: str, threads: int, repeats: int) -> dict[str, list[dict]]:
    """``repeats`` runs of each mode, the modes taking turns (so a burst of load on a shared
    machine hits them alike): each mode's runs in turn order."""
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    for _ in range(repeats):
        for mode in modes:
            runs[mode].append(_subprocess(mode, store, threads))
    return runs


def _fastest(runs: list[dict]) -> dict:
    return min(runs, key=lambda r: r["seconds"])


def _best_of(modes: list[str], store: str, threads: int, repeats: int) -> dict[str, dict]:
    """The fastest of ``repeats`` runs of each mode, the modes taking turns."""
    return {mode: _fastest(r) for mode, r in _turns(modes, store, threads, repeats).items()}


def fixed_cost(a: argparse.Namespace) -> str:
    """Seconds of ``kvcouple analyze`` on one-document stores, start-up, imports, validation
    and outputs with next to nothing to read: a summary store's document (the records of the
    ``--docs`` stores) and a full-record document (128,256-token rows: ~16 MB decoded and
    every TV recomputed); beside them their floor, Python starting and importing numpy and
    zarr-python alone (what any command reading a Zarr store pays)."""
    from make_synthetic_store import make_store

    full = Path(a.dir) / "one_doc.zarr"
    if not full.exists():
        make_store(full, 0.001, workers=1)
    summary = Path(a.dir) / "summary_1.zarr"
    if not (summary / "zarr.json").exists():
        _subprocess("summary-write", str(summary), a.threads)
    best = {"summary": math.inf, "full": math.inf, "numpy": math.inf, "zarr": math.inf}
    floors = {"numpy": "import numpy", "zarr": "import numpy, zarr"}
    for _ in range(max(a.repeats, 3)):  # taking turns
        for name, store in (("summary", summary), ("full", full)):
            best[name] = min(best[name], _subprocess("cli", str(store), a.threads)["seconds"])
        for name, code in floors.items():
            t = time.perf_counter()
            subprocess.run([sys.executable, "-c", code], check=True, env=user_env())
            best[name] = min(best[name], time.perf_counter() - t)
    return (
        f"fixed cost: kvcouple analyze on a one-document summary store {best['summary']:.2f} s "
        f"(goal <= 0.5), on a one-document full-record store {best['full']:.2f} s; Python "
        f"starting and importing numpy alone {best['numpy']:.2f} s (the command imports no "
        f"zarr-python for a local store), numpy and zarr-python {best['zarr']:.2f} s"
    )


def sizes_table(a: argparse.Namespace) -> list[tuple[float, int, dict[str, dict]]]:
    from make_synthetic_store import make_store, store_bytes

    print(fixed_cost(a))
    rows = []
    for gb in a.sizes:
        store = Path(a.dir) / f"full_{gb:g}gb.zarr"
        made = not store.exists()
        if made:
            t = time.perf_counter()
            make_store(store, gb)
            print(f"generated {store} in {time.perf_counter() - t:.0f} s", flush=True)
        size = store_bytes(store)
        m = _best_of(["raw", "zarrs", "engine", "analyze", "cli"], str(store), a.threads, a.repeats)
        floor = min(m["raw"], m["zarrs"], key=lambda r: r["seconds"])

        def ratio(mode: str) -> str:
            r = m[mode]
            return (
                f"{r['seconds']:.2f} s, {floor['seconds'] / r['seconds']:.2f} of the floor "
                f"(CPU s {r['cpu_seconds']:.2f}: {floor['cpu_seconds'] / r['cpu_seconds']:.2f})"
            )

        an = m["analyze"]
        print(
            f"{size / 1e9:6.2f} GB on disk ({m['raw']['decoded_bytes'] / 1e9:.2f} GB decoded), "
            f"{a.threads} threads: decode floor {floor['seconds']:.2f} s (CPU s "
            f"{floor['cpu_seconds']:.2f}; raw numcodecs {m['raw']['seconds']:.2f} s, engine "
            f"decode {m['zarrs']['seconds']:.2f} s)\n"
            f"  CLI end to end {ratio('cli')} (goal >= 0.9)\n"
            f"  analyze()      {ratio('analyze')}\n"
            f"  engine only    {ratio('engine')}\n"
            f"  peak RSS MB: CLI {m['cli']['peak_rss_mb']:.0f}, analyze() {an['peak_rss_mb']:.0f}, "
            f"engine {m['engine']['peak_rss_mb']:.0f}, raw decode {m['raw']['peak_rss_mb']:.0f}, "
            f"engine decode {m['zarrs']['peak_rss_mb']:.0f}; {an['rows_checked']} rows "
            f"recomputed, {an['disagreements']} disagreements",
            flush=True,
        )
        rows.append((gb, size, m))
        if made and not a.keep:
            shutil.rmtree(store, ignore_errors=True)  # an 8 GB store is not left behind
    if len(rows) > 1:
        per_gb = [r[2]["cli"]["seconds"] / (r[1] / 1e9) for r in rows]
        rss = [r[2]["cli"]["peak_rss_mb"] for r in rows]
        print(
            "CLI seconds per GB: "
            + ", ".join(f"{x:.2f}" for x in per_gb)
            + f" (max/min {max(per_gb) / min(per_gb):.2f}); CLI peak RSS MB: "
            + ", ".join(f"{x:.0f}" for x in rss)
            + f" (max/min {max(rss) / min(rss):.2f}; flat means ~1)"
        )
    return rows


def s3_vs_local(a: argparse.Namespace) -> None:
    """The analysis from a local S3 server (moto on 127.0.0.1) against the same store on local
    disk. The distributions' chunk objects (``p``, ``q``, ``branch_p``, ``branch_q``: nearly
    all the bytes) are fetched concurrently and decoded by the Rust engine; the engine's
    requests and bytes per second are over the whole S3 analysis (one request per object)."""
    from kvcouple.testing.s3 import ServerUnavailable, local_s3
    from make_synthetic_store import make_store, store_bytes

    store = Path(a.dir) / f"full_{a.s3_gb:g}gb.zarr"
    if not store.exists():
        make_store(store, a.s3_gb)
    size = store_bytes(store)
    engine_objects = [
        f
        for name in ("p", "q", "branch_p", "branch_q")
        for f in (store / name).rglob("*")
        if f.is_file() and not f.name.startswith((".z", "zarr.json"))
    ]
    engine_bytes = sum(f.stat().st_size for f in engine_objects)
    try:
        with local_s3() as bucket:
            import s3fs

            url = f"{bucket}/bench.zarr"
            t = time.perf_counter()
            s3fs.S3FileSystem().put(str(store), url[5:], recursive=True)
            up = time.perf_counter() - t
            try:
                floors = _s3_fetch_floors(url, store, a.repeats)
            finally:
                _close_s3_sessions()
            # Local and S3 take turns, so load on a shared machine hits both alike.
            best: dict[str, dict] = {}
            for _ in range(a.repeats):
                for where, path in (("s3", url), ("local", str(store))):
                    r = _subprocess("analyze", path, a.threads)
                    if where not in best or r["seconds"] < best[where]["seconds"]:
                        best[where] = r
    except ServerUnavailable as e:
        print(f"S3: skipped ({e})")
        return
    remote, local = best["s3"], best["local"]
    print(
        f"S3 (moto on 127.0.0.1; the Rust engine fetching concurrently) vs local disk, "
        f"{size / 1e9:.2f} GB: analysis {size / remote['seconds'] / 1e9:.3f} GB/s from S3, "
        f"{size / local['seconds'] / 1e9:.3f} GB/s local; S3 / local time "
        f"{remote['seconds'] / local['seconds']:.2f} (goal <= 1.3); engine "
        f"{len(engine_objects) / remote['seconds']:.0f} requests/s, "
        f"{engine_bytes / remote['seconds'] / 1e6:.0f} MB/s ({len(engine_objects)} objects, "
        f"{engine_bytes / 1e6:.0f} MB); upload {size / up / 1e9:.3f} GB/s; "
        f"peak RSS MB S3 {remote['peak_rss_mb']:.0f}, local {local['peak_rss_mb']:.0f}",
        flush=True,
    )
    client, fsspec = floors["engine"], floors["fsspec"]
    print(
        f"S3 fetch floor (every object of the store, nothing decoded): engine client "
        f"{client:.2f} s ({size / client / 1e6:.0f} MB/s), fsspec {fsspec:.2f} s "
        f"({size / fsspec / 1e6:.0f} MB/s; engine client / fsspec time {client / fsspec:.2f}); "
        f"analysis from S3 / engine-client floor {remote['seconds'] / client:.2f}; the floor / "
        f"local analysis {client / local['seconds']:.2f} (the server's own limit on this "
        f"machine: above 1.3, the 1.3x goal cannot be met here)",
        flush=True,
    )


def _close_s3_sessions() -> None:
    """Close the aiohttp sessions of this process's s3fs filesystems (the upload's and zarr's
    fsspec store's) while their event loops still run: left to the interpreter's exit, their
    finalizers find the loops stopped and aiohttp warns "Unclosed client session"."""
    import fsspec.asyn
    import s3fs
    from zarr.core.sync import sync

    for fs in list(s3fs.S3FileSystem._cache.values()):
        s3 = getattr(fs, "_s3", None)
        if s3 is None:
            continue
        if fs.asynchronous:  # zarr's store: its session lives on zarr's event loop
            sync(s3.close())
        elif fs.loop is not None and fs.loop.is_running():
            fsspec.asyn.sync(fs.loop, s3.close)
        fs._s3 = None
    s3fs.S3FileSystem.clear_instance_cache()


def _s3_fetch_floors(url: str, store: Path, repeats: int) -> dict[str, float]:
    """Seconds to fetch every object of the store from S3 and decode none: by the engine's
    own client, and by zarr's fsspec store (the peer), best of ``repeats``."""
    from kvcouple.store.reader import TraceStoreReader

    reader = TraceStoreReader(url)
    if reader.fetched_by != "engine":
        raise RuntimeError(f"the engine's client cannot read {url} ({reader.fetched_by})")
    keys = [str(f.relative_to(store)) for f in store.rglob("*") if f.is_file()]
    ways = {"engine": reader.fetch_objects, "fsspec": reader.object_storage.fetch_with_zarr}
    best = {}
    for way, fetch in ways.items():
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            got = fetch(keys)
            times.append(time.perf_counter() - t)
            assert all(g is not None for g in got), way
        best[way] = min(times)
    return best


def kernels_in_memory(a: argparse.Namespace) -> None:
    import torch

    import kvcouple
    from make_synthetic_store import _distributions

    p, q = _distributions(torch.Generator().manual_seed(1), a.rows)
    gb = 2 * p.nbytes / 1e9
    tv = best_seconds(lambda: kvcouple.total_variation(p, q))
    plain = best_seconds(lambda: kvcouple.plain_pass(p, q))
    allq = best_seconds(lambda: kvcouple.divergences(p, q, renormalize=True))
    print(
        f"in memory, {a.rows} rows x 128,256 float16 ({gb:.2f} GB): TV-only "
        f"{gb / tv:.2f} GB/s, plain memory pass {gb / plain:.2f} GB/s, all divergences "
        f"{gb / allq:.2f} GB/s; TV-only / plain pass time {tv / plain:.2f} (goal <= 2), "
        f"all divergences / TV-only {allq / tv:.2f}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--sizes", type=float, nargs="*", default=[1.5], help="GB on disk (default 1.5)"
    )
    ap.add_argument("--large", action="store_true", help="also 8 GB (minutes on two cores)")
    ap.add_argument("--dir", default="/tmp/kvbench")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--repeats", type=int, default=2, help="best of this many runs of each")
    ap.add_argument("--s3-gb", type=float, default=0.25, help="size of the S3 comparison (0: skip)")
    ap.add_argument(
        "--rows", type=int, default=256, help="rows of the in-memory kernel test (0: skip)"
    )
    ap.add_argument("--codecs", action="store_true", help="also measure candidate codecs")
    ap.add_argument("--model-store", default=None, help="a traced full store for --codecs")
    ap.add_argument("--keep", action="store_true", help="keep the generated stores")
    ap.add_argument(
        "--reuse",
        action="store_true",
        help="--docs: analyse a summary store already in --dir instead of writing it again "
        "(its write figures are then not measured)",
    )
    ap.add_argument(
        "--docs", type=int, nargs="+", default=[],
        help="only the summary-store scale test, stores of these many documents",
    )  # fmt: skip
    ap.add_argument("--_run", nargs=2, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a._run:
        mode, store = a._run
        print(json.dumps(MODES[mode](store, a.threads)))
        return 0
    if a.docs:
        Path(a.dir).mkdir(parents=True, exist_ok=True)
        summary_scale(a)
        print(fixed_cost(a))
        if not (a.keep or a.reuse):
            shutil.rmtree(a.dir, ignore_errors=True)
        return 0
    if a.large and 8.0 not in a.sizes:
        a.sizes.append(8.0)
    Path(a.dir).mkdir(parents=True, exist_ok=True)
    if a.rows > 0:
        kernels_in_memory(a)
    if a.codecs:
        codecs(a)
    if a.s3_gb > 0:
        s3_vs_local(a)  # object storage against local disk: the S3 engine reports here too
    sizes_table(a)
    if not a.keep:
        shutil.rmtree(a.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
