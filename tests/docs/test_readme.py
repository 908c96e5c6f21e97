"""The README's "Using it" snippets run as shown, in order, in an empty folder: the Python
kernels snippet, the synthetic pairs, a trace of the embedded model with a prompt file written
on the spot, a plug-in policy from a .py file, and a dry-run memory footprint."""

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
    assert "document 'letter'" in outputs[2] and "divergence" in outputs[2]
    assert (tmp_path / "report" / "report.html").is_file()
    assert (tmp_path / "mine.zarr").is_dir()  # the plug-in policy traced
    assert "memory footprint" in outputs[4] and not (tmp_path / "plan.zarr").exists()


def _sample_script():
    import importlib.util

    path = README.parent / "scripts" / "readme_sample.py"
    spec = importlib.util.spec_from_file_location("readme_sample", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_demo_sample_ends_as_the_demo_words_its_own_numbers():
    """The README's sample of ``kvcouple demo``: its closing sentences are the demo's own
    wording (kvcouple.demo.found_lines) of the numbers in its table, and a pair of diverging
    continuations follows. Fast: the numbers themselves are checked against a real run by the
    next test."""
    from kvcouple.demo import found_lines

    lines = _sample_script().readme_sample().splitlines()
    header = next(x for x in lines if x.startswith(" " * 20))
    labels = header.split()
    rows = {"occurrence P(tau<=T)": "occurrence", "mismatch rate rho": "rho"}
    rows["E[M]/T"] = "mismatch_fraction"
    est = {}
    for line in lines:
        for title, name in rows.items():
            if line.startswith(title + " "):
                cells = re.findall(r"(\S+) \[[^\]]*\]", line[len(title) :])
                assert len(cells) == len(labels), line
                est.update({(lab, name): c for lab, c in zip(labels, cells, strict=True)})
    assert len(est) == 3 * len(labels)
    found = found_lines(est, {lab: lab for lab in labels}, 32)
    start = lines.index("== what it found")
    assert lines[start : start + len(found)] == found
    pair = lines[start + len(found) :]
    assert pair[0].startswith("== one pair of continuations: ")
    assert pair[1].startswith("   kvcouple show ~/.cache/kvcouple/demo/run-")
    assert [x[:15] for x in pair[-3:]] == ["  shared       ", "  P, full     >", "  Q, evicted  >"]


@pytest.mark.torch
@pytest.mark.slow
def test_the_demo_sample_is_a_real_runs_output():
    """The README's sample equals a fresh run of the demo (a minute on two cores: run with
    KVCOUPLE_README_DEMO=1, as ``python scripts/readme_sample.py --check`` does)."""
    if os.environ.get("KVCOUPLE_README_DEMO", "") in ("", "0"):
        pytest.skip("the full demo takes a minute: set KVCOUPLE_README_DEMO=1 to compare")
    pytest.importorskip("transformers")
    script = _sample_script()
    assert script.readme_sample() == script.demo_sample()
