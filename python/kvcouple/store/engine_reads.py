"""The part of :class:`kvcouple.store.reader.TraceStoreReader` that reads through the Rust
store engine: a document's small variables (:meth:`EngineReads.read_summary`, several
documents at once with :meth:`EngineReads.read_summaries`) and the row TVs of the stored
distributions (:meth:`EngineReads.rows_tv`), decoded on every core with the GIL released,
checksums verified and every value checked (by the reader's
:class:`~kvcouple.store.validation.StoreValidation`). On object storage the chunk objects
come from :class:`~kvcouple.store.object_storage.ObjectStorageReads`. Where the engine cannot
read a store (a codec or layout it lacks, ``KVCOUPLE_STORE_ENGINE=zarr``) these say so
(:class:`EngineSwitch`), and the reader reads with zarr-python instead: the same numbers and
the same messages.
"""

from __future__ import annotations

import itertools
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from kvcouple.errors import StoreError
from kvcouple.store.batch_layout import BatchLayout, SummaryBatch
from kvcouple.store.geometry import StoreGeometry, engine_forced_off, is_url, zarr_major
from kvcouple.store.object_storage import ObjectStorageReads
from kvcouple.store.validation import StoreValidation

# Decoded bytes per window of blocks fetched at once from object storage.
REMOTE_WINDOW = 64 * 2**20

# Stores the engine fell back on (the notice is printed once per store and process).
_NOTICED: set[str] = set()
_NOTICED_LOCK = threading.Lock()


class EngineSwitch:
    """Whether the Rust engine reads a store: not with ``KVCOUPLE_STORE_ENGINE=zarr``, not on
    object storage under zarr-python 2, and not once it met a layout it cannot read (for this
    reader, from then on)."""

    def __init__(self, path: str):
        self.path = path
        self.turned_off = False

    @property
    def off(self) -> bool:
        return self.turned_off or (is_url(self.path) and zarr_major() < 3) or engine_forced_off()


class EngineReads:
    """Reads through the Rust store engine: the store's arrays, grids and keys from its
    :class:`~kvcouple.store.geometry.StoreGeometry`, the checks from its
    :class:`~kvcouple.store.validation.StoreValidation`, objects on object storage from its
    :class:`~kvcouple.store.object_storage.ObjectStorageReads`."""

    def __init__(
        self,
        geometry: StoreGeometry,
        validation: StoreValidation,
        object_storage: ObjectStorageReads,
        switch: EngineSwitch,
    ):
        self.geometry = geometry
        self.validation = validation
        self.object_storage = object_storage
        self.switch = switch
        self.path = geometry.path
        # True once the summaries are read with zarr-python: the engine cannot read them so.
        self.no_direct = False
        self._metadata_documents: dict[str, str] = {}

    def read_summary(self, doc: int, names: tuple[str, ...]) -> dict[str, np.ndarray]:
        """Several variables of one document, checked. Where each variable holds a document in
        one chunk of the layout kvcouple writes, the Rust engine reads and decodes them all at
        once (:meth:`_read_direct`; on object storage from one batch of fetched objects);
        else, with zarr-python 3, every chunk's presence is asked, and every variable read,
        concurrently. A problem is then named by reading that variable alone. ``kept_length``'s
        check needs the document's ``prompt_length``: it is read in the same batch."""
        doc = int(doc)
        wanted, extra = self._with_prompt_length(names, [doc])
        got, supported, problem = self._read_direct(wanted, [doc])
        blocks = None if got is None else got[0]
        if not supported and zarr_major() >= 3:
            blocks = self._read_concurrently(wanted, doc)
        if blocks is None:
            # zarr-python reads an absent inner chunk of a shard as its fill value: the
            # engine's word stands (an absent object, zarr-python's check names alike).
            if problem is not None and problem[0] == "missing" and self._sharded(wanted):
                raise self._damage_error(problem, doc)
            read = {n: self.validation.read_doc(n, doc) for n in names}
            if problem is not None:  # damage zarr-python's reads do not see
                raise self._damage_error(problem, doc)
            return read
        self._check_summary(doc, blocks, extra)
        return blocks

    def read_summaries(self, docs: list[int], names: tuple[str, ...]) -> SummaryBatch | None:
        """:meth:`read_summary` of several documents of a local store in one engine call
        (every chunk of every document decoded in parallel, the per-call costs paid once), in
        the order of ``docs``. None where the engine cannot read them so, or where any chunk
        or value of any of them is damaged: the caller then reads document by document, which
        names the damage and keeps the other documents."""
        docs = [int(d) for d in docs]
        if is_url(self.path) or not docs:
            return None
        wanted, extra = self._with_prompt_length(names, docs)
        stacks, _, _ = self._read_stacked(wanted, docs)
        if stacks is None:
            return None
        got = SummaryBatch(stacks, len(docs))
        if self._batch_checked(docs, stacks, got, extra):
            return got
        try:
            for doc, blocks in zip(docs, got, strict=True):
                self._check_summary(doc, blocks, extra)
        except StoreError:
            return None
        return got

    def _batch_checked(
        self,
        docs: list[int],
        stacks: dict[str, np.ndarray],
        got: SummaryBatch,
        extra: bool,
    ) -> bool:
        """Every document's values checked at once, variable by variable
        (:meth:`~kvcouple.store.validation.StoreValidation.batch_allowed`): True where all are
        allowed (then, as :meth:`_check_summary` does, the prompt lengths are kept and an
        ``extra`` ``prompt_length`` dropped); False where any may not be, and the caller
        checks document by document, naming the first problem."""
        validation = self.validation
        prompts = stacks.get("prompt_length")
        if prompts is None and all(d in validation.prompt_lengths for d in docs):
            prompts = np.array([validation.prompt_lengths[d] for d in docs], np.int64)
        flat = None if prompts is None else prompts.reshape(len(docs), -1)[:, 0]
        for name, values in stacks.items():
            if not validation.batch_allowed(name, values, stacks, flat):
                return False
        if "prompt_length" in stacks:
            for doc, length in zip(docs, stacks["prompt_length"].reshape(-1), strict=True):
                validation.prompt_lengths[doc] = int(length)
            if extra:
                got.drop("prompt_length")
        return True

    def _with_prompt_length(
        self, names: tuple[str, ...], docs: list[int]
    ) -> tuple[tuple[str, ...], bool]:
        """``names`` and whether ``prompt_length`` was added to them: ``kept_length``'s check
        needs it, unless every document's is known already."""
        known = self.validation.prompt_lengths
        extra = (
            "kept_length" in names
            and "prompt_length" not in names
            and any(d not in known for d in docs)
        )
        return (names + ("prompt_length",) if extra else names), extra

    def _check_summary(self, doc: int, blocks: dict[str, np.ndarray], extra: bool) -> None:
        """Check one document's blocks, ``prompt_length`` first (it bounds ``kept_length``;
        ``extra``: it was read only for that, and is dropped)."""
        validation = self.validation
        if "prompt_length" in blocks:
            prompt = blocks.pop("prompt_length") if extra else blocks["prompt_length"]
            validation.check_values("prompt_length", prompt, (doc,))
            validation.prompt_lengths[doc] = int(prompt)
        for n, block in blocks.items():
            validation.check_values(n, block, (doc,) + (0,) * block.ndim, blocks)

    def _sharded(self, names: tuple[str, ...]) -> bool:
        """Whether any of ``names`` is sharded (a stored object holds several chunks)."""
        geometry = self.geometry
        return any(geometry.storage_grid(n) != geometry.decode_grid(n) for n in names)

    def _read_direct(
        self, names: tuple[str, ...], docs: list[int]
    ) -> tuple[SummaryBatch | None, bool, tuple[str, str, str] | None]:
        """:meth:`_read_stacked`, as one dict of arrays per document (views of the stacks)."""
        stacks, supported, problem = self._read_stacked(names, docs)
        if stacks is None:
            return None, supported, problem
        return SummaryBatch(stacks, len(docs)), True, None

    def _read_stacked(
        self, names: tuple[str, ...], docs: list[int]
    ) -> tuple[dict[str, np.ndarray] | None, bool, tuple[str, str, str] | None]:
        """``({name: name[docs]}, True, None)`` (each variable's documents stacked along its
        first axis, in the order of ``docs``) read and decoded by the
        Rust engine (``kvcouple._core.store_decode_chunks``: every chunk in parallel, the GIL
        released, checksums verified); ``(None, True, problem)`` if a chunk is missing or
        damaged (the caller names it; ``problem``: the engine's ``(kind, key, message)``);
        ``(None, False, None)`` where the engine cannot read these variables so: several
        documents per chunk, another codec, or shards on object storage (then never again
        for this reader). A sharded variable is read where its inner chunks hold one document
        each: each shard object is read once per call and the inner chunks asked of it
        decoded. On object storage one document at a time."""
        from kvcouple import _core

        geometry = self.geometry
        remote = is_url(self.path)
        if remote and len(docs) != 1:
            return None, False, None  # fetched a document at a time (read_summary's prefetch)
        if (
            self.switch.off
            or self.no_direct
            or any(geometry.decode_grid(n)[0] != 1 for n in names)
            or remote
            # Shards hold many documents: fetched whole for one, they cost more than
            # zarr-python's ranged reads of just its inner chunks.
            and (self._sharded(names) or self.object_storage.object_fetcher() is None)
        ):
            self.no_direct = True
            return None, False, None
        metas = [self.metadata_document(n) for n in names]
        layout = BatchLayout.of(geometry, names, docs)
        which, keys, inner, runs = layout.which, layout.keys, layout.inner, layout.runs
        # Each run comes back as one object: a variable's stack, or one cell's documents.
        if remote:
            _, got = self.object_storage.summary_objects(names, docs[0])
            decoded, problem = _core.store_decode_chunks(metas, which, keys, chunks=got, runs=runs)
        else:
            sharded = any(k >= 0 for k in inner)
            decoded, problem = _core.store_decode_chunks(
                metas, which, keys, root=self.path, inner=inner if sharded else None, runs=runs
            )
        if problem is not None:
            if problem[0] == "unsupported":
                self.no_direct = True
                return None, False, None
            return None, True, problem
        return layout.stacks(decoded), True, None

    def _damage_error(self, problem: tuple[str, str, str], doc: int | None) -> StoreError:
        """The engine's ``(kind, key, message)`` of a missing or damaged chunk as the reader
        words it, naming the variable, the chunk (inside a shard: the shard and the inner
        chunk) and document ``doc`` (None: several or unknown)."""
        validation = self.validation
        what, key, message = problem
        name = key.rsplit("/", 1)[0].split("/")[-1] if "/" in key else key
        label = f" (document {validation.doc_ids[doc]!r})" if doc is not None else ""
        if what == "missing":
            return StoreError(
                f"{self.path}: chunk {key} of variable {name!r}{label} is missing; the store is "
                f"damaged. Re-trace that document, or pass --allow-incomplete to analyse the others."
            )
        if what == "checksum":
            return validation.checksum_error(name, key, label, message)
        return StoreError(
            f"{self.path}: chunk {key} of variable {name!r}{label} cannot be decoded ({message}); "
            f"the store is damaged."
        )

    def _read_concurrently(self, names: tuple[str, ...], doc: int) -> dict[str, np.ndarray] | None:
        """``name[doc]`` of every name at once, or None if any chunk is missing or fails to
        decode (the caller reads one by one to name it)."""
        import asyncio

        from zarr.core.sync import sync

        arrays = [self.geometry.array(n) for n in names]
        keys = self.geometry.doc_keys(names, doc)
        # zarr-python's arrays (a StoredArray opens its own), opened outside the event loop.
        asyncs = [getattr(a, "zarr_array", a)._async_array for a in arrays]
        store = asyncs[0].store_path.store
        whole = (slice(doc, doc + 1),)
        if any(self.geometry.missing_inner(n, whole + (slice(None),) * (a.ndim - 1))
               for n, a in zip(names, arrays, strict=True)):  # fmt: skip
            return None  # read as fill values by zarr-python: the caller names it

        async def both() -> tuple[list[bool], list[Any]]:
            there = await asyncio.gather(*(store.exists(k) for k in keys))
            if not all(there):
                return list(there), []
            got = await asyncio.gather(*(a.getitem((doc,)) for a in asyncs), return_exceptions=True)
            return list(there), list(got)

        there, got = sync(both())
        if not all(there) or any(isinstance(g, BaseException) for g in got):
            return None
        return {n: np.asarray(g) for n, g in zip(names, got, strict=True)}

    def blocks(
        self, name: str, doc: int, policy: int, whole_last: bool = True
    ) -> list[tuple[slice, ...]]:
        """Selections over the axes after (doc, policy) that follow the decoded chunks (the
        last axis taken whole when ``whole_last``, e.g. a vocabulary), so that streaming them
        holds a few chunks at a time."""
        arr = self.geometry.array(name)
        shape, grid = arr.shape[2:], self.geometry.decode_grid(name)[2:]
        if whole_last:
            grid = grid[:-1] + (shape[-1],)
        ranges = [range(0, n, c) for n, c in zip(shape, grid, strict=True)]
        return [
            tuple(slice(s, min(s + c, n)) for s, c, n in zip(st, grid, shape, strict=True))
            for st in itertools.product(*ranges)
        ]

    def rows_tv(
        self,
        p_name: str,
        q_name: str,
        sels: list[tuple[Any, ...]],
        *,
        decode_only: bool = False,
        top_delta: bool = False,
    ) -> np.ndarray | None:
        """TV of every row (last axis: the distribution) of the blocks ``sels`` (each an index
        or a slice per axis, the last axis whole) of ``p_name`` against ``q_name``, decoded and
        computed by the Rust engine (zarrs, all cores, GIL released), the blocks' rows one after
        another. Every row of both is checked first to be a distribution (as
        :meth:`~kvcouple.store.validation.StoreValidation.check_values` does), and every
        chunk against its checksum. On object storage the chunk objects are fetched
        concurrently and decoded by the same engine (:meth:`_remote_tv`). None where the engine
        cannot read this store (a codec or layout it lacks, zarr-python 2 on object storage,
        ``KVCOUPLE_STORE_ENGINE=zarr``): the caller then reads with
        :meth:`~kvcouple.store.validation.StoreValidation.read`. With ``top_delta``, (rows, 2):
        each row's TV and the scoreboard's ``q(a) - p(a)`` at ``a = argmax p`` (computed as
        numpy does on the rows widened to float32), from the same decode."""
        if self.switch.off:
            return None
        from kvcouple import _core

        validation = self.validation
        p = self.geometry.array(p_name)
        kind = "bfloat16" if p.dtype.name == "bfloat16" else np.dtype(p.dtype).name
        blocks = np.empty((len(sels), len(p.shape), 2), np.int64)
        for i, sel in enumerate(sels):
            for ax, (s, n) in enumerate(zip(sel, p.shape, strict=True)):
                if isinstance(s, slice):
                    start, stop, _ = s.indices(n)
                else:
                    start, stop = int(s), int(s) + 1
                blocks[i, ax] = (start, stop)
        # One tolerance for both: p and q share the format and the vocabulary.
        if is_url(self.path):
            tv, problem = self._remote_tv(p_name, q_name, blocks, kind, decode_only, top_delta)
        else:
            tv, problem = _core.store_blocks_tv(
                self.path,
                p.path,
                self.geometry.array(q_name).path,
                blocks,
                kind,
                row_tolerance=validation.row_tolerance(p_name),
                decode_only=decode_only,
                top_delta=top_delta,
            )
        if problem is None:
            return np.asarray(tv).reshape(-1, 2) if top_delta else np.asarray(tv)
        what, key, message = problem
        if what == "unsupported":
            self.switch.turned_off = True
            with _NOTICED_LOCK:  # one line per store, however many threads hit it
                first = self.path not in _NOTICED
                _NOTICED.add(self.path)
            if first:
                print(
                    f"kvcouple: the Rust store engine cannot read {self.path} ({message}); "
                    f"reading with zarr-python instead",
                    file=sys.stderr,
                )
            return None
        docs = {int(sel[0]) for sel in sels if not isinstance(sel[0], slice)}
        if what != "value":
            raise self._damage_error(problem, docs.pop() if len(docs) == 1 else None)
        # "entry;i0,...,iN;value" or "sum;i0,...,-1;sum" (the engine's row check).
        name = key.rsplit("/", 1)[0].split("/")[-1] if "/" in key else key
        kind_, at, value = message.split(";")
        pos = tuple(int(i) for i in at.split(","))
        if kind_ == "sum":
            tol = validation.row_tolerance(name)
            raise validation.value_error(
                name,
                pos[:-1],
                "a row",
                f"rows summing to 1 within {tol:.2g} (this row sums to {float(value):.6g})",
            )
        raise validation.value_error(
            name,
            pos,
            repr(float(value)),
            "finite and >= 0 in a recorded row (an unrecorded row is all NaN)",
        )

    def _remote_tv(
        self,
        p_name: str,
        q_name: str,
        blocks: np.ndarray,
        kind: str,
        decode_only: bool,
        top_delta: bool,
    ) -> tuple[np.ndarray, tuple[str, str, str] | None]:
        """:meth:`rows_tv` on object storage: the chunk objects of a window of blocks are
        fetched concurrently (zarr's async store: many requests in flight) while the Rust
        engine verifies, decodes and consumes the previous window
        (``kvcouple._core.store_chunks_tv``). Holds two windows of stored bytes at most."""
        from kvcouple import _core

        objects = self.object_storage
        keys: dict[str, list[str]] = {}
        for name in (p_name, q_name):
            found = objects.block_keys(name, blocks)
            if found is None:
                return np.empty(0), ("unsupported", "", "a block spans several objects")
            keys[name] = found
        meta = [self.metadata_document(n) for n in (p_name, q_name)]
        itemsize = self.geometry.array(p_name).dtype.itemsize
        row_bytes = int(blocks[0, -1, 1] - blocks[0, -1, 0]) * itemsize
        rows = np.prod(blocks[:, :-1, 1] - blocks[:, :-1, 0], axis=1)
        # Windows of ~REMOTE_WINDOW decoded bytes (>= 8 blocks): enough requests in flight to
        # hide the round trips, little enough held in memory.
        per = max(8, int(REMOTE_WINDOW // max(1, int(rows.max()) * row_bytes)))
        windows = [range(i, min(i + per, len(blocks))) for i in range(0, len(blocks), per)]

        def fetch(w: range) -> tuple[list[bytes | None], list[bytes | None]]:
            got = objects.fetch_ahead([keys[p_name][i] for i in w] + [keys[q_name][i] for i in w])
            return got[: len(w)], got[len(w) :]

        objects.read_ahead(p_name, q_name, blocks, per)

        tvs = []
        with ThreadPoolExecutor(max_workers=1) as pool:
            pending = [pool.submit(fetch, w) for w in windows[:1]]
            for n, w in enumerate(windows):
                pc, qc = pending.pop().result()
                pending += [pool.submit(fetch, v) for v in windows[n + 1 : n + 2]]
                tv, problem = _core.store_chunks_tv(
                    meta[0],
                    meta[1],
                    np.ascontiguousarray(blocks[w.start : w.stop]),
                    [keys[p_name][i] for i in w],
                    pc,
                    [keys[q_name][i] for i in w],
                    qc,
                    kind,
                    row_tolerance=self.validation.row_tolerance(p_name),
                    decode_only=decode_only,
                    top_delta=top_delta,
                )
                if problem is not None:
                    for f in pending:
                        f.cancel()
                    return np.empty(0), problem
                tvs.append(np.asarray(tv))
        return (np.concatenate(tvs) if tvs else np.empty(0)), None

    def metadata_document(self, name: str) -> str:
        """An array's metadata document as stored (``zarr.json``, or ``.zarray`` for v2): what
        the engine decodes its chunks by."""
        if name not in self._metadata_documents:
            self._metadata_documents[name] = self._fetch_metadata_document(name)
        return self._metadata_documents[name]

    def _fetch_metadata_document(self, name: str) -> str:
        arr = self.geometry.array(name)
        # (zarr-python 2's arrays have no ``metadata``: they are format 2)
        fmt = getattr(getattr(arr, "metadata", None), "zarr_format", 2)
        key = f"{arr.path}/{'zarr.json' if fmt == 3 else '.zarray'}"
        if not is_url(self.path):
            try:
                return (Path(self.path) / key).read_text()
            except FileNotFoundError:
                raw = None
        else:
            (raw,) = self.object_storage.fetch_objects([key], count=False)
        if raw is None:
            raise StoreError(f"{self.path}: the metadata of variable {name!r} is missing")
        return raw.decode()
