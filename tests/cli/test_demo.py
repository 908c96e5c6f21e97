"""``kvcouple demo`` end to end on a small slice: it prints the decomposition per policy, the
printed numbers obey the identity they decompose, it is silent with --quiet, and it writes
under its documented directory rather than the current one."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytestmark = pytest.mark.torch  # -m "not torch" deselects the module

ROWS = ("occurrence", "first mismatch", "exposure", "mismatch rate", "E[M]/T")
# Three significant figures (kvcouple.analysis.labels.number): 0.605, 0.0189, 0 for an exact 0.
DIGITS = r"(\d(?:\.\d+)?(?:e-\d+)?)"
NUMBER = rf"{DIGITS} \[{DIGITS}, {DIGITS}\]"


@pytest.mark.torch
def test_demo_prints_the_decomposition_quietly_into_its_directory(tmp_path: Path) -> None:
    home, cwd = tmp_path / "demo-home", tmp_path / "cwd"
    cwd.mkdir()
    env = {**os.environ, "KVCOUPLE_DEMO_DIR": str(home), "HF_HUB_OFFLINE": "1"}
    argv = ["demo", "--docs", "3", "--horizon", "6", "--replicates", "2", "--branches", "1"]
    argv += ["--policy", "snapkv:retain=0.5", "--policy", "recent:retain=0.5", "--quiet"]
    out = subprocess.run(
        [sys.executable, "-m", "kvcouple.cli", *argv, "--jobs", "2"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    # --quiet: no progress bars, not even transformers' "Loading weights".
    assert "Loading weights" not in out.stderr
    assert "it/s" not in out.stderr and "doc/s" not in out.stderr, out.stderr
    lines = {row: line for line in out.stdout.splitlines() for row in ROWS if line.startswith(row)}
    assert set(lines) == set(ROWS), out.stdout
    header = next(x for x in out.stdout.splitlines() if x.startswith(" " * 20))
    assert "snapkv:retain=0.5" in header and "recent:retain=0.5" in header
    # Every policy once with its full spec, before the table; the run named in words.
    assert "  snapkv:retain=0.5 = snapkv:retain=0.5,window=32,kernel=7,pool=avg" in out.stdout
    assert "  recent:retain=0.5 = recent:retain=0.5" in out.stdout
    assert "T = 6 tokens generated per trajectory,\n  L = 6 lags traced" in out.stdout
    assert "exploratory (no plan); wrote" in out.stdout and "plan hash" not in out.stdout
    values = {row: re.findall(NUMBER, line) for row, line in lines.items()}
    for row, cells in values.items():
        assert len(cells) == 2, (row, lines[row])  # one per policy
        for est, lo, hi in cells:
            assert float(lo) <= float(est) <= float(hi), (row, est, lo, hi)
    for j in range(2):  # E[M]/T = P(tau<=T)/T + exposure * rho, to the printed digits
        first, exposure, rho, total = (
            float(values[r][j][0])
            for r in ("first mismatch", "exposure", "mismatch rate", "E[M]/T")
        )
        # Each printed number is within half a unit of its third significant figure.
        slack = 5e-4 * (1 + exposure + rho) + 5e-3 * max(first, total)
        assert total == pytest.approx(first + exposure * rho, abs=slack)
    assert not any(cwd.iterdir()), "the demo wrote into the current directory"
    runs = list(home.glob("run-*"))
    assert len(runs) == 1
    assert (runs[0] / "run.zarr" / "completed").exists()
    assert (runs[0] / "report" / "report.html").is_file()
    assert str(runs[0] / "report" / "report.html") in out.stdout


def test_the_closing_sentence_does_not_print_a_rate_above_100_percent_as_a_fact():
    from kvcouple.demo import found_lines

    est = {("p", "occurrence"): "0.859", ("p", "rho"): "1.11", ("p", "mismatch_fraction"): "0.61"}
    text = " ".join(found_lines(est, {"p": "p"}, 8))
    assert "nearly all of its tokens differed" in text and "above 100%" in text
    est[("p", "rho")] = "0.613"
    assert "61.3% of its tokens differed" in " ".join(found_lines(est, {"p": "p"}, 8))
