"""``kvcouple show STORE --doc ID``: what one document's P and Q wrote, in the terminal.

The prompt's last lines, then for every branch of the replicate the continuation both sides
shared up to the first divergence (marked ``>>``) and each side's continuation after it, every
token shaded by the TV between P and Q at its step (where the output is a colour terminal;
plain text otherwise, or with ``--color never``). ``--json`` prints the same for scripts.
Stores of schema version 3 and older keep no text: their token ids are shown instead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "show",
        help="show one document's prompt and the two sides' continuations around the first "
        "divergence",
        description=__doc__,
    )
    p.add_argument("store", help="the trace store (.zarr folder or URL)")
    p.add_argument("--doc", required=True, metavar="ID", help="the document's id")
    p.add_argument(
        "--policy",
        action="append",
        default=None,
        metavar="SPEC",
        help="a policy, by its full spec or its short label (repeatable; default: every policy)",
    )
    p.add_argument("--rep", type=int, default=0, help="the replicate (0-based)")
    p.add_argument("--json", action="store_true", help="print the views as JSON")
    p.add_argument(
        "--color",
        choices=["auto", "always", "never"],
        default="auto",
        help="shade tokens by TV: auto (on a terminal, unless NO_COLOR is set), always, never",
    )
    p.set_defaults(func=run)


def use_color(choice: str, stream: Any = None) -> bool:
    """Colour on ``always``; on ``auto`` where the stream is a terminal and NO_COLOR unset."""
    if choice != "auto":
        return choice == "always"
    stream = stream or sys.stdout
    return bool(getattr(stream, "isatty", lambda: False)()) and not os.environ.get("NO_COLOR")


def run(args: argparse.Namespace) -> int:
    from kvcouple.analysis.text_view import (
        document_view,
        find_document,
        find_policy,
        terminal_lines,
        view_json,
    )
    from kvcouple.store.reader import TraceStoreReader
    from kvcouple.store.text import open_text, text_status

    reader = TraceStoreReader(args.store)
    doc = find_document(reader, args.doc)
    if doc not in reader.done:
        from kvcouple.errors import InvalidInputError

        raise InvalidInputError(
            f"{args.store}: document {args.doc!r} is not finished (the trace was interrupted "
            "before it): resume the trace first"
        )
    policies = (
        [find_policy(reader, p) for p in args.policy]
        if args.policy
        else list(range(len(reader.policies)))
    )
    text, status = open_text(reader), text_status(reader)
    views = [document_view(reader, doc, p, args.rep, text=text, status=status) for p in policies]
    if args.json:
        print(json.dumps([view_json(v) for v in views], indent=1, ensure_ascii=False))
        return 0
    color = use_color(args.color)
    for i, view in enumerate(views):
        if i:
            print()
        print("\n".join(terminal_lines(view, color)))
    return 0
