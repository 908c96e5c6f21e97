"""Zarr sharding for stores of many documents: how many documents a shard holds
(:func:`documents_per_shard`), a variable's shard shape, whether a variable's shards can be
written by the Rust encoder, and a shard's documents as the writer holds them until it is
written (:class:`HeldShard`). The writer is :mod:`kvcouple.store.writer`; which documents a
``--shard i/N`` process owns, :mod:`kvcouple.store.parts`; the layout, docs/store.md (*Many
documents*)."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvcouple.store.schema import Record, variables

# Sharding: a shard of a variable holds at most this many bytes (uncompressed) and documents,
# and a store has at least _MIN_SHARDS of them, so that a killed run loses at most a sixteenth
# of its work and the Dask tracer and --shard i/N have whole shards to share out.
_SHARD_BYTES = 8 * 2**20
MAX_DOCS_PER_SHARD = 256
_MIN_SHARDS = 16
# A shard held this long is written with the documents it has (and again when complete): a
# slow run (a real model) loses at most about this much tracing to a kill -9.
HOLD_SECONDS = 120.0


def documents_per_shard(sizes: Mapping[str, int], n_docs: int, record: Record) -> int:
    """Documents per stored object of a store of ``n_docs`` documents with these dimension
    ``sizes``: 1 (no sharding) for ``record="full"`` (a document's distributions are
    megabytes: files are not the cost there), else as many as keep each variable's shard under
    :data:`_SHARD_BYTES` (uncompressed), at most :data:`MAX_DOCS_PER_SHARD` and at most a
    sixteenth of the documents. A function of the layout alone, so every process of a run
    (planner, ``--shard`` writers, Dask workers) finds the same number."""
    if record.kind == "full":
        return 1
    largest = max(
        np.dtype(v.dtype).itemsize * math.prod(sizes[d] for d in v.dims[1:])
        for v in variables(record).values()
        if v.dims[0] == "doc"
    )
    most = min(MAX_DOCS_PER_SHARD, n_docs // _MIN_SHARDS, _SHARD_BYTES // largest)
    return max(1, most)


def shard_shape(
    dims: tuple[str, ...], chunks: tuple[int, ...], sizes: Mapping[str, int], per_shard: int
) -> tuple[int, ...] | None:
    """A variable's shard shape: ``per_shard`` documents and every policy, the other axes as
    its chunks; None where it is not sharded (one document per object, or no ``doc`` axis)."""
    if per_shard == 1 or not dims or dims[0] != "doc":
        return None
    rest = [sizes[d] if d == "policy" else c for d, c in zip(dims[1:], chunks[1:], strict=True)]
    return (per_shard, *rest)


def encodable(arr: Any) -> bool:
    """Whether ``arr`` is sharded with one shard across its axes after ``doc`` and the codecs
    the Rust shard encoder writes (``kvcouple._core.store_encode_shard``)."""
    shards = getattr(arr, "shards", None)
    if shards is None or tuple(shards[1:]) != tuple(arr.shape[1:]):
        return False
    codecs = arr.metadata.codecs
    if len(codecs) != 1 or codecs[0].to_dict().get("name") != "sharding_indexed":
        return False
    config = codecs[0].to_dict()["configuration"]
    inner = [dict(c) for c in config["codecs"]]
    index = [dict(c) for c in config["index_codecs"]]
    little: tuple[dict[str, str], ...] = ({}, {"endian": "little"})
    return (
        [c["name"] for c in inner] == ["bytes", "zstd", "crc32c"]
        and inner[0].get("configuration", {}) in little
        and inner[1]["configuration"] == {"level": 1, "checksum": False}
        and [c["name"] for c in index] == ["bytes", "crc32c"]
        and index[0].get("configuration", {}) in little
        and config["index_location"] == "end"
    )


@dataclass
class HeldShard:
    """A shard's documents held in memory until it is written: each variable's region."""

    arrays: dict[str, np.ndarray]
    docs: set[int] = field(default_factory=set)
    since: float = field(default_factory=time.monotonic)
