"""What a step records, on the device: path metrics, distributions, branch records; and
:class:`HostRecords`, which brings the big ones to the host without stalling the device."""

from __future__ import annotations

from collections.abc import Iterable, MutableMapping

import numpy as np
import torch

from kvcouple.store.schema import NO_TOKEN, Record, distribution_variables, variables

SCHEMA = variables(Record())
# The path's per-row metrics, as the store names them.
PATH_METRICS = ("kl_pq", "kl_qp", "entropy_p", "entropy_q", "top1_agree")


def row_metrics(probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Entropy (nats), KL to the row's partner and argmax of every row of ``probs`` ``(2B,
    vocab)`` (``B`` P rows then their ``B`` Q partners), on the device, both sides at once.

    ``kl[i]`` is ``KL(p_i || q_i)`` for a P row and ``KL(q_i || p_i)`` for a Q row, from two
    vocabulary-wide terms: ``H = sum entr(row)`` and the cross term ``sum xlogy(row,
    partner)`` (both 0 where the row is 0, so the sums run over its support): ``KL = -H -
    cross`` (``inf`` where the partner is 0 and the row is not; exactly 0 where they are
    equal). Top-1 agreement is ``argmax p_i == argmax q_i`` (first maximum, as the Rust
    kernel), compared on the host."""
    partner = probs.roll(probs.shape[0] // 2, 0)  # Q rows then P rows
    entropy = torch.special.entr(probs).sum(-1)
    kl = -(entropy + torch.special.xlogy(probs, partner).sum(-1))
    return entropy, kl, probs.argmax(-1)


def top_k(record: Record, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``record.k`` largest probabilities of every row, their ids and the tail mass ``1 -
    sum`` (float64, clamped at 0); padded with the fills where the vocabulary is smaller."""
    k = min(record.k, probs.shape[-1])
    vals, ids = torch.topk(probs, k, dim=-1)
    pad = record.k - k
    if pad:
        fills = distribution_variables(record)
        ids = torch.nn.functional.pad(ids, (0, pad), value=fills["topk_ids_p"].fill)
        vals = torch.nn.functional.pad(vals, (0, pad), value=fills["topk_probs_p"].fill)
    tail = (1.0 - vals.nan_to_num(0.0).sum(-1)).clamp(min=0.0)
    return ids, vals, tail


def _halves(values: np.ndarray, pairs: int) -> tuple[np.ndarray, np.ndarray]:
    """The P rows' and the Q rows' values of ``(steps, 2B, ...)`` host values, as ``(B,
    steps, ...)`` views."""
    rows = values.swapaxes(0, 1)
    return rows[:pairs], rows[pairs:]


class PathRecords:
    """The overlap path's per-step records, written into device buffers preallocated for every
    step (issue 21: nothing a step records allocates or grows with the step; one host copy
    of each buffer at the end).

    A step of ``B`` row pairs writes each buffer's row ``t`` (views made once) in one op:

    - ``floats``: float64 ``[entropy (2B) | kl (2B) | tv (B) | overlap (B) | tail mass
      (2B, top-k records)]``;
    - ``ints``: int64 ``[draw (B) | argmax (2B)]``;
    - top-k ids (int32) and probabilities (float32), ``(2B, k)``: the casts are the copies'.

    Whole distributions (``record="full"``) go to pinned host slots as they are made
    (:class:`HostRecords`). :meth:`arrays` names the values as the store does (``(B,
    steps, ...)``), with the raw ``tv``, ``has_overlap`` and ``draw`` the engine turns into
    the hazard and the path's tokens.
    """

    def __init__(self, record: Record, steps: int, pairs: int, device: torch.device | str):
        self.record, self.steps, self.pairs = record, steps, pairs
        topk = record.kind == "topk"
        width = (8 if topk else 6) * pairs
        self.floats = torch.empty(steps, width, dtype=torch.float64, device=device)
        self.ints = torch.empty(steps, 3 * pairs, dtype=torch.long, device=device)
        self._floats, self._ints = self.floats.unbind(0), self.ints.unbind(0)
        self.ids = self.probs = None
        if topk:
            shape = (steps, 2 * pairs, record.k)
            self.ids = torch.empty(shape, dtype=torch.int32, device=device)
            self.probs = torch.empty(shape, dtype=torch.float32, device=device)
            self._ids, self._probs = self.ids.unbind(0), self.probs.unbind(0)
        self.staged = HostRecords(
            ["full"] if record.kind == "full" else [], steps * 2 * pairs, device
        )

    def write(
        self,
        t: int,
        probs: torch.Tensor,
        draw: torch.Tensor,
        tv: torch.Tensor,
        overlap: torch.Tensor,
    ) -> None:
        """Step ``t``'s records of ``probs`` ``(2B, vocab)``, the overlap ``draw``, ``tv`` and
        ``overlap`` ``(B,)``."""
        entropy, kl, top = row_metrics(probs)
        floats = [entropy, kl, tv, overlap]
        if self.record.kind == "topk":
            ids, vals, tail = top_k(self.record, probs)
            self._ids[t].copy_(ids)
            self._probs[t].copy_(vals)
            floats.append(tail)
        elif self.record.kind == "full":
            self.staged.take({"full": probs.to(torch.float16)})
        torch.cat(floats, out=self._floats[t])
        torch.cat([draw, top], out=self._ints[t])

    def fed(self, first: torch.Tensor) -> torch.Tensor:
        """``(B, steps)`` on the device: the token each step fed (``first``, then the draws)."""
        return torch.cat([first[None], self.ints[: self.steps - 1, : self.pairs]]).T

    def arrays(self) -> dict[str, np.ndarray]:
        """Every record by its name, ``(B, steps, ...)``, on the host (one copy per buffer)."""
        B = self.pairs
        floats, ints = self.floats.cpu().numpy(), self.ints.cpu().numpy()
        out = {
            "tv": floats[:, 4 * B : 5 * B].T,
            "has_overlap": floats[:, 5 * B : 6 * B].T > 0,
            "draw": ints[:, :B].T,
            "top1_agree": (ints[:, B : 2 * B] == ints[:, 2 * B :]).T,
        }
        out["entropy_p"], out["entropy_q"] = _halves(floats[:, : 2 * B], B)
        out["kl_pq"], out["kl_qp"] = _halves(floats[:, 2 * B : 4 * B], B)
        if self.ids is not None and self.probs is not None:
            out["topk_ids_p"], out["topk_ids_q"] = _halves(self.ids.cpu().numpy(), B)
            out["topk_probs_p"], out["topk_probs_q"] = _halves(self.probs.cpu().numpy(), B)
            out["tail_mass_p"], out["tail_mass_q"] = _halves(floats[:, 6 * B :], B)
        if self.staged.names:
            full = self.staged.arrays()["full"].reshape(self.steps, 2 * B, -1)
            out["p"], out["q"] = _halves(full, B)
        return out


def branch_values(
    record: Record, step_probs: torch.Tensor, x: torch.Tensor, y: torch.Tensor, tv: torch.Tensor
) -> dict[str, torch.Tensor]:
    """What one branch step records, by store name, ``(B, ...)`` in the device's dtypes (cast
    on the host): TV, both tokens and the distributions; the mismatch ``1{X != Y}`` is the
    tokens' (:meth:`LagRecords.arrays`)."""
    B = x.shape[0]
    rec = {"branch_tv": tv, "branch_tokens_p": x, "branch_tokens_q": y}
    if record.kind == "topk":
        ids, vals, tail = top_k(record, step_probs)
        for name, value in (("topk_ids", ids), ("topk_probs", vals), ("tail_mass", tail)):
            rec[f"branch_{name}_p"], rec[f"branch_{name}_q"] = value[:B], value[B:]
    elif record.kind == "full":
        half = step_probs.to(torch.float16)
        rec["branch_p"], rec["branch_q"] = half[:B], half[B:]
    return rec


class LagRecords:
    """A branch batch's records, written into device buffers ``(B, lags + 2, ...)``
    preallocated from the store's fills: each step writes every row at its own lag (a
    device-side write index), one op per variable; rows not recording at a step write the
    spare last column, which is never read (no masked read-modify-write per variable).

    Parameters
    ----------
    fills : dict of str to numpy.ndarray
        Each variable's ``(B, lags + 1, ...)`` slice of the store's arrays (its fills).
    device : torch.device
        Where the records are made.
    """

    def __init__(self, fills: dict[str, np.ndarray], device: torch.device | str):
        self.fills = fills
        self.device = torch.device(device)
        self.buffers: dict[str, torch.Tensor] = {}
        rows = next(iter(fills.values())).shape[0] if fills else 0
        self._rows = torch.arange(rows, device=self.device)

    def write(self, values: dict[str, torch.Tensor], lag: torch.Tensor) -> None:
        """Row ``i`` of each value at lag ``lag[i]`` (the spare column: not recorded)."""
        for name, value in values.items():
            buffer = self.buffers.get(name)
            if buffer is None:  # the value's dtype: the store's is cast to on the host
                fill = torch.from_numpy(np.ascontiguousarray(self.fills[name]))
                spare = torch.nn.functional.pad(fill.to(value.dtype), _spare_pad(fill.dim()))
                buffer = self.buffers[name] = spare.to(self.device)
            buffer.index_put_((self._rows, lag), value)

    def arrays(self) -> dict[str, np.ndarray]:
        """``(B, lags + 1, ...)`` host arrays in the store's dtypes, and the mismatch."""
        out = {
            name: b[:, :-1].cpu().numpy().astype(self.fills[name].dtype)
            for name, b in self.buffers.items()
        }
        if "branch_tokens_p" in out and "branch_mismatch" in self.fills:
            p, q = out["branch_tokens_p"], out["branch_tokens_q"]
            fill = self.fills["branch_mismatch"]
            out["branch_mismatch"] = np.where(p == NO_TOKEN, fill, p != q).astype(fill.dtype)
        return out


def _spare_pad(dims: int) -> tuple[int, ...]:
    """``pad`` widths adding one column on axis 1 of a ``dims``-d tensor."""
    return (0, 0) * (dims - 2) + (0, 1)


def staged_names(record: Record, prefix: str = "") -> list[str]:
    """The variables :class:`HostRecords` stages: whole distributions (``record="full"``).

    Small records (summary, top-k) stay on the device until one copy at the end: a step's
    top-k is a few numbers per row, and a masked update on the device is one kernel, while
    a whole distribution per row and step would hold ``T`` (or ``L + 1``) vocabulary-sized
    rows on the device and cost a host round trip each step.
    """
    return list(distribution_variables(record, prefix)) if record.kind == "full" else []


class HostRecords:
    """Host buffers that device records are copied into as they are made, read after one
    synchronisation (issue 12: the device never waits for the store).

    Each variable gets one host buffer of ``slots`` rows, allocated at its first record (its
    row shape and dtype are the record's): pinned on CUDA, so ``copy_(non_blocking=True)``
    returns at once and the copy runs on the current stream after the kernels that made the
    record; plain memory on CPU (pinning needs CUDA), where the copies are plain copies.
    :meth:`take` fills the next slots; :meth:`arrays` waits once for every copy.

    Parameters
    ----------
    names : iterable of str
        The variables staged (others are left alone).
    slots : int
        Rows each buffer holds: every row recorded into it, in order.
    device : torch.device
        Where the records are made.
    """

    def __init__(self, names: Iterable[str], slots: int, device: torch.device | str):
        self.names = list(names)
        self.slots = slots
        self.device = torch.device(device)
        self.buffers: dict[str, torch.Tensor] = {}
        self.filled = 0

    def take(
        self, values: MutableMapping[str, torch.Tensor], rows: torch.Tensor | None = None
    ) -> None:
        """Move this object's variables out of ``values`` (rows ``rows`` of each, if given)
        into the next free slots."""
        count = 0
        for name in self.names:
            value = values.pop(name)
            if rows is not None:
                value = value.index_select(0, rows)
            count = int(value.shape[0])
            buffer = self.buffers.get(name)
            if buffer is None:
                buffer = self.buffers[name] = torch.empty(
                    (self.slots, *value.shape[1:]),
                    dtype=value.dtype,
                    pin_memory=self.device.type == "cuda",
                )
            if self.filled + count > self.slots:
                raise ValueError(f"{name}: more than {self.slots} rows recorded")
            buffer[self.filled : self.filled + count].copy_(value, non_blocking=True)
        self.filled += count

    def arrays(self) -> dict[str, np.ndarray]:
        """The filled slots of each buffer ``(filled, ...)``, once every copy has landed."""
        if self.buffers and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return {name: b[: self.filled].numpy() for name, b in self.buffers.items()}

    def by_step(self, steps: int) -> dict[str, np.ndarray]:
        """Buffers filled ``rows`` at a time for ``steps`` steps, as ``(rows, steps, ...)``
        arrays (views of the host buffers)."""
        return {
            name: a.reshape(steps, -1, *a.shape[1:]).swapaxes(0, 1)
            for name, a in self.arrays().items()
        }

    def scatter(self, out: MutableMapping[str, np.ndarray], index: tuple[np.ndarray, ...]) -> None:
        """Write slot ``j`` of each buffer to ``out[name][index[0][j], index[1][j], ...]``;
        whatever no slot names keeps its value (the fill)."""
        for name, a in self.arrays().items():
            out[name][index] = a
