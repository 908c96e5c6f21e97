"""How a batch of documents' summary variables is asked of the Rust engine and laid out
again: the chunks in the order the engine decodes them into runs (:class:`BatchLayout`), and
the documents' dicts over the stacks it returns (:class:`SummaryBatch`). The reader that
calls the engine is :class:`kvcouple.store.engine_reads.EngineReads`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, overload

import numpy as np

from kvcouple.store.geometry import StoreGeometry


@dataclass
class BatchLayout:
    """The engine's chunk list for variables ``names`` of a batch of ``docs`` documents (one
    document per decoded chunk): ``which`` (the metadata document of each chunk), ``keys``
    (each stored object), ``inner`` (the inner chunk's index in a shard, -1 unsharded) and
    ``runs`` (how many consecutive chunks come back joined as one buffer), with what
    :meth:`stacks` needs to lay the buffers out as each variable's stack."""

    names: tuple[str, ...]
    docs: int
    arrays: list[Any]
    grids: list[tuple[int, ...]]
    # Per variable, a document's cells: (cell, its selection, where document 0's is stored).
    at0: list[list[tuple[tuple[int, ...], tuple[slice, ...], tuple[tuple[int, ...], int]]]]
    stored: list[np.dtype]
    # Whether the variable's run is its stack (document after document, each whole).
    whole: list[bool]
    which: list[int]
    keys: list[str]
    inner: list[int]
    runs: list[int]

    @classmethod
    def of(cls, geometry: StoreGeometry, names: tuple[str, ...], docs: list[int]) -> BatchLayout:
        """The layout of documents ``docs`` (in this order) of variables ``names``."""
        arrays = [geometry.array(n) for n in names]
        grids = [geometry.decode_grid(n) for n in names]
        shards = [geometry.storage_grid(n) for n in names]
        # A document's cells are document 0's moved along the first axis (one document per
        # decoded chunk): laid out once per variable, and each stored object's key computed
        # once per call (a shard holds many documents' chunks).
        first = [
            [
                (cell[1:], where[1:])
                for cell, where in geometry.cells(
                    names[i], (slice(0, 1),) + (slice(None),) * (a.ndim - 1), grids[i]
                )
            ]
            for i, a in enumerate(arrays)
        ]
        # Where each document's chunk of a variable is stored: document 0's, moved along the
        # first axis (on the storage grid; inside a shard, its inner chunk's index).
        at0 = [
            [(cell, where, _stored_at((0, *cell), grids[i], shards[i])) for cell, where in cs]
            for i, cs in enumerate(first)
        ]
        per_shard = [s[0] // g[0] for s, g in zip(shards, grids, strict=True)]
        inner_step = [
            int(np.prod([s // g for s, g in zip(sh[1:], gr[1:], strict=True)], dtype=np.int64))
            for sh, gr in zip(shards, grids, strict=True)
        ]
        # A variable whose cells split only its first per-document axis, unpadded, and keep
        # every later axis whole: its chunks asked document after document (each document's
        # cells in order) come back as its stack itself, one run (no copy of the batch).
        stored = [np.dtype(a.dtype).newbyteorder("<") for a in arrays]
        whole = [
            a.ndim >= 2
            and a.shape[1] > 0
            and grids[i][2:] == a.shape[2:]
            and a.shape[1] % grids[i][1] == 0
            and stored[i] == a.dtype
            for i, a in enumerate(arrays)
        ]
        # Cell by cell, every document's chunk (the engine reads each stored object once).
        at = np.asarray(docs, np.int64)
        n = len(docs)
        which: list[int] = []
        keys: list[str] = []
        inner: list[int] = []
        runs: list[int] = []
        for i, cells_i in enumerate(at0):
            cell_keys: list[list[str]] = []
            cell_inner: list[np.ndarray] = []
            for _, _, (obj0, lin0) in cells_i:
                rest = tuple(obj0[1:])
                if lin0 < 0:
                    objs, lins = at, np.full(n, -1, np.int64)
                else:
                    objs = at // per_shard[i]
                    lins = lin0 + (at % per_shard[i]) * inner_step[i]
                cell_inner.append(lins)
                # A batch is mostly one shard: its key repeated, not looked up document by
                # document; else a key per stored object, each document's found by index.
                if n and (objs == objs[0]).all():
                    cell_keys.append([geometry.chunk_key(names[i], (int(objs[0]), *rest))] * n)
                    continue
                objects, of_doc = np.unique(objs, return_inverse=True)
                named = [geometry.chunk_key(names[i], (o, *rest)) for o in objects.tolist()]
                cell_keys.append(np.array(named, dtype=object)[of_doc].tolist())
            which += [i] * (n * len(cells_i))
            if whole[i] and len(cells_i) > 1:
                # Document-major: document d's cells, then document d + 1's.
                keys += [k for per_doc in zip(*cell_keys) for k in per_doc]
                inner += np.stack(cell_inner, axis=1).reshape(-1).tolist()
                runs.append(n * len(cells_i))
                continue
            for k, lins in zip(cell_keys, cell_inner, strict=True):
                keys += k
                inner += lins.tolist()
                runs.append(n)
        return cls(
            names, n, arrays, grids, at0, stored, whole, which, keys, inner, runs
        )  # fmt: skip

    def stacks(self, decoded: list[np.ndarray]) -> dict[str, np.ndarray]:
        """Each variable's documents along its first axis, from the engine's runs."""
        # Stored little endian (the layout the engine reads); edge chunks are padded.
        n = self.docs
        stacks: dict[str, np.ndarray] = {}
        cell = 0
        for i, (name, a) in enumerate(zip(self.names, self.arrays, strict=True)):
            shape = (n, *a.shape[1:])
            single = (
                len(self.at0[i]) == 1
                and self.grids[i][1:] == a.shape[1:]
                and self.stored[i] == a.dtype
            )
            if self.whole[i] or single:
                # The run is the batch's stack (document after document, each whole): taken
                # as it is, copied only where the engine's buffer is not aligned for the dtype.
                stack = decoded[cell].view(a.dtype).reshape(shape)
                stacks[name] = stack if stack.flags.aligned else stack.copy()
                cell += 1
                continue
            stack = np.empty(shape, a.dtype)
            for _, where, _ in self.at0[i]:
                chunks = np.frombuffer(decoded[cell], self.stored[i]).reshape(
                    (n, *self.grids[i][1:])
                )
                inner_sel = tuple(slice(0, w.stop - w.start) for w in where)
                stack[(slice(None), *where)] = chunks[(slice(None), *inner_sel)]
                cell += 1
            stacks[name] = stack
        return stacks


class SummaryBatch(Sequence[dict[str, np.ndarray]]):
    """One dict per document of its arrays (views of ``stacks``: 0-d arrays, not scalars,
    where a variable holds one value a document; each made when first asked for, then kept,
    so that changes to it stay), and the stacks themselves (each variable's documents along
    its first axis) for callers that work on a whole batch at once."""

    def __init__(self, stacks: dict[str, np.ndarray], docs: int) -> None:
        self.stacks = stacks
        self._docs: list[dict[str, np.ndarray] | None] = [None] * docs

    def __len__(self) -> int:
        return len(self._docs)

    @overload
    def __getitem__(self, k: int) -> dict[str, np.ndarray]: ...
    @overload
    def __getitem__(self, k: slice) -> list[dict[str, np.ndarray]]: ...
    def __getitem__(self, k: int | slice) -> Any:
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        k = range(len(self))[k]  # negative indices; IndexError past the end
        got = self._docs[k]
        if got is None:
            got = self._docs[k] = {n: v[k, ...] for n, v in self.stacks.items()}
        return got

    def drop(self, name: str) -> None:
        """Forget variable ``name`` (read only for a check) in the stacks and every dict."""
        self.stacks.pop(name, None)
        for got in self._docs:
            if got is not None:
                got.pop(name, None)


def _by_document(stacks: dict[str, np.ndarray], docs: int) -> SummaryBatch:
    return SummaryBatch(stacks, docs)


def _stored_at(
    cell: tuple[int, ...], grid: tuple[int, ...], shard: tuple[int, ...]
) -> tuple[tuple[int, ...], int]:
    """Where chunk ``cell`` (coordinates on the decode grid ``grid``) is stored: the
    coordinates of its object on the storage grid ``shard``, and its linear (C-order) index
    among the shard's inner chunks (-1 where the array is not sharded)."""
    if grid == shard:
        return cell, -1
    per = [s // g for s, g in zip(shard, grid, strict=True)]
    obj = tuple(c // p for c, p in zip(cell, per, strict=True))
    linear = 0
    for c, o, p in zip(cell, obj, per, strict=True):
        linear = linear * p + (c - o * p)
    return obj, linear
