"""The embedded default model, its prompts, load_model, and the tiny test architectures.

The entropy and loss bounds are there to catch a broken or untrained model being shipped:
an untrained model is near-uniform (entropy ~ log 512 = 6.24 nats), a collapsed one near 0.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvcouple.models import (  # noqa: E402
    default_model_path,
    default_prompts,
    default_prompts_path,
    load_model,
)
from kvcouple.testing import TINY_ARCHS, tiny_model  # noqa: E402

pytestmark = pytest.mark.torch


def _skip_if_unavailable(arch: str) -> None:
    import transformers

    if arch == "qwen3" and not hasattr(transformers, "Qwen3Config"):
        pytest.skip("Qwen3 needs transformers >= 4.51")


PROMPT_MIN, PROMPT_MAX = 150, 400


@pytest.fixture(scope="module")
def default():
    """The embedded model on CPU in float32, loaded with the Hub switched off."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TRANSFORMERS_OFFLINE", "1")
        torch.set_num_threads(min(2, torch.get_num_threads()))
        model, tok = load_model(device="cpu")
    return model, tok


def test_shipped_files_present():
    path = default_model_path()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (path / name).is_file(), name
    size = sum(f.stat().st_size for f in path.iterdir())
    assert size < 6 * 2**20
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]
    assert cfg["eos_token_id"] is not None


def test_loads_in_fresh_offline_process(tmp_path):
    """No network, an empty HF cache: the default model still loads and generates."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HOME=str(tmp_path))
    code = (
        "import torch; torch.set_num_threads(1)\n"
        "from kvcouple.models import load_model\n"
        "m, t = load_model(device='cpu')\n"
        "ids = t('The event loop', return_tensors='pt').input_ids\n"
        "out = m.generate(ids, max_new_tokens=5, do_sample=False)\n"
        "print(m.dtype, m.training, out.shape[1] - ids.shape[1])\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split()[-3:] == ["torch.float32", "False", "5"]


def test_load_model_defaults(default):
    model, tok = default
    assert not model.training
    assert model.dtype == torch.float32
    assert model.device.type == "cpu"
    assert tok.eos_token_id is not None
    assert model.config.eos_token_id == tok.eos_token_id
    assert tok.bos_token_id is not None


def test_load_model_dtype_by_name():
    model, _ = load_model(default_model_path(), device="cpu", dtype="bfloat16")
    assert model.dtype == torch.bfloat16
    with pytest.raises(ValueError):
        load_model(device="cpu", dtype="int8")


def test_tokenizer_round_trip(default):
    _, tok = default
    texts = [p["text"] for p in default_prompts()[:4]]
    texts.append("Unicode survives byte-level BPE: naïve café, π ≈ 3.14159, 日本語.\n\tTabs too.")
    for text in texts:
        ids = tok(text)["input_ids"]
        assert ids[0] == tok.bos_token_id
        assert tok.decode(ids, skip_special_tokens=True) == text


def test_greedy_generation_is_deterministic(default):
    model, tok = default
    ids = tok(default_prompts()[0]["text"], return_tensors="pt").input_ids
    outs = [
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=20,
            do_sample=False,
            pad_token_id=tok.eos_token_id,
        )
        for _ in range(2)
    ]
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[0][0, : ids.shape[1]], ids[0])
    assert 1 <= outs[0].shape[1] - ids.shape[1] <= 20


def test_prompts_in_token_band(default):
    _, tok = default
    prompts = default_prompts()
    assert default_prompts_path().is_file()
    assert len(prompts) >= 12
    assert len({p["id"] for p in prompts}) == len(prompts)
    for p in prompts:
        n = len(tok(p["text"])["input_ids"])
        assert PROMPT_MIN <= n <= PROMPT_MAX, (p["id"], n)


def test_next_token_entropy_is_non_degenerate(default):
    """Mean next-token entropy and held-out loss of a trained, not collapsed, model."""
    model, tok = default
    log_v = math.log(model.config.vocab_size)
    entropies, losses = [], []
    with torch.no_grad():
        for p in default_prompts():
            ids = tok(p["text"], return_tensors="pt").input_ids
            logp = model(ids).logits[0].float().log_softmax(-1)
            ent = -(logp.exp() * logp).sum(-1)
            entropies.append(ent.mean().item())
            losses.append(-logp[:-1].gather(1, ids[0, 1:, None]).mean().item())
            assert ent.min().item() >= 0.0
            assert ent.max().item() <= log_v + 1e-4
    mean_h, mean_loss = sum(entropies) / len(entropies), sum(losses) / len(losses)
    assert 0.3 < mean_h < 0.6 * log_v, mean_h
    assert mean_loss < 0.6 * log_v, mean_loss  # an untrained model scores ~log V
    # Documents differ: the per-prompt entropies are not all the same number.
    assert max(entropies) - min(entropies) > 0.05


def test_continuations_do_not_stop_at_once(default):
    """EOS is absorbing in kvcouple's kernels: a model that ends right after every prompt
    would leave nothing for an eviction to change."""
    model, tok = default
    p_eos = []
    with torch.no_grad():
        for p in default_prompts():
            ids = tok(p["text"], return_tensors="pt").input_ids
            p_eos.append(model(ids).logits[0, -1].float().softmax(-1)[tok.eos_token_id].item())
    assert sum(p_eos) / len(p_eos) < 0.1, p_eos


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_model_builds(arch):
    _skip_if_unavailable(arch)
    model = tiny_model(arch, seed=3)
    cfg = model.config
    assert cfg.model_type == arch
    assert cfg.num_key_value_heads < cfg.num_attention_heads
    assert cfg.eos_token_id is not None
    assert not model.training
    assert model.dtype == torch.float32
    ids = torch.tensor([[0, 5, 17, 99, 3, 42]])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, 6, cfg.vocab_size)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_model_is_deterministic_in_seed(arch):
    _skip_if_unavailable(arch)
    ids = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7]])
    state = torch.random.get_rng_state()
    with torch.no_grad():
        a = tiny_model(arch, seed=7)(ids).logits
        b = tiny_model(arch, seed=7)(ids).logits
        c = tiny_model(arch, seed=8)(ids).logits
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert torch.equal(torch.random.get_rng_state(), state)  # global RNG untouched


def test_tiny_model_rejects_unknown_arch():
    with pytest.raises(ValueError, match="unknown tiny architecture"):
        tiny_model("no_such_arch")


def test_package_imports_without_torch():
    code = (
        "import sys\n"
        "import kvcouple.models, kvcouple.testing\n"
        "kvcouple.models.default_model_path(); kvcouple.models.default_prompts()\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr[-2000:]
