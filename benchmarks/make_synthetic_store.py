"""Generate a synthetic ``full`` trace store of a chosen size (no model needed).

Distributions have the vocabulary of Llama 3 (128,256 tokens), are stored in float16 with the
store's zstd compression and look like a language model's: ``p = softmax(z)`` with Gaussian
logits of scale 2.5 (a few tokens carry most mass, most probabilities underflow toward zero),
``q = softmax(z + noise)``. Recorded hazards and branch TVs are the TVs of the stored float16
rows (computed with the Rust kernel), so the analysis's recomputation check must find no
disagreement. Other fields are filled with plausible values.

    python benchmarks/make_synthetic_store.py /tmp/bench_1g.zarr --gb 1
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

VOCAB = 128_256
POLICIES = ["snapkv:retain=0.5"]
REPS, HORIZON, BRANCHES, WINDOW = 2, 32, 1, 15


def _layout(docs: int):
    from kvcouple.store import Record, StoreLayout

    return StoreLayout(
        doc_ids=[f"doc{d:05d}" for d in range(docs)],
        policies=POLICIES,
        horizon=HORIZON,
        window=WINDOW,
        branches=BRANCHES,
        replicates=REPS,
        vocab_size=VOCAB,
        record=Record("full"),
    )


ATTRS = {
    "model_id": "synthetic-llama3-vocab",
    "model_revision": "",
    "dtype": "float16",
    "decoding": {"temperature": 1.0, "top_k": None, "top_p": None},
    "policies": [{"spec": p, "name": p, "params": {}} for p in POLICIES],
    "seed": 0,
    "estimator": "rb",
    "source": "synthetic",
    "eos_token_id": None,
    "kvcouple_version": "bench",
}


def _distributions(gen: Any, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows of p and q in float16 (torch: numpy's float16 cast is ~50x slower)."""
    import torch

    z = torch.randn((rows, VOCAB), generator=gen) * 2.5
    noise = torch.randn((rows, VOCAB), generator=gen) * 0.3
    p = torch.softmax(z, dim=1).half().numpy()
    q = torch.softmax(z + noise, dim=1).half().numpy()
    return p, q


def _tv(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    from kvcouple import _core

    v = p.shape[-1]
    return _core.row_tv(
        p.reshape(-1, v).view(np.uint16), q.reshape(-1, v).view(np.uint16), "float16"
    ).reshape(p.shape[:-1])


def _doc_arrays(doc: int) -> dict[str, np.ndarray]:
    import torch

    rng = np.random.default_rng([7, doc])
    gen = torch.Generator().manual_seed(7_000_003 * doc + 7)
    P, R, T, K, L1 = len(POLICIES), REPS, HORIZON, BRANCHES, WINDOW + 1
    p, q = _distributions(gen, P * R * T)
    p, q = p.reshape(P, R, T, VOCAB), q.reshape(P, R, T, VOCAB)
    bp, bq = _distributions(gen, P * R * K * L1)
    bp, bq = bp.reshape(P, R, K, L1, VOCAB), bq.reshape(P, R, K, L1, VOCAB)
    hazard = _tv(p, q).astype(np.float32)
    branch_tv = _tv(bp, bq).astype(np.float32)
    mismatch = (rng.random((P, R, K, L1)) < branch_tv).astype(np.int8)
    mismatch[..., 0] = 1
    path = (P, R, T)
    from kvcouple.store.schema import empty_arrays

    layout = _layout(1)
    # Every schema variable (fill values), then the ones this benchmark fills.
    return {
        **empty_arrays(layout.record, layout.sizes()),
        "prompt_length": np.int32(512),
        "kept_length": np.full(P, 256, np.int32),
        "tokens": rng.integers(0, VOCAB, path, dtype=np.int32),
        "hazard": hazard,
        "kl_pq": np.full(path, 0.05, np.float32),
        "kl_qp": np.full(path, 0.05, np.float32),
        "entropy_p": np.full(path, 2.0, np.float32),
        "entropy_q": np.full(path, 2.0, np.float32),
        "top1_agree": np.ones(path, bool),
        "branch_step": rng.integers(1, T - WINDOW + 1, (P, R, K), dtype=np.int32),
        "branch_tv": branch_tv,
        "branch_mismatch": mismatch,
        "branch_tokens_p": rng.integers(0, VOCAB, (P, R, K, L1), dtype=np.int32),
        "branch_tokens_q": rng.integers(0, VOCAB, (P, R, K, L1), dtype=np.int32),
        "p": p,
        "q": q,
        "branch_p": bp,
        "branch_q": bq,
    }


def _write_docs(args: tuple[str, int, list[int]]) -> None:
    import torch

    from kvcouple import set_num_threads
    from kvcouple.store import TraceStoreWriter

    set_num_threads(1)
    torch.set_num_threads(1)
    path, docs, mine = args
    writer = TraceStoreWriter.open(path, _layout(docs), ATTRS)
    for d in mine:
        writer.write_doc(d, _doc_arrays(d))


def bytes_per_doc_raw() -> int:
    rows = len(POLICIES) * REPS * (HORIZON + BRANCHES * (WINDOW + 1))
    return 2 * rows * VOCAB * 2


def make_store(path: str | Path, gb: float, workers: int = 2, ratio: float = 0.5) -> Path:
    """Write a store of about ``gb`` GB on disk (``ratio``: expected compressed/raw size)."""
    from kvcouple.store import TraceStoreWriter

    path = Path(path)
    docs = max(1, math.ceil(gb * 1e9 / (bytes_per_doc_raw() * ratio)))
    TraceStoreWriter.open(path, _layout(docs), ATTRS)  # create once, before the workers
    todo = list(range(docs))
    with mp.get_context("spawn").Pool(workers) as pool:
        pool.map(_write_docs, [(str(path), docs, todo[i::workers]) for i in range(workers)])
    return path


def store_bytes(path: str | Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--gb", type=float, required=True, help="approximate size on disk")
    ap.add_argument("--workers", type=int, default=2)
    a = ap.parse_args(argv)
    t = time.perf_counter()
    make_store(a.out, a.gb, a.workers)
    n = store_bytes(a.out)
    print(
        f"wrote {a.out}: {n / 1e9:.2f} GB on disk in {time.perf_counter() - t:.0f} s "
        f"({bytes_per_doc_raw() / 1e6:.0f} MB raw per document)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
