"""The README's sample of ``kvcouple demo``'s output, from a real run.

    python scripts/readme_sample.py            # run the demo, print its sample
    python scripts/readme_sample.py --write    # ... and put it into README.md
    python scripts/readme_sample.py --check    # ... and fail if README.md's differs

The demo runs in a fresh folder (``--quiet``, the default settings); the sample is its output
from the decomposition to the pair of continuations, with the run's folder written as
``~/.cache/kvcouple/demo`` (where the demo writes by default). ``tests/docs/test_readme.py``
checks the README's sample against the demo's own wording on every run, and against a real run
with ``KVCOUPLE_README_DEMO=1`` (a minute on two cores).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
# The sample's code block follows this sentence's paragraph in README.md.
BEFORE = (
    "is the expected fraction of the 32 generated tokens that differ from the full-cache model's"
)


def demo_sample() -> str:
    """Run the demo in a fresh folder and return its sample (see the module docstring)."""
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run(
            [sys.executable, "-m", "kvcouple.cli", "demo", "--quiet", "--out", tmp],
            capture_output=True,
            text=True,
            check=True,
        )
        out = done.stdout.replace(tmp, "~/.cache/kvcouple/demo")
    lines = out.splitlines()
    start = next(i for i, x in enumerate(lines) if x.startswith("kvcouple-default:"))
    end = next(i for i, x in enumerate(lines) if x.startswith("== done"))
    return "\n".join(lines[start:end]) + "\n"


def readme_sample(text: str | None = None) -> str:
    """The sample block in README.md."""
    text = README.read_text() if text is None else text
    tail = text.split(BEFORE, 1)[1]
    return re.search(r"```\n(.*?)```", tail, re.S).group(1)  # type: ignore[union-attr]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="put the sample into README.md")
    ap.add_argument("--check", action="store_true", help="fail if README.md's sample differs")
    args = ap.parse_args()
    sample = demo_sample()
    print(sample, end="")
    if args.write:
        text = README.read_text()
        old = readme_sample(text)
        README.write_text(text.replace(f"```\n{old}```", f"```\n{sample}```", 1))
    if args.check and readme_sample() != sample:
        print("README.md's sample differs from this run's", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
