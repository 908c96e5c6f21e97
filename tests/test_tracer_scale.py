"""The tracer at scale: provenance attributes, the memory plan, ``--dry-run``."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import xarray as xr  # noqa: E402

from kvcouple import __version__  # noqa: E402
from kvcouple.cli import main as cli_main  # noqa: E402
from kvcouple.tracer import Prompt, TraceSettings, trace  # noqa: E402
from kvcouple.tracer.provenance import resolved_revision  # noqa: E402

pytestmark = pytest.mark.torch

from tracer_helpers import model, one_thread  # noqa: E402, F401 - autouse fixture

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _prompt_file(path, lengths):
    rng = np.random.default_rng(3)
    path.write_text(
        "".join(
            json.dumps({"id": f"d{i}", "input_ids": rng.integers(1, 100, n).tolist()}) + "\n"
            for i, n in enumerate(lengths)
        )
    )
    return path


def test_store_carries_provenance(tmp_path):
    m = model("llama")
    prompts = [Prompt("a", tuple(range(1, 13)))]
    trace(
        m,
        prompts,
        ["recent:retain=0.5"],
        TraceSettings(horizon=2),
        tmp_path / "s",
        model_revision="v1",
        progress=False,
    )
    attrs = xr.open_zarr(tmp_path / "s").attrs
    assert attrs["torch_version"] == torch.__version__
    assert attrs["transformers_version"] == transformers.__version__
    assert attrs["kvcouple_version"] == __version__
    assert attrs["device"] == "cpu"
    assert attrs["dtype"] == "float32"
    assert attrs["attn_implementation"] == "sdpa"
    # An in-memory model has no snapshot: the requested revision is what is known.
    assert attrs["model_revision"] == "v1"


def test_revision_resolved_from_a_hub_snapshot(tmp_path, capsys):
    """A model loaded by path from a Hub cache snapshot records the snapshot's commit hash,
    with or without --revision."""
    snapshot = tmp_path / "hub" / "models--org--tiny" / "snapshots" / COMMIT
    model("llama").save_pretrained(snapshot)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(snapshot)
    assert resolved_revision(loaded) == COMMIT
    assert resolved_revision(loaded, "main") == COMMIT
    assert resolved_revision(model("llama"), None) == ""

    prompts = _prompt_file(tmp_path / "p.jsonl", [10])
    out = tmp_path / "run.zarr"
    args = ["trace", "--model", str(snapshot), "--prompts", str(prompts), "--out", str(out)]
    args += ["--policy", "recent:retain=0.5", "--horizon", "2", "--replicates", "1"]
    assert cli_main([*args, "--quiet", "--device", "cpu"]) == 0
    capsys.readouterr()
    assert xr.open_zarr(out).attrs["model_revision"] == COMMIT
