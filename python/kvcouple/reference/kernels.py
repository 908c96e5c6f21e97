"""numba reference of ``divergences`` and ``couple`` (SPEC section 2), for tests and benchmarks."""

from __future__ import annotations

import math

import numba
import numpy as np


def widen(a: np.ndarray, dtype: str | None = None) -> np.ndarray:
    """float16/float32 -> float64; ``dtype="bfloat16"`` reads uint16 bits as bfloat16."""
    a = np.asarray(a)
    if dtype == "bfloat16":
        return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return a.astype(np.float64)


@numba.njit(parallel=True, cache=True)
def divergences_ref(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Per row: tv, kl_pq, kl_qp, js, hellinger, entropy_p, entropy_q, overlap, top1_agree."""
    rows, vocab = p.shape
    out = np.zeros((rows, 9))
    for r in numba.prange(rows):
        tv = 0.0
        kl_pq = 0.0
        kl_qp = 0.0
        js = 0.0
        hel = 0.0
        h_p = 0.0
        h_q = 0.0
        inf_pq = False
        inf_qp = False
        best_p = -1.0
        best_q = -1.0
        arg_p = 0
        arg_q = 0
        for v in range(vocab):
            a = p[r, v]
            b = q[r, v]
            tv += abs(a - b)
            total = a + b  # m = total / 2; halving can underflow for subnormals
            if a > 0.0:
                h_p -= a * math.log(a)
                js += 0.5 * a * math.log(2.0 * a / total)
                if b > 0.0:
                    kl_pq += a * (math.log(a) - math.log(b))  # a / b can overflow
                else:
                    inf_pq = True
            if b > 0.0:
                h_q -= b * math.log(b)
                js += 0.5 * b * math.log(2.0 * b / total)
                if a > 0.0:
                    kl_qp += b * (math.log(b) - math.log(a))
                else:
                    inf_qp = True
            d = math.sqrt(a) - math.sqrt(b)
            hel += d * d
            if a > best_p:
                best_p = a
                arg_p = v
            if b > best_q:
                best_q = b
                arg_q = v
        tv = min(0.5 * tv, 1.0)  # rows within atol of sum 1 may round past 1
        out[r, 0] = tv
        out[r, 1] = math.inf if inf_pq else max(kl_pq, 0.0)
        out[r, 2] = math.inf if inf_qp else max(kl_qp, 0.0)
        out[r, 3] = max(js, 0.0)
        out[r, 4] = math.sqrt(0.5 * hel)
        out[r, 5] = h_p
        out[r, 6] = h_q
        out[r, 7] = 1.0 - tv
        out[r, 8] = 1.0 if arg_p == arg_q else 0.0
    return out


DIVERGENCE_FIELDS = (
    "tv",
    "kl_pq",
    "kl_qp",
    "js",
    "hellinger",
    "entropy_p",
    "entropy_q",
    "overlap",
    "top1_agree",
)


@numba.njit(cache=True)
def _walk(w: np.ndarray, target: float) -> int:
    """First index whose running sum of ``w`` exceeds ``target``; else the last positive one."""
    cum = 0.0
    last = 0
    for v in range(w.shape[0]):
        if w[v] > 0.0:
            last = v
            cum += w[v]
            if cum > target:
                return v
    return last


@numba.njit(parallel=True, cache=True)
def couple_ref(p: np.ndarray, q: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Maximal coupling per row: columns x, y, diverged (as int64)."""
    rows, vocab = p.shape
    out = np.zeros((rows, 3), dtype=np.int64)
    for r in numba.prange(rows):
        a = p[r] / p[r].sum()
        b = q[r] / q[r].sum()
        overlap = np.minimum(a, b)
        res_p = np.maximum(a - b, 0.0)
        res_q = np.maximum(b - a, 0.0)
        delta = min(0.5 * np.abs(a - b).sum(), 1.0)
        o = overlap.sum()
        if u[r, 0] >= delta and o > 0.0:
            z = _walk(overlap, u[r, 1] * o)
            out[r, 0] = z
            out[r, 1] = z
            continue
        rp = res_p.sum()
        rq = res_q.sum()
        x = _walk(res_p, u[r, 1] * rp) if rp > 0.0 else _walk(a, u[r, 1])
        y = _walk(res_q, u[r, 2] * rq) if rq > 0.0 else _walk(b, u[r, 2])
        out[r, 0] = x
        out[r, 1] = y
        out[r, 2] = 1 if x != y else 0
    return out
