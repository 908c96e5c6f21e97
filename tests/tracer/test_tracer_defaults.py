"""The Python API and the CLI trace the same run by default (EOS ids from the model)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import xarray as xr  # noqa: E402

from kvcouple.testing.tiny_models import tiny_model  # noqa: E402
from kvcouple.tracer import Prompt, TraceSettings, trace  # noqa: E402
from kvcouple.tracer.model import model_eos_ids  # noqa: E402

pytestmark = pytest.mark.torch


def test_default_eos_is_the_models_and_empty_means_none(tmp_path):
    m = tiny_model("llama", vocab_size=64)
    eos = model_eos_ids(m)
    assert eos == (63,)
    ids = [int(x) for x in np.random.default_rng(1).integers(1, 62, size=12)]
    prompts = [Prompt("a", tuple(ids))]
    kw = {"seed": 1, "progress": False}
    default = trace(
        m, prompts, ["recent:retain=0.5"], TraceSettings(horizon=3), tmp_path / "d", **kw
    )
    assert xr.open_zarr(default.store).attrs["eos_token_id"] == [63]
    none = TraceSettings(horizon=3, eos_token_ids=())
    trace(m, prompts, ["recent:retain=0.5"], none, tmp_path / "n", **kw)
    assert xr.open_zarr(tmp_path / "n").attrs["eos_token_id"] == []
