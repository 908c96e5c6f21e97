"""The decomposition as a terminal table: what ``kvcouple analyze`` and ``kvcouple demo`` print.

Per model, one row per quantity of ``E[M]/T = P(tau<=T)/T + exposure x rho`` and one column
per policy (short labels; full specs underneath), each cell the mean over documents with its
bootstrap CI. When branches were traced only to L < T the tail is unobserved: ``E[M]/T`` is
then given as its sharp interval.
"""

from __future__ import annotations

import math
from typing import Any

from kvcouple.analysis.engine import AnalysisResult, ModelResult
from kvcouple.analysis.labels import policy_labels
from kvcouple.textsafe import terminal

# (quantity in summary.csv, row label); the order reads as the decomposition.
DECOMPOSITION_ROWS = (
    ("occurrence", "occurrence P(tau<=T)"),
    ("first_mismatch", "first mismatch P(tau<=T)/T"),
    ("exposure", "exposure E[(T-tau)+]/T"),
    ("rho", "mismatch rate rho"),
    ("mismatch_fraction", "E[M]/T"),
)


def _cell(row: dict[str, Any] | None) -> str:
    if row is None or not math.isfinite(row["estimate"]):
        return "unobserved"
    return f"{row['estimate']:.4f} [{row['ci_low']:.4f}, {row['ci_high']:.4f}]"


def _interval_cell(lo: dict[str, Any], hi: dict[str, Any]) -> str:
    return f"in [{lo['estimate']:.4f}, {hi['estimate']:.4f}]"


def format_model(m: ModelResult, level: float) -> str:
    """One model's decomposition table.

    Parameters
    ----------
    m : ModelResult
        One store's analysis (``result.models[i]``).
    level : float
        The CI level the bootstrap used (for the header), e.g. 0.95.

    Returns
    -------
    str
        Lines of text, ending with a newline.
    """
    rows = {(r["policy"], r["quantity"]): r for r in m.tables["summary"]}
    # Names come from the store: control characters escaped.
    labels = {p: terminal(lab) for p, lab in policy_labels(m.policies).items()}
    n_docs = next((r["n_docs"] for r in m.tables["summary"]), len(m.docs))
    cells = []
    for quantity, title in DECOMPOSITION_ROWS:
        line = [title]
        for pol in m.policies:
            r = rows.get((pol, quantity))
            if quantity == "mismatch_fraction" and (r is None or not math.isfinite(r["estimate"])):
                line.append(
                    _interval_cell(rows[(pol, "interval_lower")], rows[(pol, "interval_upper")])
                )
            else:
                line.append(_cell(r))
        cells.append(line)
    head = [""] + [labels[p] for p in m.policies]
    widths = [max(len(r[i]) for r in [head, *cells]) for i in range(len(head))]

    def fmt(r: list[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()

    out = [
        f"{terminal(m.model)}: {n_docs} documents, T={m.horizon}, L={m.window}; mean over documents "
        f"[{100 * level:.0f}% document-bootstrap CI]",
        fmt(head),
        *map(fmt, cells),
    ]
    if m.window < m.horizon:
        out.append(
            "  (branches traced to L < T: the tail after L is unobserved, so E[M]/T is given "
            "as its sharp interval)"
        )
    full = [f"  {labels[p]} = {terminal(p)}" for p in m.policies if labels[p] != terminal(p)]
    if full:
        out += ["policies:", *full]
    return "\n".join(out) + "\n"


def format_decomposition(result: AnalysisResult) -> str:
    """Every model's decomposition table (see :func:`format_model`)."""
    level = float(result.settings.get("ci", 0.95))
    return "\n".join(format_model(m, level) for m in result.models)
