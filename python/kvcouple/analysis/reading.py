"""Recomputing the recorded TVs of one document from its stored distributions.

Everything is read through :class:`kvcouple.store.reader.TraceStoreReader` (the one reader:
any chunking, Zarr v2 or v3, local or object storage, every block checked); this module only
compares what was recorded with what the stored distributions give.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvcouple.errors import StoreError
from kvcouple.store.reader import TraceStoreReader
from kvcouple.store.schema import CHECKED_ONLY

# Disagreement between recorded and recomputed TV that still counts as agreement: storing a
# probability in a half format rounds it by a relative 2^-11 (float16) or 2^-8 (bfloat16), so
# TV = 1/2 sum |p - q| moves by at most about that much (plus underflowed tiny entries).
TOLERANCE = {"float16": 2e-3, "bfloat16": 1e-2, "float32": 1e-5, "float64": 1e-9}

# What a document's task reads (and so checks against the schema's value rules): the fields
# the estimates use, then the ones read only to be checked.
SUMMARY_READ = ("hazard", "tokens", "branch_step", "branch_mismatch", "branch_tv", *CHECKED_ONLY)

# Recomputed quantity -> (stored p, stored q, recorded TV), for the path and the branches.
PAIRS = {"path": ("p", "q", "hazard"), "branch": ("branch_p", "branch_q", "branch_tv")}


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


def _as_bits(block: np.ndarray) -> tuple[np.ndarray, str]:
    if block.dtype == np.float16:
        return block.view(np.uint16), "float16"
    if block.dtype.name == "bfloat16":
        return block.view(np.uint16), "bfloat16"
    if block.dtype in (np.float32, np.float64):
        return block, block.dtype.name
    raise StoreError(f"stored distributions have dtype {block.dtype}; expected a float format")


def recompute_full(
    reader: TraceStoreReader,
    doc: int,
    summary: dict[str, np.ndarray],
    tolerance: float | None,
    threads: int = 2,
    top_delta: list[dict[int, np.ndarray]] | None = None,
) -> RecomputeCheck:
    """Recompute hazards (``p, q``) and branch TVs (``branch_p, branch_q``) of one document
    from the stored distributions with the Rust kernel, block by block along the decoded
    chunks (``threads`` blocks decoded ahead, so decoding and computing overlap).
    ``top_delta``: see :func:`recompute_full_engine` (left empty where the engine cannot
    read the store)."""
    from kvcouple import _core

    doc_id = reader.doc_ids[doc]
    fused = recompute_full_engine(reader, [doc], [summary], tolerance, top_delta)
    if fused is not None:
        return fused[0]
    check = RecomputeCheck()
    jobs = []
    for where, (pn, qn, recorded_name) in PAIRS.items():
        for pol in range(len(reader.policies)):
            for sel in reader.blocks(pn, doc, pol):
                jobs.append((where, pol, (doc, pol, *sel), pn, qn, recorded_name))

    def load(job: Any) -> tuple[Any, np.ndarray, np.ndarray]:
        _, _, sel, pn, qn, _ = job
        return job, reader.read(pn, sel), reader.read(qn, sel)

    # Reader threads decode ahead (the codecs release the GIL while decompressing) while this
    # thread runs the Rust kernel (which releases it too). At most 2 x threads block pairs are
    # in memory at once.
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        it = iter(jobs)
        pending = [pool.submit(load, job) for job in itertools.islice(it, 2 * max(1, threads))]
        while pending:
            job, p, q = pending.pop(0).result()
            nxt = next(it, None)
            if nxt is not None:
                pending.append(pool.submit(load, nxt))
            where, pol, sel, pn, qn, recorded_name = job
            origin = (doc, pol, *(s.start for s in sel[2:]))
            reader.check_values(pn, p, origin)  # rows must be distributions, as in the engine
            reader.check_values(qn, q, origin)
            check.bytes_read += p.nbytes + q.nbytes
            vocab = p.shape[-1]
            pb, kind = _as_bits(np.ascontiguousarray(p))
            qb, _ = _as_bits(np.ascontiguousarray(q))
            tv = _core.row_tv(pb.reshape(-1, vocab), qb.reshape(-1, vocab), kind)
            tol = TOLERANCE.get(kind, 1e-3) if tolerance is None else tolerance
            recorded = summary[recorded_name][(pol,) + sel[2:-1]].astype(np.float64).reshape(-1)
            _compare(
                check, tv, recorded, tol, where, sel, p.shape[:-1], doc_id, reader.policies[pol]
            )
    return check


def recompute_full_engine(
    reader: TraceStoreReader,
    docs: list[int],
    summaries: Sequence[dict[str, np.ndarray]],
    tolerance: float | None,
    top_delta: list[dict[int, np.ndarray]] | None = None,
) -> list[RecomputeCheck] | None:
    """The fused path of :func:`recompute_full` for documents ``docs`` (``summaries``: their
    :meth:`~kvcouple.store.reader.TraceStoreReader.read_summary`): the Rust engine decodes
    every block of every document in one call, in parallel, and returns row TVs only; one
    check per document. None where it cannot read this store (the caller reads in Python);
    a damaged block raises :class:`StoreError` (naming its document when there is one).

    ``top_delta``: a list to fill with one dict per document, policy index -> the path's
    ``q(a) - p(a)`` (``a = argmax p``) at every (replicate, step) (NaN where no row was
    recorded), from the same decode: the scoreboard's ``delta_p``, so that full records are
    read once."""
    checks = [RecomputeCheck() for _ in docs]
    if not docs:
        return checks
    deltas: list[dict[int, np.ndarray]] = [{} for _ in docs]
    for where, (pn, qn, recorded_name) in PAIRS.items():
        arr = reader.array(pn)
        per_doc = [
            (pol, sel)
            for pol in range(len(reader.policies))
            for sel in reader.blocks(pn, docs[0], pol)
        ]
        sels: list[tuple[Any, ...]] = [(doc, pol, *sel) for doc in docs for pol, sel in per_doc]
        want_delta = top_delta is not None and where == "path"
        got = reader.rows_tv(pn, qn, sels, top_delta=want_delta)
        if got is None:
            return None
        tv = got[:, 0] if want_delta else got
        kind = "bfloat16" if arr.dtype.name == "bfloat16" else arr.dtype.name
        tol = TOLERANCE.get(kind, 1e-3) if tolerance is None else tolerance
        itemsize = arr.dtype.itemsize
        at = 0
        for k, sel in enumerate(sels):
            doc_index = k // len(per_doc)
            check, summary = checks[doc_index], summaries[doc_index]
            shape = tuple(s.stop - s.start for s in sel[2:-1])
            n = int(np.prod(shape))
            pol = sel[1]
            check.bytes_read += 2 * n * (sel[-1].stop - sel[-1].start) * itemsize
            recorded = summary[recorded_name][(pol,) + sel[2:-1]].astype(np.float64).reshape(-1)
            if want_delta:
                into = deltas[doc_index].setdefault(
                    pol, np.full(summary[recorded_name][pol].shape, np.nan)
                )
                into[sel[2:-1]] = got[at : at + n, 1].reshape(shape)
            _refuse_recorded_nan_rows(reader, summary, tv[at : at + n], where, sel)
            _compare(
                check,
                tv[at : at + n],
                recorded,
                tol,
                where,
                sel,
                shape,
                reader.doc_ids[sel[0]],
                reader.policies[pol],
            )
            at += n
    if top_delta is not None:
        top_delta.extend(deltas)
    return checks


def _refuse_recorded_nan_rows(
    reader: TraceStoreReader,
    summary: dict[str, np.ndarray],
    tv: np.ndarray,
    where: str,
    sel: tuple[Any, ...],
) -> None:
    """The engine allows rows of NaN (not recorded); where one stands at an entry that was
    recorded, read the block here so that the value check names the variable and row."""
    nan = np.isnan(tv)
    if not nan.any():
        return
    mark = summary["tokens" if where == "path" else "branch_mismatch"][(sel[1],) + sel[2:-1]]
    if not (nan & (mark.reshape(-1) != -1)).any():
        return
    origin = (sel[0], sel[1], *(s.start for s in sel[2:]))
    for name in PAIRS[where][:2]:
        reader.check_values(name, reader.read(name, sel), origin)


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
    # A TV recorded without its distributions (or the reverse) is a disagreement too, not a
    # row to skip. The one legitimate case: the path's hazard is 0 after a stop, where no
    # distribution is recorded.
    stopped = (recorded == 0) if where == "path" else np.zeros_like(seen)
    lone = (np.isnan(tv) & np.isfinite(recorded) & ~stopped) | (
        np.isfinite(tv) & np.isnan(recorded)
    )
    check.rows_checked += int(seen.sum() + lone.sum())
    if not seen.any() and not lone.any():
        return
    diff = np.abs(tv - recorded)
    diff[~seen] = 0.0
    check.max_abs_diff = max(check.max_abs_diff, float(diff.max()))
    for flat in np.flatnonzero((diff > tol) | lone)[:100]:  # a handful names the problem
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
    reader: TraceStoreReader, doc: int, summary: dict[str, np.ndarray], tolerance: float | None
) -> RecomputeCheck:
    """Top-K records do not determine TV exactly; check that each recorded TV lies in the
    interval the top-K ids, probabilities and tail masses allow (widened by ``tolerance``)."""
    doc_id = reader.doc_ids[doc]
    check = RecomputeCheck()
    tol = 1e-4 if tolerance is None else tolerance
    for where, prefix, recorded_name in (
        ("path", "", "hazard"),
        ("branch", "branch_", "branch_tv"),
    ):
        names = [
            f"{prefix}{v}_{s}" for v in ("topk_ids", "topk_probs", "tail_mass") for s in ("p", "q")
        ]
        a = reader.read_summary(doc, tuple(names))
        lo, hi = topk_tv_bounds(
            a[f"{prefix}topk_ids_p"],
            a[f"{prefix}topk_probs_p"],
            a[f"{prefix}tail_mass_p"],
            a[f"{prefix}topk_ids_q"],
            a[f"{prefix}topk_probs_q"],
            a[f"{prefix}tail_mass_q"],
        )
        rec = summary[recorded_name].astype(np.float64)
        for pol in range(len(reader.policies)):
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
                        reader.policies[pol],
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
