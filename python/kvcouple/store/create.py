"""A new trace store: its layout (:class:`StoreLayout`: every dimension's size), the chunk and
shard shapes (one document and policy per chunk; :func:`docs_per_shard` documents per stored
object with zarr-python 3), the checksummed codecs, and building it: locally in a temporary
folder renamed into place (:func:`create_local`), on object storage uploaded with the group's
metadata last (:func:`create_remote`). Filling it is :mod:`kvcouple.store.writer`'s.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from kvcouple.errors import StoreError
from kvcouple.store import registry, sharding
from kvcouple.store.schema import RUN_KEYS, TEXT_VARIABLES, Record, variables
from kvcouple.store.text import TEXT_ATTR, TextTables

__all__ = [
    "StoreLayout",
    "create_array",
    "create_local",
    "create_remote",
    "docs_per_shard",
    "jsonable",
    "open_group",
    "remote_exists",
    "write_empty_chunks",
    "zarr_module",
]


def zarr_module() -> Any:
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
    return hasattr(zarr_module(), "create_array")


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
            f"writing a trace store with zarr-python {zarr_module().__version__} needs numcodecs >= "
            f"0.13 (zstd checksums; this is {numcodecs.__version__}): upgrade numcodecs, or "
            "install zarr >= 3"
        ) from None


def create_array(
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


def open_group(path: str | Path, mode: Literal["r", "r+", "a", "w", "w-"]) -> Any:
    """A new group (``mode="w"``) in the format this zarr-python writes with checksums; an
    existing one in whatever format it has."""
    if mode == "w" and _zarr3():
        return zarr_module().open_group(str(path), mode=mode, zarr_format=3)
    return zarr_module().open_group(str(path), mode=mode)


def write_empty_chunks() -> Any:
    """A context in which zarr 3 writes chunks equal to the fill value (zarr 2 always does)."""
    config = getattr(zarr_module(), "config", None)
    if config is None:
        import contextlib

        return contextlib.nullcontext()
    return config.set({"array.write_empty_chunks": True})


def jsonable(v: Any) -> Any:
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
    group = open_group(tmp, "w")
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
            create_array(group, name, np.zeros(shape, bool), chunks, dtype, dims, True, shards)
        else:
            create_array(group, name, shape, chunks, dtype, dims, True, shards)
    coords = {
        "doc": np.arange(sizes["doc"], dtype=np.int32),
        "policy": np.array(layout.policies, dtype=f"<U{max(map(len, layout.policies))}"),
        "rep": np.arange(sizes["rep"], dtype=np.int32),
        "step": np.arange(1, sizes["step"] + 1, dtype=np.int32),
        "branch": np.arange(1, sizes["branch"] + 1, dtype=np.int32),
        "lag": np.arange(sizes["lag"], dtype=np.int32),
    }
    for name, values in coords.items():
        create_array(group, name, values, values.shape, values.dtype.str, (name,), False)
    ids = np.array(layout.doc_ids, dtype=f"<U{max(1, max(map(len, layout.doc_ids)))}")
    create_array(group, "doc_id", ids, ids.shape, ids.dtype.str, ("doc",), False)
    if text is not None:
        attrs = {**attrs, TEXT_ATTR: text.decoder}
        for name, values in text.arrays(layout.vocab_size).items():
            dims = TEXT_VARIABLES[name].dims
            chunks = (1, *values.shape[1:]) if dims[0] == "doc" else values.shape
            shards = sharding.shard_shape(dims, chunks, {}, per_shard)
            dtype = TEXT_VARIABLES[name].dtype
            create_array(group, name, values, chunks, dtype, dims, True, shards)
    # The plan registry is born with the store (kvcouple.store.registry); written after
    # consolidating, which warns about files that are not zarr nodes.
    group.attrs.update({**attrs, registry.MARKER_ATTR: registry.REGISTRY_NAME})
    with warnings.catch_warnings():
        # zarr 3 notes that consolidated metadata is not in the v3 specification: readers
        # without it read the nodes' own metadata, which is complete.
        warnings.simplefilter("ignore")
        zarr_module().consolidate_metadata(str(tmp))
    registry.create_registry(tmp, store, registry.fingerprint(attrs, RUN_KEYS), RUN_KEYS)


# The group's own metadata: uploaded last, so a store on object storage exists (for readers
# and for other shards) only once everything else is in place.
_ROOT_METADATA = (".zgroup", ".zattrs", ".zmetadata", "zarr.json")


def _fs(url: str) -> tuple[Any, str]:
    import fsspec

    fs, root = fsspec.core.url_to_fs(url)
    return fs, root.rstrip("/")


def remote_exists(url: str) -> bool:
    fs, root = _fs(url)
    fs.invalidate_cache()
    return any(fs.exists(f"{root}/{m}") for m in (".zmetadata", "zarr.json"))


def create_remote(
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


def create_local(
    path: Path, layout: StoreLayout, attrs: dict[str, Any], text: TextTables | None = None
) -> None:
    """Create a store in the local folder ``path``: built in a temporary folder beside it,
    then renamed into place (atomic: where another ``--shard`` process won the race, its
    store stands and this one is dropped)."""
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
