"""Simulate synthetic kernel pairs into a trace store (``kvcouple synth trace-store``).

The store is what the tracer would write for a model, with the kernels replaced by finite-state
emitters (SPEC section 6), so the whole analysis path can be checked end to end against the
exact solver without a model. Each replicate follows RB-CMC (SPEC section 4):

1. the overlap path ``z_t ~ min(p_t, q_t) / (1 - h_t)`` (both kernels on the same prefix; a step
   with ``h_t = 1`` ends the path), drawn with :func:`kvcouple.couple` forced onto its overlap;
2. ``K`` branch times ``t* ~ pi_t = W_{t-1} h_t / O``;
3. at ``t*`` the residual draw ``X ~ r^P, Y ~ r^Q`` (``couple`` forced onto its residual), then
   both kernels continue from their own prefixes with the stepwise maximal coupling for lags
   ``1..L`` (or up to the horizon).

Documents are start states (prompts); policies are Q kernels (each given as a pair with the
same P or not). ``record="full"`` stores the actual distributions (float16), ``topk:K`` their
top K, so the analysis's recomputation of hazards and branch TVs can be tested.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm  # type: ignore[import-untyped]

from kvcouple import cliargs
from kvcouple._core import __version__ as kvcouple_version
from kvcouple.errors import InvalidInputError
from kvcouple.kernels import couple, divergences
from kvcouple.resources import check_memory
from kvcouple.store.create import StoreLayout
from kvcouple.store.geometry import is_url
from kvcouple.store.identity import run_identity
from kvcouple.store.lock import writer_lock
from kvcouple.store.schema import Record, empty_arrays, variables
from kvcouple.store.writer import TraceStoreWriter
from kvcouple.synth.pairs import KernelPair, check_seed, load_pair, pair_from_mapping

_BELOW_ONE = 1.0 - 2.0**-53
# Synthetic stores hold their document ids in the attributes: keep them a sane size.
MAX_DOCS = 1_000_000
MAX_HORIZON = 2**20  # as the synthetic solvers
MAX_BRANCHES = 2**17  # per document (the branch times are drawn in a Python loop)
# Documents simulated in one batch: a document's records do not depend on it.
SIMULATED_TOGETHER = 256


@dataclass(frozen=True)
class EmitterPair:
    """Two finite-state emitters over one vocabulary (SPEC section 6)."""

    p_emit: np.ndarray
    p_next: np.ndarray
    p_start: int
    q_emit: np.ndarray
    q_next: np.ndarray
    q_start: int

    @property
    def vocab_size(self) -> int:
        return int(self.p_emit.shape[1])


def as_emitter_pair(pair: Any) -> EmitterPair:
    """Accept an :class:`EmitterPair`, a :class:`~kvcouple.synth.KernelPair`, a pair-file path
    (``.npz``), a mapping with the pair-file keys (``P_emit, P_next, P_start, Q_emit, Q_next,
    Q_start``, or ``P, Q, start`` Markov tables, ``start`` defaulting to 0) or an object with
    those attributes (lower-case names accepted too). Validated as pair files are (typed
    :class:`~kvcouple.InvalidKernelError` naming the array)."""
    if isinstance(pair, EmitterPair):
        return pair
    if isinstance(pair, str | os.PathLike):
        kp = load_pair(pair)
    elif isinstance(pair, KernelPair):
        kp = pair
    else:
        names = ("P_emit", "P_next", "P_start", "Q_emit", "Q_next", "Q_start", "P", "Q", "start")
        if isinstance(pair, Mapping):
            found = {n: pair[n] for n in names if n in pair}
        else:
            found = {
                n: getattr(pair, n, getattr(pair, n.lower(), None))
                for n in names
                if getattr(pair, n, getattr(pair, n.lower(), None)) is not None
            }
        if "P" in found and "Q" in found and "P_emit" not in found:
            found.setdefault("start", 0)
        kp = pair_from_mapping(found, type(pair).__name__)
    return EmitterPair(*kp.arrays())


def with_starts(pair: EmitterPair, p_start: int, q_start: int) -> EmitterPair:
    """The same pair started from other states (a synthetic document's "prompt")."""
    for side, emit, start in (("P", pair.p_emit, p_start), ("Q", pair.q_emit, q_start)):
        if not 0 <= int(start) < emit.shape[0]:
            raise InvalidInputError(
                f"start state {start} of {side} is not a state of the pair (0..{emit.shape[0] - 1})"
            )
    return EmitterPair(
        pair.p_emit, pair.p_next, int(p_start), pair.q_emit, pair.q_next, int(q_start)
    )


def _record_rows(
    out: dict[str, np.ndarray],
    prefix: str,
    index: Any,
    p: np.ndarray,
    q: np.ndarray,
    record: Record,
) -> None:
    """Store the distributions themselves (full) or their top K (topk) at ``index``."""
    if record.kind == "full":
        out[f"{prefix}p"][index] = p
        out[f"{prefix}q"][index] = q
    elif record.kind == "topk":
        k = record.k
        for side, m in (("p", p), ("q", q)):
            ids = np.argsort(-m, axis=1, kind="stable")[:, :k]
            probs = np.take_along_axis(m, ids, axis=1)
            if ids.shape[1] < k:  # vocab smaller than K: pad
                pad = k - ids.shape[1]
                ids = np.pad(ids, ((0, 0), (0, pad)), constant_values=-1)
                probs = np.pad(probs, ((0, 0), (0, pad)), constant_values=0.0)
            out[f"{prefix}topk_ids_{side}"][index] = ids
            out[f"{prefix}topk_probs_{side}"][index] = probs
            out[f"{prefix}tail_mass_{side}"][index] = np.clip(1.0 - probs.sum(1), 0.0, 1.0)


def simulate_doc_policy(
    pair: EmitterPair,
    layout: StoreLayout,
    rng: np.random.Generator,
    out: dict[str, np.ndarray],
    pol: int,
) -> None:
    """Fill ``out[...][pol]`` with one (document, policy)'s RB-CMC replicates."""
    starts = np.array([[pair.p_start, pair.q_start]])
    simulate_docs_policy(pair, starts, layout, [rng], {n: a[None] for n, a in out.items()}, pol)


class _Streams:
    """Each document's uniforms, drawn from its own stream in the order one document
    simulated alone draws them. ``Generator.random`` makes one float64 per 64-bit output, so
    a stream drawn ahead in one call and consumed in order gives the same numbers as many
    small calls; it is drawn ahead where the run's draws fit in 64 MiB (one call per document,
    rows gathered at once), else call by call."""

    AHEAD_BYTES = 2**26

    def __init__(self, rngs: Sequence[np.random.Generator], most: int):
        self.rngs = rngs
        self.ahead: np.ndarray | None = None
        if len(rngs) * most * 8 <= self.AHEAD_BYTES:
            self.ahead = np.stack([rng.random(most) for rng in rngs])
            self.cursor = np.zeros(len(rngs), np.int64)

    def draw(self, doc_of: np.ndarray, width: int) -> np.ndarray:
        """Uniforms ``(rows, width)`` for rows of documents ``doc_of`` (sorted)."""
        if doc_of.size == 0:
            return np.empty((0, width))
        counts = np.bincount(doc_of, minlength=len(self.rngs))
        if self.ahead is None:
            u = np.empty((doc_of.size, width))
            at = 0
            for d in np.flatnonzero(counts).tolist():
                c = int(counts[d])
                u[at : at + c] = self.rngs[d].random((c, width))
                at += c
            return u
        rank = np.arange(doc_of.size) - (np.cumsum(counts) - counts)[doc_of]
        pos = (self.cursor[doc_of] + width * rank)[:, None] + np.arange(width)
        self.cursor += width * counts
        return self.ahead[doc_of[:, None], pos]


# The records of the path (by replicate and step; tokens last: written by the coupling) and of
# the branches (by replicate, branch and lag), as the batch simulation fills them.
_PATH_RECORDS = ("hazard", "kl_pq", "kl_qp", "entropy_p", "entropy_q", "top1_agree", "tokens")
_LAG_RECORDS = ("branch_tv", "branch_mismatch", "branch_tokens_p", "branch_tokens_q")


def simulate_docs_policy(
    pair: EmitterPair,
    starts: np.ndarray,
    layout: StoreLayout,
    rngs: Sequence[np.random.Generator],
    out: dict[str, np.ndarray],
    pol: int,
) -> None:
    """Fill ``out[...][:, pol]`` with the RB-CMC replicates of a batch of documents under one
    policy: ``starts[i]`` document ``i``'s (P, Q) start states, ``rngs[i]`` its random stream,
    ``out`` arrays with a leading document axis. Every step's kernels run once for the whole
    batch's rows; each document draws from its own stream exactly what it would alone, so a
    document's records do not depend on the batch it is in."""
    R, T, K, L = layout.replicates, layout.horizon, layout.branches, layout.window
    record = layout.record
    D = len(rngs)
    sp = np.repeat(np.asarray(starts[:, 0], np.int64), R)  # row = doc * R + rep
    sq = np.repeat(np.asarray(starts[:, 1], np.int64), R)
    hist_p = np.zeros((D * R, T), np.int64)  # state before step t (for branching at t)
    hist_q = np.zeros((D * R, T), np.int64)
    alive = np.ones(D * R, bool)
    # The path's records by row and step (written back into ``out`` at the end: a row's
    # values are contiguous here, scattered across the document axis there).
    path = {n: out[n][:, pol].reshape(D * R, T).copy() for n in _PATH_RECORDS}
    hazard = np.zeros((D * R, T))
    streams = _Streams(rngs, 3 * R * T + R * K + 3 * R * K * (L + 1))
    for t in range(T):
        rows = np.flatnonzero(alive)
        if rows.size == 0:
            break
        at = slice(None) if rows.size == D * R else rows  # every row alive: a plain copy
        hist_p[at, t], hist_q[at, t] = sp[at], sq[at]
        p, q = pair.p_emit[sp[at]], pair.q_emit[sq[at]]
        d = divergences(p, q)
        hazard[at, t] = d.tv
        for name in _PATH_RECORDS[:-1]:
            path[name][at, t] = d.tv if name == "hazard" else getattr(d, name)
        _record_rows(out, "", (rows // R, pol, rows % R, t), p, q, record)
        go = d.tv < 1.0  # a step with h = 1 has no overlap: the path ends there
        alive[rows[~go]] = False
        g = rows[go]
        if g.size:
            tv = d.tv[go]
            u = streams.draw(g // R, 3)
            u[:, 0] = np.minimum(tv + (1.0 - tv) * u[:, 0], _BELOW_ONE)  # force the overlap
            x, _, _ = couple(p[go], q[go], u)
            path["tokens"][g, t] = x
            sp[g], sq[g] = pair.p_next[sp[g], x], pair.q_next[sq[g], x]
    # After a step with no overlap (h = 1) the path has ended: nothing can diverge any more,
    # so its later hazards are 0, as the tracer writes them (tokens stay -1, metrics NaN).
    path["hazard"][np.isnan(path["hazard"])] = 0.0
    for name, values in path.items():
        out[name][:, pol] = values.reshape(D, R, T)
    # Survival weights W_t and the branch law pi_t = W_{t-1} h_t / O.
    w_prev = np.concatenate([np.ones((D * R, 1)), np.cumprod(1.0 - hazard, axis=1)[:, :-1]], axis=1)
    mass = w_prev * hazard
    occurrence = mass.sum(1)
    rep_k = np.repeat(np.arange(D * R), K)  # branch row = (doc * R + rep) * K + k
    has = occurrence[rep_k] > 0
    cdf = np.cumsum(mass, axis=1) / np.where(occurrence > 0, occurrence, 1.0)[:, None]
    u = streams.draw(np.repeat(np.arange(D), R * K), 1)[:, 0]
    tstar = np.zeros(D * R * K, np.int64)  # 1-based, 0: no branch
    branching = np.flatnonzero(has)
    if branching.size:
        r = rep_k[branching]
        # numpy's searchsorted(side="right") of each u in its row's cdf, in one pass.
        found = (cdf[r] <= u[branching, None]).sum(axis=1)
        at_step = np.minimum(found, T - 1) + 1
        while True:  # rounding at the top of the cdf: step back to a step with h > 0
            low = hazard[r, at_step - 1] <= 0.0
            if not low.any():
                break
            at_step[low] -= 1
        tstar[branching] = at_step
    out["branch_step"][:, pol] = tstar.reshape(D, R, K)
    rows = branching
    if rows.size == 0:
        return
    # The branches' records by branch row and lag (written back at the end).
    lags = {n: out[n][:, pol].reshape(D * R * K, L + 1).copy() for n in _LAG_RECORDS}
    r_of, k_of = rep_k[rows], rows % K
    bp, bq = hist_p[r_of, tstar[rows] - 1], hist_q[r_of, tstar[rows] - 1]
    for lag in range(L + 1):
        act = tstar[rows] + lag <= T
        if not act.any():
            break
        sel = rows[act]
        p, q = pair.p_emit[bp[act]], pair.q_emit[bq[act]]
        tv = divergences(p, q).tv
        u = streams.draw(sel // (R * K), 3)
        if lag == 0:
            u[:, 0] = 0.0  # force the residual: h_{t*} > 0 since pi puts no mass elsewhere
        x, y, diverged = couple(p, q, u)
        for name, values in zip(_LAG_RECORDS, (tv, diverged, x, y), strict=True):
            lags[name][sel, lag] = values
        branch_idx = (r_of[act] // R, pol, r_of[act] % R, k_of[act], lag)
        _record_rows(out, "branch_", branch_idx, p, q, record)
        bp[act], bq[act] = pair.p_next[bp[act], x], pair.q_next[bq[act], y]
    for name, values in lags.items():
        out[name][:, pol] = values.reshape(D, R, K, L + 1)


def write_synthetic_trace_store(
    path: str | os.PathLike[str],
    pairs: Mapping[str, Any],
    *,
    horizon: int,
    window: int | None = None,
    branches: int = 1,
    replicates: int = 64,
    docs: int | Sequence[tuple[int, int] | int] = 1,
    record: str = "summary",
    seed: int = 0,
    stop_after: int | None = None,
    model_id: str = "synthetic",
    progress: bool = False,
) -> Path:
    """Simulate every (document, policy) into a new or resumed store at ``path``.

    ``pairs`` maps policy names to pairs (anything :func:`as_emitter_pair` accepts). ``docs``
    is a count (every document starts from the pairs' own start states) or a list of start
    states, one per document: an int for Markov pairs (the start token) or ``(p_state,
    q_state)``. ``window`` defaults to ``horizon - 1`` (branches traced to the horizon).
    ``stop_after`` writes only that many documents (to make an interrupted run for tests);
    ``model_id`` labels the store (analyses of several stores report per model);
    ``progress`` shows a bar over documents.
    Each (document, policy) has its own random stream from ``(seed, doc, policy)``, so a
    resumed run writes exactly what an uninterrupted one would.
    """
    emitters = {name: as_emitter_pair(p) for name, p in pairs.items()}
    if not emitters:
        raise InvalidInputError("give at least one policy pair")
    vocab = {e.vocab_size for e in emitters.values()}
    if len(vocab) != 1:
        raise InvalidInputError(f"every pair must share one vocabulary size, got {sorted(vocab)}")
    starts: list[tuple[int, int] | None]
    if isinstance(docs, int | np.integer):  # a bool is refused by _count
        starts = [None] * _count("docs", docs, 1)
    else:
        starts = [_start_pair(s) for s in docs]
    if len(starts) > MAX_DOCS:
        raise InvalidInputError(f"docs = {len(starts)} is beyond {MAX_DOCS} synthetic documents")
    horizon = _count("horizon", horizon, 1)
    if horizon > MAX_HORIZON:
        raise InvalidInputError(f"horizon = {horizon} is beyond the {MAX_HORIZON} steps supported")
    window = horizon - 1 if window is None else _count("window", window, 0)
    branches = _count("branches", branches, 1)
    replicates = _count("replicates", replicates, 1)
    if replicates * branches > MAX_BRANCHES:
        raise InvalidInputError(
            f"replicates x branches = {replicates} x {branches} is beyond the {MAX_BRANCHES} "
            "branches per document the synthetic simulator traces"
        )
    seed = check_seed(seed)
    for s in starts:  # checked before the store is created
        if s is not None:
            for e in emitters.values():
                with_starts(e, *s)
    layout, attrs = run_identity(
        [f"doc{d:04d}" for d in range(len(starts))],
        [(n, n, {}) for n in emitters],
        horizon=horizon,
        window=window,
        branches=branches,
        replicates=replicates,
        vocab_size=vocab.pop(),
        record=Record.parse(record),
        model_id=model_id,
        seed=int(seed),
        decoding={"temperature": 1.0, "top_k": None, "top_p": None},
        eos_token_id=None,
        source="synthetic",
        model_revision="",
        dtype="float64",
        kvcouple_version=kvcouple_version,
        synthetic_starts=[list(s) if s else None for s in starts],
    )
    # One document's arrays are built in memory: refuse what cannot fit before writing.
    sizes = layout.sizes()
    doc_bytes = sum(
        8 * math.prod(sizes[d] for d in v.dims[1:]) for v in variables(layout.record).values()
    )
    check_memory(f"one synthetic document ({layout.record} record)", 2 * doc_bytes)
    # Documents simulated together (every step's kernels called once for the batch), within
    # 256 MiB of float64 records.
    batch = max(1, min(SIMULATED_TOGETHER, 2**28 // doc_bytes))
    writer = TraceStoreWriter.open(path, layout, attrs)
    # One writer at a time (kvcouple.store.lock); the shards it holds are written on the way
    # out, also when stopped early or by an error.
    with writer_lock(path, (0, 1), len(starts)), writer:
        done = writer.completed()
        todo = [d for d in range(len(starts)) if not done[d]]
        if stop_after is not None:
            todo = todo[:stop_after]
        writer.expect(todo)
        bar = tqdm(total=len(todo), unit="doc", desc="kvcouple synth trace-store",
                   disable=not progress)  # fmt: skip
        with bar:
            for i in range(0, len(todo), batch):
                docs_now = todo[i : i + batch]
                for d, arrays in zip(docs_now, _simulate_batch(emitters, starts, docs_now, layout,
                                                               int(seed)), strict=True):  # fmt: skip
                    writer.write_doc(d, arrays)
                bar.update(len(docs_now))
    return str(path) if is_url(str(path)) else Path(path)  # type: ignore[return-value]


def _simulate_batch(
    emitters: Mapping[str, EmitterPair],
    starts: Sequence[tuple[int, int] | None],
    docs: list[int],
    layout: StoreLayout,
    seed: int,
) -> list[dict[str, np.ndarray]]:
    """Every policy's records of the documents ``docs``, each document's arrays as
    ``write_doc`` takes them; document ``d`` under policy ``pol`` draws from its own stream
    ``(seed, d, pol)``, so a resumed run writes exactly what an uninterrupted one would."""
    one = empty_arrays(layout.record, layout.sizes(), float_dtype="float64")
    out = {n: np.repeat(a[None], len(docs), axis=0) for n, a in one.items()}
    for pol, base in enumerate(emitters.values()):
        first = np.array(
            [(base.p_start, base.q_start) if starts[d] is None else starts[d] for d in docs]
        )
        rngs = [np.random.default_rng([seed, d, pol]) for d in docs]
        simulate_docs_policy(base, first, layout, rngs, out, pol)
    out["prompt_length"][...] = 1
    out["kept_length"] = np.ones((len(docs), len(emitters)), np.int32)
    out["eviction_applied"][...] = True  # every synthetic Q is its own kernel
    return [{n: a[i] for n, a in out.items()} for i in range(len(docs))]


def _count(name: str, value: Any, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < least:
        raise InvalidInputError(f"{name} must be an integer >= {least}, got {value!r}")
    return int(value)


def _start_pair(s: Any) -> tuple[int, int]:
    """A document's start: one state (Markov pairs: the start token) or ``(p_state, q_state)``."""
    if isinstance(s, int | np.integer) and not isinstance(s, bool):
        return int(s), int(s)
    if (
        isinstance(s, tuple | list)
        and len(s) == 2
        and all(isinstance(x, int | np.integer) and not isinstance(x, bool) for x in s)
    ):
        return int(s[0]), int(s[1])
    raise InvalidInputError(
        f"a document start must be a state (int) or a (p_state, q_state) pair, got {s!r}"
    )


def parse_starts(text: str) -> list[tuple[int, int]]:
    """``--starts``: ``'a,b,c'`` (one state per document) or ``'sp:sq,...'``."""
    out = []
    for item in text.split(","):
        fields = item.strip().split(":")
        try:
            if len(fields) > 2:
                raise ValueError
            states = [int(f) for f in fields]
        except ValueError:
            raise InvalidInputError(
                f"--starts: {item.strip()!r} is not a state or sp:sq (integers), in {text!r}"
            ) from None
        if min(states) < 0:
            raise InvalidInputError(f"--starts: {item.strip()!r} has a negative state")
        out.append((states[0], states[-1]))
    return out


def _parse_policy(text: str) -> tuple[str, str]:
    name, sep, file = text.partition("=")
    if not sep:
        return Path(text).stem, text
    return name, file


def _run(args: argparse.Namespace) -> int:
    pairs = dict(_parse_policy(t) for t in args.pair)
    docs: int | list[tuple[int, int]] = args.docs
    if args.starts:
        docs = parse_starts(args.starts)
    path = write_synthetic_trace_store(
        args.out,
        pairs,
        horizon=args.horizon,
        window=args.window,
        branches=args.branches,
        replicates=args.replicates,
        docs=docs,
        record=args.record,
        seed=args.seed,
        progress=not args.quiet,
    )
    print(f"wrote {path}")
    return 0


def register_trace_store(subparsers: Any) -> None:
    """Add ``trace-store`` to the ``kvcouple synth`` command group."""
    p = subparsers.add_parser(
        "trace-store",
        help="simulate synthetic kernel pairs into a trace store (no model needed)",
        description="Simulate RB-CMC replicates of synthetic kernel pairs into a trace store "
        "in the schema the tracer writes, for testing the analysis end to end.",
    )
    p.add_argument(
        "pair", nargs="+", help="pair files (.npz), optionally NAME=FILE; one per policy"
    )
    p.add_argument("--out", required=True, help="the store to write (created or resumed)")
    cliargs.add_horizon(p, required=True, help="T: steps per trajectory", short="-T")
    cliargs.add_window(
        p, help="L: lags traced after a branch (default: T-1, to the horizon)", short="-L"
    )
    cliargs.add_branches(p, 1, short="-K")
    cliargs.add_replicates(p, 64, short="-R")
    p.add_argument(
        "--docs", type=cliargs.positive, default=1, help="documents from the pairs' start states"
    )
    p.add_argument(
        "--starts",
        default=None,
        help="one start per document: 'a,b,c' (Markov) or 'sp:sq,...' (emitters)",
    )
    p.add_argument("--record", default="summary", help="summary, topk:K or full")
    cliargs.add_seed(p, 0, help="random seed of the simulation")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_run)
