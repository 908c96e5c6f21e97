"""The support probe's tolerance: measured rounding passes in every floating dtype, a real
mismatch is refused naming the measured difference and the tolerance (a model that ignores
its attention mask; a tracer cache that loses an entry)."""

import pytest

torch = pytest.importorskip("torch")

from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: E402

from kvcouple.testing import tiny_model  # noqa: E402
from kvcouple.tracer import compat, support  # noqa: E402
from kvcouple.tracer.support import (  # noqa: E402
    NOISE_FACTOR,
    ProbeMeasure,
    UnsupportedModelError,
    check_support,
)

pytestmark = pytest.mark.torch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_probe_passes_in_every_dtype_and_reports_its_figures(dtype, attn):
    m = tiny_model("llama", seed=3, attn_implementation=attn).to(dtype)
    probe = check_support(m).probe
    assert isinstance(probe, ProbeMeasure)
    eps = torch.finfo(dtype).eps
    assert probe.tolerance == pytest.approx(max(NOISE_FACTOR * probe.noise, eps**0.5))
    assert 0 <= probe.difference <= probe.tolerance < probe.effect <= 1


def test_tolerance_is_the_larger_of_measured_noise_and_the_dtype_floor():
    logits = torch.zeros(2, 5)
    quiet = ProbeMeasure.of(logits, logits, torch.float32)
    assert quiet.noise == 0 and quiet.tolerance == pytest.approx(
        torch.finfo(torch.float32).eps ** 0.5
    )
    noisy = logits.clone()
    noisy[1, 0] = 0.5  # the un-evicted rows disagree: the noise sets the tolerance
    m = ProbeMeasure.of(noisy, logits, torch.float32)
    assert m.noise > 0.05 and m.tolerance == pytest.approx(NOISE_FACTOR * m.noise)


def test_a_model_that_ignores_its_attention_mask_is_refused(monkeypatch):
    plain = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def maskless(module, query, key, value, attention_mask, **kwargs):
        # Causal within a prefill, blind to every eviction mask.
        return plain(module, query, key, value, None, **kwargs)

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "sdpa", maskless)
    m = tiny_model("llama", seed=4)  # fresh: no verdict kept
    with pytest.raises(UnsupportedModelError, match="ignores its attention mask") as e:
        check_support(m)
    assert "total variation" in str(e.value) and "tolerance" in str(e.value)


def test_a_tracer_cache_that_loses_an_entry_is_refused(monkeypatch):
    build = compat.additive_mask

    def losing(rows):
        def mask(valid, dtype):  # these rows of the tracer's re-fed token lose an entry
            valid = valid.clone()
            valid[rows, -2] = False
            return build(valid, dtype)

        return mask

    monkeypatch.setattr(support.compat, "additive_mask", losing([0]))
    with pytest.raises(UnsupportedModelError, match="differs from a plain masked forward") as e:
        check_support(tiny_model("llama", seed=5))
    text = str(e.value)
    assert "total variation" in text and "tolerance" in text and "float32" in text
    # Lost on the un-evicted row too: the noise it measures is no rounding to widen a tolerance.
    monkeypatch.setattr(support.compat, "additive_mask", losing([0, 1]))
    with pytest.raises(UnsupportedModelError, match="even with nothing evicted"):
        check_support(tiny_model("llama", seed=6))
