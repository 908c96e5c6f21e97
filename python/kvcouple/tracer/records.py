"""What a step records, on the device: path metrics, distributions, branch records; and
:class:`HostRecords`, which brings the big ones to the host without stalling the device."""

from __future__ import annotations

from collections.abc import Iterable, MutableMapping

import numpy as np
import torch

from kvcouple.store.schema import Record, distribution_variables, variables

SCHEMA = variables(Record())
# What path_metrics returns, per row.
PATH_METRICS = ("kl_pq", "kl_qp", "entropy_p", "entropy_q", "top1_agree")


def path_metrics(p: torch.Tensor, q: torch.Tensor) -> dict[str, torch.Tensor]:
    """KL both ways, entropies (nats) and top-1 agreement per row, on the device.

    In four vocabulary-wide terms: ``H(p) = sum entr(p)`` and the cross term ``sum xlogy(p,
    q)`` (both 0 where ``p = 0``, as the sums run over the support), ``KL(p||q) = -H(p) -
    sum xlogy(p, q)`` (``inf`` where ``q = 0 < p``; exactly 0 where ``p = q``)."""
    entropy_p = torch.special.entr(p).sum(-1)
    entropy_q = torch.special.entr(q).sum(-1)
    return {
        "kl_pq": -(entropy_p + torch.special.xlogy(p, q).sum(-1)),
        "kl_qp": -(entropy_q + torch.special.xlogy(q, p).sum(-1)),
        "entropy_p": entropy_p,
        "entropy_q": entropy_q,
        "top1_agree": p.argmax(-1) == q.argmax(-1),
    }


def distribution_records(
    record: Record, side: str, probs: torch.Tensor, prefix: str
) -> dict[str, torch.Tensor]:
    """Top-k ids/probs/tail mass, or the whole distribution (float16), for one side; on the
    device (:class:`HostRecords` brings whole distributions to the host)."""
    if record.kind == "topk":
        k = min(record.k, probs.shape[-1])
        vals, ids = torch.topk(probs, k, dim=-1)
        pad = record.k - k
        if pad:
            fills = distribution_variables(record)
            ids = torch.nn.functional.pad(ids, (0, pad), value=fills["topk_ids_p"].fill)
            vals = torch.nn.functional.pad(vals, (0, pad), value=fills["topk_probs_p"].fill)
        return {
            f"{prefix}topk_ids_{side}": ids.to(torch.int32),
            f"{prefix}topk_probs_{side}": vals.to(torch.float32),
            f"{prefix}tail_mass_{side}": (1.0 - vals.nan_to_num(0.0).sum(-1)).clamp(min=0.0),
        }
    if record.kind == "full":
        return {f"{prefix}{side}": probs.to(torch.float16)}
    return {}


def branch_record(
    record: Record,
    p: torch.Tensor,
    q: torch.Tensor,
    x: torch.Tensor,
    y: torch.Tensor,
    tv: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """What one branch step records: TV, mismatch, both tokens, and the distributions."""
    rec = {
        "branch_tv": tv,
        "branch_mismatch": (x != y).to(torch.int8),
        "branch_tokens_p": x,
        "branch_tokens_q": y,
    }
    for side, probs_side in (("p", p), ("q", q)):
        rec.update(distribution_records(record, side, probs_side, "branch_"))
    return rec


def to_host(steps: list[dict[str, torch.Tensor]], axis: int) -> dict[str, np.ndarray]:
    """Stack per-step device records along ``axis`` and bring them to the host at once."""
    if not steps:
        return {}
    return {
        name: torch.stack([s[name] for s in steps], dim=axis).cpu().numpy() for name in steps[0]
    }


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
