"""Regenerate the model-coverage table in docs/tracer.md from the tiny-model matrix.

    python scripts/coverage_table.py          # rewrite the table in place
    python scripts/coverage_table.py --check  # exit 1 if the docs are out of date

The exactness behind each "exact" row is asserted by tests/tracer/test_coverage.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvcouple.testing.coverage import BEGIN, END, coverage_table

DOCS = Path(__file__).resolve().parents[1] / "docs" / "tracer.md"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check the docs are current")
    args = parser.parse_args()
    text = DOCS.read_text()
    if BEGIN not in text or END not in text:
        print(f"{DOCS}: no coverage-table markers", file=sys.stderr)
        return 1
    start, stop = text.index(BEGIN), text.index(END) + len(END)
    new = text[:start] + coverage_table() + text[stop:]
    if args.check:
        if new != text:
            print(f"{DOCS}: coverage table out of date; run {sys.argv[0]}", file=sys.stderr)
            return 1
        return 0
    DOCS.write_text(new)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
