"""Deprecated: renamed :mod:`kvcouple.store.object_storage` (reading a store on object
storage). Its names still read from here for one release, with a :class:`DeprecationWarning`."""

from __future__ import annotations

import importlib
from typing import Any

from kvcouple.deprecation import warn_renamed

# Old name here -> the module that has it now.
_MOVED = {
    "engine_settings": "kvcouple.store.object_storage",
    "ObjectStorageReads": "kvcouple.store.object_storage",
    "SUMMARY_AHEAD": "kvcouple.store.object_storage",
    "is_url": "kvcouple.store.geometry",
    "REMOTE_WINDOW": "kvcouple.store.engine_reads",
}


def __getattr__(name: str) -> Any:
    module = _MOVED.get(name)
    if module is None:
        raise AttributeError(f"module 'kvcouple.store.remote' has no attribute {name!r}")
    warn_renamed(f"kvcouple.store.remote.{name}", f"{module}.{name}", "kvcouple.store.remote")
    return getattr(importlib.import_module(module), name)
