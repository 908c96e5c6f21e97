"""Does ``trace --scheduler`` scale with workers? The same run on 1, 2, ... Dask workers against
one process, each into a fresh store, every store compared with the one process's array by array.

    python benchmarks/trace_dask.py --workers 1 2 4 --cuda       # one worker per GPU (dask-cuda)
    python benchmarks/trace_dask.py --workers 1 2                # CPU worker processes, 1 thread

By default the embedded model traces 16 of its shipped prompts under two policies; ``--model``
and ``--prompts`` take a real model and a prompt file (with ``--cuda``, a real model is what
makes the GPUs worth having). Each cluster first runs a two-document warm-up (workers import
torch and load the model once); the timed run then loads the model again on every worker, as a
run does. Printed: wall seconds, the summary's generated tokens per second, the speed-up over
one process, and whether the store equals one process's. ``--out`` writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np


def same_store(a: Path, b: Path) -> bool:
    import zarr

    ga, gb = zarr.open_group(str(a), mode="r"), zarr.open_group(str(b), mode="r")
    names = sorted(n for n, _ in ga.arrays())
    if names != sorted(n for n, _ in gb.arrays()) or dict(ga.attrs) != dict(gb.attrs):
        return False
    return all(np.array_equal(ga[n][...], gb[n][...], equal_nan=True) for n in names)


def cluster(workers: int, cuda: bool) -> Any:
    if cuda:
        from dask_cuda import LocalCUDACluster

        visible = ",".join(str(i) for i in range(workers))
        return LocalCUDACluster(CUDA_VISIBLE_DEVICES=visible, dashboard_address=":0")
    from distributed import LocalCluster

    return LocalCluster(
        n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=":0"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--cuda", action="store_true", help="dask_cuda.LocalCUDACluster")
    parser.add_argument("--model", default=None, help="default: the embedded model")
    parser.add_argument("--prompts", default=None, help="default: the embedded model's")
    parser.add_argument("--docs", type=int, default=16)
    parser.add_argument("--horizon", type=int, default=64)
    parser.add_argument("--replicates", type=int, default=4)
    parser.add_argument("--branches", type=int, default=2)
    parser.add_argument(
        "--memory", type=float, default=None, metavar="GIB",
        help="plan every run for this much device memory (on CUDA: the same batches, so the "
        "stores can be equal bit for bit)",
    )  # fmt: skip
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch
    from distributed import Client

    from kvcouple.models import default_prompts_path, load_model, load_tokenizer
    from kvcouple.tracer import TraceSettings, load_prompts, trace
    from kvcouple.tracer.distributed import WorkerModel

    if not args.cuda:
        torch.set_num_threads(1)  # as one CPU worker
    tokenizer = load_tokenizer(args.model)
    prompts = load_prompts(args.prompts or default_prompts_path(), tokenizer)[: args.docs]
    settings = TraceSettings(
        args.horizon, args.replicates, branches=args.branches, window=args.horizon
    )
    policies = ["snapkv:retain=0.5", "recent:retain=0.5"]
    kw: dict[str, Any] = {"progress": False, "seed": 0, "model_id": args.model or "default"}
    if args.memory is not None:
        kw["memory"] = int(args.memory * 2**30)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvcouple-dask-bench-") as tmp:
        base = Path(tmp) / "one.zarr"
        model, _ = load_model(args.model)
        start = time.perf_counter()
        one = trace(model, prompts, policies, settings, base, **kw)
        seconds_one = time.perf_counter() - start
        rows.append({"workers": 0, "seconds": seconds_one, "tokens_s": one.tokens_per_second})
        print(f"one process: {seconds_one:.2f} s, {one.tokens_per_second:.0f} tokens/s")
        spec = WorkerModel.of(model)
        del model
        for n in args.workers:
            with cluster(n, args.cuda) as c, Client(c) as client:
                client.wait_for_workers(n)
                warm = Path(tmp) / f"warm{n}.zarr"
                trace(spec, prompts[:2], policies, settings, warm, client=client, **kw)
                out = Path(tmp) / f"dask{n}.zarr"
                start = time.perf_counter()
                run = trace(spec, prompts, policies, settings, out, client=client, **kw)
                seconds = time.perf_counter() - start
            equal = same_store(base, out)
            rows.append(
                {"workers": n, "seconds": seconds, "tokens_s": run.tokens_per_second,
                 "speedup": seconds_one / seconds, "equal": equal}
            )  # fmt: skip
            print(
                f"{n} workers: {seconds:.2f} s, {run.tokens_per_second:.0f} tokens/s, "
                f"x{seconds_one / seconds:.2f} of one process, store equal: {equal}"
            )
            shutil.rmtree(out, ignore_errors=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
