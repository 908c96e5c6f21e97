"""Trace a fixed set of tiny stores, or compare two such sets: a refactoring of the tracer must
leave every store it writes as it was, to float noise.

    python scripts/compare_trace_stores.py write DIR      # trace the stores into DIR
    python scripts/compare_trace_stores.py compare A B    # every array of A against B

The stores cover two architectures (tiny Llama: shared, split and joint cache layouts and a
batch of documents; tiny Gemma 3: sliding-window layers, entry positions tracked), one-shot
policies scored and unscored, a gated policy (page), a randomised one, and decode-time
eviction (h2o and streaming with ``mode=decode``, replayed branches). ``compare`` prints the
largest difference of each float array and the count of differing entries of each integer
array, and exits 1 when any float differs by more than ``--atol`` or any integer differs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

# name -> (architecture, policies, TraceSettings keywords)
RUNS = {
    "llama_shared": (
        "llama",
        [
            "snapkv:retain=0.5",
            "recent:retain=0.5",
            "random:retain=0.4",
            "page:base=snapkv,retain=0.5,threshold=0.0",
            "full",
        ],
        {"cache_layout": "shared", "doc_batch": 2},
    ),
    "llama_split": ("llama", ["snapkv:retain=0.5", "knorm:budget=5"], {"cache_layout": "split"}),
    "llama_joint": ("llama", ["valuediff:retain=0.5", "h2o:retain=0.5"], {"cache_layout": "joint"}),
    "llama_decode": (
        "llama",
        ["h2o:retain=0.5,mode=decode", "streaming:budget=6,sinks=2,mode=decode,every=2"],
        {},
    ),
    "gemma3_window": ("gemma3_text", ["snapkv:retain=0.5", "recent:budget=6"], {}),
}


def _prompts() -> list[object]:
    from kvcouple.tracer import Prompt

    rng = np.random.default_rng(20)
    lengths = (12, 16, 20, 14)
    return [
        Prompt(f"d{i}", tuple(int(t) for t in rng.integers(1, 120, size=n)))
        for i, n in enumerate(lengths)
    ]


def write(out: Path) -> None:
    from kvcouple.store import Record
    from kvcouple.testing import tiny_model
    from kvcouple.tracer import TraceSettings, trace

    out.mkdir(parents=True, exist_ok=True)
    for name, (arch, policies, extra) in RUNS.items():
        model = tiny_model(arch, seed=3)
        settings = TraceSettings(
            horizon=10,
            replicates=3,
            branches=2,
            window=3,
            record=Record.parse("full"),
            **extra,  # type: ignore[arg-type]
        )
        trace(model, _prompts(), policies, settings, out / f"{name}.zarr", seed=5, progress=False)
        print(f"wrote {out / name}.zarr")


def _arrays(path: Path) -> dict[str, np.ndarray]:
    import zarr

    group = zarr.open_group(str(path), mode="r")
    return {name: np.asarray(array[...]) for name, array in group.arrays()}


def compare(a: Path, b: Path, atol: float, ignore: tuple[str, ...] = ()) -> int:
    import zarr

    bad = 0
    for store in sorted(p.name for p in a.glob("*.zarr")):
        left, right = _arrays(a / store), _arrays(b / store)
        la = dict(zarr.open_group(str(a / store), mode="r").attrs)
        ra = dict(zarr.open_group(str(b / store), mode="r").attrs)
        keys = sorted(k for k in set(la) | set(ra) if la.get(k) != ra.get(k) and k not in ignore)
        if keys:
            print(f"{store}: attributes differ: {keys}")
            bad += 1
        if set(left) != set(right):
            print(f"{store}: variables differ: {sorted(set(left) ^ set(right))}")
            bad += 1
        worst = 0.0
        for name in sorted(set(left) & set(right)):
            x, y = left[name], right[name]
            if x.shape != y.shape:
                print(f"{store}:{name}: shape {x.shape} vs {y.shape}")
                bad += 1
            elif np.issubdtype(x.dtype, np.floating):
                same_nan = np.array_equal(np.isnan(x), np.isnan(y))
                both = ~(np.isnan(x) | np.isnan(y))
                diff = float(np.abs(x[both].astype(np.float64) - y[both]).max(initial=0.0))
                worst = max(worst, diff)
                if not same_nan or diff > atol:
                    print(f"{store}:{name}: max |difference| {diff:.3g}, NaNs equal: {same_nan}")
                    bad += 1
            else:
                differ = int((x != y).sum())
                if differ:
                    print(f"{store}:{name}: {differ} of {x.size} entries differ")
                    bad += 1
        print(f"{store}: {len(left)} arrays, largest float difference {worst:.3g}")
    print("identical to float noise" if not bad else f"{bad} difference(s)")
    return 1 if bad else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write")
    w.add_argument("out", type=Path)
    c = sub.add_parser("compare")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    c.add_argument("--atol", type=float, default=1e-5)
    c.add_argument(
        "--ignore-attr",
        action="append",
        default=[],
        help="an attribute not compared (e.g. schema_version, when the schema moved on)",
    )
    args = parser.parse_args()
    if args.command == "write":
        write(args.out)
        return 0
    return compare(args.a, args.b, args.atol, tuple(args.ignore_attr))


if __name__ == "__main__":
    sys.exit(main())
