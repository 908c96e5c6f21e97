"""Check a built wheel is portable: `auditwheel show` must place it at manylinux_2_28 or older,
and its tag must be abi3 (one wheel for every CPython >= 3.10). Prints auditwheel's report.

    python .ci/check_wheel.py dist/kvcouple-*.whl
"""

import re
import subprocess
import sys
from pathlib import Path

NEWEST_GLIBC = (2, 28)


def check(wheel: Path) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-m", "auditwheel", "show", str(wheel)],
        capture_output=True,
        text=True,
        check=False,
    )
    print(out.stdout + out.stderr)
    if out.returncode:
        return [f"{wheel.name}: auditwheel show failed ({out.returncode})"]
    text = " ".join(out.stdout.split())  # auditwheel wraps lines
    m = re.search(
        r'consistent with the following platform tag: "(manylinux_(\d+)_(\d+)_\w+)"', text
    )
    if m is None:
        return [f"{wheel.name}: auditwheel names no manylinux tag"]
    problems = []
    if (int(m[2]), int(m[3])) > NEWEST_GLIBC:
        problems.append(f"{wheel.name}: {m[1]} is newer than manylinux_2_28")
    if "-abi3-" not in wheel.name:
        problems.append(f"{wheel.name}: not an abi3 wheel")
    if f"{m[2]}_{m[3]}" not in wheel.name:
        problems.append(f"{wheel.name}: file tag differs from auditwheel's {m[1]}")
    return problems


def main() -> int:
    wheels = [Path(a) for a in sys.argv[1:]]
    if not wheels:
        print("usage: check_wheel.py WHEEL...", file=sys.stderr)
        return 2
    problems = [p for w in wheels for p in check(w)]
    for p in problems:
        print(f"error: {p}", file=sys.stderr)
    if not problems:
        print(f"{len(wheels)} wheel(s): manylinux_2_28 or older, abi3")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
