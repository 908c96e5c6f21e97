"""The ``kvcouple`` command line: one subcommand group per area.

Each area's module exposes ``register(subparsers)``; heavy imports (torch) happen inside the
command functions, so ``kvcouple --help`` stays fast and works without torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# (module, what it adds) — each module defines register(subparsers).
_AREAS = [
    "kvcouple.synth.cli",  # kvcouple synth ...
    "kvcouple.tracer.cli",  # kvcouple trace ...
    "kvcouple.analysis.cli",  # kvcouple analyze / info ...
    "kvcouple.demo",  # kvcouple demo
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvcouple",
        description="Measure what a KV-cache eviction policy does to generation, token by token.",
    )
    from kvcouple import __version__

    parser.add_argument("--version", action="version", version=f"kvcouple {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _AREAS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:
                continue  # area not built yet
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (ValueError, RuntimeError, FileNotFoundError) as e:
        print(f"kvcouple {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
