"""Smoke test of an installed wheel: imports without torch, runs both kernels."""

import sys

import numpy as np

import kvcouple

assert "torch" not in sys.modules, "importing kvcouple must not import torch"
p = np.full((4, 8), 1 / 8, dtype=np.float16)
q = np.eye(8, dtype=np.float32)[:4].astype(np.float16)
d = kvcouple.divergences(p, q)
assert np.allclose(d.tv, 7 / 8), d.tv
x, y, diverged = kvcouple.couple(p, q, np.full((4, 3), 0.5))
assert diverged.dtype == bool and x.dtype == np.int64
assert np.array_equal(y, np.arange(4)), y
print(f"kvcouple {kvcouple.__version__} wheel OK: tv={d.tv.tolist()} x={x.tolist()} y={y.tolist()}")
