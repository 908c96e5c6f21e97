"""The decomposition as a terminal table: what ``kvcouple analyze`` and ``kvcouple demo`` print.

Per model: the policies with their full specs (once), then one row per quantity of
``E[M]/T = P(tau<=T)/T + exposure x rho`` and one column per policy (short labels), each cell
the mean over documents with its bootstrap CI, numbers to three significant figures
(:func:`kvcouple.analysis.labels.number`). When branches were traced only to L < T - 1 lags
the tail is unobserved: rho is then "unobserved" and ``E[M]/T`` is given as its sharp
interval, with a note saying so. A policy that never diverges has no rho (nothing to measure
after a divergence): "undefined", with a note naming the policy.
"""

from __future__ import annotations

import math
from typing import Any

from kvcouple.analysis.labels import number, policy_labels
from kvcouple.analysis.quantities import labelled
from kvcouple.analysis.results import AnalysisResult, ModelResult
from kvcouple.analysis.stats import NEVER_DIVERGES
from kvcouple.textsafe import terminal

# (quantity in summary.csv, row label); the order reads as the decomposition.
DECOMPOSITION_ROWS = labelled(
    "occurrence", "first_mismatch", "exposure", "rho", "mismatch_fraction"
)


UNOBSERVED = "unobserved"
UNDEFINED = "undefined"


def _cell(row: dict[str, Any] | None) -> str:
    if row is None or not math.isfinite(row["estimate"]):
        return UNDEFINED if row and row.get("note", "").startswith(UNDEFINED) else UNOBSERVED
    return f"{number(row['estimate'])} [{number(row['ci_low'])}, {number(row['ci_high'])}]"


def _interval_cell(lo: dict[str, Any], hi: dict[str, Any]) -> str:
    return f"in [{number(lo['estimate'])}, {number(hi['estimate'])}]"


def run_stamp(result: AnalysisResult) -> str:
    """What kind of analysis this was, in words: ``exploratory (no plan)``, or the plan's
    name and hash with its preregistration status."""
    if result.plan_hash == "none":
        return "exploratory (no plan)"
    name = f"plan {terminal(result.plan_name)} " if result.plan_name else "plan "
    return f"{name}(hash {result.plan_hash}); {terminal(result.preregistration)}"


def policy_legend(policies: list[str], labels: dict[str, str]) -> list[str]:
    """Every policy once with its full spec, ``label = spec`` (the label used afterwards)."""
    width = max(len(labels[p]) for p in policies)
    return [f"  {labels[p].ljust(width)} = {terminal(p)}" for p in policies]


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
    interval = False
    for quantity, title in DECOMPOSITION_ROWS:
        line = [title]
        for pol in m.policies:
            r = rows.get((pol, quantity))
            if quantity == "mismatch_fraction" and (r is None or not math.isfinite(r["estimate"])):
                interval = True
                line.append(
                    _interval_cell(
                        rows[(pol, "interval_lower_fraction")],
                        rows[(pol, "interval_upper_fraction")],
                    )
                )
            else:
                line.append(_cell(r))
        cells.append(line)
    head = [""] + [labels[p] for p in m.policies]
    widths = [max(len(r[i]) for r in [head, *cells]) for i in range(len(head))]

    def fmt(r: list[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()

    out = [
        f"{terminal(m.model)}: {n_docs} documents; T = {m.horizon} tokens generated per "
        "trajectory,",
        f"  L = {m.window} lags traced after each first divergence (its branches)",
        "policies (short label = full spec):",
        *policy_legend(m.policies, labels),
        f"mean over documents [{100 * level:.0f}% document-bootstrap CI]:",
        fmt(head),
        *map(fmt, cells),
    ]
    never = [labels[p] for p in m.policies if rows[(p, "rho")].get("note") == NEVER_DIVERGES]
    if never:
        out.append(
            f"  {UNDEFINED}: {', '.join(never)} never diverged in any document (occurrence 0), "
            "so there are no mismatches after a divergence to rate: rho is undefined."
        )
    if interval or any(UNOBSERVED in c for line in cells for c in line):
        out.append(
            f"  {UNOBSERVED}: branches were traced for L = {m.window} of T = {m.horizon} steps, "
            "so the mismatches after lag L are not seen and rho is unknown; E[M]/T is given as "
            "'in [lower, upper]', the sharp interval of values compatible with what was seen. "
            "Trace with --window >= --horizon to observe both."
        )
    return "\n".join(out) + "\n"


def format_decomposition(result: AnalysisResult) -> str:
    """Every model's decomposition table (see :func:`format_model`)."""
    level = float(result.settings.get("ci", 0.95))
    return "\n".join(format_model(m, level) for m in result.models)
