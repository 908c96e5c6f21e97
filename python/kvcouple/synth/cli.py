"""``kvcouple synth ...``: random pairs, exact values and Monte Carlo estimates.

    kvcouple synth random-pair --vocab V --states S --seed N --out pair.npz
    kvcouple synth exact --pair pair.npz --horizon T --window L --json
    kvcouple synth estimate --pair pair.npz --horizon T --window L --estimator indicator|tv|naive \
        --replicates N --branches K --seed N --json

JSON values are counts per sequence (``*_fraction``, ``exposure``, ``mismatch_fraction`` and
``first_mismatch`` are divided by T); ``estimate`` gives ``{"mean", "se"}`` for
each quantity; NaN is written as null.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvcouple import cliargs
from kvcouple.cliargs import finite_float, positive
from kvcouple.synth.estimators import RENAMED_ESTIMATORS, SYNTH_ESTIMATORS

# What `kvcouple synth exact` prints without --json (the JSON has every key).
EXACT_PRINTED = (
    "expected_mismatches",
    "mismatch_fraction",
    "occurrence",
    "first_mismatch",
    "occupation",
    "exposure",
    "rho",
    "window_contribution",
    "tail_contribution",
    "tail_exposure",
    "interval_lower",
    "interval_upper",
)


def _pair(path: str) -> Any:
    """The ``--pair`` file, errors naming the option."""
    from kvcouple.errors import InvalidKernelError
    from kvcouple.synth import load_pair

    try:
        return load_pair(path)
    except InvalidKernelError as e:
        raise InvalidKernelError(f"--pair: {e}") from None
    except OSError as e:
        raise InvalidKernelError(f"--pair {path}: {e.strerror or e}") from None


def _random_pair(args: argparse.Namespace) -> int:
    from kvcouple.synth import random_pair, save_pair

    pair = random_pair(
        args.vocab,
        args.states,
        seed=args.seed,
        closeness=args.closeness,
        sparsity=args.sparsity,
        absorbing=args.absorbing,
        deterministic=args.deterministic,
        markov=args.markov,
    )
    save_pair(pair, args.out)
    print(f"wrote {args.out} (V={pair.vocab}, S_P={pair.p.states}, S_Q={pair.q.states})")
    return 0


def _print(d: dict[str, Any], as_json: bool) -> None:
    if as_json:
        json.dump(d, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return
    for k, v in d.items():
        if isinstance(v, dict) and "mean" in v and not isinstance(v["mean"], list):
            se = "nan" if v["se"] is None else f"{v['se']:.4g}"
            mean = "nan" if v["mean"] is None else f"{v['mean']:.6g}"
            print(f"{k:30s} {mean:>12s} +- {se}")
        elif isinstance(v, float):
            print(f"{k:30s} {v:12.6g}")
        elif not isinstance(v, list | dict):
            print(f"{k:30s} {v!s:>12s}")


def _exact(args: argparse.Namespace) -> int:
    from kvcouple.synth import exact

    result = exact(_pair(args.pair), args.horizon, args.window)
    d = result.to_dict()
    if not args.json:
        d = {k: d[k] for k in ("horizon", "window", *EXACT_PRINTED)}
    _print(d, args.json)
    return 0


def _estimate(args: argparse.Namespace) -> int:
    from kvcouple.synth import estimate

    est = estimate(
        _pair(args.pair),
        args.horizon,
        args.window,
        estimator=args.estimator,
        method=args.method,  # deprecated: read for one release
        replicates=args.replicates,
        branches=args.branches,
        seed=args.seed,
        trace=args.trace,
    )
    _print(est.to_dict(), args.json)
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pair", required=True, help="pair file (.npz): emitter keys or P, Q, start")
    cliargs.add_horizon(p, required=True, help="steps T", short="-T")
    cliargs.add_window(
        p,
        help="lags after divergence in the window (default and L >= T: to the horizon)",
        short="-L",
    )
    p.add_argument("--json", action="store_true", help="print JSON")


def register(subparsers: Any) -> None:
    """Add the ``synth`` command group."""
    synth = subparsers.add_parser(
        "synth",
        help="synthetic kernel pairs: exact ground truth and estimators",
        description="Synthetic kernel pairs (finite-state emitters) with exact ground truth.",
    )
    sub = synth.add_subparsers(dest="synth_command", metavar="SUBCOMMAND")
    synth.set_defaults(func=lambda _args: synth.print_help() or 2)

    p = sub.add_parser("random-pair", help="write a seeded random pair file")
    p.add_argument("--vocab", type=positive, required=True, help="tokens V")
    p.add_argument("--states", type=positive, default=None, help="states S (default V)")
    cliargs.add_seed(p, 0, help="random seed of the pair")
    p.add_argument("--closeness", type=finite_float, default=0.5, help="0: unrelated Q; 1: Q = P")
    p.add_argument("--sparsity", type=finite_float, default=0.0, help="chance an entry is zero")
    p.add_argument("--absorbing", action="store_true", help="token V-1 is an absorbing EOS")
    p.add_argument(
        "--deterministic", type=finite_float, default=0.0, help="chance a row is one-hot"
    )
    p.add_argument("--markov", action="store_true", help="first-order Markov tables (S = V)")
    p.add_argument("--out", required=True, help="the .npz file to write")
    p.set_defaults(func=_random_pair)

    p = sub.add_parser("exact", help="exact decomposition, survival, window/tail and interval")
    _common(p)
    p.set_defaults(func=_exact)

    p = sub.add_parser("estimate", help="Monte Carlo means and standard errors")
    _common(p)
    p.add_argument(
        "--estimator",
        choices=SYNTH_ESTIMATORS,
        default=None,
        help="indicator (default): RB-CMC from branch mismatch indicators; tv: RB-CMC from "
        "branch TVs; naive: plain coupled simulation",
    )
    p.add_argument(
        "--method",
        choices=(*RENAMED_ESTIMATORS, *SYNTH_ESTIMATORS),
        default=None,
        help="deprecated: --estimator (rb is indicator, rb-tv is tv)",
    )
    cliargs.add_replicates(p, 1000, help="overlap paths simulated", short="-N")
    cliargs.add_branches(p, 1, help="residual branches per path", short="-K")
    cliargs.add_seed(p, 0, help="random seed of the simulation")
    p.add_argument(
        "--trace",
        choices=("horizon", "window"),
        default="horizon",
        help="trace branches to the horizon, or only the window (tail unobserved)",
    )
    p.set_defaults(func=_estimate)

    # `kvcouple synth trace-store` lives with the store writing it (imported here, not above:
    # the other synth commands do not load the store writer).
    from kvcouple.synth.trace_store import register_trace_store

    register_trace_store(sub)
