"""Open a trace store for analysis, with clear messages for stores that cannot be used."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from kvcouple.errors import SchemaVersionError, StoreError
from kvcouple.store.schema import SCHEMA_VERSION


def open_trace_store(
    path: str | os.PathLike[str], *, allow_incomplete: bool = False, chunks: Any = None
) -> Any:
    """Open a store as an ``xarray.Dataset`` (lazily; nothing is read but metadata).

    Raises :class:`StoreError` when the path is not a kvcouple store, or when some documents
    are unfinished (an interrupted run) unless ``allow_incomplete``, in which case only the
    finished documents are returned. Raises :class:`SchemaVersionError` for another schema.
    """
    import xarray as xr

    path = Path(path)
    if not path.exists():
        raise StoreError(f"no trace store at {path}")
    try:
        ds = xr.open_zarr(str(path), chunks=chunks, consolidated=None)
    except Exception as e:  # zarr/xarray raise many types for unreadable metadata
        raise StoreError(f"{path} is not a readable Zarr store: {e}") from e
    version = ds.attrs.get("schema_version")
    if version is None:
        raise StoreError(
            f"{path} is a Zarr store but not a kvcouple trace store (no schema_version)"
        )
    if version != SCHEMA_VERSION:
        raise SchemaVersionError(
            f"{path} was written with trace-store schema version {version}; this kvcouple "
            f"(reads version {SCHEMA_VERSION}) cannot read it. Re-trace, or use the kvcouple "
            f"release that wrote it."
        )
    done = np.asarray(ds["completed"].values, dtype=bool)
    if not done.all():
        ids = [str(x) for x in np.asarray(ds["doc_id"].values)[~done]]
        if not allow_incomplete:
            shown = ", ".join(ids[:10]) + (" ..." if len(ids) > 10 else "")
            raise StoreError(
                f"{path}: {len(ids)} of {done.size} documents are unfinished ({shown}); the run "
                f"was interrupted. Rerun the same trace command to finish it, or pass "
                f"allow_incomplete=True (--allow-incomplete) to analyse the finished ones."
            )
        ds = ds.isel(doc=np.flatnonzero(done))
    return ds
