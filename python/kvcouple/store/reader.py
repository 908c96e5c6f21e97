"""The one way kvcouple reads a trace store: :class:`TraceStoreReader`.

Every consumer (the analysis, ``kvcouple info``, Dask workers, the recomputation of TVs) reads
through this module. The reader opens a store once (a local path or a URL such as
``s3://bucket/run.zarr``), validates its attributes against its array shapes and its
coordinates, and then reads one document (or one document and policy) at a time, whatever
the chunking on disk: documents chunked by 1, by several or all together, steps or vocabulary
chunked, Zarr v2 or v3, sharded or not. Selections go through Zarr's own indexing or the Rust
store engine, never through element 0 of a chunk.

The reader is made of parts it owns, and its methods are theirs:

- :class:`~kvcouple.store.geometry.StoreGeometry` (:attr:`TraceStoreReader.geometry`): the
  Zarr group and arrays, the chunk grids and the only computation of chunk keys;
- :class:`~kvcouple.store.validation.StoreValidation` (:attr:`TraceStoreReader.validation`):
  the checks on opening (whose results are the reader's attributes: ``dims``, ``doc_ids``,
  ``policies``, ...) and on every block read (present, decodable, checksummed, values the
  schema allows: :data:`kvcouple.store.schema.RULES`), each failure a
  :class:`~kvcouple.errors.StoreError` naming the variable, chunk, document and store;
- :class:`~kvcouple.store.engine_reads.EngineReads` (:attr:`TraceStoreReader.engine_reads`):
  reads through the Rust store engine (summaries, row TVs);
- :class:`~kvcouple.store.object_storage.ObjectStorageReads`
  (:attr:`TraceStoreReader.object_storage`): fetching objects from ``s3://`` and other URLs.
"""

from __future__ import annotations

import os
from typing import Any, Generic, TypeVar, overload

import numpy as np

from kvcouple.errors import StoreError
from kvcouple.store.engine_reads import EngineReads, EngineSwitch, SummaryBatch
from kvcouple.store.geometry import StoreGeometry
from kvcouple.store.lock import StoreBeingWrittenError, writing_note
from kvcouple.store.object_storage import ObjectStorageReads
from kvcouple.store.schema import Record, Variable
from kvcouple.store.validation import StoreValidation

T = TypeVar("T")


class _PartAttribute(Generic[T]):
    """A reader attribute that is its part's attribute of the same name (read only): what
    the geometry was opened with, what the validation found."""

    def __init__(self, part: str):
        self.part = part

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, reader: None, owner: type | None = None) -> _PartAttribute[T]: ...
    @overload
    def __get__(self, reader: object, owner: type | None = None) -> T: ...
    def __get__(self, reader: object | None, owner: type | None = None) -> Any:
        if reader is None:
            return self
        return getattr(getattr(reader, self.part), self.name)


class TraceStoreReader:
    """A validated, open trace store. Picklable: a Dask worker reopens it from the URL.

    ``storage_options`` are passed to fsspec for URLs (``s3://...``): credentials, endpoint.
    Its attributes are what opening found (:class:`~kvcouple.store.validation.
    StoreValidation`): ``schema_version``, ``attrs`` (the store's attributes), ``record`` (and
    ``record_level``, parsed), ``variables`` (the schema's, by name) and ``names`` (without
    the completion flags), ``dims`` (dimension sizes), ``doc_ids``, ``policies``,
    ``checksums`` (what protects the chunks, in words), ``completed_flags`` and
    ``flag_errors`` (damaged flag chunks' messages by document).
    """

    path: _PartAttribute[str] = _PartAttribute("geometry")
    storage_options: _PartAttribute[dict[str, Any]] = _PartAttribute("geometry")
    schema_version: _PartAttribute[int] = _PartAttribute("validation")
    attrs: _PartAttribute[dict[str, Any]] = _PartAttribute("validation")
    record_level: _PartAttribute[Record] = _PartAttribute("validation")
    record: _PartAttribute[str] = _PartAttribute("validation")
    variables: _PartAttribute[dict[str, Variable]] = _PartAttribute("validation")
    names: _PartAttribute[list[str]] = _PartAttribute("validation")
    dims: _PartAttribute[dict[str, int]] = _PartAttribute("validation")
    doc_ids: _PartAttribute[list[str]] = _PartAttribute("validation")
    policies: _PartAttribute[list[str]] = _PartAttribute("validation")
    checksums: _PartAttribute[str] = _PartAttribute("validation")
    completed_flags: _PartAttribute[np.ndarray] = _PartAttribute("validation")
    flag_errors: _PartAttribute[dict[int, str]] = _PartAttribute("validation")

    def __init__(self, path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None):
        self.geometry = StoreGeometry(path, storage_options)
        self.validation = StoreValidation(self.geometry)
        switch = EngineSwitch(self.geometry.path)
        self.object_storage = ObjectStorageReads(self.geometry, self.validation.dims["doc"], switch)
        self.engine_reads = EngineReads(self.geometry, self.validation, self.object_storage, switch)

    # -- what the analysis asks ---------------------------------------------------------------

    @property
    def model(self) -> str:
        return str(self.attrs.get("model_id", "?"))

    @property
    def horizon(self) -> int:
        return self.dims["step"]

    @property
    def window(self) -> int:
        return self.dims["lag"] - 1

    @property
    def done(self) -> list[int]:
        """Indices of the finished documents (flag chunks that decode and say so)."""
        return [int(i) for i in np.flatnonzero(self.completed_flags)]

    def unfinished(self) -> list[int]:
        """Indices of the documents neither finished nor flagged damaged."""
        errors = self.flag_errors
        not_done = np.flatnonzero(~np.asarray(self.completed_flags, bool))
        return [int(i) for i in not_done if int(i) not in errors]

    def require_complete(self) -> None:
        """Raise unless every document is finished and its flag readable."""
        if self.flag_errors:
            raise StoreError(next(iter(self.flag_errors.values())))
        bad = self.unfinished()
        if bad:
            ids = [self.doc_ids[i] for i in bad]
            shown = ", ".join(ids[:10]) + (" ..." if len(ids) > 10 else "")
            head = (
                f"{self.path}: {len(ids)} of {self.dims['doc']} documents are unfinished ({shown})"
            )
            tail = (
                "or pass allow_incomplete=True (--allow-incomplete) to analyse the finished ones."
            )
            writing = self.writing()
            if writing:  # a live writer holds the store's lock (kvcouple.store.lock)
                raise StoreBeingWrittenError(
                    f"{head}; the store is {writing}. Wait for that run to finish, {tail}"
                )
            raise StoreError(
                f"{head}; the run was interrupted. Rerun the same trace command to finish it, "
                + tail
            )

    def writing(self) -> str | None:
        """``being written by process ... on host ...`` where a writer holds the store's
        lock (:mod:`kvcouple.store.lock`), else None (finished, or interrupted)."""
        return writing_note(self.path, self.storage_options)

    def check(self, docs: list[int] | None = None, *, data: bool = False) -> list[str]:
        """Every problem of the given documents (default: the finished ones), one line each:
        missing chunks, undecodable chunks, values the schema does not allow. Distribution
        variables (``vocab``/``k`` axes) are decoded only with ``data``."""
        return self.validation.check(self.done if docs is None else docs, data=data)

    def size_bytes(self) -> int | None:
        """Bytes on disk (local stores), else None."""
        return self.geometry.size_bytes()

    # -- chunk geometry (StoreGeometry) -------------------------------------------------------

    @property
    def group(self) -> Any:
        return self.geometry.group

    def array(self, name: str) -> Any:
        return self.geometry.array(name)

    def storage_grid(self, name: str) -> tuple[int, ...]:
        """The shape of one stored object (a shard where the array is sharded, else a chunk)."""
        return self.geometry.storage_grid(name)

    def decode_grid(self, name: str) -> tuple[int, ...]:
        """The shape of one independently decoded chunk (inside a shard where sharded)."""
        return self.geometry.decode_grid(name)

    def chunk_key(self, name: str, coords: tuple[int, ...]) -> str:
        """The storage key (relative to the store) of stored object ``coords`` of ``name``."""
        return self.geometry.chunk_key(name, coords)

    def keys(self, name: str, sel: tuple[slice, ...]) -> list[str]:
        """Storage keys a selection reads."""
        return self.geometry.keys(name, sel)

    def missing(self, keys: list[str]) -> list[str]:
        """The keys of ``keys`` that are absent from the store (asked concurrently)."""
        return self.geometry.missing(keys)

    # -- checked reads (StoreValidation) ------------------------------------------------------

    def read_coordinate(self, name: str) -> np.ndarray:
        """A one-dimensional coordinate, every chunk present and decodable."""
        return self.validation.read_coordinate(name)

    def read(self, name: str, sel: tuple[Any, ...]) -> np.ndarray:
        """``name[sel]`` after checking every stored object it touches exists; a decode
        failure names the chunk. Integer indices drop their axis, as in numpy."""
        return self.validation.read(name, sel)

    def read_doc(self, name: str, doc: int) -> np.ndarray:
        """Every value of one document of ``name`` (its first axis is ``doc``), checked."""
        return self.validation.read_doc(name, doc)

    def check_values(self, name: str, block: np.ndarray, origin: tuple[int, ...]) -> None:
        """Raise naming the chunk and element of the first value the schema does not allow.
        ``origin`` is the block's position in the array (one entry per array axis)."""
        self.validation.check_values(name, block, origin)

    def row_tolerance(self, name: str) -> float:
        """How far a row of the stored distribution ``name`` may sum from 1 (its format's
        rounding: :func:`kvcouple.store.schema.row_sum_tolerance`)."""
        return self.validation.row_tolerance(name)

    # -- reads through the Rust engine (EngineReads) ------------------------------------------

    def read_summary(self, doc: int, names: tuple[str, ...]) -> dict[str, np.ndarray]:
        """Several variables of one document, checked
        (:meth:`~kvcouple.store.engine_reads.EngineReads.read_summary`)."""
        return self.engine_reads.read_summary(doc, names)

    def read_summaries(self, docs: list[int], names: tuple[str, ...]) -> SummaryBatch | None:
        """:meth:`read_summary` of several documents of a local store in one engine call, or
        None (:meth:`~kvcouple.store.engine_reads.EngineReads.read_summaries`)."""
        return self.engine_reads.read_summaries(docs, names)

    def blocks(
        self, name: str, doc: int, policy: int, whole_last: bool = True
    ) -> list[tuple[slice, ...]]:
        """Selections over the axes after (doc, policy) that follow the decoded chunks
        (:meth:`~kvcouple.store.engine_reads.EngineReads.blocks`)."""
        return self.engine_reads.blocks(name, doc, policy, whole_last)

    def rows_tv(
        self,
        p_name: str,
        q_name: str,
        sels: list[tuple[Any, ...]],
        *,
        decode_only: bool = False,
        top_delta: bool = False,
    ) -> np.ndarray | None:
        """TV of every row of the blocks ``sels`` of ``p_name`` against ``q_name`` (with
        ``top_delta``, each row's TV and top-token delta), by the Rust engine; None where it
        cannot read this store (:meth:`~kvcouple.store.engine_reads.EngineReads.rows_tv`)."""
        return self.engine_reads.rows_tv(
            p_name, q_name, sels, decode_only=decode_only, top_delta=top_delta
        )

    # -- object storage (ObjectStorageReads) --------------------------------------------------

    def fetch_objects(self, keys: list[str], *, count: bool = True) -> list[bytes | None]:
        """The stored objects ``keys`` (None where absent), fetched concurrently
        (:meth:`~kvcouple.store.object_storage.ObjectStorageReads.fetch_objects`)."""
        return self.object_storage.fetch_objects(keys, count=count)

    @property
    def fetched_by(self) -> str:
        """Who fetches this store's chunk objects for the engine: "engine" (its own client,
        many requests in flight) or "fsspec" (zarr's store); "local" for a local store."""
        return self.object_storage.fetched_by

    @property
    def remote_reads(self) -> tuple[int, int, float]:
        """Chunk objects fetched from object storage by the engine's path so far: (requests,
        bytes, seconds the fetches took, summed)."""
        return self.object_storage.remote_reads
