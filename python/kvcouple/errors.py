"""Exceptions raised by kvcouple. Every bad-input error is a ``ValueError`` subclass."""

from kvcouple._core import InternalError, InvalidInputError, InvalidKernelError, ShapeError


class StoreError(RuntimeError):
    """A trace store that cannot be read or written as asked (damaged, incomplete, wrong schema)."""


class SchemaVersionError(StoreError):
    """A trace store written with another schema version than this kvcouple reads."""


class ResourceLimitError(ValueError):
    """A request whose buffers would not fit in the memory available (refused before allocating)."""


__all__ = [
    "InternalError",
    "InvalidInputError",
    "InvalidKernelError",
    "ResourceLimitError",
    "SchemaVersionError",
    "ShapeError",
    "StoreError",
]
