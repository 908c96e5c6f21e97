"""Model loading, and the small model kvcouple ships so that demos run with no download.

The embedded default model (``data/default_model``) is a tiny Llama-style causal LM with
grouped-query attention (4 query heads, 2 KV heads, 4 layers, hidden 128, byte-level BPE with
512 tokens), trained by ``scripts/train_default_model.py`` on Python standard-library
docstrings. It is far too small to be useful as a language model; it exists so that the
tracer, the README demo and the notebooks have real, non-degenerate next-token distributions
on any machine, offline. ``data/prompts.jsonl`` holds held-out documents for it.

torch and transformers are imported inside the functions, so ``import kvcouple.models``
works without them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvcouple.errors import InvalidInputError

_DATA = Path(__file__).resolve().parent / "data"

__all__ = ["default_model_path", "default_prompts", "default_prompts_path", "load_model"]


def default_model_path() -> Path:
    """Directory of the embedded default model (a Hugging Face model directory)."""
    return _DATA / "default_model"


def default_prompts_path() -> Path:
    """JSON-lines file of held-out prompts for the default model: ``{"id", "text", ...}``."""
    return _DATA / "prompts.jsonl"


def default_prompts() -> list[dict[str, Any]]:
    """The shipped prompts as a list of dicts (each has at least ``id`` and ``text``)."""
    with default_prompts_path().open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _dtype_keyword() -> str:
    """``from_pretrained``'s dtype keyword: ``dtype`` from transformers 4.56, ``torch_dtype`` before.

    Newer versions still accept ``torch_dtype`` but warn; older ones silently ignore ``dtype``
    (it ends up in the config), so the choice matters.
    """
    import transformers
    from packaging.version import Version

    return "dtype" if Version(transformers.__version__).release >= (4, 56) else "torch_dtype"


def _resolve_dtype(dtype: Any, device: Any) -> Any:
    import torch

    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        resolved = getattr(torch, dtype.removeprefix("torch."), None)
        if isinstance(resolved, torch.dtype) and resolved.is_floating_point:
            return resolved
    raise InvalidInputError(f"dtype must be a floating torch.dtype or its name, got {dtype!r}")


def load_model(
    name_or_path: str | Path | None = None,
    *,
    device: Any = None,
    dtype: Any = None,
    **from_pretrained_kwargs: Any,
) -> tuple[Any, Any]:
    """Load a causal LM and its tokenizer; returns ``(model, tokenizer)``, model in eval mode.

    Parameters
    ----------
    name_or_path:
        ``None`` for the embedded default model; otherwise a local model directory (loaded
        with ``local_files_only=True``, never touching the network) or a Hugging Face Hub id.
    device:
        Where to put the model; default ``"cuda"`` if available, else ``"cpu"``.
    dtype:
        A torch dtype or its name (``"bfloat16"``); default bfloat16 on CUDA, float32 on CPU.
    **from_pretrained_kwargs:
        Passed to ``AutoModelForCausalLM.from_pretrained`` (e.g. ``attn_implementation``,
        ``revision``).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if name_or_path is None:
        source: str | Path = default_model_path()
        local = True
        if not (source / "config.json").is_file():
            raise FileNotFoundError(
                f"the embedded default model is missing from {source}; "
                "run scripts/train_default_model.py or reinstall kvcouple"
            )
    else:
        path = Path(name_or_path).expanduser()
        local = path.exists()
        source = path if local else str(name_or_path)

    dev = torch.device(
        device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    )
    torch_dtype = _resolve_dtype(dtype, dev)
    kwargs = dict(from_pretrained_kwargs)
    if local:
        kwargs["local_files_only"] = True
    tokenizer = AutoTokenizer.from_pretrained(
        source,
        **{k: v for k, v in kwargs.items() if k in ("local_files_only", "revision", "token")},
    )
    kwargs[_dtype_keyword()] = torch_dtype
    model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    model.to(dev)
    model.eval()
    return model, tokenizer
