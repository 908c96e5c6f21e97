"""Reading a trace store one document at a time, with damage detection and recomputation.

The store is opened with :func:`kvcouple.store.open_trace_store` (xarray, which checks the schema
version and the completion flags); the arrays themselves are read chunk by chunk through Zarr,
so memory stays bounded by a few chunks whatever the store's size.

Damage is reported by name: a chunk file that is missing (Zarr would silently return its fill
value) or that cannot be decoded raises :class:`~kvcouple.errors.StoreError` naming the variable,
the chunk key, the document and the store.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvcouple.errors import StoreError

# Disagreement between recorded and recomputed TV that still counts as agreement: storing a
# probability in a half format rounds it by a relative 2^-11 (float16) or 2^-8 (bfloat16), so
# TV = 1/2 sum |p - q| moves by at most about that much (plus underflowed tiny entries).
TOLERANCE = {"float16": 2e-3, "bfloat16": 1e-2, "float32": 1e-5, "float64": 1e-9}

SUMMARY_READ = ("hazard", "tokens", "branch_step", "branch_mismatch", "branch_tv")


@dataclass
class StoreInfo:
    """What the analysis needs to know about a store, picklable for Dask workers."""

    path: str
    attrs: dict[str, Any]
    doc_ids: list[str]  # every document of the store, by index
    policies: list[str]
    done: list[int]  # indices of completed documents
    record: str

    @property
    def model(self) -> str:
        return str(self.attrs.get("model_id", "?"))


@dataclass
class Disagreement:
    """A recorded TV that differs from the one recomputed from the stored distributions."""

    doc_id: str
    policy: str
    where: str  # "path" or "branch"
    rep: int
    index: int  # step (path) or branch number
    lag: int  # -1 for the path
    recorded: float
    recomputed: float


@dataclass
class RecomputeCheck:
    rows_checked: int = 0
    max_abs_diff: float = 0.0
    disagreements: list[Disagreement] = field(default_factory=list)
    bytes_read: int = 0


def open_store_info(path: str | os.PathLike[str], *, allow_incomplete: bool) -> StoreInfo:
    """Validate a store (schema, completion) and collect what the analysis needs."""
    from kvcouple.store.reader import open_trace_store

    ds = open_trace_store(path, allow_incomplete=True)
    import zarr

    group = zarr.open_group(str(path), mode="r")
    done_flags = np.asarray(group["completed"][...], bool)
    ids = [str(x) for x in np.asarray(group["doc_id"][...])]
    if not done_flags.all() and not allow_incomplete:
        open_trace_store(path, allow_incomplete=False)  # raises the reader's clear message
    attrs = dict(ds.attrs)
    return StoreInfo(
        path=str(path),
        attrs=attrs,
        doc_ids=ids,
        policies=[str(p) for p in np.asarray(group["policy"][...])],
        done=[int(i) for i in np.flatnonzero(done_flags)],
        record=str(attrs.get("record")),
    )


def _group(path: str) -> Any:
    import zarr

    return zarr.open_group(path, mode="r")


def _chunk_keys(arr: Any, name: str, doc: int) -> Iterator[tuple[str, tuple[slice, ...]]]:
    """The chunk files (key, selection) of one document of ``arr`` (doc is the first axis)."""
    # zarr 3 exposes the separator on `metadata`, zarr 2 on the array; both default to ".".
    meta = getattr(arr, "metadata", arr)
    sep = getattr(meta, "dimension_separator", None) or getattr(arr, "_dimension_separator", None)
    sep = sep or "."
    ranges = [range(0, n, c) for n, c in zip(arr.shape[1:], arr.chunks[1:], strict=True)]
    c0 = arr.chunks[0]
    for starts in itertools.product(*ranges):
        idx = [doc // c0] + [s // c for s, c in zip(starts, arr.chunks[1:], strict=True)]
        sel = (slice(doc, doc + 1),) + tuple(
            slice(s, min(s + c, n))
            for s, c, n in zip(starts, arr.chunks[1:], arr.shape[1:], strict=True)
        )
        yield f"{name}/{sep.join(map(str, idx))}", sel


def check_chunks_exist(path: str, group: Any, names: list[str], doc: int, doc_id: str) -> None:
    """Raise :class:`StoreError` naming the first chunk file of this document that is missing."""
    root = Path(path)
    for name in names:
        arr = group[name]
        for key, _ in _chunk_keys(arr, name, doc):
            if not (root / key).exists():
                raise StoreError(
                    f"{path}: chunk {key} of variable {name!r} (document {doc_id!r}) is missing; "
                    f"the store is damaged. Re-trace that document, or pass --allow-incomplete "
                    f"to analyse the others."
                )


def read_chunk(path: str, arr: Any, name: str, sel: tuple[Any, ...], doc_id: str) -> np.ndarray:
    """Read one selection; a decode failure names the chunk that failed."""
    try:
        return np.asarray(arr[sel])
    except Exception as e:  # codecs raise many types
        for key, chunk_sel in _chunk_keys(
            arr, name, sel[0].start if isinstance(sel[0], slice) else int(sel[0])
        ):
            try:
                arr[chunk_sel]
            except Exception as inner:
                raise StoreError(
                    f"{path}: chunk {key} of variable {name!r} (document {doc_id!r}) cannot be "
                    f"decoded ({type(inner).__name__}: {inner}); the store is damaged."
                ) from inner
        raise StoreError(
            f"{path}: variable {name!r} of document {doc_id!r} cannot be read: {e}"
        ) from e


def read_summary(info: StoreInfo, group: Any, doc: int) -> dict[str, np.ndarray]:
    """The RB-CMC fields of one document (all policies), after checking its chunks exist."""
    doc_id = info.doc_ids[doc]
    check_chunks_exist(info.path, group, list(SUMMARY_READ), doc, doc_id)
    out = {}
    for n in SUMMARY_READ:
        direct = DirectChunks.open(info.path, n)
        if direct is not None:
            out[n] = direct.read_doc(doc, doc_id)
        else:
            out[n] = read_chunk(info.path, group[n], n, (doc,), doc_id)
    return out


def _block_selections(arr: Any, doc: int, pol: int) -> list[tuple[Any, ...]]:
    """Chunk-aligned selections of one (document, policy) over the remaining axes."""
    shape, chunks = arr.shape[2:], arr.chunks[2:]
    out = []
    for starts in itertools.product(*[range(0, n, c) for n, c in zip(shape, chunks, strict=True)]):
        out.append(
            (doc, pol)
            + tuple(slice(s, min(s + c, n)) for s, c, n in zip(starts, chunks, shape, strict=True))
        )
    return out


def _as_bits(block: np.ndarray) -> tuple[np.ndarray, str]:
    if block.dtype == np.float16:
        return block.view(np.uint16), "float16"
    if block.dtype.name == "bfloat16":
        return block.view(np.uint16), "bfloat16"
    if block.dtype in (np.float32, np.float64):
        return block, block.dtype.name
    raise StoreError(f"stored distributions have dtype {block.dtype}; expected a float format")


def recompute_full(
    info: StoreInfo,
    group: Any,
    doc: int,
    summary: dict[str, np.ndarray],
    tolerance: float | None,
    threads: int = 2,
) -> RecomputeCheck:
    """Recompute hazards (``p, q``) and branch TVs (``branch_p, branch_q``) of one document
    from the stored distributions with the Rust kernel, chunk by chunk (``threads`` chunks
    decoded ahead, so decoding and computing overlap)."""
    from kvcouple import _core

    doc_id = info.doc_ids[doc]
    check_chunks_exist(info.path, group, ["p", "q", "branch_p", "branch_q"], doc, doc_id)
    check = RecomputeCheck()
    jobs = []
    for where, (pn, qn, recorded_name) in {
        "path": ("p", "q", "hazard"),
        "branch": ("branch_p", "branch_q", "branch_tv"),
    }.items():
        pa, qa = group[pn], group[qn]
        for pol in range(len(info.policies)):
            for sel in _block_selections(pa, doc, pol):
                jobs.append((where, pol, sel, pa, qa, pn, qn, recorded_name))

    direct = {n: DirectChunks.open(info.path, n) for n in ("p", "q", "branch_p", "branch_q")}

    def read(arr: Any, name: str, sel: tuple[Any, ...]) -> np.ndarray:
        reader = direct[name]
        if reader is None:
            return read_chunk(info.path, arr, name, sel, doc_id)
        return reader.read(sel, doc_id)

    def load(job: Any) -> tuple[Any, np.ndarray, np.ndarray]:
        where, pol, sel, pa, qa, pn, qn, _ = job
        return job, read(pa, pn, sel), read(qa, qn, sel)

    # Reader threads decode ahead (numcodecs releases the GIL while decompressing) while this
    # thread runs the Rust kernel (which releases it too), so decoding and computing overlap.
    # At most 2 x threads chunk pairs are in memory at once.
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        it = iter(jobs)
        pending = [pool.submit(load, job) for job in itertools.islice(it, 2 * max(1, threads))]
        while pending:
            job, p, q = pending.pop(0).result()
            nxt = next(it, None)
            if nxt is not None:
                pending.append(pool.submit(load, nxt))
            where, pol, sel, *_, recorded_name = job
            check.bytes_read += p.nbytes + q.nbytes
            vocab = p.shape[-1]
            pb, kind = _as_bits(np.ascontiguousarray(p))
            qb, _ = _as_bits(np.ascontiguousarray(q))
            tv = _core.row_tv(pb.reshape(-1, vocab), qb.reshape(-1, vocab), kind)
            tol = TOLERANCE.get(kind, 1e-3) if tolerance is None else tolerance
            recorded = summary[recorded_name][(pol,) + sel[2:-1]].astype(np.float64).reshape(-1)
            _compare(check, tv, recorded, tol, where, sel, p.shape[:-1], doc_id, info.policies[pol])
    return check


class DirectChunks:
    """Chunk files of one Zarr v2 array in a local directory store, decoded with the array's own
    numcodecs compressor and filters: the same bytes and codec as Zarr, without its per-call
    machinery (which costs as much as the Rust kernel at 128k vocabularies)."""

    def __init__(self, root: Path, name: str, meta: dict[str, Any]):
        import numcodecs

        self.root, self.name = root, name
        self.shape = tuple(meta["shape"])
        self.chunks = tuple(meta["chunks"])
        self.dtype = np.dtype(meta["dtype"])
        self.sep = meta.get("dimension_separator") or "."
        self.codec = numcodecs.get_codec(meta["compressor"]) if meta.get("compressor") else None
        self.filters = [numcodecs.get_codec(f) for f in meta.get("filters") or []]

    @classmethod
    def open(cls, path: str, name: str) -> DirectChunks | None:
        """A reader when the array is plain Zarr v2 in C order on local disk, else None."""
        import json

        meta_file = Path(path) / name / ".zarray"
        try:
            meta = json.loads(meta_file.read_text())
        except (OSError, ValueError):
            return None
        if meta.get("zarr_format") != 2 or meta.get("order", "C") != "C":
            return None
        try:
            return cls(Path(path), name, meta)
        except Exception:  # an unknown codec: let Zarr handle it
            return None

    def read_doc(self, doc: int, doc_id: str) -> np.ndarray:
        """Every chunk of one document (the first axis), assembled."""
        out = np.empty(self.shape[1:], self.dtype)
        grid = [range(0, n, c) for n, c in zip(self.shape[1:], self.chunks[1:], strict=True)]
        for starts in itertools.product(*grid):
            sel = tuple(
                slice(s, min(s + c, n))
                for s, c, n in zip(starts, self.chunks[1:], self.shape[1:], strict=True)
            )
            out[sel] = self.read((doc, *sel), doc_id)
        return out

    def read(self, sel: tuple[Any, ...], doc_id: str) -> np.ndarray:
        """The block ``sel`` (integers, then chunk-aligned slices) as a numpy array."""
        starts = [s.start if isinstance(s, slice) else int(s) for s in sel]
        idx = [st // c for st, c in zip(starts, self.chunks, strict=False)]
        key = f"{self.name}/{self.sep.join(map(str, idx))}"
        try:
            raw = (self.root / key).read_bytes()
        except FileNotFoundError:
            raise StoreError(
                f"{self.root}: chunk {key} of variable {self.name!r} (document {doc_id!r}) is "
                f"missing; the store is damaged."
            ) from None
        try:
            data: Any = self.codec.decode(raw) if self.codec else raw
            for f in reversed(self.filters):
                data = f.decode(data)
            block = np.frombuffer(data, dtype=self.dtype).reshape(self.chunks)
        except Exception as e:
            raise StoreError(
                f"{self.root}: chunk {key} of variable {self.name!r} (document {doc_id!r}) cannot "
                f"be decoded ({type(e).__name__}: {e}); the store is damaged."
            ) from e
        inner = tuple(0 if not isinstance(s, slice) else slice(0, s.stop - s.start) for s in sel)
        return block[inner]


def _compare(
    check: RecomputeCheck,
    tv: np.ndarray,
    recorded: np.ndarray,
    tol: float,
    where: str,
    sel: tuple[Any, ...],
    block_shape: tuple[int, ...],
    doc_id: str,
    policy: str,
) -> None:
    seen = np.isfinite(tv) & np.isfinite(recorded)
    check.rows_checked += int(seen.sum())
    if not seen.any():
        return
    diff = np.abs(tv - recorded)
    diff[~seen] = 0.0
    check.max_abs_diff = max(check.max_abs_diff, float(diff.max()))
    for flat in np.flatnonzero(diff > tol)[:100]:  # a handful names the problem
        idx = np.unravel_index(flat, block_shape)
        offs = [s.start for s in sel[2:-1]]
        pos = [int(i) + o for i, o in zip(idx, offs, strict=True)]
        check.disagreements.append(
            Disagreement(
                doc_id,
                policy,
                where,
                pos[0],
                pos[1] + 1,
                -1 if where == "path" else pos[2],
                float(recorded[flat]),
                float(tv[flat]),
            )
        )


def recompute_topk(
    info: StoreInfo, group: Any, doc: int, summary: dict[str, np.ndarray], tolerance: float | None
) -> RecomputeCheck:
    """Top-K records do not determine TV exactly; check that each recorded TV lies in the
    interval the top-K ids, probabilities and tail masses allow (widened by ``tolerance``)."""
    doc_id = info.doc_ids[doc]
    check = RecomputeCheck()
    tol = 1e-4 if tolerance is None else tolerance
    for where, prefix, recorded_name in (
        ("path", "", "hazard"),
        ("branch", "branch_", "branch_tv"),
    ):
        names = [
            f"{prefix}{v}_{s}" for v in ("topk_ids", "topk_probs", "tail_mass") for s in ("p", "q")
        ]
        check_chunks_exist(info.path, group, names, doc, doc_id)
        a = {n: read_chunk(info.path, group[n], n, (doc,), doc_id) for n in names}
        lo, hi = topk_tv_bounds(
            a[f"{prefix}topk_ids_p"],
            a[f"{prefix}topk_probs_p"],
            a[f"{prefix}tail_mass_p"],
            a[f"{prefix}topk_ids_q"],
            a[f"{prefix}topk_probs_q"],
            a[f"{prefix}tail_mass_q"],
        )
        rec = summary[recorded_name].astype(np.float64)
        for pol in range(len(info.policies)):
            r, lo_p, hi_p = rec[pol], lo[pol], hi[pol]
            seen = np.isfinite(r) & np.isfinite(lo_p)
            check.rows_checked += int(seen.sum())
            out = seen & ((r < lo_p - tol) | (r > hi_p + tol))
            for idx in np.argwhere(out)[:100]:
                i = tuple(idx)
                est = lo_p[i] if r[i] < lo_p[i] else hi_p[i]
                check.max_abs_diff = max(check.max_abs_diff, abs(float(r[i] - est)))
                check.disagreements.append(
                    Disagreement(
                        doc_id,
                        info.policies[pol],
                        where,
                        int(idx[0]),
                        int(idx[1]) + 1,
                        -1 if where == "path" else int(idx[2]),
                        float(r[i]),
                        float(est),
                    )
                )
    return check


def topk_tv_bounds(
    ids_p: np.ndarray,
    probs_p: np.ndarray,
    tail_p: np.ndarray,
    ids_q: np.ndarray,
    probs_q: np.ndarray,
    tail_q: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Bounds on TV(p, q) from top-K records (last axis K; NaN where nothing was recorded).

    For a token in both lists ``|p - q|`` is known. For a token in one list only, the other
    side's probability is unknown but at most that side's smallest listed probability and its
    tail mass. Tokens in neither list hide in both tails. TV is half the L1 sum; the lower bound
    takes the unknowns as close as allowed and uses ``|tail_p' - tail_q'|`` for the rest."""
    shape = ids_p.shape[:-1]
    K = ids_p.shape[-1]
    ip, pp = ids_p.reshape(-1, K), probs_p.reshape(-1, K).astype(np.float64)
    iq, pq = ids_q.reshape(-1, K), probs_q.reshape(-1, K).astype(np.float64)
    tp, tq = tail_p.reshape(-1).astype(np.float64), tail_q.reshape(-1).astype(np.float64)
    match = (ip[:, :, None] == iq[:, None, :]) & (ip[:, :, None] >= 0)
    in_q = match.any(2)  # p's listed tokens that q also lists
    in_p = match.any(1)
    q_at_p = np.where(match, pq[:, None, :], 0.0).sum(2)
    known = np.where(in_q, np.abs(pp - q_at_p), 0.0).sum(1)
    cap_q = np.minimum(np.min(np.where(iq >= 0, pq, np.inf), axis=1), tq)
    cap_p = np.minimum(np.min(np.where(ip >= 0, pp, np.inf), axis=1), tp)
    only_p = np.where(~in_q & (ip >= 0), pp, 0.0)
    only_q = np.where(~in_p & (iq >= 0), pq, 0.0)
    # Upper: unknown partners are 0 and the tails are disjoint.
    upper = known + only_p.sum(1) + only_q.sum(1) + tp + tq
    # Lower: partners take up to their cap (limited by tail mass), the rest of the tails cancel.
    lower = (
        known
        + np.maximum(only_p - cap_q[:, None], 0.0).sum(1)
        + np.maximum(only_q - cap_p[:, None], 0.0).sum(1)
    )
    return (
        np.minimum(0.5 * lower, 1.0).reshape(shape),
        np.minimum(0.5 * upper, 1.0).reshape(shape),
    )
