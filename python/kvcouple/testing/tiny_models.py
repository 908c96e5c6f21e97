"""Tiny random-weight causal LMs of real Hugging Face architectures, for tests.

Each model has grouped-query attention (4 query heads sharing 2 KV heads, head_dim 16),
2 layers, float32 weights, eval mode, and is a deterministic function of its arguments
(weights are drawn under ``seed`` without touching torch's global RNG). There is no
tokenizer: feed any token ids in ``[0, vocab_size)``. ``bos_token_id`` is 0 and
``eos_token_id`` is ``vocab_size - 1`` (also the pad id).

Weights are drawn with ``init_std=0.2`` rather than the usual 0.02 so that next-token
distributions are visibly non-uniform (with 0.02 every row is nearly uniform and an eviction
changes almost nothing, which makes tracer tests weak).

Example::

    from kvcouple.testing import tiny_model
    model = tiny_model("qwen2", seed=1)
    logits = model(torch.tensor([[0, 5, 7, 9]])).logits   # (1, 4, 128)
"""

from __future__ import annotations

from typing import Any

TINY_ARCHS = ("llama", "qwen2", "qwen3", "mistral")

_CONFIG_CLASSES = {
    "llama": "LlamaConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
    "mistral": "MistralConfig",
}


def tiny_model(
    arch: str,
    *,
    seed: int = 0,
    vocab_size: int = 128,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 128,
    max_position_embeddings: int = 512,
    init_std: float = 0.2,
    attn_implementation: str | None = None,
    **config_overrides: Any,
) -> Any:
    """Build a tiny random-weight causal LM of architecture ``arch`` (one of ``TINY_ARCHS``).

    ``hidden_size`` is ``num_attention_heads * head_dim`` (64 by default). ``attn_implementation``
    (``"eager"``, ``"sdpa"``) is passed to the config when given; ``config_overrides`` go to the
    config constructor as well. Returns the model (float32, CPU, eval mode) with
    ``config.eos_token_id`` and its generation config set.
    """
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig

    if arch not in _CONFIG_CLASSES:
        raise ValueError(f"unknown tiny architecture {arch!r}; expected one of {TINY_ARCHS}")
    config_cls = getattr(transformers, _CONFIG_CLASSES[arch], None)
    if config_cls is None:
        raise ImportError(
            f"transformers {transformers.__version__} has no {_CONFIG_CLASSES[arch]} (qwen3 needs >= 4.51)"
        )
    bos, eos = 0, vocab_size - 1
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=num_attention_heads * head_dim,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        initializer_range=init_std,
        tie_word_embeddings=False,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=eos,
    )
    if arch == "mistral":
        kwargs["sliding_window"] = None  # full attention, like the other three
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    kwargs.update(config_overrides)
    config = config_cls(**kwargs)

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    model.to(torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=bos, eos_token_id=eos, pad_token_id=eos, do_sample=False
    )
    model.eval()
    return model
