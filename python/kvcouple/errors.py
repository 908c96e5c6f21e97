"""Exceptions raised by kvcouple. Every bad-input error is a ``ValueError`` subclass."""

from kvcouple._core import InternalError, InvalidInputError, InvalidKernelError, ShapeError


class StoreError(RuntimeError):
    """A trace store that cannot be read or written as asked (damaged, incomplete, wrong schema)."""


class SchemaVersionError(StoreError):
    """A trace store written with another schema version than this kvcouple reads."""


__all__ = [
    "InternalError",
    "InvalidInputError",
    "InvalidKernelError",
    "SchemaVersionError",
    "ShapeError",
    "StoreError",
]
