"""``kvcouple demo``: the main job end to end on the embedded default model.

Traces the shipped prompts with the small model kvcouple trains and ships, under the three
policies the paper compares (SnapKV at 50% retention, SnapKV with a fixed budget, recent-token
retention at 50%), then analyses the store and writes the report. Nothing is downloaded.
Rerunning resumes an interrupted trace.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

DEMO_POLICIES = ("snapkv:retain=0.5", "snapkv:budget=64", "recent:retain=0.5")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "demo",
        help="trace and analyse the embedded default model (no download)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", default="kvcouple-demo", help="folder for the store and the report")
    p.add_argument("--horizon", type=int, default=32, help="T: new tokens per trajectory")
    p.add_argument("--replicates", type=int, default=6, help="R: overlap paths per document")
    p.add_argument("--branches", type=int, default=2, help="K: residual branches per path")
    p.add_argument(
        "--window",
        type=int,
        default=None,
        help="L: lags traced after a branch (default: to the horizon, so the decomposition "
        "is observed in full; a shorter window gives the sharp interval instead)",
    )
    p.add_argument("--docs", type=int, default=None, help="trace only the first N prompts")
    p.add_argument("--policy", action="append", default=None, help="override the policies")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvcouple.cli import main

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    store = out / "run.zarr"
    prompts = _prompts(out, args.docs)
    trace_argv = [
        "trace",
        "--prompts", str(prompts),
        "--horizon", str(args.horizon),
        "--replicates", str(args.replicates),
        "--branches", str(args.branches),
        "--window", str(args.window if args.window is not None else args.horizon),
        "--record", "summary",
        "--seed", str(args.seed),
        "--out", str(store),
    ]  # fmt: skip
    for spec in args.policy or DEMO_POLICIES:
        trace_argv += ["--policy", spec]
    if args.quiet:
        trace_argv.append("--quiet")
    print(f"== kvcouple demo: tracing the embedded model into {store}")
    code = main(trace_argv)
    if code:
        return code
    report = out / "report"
    print(f"== kvcouple demo: analysing {store} into {report}")
    code = main(["analyze", str(store), "--out", str(report), "--n-boot", "1000"])
    if code == 0:
        print(f"== done: open {report / 'report.html'}")
    return code


def _prompts(out: Path, limit: int | None) -> Path:
    """The shipped prompts, or the first ``limit`` of them."""
    from kvcouple.models import default_prompts_path

    src = default_prompts_path()
    if limit is None:
        return src
    lines = [ln for ln in src.read_text().splitlines() if ln.strip()][:limit]
    dst = out / f"prompts-{limit}.jsonl"
    dst.write_text("\n".join(lines) + "\n")
    return dst
