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

# The coverage matrix (tests/tracer/test_coverage.py, docs/tracer.md): one tiny model per decoder
# family, configured so that what makes the family special is exercised: small sliding
# windows (shorter than the test prompts), no-RoPE layers, soft-capping, sinks, partial
# rotary, MoE routing, latent attention.
COVERAGE_ARCHS = (
    "llama",
    "mistral_window",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "mixtral",
    "gemma",
    "gemma2",
    "gemma3_text",
    "phi3",
    "olmo2",
    "gpt_neox",
    "gpt2",
    "stablelm",
    "granite",
    "cohere2",
    "smollm3",
    "deepseek_v3",
    "gpt_oss",
    "falcon",
    # Beyond the twenty: the other families its survey found failing.
    "falcon_alibi",
    "bloom",
    "gptj",
    "opt",
    "phi",
    "exaone4",
    "olmo3",
    "lfm2",
)

# Sliding window of the tiny windowed models: shorter than the test prompts.
TINY_WINDOW = 8

_HYBRID = ["sliding_attention", "full_attention"]

# arch -> (config class, family of size arguments, extra config arguments)
_SPECS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "gqa", {}),
    "qwen2": ("Qwen2Config", "gqa", {}),
    "qwen3": ("Qwen3Config", "gqa", {}),
    "mistral": ("MistralConfig", "gqa", {"sliding_window": None}),
    "mistral_window": ("MistralConfig", "gqa", {"sliding_window": TINY_WINDOW}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "gqa",
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    ),
    "mixtral": (
        "MixtralConfig",
        "gqa",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None},
    ),
    "gemma": ("GemmaConfig", "gqa", {}),
    "gemma2": (
        "Gemma2Config",
        "gqa",
        {
            "sliding_window": TINY_WINDOW,
            "layer_types": _HYBRID,
            "attn_logit_softcapping": 5.0,
            "final_logit_softcapping": 30.0,
            "query_pre_attn_scalar": 16,
        },
    ),
    "gemma3_text": (
        "Gemma3TextConfig",
        "gqa",
        {"sliding_window": TINY_WINDOW, "layer_types": _HYBRID, "query_pre_attn_scalar": 16},
    ),
    "phi3": ("Phi3Config", "gqa", {"sliding_window": None}),
    "olmo2": ("Olmo2Config", "gqa", {}),
    "gpt_neox": ("GPTNeoXConfig", "mha", {"rotary_pct": 0.25}),
    "gpt2": ("GPT2Config", "gpt2", {}),
    "stablelm": ("StableLmConfig", "gqa", {"partial_rotary_factor": 0.25}),
    "granite": (
        "GraniteConfig",
        "gqa",
        {"embedding_multiplier": 2.0, "attention_multiplier": 0.2, "logits_scaling": 2.0},
    ),
    "cohere2": (
        "Cohere2Config",
        "gqa",
        {"sliding_window": TINY_WINDOW, "layer_types": _HYBRID},
    ),
    "smollm3": ("SmolLM3Config", "gqa", {"no_rope_layers": [1, 0], "use_sliding_window": False}),
    "deepseek_v3": (
        "DeepseekV3Config",
        "gqa",
        {
            "kv_lora_rank": 32,
            "q_lora_rank": None,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": 16,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "n_group": 1,
            "topk_group": 1,
            "first_k_dense_replace": 1,
            "moe_intermediate_size": 32,
            "head_dim": 8,  # the rotary part of each head
        },
    ),
    "gpt_oss": (
        "GptOssConfig",
        "gqa",
        {
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": TINY_WINDOW,
            "layer_types": _HYBRID,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        },
    ),
    "falcon": (
        "FalconConfig",
        "mha",
        {"alibi": False, "multi_query": True, "new_decoder_architecture": False},
    ),
    "falcon_alibi": (
        "FalconConfig",
        "mha",
        {"alibi": True, "multi_query": True, "new_decoder_architecture": False},
    ),
    "bloom": ("BloomConfig", "mha", {"n_head": 4, "n_layer": 2}),
    "gptj": ("GPTJConfig", "gpt2", {"rotary_dim": 8}),
    "opt": ("OPTConfig", "mha", {"ffn_dim": 128, "word_embed_proj_dim": 64}),
    "phi": ("PhiConfig", "mha", {"partial_rotary_factor": 0.5}),
    "exaone4": (
        "Exaone4Config",
        "gqa",
        {"sliding_window": TINY_WINDOW, "layer_types": _HYBRID},
    ),
    "olmo3": (
        "Olmo3Config",
        "gqa",
        {"sliding_window": TINY_WINDOW, "layer_types": _HYBRID},
    ),
    "lfm2": ("Lfm2Config", "gqa", {"layer_types": ["conv", "full_attention"]}),
}

# Architectures whose attention transformers runs only with the eager implementation.
EAGER_ONLY = ("gemma2", "gpt_oss")


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
    """Build a tiny random-weight causal LM of architecture ``arch`` (one of ``TINY_ARCHS`` or
    ``COVERAGE_ARCHS``; ``mistral_window`` is Mistral with a ``TINY_WINDOW``-token window).

    ``hidden_size`` is ``num_attention_heads * head_dim`` (64 by default). ``attn_implementation``
    (``"eager"``, ``"sdpa"``) is passed to the config when given; ``config_overrides`` go to the
    config constructor as well. Returns the model (float32, CPU, eval mode) with
    ``config.eos_token_id`` and its generation config set.
    """
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig

    if arch not in _SPECS:
        raise ValueError(f"unknown tiny architecture {arch!r}; expected one of {sorted(_SPECS)}")
    class_name, family, extra = _SPECS[arch]
    config_cls = getattr(transformers, class_name, None)
    if config_cls is None:
        raise ImportError(f"transformers {transformers.__version__} has no {class_name}")
    bos, eos = 0, vocab_size - 1
    hidden = num_attention_heads * head_dim
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        initializer_range=init_std,
        tie_word_embeddings=False,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=eos,
    )
    if family == "gpt2":
        kwargs.update(
            n_embd=hidden,
            n_layer=num_hidden_layers,
            n_head=num_attention_heads,
            n_inner=intermediate_size,
            n_positions=max_position_embeddings,
        )
    else:
        kwargs.update(
            hidden_size=hidden,
            intermediate_size=intermediate_size,
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=num_attention_heads,
            max_position_embeddings=max_position_embeddings,
        )
    if family == "gqa":
        kwargs.update(num_key_value_heads=num_key_value_heads, head_dim=head_dim)
    kwargs.update(extra)
    kwargs.update(config_overrides)
    if attn_implementation is None and arch in EAGER_ONLY:
        attn_implementation = "eager"
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
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
