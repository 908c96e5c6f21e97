"""Open a trace store (creating it with :mod:`kvcouple.store.create`, or resuming it) and fill
it, one document region at a time.

Several processes (``--shard i/N``) may fill one store: creation is atomic (built in a
temporary folder, then renamed into place), every document is its own chunk along ``doc``,
and a document counts as done only once its ``completed`` flag is written, last.

**Sharding.** With zarr-python 3, a store of many documents keeps ``docs_per_shard``
consecutive documents of a variable in one stored object (a Zarr v3 shard; inside it each
document and policy is still its own chunk, readable alone): files per store grow with
documents / shard size instead of ~17 per document and policy (:func:`docs_per_shard`). The
writer holds a shard's documents in memory and writes the shard whole once every document it
expects there is in (:meth:`TraceStoreWriter.expect`), or once it has been held
:data:`kvcouple.store.sharding.HOLD_SECONDS` (then again when complete, the documents written before read back), the
``completed`` flags last; what is left at the end (a stopped or failed run) is written by
:meth:`TraceStoreWriter.flush`. A process killed before a shard is written loses that shard's
new documents (at most ``docs_per_shard`` of them, and about that long of work), and
the resumed run writes them again. Writers of ``--shard i/N`` own whole Zarr shards (:mod:`kvcouple.store.parts`),
so no two processes ever write the same object.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from kvcouple.deprecation import moved_getattr
from kvcouple.errors import MissingExtraError, StoreError
from kvcouple.store import sharding
from kvcouple.store.create import StoreLayout as StoreLayout
from kvcouple.store.create import (
    create_local,
    create_remote,
    docs_per_shard,
    jsonable,
    open_group,
    remote_exists,
    write_empty_chunks,
    zarr_module,
)
from kvcouple.store.geometry import StoreGeometry, is_url
from kvcouple.store.resume import VocabularyMismatchError as VocabularyMismatchError
from kvcouple.store.resume import check_resume
from kvcouple.store.schema import RUN_KEYS as RUN_KEYS
from kvcouple.store.schema import SCHEMA_VERSION, variables
from kvcouple.store.text import TextTables

# Read from where it lives now, for one release.
__getattr__ = moved_getattr(__name__, {"resume_mismatch": "kvcouple.store.resume"})


class TraceStoreWriter:
    """Writes one run's store. Use :meth:`open` to create it or resume it.

    Attributes
    ----------
    path : pathlib.Path or str
        Where the store lies: a local directory, or a URL string for a remote store.
    layout : StoreLayout
        The sizes of every dimension of the store.
    """

    def __init__(self, path: str | Path, layout: StoreLayout, group: Any):
        self.path = path
        self.layout = layout
        self._group = group
        self._vars = variables(layout.record)
        shards = getattr(group["tokens"], "shards", None)
        #: Documents per stored object (1: the store is not sharded).
        self.docs_per_shard = int(shards[0]) if shards else 1
        # Sharded stores: what is on disk, what this run writes, the shards held in memory.
        self._on_disk: np.ndarray | None = None
        self._expected: set[int] | None = None
        self._held: dict[int, sharding.HeldShard] = {}
        self._arrays: dict[str, Any] = {}
        self._direct: dict[str, bool] = {}
        self._geometry: StoreGeometry | None = None

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        layout: StoreLayout,
        attrs: dict[str, Any],
        text: TextTables | None = None,
    ) -> TraceStoreWriter:
        """Create the store, or resume it if it exists and was made by the same run.

        ``attrs`` must hold the run-defining keys of :data:`RUN_KEYS` that apply; a store that
        exists with different values raises :class:`StoreError` naming the first difference.
        ``text`` (the prompts' ids and the token table) is written when the store is created.
        """
        if zarr_module() is None:
            raise MissingExtraError(
                "writing a trace store needs zarr, which is not installed: pip install 'zarr>=2.16'"
            )
        layout.validate()
        store: str | Path = str(path) if is_url(str(path)) else Path(path)
        full_attrs = jsonable(
            {
                **attrs,
                "schema_version": SCHEMA_VERSION,
                "record": str(layout.record),
                "horizon": layout.horizon,
                "window": layout.window,
                "branches": layout.branches,
                "replicates": layout.replicates,
                "vocab_size": layout.vocab_size,
                "doc_ids": list(layout.doc_ids),
                "policy_specs": list(layout.policies),
            }
        )
        if isinstance(store, str):
            if not remote_exists(store):
                create_remote(store, layout, full_attrs, text)
        elif not store.exists():
            create_local(store, layout, full_attrs, text)
        elif not store.is_dir() or not any((store / m).exists() for m in (".zgroup", "zarr.json")):
            what = "a file" if not store.is_dir() else "a directory without a Zarr group"
            raise StoreError(
                f"{store} exists and is {what}, not a kvcouple trace store: write to a new path"
            )
        group = open_group(store, "r+")
        existing = dict(group.attrs)
        if "schema_version" not in existing:
            raise StoreError(f"{store} exists and is not a kvcouple trace store")
        if existing["schema_version"] != SCHEMA_VERSION:
            from kvcouple.errors import SchemaVersionError

            found = existing["schema_version"]
            if not isinstance(found, int) or isinstance(found, bool):
                raise StoreError(
                    f"{store}: attribute schema_version is {found!r} ({type(found).__name__}), "
                    "not an integer: the store's attributes are damaged"
                )
            raise SchemaVersionError(
                f"{store} has schema version {found}; this kvcouple writes "
                f"version {SCHEMA_VERSION}. Write to a new store."
            )
        check_resume(store, existing, full_attrs)
        writer = cls(store, layout, group)
        if writer.docs_per_shard != docs_per_shard(layout):
            # The planner shares documents out by whole shards of the size this kvcouple
            # makes; another size would let two writers share a stored object.
            raise StoreError(
                f"cannot resume {store}: it holds {writer.docs_per_shard} documents per stored "
                f"object, this kvcouple writes {docs_per_shard(layout)}; write to a new --out"
            )
        return writer

    def completed(self) -> np.ndarray:
        """Boolean array over docs: which documents are fully written."""
        flags = np.asarray(self._array("completed")[...], dtype=bool)
        self._on_disk = flags.copy()
        return flags

    def expect(self, docs: Iterable[int]) -> None:
        """The documents this run will write (sharded stores: a shard is written once those of
        its documents are in; by default every document the store lacks)."""
        self._expected = {int(d) for d in docs}

    def write_doc(self, doc: int, arrays: dict[str, np.ndarray]) -> None:
        """Write every variable of one document (arrays without the leading ``doc`` axis),
        then mark it completed. Missing variables are an error: nothing is half-written.
        In a sharded store the document is held with its shard, which is written whole once
        complete (or by :meth:`flush`)."""
        missing = [n for n in self._vars if n not in arrays and n not in ("completed",)]
        if missing:
            raise StoreError(f"write_doc({doc}) is missing variables: {', '.join(missing)}")
        sizes = self.layout.sizes()
        values = {}
        for name, (dims, dtype, _) in self._vars.items():
            if name == "completed":
                continue
            want = tuple(sizes[d] for d in dims[1:])
            value = np.asarray(arrays[name])
            if value.shape != want:
                raise StoreError(
                    f"write_doc({doc}): {name} has shape {value.shape}, expected {want} {dims[1:]}"
                )
            values[name] = value.astype(dtype, copy=False)
        if self.docs_per_shard > 1:
            self._hold(doc, values)
            return
        # Every chunk is written, even one equal to the fill value (an all-zero hazard of the
        # full policy): readers tell a damaged store by its missing chunks.
        with write_empty_chunks():
            for name, value in values.items():
                self._array(name)[doc] = value
            self._array("completed")[doc] = True

    def flush(self) -> None:
        """Write every shard held, also those still missing documents (a run that stops or
        fails keeps what it traced). Nothing to do where the store is not sharded."""
        for k in sorted(self._held):
            self._write_shard(k)

    def close(self) -> None:
        self.flush()

    def __enter__(self) -> TraceStoreWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.flush()

    def _array(self, name: str) -> Any:
        """The Zarr array ``name``, opened once (zarr-python reads its metadata on every
        group lookup)."""
        arr = self._arrays.get(name)
        if arr is None:
            arr = self._arrays[name] = self._group[name]
        return arr

    def _done(self) -> np.ndarray:
        if self._on_disk is None:
            self._on_disk = self.completed()
        return self._on_disk

    def _region(self, k: int) -> range:
        n = len(self.layout.doc_ids)
        return range(k * self.docs_per_shard, min(n, (k + 1) * self.docs_per_shard))

    def _hold(self, doc: int, values: dict[str, np.ndarray]) -> None:
        k = doc // self.docs_per_shard
        region = self._region(k)
        held = self._held.get(k)
        if held is None:
            held = sharding.HeldShard(
                {
                    name: np.full((len(region), *v.shape), self._vars[name].fill, v.dtype)
                    for name, v in values.items()
                }
            )
            self._held[k] = held
        for name, value in values.items():
            held.arrays[name][doc - region.start] = value
        held.docs.add(doc)
        done = self._done()
        want = [
            d for d in region if not done[d] and (self._expected is None or d in self._expected)
        ]
        # Written once complete, or after HOLD_SECONDS (a slow run: what a kill -9 loses is
        # bounded in time too; the shard's later documents rewrite it with these read back).
        if (
            all(d in held.docs for d in want)
            or time.monotonic() - held.since > sharding.HOLD_SECONDS
        ):
            self._write_shard(k)

    def _write_shard(self, k: int) -> None:
        """Write shard ``k`` whole: the documents held, the ones already on disk read back
        (a resumed shard), the others as fill values; the ``completed`` flags last."""
        held = self._held.pop(k)
        region = self._region(k)
        sel = slice(region.start, region.stop)
        done = self._done()
        before = [d - region.start for d in region if done[d] and d not in held.docs]
        if before:
            for name, arr in held.arrays.items():
                self._check_read_back(name, [region.start + i for i in before])
                arr[before] = np.asarray(self._array(name)[sel])[before]
        flags = done[sel].copy()
        flags[[d - region.start for d in held.docs]] = True
        with write_empty_chunks():
            for name, values in [*held.arrays.items(), ("completed", flags)]:
                if not self._write_shard_file(name, k, values):
                    self._array(name)[sel] = values
        done[sel] = flags

    def _check_read_back(self, name: str, docs: list[int]) -> None:
        """Refuse to carry finished documents whose inner chunks a shard's index marks absent
        (or out of the shard) into the rewritten shard: zarr-python reads them as fill
        values, which the rewrite would make look like data (a local store; elsewhere a
        damaged chunk raises on reading)."""
        if not isinstance(self.path, Path):
            return
        if self._geometry is None:
            self._geometry = StoreGeometry(self.path)
        ndim = len(self._vars[name].dims)
        for d in docs:
            sel = (slice(d, d + 1),) + (slice(None),) * (ndim - 1)
            absent = self._geometry.missing_inner(name, sel)
            if absent:
                raise StoreError(
                    f"cannot resume {self.path}: chunk {absent[0][0]} of variable {name!r} "
                    f"(document {self.layout.doc_ids[d]!r}, marked finished) is missing or "
                    "damaged; the store is damaged. Write to a new --out."
                )

    def _write_shard_file(self, name: str, k: int, values: np.ndarray) -> bool:
        """Write shard ``k`` of ``name`` whole through the Rust encoder (a local store, the
        layout :mod:`kvcouple.store.create` makes, one shard per document region): written aside, then
        renamed into place, so a reader or a kill never finds half a shard. False where
        zarr-python must write it (object storage, another layout)."""
        arr = self._array(name)
        if name not in self._direct:
            self._direct[name] = isinstance(self.path, Path) and sharding.encodable(arr)
        if not self._direct[name]:
            return False
        from kvcouple import _core

        shard = tuple(int(c) for c in arr.shards)
        padded = np.full(shard, self._vars[name].fill, dtype=arr.dtype.newbyteorder("<"))
        padded[: len(values)] = values
        data = _core.store_encode_shard(
            padded.reshape(-1).view(np.uint8), padded.itemsize, shard, arr.chunks, len(values)
        )
        coords = (k,) + (0,) * (arr.ndim - 1)
        target = self.path / arr.path / arr.metadata.encode_chunk_key(coords)
        aside = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        aside.write_bytes(data)
        os.replace(aside, target)
        return True
