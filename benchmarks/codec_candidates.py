"""``bench_analysis.py --codecs``: candidate codecs' compression ratio and one-thread decode
speed on 128k-vocabulary float16 rows, synthetic and (``--model-store``) a traced model's."""

from __future__ import annotations

import argparse

import numpy as np

from measure import best_seconds

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
        t = best_seconds(lambda c=codec, e=enc: c.decode(e), 3)
        print(
            f"  {name:24s} ratio {len(raw) / len(enc):.2f}  decode {len(raw) / t / 1e9:.2f} GB/s raw"
        )


def codecs(a: argparse.Namespace) -> None:
    import torch

    from make_synthetic_store import _distributions

    p, _ = _distributions(torch.Generator().manual_seed(2), 128)
    codec_table(p, "synthetic 128k-vocabulary rows")
    if a.model_store:
        import zarr

        g = zarr.open_group(a.model_store, mode="r")
        rows = np.asarray(g["p"][...])
        rows = rows[np.isfinite(rows).all(-1)]
        codec_table(rows, f"the model's rows from {a.model_store}")
