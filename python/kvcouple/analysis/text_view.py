"""What diverged, as text: one document's prompt, the continuation P and Q shared up to the
first divergence, and the two sides' continuations after it, branch by branch, each token with
the TV at its step.

:func:`document_view` reads one (document, policy, replicate) of a store; :func:`terminal_lines`
writes it for a terminal (the first divergence marked ``>>``, each token shaded by its TV where
colour is on); :func:`view_json` for scripts. ``kvcouple show``, the report's text views and
the demo's closing pair all go through here. A store without text (schema version 3, a
synthetic store, a run without a tokenizer) is shown by token ids, and says so.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from kvcouple.errors import InvalidInputError
from kvcouple.store.reader import TraceStoreReader
from kvcouple.store.text import StoreText, open_text, text_status
from kvcouple.textsafe import terminal

__all__ = [
    "BranchView",
    "DocumentView",
    "Token",
    "document_view",
    "find_document",
    "find_policy",
    "pair_lines",
    "terminal_lines",
    "view_json",
]

# The marker of the first divergence in plain text.
MARK = ">>"
# Where the prompt is folded: its last lines, each cut to its last characters.
PROMPT_LINES = 3
PROMPT_CHARS = 240


@dataclass
class Token:
    """One generated token: its step (1..T), id, text (its share of the decoded text; ``[id]``
    without text) and the TV between P's and Q's next-token distributions at that step (the
    path's hazard before the divergence, the branch TV after; NaN where not recorded)."""

    step: int
    id: int
    text: str
    tv: float


@dataclass
class BranchView:
    """One branch of a replicate: the path shared up to its first divergence at ``step`` (0:
    the path never diverged within the horizon, then ``shared`` is the whole path and the
    sides are empty), then P's and Q's tokens from that step on."""

    branch: int
    step: int
    shared: list[Token]
    p: list[Token]
    q: list[Token]

    @property
    def mismatches(self) -> int:
        """Steps from the divergence on where the two sides' tokens differ."""
        return sum(a.id != b.id for a, b in zip(self.p, self.q, strict=False))


@dataclass
class DocumentView:
    """One document under one policy, one replicate: the prompt and every branch."""

    doc_id: str
    policy: str
    rep: int
    horizon: int
    has_text: bool
    text: str  # text_status(): what the store keeps
    prompt: str  # the prompt's text ("" without text)
    prompt_tokens: int
    branches: list[BranchView] = field(default_factory=list)

    @property
    def first_step(self) -> int:
        """The earliest first divergence among the branches (0: none)."""
        steps = [b.step for b in self.branches if b.step > 0]
        return min(steps) if steps else 0


def _candidates(values: Sequence[str], limit: int = 8) -> str:
    shown = ", ".join(f"'{terminal(v)}'" for v in values[:limit])
    return shown + (f" and {len(values) - limit} more" if len(values) > limit else "")


def find_document(reader: TraceStoreReader, doc_id: str) -> int:
    """The index of document ``doc_id``; an :class:`InvalidInputError` listing the store's
    documents otherwise."""
    try:
        return reader.doc_ids.index(doc_id)
    except ValueError:
        raise InvalidInputError(
            f"{reader.path} has no document '{terminal(doc_id)}'; its documents: "
            f"{_candidates(reader.doc_ids)}"
        ) from None


def find_policy(reader: TraceStoreReader, policy: str) -> int:
    """The index of ``policy``: its full spec as stored, or its short label (the spec minus
    parameters at their defaults, as the report writes it)."""
    from kvcouple.analysis.labels import policy_labels

    if policy in reader.policies:
        return reader.policies.index(policy)
    labels = policy_labels(reader.policies)
    found = [i for i, p in enumerate(reader.policies) if labels.get(p) == policy]
    if len(found) == 1:
        return found[0]
    raise InvalidInputError(
        f"{reader.path} has no policy '{terminal(policy)}'; its policies: "
        f"{_candidates(reader.policies)}"
    )


def _tokens(ids: np.ndarray, tvs: np.ndarray, first: int, texts: list[str] | None) -> list[Token]:
    out = []
    for i, (t, tv) in enumerate(zip(ids, tvs, strict=True)):
        text = texts[i] if texts is not None else f"[{int(t)}]"
        out.append(Token(first + i, int(t), text, float(tv)))
    return out


# What a view reads of its document (every policy and replicate: one engine call serves a
# batch of documents' views), with the marks that say where NaN is allowed (branch_mismatch)
# so that the batch's values are checked at once.
VIEW_READ = (
    "tokens", "hazard", "branch_step", "branch_mismatch", "branch_tokens_p", "branch_tokens_q",
    "branch_tv", "prompt_length",
)  # fmt: skip


def document_view(
    reader: TraceStoreReader,
    doc: int,
    policy: int,
    rep: int = 0,
    *,
    text: StoreText | None = None,
    status: str | None = None,
    summary: Mapping[str, np.ndarray] | None = None,
) -> DocumentView:
    """One (document, policy, replicate) of an open store, as text where the store keeps it.

    Parameters
    ----------
    reader : TraceStoreReader
        The open store.
    doc, policy, rep : int
        Indices along ``doc``, ``policy`` and ``rep``.
    text : StoreText, optional
        The store's text, when the caller opened it already (:func:`kvcouple.store.text.
        open_text`); read here otherwise.
    status : str, optional
        :func:`kvcouple.store.text.text_status`, likewise.
    summary : mapping, optional
        The document's :data:`VIEW_READ` variables, where the caller read them already (a
        batch of documents at once: :meth:`~kvcouple.store.reader.TraceStoreReader.
        read_summaries`); read here otherwise.

    Returns
    -------
    DocumentView
        The prompt and each branch's shared, P and Q tokens with their TVs.
    """
    if not 0 <= rep < reader.dims["rep"]:
        raise InvalidInputError(
            f"--rep must be in 0..{reader.dims['rep'] - 1} (the store has {reader.dims['rep']} "
            f"replicates), got {rep}"
        )
    if text is None and status is None:
        text = open_text(reader)
    status = status or text_status(reader)
    sel = (int(doc), int(policy), int(rep))

    def read(name: str) -> np.ndarray:
        if summary is not None and name in summary:
            return np.asarray(summary[name][sel[1:]])
        return reader.read(name, sel)

    tokens, hazard, steps = read("tokens"), read("hazard"), read("branch_step")
    tok_p, tok_q = read("branch_tokens_p"), read("branch_tokens_q")
    tv = read("branch_tv")
    prompt, n_prompt = "", 0
    if text is not None:
        ids = text.prompt_ids(doc)
        prompt, n_prompt = text.decode(ids), len(ids)
    elif summary is not None and "prompt_length" in summary:
        n_prompt = int(summary["prompt_length"])
    else:
        n_prompt = int(reader.read("prompt_length", (int(doc),)))
    view = DocumentView(
        reader.doc_ids[doc], reader.policies[policy], int(rep), int(reader.dims["step"]),
        text is not None, status, prompt, n_prompt,
    )  # fmt: skip
    path_len = int((tokens >= 0).sum())
    for k, t_star in enumerate(int(s) for s in steps):
        shared_n = path_len if t_star == 0 else t_star - 1
        shared_ids, shared_tv = tokens[:shared_n], hazard[:shared_n]
        sides = []
        for side in (tok_p[k], tok_q[k]):
            seen = side >= 0 if t_star else np.zeros(len(side), bool)
            sides.append((side[seen], tv[k][seen]))
        texts: list[list[str] | None] = [None, None, None]
        if text is not None:
            both = [text.pieces(np.concatenate([shared_ids, s[0]])) for s in sides]
            texts = [both[0][:shared_n], both[0][shared_n:], both[1][shared_n:]]
        view.branches.append(
            BranchView(
                k + 1,
                t_star,
                _tokens(shared_ids, shared_tv, 1, texts[0]),
                _tokens(sides[0][0], sides[0][1], t_star, texts[1]),
                _tokens(sides[1][0], sides[1][1], t_star, texts[2]),
            )
        )
    return view


def view_json(view: DocumentView) -> dict[str, Any]:
    """The view as JSON-ready data (NaN TVs as None)."""
    data = asdict(view)
    for b in data["branches"]:
        for part in ("shared", "p", "q"):
            for t in b[part]:
                t["tv"] = None if not math.isfinite(t["tv"]) else t["tv"]
    data["first_step"] = view.first_step
    return data


# Background colours (256-colour terminal) by TV: none below 0.05, then five steps to red.
_SHADES = (230, 223, 216, 209, 203)


def shade_index(tv: float) -> int:
    """0 (no shade: TV below 0.05 or unknown) to 5 (TV above 0.8)."""
    if not math.isfinite(tv) or tv < 0.05:
        return 0
    return min(5, 1 + int(tv / 0.2))


def _shaded(tokens: list[Token], color: bool) -> str:
    out = []
    for t in tokens:
        piece = terminal(t.text)
        level = shade_index(t.tv)
        if color and level:
            out.append(f"\x1b[48;5;{_SHADES[level - 1]}m\x1b[30m{piece}\x1b[0m")
        else:
            out.append(piece)
    return "".join(out)


def prompt_tail(prompt: str, lines: int = PROMPT_LINES, chars: int = PROMPT_CHARS) -> list[str]:
    """The prompt's last ``lines`` lines, each cut to its last ``chars`` characters."""
    parts = prompt.split("\n")
    tail = parts[-lines:]
    out = [terminal(x if len(x) <= chars else "..." + x[-chars:]) for x in tail]
    if len(parts) > lines:
        out.insert(0, f"({len(parts) - lines} lines above)")
    return out


def _tv(v: float) -> str:
    return "n/a" if not math.isfinite(v) else f"{v:.2f}"


def terminal_lines(view: DocumentView, color: bool = False) -> list[str]:
    """The view for a terminal: the prompt's last lines, then per branch the shared
    continuation, ``>>`` at the first divergence and P's and Q's continuations after it.
    ``color`` shades each token by its TV (ANSI background colours); without it, plain text."""
    head = (
        f"document '{terminal(view.doc_id)}', policy {terminal(view.policy)}, replicate "
        f"{view.rep}; T = {view.horizon}"
    )
    lines = [head]
    if view.has_text:
        lines.append(f"prompt ({view.prompt_tokens} tokens), last lines:")
        lines += ["  | " + x for x in prompt_tail(view.prompt)]
    else:
        lines.append(f"prompt: {view.prompt_tokens} tokens; {view.text}: token ids shown")
    if color:
        lines.append("shade: the TV between P and Q at each token's step (darker: larger)")
    for b in view.branches:
        if b.step == 0:
            lines.append(f"branch {b.branch}: no divergence within the horizon")
            lines.append(f"  shared  {_shaded(b.shared, color)}")
            continue
        at = b.p[0].tv if b.p else float("nan")
        lines.append(
            f"branch {b.branch}: first divergence at step {b.step} (TV there {_tv(at)}); "
            f"{b.mismatches} of {len(b.p)} tokens differ from there"
        )
        lines.append(f"  shared  {_shaded(b.shared, color)}")
        lines.append(f"  P    {MARK} {_shaded(b.p, color)}")
        lines.append(f"  Q    {MARK} {_shaded(b.q, color)}")
    return lines


def pair_lines(view: DocumentView, color: bool = False, tokens: int = 24) -> list[str]:
    """The view's first diverged branch, short: the last ``tokens`` shared tokens, then the
    first ``tokens`` of each side (the demo's closing pair); the whole path where none
    diverged."""
    branch = next((b for b in view.branches if b.step > 0), None)
    if branch is None:
        return ["  (no divergence within the horizon on this replicate)"]
    shared = branch.shared[-tokens:]
    lead = "..." if len(branch.shared) > len(shared) else ""
    lines = []
    if view.has_text:
        lines.append(f"  prompt ends    {prompt_tail(view.prompt, 1, 80)[-1]}")
    lines.append(f"  shared         {lead}{_shaded(shared, color)}")
    lines.append(f"  P, full     {MARK} {_shaded(branch.p[:tokens], color)}")
    lines.append(f"  Q, evicted  {MARK} {_shaded(branch.q[:tokens], color)}")
    return lines
