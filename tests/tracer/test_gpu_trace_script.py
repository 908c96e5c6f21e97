"""benchmarks/gpu_trace.py runs where only the kvcouple wheel is (the GPU image: no zarr):
``--tiny`` in a subprocess whose ``import zarr`` fails, with the decoding step's figures."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytestmark = pytest.mark.torch  # -m "not torch" deselects the module

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_trace.py"

# A meta-path finder that makes zarr unimportable, as if it were not installed.
BLOCKER = """
import importlib.abc, sys

class _NoZarr(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "zarr" or name.startswith("zarr."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
        return None

sys.meta_path.insert(0, _NoZarr())
"""


def test_gpu_trace_tiny_runs_without_zarr(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
    }
    blocked = subprocess.run([sys.executable, "-c", "import zarr"], env=env, capture_output=True)
    assert blocked.returncode != 0 and b"blocked" in blocked.stderr  # the blocker is in force
    out = tmp_path / "gpu.json"
    args = ["--tiny", "--prompts", "24", "--horizon", "3", "--window", "1", "--branches", "2"]
    args += ["--short-docs", "2", "--short-length", "16", "--out", str(out)]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["compile_modes"] == ["off"]
    floor = report["weight_read_floor_ms"]
    assert report["copy_bandwidth_bytes_per_s"] > 0 and floor > 0
    assert floor == pytest.approx(
        1e3 * report["model"]["weight_bytes"] / report["copy_bandwidth_bytes_per_s"]
    )
    (row,) = report["results"]
    decode = row["decode"]
    assert decode["horizons"] == [2, 6] and decode["floor_ms"] == floor
    step = decode["off"]
    assert step["trace_ms_per_step"] >= 0 and decode["generate_ms_per_step"] >= 0
    assert step["over_floor"] == pytest.approx(step["trace_ms_per_step"] / floor)
    if step["trace_ms_per_step"] > 0:
        rows = 2 * report["settings"]["R"]
        assert step["trace_tokens_per_s"] == pytest.approx(rows * 1e3 / step["trace_ms_per_step"])
    assert "weight-read floor" in done.stdout and "decode, compile off" in done.stdout
