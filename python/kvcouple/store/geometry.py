"""Where a trace store keeps each value: :class:`StoreGeometry`, the part of
:class:`kvcouple.store.reader.TraceStoreReader` that opens the Zarr group and its arrays and
maps a selection to the stored objects it touches. It is the only place chunk keys are
computed. It knows Zarr, not the schema: what the values mean and which are allowed is
:mod:`kvcouple.store.validation`'s.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from kvcouple.errors import StoreError
from kvcouple.store.stored_array import ABSENT, LocalGroup, StoredArray, shard_index, v3_metadata


def is_url(path: str) -> bool:
    """A store address for fsspec (``s3://bucket/run.zarr``) rather than a local path."""
    return "://" in path and not path.startswith("file://")


def engine_forced_off() -> bool:
    """``KVCOUPLE_STORE_ENGINE=zarr``: every read goes through zarr-python, none through the
    Rust engine (nor the zarr-free local reads of :mod:`kvcouple.store.stored_array`)."""
    return os.environ.get("KVCOUPLE_STORE_ENGINE", "auto") == "zarr"


def zarr_major() -> int:
    """The major version of the installed zarr-python."""
    import zarr

    return int(zarr.__version__.split(".")[0])


def not_a_store(path: str) -> str:
    """Why a local path is not a trace store, in words with what to do ("" where it may be
    one: a folder with a Zarr group's metadata)."""
    if os.path.isfile(path):
        return (
            f"{path} is a file, not a trace store: a store is the folder kvcouple trace --out "
            "wrote (run.zarr)"
        )
    if any(os.path.exists(os.path.join(path, m)) for m in ("zarr.json", ".zgroup")):
        return ""
    inside = sorted(
        n for n in os.listdir(path) if n.endswith(".zarr") and os.path.isdir(os.path.join(path, n))
    )
    hint = (
        f"; it holds {', '.join(os.path.join(path, n) for n in inside[:3])}: give that"
        if inside
        else "; give the folder kvcouple trace --out wrote (run.zarr), or trace one first"
    )
    return f"{path} is a folder but not a trace store (no Zarr metadata in it){hint}"


class StoreGeometry:
    """A store's Zarr group and arrays (opened once per process: a pickled geometry reopens
    them where it is unpickled), the shapes of their stored and decoded chunks, and the keys
    of the objects a selection reads.

    ``storage_options`` are passed to fsspec for URLs (``s3://...``): credentials, endpoint.
    """

    def __init__(self, path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None):
        self.path = str(path)
        self.storage_options = dict(storage_options or {})
        self._group: Any = None
        self._zarr_group: Any = None
        self._arrays: dict[str, Any] = {}

    def __getstate__(self) -> dict[str, Any]:
        # Open Zarr objects belong to this process: a Dask worker opens its own.
        return {**self.__dict__, "_group": None, "_zarr_group": None, "_arrays": {}}

    @property
    def group(self) -> Any:
        if self._group is None:
            self._group = self._open_group()
        return self._group

    def _open_group(self) -> Any:
        """A local Zarr v3 store's root group read without zarr-python
        (:class:`~kvcouple.store.stored_array.LocalGroup`); any other, zarr-python's."""
        if not is_url(self.path):
            if not os.path.exists(self.path):
                raise StoreError(f"no trace store at {self.path}")
            if not_a_store(self.path):
                raise StoreError(not_a_store(self.path))
            meta = None if engine_forced_off() else v3_metadata(self.path)
            if meta is not None and meta.get("node_type") == "group":
                return LocalGroup(self.path, meta, lambda name: self.zarr_group[name])
        return self.zarr_group

    @property
    def zarr_group(self) -> Any:
        """The store's root group opened with zarr-python (imported on first use)."""
        if self._zarr_group is None:
            import zarr

            kw: dict[str, Any] = {"mode": "r"}
            if self.storage_options:
                kw["storage_options"] = self.storage_options
            try:
                self._zarr_group = zarr.open_group(self.path, **kw)
            except Exception as e:  # zarr and fsspec raise many types for unreadable metadata
                raise StoreError(f"{self.path} is not a readable Zarr store: {e}") from e
        return self._zarr_group

    def array(self, name: str) -> Any:
        arr = self._arrays.get(name)
        if arr is None:
            try:
                arr = self.group[name]
            except KeyError:
                raise StoreError(
                    f"{self.path}: variable {name!r} is missing; the store is damaged"
                ) from None
            self._arrays[name] = arr
        return arr

    def any_array(self) -> Any:
        """An array already opened (they share a store): the way to the store's objects."""
        return self.array(next(iter(self._arrays)))

    def storage_grid(self, name: str) -> tuple[int, ...]:
        """The shape of one stored object (a shard where the array is sharded, else a chunk)."""
        arr = self.array(name)
        shards = getattr(arr, "shards", None)
        return tuple(int(c) for c in (shards or arr.chunks))

    def decode_grid(self, name: str) -> tuple[int, ...]:
        """The shape of one independently decoded chunk (inside a shard where sharded)."""
        return tuple(int(c) for c in self.array(name).chunks)

    def chunk_key(self, name: str, coords: tuple[int, ...]) -> str:
        """The storage key (relative to the store) of stored object ``coords`` of ``name``."""
        arr = self.array(name)
        if isinstance(arr, StoredArray) or zarr_major() >= 3:
            return f"{arr.path}/{arr.metadata.encode_chunk_key(tuple(coords))}"
        return str(arr._chunk_key(tuple(coords)))

    def cells(
        self, name: str, sel: tuple[slice, ...], grid: tuple[int, ...]
    ) -> Iterator[tuple[tuple[int, ...], tuple[slice, ...]]]:
        """The grid cells a selection touches: (cell coordinates, the cell's selection)."""
        shape = self.array(name).shape
        ranges = []
        for s, c, n in zip(sel, grid, shape, strict=True):
            start, stop, _ = s.indices(n)
            ranges.append(range(start // c, max(start // c, (stop - 1) // c) + 1))
        for cell in itertools.product(*ranges):
            yield (
                cell,
                tuple(
                    slice(i * c, min((i + 1) * c, n))
                    for i, c, n in zip(cell, grid, shape, strict=True)
                ),
            )

    def keys(self, name: str, sel: tuple[slice, ...]) -> list[str]:
        """Storage keys a selection reads."""
        return [
            self.chunk_key(name, cell) for cell, _ in self.cells(name, sel, self.storage_grid(name))
        ]

    def doc_keys(self, names: tuple[str, ...], doc: int) -> list[str]:
        """Storage keys of every value of document ``doc`` of ``names`` (first axis ``doc``)."""
        return [
            k
            for n in names
            for k in self.keys(
                n, (slice(doc, doc + 1),) + (slice(None),) * (self.array(n).ndim - 1)
            )
        ]

    def missing_inner(self, name: str, sel: tuple[slice, ...]) -> list[tuple[str, bool]]:
        """The inner chunks of a selection of a sharded array that their shard's index marks
        absent, or places outside the shard: ``("<shard key> (inner chunk i)", outside)``
        (local stores whose shards keep their index at the end, the layout kvcouple writes;
        [] otherwise). zarr-python reads both as the fill value, which a reader must not take
        for data."""
        arr = self.array(name)
        shards = getattr(arr, "shards", None)
        if not shards or is_url(self.path):
            return []
        codec = arr.metadata.codecs[0].to_dict()
        if codec.get("configuration", {}).get("index_location") != "end":
            return []
        per = tuple(int(s) // int(c) for s, c in zip(shards, arr.chunks, strict=True))
        count = int(np.prod(per))
        indexes: dict[str, tuple[np.ndarray, int] | None] = {}
        out = []
        for cell, _ in self.cells(name, sel, self.decode_grid(name)):
            key = self.chunk_key(name, tuple(c // p for c, p in zip(cell, per, strict=True)))
            if key not in indexes:
                indexes[key] = shard_index(self.path, key, count)
            found = indexes[key]
            if found is None:
                continue  # an absent shard: missing() names it
            index, body = found
            inner = int(np.ravel_multi_index(tuple(c % p for c, p in zip(cell, per)), per))
            offset, size = int(index[inner, 0]), int(index[inner, 1])
            if offset == ABSENT and size == ABSENT:
                out.append((f"{key} (inner chunk {inner})", False))
            elif offset + size > body:
                out.append((f"{key} (inner chunk {inner})", True))
        return out

    def missing(self, keys: list[str]) -> list[str]:
        """The keys of ``keys`` that are absent from the store (asked concurrently)."""
        if not keys:
            return []
        if isinstance(self.group, LocalGroup):
            return [k for k in keys if not os.path.exists(os.path.join(self.path, k))]
        arr = self.any_array()
        if zarr_major() >= 3:
            import asyncio

            from zarr.core.sync import sync

            store = arr.store_path.store

            async def ask() -> list[bool]:
                return list(await asyncio.gather(*(store.exists(k) for k in keys)))

            there = sync(ask())
        else:
            store = arr.chunk_store
            there = [k in store for k in keys]
        return [k for k, ok in zip(keys, there, strict=True) if not ok]

    def size_bytes(self) -> int | None:
        """Bytes on disk (local stores), else None."""
        if is_url(self.path):
            return None
        total = 0
        for root, _, files in os.walk(self.path):
            for f in files:
                total += os.path.getsize(os.path.join(root, f))
        return total
