"""The table's moments, in blocks of bounded memory whatever the number of documents: each
column's mean over its finite entries (:func:`column_means`), the cross moments of chosen
pairs of columns (:func:`pair_moments`), spreads (:func:`spreads`), and the Gram matrix of
the centred columns, in two passes over the finished table (:meth:`TableMoments.of`) or a
block at a time while the table is read (:class:`RunningMoments`). The studentized intervals
(:mod:`kvcouple.analysis.studentized`) and the Gaussian-limit resamples
(:func:`kvcouple.analysis.bootstrap.gaussian_means`) read them.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "GATHER_BYTES",
    "RunningMoments",
    "TableMoments",
    "column_means",
    "pair_moments",
    "spreads",
]

# Bytes of table columns gathered at once by the moments here (memory independent of the
# number of columns asked for).
GATHER_BYTES = 8 << 20


def _column_blocks(rows: int, count: int) -> list[slice]:
    """Blocks of ``count`` gathered columns of ``rows`` doubles, each within GATHER_BYTES."""
    width = max(1, GATHER_BYTES // (8 * max(rows, 1)))
    return [slice(i, min(i + width, count)) for i in range(0, count, width)]


def _cross_means(
    data: np.ndarray, center: np.ndarray, pairs: Sequence[tuple[int, int]]
) -> np.ndarray:
    """``nanmean((x_j - c_j)(x_l - c_l))`` over the documents for each pair (NaN where no
    product is finite), block by block of pairs; each pair's column is summed as numpy sums
    one column (the same doubles as one call per pair)."""
    out = np.full(len(pairs), np.nan)
    if not pairs:
        return out
    j = np.fromiter((p[0] for p in pairs), np.int64, len(pairs))
    k = np.fromiter((p[1] for p in pairs), np.int64, len(pairs))
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # an all-NaN pair: NaN, as asked
        for b in _column_blocks(data.shape[0], len(pairs)):
            prod = np.ascontiguousarray(
                ((data[:, j[b]] - center[j[b]]) * (data[:, k[b]] - center[k[b]])).T
            )
            out[b] = np.where(np.isfinite(prod).any(1), np.nanmean(prod, axis=1), np.nan)
    return out


def pair_moments(
    data: np.ndarray | None,
    center: np.ndarray,
    pairs: Sequence[tuple[int, int]],
    moments: TableMoments | None,
    rows: int,
) -> np.ndarray:
    """:func:`_cross_means` of ``pairs`` of the ``rows`` documents; where the table's moments
    are given, a pair of columns without NaN entries is read off their Gram matrix
    (``gram_jk / rows``) instead. ``data`` may be None where every pair is read so."""
    if moments is None or not pairs:
        if data is None:
            raise ValueError("cross moments need the table or its moments")
        return _cross_means(data, center, pairs)
    complete = moments.complete(rows)
    out = np.empty(len(pairs))
    rest = []
    for q, (j, k) in enumerate(pairs):
        if complete[j] and complete[k]:
            out[q] = moments.gram[j, k] / rows
        else:
            rest.append(q)
    if rest:
        if data is None:
            raise ValueError("cross moments of columns with non-finite entries need the table")
        out[rest] = _cross_means(data, center, [pairs[q] for q in rest])
    return out


def spreads(data: np.ndarray, cols: Sequence[int]) -> np.ndarray:
    """``nanstd`` of each column of ``cols`` (0 where it has no finite entry), block by block,
    each column summed as numpy sums one column."""
    out = np.zeros(len(cols))
    at = np.asarray(cols, np.int64)
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for b in _column_blocks(data.shape[0], len(cols)):
            block = np.ascontiguousarray(data[:, at[b]].T)
            out[b] = np.where(np.isfinite(block).any(1), np.nanstd(block, axis=1), 0.0)
    return out


def _row_blocks(mat: np.ndarray) -> list[slice]:
    """Blocks of rows of ``mat``, each within GATHER_BYTES."""
    rows, cols = mat.shape
    step = max(1, GATHER_BYTES // (8 * max(cols, 1)))
    return [slice(i, min(i + step, rows)) for i in range(0, rows, step)]


def column_means(mat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each column's mean over its finite entries (NaN where it has none) and their count, in
    one pass over blocks of rows (the bootstrap's point estimates)."""
    point, count, _ = _column_sums(mat, positive=False)
    return point, count


def _column_sums(mat: np.ndarray, positive: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`column_means` and, where asked (else zeros), each column's number of positive
    entries, in the same pass."""
    total, count = np.zeros(mat.shape[1]), np.zeros(mat.shape[1])
    positives = np.zeros(mat.shape[1], np.int64)
    for b in _row_blocks(mat):
        finite = np.isfinite(mat[b])
        total += np.where(finite, mat[b], 0.0).sum(0)
        count += finite.sum(0)
        if positive:
            positives += (mat[b] > 0).sum(0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, total / np.maximum(count, 1), np.nan), count, positives


# A combination of columns whose variance is below this share of its columns' spread squared
# is taken from a pass over the rows (TableMoments.combination): rounding there is ~1e-16.
COMBINED_SPREAD_TOL = 1e-9


@dataclass
class TableMoments:
    """Two passes over the table's rows (in GATHER_BYTES blocks, memory independent of the
    documents): each column's mean over its finite entries, their count, and the Gram matrix
    of the centred columns with NaN entries as 0 (``gram[j, k] = sum_i (x_ij - m_j)(x_ik -
    m_k)`` over the documents where both are finite); and each column's number of positive
    entries (the documents that inform a hazard or a lag's branch TV: the curves' counts; None
    for linear combinations of columns made from another table's moments,
    :meth:`combination`)."""

    point: np.ndarray  # (cols,) NaN where a column has no finite entry
    count: np.ndarray  # (cols,)
    gram: np.ndarray  # (cols, cols)
    positive: np.ndarray | None  # (cols,) int64

    @classmethod
    def of(cls, mat: np.ndarray) -> TableMoments:
        point, count, positive = _column_sums(mat, positive=True)
        center = np.where(count > 0, point, 0.0)
        gram = np.zeros((mat.shape[1], mat.shape[1]))
        blocks = _row_blocks(mat)
        buffer = np.empty((blocks[0].stop - blocks[0].start if blocks else 0, mat.shape[1]))
        for b in blocks:  # one buffer for every block, masked only where it holds NaN or inf
            x = buffer[: b.stop - b.start]
            np.subtract(mat[b], center, out=x)
            finite = np.isfinite(x)
            if not finite.all():
                np.copyto(x, 0.0, where=~finite)
            gram += x.T @ x
        return cls(point, count, gram, positive)

    def complete(self, rows: int) -> np.ndarray:
        """Columns with every entry finite."""
        return self.count == rows

    def combination(
        self, idx: Sequence[int], weights: np.ndarray, rows: int
    ) -> TableMoments | None:
        """The moments of the columns ``table[:, idx] @ weights`` of a table of ``rows`` rows
        whose columns ``idx`` are complete: means ``w' m`` and Gram matrix ``w' G w``, equal
        to :meth:`of` of the combined columns up to rounding, without a pass over the rows.
        None where a combination (nearly) cancels its columns' spread: its variance is then
        at the level of rounding, and only a pass over the rows says whether it is exactly 0
        (a constant combination, which the tests treat by their own rule)."""
        at = np.asarray(idx, np.int64)
        if not self.complete(rows)[at].all():
            raise ValueError("a combination of columns with non-finite entries has no moments here")
        w = np.asarray(weights, np.float64)
        gram = w.T @ self.gram[np.ix_(at, at)] @ w
        # Each combination's spread if its columns' spreads added up (no cancellation).
        spread = np.abs(w).T @ np.sqrt(np.maximum(np.diag(self.gram)[at], 0.0))
        if not (np.diag(gram) > COMBINED_SPREAD_TOL * spread**2).all():
            return None
        return TableMoments(self.point[at] @ w, np.full(w.shape[1], float(rows)), gram, None)


class RunningMoments:
    """:class:`TableMoments` of rows given a block at a time (:meth:`add`), so that they are
    made while the table is still being read. Each block is centred at the first block's
    means ``c`` and the sums are recentred exactly at the end: with ``d = m - c``,
    ``gram = G - d P - (d P)' + d d' N``, where ``G``, ``P`` and ``N`` are the sums over
    the rows of ``x x'``, ``f x'`` and ``f f'`` (``x``: the row minus ``c``, non-finite
    entries 0; ``f``: its finite mask). Blocks without a non-finite entry add to ``P`` and
    ``N`` through their column sums and row count alone (no extra products). Equal to
    :meth:`TableMoments.of` of the same rows up to rounding (``c`` is near ``m``, so
    nothing cancels)."""

    def __init__(self, cols: int) -> None:
        self.cols = cols
        self.rows = 0
        self.center: np.ndarray | None = None
        self.gram = np.zeros((cols, cols))
        self.total = np.zeros(cols)  # sum of x over finite entries
        self.count = np.zeros(cols)
        self.positive = np.zeros(cols, np.int64)
        self.dense_total = np.zeros(cols)  # sum of x over the blocks with every entry finite
        self.dense_rows = 0
        self.cross: np.ndarray | None = None  # sum f x' over the other blocks
        self.pairs: np.ndarray | None = None  # sum f f' over the other blocks

    def add(self, block: np.ndarray) -> None:
        """Add ``block`` (rows x cols); any number of rows."""
        if block.ndim != 2 or block.shape[1] != self.cols:
            raise ValueError(f"a block of {self.cols} columns, got shape {block.shape}")
        if not block.shape[0]:
            return
        if self.center is None:
            first, _ = column_means(block)
            self.center = np.where(np.isfinite(first), first, 0.0)
        self.positive += (block > 0).sum(0)
        x = block - self.center
        finite = np.isfinite(x)
        dense = bool(finite.all())
        if not dense:
            np.copyto(x, 0.0, where=~finite)
        self.gram += x.T @ x
        sums = x.sum(0)
        self.total += sums
        self.rows += block.shape[0]
        if dense:
            self.count += block.shape[0]
            self.dense_total += sums
            self.dense_rows += block.shape[0]
            return
        f = finite.astype(np.float64)
        self.count += f.sum(0)
        if self.cross is None or self.pairs is None:
            self.cross = np.zeros((self.cols, self.cols))
            self.pairs = np.zeros((self.cols, self.cols))
        self.cross += f.T @ x
        self.pairs += f.T @ f

    def moments(self) -> TableMoments:
        """The moments of every row added."""
        center = self.center if self.center is not None else np.zeros(self.cols)
        has = self.count > 0
        shift = np.where(has, self.total / np.maximum(self.count, 1), 0.0)
        point = np.where(has, center + shift, np.nan)
        # P and N: the dense blocks' parts (every row counts in every column) plus the rest.
        cross = np.broadcast_to(self.dense_total, (self.cols, self.cols)).copy()
        pairs = np.full((self.cols, self.cols), float(self.dense_rows))
        if self.cross is not None and self.pairs is not None:
            cross += self.cross
            pairs += self.pairs
        dp = shift[:, None] * cross
        gram = self.gram - dp - dp.T + np.outer(shift, shift) * pairs
        return TableMoments(point, self.count.copy(), gram, self.positive.copy())
