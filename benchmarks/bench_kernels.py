"""Divergence and coupling kernels: Rust vs numpy, the numba reference, torch and a plain pass.

Prints each peer's median time and Rust's speed-up over it, all measured in this one run.
Usage: python benchmarks/bench_kernels.py [--rows 64] [--vocab 128256] [--repeat 5]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import kvcouple
from kvcouple.reference.kernels import couple_ref, divergences_ref


def timeit(fn, repeat: int) -> float:
    fn()  # warm-up (numba compilation, page faults)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def divergences_numpy(p: np.ndarray, q: np.ndarray) -> dict[str, np.ndarray]:
    """Straightforward vectorised numpy, float64 accumulation."""
    a = p.astype(np.float64)
    b = q.astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        la = np.log(a)
        lb = np.log(b)
        m = 0.5 * (a + b)
        lm = np.log(m)
        xlogx = lambda x, lx: np.where(x > 0, x * lx, 0.0)  # noqa: E731
        kl_pq = np.where(a > 0, a * (la - lb), 0.0).sum(1)
        kl_qp = np.where(b > 0, b * (lb - la), 0.0).sum(1)
        js = 0.5 * (np.where(a > 0, a * (la - lm), 0.0) + np.where(b > 0, b * (lb - lm), 0.0)).sum(
            1
        )
        return {
            "tv": 0.5 * np.abs(a - b).sum(1),
            "kl_pq": kl_pq,
            "kl_qp": kl_qp,
            "js": js,
            "hellinger": np.sqrt(0.5 * ((np.sqrt(a) - np.sqrt(b)) ** 2).sum(1)),
            "entropy_p": -xlogx(a, la).sum(1),
            "entropy_q": -xlogx(b, lb).sum(1),
            "top1": a.argmax(1) == b.argmax(1),
        }


def divergences_torch(p, q):
    import torch

    a = torch.from_numpy(p).double()
    b = torch.from_numpy(q).double()
    m = 0.5 * (a + b)
    xlogy = torch.special.xlogy
    return {
        "tv": 0.5 * (a - b).abs().sum(1),
        "kl_pq": (xlogy(a, a) - xlogy(a, b)).sum(1),
        "kl_qp": (xlogy(b, b) - xlogy(b, a)).sum(1),
        "js": (0.5 * (xlogy(a, a) + xlogy(b, b)) - xlogy(m, m)).sum(1),
        "hellinger": (0.5 * ((a.sqrt() - b.sqrt()) ** 2).sum(1)).sqrt(),
        "entropy_p": -xlogy(a, a).sum(1),
        "entropy_q": -xlogy(b, b).sum(1),
        "top1": a.argmax(1) == b.argmax(1),
    }


def couple_numpy(p: np.ndarray, q: np.ndarray, u: np.ndarray):
    """Vectorised numpy maximal coupling (the same inverse-CDF rule)."""
    a = p.astype(np.float64)
    b = q.astype(np.float64)
    a /= a.sum(1, keepdims=True)
    b /= b.sum(1, keepdims=True)
    w = np.minimum(a, b)
    delta = 0.5 * np.abs(a - b).sum(1)
    o = w.sum(1)
    rp = np.maximum(a - b, 0)
    rq = np.maximum(b - a, 0)

    def walk(weights, target):
        c = np.cumsum(weights, 1)
        idx = (c <= target[:, None]).sum(1)
        return np.minimum(idx, weights.shape[1] - 1)

    residual = u[:, 0] < delta
    z = walk(w, u[:, 1] * o)
    x = np.where(residual, walk(rp, u[:, 1] * rp.sum(1)), z)
    y = np.where(residual, walk(rq, u[:, 2] * rq.sum(1)), z)
    return x, y, x != y


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=128_256)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(kvcouple.get_num_threads())
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(args.rows, args.vocab)) * 2.5
    p64 = np.exp(logits - logits.max(1, keepdims=True))
    p64 /= p64.sum(1, keepdims=True)
    q64 = np.exp(0.9 * logits + 0.3 * rng.normal(size=logits.shape))
    q64 /= q64.sum(1, keepdims=True)
    u = rng.random((args.rows, 3))
    print(
        f"rows={args.rows} vocab={args.vocab} threads={kvcouple.get_num_threads()} "
        f"(numba threads={__import__('numba').get_num_threads()}, torch threads={torch.get_num_threads()})"
    )
    for dtype in (np.float16, np.float32):
        p = p64.astype(dtype)
        q = q64.astype(dtype)
        wide_p, wide_q = p.astype(np.float64), q.astype(np.float64)
        rust = timeit(lambda: kvcouple.divergences(p, q), args.repeat)
        peers = {
            "numpy": timeit(lambda: divergences_numpy(p, q), args.repeat),
            # numba takes no float16: the widening copy is part of its cost, as for numpy.
            "numba reference": timeit(
                lambda: divergences_ref(p.astype(np.float64), q.astype(np.float64)), args.repeat
            ),
            "numba (pre-widened)": timeit(lambda: divergences_ref(wide_p, wide_q), args.repeat),
            "torch cpu": timeit(lambda: divergences_torch(p, q), args.repeat),
            "plain pass (Rust)": timeit(lambda: kvcouple.plain_pass(p, q), args.repeat),
        }
        gb = 2 * p.nbytes / 1e9
        print(
            f"\ndivergences, {np.dtype(dtype).name}: Rust {rust * 1e3:.2f} ms ({gb / rust:.2f} GB/s)"
        )
        for name, t in peers.items():
            rel = "speed-up" if not name.startswith("plain") else "slower than the plain pass by"
            ratio = t / rust if not name.startswith("plain") else rust / t
            print(f"  {name:<22} {t * 1e3:9.2f} ms   {rel} {ratio:.1f}x")
        rust_c = timeit(lambda: kvcouple.couple(p, q, u), args.repeat)
        numpy_c = timeit(lambda: couple_numpy(p, q, u), args.repeat)
        numba_c = timeit(
            lambda: couple_ref(p.astype(np.float64), q.astype(np.float64), u), args.repeat
        )
        print(
            f"couple, {np.dtype(dtype).name}: Rust {rust_c * 1e3:.2f} ms; numpy {numpy_c * 1e3:.2f} ms "
            f"({numpy_c / rust_c:.1f}x); numba {numba_c * 1e3:.2f} ms ({numba_c / rust_c:.1f}x)"
        )


if __name__ == "__main__":
    main()
