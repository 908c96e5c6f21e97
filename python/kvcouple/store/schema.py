"""The trace-store layout (SPEC section 8): one xarray Dataset in a Zarr store per run.

Schema version 1. Dimensions: ``doc, policy, rep, step (1..T), branch (1..K), lag (0..L)``,
``k`` (top-k records) and ``vocab`` (full records). Readable by plain ``xarray.open_zarr``.

Variables (every record level):

=====================  ==============================  =======  ==================================
name                   dims                            dtype    meaning
=====================  ==============================  =======  ==================================
doc_id                 doc                             str      the prompt's id
prompt_length          doc                             int32    prompt tokens
kept_length            doc, policy                     int32    prompt-cache entries kept per head
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
``dtype``, ``decoding`` ({temperature, top_k, top_p}), ``policies`` (list of {spec, name,
params}), ``horizon`` (T), ``window`` (L), ``branches`` (K), ``replicates`` (R), ``record``,
``vocab_size``, ``eos_token_id``, ``seed``, ``estimator`` ("rb": branches drawn from the
residual-branch law of SPEC section 4), ``source`` ("model" or "synthetic").
Completion is recorded per doc in the ``completed`` variable rather than in attrs, so that
several processes can fill one store without racing on the attribute document.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SCHEMA_VERSION = 1

# Sentinels for unobserved entries (after a stop, past the horizon, no branch).
NO_TOKEN = -1
NO_MISMATCH = -1

PATH_DIMS = ("doc", "policy", "rep", "step")
BRANCH_DIMS = ("doc", "policy", "rep", "branch")
LAG_DIMS = ("doc", "policy", "rep", "branch", "lag")

# name -> (dims, dtype, fill written where unobserved)
SUMMARY_VARIABLES: dict[str, tuple[tuple[str, ...], str]] = {
    "prompt_length": (("doc",), "int32"),
    "kept_length": (("doc", "policy"), "int32"),
    "completed": (("doc",), "bool"),
    "tokens": (PATH_DIMS, "int32"),
    "hazard": (PATH_DIMS, "float32"),
    "kl_pq": (PATH_DIMS, "float32"),
    "kl_qp": (PATH_DIMS, "float32"),
    "entropy_p": (PATH_DIMS, "float32"),
    "entropy_q": (PATH_DIMS, "float32"),
    "top1_agree": (PATH_DIMS, "bool"),
    "branch_step": (BRANCH_DIMS, "int32"),
    "branch_tv": (LAG_DIMS, "float32"),
    "branch_mismatch": (LAG_DIMS, "int8"),
    "branch_tokens_p": (LAG_DIMS, "int32"),
    "branch_tokens_q": (LAG_DIMS, "int32"),
}


@dataclass(frozen=True)
class Record:
    """What a run records beyond the summary: ``summary``, ``topk:K`` or ``full``."""

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


def variables(record: Record) -> dict[str, tuple[tuple[str, ...], str]]:
    """Every variable a store with this record level holds."""
    out = dict(SUMMARY_VARIABLES)
    if record.kind == "topk":
        for side in ("p", "q"):
            out[f"topk_ids_{side}"] = ((*PATH_DIMS, "k"), "int32")
            out[f"topk_probs_{side}"] = ((*PATH_DIMS, "k"), "float32")
            out[f"tail_mass_{side}"] = (PATH_DIMS, "float32")
            out[f"branch_topk_ids_{side}"] = ((*LAG_DIMS, "k"), "int32")
            out[f"branch_topk_probs_{side}"] = ((*LAG_DIMS, "k"), "float32")
            out[f"branch_tail_mass_{side}"] = (LAG_DIMS, "float32")
    elif record.kind == "full":
        for side in ("p", "q"):
            out[side] = ((*PATH_DIMS, "vocab"), "float16")
            out[f"branch_{side}"] = ((*LAG_DIMS, "vocab"), "float16")
    return out


def empty_value(dtype: str) -> object:
    """The value a writer puts where nothing was observed."""
    if dtype.startswith("float"):
        return np.nan
    if dtype == "bool":
        return False
    return -1
