"""Create, resume and fill a trace store, one document region at a time.

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

import json
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from kvcouple.deprecation import moved_getattr
from kvcouple.errors import MissingExtraError, StoreError
from kvcouple.store import registry, sharding
from kvcouple.store.geometry import StoreGeometry, is_url
from kvcouple.store.resume import VocabularyMismatchError as VocabularyMismatchError
from kvcouple.store.resume import check_resume
from kvcouple.store.schema import RUN_KEYS as RUN_KEYS
from kvcouple.store.schema import SCHEMA_VERSION, TEXT_VARIABLES, Record, variables
from kvcouple.store.text import TEXT_ATTR, TextTables

# Read from where it lives now, for one release.
__getattr__ = moved_getattr(__name__, {"resume_mismatch": "kvcouple.store.resume"})


def _zarr() -> Any:
    """zarr-python, or None where it is not installed. Imported when a store is first
    written: the layout and the resume checks need no zarr, and importing it costs reading
    commands a fifth of a second."""
    try:
        import zarr
    except ModuleNotFoundError:  # pragma: no cover - a tracer-only environment
        return None
    return zarr


# Aim for chunks of a few MB to tens of MB (SPEC section 8).
_TARGET_CHUNK_BYTES = 16 * 2**20


@dataclass(frozen=True)
class StoreLayout:
    """The sizes of every dimension of a store.

    Parameters
    ----------
    doc_ids : list of str
        The document ids, unique and at least one (dimension ``doc``).
    policies : list of str
        The policy specs, at least one (dimension ``policy``).
    horizon : int
        Number of decode steps traced per document (dimension ``step``, >= 1).
    window : int
        Observation window L in lags after a divergence (>= 0; dimension ``lag`` has
        ``window + 1`` entries).
    branches : int
        Branches per replicate (dimension ``branch``, >= 1).
    replicates : int
        Replicates per document and policy (dimension ``rep``, >= 1).
    vocab_size : int
        The model's vocabulary size (dimension ``vocab``, >= 1).
    record : Record, optional
        What is recorded beyond the summary; default ``Record()`` (summary only).
    """

    doc_ids: list[str]
    policies: list[str]
    horizon: int
    window: int
    branches: int
    replicates: int
    vocab_size: int
    record: Record = field(default_factory=Record)

    def sizes(self) -> dict[str, int]:
        return {
            "doc": len(self.doc_ids),
            "policy": len(self.policies),
            "rep": self.replicates,
            "step": self.horizon,
            "branch": self.branches,
            "lag": self.window + 1,
            "k": max(self.record.k, 1),
            "vocab": self.vocab_size,
        }

    def validate(self) -> None:
        if not self.doc_ids:
            raise ValueError("a store needs at least one document")
        if len(set(self.doc_ids)) != len(self.doc_ids):
            raise ValueError("document ids must be unique")
        if not self.policies:
            raise ValueError("a store needs at least one policy")
        for name, v in [
            ("horizon", self.horizon),
            ("replicates", self.replicates),
            ("branches", self.branches),
            ("vocab_size", self.vocab_size),
        ]:
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if self.window < 0:
            raise ValueError(f"window must be >= 0, got {self.window}")


def _chunks(dims: tuple[str, ...], sizes: dict[str, int], itemsize: int) -> tuple[int, ...]:
    """One doc and one policy per chunk; vocab whole; grow the rest up to the target size."""
    chunk = {d: sizes[d] for d in dims}
    for d in ("doc", "policy"):
        if d in chunk:
            chunk[d] = 1
    for d in ("rep", "branch", "step", "lag"):
        total = itemsize * int(np.prod([chunk[x] for x in dims]))
        if d in chunk and total > _TARGET_CHUNK_BYTES:
            rest = total // chunk[d]
            chunk[d] = max(1, _TARGET_CHUNK_BYTES // max(rest, 1))
    return tuple(chunk[d] for d in dims)


def _zarr3() -> bool:
    return hasattr(_zarr(), "create_array")


def docs_per_shard(layout: StoreLayout) -> int:
    """Documents per stored object of the store ``layout`` describes
    (:func:`kvcouple.store.sharding.documents_per_shard`; 1 with zarr-python 2)."""
    if not _zarr3():
        return 1
    return sharding.documents_per_shard(layout.sizes(), len(layout.doc_ids), layout.record)


# Chunk keys as in Zarr format 2 (``hazard/1.0.0.0``) in format 3 too: one file per chunk in
# the variable's folder, the same names whichever zarr-python wrote the store.
_KEYS_V2 = {"name": "v2", "separator": "."}


def _codecs(compress: bool) -> dict[str, Any]:
    """Every chunk compressed (Zstd level 1) where ``compress``, and checksummed: with
    zarr-python 3, Zarr format 3 with the ``crc32c`` codec after Zstd (the checksum covers
    the bytes on disk); with zarr-python 2, Zarr format 2 with Zstd's frame checksum."""
    import numcodecs

    # Zstd level 1: on float16 distributions (128k-vocabulary rows and the embedded model's)
    # it is as small as level 3 or smaller and decodes ~1.4x faster (docs/store.md, measured).
    if _zarr3():
        from zarr.codecs import Crc32cCodec, ZstdCodec

        return {"compressors": ([ZstdCodec(level=1)] if compress else []) + [Crc32cCodec()]}
    try:
        # Zarr format 2 has one compressor and no place for a checksum of the stored bytes:
        # Zstd's own checksum (XXH64 of the content, checked on every decode) stands in.
        return {"compressor": numcodecs.Zstd(level=1, checksum=True)}
    except TypeError:  # numcodecs < 0.13 has no zstd checksum
        raise StoreError(
            f"writing a trace store with zarr-python {_zarr().__version__} needs numcodecs >= "
            f"0.13 (zstd checksums; this is {numcodecs.__version__}): upgrade numcodecs, or "
            "install zarr >= 3"
        ) from None


def _create_array(
    group: Any,
    name: str,
    data_or_shape: Any,
    chunks: tuple[int, ...],
    dtype: str,
    dims: tuple[str, ...],
    compress: bool = True,
    shards: tuple[int, ...] | None = None,
) -> Any:
    """Create one checksummed array with xarray's dimension names: Zarr format 3 with
    zarr-python 3 (sharded where ``shards`` is given), format 2 with zarr-python 2."""
    shape = data_or_shape.shape if isinstance(data_or_shape, np.ndarray) else data_or_shape
    if _zarr3():
        # Labels as variable-length strings (the Zarr v3 "string" type): numpy's fixed-width
        # unicode is not in the v3 specification.
        kind = str if np.dtype(dtype).kind == "U" else dtype
        arr = group.create_array(
            name,
            shape=shape,
            chunks=chunks,
            shards=shards,
            dtype=kind,
            dimension_names=list(dims),
            chunk_key_encoding=_KEYS_V2,
            # Also chunks equal to the fill value (the doc coordinate [0] of a one-document
            # store): readers take a missing chunk for damage.
            config={"write_empty_chunks": True},
            **_codecs(compress),
        )
    else:  # zarr 2
        arr = group.create_dataset(
            name, shape=shape, chunks=chunks, dtype=dtype, fill_value=None, **_codecs(compress)
        )
        arr.attrs.update({"_ARRAY_DIMENSIONS": list(dims)})
    if isinstance(data_or_shape, np.ndarray):
        arr[...] = data_or_shape
    return arr


def _open_group(path: str | Path, mode: Literal["r", "r+", "a", "w", "w-"]) -> Any:
    """A new group (``mode="w"``) in the format this zarr-python writes with checksums; an
    existing one in whatever format it has."""
    if mode == "w" and _zarr3():
        return _zarr().open_group(str(path), mode=mode, zarr_format=3)
    return _zarr().open_group(str(path), mode=mode)


def _write_empty_chunks() -> Any:
    """A context in which zarr 3 writes chunks equal to the fill value (zarr 2 always does)."""
    config = getattr(_zarr(), "config", None)
    if config is None:
        import contextlib

        return contextlib.nullcontext()
    return config.set({"array.write_empty_chunks": True})


def _jsonable(v: Any) -> Any:
    return json.loads(json.dumps(v, default=str))


def _build(
    tmp: Path,
    layout: StoreLayout,
    attrs: dict[str, Any],
    store: Path | None = None,
    text: TextTables | None = None,
) -> None:
    """Every array, coordinate and attribute of a new store, in the local folder ``tmp``; the
    plan registry too (taking over a registration waiting beside a local ``store``); the
    run's ``text`` where it has one (schema version 4)."""
    group = _open_group(tmp, "w")
    sizes = layout.sizes()
    per_shard = docs_per_shard(layout)
    for name, (dims, dtype, _) in variables(layout.record).items():
        shape = tuple(sizes[d] for d in dims)
        itemsize = np.dtype(dtype).itemsize
        chunks = _chunks(dims, sizes, itemsize)
        shards = sharding.shard_shape(dims, chunks, sizes, per_shard)
        if name == "completed" and shards is not None:
            # The flags are read whole by every run and reader: one chunk a shard's documents
            # (not sharded), not an inner chunk each.
            chunks, shards = shards, None
        if name == "completed":
            # Written in full now: zarr 2 returns unwritten chunks of an array without
            # a fill value as uninitialised memory, and this flag must read False.
            _create_array(group, name, np.zeros(shape, bool), chunks, dtype, dims, True, shards)
        else:
            _create_array(group, name, shape, chunks, dtype, dims, True, shards)
    coords = {
        "doc": np.arange(sizes["doc"], dtype=np.int32),
        "policy": np.array(layout.policies, dtype=f"<U{max(map(len, layout.policies))}"),
        "rep": np.arange(sizes["rep"], dtype=np.int32),
        "step": np.arange(1, sizes["step"] + 1, dtype=np.int32),
        "branch": np.arange(1, sizes["branch"] + 1, dtype=np.int32),
        "lag": np.arange(sizes["lag"], dtype=np.int32),
    }
    for name, values in coords.items():
        _create_array(group, name, values, values.shape, values.dtype.str, (name,), False)
    ids = np.array(layout.doc_ids, dtype=f"<U{max(1, max(map(len, layout.doc_ids)))}")
    _create_array(group, "doc_id", ids, ids.shape, ids.dtype.str, ("doc",), False)
    if text is not None:
        attrs = {**attrs, TEXT_ATTR: text.decoder}
        for name, values in text.arrays(layout.vocab_size).items():
            dims = TEXT_VARIABLES[name].dims
            chunks = (1, *values.shape[1:]) if dims[0] == "doc" else values.shape
            shards = sharding.shard_shape(dims, chunks, {}, per_shard)
            dtype = TEXT_VARIABLES[name].dtype
            _create_array(group, name, values, chunks, dtype, dims, True, shards)
    # The plan registry is born with the store (kvcouple.store.registry); written after
    # consolidating, which warns about files that are not zarr nodes.
    group.attrs.update({**attrs, registry.MARKER_ATTR: registry.REGISTRY_NAME})
    with warnings.catch_warnings():
        # zarr 3 notes that consolidated metadata is not in the v3 specification: readers
        # without it read the nodes' own metadata, which is complete.
        warnings.simplefilter("ignore")
        _zarr().consolidate_metadata(str(tmp))
    registry.create_registry(tmp, store, registry.fingerprint(attrs, RUN_KEYS), RUN_KEYS)


# The group's own metadata: uploaded last, so a store on object storage exists (for readers
# and for other shards) only once everything else is in place.
_ROOT_METADATA = (".zgroup", ".zattrs", ".zmetadata", "zarr.json")


def _fs(url: str) -> tuple[Any, str]:
    import fsspec

    fs, root = fsspec.core.url_to_fs(url)
    return fs, root.rstrip("/")


def _remote_exists(url: str) -> bool:
    fs, root = _fs(url)
    fs.invalidate_cache()
    return any(fs.exists(f"{root}/{m}") for m in (".zmetadata", "zarr.json"))


def _create_remote(
    url: str, layout: StoreLayout, attrs: dict[str, Any], text: TextTables | None = None
) -> None:
    """Create a store on object storage: built locally, uploaded, the group metadata last.
    Object stores have no atomic rename; shards racing to create the same run upload the same
    bytes, and a run with other settings is refused on resume by :func:`check_resume`."""
    fs, root = _fs(url)
    tmp = Path(tempfile.mkdtemp(prefix=".kvcouple-store."))
    try:
        _build(tmp, layout, attrs, text=text)
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        late = [p for p in files if p.parent == tmp and p.name in _ROOT_METADATA]
        early = [p for p in files if p not in late]
        late.sort(key=lambda p: _ROOT_METADATA.index(p.name))
        for batch in (early, late):
            fs.put(
                [str(p) for p in batch], [f"{root}/{p.relative_to(tmp).as_posix()}" for p in batch]
            )
        fs.invalidate_cache()
    except Exception as e:
        raise StoreError(f"cannot create the store {url}: {type(e).__name__}: {e}") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


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
        if _zarr() is None:
            raise MissingExtraError(
                "writing a trace store needs zarr, which is not installed: pip install 'zarr>=2.16'"
            )
        layout.validate()
        store: str | Path = str(path) if is_url(str(path)) else Path(path)
        full_attrs = _jsonable(
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
            if not _remote_exists(store):
                _create_remote(store, layout, full_attrs, text)
        elif not store.exists():
            cls._create(store, layout, full_attrs, text)
        elif not store.is_dir() or not any((store / m).exists() for m in (".zgroup", "zarr.json")):
            what = "a file" if not store.is_dir() else "a directory without a Zarr group"
            raise StoreError(
                f"{store} exists and is {what}, not a kvcouple trace store: write to a new path"
            )
        group = _open_group(store, "r+")
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

    @classmethod
    def _create(
        cls, path: Path, layout: StoreLayout, attrs: dict[str, Any], text: TextTables | None
    ) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
        try:
            _build(tmp, layout, attrs, path, text)
            try:
                os.rename(tmp, path)  # atomic: another shard may have won the race
            except OSError:
                if not path.exists():
                    raise
            registry.discard_pending(path)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)

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
        with _write_empty_chunks():
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
        with _write_empty_chunks():
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
        layout :func:`_codecs` makes, one shard per document region): written aside, then
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
