"""The tracer's entry points behave as ``trace`` does (three bugs found by reading, issue 20,
each pinned by a test that failed before its fix):

- ``first_step`` applies the policy's admission step (a gated ``page:`` policy runs) and seeds
  each policy with the engine's per-(document, policy) seed, so its first step is the first
  step of ``trace``;
- ``trace_document`` with default settings absorbs at the model's own EOS ids, as ``trace``
  does (``TraceSettings.eos_token_ids=None`` means "the model's own");
- ``import kvcouple.tracer`` (and every tracer module) works without zarr; writing a store
  without zarr fails with one clear line.
"""

import subprocess
import sys
import textwrap

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvcouple.store import Record  # noqa: E402
from kvcouple.testing.tiny_models import tiny_model  # noqa: E402
from kvcouple.torch_coupling import apply_decoding  # noqa: E402
from kvcouple.tracer import Decoding, TraceSettings, first_step, trace_document  # noqa: E402
from tracer_helpers import PROMPT, model  # noqa: E402

pytestmark = pytest.mark.torch


def _first_q(arrays: dict, policy: int) -> np.ndarray:
    """Q's first-step distribution of replicate 0 from a ``full`` record."""
    return arrays["q"][policy, 0, 0].astype(np.float64)


def _softmax(x: np.ndarray) -> np.ndarray:
    return apply_decoding(torch.as_tensor(x)).double().numpy()


def test_first_step_is_the_first_step_of_trace_for_gated_and_random_policies():
    m = model("llama")
    specs = ["recent:retain=0.5", "random:retain=0.4", "page:base=snapkv,retain=0.5"]
    settings = TraceSettings(horizon=1, replicates=1, window=0, record=Record.parse("full"))
    for seed in (0, 3):
        steps = first_step(m, PROMPT, specs, seed=seed)  # page: no longer raises
        arr, _ = trace_document(m, PROMPT, specs, settings, seed=seed)
        for i, s in enumerate(steps):
            # float16 records: the same distribution to their precision.
            np.testing.assert_allclose(_softmax(s.logits_q), _first_q(arr, i), atol=2e-3)
            assert s.kept == int(arr["kept_length"][i])
    # The comparison can fail: another seed keeps other entries, so another q.
    other = first_step(m, PROMPT, ["random:retain=0.4"], seed=1)[0]
    arr, _ = trace_document(m, PROMPT, ["random:retain=0.4"], settings, seed=0)
    assert np.abs(_softmax(other.logits_q) - _first_q(arr, 0)).max() > 1e-2


def test_trace_document_absorbs_at_the_models_eos_by_default():
    from kvcouple.tracer.model import model_eos_ids

    m = tiny_model("llama", seed=7)
    # Make the most likely first token the EOS, so that paths emit it within the horizon.
    (step,) = first_step(m, PROMPT, ["full"])
    eos = int(np.argmax(step.logits_p))
    m.config.eos_token_id = eos
    m.generation_config.eos_token_id = eos
    assert model_eos_ids(m) == (eos,)
    base = dict(
        horizon=4,
        replicates=8,
        window=1,
        record=Record.parse("topk:2"),
        decoding=Decoding(temperature=0.3),  # sharp: the likely EOS is drawn
    )
    default, _ = trace_document(m, PROMPT, ["recent:retain=0.5"], TraceSettings(**base), seed=2)
    explicit, _ = trace_document(
        m, PROMPT, ["recent:retain=0.5"], TraceSettings(**base, eos_token_ids=(eos,)), seed=2
    )
    none, _ = trace_document(
        m, PROMPT, ["recent:retain=0.5"], TraceSettings(**base, eos_token_ids=()), seed=2
    )
    tokens = default["tokens"][0]
    assert (tokens[:, :-1] == eos).any(), "no path emitted the EOS: the test would be vacuous"
    for name in ("tokens", "hazard", "topk_ids_p", "topk_probs_p"):
        np.testing.assert_array_equal(default[name], explicit[name])
    # After an EOS the path's kernels are a point mass on it: hazard 0, the EOS again.
    r, t = np.argwhere(tokens[:, :-1] == eos)[0]
    assert default["hazard"][0, r, t + 1] == 0 and tokens[r, t + 1] == eos
    assert not np.array_equal(default["hazard"], none["hazard"])


_WITHOUT_ZARR = """
import importlib, pkgutil, sys
sys.modules["zarr"] = None  # `import zarr` now raises ModuleNotFoundError
import kvcouple.tracer
from kvcouple.tracer import TraceSettings, first_step, trace, trace_document, Prompt
for info in pkgutil.iter_modules(kvcouple.tracer.__path__):
    importlib.import_module(f"kvcouple.tracer.{info.name}")
assert "zarr" not in {m.partition(".")[0] for m in sys.modules if sys.modules[m] is not None}
from kvcouple.testing import tiny_model
m = tiny_model("llama", seed=1)
arrays, _ = trace_document(m, list(range(1, 9)), ["recent:retain=0.5"], TraceSettings(horizon=2))
assert arrays["hazard"].shape == (1, 1, 2)
try:
    trace(m, [Prompt("d", tuple(range(1, 9)))], ["full"], TraceSettings(horizon=2), OUT)
except Exception as e:
    print(type(e).__name__ + ": " + str(e))
else:
    raise SystemExit("a store was written without zarr")
"""


def test_the_tracer_imports_and_traces_without_zarr_and_writing_says_so(tmp_path):
    out = tmp_path / "s.zarr"
    code = f"OUT = {str(out)!r}\n" + textwrap.dedent(_WITHOUT_ZARR)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1 and "zarr" in lines[0] and "pip install" in lines[0], done.stdout
    assert not out.exists()
