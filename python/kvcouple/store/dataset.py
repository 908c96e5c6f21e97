"""A trace store as an ``xarray.Dataset`` (:func:`open_trace_store`), opened lazily after
:class:`~kvcouple.store.reader.TraceStoreReader` has validated it."""

from __future__ import annotations

import os
from typing import Any

from kvcouple.errors import StoreError
from kvcouple.store.reader import TraceStoreReader


def open_trace_store(
    path: str | os.PathLike[str],
    *,
    allow_incomplete: bool = False,
    chunks: Any = None,
    storage_options: dict[str, Any] | None = None,
) -> Any:
    """Open a store as an ``xarray.Dataset`` (lazily; nothing is read but metadata and the
    coordinates), after :class:`TraceStoreReader` has validated it.

    Raises :class:`StoreError` when the path is not a kvcouple store or is damaged, or when some
    documents are unfinished (an interrupted run) unless ``allow_incomplete``, in which case only
    the finished documents are returned. Raises :class:`SchemaVersionError` for another schema.

    Parameters
    ----------
    path : str or os.PathLike
        The store (a local path or a URL such as ``s3://...``).
    allow_incomplete : bool
        Return only the finished documents instead of raising for unfinished ones.
        Default False.
    chunks : optional
        Dask chunks, passed to ``xarray.open_zarr``. Default None: the store's chunks.
    storage_options : dict, optional
        Options for the storage backend (for example S3 credentials). Default None.

    Returns
    -------
    xarray.Dataset
        The store's variables, read lazily.

    Raises
    ------
    kvcouple.errors.StoreError
        Not a (readable) kvcouple store, damaged, or with unfinished documents without
        ``allow_incomplete``.
    kvcouple.errors.SchemaVersionError
        The store was written with another schema version.
    """
    import xarray as xr

    reader = TraceStoreReader(path, storage_options)
    if not allow_incomplete:
        reader.require_complete()
    kw: dict[str, Any] = {}
    if storage_options:
        kw["storage_options"] = storage_options
    try:
        ds = xr.open_zarr(str(path), chunks=chunks, consolidated=None, **kw)
    except Exception as e:  # zarr/xarray raise many types for unreadable metadata
        raise StoreError(f"{path} is not a readable Zarr store: {e}") from e
    if allow_incomplete:
        ds = ds.isel(doc=reader.done)
    return ds
