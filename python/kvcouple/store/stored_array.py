"""A local Zarr v3 store read without zarr-python: :class:`LocalGroup` and
:class:`StoredArray`, the part of :class:`kvcouple.store.geometry.StoreGeometry` that opens a
store. Importing zarr-python costs 0.25-0.4 s (its codec registry, fsspec's and numcodecs'
entry points), more than the rest of a small analysis; the engine (zarrs, in Rust) decodes
every numeric chunk kvcouple writes, and a string coordinate's ``vlen-utf8`` chunk is short
enough to read here.

An array these do not read (another data type, codec or chunk layout, a Zarr v2 store, a
store on object storage) is zarr-python's, imported when first needed: ``StoreGeometry`` opens
it so, and :class:`StoredArray` hands a layout the engine calls unsupported to it. Reads keep
zarr-python's meaning: an absent chunk (or inner chunk of a shard) reads as the fill value,
and the caller, which asks for every chunk's presence first, names it; a chunk that fails
to decode raises, with the word "checksum" where its checksum fails.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from kvcouple import _core
from kvcouple.errors import StoreError

# The numeric data types the engine decodes (stored little endian), by Zarr v3 name.
NUMERIC = {
    "bool": "|b1",
    "int8": "|i1",
    "uint8": "|u1",
    "int16": "<i2",
    "uint16": "<u2",
    "int32": "<i4",
    "uint32": "<u4",
    "int64": "<i8",
    "uint64": "<u8",
    "float16": "<f2",
    "float32": "<f4",
    "float64": "<f8",
}
_FLOAT_FILLS = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
# An inner chunk a shard's index marks absent: offset and size both 2**64 - 1.
ABSENT = 2**64 - 1


class ChunkDecodeError(ValueError):
    """A chunk of a stored array that cannot be decoded (its message says "checksum" where
    its checksum fails, as zarr-python's codecs do)."""


def v3_metadata(root: str, node: str = "") -> dict[str, Any] | None:
    """The Zarr v3 metadata document of ``node`` (the group at ``""``) of the local store at
    ``root``, or None where it has none (another format, or no such node)."""
    try:
        with open(os.path.join(root, node, "zarr.json"), "rb") as f:
            meta = json.loads(f.read())
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or meta.get("zarr_format") != 3:
        return None
    return meta


class Codec:
    """One codec of an array's metadata (``to_dict``: as stored)."""

    def __init__(self, meta: dict[str, Any]) -> None:
        self.meta = meta

    def to_dict(self) -> dict[str, Any]:
        return self.meta


class ArrayMetadata:
    """A stored array's Zarr v3 metadata: what zarr-python's ``metadata`` gives the reader
    (``zarr_format``, ``codecs``, ``to_dict``, ``encode_chunk_key``)."""

    zarr_format = 3

    def __init__(self, meta: dict[str, Any]) -> None:
        self.meta = meta
        self.codecs = [Codec(c) for c in meta.get("codecs", [])]
        encoding = meta.get("chunk_key_encoding") or {}
        config = encoding.get("configuration") or {}
        self.key_encoding = str(encoding.get("name", "default"))
        default_separator = "." if self.key_encoding == "v2" else "/"
        self.separator = str(config.get("separator", default_separator))

    def to_dict(self) -> dict[str, Any]:
        return self.meta

    def encode_chunk_key(self, coords: tuple[int, ...]) -> str:
        """The key (relative to the array) of the stored object at grid position ``coords``."""
        parts = [str(int(c)) for c in coords]
        if self.key_encoding == "v2":
            return self.separator.join(parts) if parts else "0"
        return self.separator.join(["c", *parts])


def _layout(meta: dict[str, Any]) -> tuple[tuple[int, ...], tuple[int, ...] | None, list[Any]]:
    """``(decoded chunk shape, shard shape or None, the chunks' own codecs)``."""
    grid = meta.get("chunk_grid") or {}
    if grid.get("name") != "regular":
        raise ValueError("not a regular chunk grid")
    outer = tuple(int(c) for c in grid["configuration"]["chunk_shape"])
    codecs = list(meta.get("codecs") or [])
    if codecs and codecs[0].get("name") == "sharding_indexed":
        config = codecs[0].get("configuration") or {}
        inner = tuple(int(c) for c in config["chunk_shape"])
        return inner, outer, list(config.get("codecs") or [])
    return outer, None, codecs


class StoredArray:
    """One array of a local Zarr v3 store, read by the engine (numbers) or here (strings):
    the attributes of a zarr-python array the reader uses (``path``, ``shape``, ``ndim``,
    ``dtype``, ``chunks`` (the decoded chunk), ``shards``, ``metadata``) and ``array[sel]``
    (integers and unit-step slices). ``zarr_array`` opens the same array with zarr-python for
    what only it does."""

    def __init__(
        self, root: str, name: str, meta: dict[str, Any], open_zarr: Callable[[], Any]
    ) -> None:
        self.root, self.path, self._open_zarr = root, name, open_zarr
        self.metadata = ArrayMetadata(meta)
        self.shape = tuple(int(n) for n in meta["shape"])
        self.ndim = len(self.shape)
        self.chunks, self.shards, codecs = _layout(meta)
        names = [c.get("name") for c in codecs]
        kind = meta.get("data_type")
        self.strings = kind == "string"
        self.plain = self.strings
        if self.strings:
            if self.shards is not None or names not in (["vlen-utf8"], ["vlen-utf8", "crc32c"]):
                raise ValueError(f"string chunks coded {names}")
            self.dtype = np.dtype(object)
            self.fill_value: Any = str(meta.get("fill_value") or "")
        elif kind in NUMERIC:
            self.dtype = np.dtype(NUMERIC[kind]).newbyteorder("=")
            # Uncompressed chunks (the coordinates) are read here, the others by the engine.
            little = (codecs[0].get("configuration") or {}).get("endian", "little") == "little"
            self.plain = (
                self.shards is None
                and names in (["bytes"], ["bytes", "crc32c"])
                and (little or self.dtype.itemsize == 1)
            )
            fill = meta.get("fill_value", 0)
            if isinstance(fill, str) and fill not in _FLOAT_FILLS:
                raise ValueError(f"fill value {fill!r}")  # a hex bit pattern: zarr-python's
            self.fill_value = _FLOAT_FILLS.get(fill, fill) if isinstance(fill, str) else fill
        else:
            raise ValueError(f"data type {kind!r}")
        if (
            not self.ndim
            or len(self.chunks) != self.ndim
            or min(self.chunks) < 1
            or min(self.shape) < 0
            or (self.shards is not None and any(s % c for s, c in zip(self.shards, self.chunks)))
        ):
            # Metadata this reader does not take as given: zarr-python reads it, or says why.
            raise ValueError("a scalar array, or chunks of another rank or size")
        self._text = json.dumps(meta)
        self._zarr: Any = None
        self.unsupported = False  # the engine does not read this layout: zarr-python does

    @property
    def zarr_array(self) -> Any:
        """The same array opened with zarr-python (imported on first use)."""
        if self._zarr is None:
            self._zarr = self._open_zarr()
        return self._zarr

    def __getattr__(self, name: str) -> Any:
        # What the reader asks of zarr-python's arrays on its other paths (store_path,
        # _async_array) goes to zarr-python's array.
        if name.startswith("__") or name in ("_zarr", "_open_zarr", "unsupported"):
            raise AttributeError(name)
        return getattr(self.zarr_array, name)

    def __getitem__(self, sel: Any) -> np.ndarray:
        box, drop = self._box(sel)
        if self.unsupported or box is None:
            return np.asarray(self.zarr_array[sel])
        out = np.full(tuple(b.stop - b.start for b in box), self.fill_value, self.dtype)
        ranges = [range(b.start // c, (b.stop - 1) // c + 1) for b, c in zip(box, self.chunks)]
        cells = list(itertools.product(*ranges)) if out.size else []
        decoded = self._decode(cells)
        if decoded is None:  # the engine does not read this layout: zarr-python does
            return np.asarray(self.zarr_array[sel])
        for cell, chunk in zip(cells, decoded, strict=True):
            if chunk is None:
                continue  # absent: the fill value
            src, dst = [], []
            for c, size, b in zip(cell, self.chunks, box, strict=True):
                lo, hi = max(b.start, c * size), min(b.stop, (c + 1) * size)
                src.append(slice(lo - c * size, hi - c * size))
                dst.append(slice(lo - b.start, hi - b.start))
            out[tuple(dst)] = chunk[tuple(src)]
        return out[drop] if drop else out

    def _box(self, sel: Any) -> tuple[tuple[slice, ...] | None, tuple[Any, ...]]:
        """The selection as one unit-step slice per axis, and the indexing that drops the
        axes given as integers; ``(None, ())`` for a selection read through zarr-python."""
        sel = sel if isinstance(sel, tuple) else (sel,)
        if any(s is Ellipsis for s in sel):
            at = sel.index(Ellipsis)
            sel = sel[:at] + (slice(None),) * (self.ndim - len(sel) + 1) + sel[at + 1 :]
        if len(sel) > self.ndim:
            raise IndexError(f"too many indices for an array of {self.ndim} dimensions")
        sel = sel + (slice(None),) * (self.ndim - len(sel))
        box: list[slice] = []
        drop: list[int | slice] = []
        dropped = False
        for s, n in zip(sel, self.shape, strict=True):
            if isinstance(s, int | np.integer) and not isinstance(s, bool):
                i = int(s) + (n if s < 0 else 0)
                if not 0 <= i < n:
                    raise IndexError(f"index {int(s)} is out of bounds for an axis of {n}")
                box.append(slice(i, i + 1))
                drop.append(0)
                dropped = True
            elif isinstance(s, slice):
                start, stop, step = s.indices(n)
                if step != 1:
                    return None, ()
                box.append(slice(start, max(start, stop)))
                drop.append(slice(None))
            else:
                return None, ()
        return tuple(box), (tuple(drop) if dropped else ())

    def _object(self, cell: tuple[int, ...]) -> tuple[str, int]:
        """The key (relative to the store) of the object holding decoded chunk ``cell``, and
        the chunk's index inside it (-1: unsharded)."""
        if self.shards is None:
            return f"{self.path}/{self.metadata.encode_chunk_key(cell)}", -1
        per = tuple(s // c for s, c in zip(self.shards, self.chunks, strict=True))
        shard = tuple(c // p for c, p in zip(cell, per, strict=True))
        inner = int(np.ravel_multi_index(tuple(c % p for c, p in zip(cell, per)), per))
        return f"{self.path}/{self.metadata.encode_chunk_key(shard)}", inner

    def _decode(self, cells: list[tuple[int, ...]]) -> list[np.ndarray | None] | None:
        """Each cell's decoded chunk (None where absent); None where the engine does not
        read this layout (then for good)."""
        if not cells:
            return []
        if self.plain:
            return [self._plain(self._object(c)[0]) for c in cells]
        objects = [self._object(c) for c in cells]
        got, missing = self._engine(objects)
        if not missing:
            return got  # None: unsupported
        # Some chunks are absent: those read as the fill value, the others decoded.
        there = [i for i, (k, j) in enumerate(objects) if self._present(k, j)]
        if len(there) == len(objects):
            raise ChunkDecodeError(f"chunk {missing} cannot be read")
        got, missing = self._engine([objects[i] for i in there])
        if missing:  # present a moment ago
            raise ChunkDecodeError(f"chunk {missing} cannot be read")
        if got is None:
            return None
        out: list[np.ndarray | None] = [None] * len(cells)
        for i, chunk in zip(there, got, strict=True):
            out[i] = chunk
        return out

    def _engine(self, objects: list[tuple[str, int]]) -> tuple[list[np.ndarray | None] | None, str]:
        """The engine's decode of ``objects`` (key, inner chunk): ``(chunks, "")``, ``(None,
        "")`` where it does not read this layout (zarr-python does, from now on), ``(None,
        key)`` where an object is absent."""
        inner = [i for _, i in objects] if self.shards is not None else None
        got, problem = _core.store_decode_chunks(
            [self._text], [0] * len(objects), [k for k, _ in objects], root=self.root, inner=inner
        )
        if problem is None:
            return [self._chunk(b) for b in got], ""
        kind, key, message = problem
        if kind == "missing":
            return None, key
        if kind == "unsupported":
            self.unsupported = True
            return None, ""
        what = "fails its checksum" if kind == "checksum" else "cannot be decoded"
        raise ChunkDecodeError(f"chunk {key} {what}: {message} ({kind})")

    def _chunk(self, raw: np.ndarray) -> np.ndarray:
        stored = self.dtype.newbyteorder("<") if self.dtype.itemsize > 1 else self.dtype
        return np.frombuffer(raw, stored).reshape(self.chunks)

    def _present(self, key: str, inner: int) -> bool:
        """Whether the object ``key`` (and inner chunk ``inner`` of a shard) is stored."""
        if inner < 0:
            return os.path.exists(os.path.join(self.root, key))
        assert self.shards is not None
        count = math.prod(s // c for s, c in zip(self.shards, self.chunks, strict=True))
        found = shard_index(self.root, key, count)
        if found is None:
            return False
        offset, size = (int(v) for v in found[0][inner])
        return not (offset == ABSENT and size == ABSENT)

    def _plain(self, key: str) -> np.ndarray | None:
        """An uncompressed chunk (``bytes``, or a string coordinate's ``vlen-utf8``), its
        crc32c checked where it has one; None where absent."""
        try:
            with open(os.path.join(self.root, key), "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return None
        if self.metadata.codecs[-1].meta.get("name") == "crc32c":
            body, tail = raw[:-4], raw[-4:]
            if len(raw) < 4 or _core.store_crc32c(body) != int.from_bytes(tail, "little"):
                raise ChunkDecodeError(f"chunk {key} fails its crc32c checksum")
            raw = body
        count = math.prod(self.chunks)
        if not self.strings:
            want = count * self.dtype.itemsize
            if len(raw) != want:
                raise ChunkDecodeError(f"chunk {key} holds {len(raw)} bytes, not {want}")
            return self._chunk(np.frombuffer(raw, np.uint8))
        values = _vlen_utf8(raw, key)
        if len(values) != count:
            raise ChunkDecodeError(f"chunk {key} holds {len(values)} strings, not {count}")
        out = np.empty(count, object)
        out[:] = values
        return out.reshape(self.chunks)


def _vlen_utf8(raw: bytes, key: str) -> list[str]:
    """The strings of a ``vlen-utf8`` chunk: a little-endian u32 count, then each string's
    u32 length and UTF-8 bytes (parsed by the engine: 100k document ids in milliseconds)."""
    try:
        return _core.store_vlen_utf8(raw)
    except ValueError as e:
        raise ChunkDecodeError(f"chunk {key} is not a vlen-utf8 chunk ({e})") from None


def shard_index(root: str, key: str, count: int) -> tuple[np.ndarray, int] | None:
    """The ``(offset, size)`` index at the end of the local shard ``key`` of ``count`` inner
    chunks (the layout kvcouple writes), and the bytes before it; None where the shard is
    absent or too short to hold an index. The index's own crc32c is not checked here: the
    decoder that reads the shard checks it."""
    try:
        with open(os.path.join(root, key), "rb") as f:
            body = f.seek(0, os.SEEK_END) - (16 * count + 4)
            if body < 0:
                return None
            f.seek(body)
            raw = f.read(16 * count)
    except OSError:
        return None
    return np.frombuffer(raw, "<u8").reshape(count, 2), body


class LocalGroup:
    """The root group of a local Zarr v3 store, read without zarr-python: its attributes,
    which arrays it has, and each as a :class:`StoredArray` (or, where that does not read
    it, as zarr-python's array from ``open_zarr(name)``)."""

    def __init__(self, root: str, meta: dict[str, Any], open_zarr: Callable[[str], Any]):
        self.root = root
        attrs = meta.get("attributes", {})
        if not isinstance(attrs, dict):
            raise StoreError(f"{root}: the group's attributes are not a mapping")
        self.attrs = attrs
        self._open_zarr = open_zarr

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and os.path.exists(os.path.join(self.root, name, "zarr.json"))

    def __getitem__(self, name: str) -> Any:
        meta = v3_metadata(self.root, name)
        if meta is None:
            if name in self:
                return self._open_zarr(name)  # unreadable here: zarr-python names why
            raise KeyError(name)
        if meta.get("node_type") != "array":
            return self._open_zarr(name)
        try:
            return StoredArray(self.root, name, meta, lambda: self._open_zarr(name))
        except (ValueError, KeyError, TypeError):
            return self._open_zarr(name)  # a layout or data type read by zarr-python
