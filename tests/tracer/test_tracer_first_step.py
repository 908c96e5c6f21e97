"""kvcouple.tracer.first_step: the public one-step view agrees with an independent masked
forward pass and with the first hazard the tracer records."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvcouple.torch_coupling import apply_decoding  # noqa: E402
from kvcouple.tracer import TraceSettings, first_step, trace_document  # noqa: E402
from tracer_helpers import PROMPT, kept_positions, masked_forward, model  # noqa: E402

pytestmark = pytest.mark.torch


def _softmax(x: np.ndarray) -> np.ndarray:
    return apply_decoding(torch.as_tensor(x)).double().numpy()


def test_first_step_is_the_masked_full_model_and_the_traced_first_hazard():
    m = model("llama")
    specs = ["recent:retain=0.3", "streaming:sinks=2,retain=0.5", "full"]
    steps = first_step(m, PROMPT, specs)
    assert [s.policy for s in steps] == [
        "recent:retain=0.3",
        "streaming:retain=0.5,sinks=2",
        "full",
    ]
    n = len(PROMPT)
    p_want = masked_forward(m, PROMPT, n, set(range(n)))[0]
    settings = TraceSettings(horizon=1, replicates=2, branches=1, window=0)
    arr, _ = trace_document(m, PROMPT, specs, settings, seed=0)
    for i, (spec, s) in enumerate(zip(specs, steps, strict=True)):
        assert s.prompt_length == n and s.logits_p.dtype == np.float64
        p, q = _softmax(s.logits_p), _softmax(s.logits_q)
        np.testing.assert_allclose(p, p_want, atol=1e-5)
        kept = kept_positions(spec, n)
        assert s.kept == len(kept)
        np.testing.assert_allclose(q, masked_forward(m, PROMPT, n, kept)[0], atol=1e-5)
        tv = 0.5 * np.abs(p - q).sum()
        np.testing.assert_allclose(arr["hazard"][i, :, 0], tv, atol=1e-5)
    assert steps[2].kept == n and np.allclose(steps[2].logits_p, steps[2].logits_q)
    assert 0.05 < 0.5 * np.abs(_softmax(steps[0].logits_p) - _softmax(steps[0].logits_q)).sum()


def test_first_step_refuses_a_one_token_prompt():
    from kvcouple.tracer.prefill import PromptTooShortError

    with pytest.raises(PromptTooShortError, match="at least 2"):
        first_step(model("llama"), [5], ["recent:retain=0.5"])
