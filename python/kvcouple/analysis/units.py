"""One store's per-unit estimates held as columns, in memory bounded by the table.

The document bootstrap resamples one (documents x columns) table (:class:`TableLayout` says
its columns: per policy the scalars, the survival and pmf curves, the TV-by-lag numerators and
denominators and the early/late sums). :class:`UnitColumns` is that table, filled row by row as
the documents' batches come back (from threads or Dask workers, in any order), plus the few
per-unit values the bootstrap does not read (Monte Carlo standard errors, median tau, whether
the tail was observed). Nothing of size documents x :class:`UnitEstimate` objects is kept: a
document's units are rebuilt from its row on demand (:class:`UnitView`), so 100k documents
cost the table (8 bytes a cell) and ~200 bytes a unit, not a Python object graph per unit.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from kvcouple.analysis.estimates import SCALARS, BatchUnits, Table, UnitBatch, UnitEstimate
from kvcouple.analysis.moments import GATHER_BYTES, RunningMoments, TableMoments

__all__ = ["TableLayout", "UnitColumns", "UnitView", "build_table"]


@dataclass(frozen=True)
class TableLayout:
    """The table's columns for ``policies`` at ``horizon`` T, observation window ``obs_window``
    (L_w, lags ``0..lags - 1`` stored) and early/late split (early lags ``1..s``, late
    ``s+1..L_w``; default ``L_w // 2``)."""

    policies: tuple[str, ...]
    horizon: int
    lags: int  # stored lags 0..L: L + 1
    obs_window: int
    split: int

    @classmethod
    def of(
        cls,
        policies: list[str],
        horizon: int,
        lags: int,
        obs_window: int,
        early_late_split: int | None = None,
    ) -> TableLayout:
        half = obs_window // 2 if early_late_split is None else int(early_late_split)
        if not 0 < half < obs_window:
            raise ValueError(
                f"the early/late split must be a lag in 1..{obs_window - 1} (the window has "
                f"{obs_window} lags), got {half}"
            )
        return cls(tuple(policies), int(horizon), int(lags), int(obs_window), half)

    @property
    def per_policy(self) -> int:
        """Columns per policy: scalars, S_0..S_T, pmf_1..pmf_T, (tvn, tvd) per lag, 4 sums."""
        return len(SCALARS) + (self.horizon + 1) + self.horizon + 2 * self.lags + 4

    @property
    def width(self) -> int:
        return self.per_policy * len(self.policies)

    def names(self) -> list[str]:
        out: list[str] = []
        for pol in self.policies:
            out += [f"{pol}|{name}" for name in SCALARS]
            out += [f"{pol}|S|{i}" for i in range(self.horizon + 1)]
            out += [f"{pol}|pmf|{i + 1}" for i in range(self.horizon)]
            for lag in range(self.lags):
                out += [f"{pol}|tvn|{lag}", f"{pol}|tvd|{lag}"]
            for part in ("early", "late"):
                out += [f"{pol}|{part}n", f"{pol}|{part}d"]
        return out

    def fill(self, row: np.ndarray, units: Mapping[str, UnitEstimate]) -> None:
        """Write one document's units into ``row`` (length :attr:`width`)."""
        T, n = self.horizon, len(SCALARS)
        early = slice(1, self.split + 1)
        late = slice(self.split + 1, self.obs_window + 1)
        for k, pol in enumerate(self.policies):
            u = units[pol]
            if len(u.tv_lag_num) != self.lags or len(u.survival) != T + 1:
                raise ValueError(
                    f"policy {pol!r}: a unit of {len(u.survival) - 1} steps and "
                    f"{len(u.tv_lag_num)} lags in a table of {T} steps and {self.lags} lags"
                )
            at = k * self.per_policy
            row[at : at + n] = [u.values[name] for name in SCALARS]
            at += n
            row[at : at + T + 1] = u.survival
            at += T + 1
            row[at : at + T] = u.pmf
            at += T
            row[at : at + 2 * self.lags : 2] = u.tv_lag_num
            row[at + 1 : at + 2 * self.lags : 2] = u.tv_lag_den
            at += 2 * self.lags
            row[at : at + 4] = (
                u.tv_lag_num[early].sum(),
                u.tv_lag_den[early].sum(),
                u.tv_lag_num[late].sum(),
                u.tv_lag_den[late].sum(),
            )

    def fill_batch(self, rows: np.ndarray, batch: UnitBatch, docs: np.ndarray) -> None:
        """:meth:`fill` of documents ``docs`` of ``batch`` into ``rows`` (one row each, as
        many as ``docs``) at once: the same doubles, column block by column block."""
        T, n, P = self.horizon, len(SCALARS), len(batch.policies)
        early = slice(1, self.split + 1)
        late = slice(self.split + 1, self.obs_window + 1)
        if batch.tv_lag_num.shape[1] != self.lags or batch.survival.shape[1] != T + 1:
            raise ValueError(
                f"units of {batch.survival.shape[1] - 1} steps and {batch.tv_lag_num.shape[1]} "
                f"lags in a table of {T} steps and {self.lags} lags"
            )
        # Consecutive documents from the first (a whole batch): each policy's units are every
        # P-th row, read as a strided view rather than gathered.
        run = bool(docs.size) and docs[0] == 0 and bool(np.all(np.diff(docs) == 1))
        for k, pol in enumerate(self.policies):
            j = batch.policies.index(pol)
            u: slice | np.ndarray = slice(j, j + P * len(docs), P) if run else docs * P + j
            at = k * self.per_policy
            rows[:, at : at + n] = batch.values[u]
            at += n
            rows[:, at : at + T + 1] = batch.survival[u]
            at += T + 1
            rows[:, at : at + T] = batch.pmf[u]
            at += T
            num, den = batch.tv_lag_num[u], batch.tv_lag_den[u]
            rows[:, at : at + 2 * self.lags : 2] = num
            rows[:, at + 1 : at + 2 * self.lags : 2] = den
            at += 2 * self.lags
            # Row by row as fill sums them (numpy's row reduction: the same doubles).
            rows[:, at] = num[:, early].sum(axis=1)
            rows[:, at + 1] = den[:, early].sum(axis=1)
            rows[:, at + 2] = num[:, late].sum(axis=1)
            rows[:, at + 3] = den[:, late].sum(axis=1)

    def unit(
        self, row: np.ndarray, k: int, stderr: np.ndarray, median_tau: float, tail: bool
    ) -> UnitEstimate:
        """Policy ``k``'s :class:`UnitEstimate` rebuilt from a row (the same doubles)."""
        T, n = self.horizon, len(SCALARS)
        at = k * self.per_policy
        values = {name: float(v) for name, v in zip(SCALARS, row[at : at + n], strict=True)}
        at += n
        survival = row[at : at + T + 1].copy()
        at += T + 1
        pmf = row[at : at + T].copy()
        at += T
        num = row[at : at + 2 * self.lags : 2].copy()
        den = row[at + 1 : at + 2 * self.lags : 2].copy()
        errs = {name: float(v) for name, v in zip(SCALARS, stderr, strict=True)}
        return UnitEstimate(values, errs, survival, pmf, num, den, float(median_tau), bool(tail))


class UnitColumns:
    """Every analysed document's units of one store: ``slots`` rows, filled by :meth:`put`
    (each slot once; any order, any thread: rows are disjoint), then :meth:`finish` keeps the
    filled slots in slot order.

    With ``moments``, the table's :class:`~kvcouple.analysis.moments.TableMoments` (the
    Gram matrix the Gaussian-limit resamples need) are made while the rows come in: a block
    of slots is added once every slot in it is settled (:meth:`settle`: filled, or given up
    by a damaged document), blocks in slot order whatever order the batches came back in, so
    the result does not depend on the threads' timing."""

    def __init__(self, layout: TableLayout, slots: int, moments: bool = False) -> None:
        self.layout = layout
        P = len(layout.policies)
        self.matrix = np.zeros((slots, layout.width))
        self.stderr = np.full((slots, P, len(SCALARS)), np.nan)
        self.median_tau = np.full((slots, P), np.nan)
        self.tail_observed = np.zeros((slots, P), bool)
        self.filled = np.zeros(slots, bool)
        self._running = RunningMoments(layout.width) if moments else None
        self._settled = np.zeros(slots, bool)
        self._added = 0  # slots before this one are in the running moments
        self._block = max(1, GATHER_BYTES // (8 * max(layout.width, 1)))
        self._adding = threading.Lock()

    @property
    def running(self) -> bool:
        """Whether the moments are made as the rows come in."""
        return self._running is not None

    def settle(self, slots: Iterable[int]) -> None:
        """Mark ``slots`` as settled (their rows filled, or never to be) and add every block
        of settled slots from the last one added to the running moments. A thread that finds
        another adding returns at once: that one adds what is ready when it finishes, and
        :meth:`moments` adds the rest."""
        if self._running is None:
            return
        self._settled[np.fromiter(slots, np.int64)] = True
        while self._adding.acquire(blocking=False):
            try:
                if not self._add_ready(final=False):
                    return
            finally:
                self._adding.release()

    def _add_ready(self, final: bool) -> bool:
        """Add the next block if settled (any settled remainder when ``final``): whether one
        was added."""
        assert self._running is not None
        start, n = self._added, self.matrix.shape[0]
        stop = min(start + self._block, n)
        if start >= n:
            return False
        if not final:
            if stop - start < self._block and stop < n:
                return False
            if not self._settled[start:stop].all():
                return False
        filled = self.filled[start:stop]
        rows = self.matrix[start:stop]
        self._running.add(rows if filled.all() else rows[filled])
        self._added = stop
        return True

    def moments(self) -> TableMoments | None:
        """The filled rows' moments (None unless made with ``moments``): call before
        :meth:`finish` moves the rows, once every batch is folded."""
        if self._running is None:
            return None
        with self._adding:
            while self._add_ready(final=True):
                pass
            if self._running.rows != int(self.filled.sum()):
                raise RuntimeError(
                    f"the running moments hold {self._running.rows} rows of "
                    f"{int(self.filled.sum())} filled: a row was filled after its block was added"
                )
            return self._running.moments()

    def put(self, slot: int, units: Mapping[str, UnitEstimate]) -> UnitView:
        self.layout.fill(self.matrix[slot], units)
        for k, pol in enumerate(self.layout.policies):
            u = units[pol]
            self.stderr[slot, k] = [u.stderr[name] for name in SCALARS]
            self.median_tau[slot, k] = u.median_tau
            self.tail_observed[slot, k] = u.tail_observed
        self.filled[slot] = True
        return UnitView(self, slot)

    def put_batch(self, slots: list[int], units: list[BatchUnits]) -> list[UnitView]:
        """:meth:`put` of several documents of one :class:`UnitBatch` (``units[i]`` into slot
        ``slots[i]``) at once."""
        if not units:
            return []
        batch = units[0].batch
        if any(u.batch is not batch for u in units):
            raise ValueError("put_batch takes the documents of one batch")
        at = np.asarray(slots, np.int64)
        docs = np.array([u.d for u in units], np.int64)
        if at.size and np.all(np.diff(at) == 1):
            # Consecutive slots (a batch of consecutive documents): filled in place.
            self.layout.fill_batch(self.matrix[at[0] : at[-1] + 1], batch, docs)
        else:
            rows = np.empty((len(at), self.layout.width))
            self.layout.fill_batch(rows, batch, docs)
            self.matrix[at] = rows
        P = len(batch.policies)
        for k, pol in enumerate(self.layout.policies):
            u = docs * P + batch.policies.index(pol)
            self.stderr[at, k] = batch.stderr[u]
            self.median_tau[at, k] = batch.median_tau[u]
            self.tail_observed[at, k] = batch.tail_observed
        self.filled[at] = True
        return [UnitView(self, int(slot)) for slot in at]

    def scalar_rows(
        self, slots: list[int] | np.ndarray, policy: str
    ) -> tuple[np.ndarray, np.ndarray]:
        """Policy ``policy``'s scalars (:data:`SCALARS` order) and their standard errors for
        the documents in ``slots``: ``(len(slots), len(SCALARS))`` each, as :meth:`unit`
        gives them one document at a time (views of the table where the slots are
        consecutive, as :meth:`finish` leaves them)."""
        k = self.layout.policies.index(policy)
        at = k * self.layout.per_policy
        picked = np.asarray(slots, np.int64)
        rows: slice | np.ndarray = picked
        if len(picked) and bool((np.diff(picked) == 1).all()):
            rows = slice(int(picked[0]), int(picked[-1]) + 1)
        return self.matrix[rows, at : at + len(SCALARS)], self.stderr[rows, k]

    def unit(self, slot: int, policy: str) -> UnitEstimate:
        k = self.layout.policies.index(policy)
        return self.layout.unit(
            self.matrix[slot],
            k,
            self.stderr[slot, k],
            self.median_tau[slot, k],
            self.tail_observed[slot, k],
        )

    def finish(self, views: list[UnitView]) -> None:
        """Keep the filled slots (``views``, in slot order) as rows ``0..n-1``, moved in place
        (a damaged document leaves its slot empty; no second table is allocated)."""
        for row, view in enumerate(views):
            if view.slot != row:
                for a in (self.matrix, self.stderr, self.median_tau, self.tail_observed):
                    a[row] = a[view.slot]
                view.slot = row
        n = len(views)
        self.matrix = self.matrix[:n]
        self.stderr = self.stderr[:n]
        self.median_tau = self.median_tau[:n]
        self.tail_observed = self.tail_observed[:n]
        self.filled = np.ones(n, bool)

    def table(self, doc_ids: list[str]) -> Table:
        """The bootstrap's table: columns as views of the matrix (no copy)."""
        if len(doc_ids) != self.matrix.shape[0]:
            raise ValueError(f"{len(doc_ids)} documents for {self.matrix.shape[0]} rows")
        names = self.layout.names()
        return Table(doc_ids, {n: self.matrix[:, j] for j, n in enumerate(names)}, self.matrix)


class UnitView(Mapping[str, UnitEstimate]):
    """One document's units (policy -> :class:`UnitEstimate`), read from its row."""

    __slots__ = ("columns", "slot")

    def __init__(self, columns: UnitColumns, slot: int) -> None:
        self.columns = columns
        self.slot = slot

    def __getitem__(self, policy: str) -> UnitEstimate:
        if policy not in self.columns.layout.policies:
            raise KeyError(policy)
        return self.columns.unit(self.slot, policy)

    def __iter__(self) -> Iterator[str]:
        return iter(self.columns.layout.policies)

    def __len__(self) -> int:
        return len(self.columns.layout.policies)

    def __repr__(self) -> str:
        return f"UnitView({dict(self)!r})"


def build_table(
    doc_ids: list[str],
    units: list[Mapping[str, UnitEstimate]],
    policies: list[str],
    horizon: int,
    obs_window: int,
    early_late_split: int | None = None,
) -> Table:
    """One column per (policy, per-document quantity); curves as one column per point.
    Early lags are ``1..s``, late ``s+1..L_w`` with ``s = early_late_split`` (default
    ``L_w // 2``)."""
    lags = len(units[0][policies[0]].tv_lag_num) if units else obs_window + 1
    layout = TableLayout.of(policies, horizon, lags, obs_window, early_late_split)
    mat = np.empty((len(doc_ids), layout.width))
    for row, u in zip(mat, units, strict=True):
        layout.fill(row, u)
    names = layout.names()
    return Table(doc_ids, {n: mat[:, j] for j, n in enumerate(names)}, mat)
