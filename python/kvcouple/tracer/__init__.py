"""The tracer: eviction policies on Hugging Face causal LMs, coupled generation, the trace store.

Needs torch and transformers, imported lazily (so ``kvcouple --help`` and the CLI registration
work without them). Entry points: :func:`trace` (a whole run into a store),
:func:`trace_document` (one prompt, in memory), :func:`first_step` (the first next-token
distributions with the full and the evicted cache), and the ``kvcouple trace`` command
(:mod:`kvcouple.tracer.cli`).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Decoding": "kvcouple.tracer.settings",
    "FirstStep": "kvcouple.tracer.onestep",
    "first_step": "kvcouple.tracer.onestep",
    "PolicyTrace": "kvcouple.tracer.engine",
    "TraceSettings": "kvcouple.tracer.settings",
    "trace_policy": "kvcouple.tracer.engine",
    "Prompt": "kvcouple.tracer.prompts",
    "PromptFileError": "kvcouple.tracer.prompts",
    "load_prompts": "kvcouple.tracer.prompts",
    "trace": "kvcouple.tracer.run",
    "trace_document": "kvcouple.tracer.batches",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'kvcouple.tracer' has no attribute {name!r}")
