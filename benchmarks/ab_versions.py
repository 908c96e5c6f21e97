"""Two versions of kvcouple side by side: `kvcouple analyze` and the read floor of one store,
run in turns (ABBA...), so that both meet the same machine. On a shared machine whose speed
moves by 10-30% over minutes, figures from runs minutes apart cannot say which version is
faster; runs in turns can.

    python benchmarks/ab_versions.py STORE --baseline-ref f2ea6c4 [--pairs 4] [--reuse-core]

The baseline is built from a git ref in a scratch worktree (`maturin build --release` into
its own target folder, ``target/ab-baseline``) and imported through PYTHONPATH; the
other side is the installed kvcouple (this checkout). Prints each run and, per version, the
minimum and median of wall and CPU seconds.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent


# What the compiled ``_core`` is built from.
RUST_SOURCES = ["rust/core/src", "rust/store/src", "rust/python/src", "Cargo.toml", "Cargo.lock"]


def build_baseline(ref: str, scratch: Path, reuse_core: bool = False) -> Path:
    """The baseline's ``python`` folder with its compiled ``_core`` in place; with
    ``reuse_core``, this checkout's ``_core`` (refused unless the ref's Rust sources are this
    checkout's: for changes to the Python alone, no build)."""
    tree = scratch / "tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", str(tree), ref], check=True)
    if reuse_core:
        same = subprocess.run(["git", "-C", str(ROOT), "diff", "--quiet", ref, "--", *RUST_SOURCES])
        if same.returncode != 0:
            raise SystemExit(
                f"--reuse-core: the Rust sources differ between {ref} and this checkout"
            )
        import kvcouple._core  # this checkout's build

        core = Path(kvcouple._core.__file__)  # type: ignore[arg-type]
        shutil.copy(core, tree / "python" / "kvcouple" / core.name)
        return tree / "python"
    # Its own target folder: cargo hashes a workspace's path crates by their path inside the
    # workspace, so a worktree sharing this checkout's folder overwrites this checkout's
    # artifacts under fingerprints that still look fresh, and the next `make develop` then
    # installs the baseline's code.
    env = dict(os.environ, CARGO_TARGET_DIR=str(ROOT / "target" / "ab-baseline"))
    wheels = scratch / "wheels"
    built = subprocess.run(
        [sys.executable, "-m", "maturin", "build", "--release", "-o", str(wheels)],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
    )
    if built.returncode != 0:
        raise RuntimeError(f"building {ref} failed:\n{built.stderr[-4000:]}")
    (wheel,) = wheels.glob("*.whl")
    with zipfile.ZipFile(wheel) as z:
        (name,) = [n for n in z.namelist() if n.startswith("kvcouple/_core.") and n.endswith(".so")]
        (tree / "python" / name).write_bytes(z.read(name))
    return tree / "python"


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Wall and CPU seconds of ``cmd`` in a child process (its own resource usage)."""
    with tempfile.TemporaryFile() as err:
        t = time.perf_counter()
        child = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=err, env=env, cwd=tempfile.gettempdir()
        )
        _, status, usage = os.wait4(child.pid, 0)
        seconds = time.perf_counter() - t
        if status != 0:
            err.seek(0)
            raise RuntimeError(f"{cmd[2:4]} failed: {err.read().decode()[-2000:]}")
    return seconds, usage.ru_utime + usage.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("store")
    ap.add_argument("--baseline-ref", required=True, help="git ref of the version to compare")
    ap.add_argument("--pairs", type=int, default=4, help="runs of each version and mode")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--reuse-core",
        action="store_true",
        help="the baseline's Python with this checkout's compiled _core (no build; refused "
        "where the Rust sources differ)",
    )
    a = ap.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="kvcouple-ab-"))
    try:
        baseline = build_baseline(a.baseline_ref, scratch, a.reuse_core)
        user = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE",)}
        envs = {
            a.baseline_ref: dict(user, PYTHONPATH=str(baseline)),
            "this checkout": {k: v for k, v in user.items() if k != "PYTHONPATH"},
        }
        out = scratch / "out"
        modes = {
            "command": [sys.executable, "-m", "kvcouple.cli", "analyze", a.store, "--out",
                        str(out), "--no-figures", "--quiet", "--io-threads", str(a.threads)],
            "floor": [sys.executable, str(HERE / "bench_analysis.py"), "--_run", "summary-read",
                      a.store, "--threads", str(a.threads)],
        }  # fmt: skip
        got: dict[tuple[str, str], list[tuple[float, float]]] = {}
        names = list(envs)
        for i in range(a.pairs):
            for mode, cmd in modes.items():
                for name in names if i % 2 == 0 else names[::-1]:
                    shutil.rmtree(out, ignore_errors=True)
                    wall, cpu = timed(cmd, envs[name])
                    got.setdefault((mode, name), []).append((wall, cpu))
                    print(f"{mode:8} {name:14} {wall:6.2f} s  {cpu:6.2f} CPU s", flush=True)
        for (mode, name), runs in got.items():
            walls, cpus = [w for w, _ in runs], [c for _, c in runs]
            print(
                f"{mode:8} {name:14} wall min {min(walls):.2f} median {statistics.median(walls):.2f}"
                f"  CPU min {min(cpus):.2f} median {statistics.median(cpus):.2f}"
            )
    finally:
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(scratch / "tree")],
            check=False,
        )
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
