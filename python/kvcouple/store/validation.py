"""What the reader checks: :class:`StoreValidation`, the part of
:class:`kvcouple.store.reader.TraceStoreReader` that validates a store when it opens (schema
version, record level, every variable's dimensions against the others and against the
attributes that size them, the coordinates, the completion flags) and every block it reads
through zarr-python.

Every block read is checked: its chunk files must exist (Zarr would silently return the fill
value for a missing one), must decode and match their checksums (schema version 3; version 2
stores have none and are reported as such: :attr:`StoreValidation.checksums`), and must hold
values the schema allows (hazard and TVs in [0, 1], NaN only where nothing was recorded,
mismatch in {-1, 0, 1}, tokens in [-1, vocab), branch steps within the horizon, stored
distributions summing to 1, prompt and cache lengths in range:
:data:`kvcouple.store.schema.RULES`). A failure raises :class:`~kvcouple.errors.StoreError`
naming the variable, the chunk, the document and the store.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from kvcouple.errors import SchemaVersionError, StoreError
from kvcouple.store.geometry import StoreGeometry
from kvcouple.store.schema import (
    CHECKSUMS_SINCE,
    READABLE_VERSIONS,
    RULES,
    SCHEMA_VERSION,
    UNRECORDED_MARK,
    Record,
    Variable,
    disallowed,
    distribution_problems,
    row_sum_tolerance,
    variables,
)
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

# Codecs that checksum a chunk: Zarr v3 names (crc32c) and numcodecs ids (Zarr v2 filters).
_CHECKSUM_CODECS = ("crc32c", "crc32", "adler32", "fletcher32", "jenkins_lookup3")


def _fmt_index(idx: tuple[int, ...]) -> str:
    return "(" + ", ".join(map(str, idx)) + ")"


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


class StoreValidation:
    """A store's validated description (what :class:`~kvcouple.store.reader.TraceStoreReader`
    exposes as its attributes) and its checked reads. Raises
    :class:`~kvcouple.errors.StoreError` (or :class:`~kvcouple.errors.SchemaVersionError`)
    when the store cannot be read as a trace store."""

    doc_ids: list[str]  # set while opening: a block read before it is labelled by index

    def __init__(self, geometry: StoreGeometry):
        self.geometry = geometry
        self.path = geometry.path
        # prompt_length by document: it bounds kept_length (read once per document).
        self.prompt_lengths: dict[int, int] = {}
        attrs = dict(geometry.group.attrs)
        self.schema_version = self._schema_version(attrs.get("schema_version"))
        self.attrs = attrs
        try:
            self.record_level = Record.parse(str(attrs.get("record")))
        except ValueError as e:
            raise StoreError(f"{self.path}: attribute 'record': {e}") from None
        self.record = str(self.record_level)
        self.variables: dict[str, Variable] = variables(self.record_level)
        self.names = [n for n in self.variables if n != COMPLETED]
        self.dims = self._check_shapes()
        self.doc_ids = self._coordinate(DOC_ID, "doc")
        self.policies = self._coordinate(POLICY, "policy")
        self._check_coordinates()
        self.checksums = self._checksums()
        self.completed_flags, self.flag_errors = self._read_completed()

    # -- opening ------------------------------------------------------------------------------

    def _schema_version(self, version: Any) -> int:
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
        return version

    def _check_coordinates(self) -> None:
        """The labels agree with the attributes that repeat them; the numbered coordinates
        count from their first value."""
        specs = self.attrs.get("policy_specs")
        if specs is not None and list(specs) != self.policies:
            raise StoreError(
                f"{self.path}: coordinate 'policy' {self.policies} does not match the attribute "
                f"policy_specs {list(specs)}; the store is damaged"
            )
        ids = self.attrs.get("doc_ids")
        if ids is not None and list(ids) != self.doc_ids:
            raise StoreError(
                f"{self.path}: coordinate 'doc_id' does not match the attribute doc_ids; "
                f"the store is damaged"
            )
        for dim, first in DIM_COORDS.items():
            if first is not None and dim in self.geometry.group:
                values = self.read_coordinate(dim)
                want = np.arange(first, first + self.dims[dim])
                if values.shape != want.shape or not np.array_equal(values, want):
                    raise StoreError(
                        f"{self.path}: coordinate {dim!r} is not {first}..{first + self.dims[dim] - 1}"
                        f"; the store is damaged"
                    )

    def _checksums(self) -> str:
        """What protects the chunks, in words: ``"crc32c on every chunk"`` (or another
        checksum), ``"no checksums"`` for stores written before schema version 3, or which
        variables lack one (a store re-written by a tool that dropped the codecs)."""
        names = [*self.variables, DOC_ID, POLICY]
        kinds = {n: _checksum_kind(_codec_metadata(self.geometry.array(n))) for n in names}
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
            arr = self.geometry.array(name)
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
        geometry = self.geometry
        n = self.dims["doc"]
        flags = np.zeros(n, bool)
        errors: dict[int, str] = {}
        step = geometry.storage_grid(COMPLETED)[0]
        cells = [(slice(start, min(start + step, n)),) for start in range(0, n, step)]
        keys = [geometry.keys(COMPLETED, sel) for sel in cells]
        absent = set(geometry.missing([k for ks in keys for k in ks]))
        # Never written (zarr 3 skips all-False chunks): unfinished.
        present = [sel for sel, ks in zip(cells, keys, strict=True) if absent.isdisjoint(ks)]
        if not present:
            return flags, errors
        try:
            whole = np.asarray(geometry.array(COMPLETED)[:], dtype=bool)
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

    # -- checked reads ------------------------------------------------------------------------

    def doc_label(self, name: str, sel: tuple[slice | int, ...]) -> str:
        """`` (document 'id')`` or `` (documents i..j)`` for a selection of ``name``, "" where
        its first axis is not the document."""
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
        geometry = self.geometry
        arr = geometry.array(name)
        full = tuple(sel) + (slice(None),) * (len(arr.shape) - len(sel))
        as_slices = tuple(slice(s, s + 1) if isinstance(s, int | np.integer) else s for s in full)
        label = self.doc_label(name, full)
        absent = geometry.missing(geometry.keys(name, as_slices))
        for inner, outside in [] if absent else geometry.missing_inner(name, as_slices):
            if outside:
                raise StoreError(
                    f"{self.path}: chunk {inner} of variable {name!r}{label} cannot be decoded: "
                    "the shard's index points outside the shard; the store is damaged. "
                    "Re-trace that document, or pass --allow-incomplete to analyse the others."
                )
            absent.append(inner)
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
        geometry = self.geometry
        arr = geometry.array(name)
        for cell, cell_sel in geometry.cells(name, sel, geometry.storage_grid(name)):
            try:
                arr[cell_sel]
            except Exception as inner:
                key = geometry.chunk_key(name, cell)
                if _is_checksum_failure(inner):
                    return self.checksum_error(name, key, label, f"{type(inner).__name__}: {inner}")
                return StoreError(
                    f"{self.path}: chunk {key} of variable {name!r}"
                    f"{label} cannot be decoded ({type(inner).__name__}: {inner}); the store is "
                    f"damaged."
                )
        return StoreError(f"{self.path}: variable {name!r}{label} cannot be read: {err}")

    def checksum_error(self, name: str, key: str, label: str, detail: str) -> StoreError:
        """Chunk ``key`` of ``name`` fails its checksum (``detail``: the codec's words)."""
        return StoreError(
            f"{self.path}: chunk {key} of variable {name!r}{label} cannot be decoded: it fails "
            f"its checksum, so its bytes changed after they were written ({detail}); the store "
            f"is damaged. Re-trace that document, or pass --allow-incomplete to analyse the "
            f"others."
        )

    def row_tolerance(self, name: str) -> float:
        """How far a row of the stored distribution ``name`` may sum from 1 (its format's
        rounding: :func:`kvcouple.store.schema.row_sum_tolerance`)."""
        arr = self.geometry.array(name)
        kind = "bfloat16" if arr.dtype.name == "bfloat16" else np.dtype(arr.dtype).name
        return row_sum_tolerance(kind, int(arr.shape[-1]))

    def _prompt_length(self, doc: int) -> int:
        if doc not in self.prompt_lengths:
            self.prompt_lengths[doc] = int(self.read_doc("prompt_length", doc))
        return int(self.prompt_lengths[doc])

    def value_error(
        self, name: str, full_pos: tuple[int, ...], shown: str, allowed: str
    ) -> StoreError:
        """A value the schema does not allow, named by chunk, document and element (for a row
        whose sum is wrong, the element is the row: its last index is omitted)."""
        geometry = self.geometry
        grid = geometry.storage_grid(name)
        where = full_pos + (0,) * (len(grid) - len(full_pos))
        key = geometry.chunk_key(name, tuple(p // c for p, c in zip(where, grid, strict=True)))
        label = self.doc_label(name, (int(full_pos[0]),)) if full_pos else ""
        return StoreError(
            f"{self.path}: chunk {key} of variable {name!r}{label} holds {shown} at "
            f"{_fmt_index(full_pos)}; values must be {allowed}. The store is damaged."
        )

    def check_values(
        self,
        name: str,
        block: np.ndarray,
        origin: tuple[int, ...],
        marks: Mapping[str, np.ndarray] | None = None,
    ) -> None:
        """Raise naming the chunk and element of the first value the schema does not allow.
        ``origin`` is the block's position in the array (one entry per array axis); ``marks``:
        the same document's blocks already decoded (where NaN is allowed reads them)."""
        rule = RULES.get(name)
        if rule is None or block.size == 0:
            return
        lead = tuple(int(o) for o in origin[: len(origin) - block.ndim])
        offset = origin[len(origin) - block.ndim :]
        nan = recorded_nan(self, name, block, origin, marks)
        if nan is not None:  # a NaN where something was recorded: damage (no range sees it)
            raise self.value_error(name, *nan)
        if rule == "distribution":
            found = distribution_problems(block, self.row_tolerance(name))
            if found is None:
                return
            first, allowed = found
            whole_row = int(first[-1]) < 0
            idx = tuple(int(i) for i in (first[:-1] if whole_row else first))
            pos = lead + tuple(i + int(o) for i, o in zip(idx, offset, strict=False))
            shown = "a row" if whole_row else repr(block[idx].item())
            raise self.value_error(name, pos, shown, allowed)
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
        raise self.value_error(name, pos, repr(block[at].item()), allowed)

    def batch_allowed(
        self,
        name: str,
        values: np.ndarray,
        marks: Mapping[str, np.ndarray],
        prompts: np.ndarray | None = None,
    ) -> bool:
        """Whether :meth:`check_values` would pass every document of a batch, checked at once:
        ``values`` holds one document's whole variable per entry of its first axis, ``marks``
        the same documents' mark variables stacked alike (where NaN is allowed), ``prompts``
        their ``prompt_length`` (it bounds ``kept_length``). True: every value is allowed.
        False: one might not be; the caller then checks document by document, which names the
        first problem (this only says where no problem is, quickly)."""
        rule = RULES.get(name)
        if rule is None or values.size == 0:
            return True
        if rule == "distribution":
            return False  # row-wise, with its own messages: always by document
        if rule in ("unit", "nonneg", "divergence") and values.dtype.kind == "f":
            nan = np.isnan(values)
            if nan.any():
                mark = UNRECORDED_MARK.get(name)
                marked = marks.get(mark) if mark is not None else None
                if marked is None or values.shape[: marked.ndim] != marked.shape:
                    return False
                lead = nan.reshape(marked.shape + (-1,)).any(-1)
                if (lead & (marked != -1)).any():
                    return False
        bad, _ = disallowed(rule, values, self.dims, self.attrs.get("vocab_size"))
        if bad.any():
            return False
        if rule == "kept":
            if prompts is None or prompts.shape != values.shape[:1]:
                return False
            limit = prompts.reshape((-1,) + (1,) * (values.ndim - 1))
            return not bool((values > limit).any())
        return True

    def read_doc(self, name: str, doc: int) -> np.ndarray:
        """Every value of one document of ``name`` (its first axis is ``doc``), checked."""
        block = self.read(name, (int(doc),))
        self.check_values(name, block, (int(doc),) + (0,) * block.ndim)
        return block

    def check(self, docs: list[int], *, data: bool = False) -> list[str]:
        """Every problem of the documents ``docs``, one line each: damaged completion flags,
        missing chunks, undecodable chunks, values the schema does not allow. Distribution
        variables (``vocab``/``k`` axes) are decoded only with ``data``."""
        geometry = self.geometry
        problems = list(dict.fromkeys(self.flag_errors.values()))
        for name, var in self.variables.items():
            dims = var.dims
            if name == COMPLETED or not dims or dims[0] != "doc":
                continue
            heavy = "vocab" in dims or "k" in dims
            for d in docs:
                try:
                    if heavy and not data:
                        sel = (slice(d, d + 1),) + (slice(None),) * (len(dims) - 1)
                        absent = geometry.missing(geometry.keys(name, sel))
                        absent = absent or [k for k, _ in geometry.missing_inner(name, sel)]
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
