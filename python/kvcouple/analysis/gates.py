"""Results split by a gated policy's class (``page``: capacity-bound vs dilution-prone).

A gated policy records per document its class (``gate_class``: 1 capacity-bound, kept whole;
0 dilution-prone, evicted; -1 no gate) and score. :func:`split_by_gate_class` groups the
per-document estimates of an analysis by (policy, class) and averages them, so a gate can be
judged on each side of its threshold.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvcouple.analysis.estimates import SCALARS
from kvcouple.analysis.results import AnalysisResult
from kvcouple.store.schema import CAPACITY_BOUND, DILUTION_PRONE, NO_GATE

GATE_CLASSES = {
    NO_GATE: "ungated",
    DILUTION_PRONE: "dilution-prone",
    CAPACITY_BOUND: "capacity-bound",
}


def split_by_gate_class(result: AnalysisResult) -> list[dict[str, Any]]:
    """One row per (model, policy, gate class) present: the documents in the class, the mean
    gate score, the share with eviction applied, and the mean of each per-document estimate
    (``occurrence``, ``expected_mismatches``, ...)."""
    rows = []
    for model in result.models:
        reader = model.open_reader()
        docs = [d for d in model.docs if d.units is not None]
        gate = {d.doc: reader.read_doc("gate_class", d.doc) for d in docs}
        score = {d.doc: reader.read_doc("gate_score", d.doc) for d in docs}
        applied = {d.doc: reader.read_doc("eviction_applied", d.doc) for d in docs}
        for p, policy in enumerate(model.policies):
            for code, label in GATE_CLASSES.items():
                members = [d for d in docs if int(gate[d.doc][p]) == code]
                if not members:
                    continue
                row: dict[str, Any] = {
                    "model": model.model,
                    "policy": policy,
                    "gate_class": label,
                    "documents": len(members),
                    "gate_score": float(np.mean([score[d.doc][p] for d in members])),
                    "eviction_applied": float(np.mean([applied[d.doc][p] for d in members])),
                }
                for name in SCALARS:
                    values = [d.units[policy].values[name] for d in members if d.units]
                    row[name] = float(np.mean(values))
                rows.append(row)
    return rows
