"""The README's "Using it" snippets run as shown, in order, in an empty folder: the Python
kernels snippet, the synthetic pairs, a trace of the embedded model with a prompt file written
on the spot, a plug-in policy from a .py file, and a dry-run memory plan."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).parents[2] / "README.md"


def _snippets() -> list[tuple[str, str]]:
    text = README.read_text()
    section = text.split("\n## Using it\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```(python|bash)\n(.*?)```", section, re.S)


def test_the_using_it_section_has_the_snippets_it_promises():
    kinds = [kind for kind, _ in _snippets()]
    assert kinds == ["python", "bash", "bash", "bash", "bash"], kinds
    code = "\n".join(body for _, body in _snippets())
    for defined in ("p = ", "q = ", "u = "):  # the arrays the kernels take
        assert defined in code
    assert "--model" not in code.split("kvcouple trace", 1)[1].split("\n")[0]


@pytest.mark.torch
def test_the_using_it_snippets_run(tmp_path):
    pytest.importorskip("transformers")
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    bin_dir = str(Path(sys.executable).parent)
    env = {
        **os.environ,
        "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
        "HF_HUB_OFFLINE": "1",
        "KVCOUPLE_NUM_THREADS": "1",
    }
    if shutil.which("kvcouple", path=env["PATH"]) is None:
        pytest.skip("the kvcouple command is not installed")
    outputs = []
    for kind, body in _snippets():
        argv = [sys.executable, "-c", body] if kind == "python" else ["bash", "-e", "-c", body]
        done = subprocess.run(
            argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, (kind, body, done.stdout[-2000:], done.stderr[-2000:])
        outputs.append(done.stdout)
    assert "P(x != y)" not in outputs[0] and outputs[0].strip()
    assert "E[M]/T" in outputs[2] and "unobserved" not in outputs[2]  # window covers T
    assert (tmp_path / "report" / "report.html").is_file()
    assert (tmp_path / "mine.zarr").is_dir()  # the plug-in policy traced
    assert "memory plan" in outputs[4] and not (tmp_path / "plan.zarr").exists()
