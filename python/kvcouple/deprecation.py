"""Public names renamed so that every quantity has one name (the registry:
:mod:`kvcouple.analysis.quantities`), each still readable under its old name for one release
with a :class:`DeprecationWarning` (CHANGELOG.md lists them)."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any

# Old name -> the registered name.
RENAMED: dict[str, str] = {
    "total_loss": "expected_mismatches",
    "total_loss_tv": "expected_mismatches_tv",
    "first_mismatch_contribution": "first_mismatch",
    "mismatch_rate": "rho",
}


def warn_renamed(old: str, new: str, where: str, stacklevel: int = 3) -> None:
    warnings.warn(
        f"{where}: {old!r} is deprecated, use {new!r} (removed in the next release)",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


class RenamedKeys(dict[str, Any]):
    """A dict whose renamed keys (:data:`RENAMED`) still read, with a warning."""

    def __missing__(self, key: str) -> Any:
        new = RENAMED.get(key)
        if new is None or new not in self:
            raise KeyError(key)
        warn_renamed(key, new, "result key")
        return self[new]

    def get(self, key: str, default: Any = None) -> Any:
        try:
            return self[key]
        except KeyError:
            return default


class RenamedAttribute:
    """A class attribute's former name (deprecated, one release): reads the new one, on the
    class or an instance, with a :class:`DeprecationWarning`. Set as ``OLD = RenamedAttribute
    ("NEW")`` in the class body."""

    def __init__(self, new: str) -> None:
        self.new = new
        self.old = new

    def __set_name__(self, owner: type, name: str) -> None:
        self.old = name

    def __get__(self, obj: object, owner: type) -> Any:
        warn_renamed(self.old, self.new, owner.__name__)
        return getattr(owner if obj is None else obj, self.new)


def module_getattr(module: str, renamed: dict[str, str], namespace: dict[str, Any]) -> Any:
    """A module's ``__getattr__`` that reads each old name of ``renamed`` (old -> new) as the
    new one in ``namespace`` (the module's globals), with a :class:`DeprecationWarning`."""

    def __getattr__(name: str) -> Any:
        new = renamed.get(name)
        if new is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warn_renamed(name, new, module)
        return namespace[new]

    return __getattr__


def moved_getattr(
    module: str, moved: dict[str, str], fallback: Callable[[str], Any] | None = None
) -> Any:
    """A module's ``__getattr__`` that reads each name of ``moved`` (name -> the module that
    has it now) from its new home, with a :class:`DeprecationWarning`; other names go to
    ``fallback`` (another such ``__getattr__``), else raise AttributeError."""

    def __getattr__(name: str) -> Any:
        home = moved.get(name)
        if home is None:
            if fallback is not None:
                return fallback(name)
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warn_renamed(f"{module}.{name}", f"{home}.{name}", module)
        return getattr(importlib.import_module(home), name)

    return __getattr__
