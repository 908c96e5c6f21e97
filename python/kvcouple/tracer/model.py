"""What the tracer reads of a model, read once into one typed object: :class:`ModelFacts`.

The text config (multimodal models nest it), each layer's sliding window, the attention
implementation, the logits' width, the head counts, the EOS ids, whether the attention
dispatches through transformers' attention interface, soft-capping and sinks, and the keywords
the model's forward takes. Every other tracer module asks :func:`facts` rather than reading
``model.config`` itself.

:func:`facts` keeps what it read in a side table owned by the tracer (keyed by the model,
weakly): nothing is set on the model. Each public entry point (``trace``, ``trace_document``,
``first_step``, ``check_support``) calls :func:`refresh` first, so a model whose config was
changed between calls is read again.
"""

from __future__ import annotations

import inspect
import sys
import weakref
from dataclasses import dataclass
from typing import Any

from kvcouple.errors import InvalidInputError

# The tracer registers its attention wrapper under this prefix (kvcouple_sdpa, kvcouple_eager).
WRAPPER_PREFIX = "kvcouple_"


class UnsupportedModelError(InvalidInputError):
    """A model whose cache or attention the tracer cannot serve exactly."""


def text_config(model: Any) -> Any:
    """The config of the model's text decoder (multimodal configs nest it)."""
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def layer_windows(cfg: Any) -> list[int | None]:
    """Each layer's sliding window as the model's config declares it (None: full attention)."""
    n = int(cfg.num_hidden_layers)
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if types is not None:
        return [window if t == "sliding_attention" else None for t in types]
    if window and getattr(cfg, "use_sliding_window", True):
        return [int(window)] * n
    return [None] * n


def attn_implementation(model: Any) -> str:
    """The attention implementation the model runs with (``sdpa``, ``eager``, ...): the
    model's own, also while the tracer's wrapper stands in for it."""
    impl = str(getattr(model.config, "_attn_implementation", None) or "eager")
    return impl.removeprefix(WRAPPER_PREFIX)


def uses_interface(model: Any) -> bool:
    """Whether the model's attention dispatches through transformers' attention interface
    (its modeling module imports ``ALL_ATTENTION_FUNCTIONS`` and defines
    ``eager_attention_forward``)."""
    module = sys.modules.get(type(model).__module__)
    names = vars(module) if module is not None else {}
    return "ALL_ATTENTION_FUNCTIONS" in names and "eager_attention_forward" in names


def vocab_size(model: Any) -> int:
    """The width of the model's logits (can exceed ``config.vocab_size``: padded embeddings)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and hasattr(head, "weight"):
        return int(head.weight.shape[0])
    return int(model.config.vocab_size)


def model_eos_ids(model: Any) -> tuple[int, ...]:
    """The EOS token ids a model declares (generation config first, then model config)."""
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            return tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))
    return ()


def _module_scaling(model: Any, head_dim: int) -> float:
    """The first attention layer's scale (before any forward pass shows it)."""
    for m in model.modules():
        if hasattr(m, "layer_idx") and isinstance(getattr(m, "scaling", None), (int, float)):
            return float(m.scaling)
    return float(head_dim**-0.5)


@dataclass(frozen=True)
class ModelFacts:
    """What the tracer knows of one model, read once (:func:`facts`)."""

    name: str  # "LlamaForCausalLM (llama)", for messages
    model_type: str
    config: Any  # the text config
    layers: int
    query_heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int  # the logits' width
    windows: tuple[int | None, ...]  # per layer (None: full attention)
    attn_implementation: str  # the model's own (sdpa, eager, flash_attention_2, ...)
    attention_interface: bool  # dispatches through ALL_ATTENTION_FUNCTIONS
    softcap: float | None  # attention logit soft-capping
    sinks: bool  # some attention module has sinks
    eos_ids: tuple[int, ...]
    forward_parameters: frozenset[str]
    scaling: float  # the first attention layer's scale

    @property
    def windowed(self) -> bool:
        """Some layer has a sliding window (caches then track entry positions)."""
        return any(w is not None for w in self.windows)

    @classmethod
    def read(cls, model: Any) -> ModelFacts:
        cfg = text_config(model)
        heads = int(cfg.num_attention_heads)
        hidden = int(cfg.hidden_size)
        head_dim = int(getattr(cfg, "head_dim", None) or hidden // heads)
        model_type = str(getattr(cfg, "model_type", "") or "")
        return cls(
            name=f"{type(model).__name__} ({model_type or '?'})",
            model_type=model_type,
            config=cfg,
            layers=int(cfg.num_hidden_layers),
            query_heads=heads,
            kv_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
            head_dim=head_dim,
            hidden=hidden,
            intermediate=int(getattr(cfg, "intermediate_size", None) or 4 * hidden),
            vocab=vocab_size(model),
            windows=tuple(layer_windows(cfg)),
            attn_implementation=attn_implementation(model),
            attention_interface=uses_interface(model),
            softcap=getattr(cfg, "attn_logit_softcapping", None),
            sinks=any(hasattr(m, "sinks") for m in model.modules()),
            eos_ids=model_eos_ids(model),
            forward_parameters=frozenset(inspect.signature(model.forward).parameters),
            scaling=_module_scaling(model, head_dim),
        )


_FACTS: weakref.WeakKeyDictionary[Any, ModelFacts] = weakref.WeakKeyDictionary()


def facts(model: Any) -> ModelFacts:
    """The model's facts, read on first use (and again after :func:`refresh`)."""
    known = _FACTS.get(model)
    if known is None or known.attn_implementation != attn_implementation(model):
        known = _FACTS[model] = ModelFacts.read(model)
    return known


def refresh(model: Any) -> ModelFacts:
    """Read the model's facts again (an entry point's first step: its config may have
    changed since the last call)."""
    _FACTS.pop(model, None)
    return facts(model)
