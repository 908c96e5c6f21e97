"""Editing a trace store's files by hand, as a user's editor (or damage) would."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def set_root_attr(path: Path, key: str, value: Any = None, *, delete: bool = False) -> None:
    """Set (or delete) a group attribute in every metadata document that holds it: Zarr
    format 2 (``.zattrs`` and the consolidated ``.zmetadata``) or 3 (the root ``zarr.json``)."""
    path = Path(path)
    docs = [(path / "zarr.json", ("attributes",))]
    docs += [(path / ".zattrs", ()), (path / ".zmetadata", ("metadata", ".zattrs"))]
    found = False
    for f, keys in docs:
        if not f.exists():
            continue
        found = True
        meta = json.loads(f.read_text())
        target = meta
        for k in keys:
            target = target[k]
        if delete:
            target.pop(key)
        else:
            target[key] = value
        f.write_text(json.dumps(meta))
    assert found, f"{path} has no group metadata"
