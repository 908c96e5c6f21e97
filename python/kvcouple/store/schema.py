"""The trace-store layout (SPEC section 8): one xarray Dataset in a Zarr store per run.

Schema version 5: a store of many documents may be written with Zarr v3 sharding, many
documents per stored object, each document and policy still its own chunk inside
(:func:`kvcouple.store.create.docs_per_shard`), and ``--shard i/N`` writers own whole Zarr
shards (:mod:`kvcouple.store.parts`); version 4 stores read as before.
Schema version 4: the store may keep its text (:data:`TEXT_VARIABLES`: the prompts' token ids
and the bytes of every token id, so that text is shown without the model; attribute
``text_decoder``); version 3 stores, which keep no text, read as before.
Schema version 3: every chunk carries a checksum (Zarr format 3 with the ``crc32c`` codec after
Zstd; with zarr-python 2, Zarr format 2 with Zstd's own frame checksum). Version 2 stores (no
checksums) are still read; version 1 had no gate variables. Dimensions: ``doc, policy, rep, step (1..T), branch (1..K), lag (0..L)``,
``k`` (top-k records) and ``vocab`` (full records). Readable by plain ``xarray.open_zarr``.

Variables (every record level):

=====================  ==============================  =======  ==================================
name                   dims                            dtype    meaning
=====================  ==============================  =======  ==================================
doc_id                 doc                             str      the prompt's id
prompt_length          doc                             int32    prompt tokens
kept_length            doc, policy                     int32    prompt-cache entries kept per head
gate_score             doc, policy                     float32  a gated policy's admission score
                                                                (PAGE: the early-to-late drop in
                                                                head agreement); NaN: no gate
gate_class             doc, policy                     int8     -1: no gate; 0: dilution-prone
                                                                (evicted); 1: capacity-bound (kept
                                                                whole)
eviction_applied       doc, policy                     bool     the evicted cache differs from the
                                                                full one (False for ``full`` and
                                                                inputs a gate kept whole)
completed              doc                             bool     the doc's region is fully written
tokens                 doc, policy, rep, step          int32    overlap-path token z_t (-1 after a
                                                                stop: hazard 1 ends the path)
hazard                 doc, policy, rep, step          float32  TV(p_t, q_t) on the overlap path
                                                                (0 after a stop)
kl_pq, kl_qp           doc, policy, rep, step          float32  KL both ways (nats) on the path
entropy_p, entropy_q   doc, policy, rep, step          float32  entropies (nats) on the path
top1_agree             doc, policy, rep, step          bool     argmax p == argmax q on the path
branch_step            doc, policy, rep, branch        int32    branch time t* (1..T); 0: no
                                                                branch (the path never diverges)
branch_tv              doc, policy, rep, branch, lag   float32  TV at t*+lag on the branch (lag 0:
                                                                the hazard at t*); NaN past T
branch_mismatch        doc, policy, rep, branch, lag   int8     1{X != Y} at t*+lag (lag 0: 1);
                                                                -1 past T or no branch
branch_tokens_p/_q     doc, policy, rep, branch, lag   int32    X and Y at t*+lag; -1 past T
=====================  ==============================  =======  ==================================

``record="topk:K"`` adds ``topk_ids_p/_q`` (int32), ``topk_probs_p/_q`` (float32) over
``(doc, policy, rep, step, k)`` and ``tail_mass_p/_q`` (float32, the mass outside the top K)
over ``(doc, policy, rep, step)``, and the same with a ``branch_`` prefix over
``(doc, policy, rep, branch, lag[, k])``. ``record="full"`` adds ``p, q`` over
``(doc, policy, rep, step, vocab)`` and ``branch_p, branch_q`` over
``(doc, policy, rep, branch, lag, vocab)`` in float16 (one chunk along vocab).

Attributes: ``schema_version``, ``kvcouple_version``, ``model_id``, ``model_revision``,
``model_file`` and ``model_sha256`` (a model read from a GGUF file), ``dtype``, ``decoding`` ({temperature, top_k, top_p}), ``policies`` (list of {spec, name,
params}), ``horizon`` (T), ``window`` (L), ``branches`` (K), ``replicates`` (R), ``record``,
``vocab_size``, ``eos_token_id``, ``seed``, ``estimator`` ("rb": branches drawn from the
residual-branch law of SPEC section 4), ``source`` ("model" or "synthetic").
Completion is recorded per doc in the ``completed`` variable rather than in attrs, so that
several processes can fill one store without racing on the attribute document.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

SCHEMA_VERSION = 5
# Versions this kvcouple reads: 2 has the same layout without chunk checksums; 3 has no text;
# 4 keeps one stored object per document (and policy) of every variable.
READABLE_VERSIONS = (2, 3, 4, 5)
# The first version whose writer puts a checksum on every chunk.
CHECKSUMS_SINCE = 3
# The first version that may keep the text (TEXT_VARIABLES), where the tracer had a tokenizer.
TEXT_SINCE = 4
# The first version whose writer may shard (kvcouple.store.create.docs_per_shard) and whose
# --shard i/N parts are whole Zarr shards (kvcouple.store.parts).
SHARDS_SINCE = 5

# Sentinels for unobserved entries (after a stop, past the horizon, no branch).
NO_TOKEN = -1
NO_MISMATCH = -1

# gate_class values.
NO_GATE = -1
DILUTION_PRONE = 0
CAPACITY_BOUND = 1

PATH_DIMS = ("doc", "policy", "rep", "step")
BRANCH_DIMS = ("doc", "policy", "rep", "branch")
LAG_DIMS = ("doc", "policy", "rep", "branch", "lag")


class Variable(NamedTuple):
    """One store variable: its dimensions, dtype, and the value where nothing was observed."""

    dims: tuple[str, ...]
    dtype: str
    fill: float | int | bool


_NAN = float("nan")

SUMMARY_VARIABLES: dict[str, Variable] = {
    "prompt_length": Variable(("doc",), "int32", 0),
    "kept_length": Variable(("doc", "policy"), "int32", 0),
    "gate_score": Variable(("doc", "policy"), "float32", _NAN),
    "gate_class": Variable(("doc", "policy"), "int8", NO_GATE),
    "eviction_applied": Variable(("doc", "policy"), "bool", False),
    "completed": Variable(("doc",), "bool", False),
    "tokens": Variable(PATH_DIMS, "int32", NO_TOKEN),
    "hazard": Variable(PATH_DIMS, "float32", _NAN),
    "kl_pq": Variable(PATH_DIMS, "float32", _NAN),
    "kl_qp": Variable(PATH_DIMS, "float32", _NAN),
    "entropy_p": Variable(PATH_DIMS, "float32", _NAN),
    "entropy_q": Variable(PATH_DIMS, "float32", _NAN),
    "top1_agree": Variable(PATH_DIMS, "bool", False),
    "branch_step": Variable(BRANCH_DIMS, "int32", 0),
    "branch_tv": Variable(LAG_DIMS, "float32", _NAN),
    "branch_mismatch": Variable(LAG_DIMS, "int8", NO_MISMATCH),
    "branch_tokens_p": Variable(LAG_DIMS, "int32", NO_TOKEN),
    "branch_tokens_q": Variable(LAG_DIMS, "int32", NO_TOKEN),
}


# The store's text (schema version 4, written at creation where the run has a tokenizer; the
# attribute ``text_decoder`` says how the token bytes were derived): the prompts' token ids
# (-1 past each prompt's end), and every token id's bytes, concatenated (``token_bytes``) and
# delimited by their ends (``token_ends[i]``: one past token i's last byte), so that a
# sequence of ids decodes to the concatenation of its tokens' bytes, read as UTF-8.
TEXT_VARIABLES: dict[str, Variable] = {
    "prompt_tokens": Variable(("doc", "prompt_position"), "int32", NO_TOKEN),
    "token_bytes": Variable(("token_byte",), "uint8", 0),
    "token_ends": Variable(("vocab",), "int64", 0),
}


@dataclass(frozen=True)
class Record:
    """What a run records beyond the summary: ``summary``, ``topk:K`` or ``full``.

    :meth:`parse` builds one from its text form (``"summary"``, ``"topk:K"`` or ``"full"``).

    Parameters
    ----------
    kind : str, optional
        ``"summary"`` (the default: summary variables only), ``"topk"`` (the top ``k`` token
        ids and probabilities of each distribution, plus the tail mass) or ``"full"`` (whole
        distributions over the vocabulary, stored as float16).
    k : int, optional
        Number of tokens kept per distribution for ``kind="topk"`` (>= 1); 0 (the default)
        otherwise.
    """

    kind: str = "summary"
    k: int = 0

    @classmethod
    def parse(cls, text: str) -> Record:
        text = text.strip()
        if text in ("summary", "full"):
            return cls(text, 0)
        if text.startswith("topk:"):
            try:
                k = int(text.split(":", 1)[1])
            except ValueError:
                k = 0
            if k >= 1:
                return cls("topk", k)
        raise ValueError(f"record must be 'summary', 'topk:K' (K >= 1) or 'full', got {text!r}")

    def __str__(self) -> str:
        return f"topk:{self.k}" if self.kind == "topk" else self.kind


def distribution_variables(record: Record, prefix: str = "") -> dict[str, Variable]:
    """The record-level variables of the path (``prefix=""``) or the branches (``"branch_"``)."""
    dims = PATH_DIMS if not prefix else LAG_DIMS
    out: dict[str, Variable] = {}
    for side in ("p", "q"):
        if record.kind == "topk":
            out[f"{prefix}topk_ids_{side}"] = Variable((*dims, "k"), "int32", NO_TOKEN)
            out[f"{prefix}topk_probs_{side}"] = Variable((*dims, "k"), "float32", _NAN)
            out[f"{prefix}tail_mass_{side}"] = Variable(dims, "float32", _NAN)
        elif record.kind == "full":
            out[f"{prefix}{side}"] = Variable((*dims, "vocab"), "float16", _NAN)
    return out


def variables(record: Record) -> dict[str, Variable]:
    """Every variable a store with this record level holds.

    Parameters
    ----------
    record : Record
        The record level: ``summary``, ``topk:K`` or ``full``.

    Returns
    -------
    dict of str to Variable
        Each variable's name mapped to its dimensions, dtype and fill value: the summary
        variables plus the distribution variables (and their ``branch_`` versions).
    """
    return {
        **SUMMARY_VARIABLES,
        **distribution_variables(record),
        **distribution_variables(record, "branch_"),
    }


def empty_arrays(
    record: Record,
    sizes: Mapping[str, int],
    region: tuple[str, ...] = ("doc",),
    *,
    names: Iterable[str] | None = None,
    having: str | None = None,
    float_dtype: str | None = None,
) -> dict[str, np.ndarray]:
    """Arrays filled with each variable's fill value for one region of the store: the variables
    whose dims start with ``region`` (``("doc",)``: one document; ``("doc", "policy")``: one
    document and policy), shaped by the remaining dims. ``names`` restricts the variables;
    ``having`` keeps those with that dimension; ``float_dtype`` overrides the float dtypes (simulation in float64). ``completed`` is the
    writer's own and never included."""
    table = variables(record)
    chosen = table if names is None else {n: table[n] for n in names}
    out = {}
    for name, var in chosen.items():
        if name == "completed" or var.dims[: len(region)] != region:
            continue
        if having is not None and having not in var.dims:
            continue
        shape = tuple(sizes[d] for d in var.dims[len(region) :])
        dtype = float_dtype if float_dtype and var.dtype.startswith("float") else var.dtype
        out[name] = np.full(shape, var.fill, dtype=dtype)
    return out


# Allowed values by variable (checked on every block read). "unit": finite in [0, 1];
# "nonneg": finite and >= 0 (entropies); "divergence": >= 0, +inf included (KL is +inf where
# one distribution has mass outside the other's support, as the kernels compute it); "token": [-1, vocab); "ternary": {-1, 0, 1};
# "step": [0, horizon]; "prompt": >= 1; "kept": in [1, the document's prompt_length] (checked
# by the reader, which knows the prompt); "distribution": every row (last axis) finite, >= 0
# and summing to 1 within :func:`row_sum_tolerance`. NaN (a whole row of a distribution) only
# where nothing was recorded (:data:`UNRECORDED_MARK`); inf never.
RULES: dict[str, str] = {
    "hazard": "unit",
    "branch_tv": "unit",
    "kl_pq": "divergence",
    "kl_qp": "divergence",
    "entropy_p": "nonneg",
    "entropy_q": "nonneg",
    "tokens": "token",
    "branch_tokens_p": "token",
    "branch_tokens_q": "token",
    "branch_mismatch": "ternary",
    "gate_class": "ternary",
    "branch_step": "step",
    "prompt_length": "prompt",
    "kept_length": "kept",
}
for _side in ("p", "q"):
    for _pre in ("", "branch_"):
        RULES[f"{_pre}topk_ids_{_side}"] = "token"
        RULES[f"{_pre}topk_probs_{_side}"] = "unit"
        RULES[f"{_pre}tail_mass_{_side}"] = "unit"
        RULES[f"{_pre}{_side}"] = "distribution"

# Where a float variable may hold NaN: only at the entries its mark variable says were not
# recorded (-1): the path's metrics after the path ended (``tokens`` -1), the branches' past
# the horizon or without a branch (``branch_mismatch`` -1). Every other NaN is damage (the
# value checks compare with NaN, which no range check catches by itself); ``hazard`` is 0
# after a stop, never NaN.
UNRECORDED_MARK: dict[str, str] = {
    name: ("branch_mismatch" if name.startswith("branch_") else "tokens")
    for name, rule in RULES.items()
    if rule in ("unit", "nonneg", "divergence", "distribution") and name != "hazard"
}

# Variables the analysis does not compute with but reads to check (a damaged value anywhere in
# a document refuses it): the path's divergences and the prompt and cache lengths.
CHECKED_ONLY = ("kl_pq", "kl_qp", "entropy_p", "entropy_q", "prompt_length", "kept_length")

# Probabilities and TVs computed in float arithmetic may leave [0, 1] by rounding only.
UNIT_SLACK = 1e-5
# KL and entropies are float32 sums over the vocabulary (reduced in a tree on the device): the
# rounding error is about log2(V) * 2^-24 * sum |p log p| <= 17 * 6e-8 * log(V) ~ 1.2e-5 nats
# for V = 128k, so a true 0 may be stored as a slightly negative number; 1e-4 nats covers it
# with margin and still refuses any real negative divergence.
DIVERGENCE_SLACK = 1e-4

# Relative rounding of one stored entry by format (half the spacing of the significand) and
# the smallest spacing (below the normal range the absolute error is half of it).
_UNIT_ROUNDOFF = {
    "float16": 2.0**-11,
    "bfloat16": 2.0**-8,
    "float32": 2.0**-24,
    "float64": 2.0**-53,
}
_SUBNORMAL_SPACING = {
    "float16": 2.0**-24,
    "bfloat16": 2.0**-133,
    "float32": 2.0**-149,
    "float64": 0.0,
}


def row_sum_tolerance(dtype: str, vocab: int) -> float:
    """How far a stored distribution's row sum may be from 1 by rounding alone.

    Storing entry ``x`` rounds it by at most ``u * x`` (``u`` = 2^-11 for float16) where ``x``
    is a normal number and by at most half the subnormal spacing (2^-25 for float16) below
    that, so the row sum moves by at most ``u * sum(x) + V * spacing / 2``. The distribution
    itself was normalised in float64 before storing (the tracer, the synthetic writer), and
    the checkers sum a row in float32 lanes of at most 64 entries added in float64 (relative
    error below 4e-6): 2^-17 (7.6e-6) covers both. So the tolerance is
    ``u + V * spacing / 2 + 2^-17``: for float16, 5.0e-4 + 3e-8 V (4.4e-3 at V = 128k).
    Anything further from 1 is damage.
    """
    u = _UNIT_ROUNDOFF.get(dtype, 2.0**-8)
    return u + vocab * _SUBNORMAL_SPACING.get(dtype, 0.0) / 2 + 2.0**-17


def distribution_problems(block: np.ndarray, tolerance: float) -> tuple[np.ndarray, str] | None:
    """The first element of ``block`` (rows along the last axis) that breaks the
    "distribution" rule, as an index into ``block`` and the reason in words; None if every row
    is either all NaN (unrecorded) or finite, >= 0 and summing to 1 within ``tolerance``."""
    with np.errstate(invalid="ignore", over="ignore"):
        nan = np.isnan(block)
        unrecorded = nan.all(-1, keepdims=True)
        bad = (~np.isfinite(block) | (block < 0)) & ~unrecorded
        if bad.any():
            at = np.unravel_index(int(np.flatnonzero(bad.reshape(-1))[0]), block.shape)
            return np.array(at), "finite and >= 0 in a recorded row (an unrecorded row is all NaN)"
        sums = block.sum(-1, dtype=np.float64)
        off = ~unrecorded[..., 0] & (np.abs(sums - 1.0) > tolerance)
    if off.any():
        row = np.unravel_index(int(np.flatnonzero(off.reshape(-1))[0]), off.shape)
        return np.array((*row, -1)), (
            f"rows summing to 1 within {tolerance:.2g} (this row sums to {float(sums[row]):.6g})"
        )
    return None


def disallowed(
    rule: str, v: np.ndarray, dims: Mapping[str, int], vocab_size: Any = None
) -> tuple[np.ndarray, str]:
    """The values of block ``v`` that ``rule`` (a value of :data:`RULES` other than
    "distribution", which is row-wise: :func:`distribution_problems`) does not allow, as a
    mask, and the allowed values in words. NaN is not in the mask: where it is allowed depends
    on what was recorded (:data:`UNRECORDED_MARK`; the reader checks it). ``dims`` are the store's dimension sizes (``step``:
    the horizon; ``vocab`` bounds tokens unless the store's ``vocab_size`` attribute is given).
    "kept" is checked here against >= 1 only (the reader bounds it by the prompt)."""
    if rule == "unit":
        with np.errstate(invalid="ignore"):
            bad = ~(np.isnan(v) | ((v >= -UNIT_SLACK) & (v <= 1 + UNIT_SLACK)))
        allowed = "finite and in [0, 1]"
    elif rule == "nonneg":
        with np.errstate(invalid="ignore"):
            bad = ~(np.isnan(v) | ((v >= -DIVERGENCE_SLACK) & (v < np.inf)))
        allowed = "finite and >= 0"
    elif rule == "divergence":
        with np.errstate(invalid="ignore"):
            bad = ~(np.isnan(v) | (v >= -DIVERGENCE_SLACK))
        allowed = ">= 0 (+inf where the supports differ)"
    elif rule == "token":
        bad = (v < -1) | (v >= dims["vocab"] if "vocab" in dims else False)
        if vocab_size is not None:
            bad = (v < -1) | (v >= int(vocab_size))
        allowed = f"in [-1, {vocab_size})"
    elif rule == "ternary":
        bad = (v < -1) | (v > 1)
        allowed = "in {-1, 0, 1}"
    elif rule == "step":
        horizon = dims["step"]
        bad = (v < 0) | (v > horizon)
        allowed = f"in [0, {horizon}] (the horizon)"
    elif rule in ("prompt", "kept"):
        bad = v < 1
        allowed = ">= 1 (a prompt has at least one token)" if rule == "prompt" else ">= 1"
    else:
        raise ValueError(f"no elementwise rule {rule!r}")
    return bad, allowed


# Attributes that define a run: resuming with any of them changed would mix two runs (the
# writer refuses it; the plan registry's id is their fingerprint).
RUN_KEYS = (
    "model_id",
    "model_revision",
    "model_sha256",  # a model loaded from a GGUF file: the file's content
    "dtype",
    "decoding",
    "policies",
    "horizon",
    "window",
    "branches",
    "replicates",
    "record",
    "vocab_size",
    "seed",
    "doc_ids",
    "source",
    "eos_token_id",
    "prompts_sha256",
    "attn_implementation",
)
