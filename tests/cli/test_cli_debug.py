"""`--debug` and `KVCOUPLE_DEBUG=1` print the traceback from every command, nested ones too."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def kvcouple(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if k != "KVCOUPLE_DEBUG"}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "kvcouple.cli", *argv],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=300,
    )


def test_analyze_error_is_one_line_without_debug(tmp_path):
    proc = kvcouple("analyze", str(tmp_path / "nothing"), "--out", str(tmp_path / "r"))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"kvcouple analyze: error: no trace store at {tmp_path / 'nothing'}"
    ]


@pytest.mark.parametrize("how", ["flag", "env"])
def test_analyze_error_shows_the_traceback_with_debug(tmp_path, how):
    argv = ["analyze", str(tmp_path / "nothing"), "--out", str(tmp_path / "r")]
    if how == "flag":
        proc = kvcouple("--debug", *argv)
    else:
        proc = kvcouple(*argv, env={"KVCOUPLE_DEBUG": "1"})
    assert proc.returncode != 0
    assert "Traceback (most recent call last)" in proc.stderr
    assert "StoreError: no trace store at" in proc.stderr


def test_info_and_plan_errors_show_the_traceback_with_debug(tmp_path):
    info = kvcouple("--debug", "info", str(tmp_path / "nothing"))
    assert "Traceback (most recent call last)" in info.stderr
    plan = kvcouple("--debug", "plan", "show", str(tmp_path / "missing.toml"))
    assert plan.returncode != 0
    assert "Traceback (most recent call last)" in plan.stderr


@pytest.mark.torch
def test_demo_with_debug_shows_the_traceback(tmp_path):
    pytest.importorskip("torch")
    # A model that is not there passes the argument checks (argparse refuses a bad number
    # before any traceback) and fails when the demo runs.
    missing = str(tmp_path / "no-such-model")
    proc = kvcouple("--debug", "demo", "--model", missing, "--out", str(tmp_path / "demo"))
    assert proc.returncode != 0
    assert "Traceback (most recent call last)" in proc.stderr
    assert "no such local directory or file" in proc.stderr
    plain = kvcouple("demo", "--model", missing, "--out", str(tmp_path / "demo2"))
    assert plain.returncode != 0
    assert "Traceback" not in plain.stderr
    assert "no such local directory or file" in plain.stderr
