"""Exceptions raised by kvcouple.

Bad input is a ``ValueError`` subclass (:class:`InvalidInputError` and its children) naming the
argument, the value and what is allowed; a store that cannot be used is a :class:`StoreError`;
a missing optional dependency is a :class:`MissingExtraError` saying which extra to install.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

from kvcouple._core import InternalError, InvalidInputError, InvalidKernelError, ShapeError


class StoreError(RuntimeError):
    """A trace store that cannot be read or written as asked (damaged, incomplete, wrong schema)."""


class SchemaVersionError(StoreError):
    """A trace store written with another schema version than this kvcouple reads."""


class ResourceLimitError(InvalidInputError):
    """A request whose buffers would not fit in the memory available, or whose work is beyond
    what one call does (refused before allocating or starting)."""


class MissingExtraError(ImportError):
    """An optional dependency is not installed; the message names the extra that brings it."""


# Top-level module -> the kvcouple extra that installs it.
EXTRAS = {
    "torch": "tracer",
    "transformers": "tracer",
    "tokenizers": "tracer",
    "safetensors": "tracer",
    "huggingface_hub": "tracer",
    "matplotlib": "plots",
    "dask": "dask",
    "distributed": "dask",
    "numba": "reference",
    "gguf": "gguf",
    "accelerate": "gguf",
}


DEBUG_ENV = "KVCOUPLE_DEBUG"


def debug_requested() -> bool:
    """Whether ``--debug`` or ``KVCOUPLE_DEBUG=1`` asked for tracebacks. ``kvcouple --debug``
    sets the variable, so nested commands (the demo's trace processes and its analysis) see it."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def missing_extra(error: ModuleNotFoundError, what: str = "this") -> MissingExtraError | None:
    """The :class:`MissingExtraError` for a failed import of an optional dependency (``None``
    if the module is not one of kvcouple's extras)."""
    top = (error.name or "").partition(".")[0]
    extra = EXTRAS.get(top)
    if extra is None:
        return None
    return MissingExtraError(
        f"{what} needs the `{extra}` extra ({top} is not installed): "
        f"pip install 'kvcouple[{extra}]'"
    )


def require(module: str, what: str = "this") -> ModuleType:
    """Import ``module``, or raise :class:`MissingExtraError` naming the extra to install."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        err = missing_extra(e, what)
        if err is None:
            raise
        raise err from e


__all__ = [
    "InternalError",
    "InvalidInputError",
    "InvalidKernelError",
    "MissingExtraError",
    "ResourceLimitError",
    "SchemaVersionError",
    "ShapeError",
    "StoreError",
    "debug_requested",
    "missing_extra",
    "require",
]
