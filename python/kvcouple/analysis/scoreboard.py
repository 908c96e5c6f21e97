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
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvcouple import _core
from kvcouple.analysis.distributions import linear_between
from kvcouple.errors import StoreError
from kvcouple.store.reader import TraceStoreReader

__all__ = [
    "BatchScores",
    "DocScores",
    "PooledSteps",
    "ScoreBatch",
    "ScoreboardPool",
    "STATISTICS",
    "doc_scores",
    "scoreboard_rows",
    "scoreboard_table",
]

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


# The summary key under which the analysis task passes the path's top-token deltas that the
# fused recomputation of a full record computed (policy index -> (replicates, steps)).
TOP_DELTA = "path_top_delta"


def _delta_p_full(reader: TraceStoreReader, doc: int, pol: int, seen: np.ndarray) -> np.ndarray:
    """``q(a) - p(a)``, ``a = argmax p``, at every seen step, one replicate's rows at a time
    (where the engine did not give them with the recomputation: a second read)."""
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
    reader: TraceStoreReader, doc: int, summary: Mapping[str, Any]
) -> dict[str, DocScores]:
    """Every policy's :class:`DocScores` of one document, from its summary (``tokens`` and
    ``kl_pq``, read by the analysis task) and the path's ``top1_agree`` (and distributions)."""
    agree_all = summary.get("top1_agree")  # read with the batch's summaries, where it could be
    if agree_all is None:
        try:
            agree_all = reader.read("top1_agree", (int(doc),))
        except StoreError:
            # Not read by the estimates, so never required: a store re-written by a tool that
            # drops chunks equal to the fill value (all False) has no same_top, and no more.
            agree_all = None
    decoded = summary.get(TOP_DELTA)
    out = {}
    for i, pol in enumerate(reader.policies):
        kl = summary["kl_pq"][i]
        seen = (summary["tokens"][i] >= 0) & np.isfinite(kl)
        dp = None
        if reader.record == "full" and decoded is not None and i in decoded:
            dp = decoded[i][seen].astype(np.float32)
        elif reader.record == "full":
            dp = _delta_p_full(reader, int(doc), i, seen)
        elif reader.record.startswith("topk"):
            dp = _delta_p_topk(reader, int(doc), i, seen)
        out[pol] = DocScores(
            kl[seen].astype(np.float64),
            None if agree_all is None else agree_all[i][seen].astype(bool),
            None if dp is None else dp.astype(np.float64),
        )
    return out


class ScoreBatch:
    """A batch of documents' path steps from their stacked summaries (``tokens``, ``kl_pq``
    and ``top1_agree``, documents along the first axis) of a record without distributions
    (no Δp): per policy, every document's steps in batch order and each document's count. The
    values are :func:`doc_scores`' of each document, without a per-document pass."""

    def __init__(self, policies: list[str], stacks: Mapping[str, np.ndarray]) -> None:
        agree = stacks.get("top1_agree")
        kl = stacks["kl_pq"]
        # One pass in Rust: a step counts where its token was generated and its KL is finite
        # (float32 as stored read as it is; the sums are of its doubles either way).
        got = _core.path_steps(
            np.ascontiguousarray(kl, kl.dtype if kl.dtype == np.float32 else np.float64),
            np.ascontiguousarray(stacks["tokens"], np.int32),
            None if agree is None else np.ascontiguousarray(agree, np.bool_),
        )
        self.policies = list(policies)
        self.docs = int(got["sizes"].shape[0])
        self.sizes = got["sizes"]  # (docs, policies)
        self.offsets = np.cumsum(self.sizes, axis=0) - self.sizes
        # Per policy, document after document, as float32 (the pooled percentiles' precision;
        # the means are of the sums, made from the values as stored).
        self.kl: list[np.ndarray] = got["values"]
        self.agree: list[np.ndarray] | None = got["flags"]
        # Each unit's sums (the pools' per-document numbers, as segment_sums makes them).
        self.sums, self.squares, self.flagged = got["sums"], got["squares"], got["flagged"]

    def doc(self, d: int, policy: str) -> DocScores:
        """Document ``d``'s :class:`DocScores` under ``policy`` (views of the batch's steps)."""
        i = self.policies.index(policy)
        at = slice(int(self.offsets[d, i]), int(self.offsets[d, i] + self.sizes[d, i]))
        agree = None if self.agree is None else self.agree[i][at]
        return DocScores(self.kl[i][at], agree, None)


class BatchScores(Mapping[str, DocScores]):
    """Document ``d`` of a :class:`ScoreBatch` (policy -> :class:`DocScores`)."""

    __slots__ = ("batch", "d")

    def __init__(self, batch: ScoreBatch, d: int) -> None:
        self.batch = batch
        self.d = d

    def __getitem__(self, policy: str) -> DocScores:
        if policy not in self.batch.policies:
            raise KeyError(policy)
        return self.batch.doc(self.d, policy)

    def __iter__(self) -> Iterator[str]:
        return iter(self.batch.policies)

    def __len__(self) -> int:
        return len(self.batch.policies)


# The pooled steps of one (policy, quantity) are kept exactly up to this many; beyond, as a
# histogram of their float32 bit patterns in 2**HISTOGRAM_BITS bins (each bin's values agree
# to a relative 2**-12), so a pool of any size costs at most 16 MB and its percentiles are
# exact to that resolution (the rows' ``relative_error``). Maximum and minimum stay exact.
EXACT_STEPS = 1 << 22
HISTOGRAM_BITS = 21
COUNT_BLOCK = 1 << 20  # values counted per pass over the bins
HISTOGRAM_RESOLUTION = 2.0 ** -(HISTOGRAM_BITS - 9)  # bits left for the mantissa: 12
_SMALLEST_NORMAL = float(np.finfo(np.float32).tiny)


def _key_value(key: int) -> float:
    bits = key & 0x7FFFFFFF if key >> 31 else ~key & 0xFFFFFFFF
    return float(np.array([bits], np.uint32).view(np.float32)[0])


class PooledSteps:
    """Every step's value of one quantity over the documents, for the pooled percentiles."""

    def __init__(self) -> None:
        self.parts: list[np.ndarray] = []
        self.size = 0
        self.low, self.high = math.inf, -math.inf
        self.counts: np.ndarray | None = None
        self.pending: list[np.ndarray] = []  # histogram mode: counted in blocks (_flush)
        self.pending_size = 0
        self._cumulative: np.ndarray | None = None

    @property
    def exact(self) -> bool:
        return self.counts is None

    def add(self, values: np.ndarray) -> None:
        v = np.asarray(values, np.float32)
        if not v.size:
            return
        self.size += v.size
        self.low, self.high = min(self.low, float(v.min())), max(self.high, float(v.max()))
        self._cumulative = None
        if self.counts is not None:
            self.pending.append(v)
            self.pending_size += v.size
            if self.pending_size >= COUNT_BLOCK:
                self._flush()
            return
        self.parts.append(v)
        if self.size > EXACT_STEPS:
            self.counts = np.zeros(1 << HISTOGRAM_BITS, np.int64)
            self.pending, self.pending_size, self.parts = self.parts, self.size, []
            self._flush()

    def _flush(self) -> None:
        """Count the pending values (a block at a time: one pass over the bins per block)."""
        if self.counts is None or not self.pending:
            return
        for part in self.pending:  # Rust: the bins of the values' bit patterns, in place
            _core.count_float_keys(
                np.ascontiguousarray(part, np.float32), self.counts, HISTOGRAM_BITS
            )
        self.pending, self.pending_size = [], 0

    def percentile(self, pct: float) -> float:
        """``numpy.percentile`` (linear) of the pooled values; from the histogram, each order
        statistic is its bin's middle, within the bin and the values' range."""
        if not self.size:
            return math.nan
        if pct >= 100.0:
            return self.high
        if pct <= 0.0:
            return self.low
        pos = pct / 100.0 * (self.size - 1)
        lo = math.floor(pos)
        a, b = self._order(lo), self._order(min(lo + 1, self.size - 1))
        if self.counts is None:  # numpy.percentile's linear interpolation, to the bit
            return linear_between(a, b, pos - lo)
        if a == b:  # also two infinities, which interpolation turns into NaN
            return a
        return a + (pos - lo) * (b - a)

    def _sorted(self) -> np.ndarray:
        if len(self.parts) != 1 or self.parts[0].dtype != np.float64:
            self.parts = [np.sort(np.concatenate(self.parts).astype(np.float64))]
        return self.parts[0]

    def _order(self, i: int) -> float:
        """The ``i``-th smallest value (0-based), to the histogram's resolution."""
        if self.counts is None:
            return float(self._sorted()[i])
        if self._cumulative is None:
            self._flush()
            assert self.counts is not None
            self._cumulative = np.cumsum(self.counts)
        b = int(np.searchsorted(self._cumulative, i, side="right"))
        shift = 32 - HISTOGRAM_BITS
        value = _key_value((b << shift) | (1 << (shift - 1)))
        if not math.isfinite(value):  # the bin of inf: its middle is a NaN pattern
            value = _key_value(b << shift) if b < (1 << HISTOGRAM_BITS) - 1 else self.high
        elif abs(value) < _SMALLEST_NORMAL:  # the bins of 0 (and subnormals): 0, not 1e-42
            value = 0.0
        return min(max(value, self.low), self.high)


class _Pool:
    """One (policy, quantity): each document's mean, step count and sum of squares (by slot,
    so the result does not depend on the order documents arrive in) and the pooled steps."""

    def __init__(self, quantity: str, slots: int) -> None:
        self.quantity = quantity
        self.doc_mean = np.full(slots, np.nan)
        self.steps = np.zeros(slots, np.int64)
        self.square_sum = np.zeros(slots)
        # Only quantities with percentiles keep their steps (same_top has a mean only).
        self.pooled = PooledSteps() if len(STATISTICS[quantity]) > 1 else None

    def put(self, slots: Sequence[int], values: Sequence[np.ndarray]) -> None:
        """Documents ``slots``' steps (``values[i]`` for slot ``slots[i]``), folded at once:
        each document's sums are its own segment's (the same whatever the batch)."""
        sizes = np.array([v.size for v in values], np.int64)
        if not sizes.any():
            return
        flat = np.concatenate([np.asarray(v, np.float64).reshape(-1) for v in values])
        self.put_flat(slots, flat, sizes)

    def put_flat(self, slots: Sequence[int], flat: np.ndarray, sizes: np.ndarray) -> None:
        """:meth:`put` of the documents' steps laid end to end (``sizes[i]`` of slot
        ``slots[i]``, in order)."""
        sizes = np.ascontiguousarray(sizes, np.int64)
        flat = np.ascontiguousarray(flat, np.float64)
        sums, squares = _core.segment_sums(flat, sizes)
        self.put_sums(slots, sizes, sums, squares, flat)

    def put_sums(
        self,
        slots: Sequence[int],
        sizes: np.ndarray,
        sums: np.ndarray,
        squares: np.ndarray,
        flat: np.ndarray | None,
    ) -> None:
        """:meth:`put_flat` of documents whose step counts, sums and sums of squares are
        made (each summed in step order: :func:`kvcouple._core.segment_sums`,
        :func:`kvcouple._core.path_steps`); ``flat``, their steps end to end, for the pooled
        percentiles (None where this quantity keeps none)."""
        sizes = np.asarray(sizes, np.int64)
        seen = sizes > 0
        if not seen.any():
            return
        at = np.asarray(slots, np.int64)[seen]
        self.doc_mean[at] = np.asarray(sums)[seen] / sizes[seen]
        self.steps[at] = sizes[seen]
        self.square_sum[at] = np.asarray(squares)[seen]
        if self.pooled is not None:
            if flat is None:
                raise ValueError(f"{self.quantity}: its pooled steps are needed")
            self.pooled.add(flat)

    def rows(self) -> list[dict[str, Any]]:
        """The mean over documents (+- se), then the pooled steps' percentiles (and the RMS
        for delta_p)."""
        quantity, pooled = self.quantity, self.pooled
        seen = self.steps > 0
        means = self.doc_mean[seen]
        n = int(seen.sum())
        mean = float(means.mean()) if n else math.nan
        se = float(means.std(ddof=1) / math.sqrt(n)) if n > 1 else math.nan
        total = int(self.steps.sum())
        error = 0.0 if pooled is None or pooled.exact else HISTOGRAM_RESOLUTION
        rows = []
        for statistic, pct in STATISTICS[quantity]:
            estimate, stderr, relative_error = math.nan, math.nan, 0.0
            if statistic == "mean":
                estimate, stderr = mean, se
            elif statistic == "rms" and total:
                estimate = math.sqrt(float(self.square_sum.sum()) / total)
            elif pct is not None and total and pooled is not None:
                estimate = pooled.percentile(pct)
                relative_error = error if 0.0 < pct < 100.0 else 0.0
            rows.append(
                {
                    "quantity": quantity,
                    "statistic": statistic,
                    "estimate": estimate,
                    "se": stderr,
                    "n_docs": n,
                    "steps": total,
                    "relative_error": relative_error,
                }
            )
        return rows


class ScoreboardPool:
    """The scoreboard of one store, folded one document at a time (:meth:`put`, any order,
    thread-safe) in memory independent of the number of documents but for a few numbers
    each: a 100k-document store does not keep its ~10^8 path steps."""

    def __init__(self, policies: list[str], slots: int) -> None:
        self.policies = list(policies)
        self.pools = {p: {q: _Pool(q, slots) for q in STATISTICS} for p in self.policies}
        # A quantity is reported only when every document recorded it.
        self.missing = {p: {q: False for q in STATISTICS} for p in self.policies}
        self.lock = threading.Lock()
        self.documents = 0

    def put(self, slot: int, scores: Mapping[str, DocScores]) -> None:
        self.put_many([slot], [scores])

    def put_many(self, slots: Sequence[int], scores: Sequence[Mapping[str, DocScores]]) -> None:
        """Several documents' scores (``scores[i]`` of slot ``slots[i]``) in one fold per
        pool: the result is the same as one :meth:`put` each, in any order or batching."""
        if not slots:
            return
        with self.lock:
            self.documents += len(slots)
            for pol in self.policies:
                pools, missing = self.pools[pol], self.missing[pol]
                here = [(slot, s[pol]) for slot, s in zip(slots, scores, strict=True) if pol in s]
                if not here:
                    continue
                at = [slot for slot, _ in here]
                pools["kl_pq"].put(at, [d.kl for _, d in here])
                for q in ("delta_p", "same_top"):
                    got = [(slot, d.dp if q == "delta_p" else d.agree) for slot, d in here]
                    if any(v is None for _, v in got):
                        missing[q] = True
                    kept = [(slot, v) for slot, v in got if v is not None]
                    if kept:
                        pools[q].put([slot for slot, _ in kept], [v for _, v in kept])

    def put_batch(self, slots: Sequence[int], batch: ScoreBatch) -> None:
        """Every document of ``batch`` (document ``d`` in slot ``slots[d]``): the same as
        :meth:`put_many` of their :class:`BatchScores`, without a per-document pass."""
        if len(slots) != batch.docs:
            raise ValueError(f"{len(slots)} slots for a batch of {batch.docs} documents")
        with self.lock:
            self.documents += batch.docs
            for i, pol in enumerate(self.policies):
                pools, missing = self.pools[pol], self.missing[pol]
                sizes = batch.sizes[:, i]
                pools["kl_pq"].put_sums(
                    slots, sizes, batch.sums[:, i], batch.squares[:, i], batch.kl[i]
                )
                missing["delta_p"] = True  # a record without distributions
                if batch.flagged is None:
                    missing["same_top"] = True
                else:  # a flag squared is itself
                    flagged = batch.flagged[:, i]
                    pools["same_top"].put_sums(slots, sizes, flagged, flagged, None)

    def doc_means(self, slots: Sequence[int]) -> dict[str, dict[str, np.ndarray]]:
        """Each document's mean over its path steps (``slots``' documents, in that order),
        per quantity and policy: ``{"kl_pq": {policy: means}, "same_top": ...}``; NaN where a
        document has no path step or the quantity was not recorded."""
        at = np.asarray(slots, np.int64)
        out: dict[str, dict[str, np.ndarray]] = {}
        for q in ("kl_pq", "same_top"):
            out[q] = {
                pol: np.full(at.size, np.nan)
                if self.missing[pol][q]
                else self.pools[pol][q].doc_mean[at].copy()
                for pol in self.policies
            }
        return out

    def rows(self, model: str) -> list[dict[str, Any]]:
        out = []
        for pol in self.policies:
            pools, missing = self.pools[pol], self.missing[pol]
            if not self.documents:
                continue
            parts = pools["kl_pq"].rows()
            for q in ("delta_p", "same_top"):
                if not missing[q]:
                    parts += pools[q].rows()
            out += [{"model": model, "policy": pol, **r} for r in parts]
        return out


def scoreboard_rows(model: str, policies: list[str], docs: list[Any]) -> list[dict[str, Any]]:
    """The scoreboard of one store: per policy, ``kl_pq``, ``delta_p`` (where recorded) and
    ``same_top`` rows (``statistic``, ``estimate``, ``se``, ``n_docs``, ``steps``,
    ``relative_error`` of a percentile), from the documents' :class:`DocScores` (``docs``: the
    analysis's per-document results, or ``scores`` dicts)."""
    scored = [getattr(d, "scores", d) for d in docs]
    scored = [s for s in scored if s]
    pool = ScoreboardPool(policies, len(scored))
    for slot, s in enumerate(scored):
        pool.put(slot, s)
    return pool.rows(model)


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
