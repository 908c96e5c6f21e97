"""What produced a trace store: library versions, device, dtype, attention, model revision
(and, for a model read from a GGUF file, the file's name and sha256).

The tracer writes these as store attributes when it creates a store. The model revision is
resolved to a commit hash whenever the weights came from the Hugging Face Hub cache (a Hub id,
or a local ``.../snapshots/<commit>/`` directory), so that a store names the exact weights even
when ``--revision`` was not given or named a branch.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import transformers

from kvcouple import __version__
from kvcouple.models import model_origin
from kvcouple.tracer.model import attn_implementation

_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_SNAPSHOT = re.compile(r"(?:^|/)snapshots/([0-9a-f]{40})(?:/|$)")


def resolved_revision(model: Any, requested: str | None = None) -> str:
    """The commit hash of the model's weights where it can be known, else ``requested`` (or "").

    transformers records the hash of a Hub snapshot in ``config._commit_hash``; a model loaded
    from a snapshot directory by path also carries it in its ``name_or_path``.
    """
    config = getattr(model, "config", None)
    commit = getattr(config, "_commit_hash", None)
    if isinstance(commit, str) and _COMMIT.match(commit):
        return commit
    for source in (getattr(model, "name_or_path", None), getattr(config, "_name_or_path", None)):
        if isinstance(source, str):
            found = _SNAPSHOT.search(source.replace("\\", "/"))
            if found:
                return found.group(1)
    return requested or ""


def device_name(device: Any) -> str:
    """The CUDA device's name (e.g. ``"NVIDIA H200"``), or the device type (``"cpu"``)."""
    device = torch.device(device)
    if device.type == "cuda":
        return str(torch.cuda.get_device_name(device))
    return device.type


def provenance(model: Any, requested_revision: str | None = None) -> dict[str, str]:
    """Store attributes describing the software, the device and the exact model traced."""
    param = next(model.parameters())
    return {
        "kvcouple_version": __version__,
        "torch_version": str(torch.__version__),
        "transformers_version": str(transformers.__version__),
        "device": device_name(param.device),
        "dtype": str(param.dtype).removeprefix("torch."),
        "attn_implementation": attn_implementation(model),
        "model_revision": resolved_revision(model, requested_revision),
        # A model read from a GGUF file: the file's name and sha256 (the weights' identity).
        **model_origin(model),
    }
