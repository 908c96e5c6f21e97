"""Which documents a writer of ``--shard i/N`` owns: the one rule the planner, the Dask
tracer and the writer lock share.

A store written with Zarr sharding keeps ``docs_per_shard`` consecutive documents in one
stored object per variable (:func:`kvcouple.store.create.docs_per_shard`). Two processes must
never write the same object, so parts are made of whole Zarr shards: part ``i`` of ``N`` owns
the documents ``d`` with ``(d // docs_per_shard) mod N == i``. With one document per object
(``docs_per_shard == 1``, stores without sharding) that is ``d mod N == i``, as before.
"""

from __future__ import annotations


def part_documents(n_docs: int, part: tuple[int, int], docs_per_shard: int = 1) -> list[int]:
    """The documents of ``range(n_docs)`` that part ``(i, N)`` writes."""
    index, count = part
    return [d for d in range(n_docs) if (d // docs_per_shard) % count == index]


def parts_overlap(
    a: tuple[int, int], b: tuple[int, int], n_docs: int, docs_per_shard: int = 1
) -> bool:
    """Whether parts ``a`` and ``b`` (index, count) share a document of ``range(n_docs)``."""
    blocks = -(-n_docs // docs_per_shard)
    return any(k % a[1] == a[0] and k % b[1] == b[0] for k in range(blocks))
