"""Where a stored float may be NaN: only where nothing was recorded.

NaN marks an entry the tracer did not record: the path's metrics and distributions after the
path ended (its ``tokens`` entry is -1), the branches' past the horizon or where there is no
branch (``branch_mismatch`` -1). Anywhere else a NaN is damage, and a range check alone never
sees it (every comparison with NaN is false). :func:`recorded_nan` finds the first NaN of a
block at an entry its mark says was recorded (:data:`~kvcouple.store.schema.UNRECORDED_MARK`);
a variable without a mark (``hazard``) may hold no NaN at all.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import numpy as np

from kvcouple.store.schema import RULES, UNRECORDED_MARK


class _Reads(Protocol):
    def read_doc(self, name: str, doc: int) -> np.ndarray: ...


def recorded_nan(
    reader: _Reads,
    name: str,
    block: np.ndarray,
    origin: tuple[int, ...],
    marks: Mapping[str, np.ndarray] | None = None,
) -> tuple[tuple[int, ...], str, str] | None:
    """The first NaN of ``block`` (at ``origin``, one entry per array axis, the first the
    document) where something was recorded: ``(position in the array, shown value, allowed
    values in words)``; None if there is none. A distribution's NaN counts by whole rows (a
    row partly NaN is refused by the row check). ``marks``: the block's document's mark
    variables where the caller decoded them already (a summary read), else each is read."""
    rule = RULES.get(name)
    if rule not in ("unit", "nonneg", "divergence", "distribution") or block.dtype.kind != "f":
        return None
    with np.errstate(invalid="ignore"):
        nan = np.isnan(block)
        if rule == "distribution":
            nan = nan.all(-1)
    if not nan.any():
        return None
    lead = tuple(int(o) for o in origin[: len(origin) - block.ndim])
    offset = np.array(origin[len(origin) - block.ndim :][: nan.ndim], np.int64)
    full = np.hstack(
        [np.broadcast_to(np.array(lead, np.int64), (int(nan.sum()), len(lead))),
         np.argwhere(nan) + offset]
    )  # fmt: skip
    mark = UNRECORDED_MARK.get(name)
    if mark is None:
        first = tuple(int(i) for i in full[0])
        return first, "nan", "finite (NaN is never written to it)"
    # sorted(set()) rather than np.unique, which imports numpy.ma (35 ms on every command).
    for doc in sorted(set(full[:, 0].tolist())):
        rows = full[full[:, 0] == doc]
        # The given marks are one document's: the block's (its document is its origin's lead).
        known = marks.get(mark) if marks is not None and len(lead) == 1 else None
        marked = known if known is not None else reader.read_doc(mark, int(doc))
        at = marked[tuple(rows[:, 1 : 1 + marked.ndim].T)]
        recorded = at != -1
        if recorded.any():
            first = tuple(int(i) for i in rows[int(np.argmax(recorded))])
            where = "the path ended" if mark == "tokens" else "past the horizon or no branch"
            shown = "a row of NaN" if rule == "distribution" else "nan"
            return first, shown, f"not NaN where {mark} was recorded (NaN only where {where})"
    return None
