"""The scoreboard: the numbers llama.cpp's ``llama-perplexity --kl-divergence`` prints, per
policy, from the overlap path's records.

On the overlap path P and Q read the same prefix at every step (the path is one sequence both
sides are fed), as in llama.cpp's teacher-forced comparison of two models over one text, so
every recorded path step is a step before the first divergence. Per policy:

- ``kl_pq``: KL(P||Q) in nats, its mean over documents (each document's mean over its path
  steps, every replicate) with the standard error across documents, as the rest of kvcouple;
  and the percentiles of the pooled steps (maximum, 99.9%, 99%, median, 10%, 5%, 1%, 0.1%,
  minimum), as llama.cpp lists them;
- ``delta_p``: the change in the probability of P's top token, ``q_t(a) - p_t(a)`` with
  ``a = argmax p_t``, where the record keeps the probabilities (``full``: exactly; ``topk``:
  where that token is among Q's top K), mean +- standard error over documents, RMS and
  percentiles of the pooled steps;
- ``same_top``: the share of steps where P's and Q's top tokens agree (``top1_agree``), mean
  +- standard error over documents.

Each document's values are computed where the document is analysed (:func:`doc_scores`, in
the analysis task: locally or on a Dask worker); :func:`scoreboard_rows` pools them.
docs/quantities.md says how each number relates to llama.cpp's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvcouple.errors import StoreError
from kvcouple.store.reader import TraceStoreReader

__all__ = ["DocScores", "doc_scores", "scoreboard_rows", "scoreboard_table", "STATISTICS"]

# llama-perplexity's rows, in its order: (statistic, percentile or None).
KL_STATISTICS = (
    ("mean", None), ("max", 100.0), ("99.9%", 99.9), ("99%", 99.0), ("median", 50.0),
    ("10%", 10.0), ("5%", 5.0), ("1%", 1.0), ("0.1%", 0.1), ("min", 0.0),
)  # fmt: skip
DP_STATISTICS = (
    ("mean", None), ("max", 100.0), ("99.9%", 99.9), ("99%", 99.0), ("95%", 95.0),
    ("90%", 90.0), ("75%", 75.0), ("median", 50.0), ("25%", 25.0), ("10%", 10.0),
    ("5%", 5.0), ("1%", 1.0), ("0.1%", 0.1), ("min", 0.0), ("rms", None),
)  # fmt: skip
STATISTICS = {"kl_pq": KL_STATISTICS, "delta_p": DP_STATISTICS, "same_top": (("mean", None),)}


@dataclass
class DocScores:
    """One document's path steps under one policy (every replicate): KL(P||Q), whether the top
    tokens agree, and the change in P's top token's probability (None: not recorded)."""

    kl: np.ndarray
    agree: np.ndarray | None
    dp: np.ndarray | None


def _delta_p_full(reader: TraceStoreReader, doc: int, pol: int, seen: np.ndarray) -> np.ndarray:
    """``q(a) - p(a)``, ``a = argmax p``, at every seen step, one replicate's rows at a time."""
    out = []
    for rep in range(seen.shape[0]):
        if not seen[rep].any():
            continue
        p = reader.read("p", (doc, pol, rep)).astype(np.float32)[seen[rep]]
        q = reader.read("q", (doc, pol, rep)).astype(np.float32)[seen[rep]]
        top = p.argmax(axis=-1)
        rows = np.arange(len(top))
        out.append(q[rows, top] - p[rows, top])
    return np.concatenate(out) if out else np.zeros(0, np.float32)


def _delta_p_topk(reader: TraceStoreReader, doc: int, pol: int, seen: np.ndarray) -> np.ndarray:
    """The same from top-K records: P's first entry is its top token; Q's probability of it
    where it is among Q's top K (steps where it is not are left out)."""
    sel = (doc, pol)
    ids_p, probs_p = reader.read("topk_ids_p", sel)[seen], reader.read("topk_probs_p", sel)[seen]
    ids_q, probs_q = reader.read("topk_ids_q", sel)[seen], reader.read("topk_probs_q", sel)[seen]
    top = ids_p[:, 0]
    hit = ids_q == top[:, None]
    found = hit.any(axis=-1)
    q_top = np.where(hit, probs_q, 0).sum(axis=-1)
    return (q_top - probs_p[:, 0])[found]


def doc_scores(
    reader: TraceStoreReader, doc: int, summary: dict[str, np.ndarray]
) -> dict[str, DocScores]:
    """Every policy's :class:`DocScores` of one document, from its summary (``tokens`` and
    ``kl_pq``, read by the analysis task) and the path's ``top1_agree`` (and distributions)."""
    try:
        agree_all = reader.read("top1_agree", (int(doc),))
    except StoreError:
        # Not read by the estimates, so never required: a store re-written by a tool that
        # drops chunks equal to the fill value (all False) has no same_top, and no more.
        agree_all = None
    out = {}
    for i, pol in enumerate(reader.policies):
        kl = summary["kl_pq"][i]
        seen = (summary["tokens"][i] >= 0) & np.isfinite(kl)
        dp = None
        if reader.record == "full":
            dp = _delta_p_full(reader, int(doc), i, seen)
        elif reader.record.startswith("topk"):
            dp = _delta_p_topk(reader, int(doc), i, seen)
        out[pol] = DocScores(
            kl[seen].astype(np.float64),
            None if agree_all is None else agree_all[i][seen].astype(bool),
            None if dp is None else dp.astype(np.float64),
        )
    return out


def _mean_se(values: list[float]) -> tuple[float, float]:
    """Mean over documents and its standard error (sd / sqrt(n); NaN for one document)."""
    if not values:
        return math.nan, math.nan
    x = np.asarray(values, np.float64)
    se = float(x.std(ddof=1) / math.sqrt(len(x))) if len(x) > 1 else math.nan
    return float(x.mean()), se


def _rows(quantity: str, per_doc: list[np.ndarray], transform: Any = None) -> list[dict[str, Any]]:
    """One quantity's rows: the mean over documents (+- se), then the pooled steps'
    percentiles (and the RMS for delta_p)."""
    docs = [v for v in per_doc if v.size]
    pooled = np.concatenate(docs) if docs else np.zeros(0)
    mean, se = _mean_se([float(v.mean()) for v in docs])
    rows = []
    for statistic, pct in STATISTICS[quantity]:
        estimate, error = math.nan, math.nan
        if statistic == "mean":
            estimate, error = mean, se
        elif statistic == "rms" and pooled.size:
            estimate = float(np.sqrt(np.mean(pooled**2)))
        elif pct is not None and pooled.size:
            estimate = float(np.percentile(pooled, pct))
        rows.append(
            {
                "quantity": quantity,
                "statistic": statistic,
                "estimate": estimate,
                "se": error,
                "n_docs": len(docs),
                "steps": int(pooled.size),
            }
        )
    return rows


def scoreboard_rows(model: str, policies: list[str], docs: list[Any]) -> list[dict[str, Any]]:
    """The scoreboard of one store: per policy, ``kl_pq``, ``delta_p`` (where recorded) and
    ``same_top`` rows (``statistic``, ``estimate``, ``se``, ``n_docs``, ``steps``), from the
    documents' :class:`DocScores` (``docs``: the analysis's per-document results)."""
    out = []
    for pol in policies:
        scores = [d.scores[pol] for d in docs if getattr(d, "scores", None)]
        if not scores:
            continue
        parts = _rows("kl_pq", [s.kl for s in scores])
        if all(s.dp is not None for s in scores):
            parts += _rows("delta_p", [s.dp for s in scores])
        if all(s.agree is not None for s in scores):
            parts += _rows(
                "same_top", [s.agree.astype(np.float64) for s in scores if s.agree is not None]
            )
        out += [{"model": model, "policy": pol, **r} for r in parts]
    return out


# How llama-perplexity labels each row (the report's first column).
_LABELS = {"kl_pq": "KLD", "delta_p": "Δp", "same_top": "Same top p"}
_STATISTIC_TITLES = {
    "mean": "Mean",
    "max": "Maximum",
    "min": "Minimum",
    "median": "Median",
    "rms": "RMS",
}


def _cell(row: dict[str, Any]) -> str:
    from kvcouple.analysis.labels import number

    percent = row["quantity"] in ("delta_p", "same_top")
    scale = 100.0 if percent else 1.0
    if not math.isfinite(row["estimate"]):
        return "n/a"
    text = number(row["estimate"] * scale)
    if math.isfinite(row["se"]):
        text += f" ± {number(row['se'] * scale)}"
    return text + (" %" if percent else "")


def scoreboard_table(
    rows: list[dict[str, Any]], labels: dict[str, str]
) -> list[tuple[str, list[str]]]:
    """The scoreboard as llama.cpp lays it out: one line per statistic (``Mean KLD``,
    ``99.9% KLD``, ..., ``Same top p``), one column per policy (``labels``: short labels)."""
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    by = {(r["policy"], r["quantity"], r["statistic"]): r for r in rows}
    lines = []
    for quantity, stats in STATISTICS.items():
        if not any((p, quantity, "mean") in by for p in policies):
            continue
        for statistic, _ in stats:
            name = _LABELS[quantity]
            if quantity == "same_top":
                title = name
            else:
                title = f"{_STATISTIC_TITLES.get(statistic, statistic)} {name}"
            cells = [
                _cell(by[(p, quantity, statistic)]) if (p, quantity, statistic) in by else "n/a"
                for p in policies
            ]
            lines.append((title, cells))
    return lines


def report_section(
    models: list[Any], rows: list[dict[str, Any]], labels: dict[str, str]
) -> list[str]:
    """The report's scoreboard (Markdown, so the HTML page has it too): per store, one line
    per llama-perplexity statistic and one column per policy (``labels``: short labels,
    escaped for Markdown)."""
    from kvcouple.textsafe import markdown_cell, terminal

    lines = []
    for m in models:
        mine = [r for r in rows if r["model"] == m.model]
        if not mine:
            continue
        where = f" ({terminal(m.model)})" if len(models) > 1 else ""
        policies = list(dict.fromkeys(r["policy"] for r in mine))
        n_docs = max(r["n_docs"] for r in mine)
        steps = max(r["steps"] for r in mine if r["quantity"] == "kl_pq")
        lines += [
            f"\n## Scoreboard (as llama-perplexity --kl-divergence prints it){where}\n",
            f"What `llama-perplexity --kl-divergence` prints, per policy, over the {steps} "
            f"steps of the overlap paths of {n_docs} documents (P and Q read the same prefix "
            "there: every step is before the first divergence). Mean: over documents, ± its "
            "standard error across documents; percentiles, maximum, minimum and RMS: of the "
            "pooled steps. Δp: the change in the probability of P's top token (where the record "
            "keeps probabilities); Δp and Same top p in percent. docs/quantities.md says how "
            "each differs from llama.cpp's.\n",
            "| statistic | " + " | ".join(labels.get(p, markdown_cell(p)) for p in policies) + " |",
            "|---|" + "---|" * len(policies),
        ]
        for title, cells in scoreboard_table(mine, labels):
            lines.append(f"| {title} | " + " | ".join(cells) + " |")
    return lines
