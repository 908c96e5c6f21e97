"""The one way kvcouple reads a trace store: :class:`TraceStoreReader`.

Every consumer (the analysis, ``kvcouple info``, Dask workers, the recomputation of TVs) reads
through this module, and no other module computes chunk keys. The reader opens a store once
(a local path or a URL such as ``s3://bucket/run.zarr``), validates its attributes against its
array shapes and its coordinates, and then reads one document (or one document and policy) at
a time, whatever the chunking on disk: documents chunked by 1, by several or all together,
steps or vocabulary chunked, Zarr v2 or v3, sharded or not. Selections go through Zarr's own
indexing (or the Rust store engine: :mod:`kvcouple.store.engine_reads`; on object storage
:mod:`kvcouple.store.remote` fetches), never through element 0 of a chunk. The reader's
parts: this module opens, validates, computes chunk keys and checks values;
:class:`~kvcouple.store.engine_reads.EngineReads` reads through the engine;
:class:`~kvcouple.store.remote.ObjectStorageReads` fetches objects.

Every block read is checked: its chunk files must exist (Zarr would silently return the fill
value for a missing one), must decode and match their checksums (schema version 3; version 2
stores have none and are reported as such: :attr:`TraceStoreReader.checksums`), and must hold
values the schema allows (hazard and TVs in [0, 1], NaN only where nothing was recorded,
mismatch in {-1, 0, 1}, tokens in
[-1, vocab), branch steps within the horizon, stored distributions summing to 1, prompt and
cache lengths in range: :data:`kvcouple.store.schema.RULES`). A failure raises
:class:`~kvcouple.errors.StoreError` naming the variable, the chunk, the document and the store.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from kvcouple.errors import SchemaVersionError, StoreError

# check_memory (kvcouple.resources) and UNIT_SLACK (a value rule) moved to their own modules
# and stay importable from here.
from kvcouple.resources import available_memory as available_memory
from kvcouple.resources import check_memory as check_memory
from kvcouple.store.engine_reads import EngineReads
from kvcouple.store.engine_reads import zarr_major as _zarr_major
from kvcouple.store.lock import StoreBeingWrittenError, writing_note
from kvcouple.store.remote import is_url as is_url
from kvcouple.store.schema import (
    CHECKSUMS_SINCE,
    READABLE_VERSIONS,
    RULES,
    SCHEMA_VERSION,
    Record,
    disallowed,
    distribution_problems,
    row_sum_tolerance,
    variables,
)
from kvcouple.store.schema import UNIT_SLACK as UNIT_SLACK
from kvcouple.store.unrecorded import recorded_nan

# Coordinates written by the writer (dimension name -> first value); doc_id labels documents.
DIM_COORDS = {"doc": 0, "policy": None, "rep": 0, "step": 1, "branch": 1, "lag": 0}
DOC_ID = "doc_id"
COMPLETED = "completed"
POLICY = "policy"

# Attributes that fix a dimension's size: (attribute, dimension, size from attribute value).
SIZE_ATTRS = (
    ("horizon", "step", lambda v: v),
    ("window", "lag", lambda v: v + 1),
    ("branches", "branch", lambda v: v),
    ("replicates", "rep", lambda v: v),
    ("vocab_size", "vocab", lambda v: v),
)


def _fmt_index(idx: tuple[int, ...]) -> str:
    return "(" + ", ".join(map(str, idx)) + ")"


# Codecs that checksum a chunk: Zarr v3 names (crc32c) and numcodecs ids (Zarr v2 filters).
_CHECKSUM_CODECS = ("crc32c", "crc32", "adler32", "fletcher32", "jenkins_lookup3")


def _checksum_kind(meta: Any) -> str | None:
    """The checksum a node's codec metadata (a JSON-like tree) puts on every chunk: a
    checksum codec's name, ``"zstd checksum"`` for Zstd frames written with their checksum
    flag, else None."""
    if isinstance(meta, dict):
        name = meta.get("name", meta.get("id"))
        if name in _CHECKSUM_CODECS:
            return str(name)
        config = meta.get("configuration", meta)
        if name == "zstd" and isinstance(config, dict) and config.get("checksum") is True:
            return "zstd checksum"
        # Inside a shard, the chunks' own codecs (not the shard index's) are what count.
        children = [v for k, v in meta.items() if k != "index_codecs"]
    elif isinstance(meta, list | tuple):
        children = list(meta)
    else:
        return None
    for child in children:
        found = _checksum_kind(child)
        if found is not None:
            return found
    return None


def _codec_metadata(arr: Any) -> Any:
    """An array's codecs as JSON-like metadata (zarr 3: the node's metadata; zarr 2: its
    compressor and filters)."""
    meta = getattr(arr, "metadata", None)
    if meta is not None and hasattr(meta, "to_dict"):
        d = meta.to_dict()
        return [d.get("codecs"), d.get("compressor"), d.get("filters")]
    compressor = getattr(arr, "compressor", None)
    filters = getattr(arr, "filters", None) or []
    return [c.get_config() for c in (compressor, *filters) if c is not None]


def _is_checksum_failure(err: Exception) -> bool:
    # zarr's crc32c codec, numcodecs' checksum codecs and zstd's frame check all say so.
    return "checksum" in str(err).lower()


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


class TraceStoreReader(EngineReads):
    """A validated, open trace store. Picklable: a Dask worker reopens it from the URL.

    ``storage_options`` are passed to fsspec for URLs (``s3://...``): credentials, endpoint.
    """

    def __init__(self, path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None):
        self.path = str(path)
        self.storage_options = dict(storage_options or {})
        self._group: Any = None
        self._arrays: dict[str, Any] = {}
        self._open()

    # -- opening and validation -------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_group"] = None
        state["_arrays"] = {}
        # This process's read-ahead, client and in-memory arrays: a worker makes its own.
        for name in self.PROCESS_STATE:
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    @property
    def group(self) -> Any:
        if self._group is None:
            self._group = self._open_group()
        return self._group

    def _open_group(self) -> Any:
        import zarr

        if not is_url(self.path) and not os.path.exists(self.path):
            raise StoreError(f"no trace store at {self.path}")
        kw: dict[str, Any] = {"mode": "r"}
        if self.storage_options:
            kw["storage_options"] = self.storage_options
        if not is_url(self.path) and not_a_store(self.path):
            raise StoreError(not_a_store(self.path))
        try:
            return zarr.open_group(self.path, **kw)
        except Exception as e:  # zarr and fsspec raise many types for unreadable metadata
            raise StoreError(f"{self.path} is not a readable Zarr store: {e}") from e

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

    def _open(self) -> None:
        attrs = dict(self.group.attrs)
        version = attrs.get("schema_version")
        if version is None:
            raise StoreError(
                f"{self.path} is a Zarr store but not a kvcouple trace store (no schema_version)"
            )
        if not isinstance(version, int) or isinstance(version, bool):
            raise StoreError(
                f"{self.path}: attribute schema_version is {version!r} "
                f"({type(version).__name__}), not an integer: the store's attributes are damaged"
            )
        if version not in READABLE_VERSIONS:
            readable = ", ".join(map(str, READABLE_VERSIONS))
            raise SchemaVersionError(
                f"{self.path} was written with trace-store schema version {version}; this "
                f"kvcouple (reads versions {readable}; writes {SCHEMA_VERSION}) cannot read it. "
                f"Re-trace, or use the kvcouple release that wrote it."
            )
        self.schema_version = version
        self.attrs = attrs
        try:
            self.record_level = Record.parse(str(attrs.get("record")))
        except ValueError as e:
            raise StoreError(f"{self.path}: attribute 'record': {e}") from None
        self.record = str(self.record_level)
        self.variables = variables(self.record_level)
        self.names = [n for n in self.variables if n != COMPLETED]
        self.dims = self._check_shapes()
        self.doc_ids = self._coordinate(DOC_ID, "doc")
        self.policies = self._coordinate(POLICY, "policy")
        specs = attrs.get("policy_specs")
        if specs is not None and list(specs) != self.policies:
            raise StoreError(
                f"{self.path}: coordinate 'policy' {self.policies} does not match the attribute "
                f"policy_specs {list(specs)}; the store is damaged"
            )
        ids = attrs.get("doc_ids")
        if ids is not None and list(ids) != self.doc_ids:
            raise StoreError(
                f"{self.path}: coordinate 'doc_id' does not match the attribute doc_ids; "
                f"the store is damaged"
            )
        for dim, first in DIM_COORDS.items():
            if first is not None and dim in self.group:
                values = self.read_coordinate(dim)
                want = np.arange(first, first + self.dims[dim])
                if values.shape != want.shape or not np.array_equal(values, want):
                    raise StoreError(
                        f"{self.path}: coordinate {dim!r} is not {first}..{first + self.dims[dim] - 1}"
                        f"; the store is damaged"
                    )
        self.checksums = self._checksums()
        self.completed_flags, self.flag_errors = self._read_completed()

    def _checksums(self) -> str:
        """What protects the chunks, in words: ``"crc32c on every chunk"`` (or another
        checksum), ``"no checksums"`` for stores written before schema version 3, or which
        variables lack one (a store re-written by a tool that dropped the codecs)."""
        names = [*self.variables, DOC_ID, POLICY]
        kinds = {n: _checksum_kind(_codec_metadata(self.array(n))) for n in names}
        found = sorted({k for k in kinds.values() if k is not None})
        lacking = [n for n, k in kinds.items() if k is None]
        if not found:
            why = (
                f"schema version {self.schema_version}"
                if self.schema_version < CHECKSUMS_SINCE
                else "re-written without them"
            )
            return f"no checksums ({why})"
        if lacking:
            shown = ", ".join(lacking[:5]) + (" ..." if len(lacking) > 5 else "")
            return f"{' and '.join(found)} on some variables; no checksums on {shown}"
        return f"{' and '.join(found)} on every chunk"

    def _check_shapes(self) -> dict[str, int]:
        """Every schema variable present with its dimensions; sizes agree across variables and
        with the attributes that define them (horizon, window, branches, replicates, K, vocab)."""
        sizes: dict[str, int] = {}
        for name, var in self.variables.items():
            dims = var.dims
            arr = self.array(name)
            if len(arr.shape) != len(dims):
                raise StoreError(
                    f"{self.path}: variable {name!r} has {len(arr.shape)} dimensions, the schema "
                    f"has {len(dims)} {dims}; the store is damaged"
                )
            for d, n in zip(dims, arr.shape, strict=True):
                if sizes.setdefault(d, int(n)) != n:
                    raise StoreError(
                        f"{self.path}: dimension {d!r} is {sizes[d]} long in one variable and "
                        f"{n} in {name!r}; the store is damaged"
                    )
        for attr, dim, size in SIZE_ATTRS:
            if dim not in sizes:
                continue
            value = self.attrs.get(attr)
            if not isinstance(value, int) or isinstance(value, bool):
                what = "missing" if value is None else f"{value!r}, not an integer"
                raise StoreError(f"{self.path}: attribute {attr!r} is {what}; the store is damaged")
            if size(value) != sizes[dim]:
                raise StoreError(
                    f"{self.path}: attribute {attr!r} is {value} but dimension {dim!r} has "
                    f"{sizes[dim]} entries; the store is damaged"
                )
        if self.record_level.kind == "topk" and sizes.get("k") != self.record_level.k:
            raise StoreError(
                f"{self.path}: record is {self.record} but dimension 'k' has {sizes.get('k')} "
                f"entries; the store is damaged"
            )
        return sizes

    def read_coordinate(self, name: str) -> np.ndarray:
        """A one-dimensional coordinate, every chunk present and decodable."""
        return self.read(name, (slice(None),))

    def _coordinate(self, name: str, dim: str) -> list[str]:
        values = [str(x) for x in self.read_coordinate(name)]
        if len(values) != self.dims[dim]:
            raise StoreError(
                f"{self.path}: coordinate {name!r} has {len(values)} entries, dimension {dim!r} "
                f"has {self.dims[dim]}; the store is damaged"
            )
        if any(v == "" for v in values) or len(set(values)) != len(values):
            raise StoreError(
                f"{self.path}: coordinate {name!r} has empty or repeated labels {values[:10]}; "
                f"the store is damaged"
            )
        return values

    def _read_completed(self) -> tuple[np.ndarray, dict[int, str]]:
        """The completion flags by document; a damaged flag chunk marks its documents damaged
        (with the message) rather than finished or unfinished. One existence query for every
        flag chunk and one read of the array (a store of thousands of documents has as many
        flag chunks: asked one at a time they cost milliseconds each); chunk by chunk only to
        name a chunk that fails to decode."""
        n = self.dims["doc"]
        flags = np.zeros(n, bool)
        errors: dict[int, str] = {}
        step = self.storage_grid(COMPLETED)[0]
        cells = [(slice(start, min(start + step, n)),) for start in range(0, n, step)]
        keys = [self.keys(COMPLETED, sel) for sel in cells]
        absent = set(self.missing([k for ks in keys for k in ks]))
        # Never written (zarr 3 skips all-False chunks): unfinished.
        present = [sel for sel, ks in zip(cells, keys, strict=True) if absent.isdisjoint(ks)]
        if not present:
            return flags, errors
        try:
            whole = np.asarray(self.array(COMPLETED)[:], dtype=bool)
        except Exception:  # codecs raise many types: find the chunk (and its documents)
            for sel in present:
                try:
                    flags[sel] = self.read(COMPLETED, sel)
                except StoreError as e:
                    for d in range(sel[0].start, sel[0].stop):
                        errors[d] = str(e)
            return flags, errors
        for sel in present:
            flags[sel] = whole[sel]
        return flags, errors

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
        return [
            i
            for i in range(self.dims["doc"])
            if not self.completed_flags[i] and i not in self.flag_errors
        ]

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

    # -- chunk geometry: the only place chunk keys are computed --------------------------------

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
        if _zarr_major() >= 3:
            return f"{arr.path}/{arr.metadata.encode_chunk_key(tuple(coords))}"
        return str(arr._chunk_key(tuple(coords)))

    def _cells(
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
            self.chunk_key(name, cell)
            for cell, _ in self._cells(name, sel, self.storage_grid(name))
        ]

    def missing(self, keys: list[str]) -> list[str]:
        """The keys of ``keys`` that are absent from the store (asked concurrently)."""
        if not keys:
            return []
        arr = self.array(next(iter(self._arrays)))  # any array: they share a store
        if _zarr_major() >= 3:
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

    # -- reading -----------------------------------------------------------------------------

    def _doc_label(self, name: str, sel: tuple[slice | int, ...]) -> str:
        var = self.variables.get(name)
        dims = var.dims if var is not None else ()
        if not dims or dims[0] != "doc":
            return ""
        s = sel[0]
        if isinstance(s, int):
            docs = [s]
        else:
            docs = list(range(*s.indices(self.dims["doc"])))
        if len(docs) == 1 and hasattr(self, "doc_ids"):
            return f" (document {self.doc_ids[docs[0]]!r})"
        return f" (documents {docs[0]}..{docs[-1]})" if docs else ""

    def read(self, name: str, sel: tuple[Any, ...]) -> np.ndarray:
        """``name[sel]`` after checking every stored object it touches exists; a decode
        failure names the chunk. Integer indices drop their axis, as in numpy."""
        arr = self.array(name)
        full = tuple(sel) + (slice(None),) * (len(arr.shape) - len(sel))
        as_slices = tuple(slice(s, s + 1) if isinstance(s, int | np.integer) else s for s in full)
        label = self._doc_label(name, full)
        absent = self.missing(self.keys(name, as_slices))
        if absent:
            raise StoreError(
                f"{self.path}: chunk {absent[0]} of variable {name!r}{label} is missing; the "
                f"store is damaged. Re-trace that document, or pass --allow-incomplete to "
                f"analyse the others."
            )
        try:
            return np.asarray(arr[full])
        except Exception as e:  # codecs raise many types
            raise self._locate_decode_error(name, as_slices, label, e) from e

    def _locate_decode_error(
        self, name: str, sel: tuple[slice, ...], label: str, err: Exception
    ) -> StoreError:
        arr = self.array(name)
        for cell, cell_sel in self._cells(name, sel, self.storage_grid(name)):
            try:
                arr[cell_sel]
            except Exception as inner:
                key = self.chunk_key(name, cell)
                if _is_checksum_failure(inner):
                    return self._checksum_error(
                        name, key, label, f"{type(inner).__name__}: {inner}"
                    )
                return StoreError(
                    f"{self.path}: chunk {key} of variable {name!r}"
                    f"{label} cannot be decoded ({type(inner).__name__}: {inner}); the store is "
                    f"damaged."
                )
        return StoreError(f"{self.path}: variable {name!r}{label} cannot be read: {err}")

    def _checksum_error(self, name: str, key: str, label: str, detail: str) -> StoreError:
        return StoreError(
            f"{self.path}: chunk {key} of variable {name!r}{label} cannot be decoded: it fails "
            f"its checksum, so its bytes changed after they were written ({detail}); the store "
            f"is damaged. Re-trace that document, or pass --allow-incomplete to analyse the "
            f"others."
        )

    def row_tolerance(self, name: str) -> float:
        """How far a row of the stored distribution ``name`` may sum from 1 (its format's
        rounding: :func:`kvcouple.store.schema.row_sum_tolerance`)."""
        arr = self.array(name)
        kind = "bfloat16" if arr.dtype.name == "bfloat16" else np.dtype(arr.dtype).name
        return row_sum_tolerance(kind, int(arr.shape[-1]))

    def _prompt_length(self, doc: int) -> int:
        cache = self.__dict__.setdefault("_prompt_lengths", {})
        if doc not in cache:
            cache[doc] = int(self.read_doc("prompt_length", doc))
        return int(cache[doc])

    def _value_error(
        self, name: str, full_pos: tuple[int, ...], shown: str, allowed: str
    ) -> StoreError:
        """A value the schema does not allow, named by chunk, document and element (for a row
        whose sum is wrong, the element is the row: its last index is omitted)."""
        grid = self.storage_grid(name)
        where = full_pos + (0,) * (len(grid) - len(full_pos))
        key = self.chunk_key(name, tuple(p // c for p, c in zip(where, grid, strict=True)))
        label = self._doc_label(name, (int(full_pos[0]),)) if full_pos else ""
        return StoreError(
            f"{self.path}: chunk {key} of variable {name!r}{label} holds {shown} at "
            f"{_fmt_index(full_pos)}; values must be {allowed}. The store is damaged."
        )

    def check_values(self, name: str, block: np.ndarray, origin: tuple[int, ...]) -> None:
        """Raise naming the chunk and element of the first value the schema does not allow.
        ``origin`` is the block's position in the array (one entry per array axis)."""
        rule = RULES.get(name)
        if rule is None or block.size == 0:
            return
        lead = tuple(int(o) for o in origin[: len(origin) - block.ndim])
        offset = origin[len(origin) - block.ndim :]
        nan = recorded_nan(self, name, block, origin)
        if nan is not None:  # a NaN where something was recorded: damage (no range sees it)
            raise self._value_error(name, *nan)
        if rule == "distribution":
            found = distribution_problems(block, self.row_tolerance(name))
            if found is None:
                return
            first, allowed = found
            whole_row = int(first[-1]) < 0
            idx = tuple(int(i) for i in (first[:-1] if whole_row else first))
            pos = lead + tuple(i + int(o) for i, o in zip(idx, offset, strict=False))
            shown = "a row" if whole_row else repr(block[idx].item())
            raise self._value_error(name, pos, shown, allowed)
        bad, allowed = disallowed(rule, block, self.dims, self.attrs.get("vocab_size"))
        if rule == "kept" and lead:
            # At most the document's prompt: kept_length counts prompt positions kept.
            limit = self._prompt_length(lead[0])
            bad = bad | (block > limit)
            allowed = f"in [1, {limit}] (the document's prompt_length)"
        if not bad.any():
            return
        at = np.unravel_index(int(np.flatnonzero(bad.reshape(-1))[0]), block.shape)
        pos = lead + tuple(int(i) + int(o) for i, o in zip(at, offset, strict=True))
        raise self._value_error(name, pos, repr(block[at].item()), allowed)

    def read_doc(self, name: str, doc: int) -> np.ndarray:
        """Every value of one document of ``name`` (its first axis is ``doc``), checked."""
        block = self.read(name, (int(doc),))
        self.check_values(name, block, (int(doc),) + (0,) * block.ndim)
        return block

    def check(self, docs: list[int] | None = None, *, data: bool = False) -> list[str]:
        """Every problem of the given documents (default: the finished ones), one line each:
        missing chunks, undecodable chunks, values the schema does not allow. Distribution
        variables (``vocab``/``k`` axes) are decoded only with ``data``."""
        problems = list(dict.fromkeys(self.flag_errors.values()))
        docs = self.done if docs is None else docs
        for name, var in self.variables.items():
            dims = var.dims
            if name == COMPLETED or not dims or dims[0] != "doc":
                continue
            heavy = "vocab" in dims or "k" in dims
            for d in docs:
                try:
                    if heavy and not data:
                        sel = (slice(d, d + 1),) + (slice(None),) * (len(dims) - 1)
                        absent = self.missing(self.keys(name, sel))
                        if absent:
                            problems.append(
                                f"{self.path}: chunk {absent[0]} of variable {name!r} "
                                f"(document {self.doc_ids[d]!r}) is missing"
                            )
                    else:
                        self.read_doc(name, d)
                except StoreError as e:
                    problems.append(str(e))
        return problems

    def size_bytes(self) -> int | None:
        """Bytes on disk (local stores), else None."""
        if is_url(self.path):
            return None
        total = 0
        for root, _, files in os.walk(self.path):
            for f in files:
                total += os.path.getsize(os.path.join(root, f))
        return total


def bytes_needed(*shape: int, itemsize: int = 8) -> int:
    return int(math.prod(shape)) * itemsize
