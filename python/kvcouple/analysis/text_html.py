"""The report's text: what P and Q wrote around the first divergence, and a table of every
document's estimates (HTML, inserted into report.html).

Per store and policy, the documents that diverged earliest and latest (by the restricted mean
time to divergence E[min(tau, T)] = T - E[(T - tau)+]) are shown open, as the side-by-side
view of ``kvcouple show`` (:mod:`kvcouple.analysis.text_view`): the prompt's end (the whole
prompt folded), the continuation both shared, the first divergence marked, then P's and Q's
continuations in two columns, each token shaded by the TV at its step. Below, a per-document
table (sortable by clicking a column head: a few lines of inline script, nothing fetched)
links every document to its view, folded further down.

Everything that comes from a store or a prompt file (ids, policy specs, prompt and generated
text) is HTML-escaped, and characters that do not print (control characters, escape
sequences, bidirectional overrides) are written as visible escapes; newlines and tabs stay.
The page stays light: each view keeps the last :data:`SHARED_TOKENS` shared tokens and the
first :data:`SIDE_TOKENS` of each side, tokens of one shade are one element, folded prompts
keep their last :data:`PROMPT_CHARS` characters, and views are written for at most
:data:`MAX_VIEWS` documents per store.
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from kvcouple.analysis.labels import number, policy_labels
from kvcouple.analysis.tables import Rows
from kvcouple.analysis.text_view import (
    VIEW_READ,
    DocumentView,
    Token,
    document_view,
    shade_index,
)
from kvcouple.errors import StoreError
from kvcouple.store.text import open_text, text_status
from kvcouple.textsafe import terminal

__all__ = ["MARKER", "text_section", "visible"]

SHARED_TOKENS = 48
SIDE_TOKENS = 48
PROMPT_CHARS = 2000
MAX_VIEWS = 200
# Documents in the HTML per-document table: a page a browser sorts at once; beyond, the table
# holds the first ones and says where every document is (per_document.csv).
MAX_TABLE_DOCS = 2000
PREFETCH = 64  # documents' view variables per engine call

# The Markdown report's sentence that report.html replaces by the views.
MARKER = (
    "The text of P and Q around each first divergence and the per-document table are in "
    "report.html; kvcouple show prints any document's in a terminal."
)

STYLE = (
    ".tv-view{border:1px solid #ddd;border-radius:4px;padding:.5em .8em;margin:.8em 0}"
    ".tv-view h3{font-size:1em;margin:.2em 0 .4em}"
    ".tv-txt{font-family:ui-monospace,monospace;font-size:90%;white-space:pre-wrap;"
    "overflow-wrap:anywhere;min-width:0}"
    ".tv-sides{display:grid;grid-template-columns:1fr 1fr;gap:.3em 1em}"
    ".tv-sides>div{min-width:0}.tv-who{font-weight:600;font-size:85%;color:#555}"
    ".tv-mark{color:#b00;font-weight:700}.tv-prompt summary{cursor:pointer;color:#444}"
    ".s1{background:#fff3c4}.s2{background:#ffe0a8}.s3{background:#ffc48a}"
    ".s4{background:#ff9f7a}.s5{background:#ff7a70}"
    "table.sortable th{cursor:pointer}table.sortable th:after{content:' \\2195';color:#999}"
    "details.tv-doc>summary{cursor:pointer}"
)

# Click a column head to sort by it (numbers by value: data-v); follow a link to a folded
# view and it opens.
SCRIPT = (
    "document.querySelectorAll('table.sortable th').forEach(function(th,i){th.onclick="
    "function(){var t=th.closest('table'),b=t.tBodies[0],r=Array.from(b.rows),"
    "d=th.dataset.dir==='a'?-1:1;th.dataset.dir=d>0?'a':'d';r.sort(function(x,y){"
    "var p=x.cells[i],q=y.cells[i],u=p.dataset.v,w=q.dataset.v;if(u!==undefined&&"
    "w!==undefined){return d*((+u)-(+w))}return d*p.textContent.localeCompare("
    "q.textContent)});r.forEach(function(x){b.appendChild(x)})}});"
    "function kvOpen(){var e=location.hash&&document.getElementById(location.hash.slice(1));"
    "if(e&&e.tagName==='DETAILS'){e.open=true}}window.addEventListener('hashchange',kvOpen);"
    "kvOpen();"
)


def visible(text: str) -> str:
    """``text`` HTML-escaped, every character that does not print written as a visible escape
    (``\\x1b``), newlines and tabs kept."""
    if not text.isprintable():
        text = "".join(c if c in "\n\t" or c.isprintable() else terminal(c) for c in text)
    return html.escape(text)


def _tokens_html(tokens: list[Token]) -> str:
    """Tokens as text, runs of one shade (the TV at their step) in one element."""
    out: list[str] = []
    run: list[str] = []
    level = 0
    for t in tokens:
        shade = shade_index(t.tv)
        if shade != level and run:
            body = "".join(run)
            out.append(f'<span class="s{level}">{body}</span>' if level else body)
            run = []
        level = shade
        run.append(visible(t.text))
    if run:
        body = "".join(run)
        out.append(f'<span class="s{level}">{body}</span>' if level else body)
    return "".join(out)


def _prompt_html(view: DocumentView, chars: int = PROMPT_CHARS) -> str:
    if not view.has_text:
        return (
            f'<p class="tv-who">prompt: {view.prompt_tokens} tokens; '
            f"{html.escape(view.text)}: token ids shown</p>"
        )
    prompt = view.prompt
    cut = ""
    if len(prompt) > chars:
        cut = f"(the first {len(prompt) - chars} characters are not shown)\n"
        prompt = prompt[-chars:]
    last = prompt.rstrip("\n").rsplit("\n", 1)[-1][-160:]
    return (
        f'<details class="tv-prompt"><summary>prompt ({view.prompt_tokens} tokens), ending '
        f'<span class="tv-txt">{visible(last)}</span></summary>'
        f'<div class="tv-txt">{html.escape(cut)}{visible(prompt)}</div></details>'
    )


def view_html(view: DocumentView, title: str, anchor: str = "", prompt: bool = True) -> str:
    """One view: the prompt (folded; left out with ``prompt=False``), the shared
    continuation, the first divergence marked, then P's and Q's continuations side by side
    (the first branch that diverged; the whole path where none did)."""
    branch = next(
        (b for b in view.branches if b.step > 0), view.branches[0] if view.branches else None
    )
    parts = [f"<h3>{title}</h3>", _prompt_html(view) if prompt else ""]
    if branch is None:
        return f'<div class="tv-view"{anchor}>' + "".join(parts) + "</div>"
    shared = branch.shared[-SHARED_TOKENS:]
    more = len(branch.shared) - len(shared)
    lead = f"... ({more} tokens) " if more else ""
    if branch.step == 0:
        parts.append(
            '<p class="tv-who">no divergence within the horizon on this replicate: the shared '
            "continuation</p>"
            f'<div class="tv-txt">{lead}{_tokens_html(shared)}</div>'
        )
        return f'<div class="tv-view"{anchor}>' + "".join(parts) + "</div>"
    tv = branch.p[0].tv if branch.p else math.nan
    span = f"steps 1..{branch.step - 1}" if branch.step > 1 else "none: they differ from step 1"
    parts.append(
        f'<p class="tv-who">shared continuation: {span}; first divergence '
        f"at step {branch.step} (TV {number(tv) if math.isfinite(tv) else 'n/a'}); "
        f"{branch.mismatches} of {len(branch.p)} tokens differ from there</p>"
        f'<div class="tv-txt">{html.escape(lead)}{_tokens_html(shared)}'
        '<span class="tv-mark"> &#9654;</span></div>'
    )
    sides = []
    for who, tokens in (("P (full cache)", branch.p), ("Q (evicted)", branch.q)):
        shown = tokens[:SIDE_TOKENS]
        rest = f" ... ({len(tokens) - len(shown)} more)" if len(tokens) > len(shown) else ""
        sides.append(
            f'<div><div class="tv-who">{who}</div><div class="tv-txt">'
            f'<span class="tv-mark">&#9654; </span>{_tokens_html(shown)}{rest}</div></div>'
        )
    parts.append('<div class="tv-sides">' + "".join(sides) + "</div>")
    return f'<div class="tv-view"{anchor}>' + "".join(parts) + "</div>"


def _estimates(result: Any, m: Any, tables: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per quantity of :data:`COLUMNS`, an array (documents with units, in ``m.docs``'s order x
    policies; NaN where missing): occurrence, RMST (T - occupation), E[M]/T, mean KL and the
    share of same top tokens on the path."""
    docs = [d for d in m.docs if d.units is not None]
    at = {d.doc_id: i for i, d in enumerate(docs)}
    P = len(m.policies)
    out = {k: np.full((len(docs), P), np.nan) for k, _ in COLUMNS}
    rows = tables.get("per_document", [])
    columns = rows.text_columns() if isinstance(rows, Rows) else None
    if columns is not None and len(columns.column("model")) == 0:
        columns = None
    if columns is not None:  # many rows: column by column (document-major, as m.policies)
        mine = columns.column("model") == m.model
        if int(mine.sum()) == len(docs) * P:
            occupation = columns.column("occupation")[mine].reshape(len(docs), P)
            out["occurrence"] = columns.column("occurrence")[mine].reshape(len(docs), P)
            out["rmst"] = m.horizon - occupation
            expected = columns.column("expected_mismatches")[mine].reshape(len(docs), P)
            out["mismatch_fraction"] = expected / m.horizon
        else:
            columns = None
    if columns is None:
        policy = {p: k for k, p in enumerate(m.policies)}
        for r in rows:
            if r["model"] != m.model or r["doc_id"] not in at or r["policy"] not in policy:
                continue
            i, k = at[r["doc_id"]], policy[r["policy"]]
            out["occurrence"][i, k] = float(r["occurrence"])
            out["rmst"][i, k] = m.horizon - float(r["occupation"])
            out["mismatch_fraction"][i, k] = float(r["expected_mismatches"]) / m.horizon
    means = getattr(m, "path_means", None) or {}
    # Each of m.docs's place among the documents with units (-1: none).
    place = np.array([at.get(d.doc_id, -1) for d in m.docs], np.int64)
    for q in ("kl_pq", "same_top"):
        for pol, values in means.get(q, {}).items():
            if pol in m.policies:
                v = np.asarray(values, np.float64)
                out[q][place[place >= 0], m.policies.index(pol)] = v[place >= 0]
    return out


# The per-document table's columns: (key, head).
COLUMNS = (
    ("occurrence", "occurrence P(tau<=T)"),
    ("rmst", "mean time to divergence E[min(tau,T)]"),
    ("mismatch_fraction", "E[M]/T"),
    ("kl_pq", "mean KLD (path)"),
    ("same_top", "same top p (path)"),
)


def _cell(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return '<td class="num" data-v="-1e300">n/a</td>'
    return f'<td class="num" data-v="{value!r}">{number(value)}</td>'


class _Store:
    """One store's text views: its reader and text, the policies' labels, the documents'
    estimates, and the views read so far (each (document, policy) read once)."""

    def __init__(self, result: Any, m: Any, tables: dict[str, list[dict[str, Any]]]):
        self.m = m
        self.reader = m.open_reader()
        self.text, self.status = open_text(self.reader), text_status(self.reader)
        self.labels = {p: visible(terminal(lab)) for p, lab in policy_labels(m.policies).items()}
        self.estimates = _estimates(result, m, tables)
        self.docs = [d for d in m.docs if d.units is not None]
        self.position = {doc_id: i for i, doc_id in enumerate(self.reader.doc_ids)}
        self.views: dict[tuple[int, str], DocumentView] = {}
        self.summaries: dict[int, Mapping[str, np.ndarray]] = {}

    def prefetch(self, doc_ids: list[str]) -> None:
        """The views' variables of these documents, a batch per engine call (where the engine
        cannot, or a document is damaged, each view reads its own and names the damage)."""
        docs = [self.position[d] for d in doc_ids if self.position[d] not in self.summaries]
        for i in range(0, len(docs), PREFETCH):
            batch = docs[i : i + PREFETCH]
            try:
                got = self.reader.read_summaries(batch, VIEW_READ)
            except StoreError:
                got = None
            if got is not None:
                self.summaries.update(zip(batch, got, strict=True))

    def view(self, doc_id: str, pol: str) -> DocumentView:
        key = (self.position[doc_id], pol)
        if key not in self.views:
            self.views[key] = document_view(
                self.reader, key[0], self.m.policies.index(pol), 0, text=self.text,
                status=self.status, summary=self.summaries.get(key[0]),
            )  # fmt: skip
        return self.views[key]

    def extremes(self) -> list[str]:
        """Per policy, the documents that diverged earliest and latest (by E[min(tau, T)])."""
        out = []
        for k, pol in enumerate(self.m.policies):
            rmst = self.estimates["rmst"][:, k]
            known = np.flatnonzero(~np.isnan(rmst))
            # The first earliest and the last latest in document order (a stable sort's ends).
            picks = []
            if known.size:
                picks.append(("diverged earliest", int(known[np.argmin(rmst[known])])))
            if known.size > 1:
                last = known[::-1][np.argmax(rmst[known][::-1])]
                picks.append(("diverged latest", int(last)))
            for what, i in picks:
                d = self.docs[i]
                title = (
                    f"{self.labels[pol]}: {what}: document {visible(terminal(d.doc_id))} "
                    f"(E[min(tau,T)] = {number(float(rmst[i]))} of T = {self.m.horizon})"
                )
                out.append(view_html(self.view(d.doc_id, pol), title))
        return out

    def table(self, anchors: dict[str, str], where: str) -> list[str]:
        """Every document's estimates, per policy, each document linked to its view."""
        more = len(self.docs) > MAX_VIEWS
        shown = self.docs[:MAX_TABLE_DOCS]
        head = (
            "Every document's estimates"
            if len(shown) == len(self.docs)
            else f"The first {len(shown):,} of {len(self.docs):,} documents' estimates (every "
            "document's are in per_document.csv)"
        )
        out = [
            f"<h3>Every document{where}</h3><p>{head}, per policy (means "
            "over its replicates; KLD and same top p on its overlap paths). Click a column head "
            "to sort; follow a document to its view"
            + (f" (views are written for the first {MAX_VIEWS} documents; kvcouple show "
               "prints any)" if more else "")
            + '.</p><div class="table-box"><table class="sortable"><thead><tr>'
            "<th>document</th><th>policy</th>"
            + "".join(f"<th>{html.escape(h)}</th>" for _, h in COLUMNS)
            + "</tr></thead><tbody>"
        ]  # fmt: skip
        for i, d in enumerate(shown):
            name = visible(terminal(d.doc_id))
            link = f'<a href="#{anchors[d.doc_id]}">{name}</a>' if d.doc_id in anchors else name
            for k, pol in enumerate(self.m.policies):
                cells = "".join(_cell(float(self.estimates[q][i, k])) for q, _ in COLUMNS)
                out.append(f"<tr><td>{link}</td><td>{self.labels[pol]}</td>{cells}</tr>")
        return [*out, "</tbody></table></div>"]

    def folded(self, anchors: dict[str, str]) -> list[str]:
        """Each document's views, folded: its prompt once, then one view per policy."""
        out = []
        for doc_id, anchor in anchors.items():
            first = self.view(doc_id, self.m.policies[0])
            body = _prompt_html(first, PROMPT_CHARS // 2) + "".join(
                view_html(self.view(doc_id, pol), self.labels[pol], prompt=False)
                for pol in self.m.policies
            )
            out.append(
                f'<details class="tv-doc" id="{anchor}"><summary>document '
                f"{visible(terminal(doc_id))}</summary>{body}</details>"
            )
        return out


def _model_html(result: Any, m: Any, tables: dict[str, list[dict[str, Any]]], index: int) -> str:
    store = _Store(result, m, tables)
    where = f" ({visible(terminal(m.model))})" if len(result.models) > 1 else ""
    anchors = {d.doc_id: f"kv-view-{index}-{i}" for i, d in enumerate(store.docs[:MAX_VIEWS])}
    store.prefetch(list(anchors))
    intro = (
        f"<p>The text: {html.escape(store.status)}. Each view is replicate 0 of a document: the "
        "continuation P and Q shared, the first divergence (&#9654;), then each side's "
        "continuation; a token's shade is the TV between P's and Q's next-token distributions "
        'at its step (<span class="s1">&ge;0.05</span> <span class="s2">&ge;0.2</span> '
        '<span class="s3">&ge;0.4</span> <span class="s4">&ge;0.6</span> '
        '<span class="s5">&ge;0.8</span>).</p>'
    )
    parts = [f"<h2>What diverged{where}</h2>", intro, *store.extremes()]
    parts += store.table(anchors, where) + store.folded(anchors)
    return "\n".join(parts)


def text_section(result: Any, tables: dict[str, list[dict[str, Any]]]) -> str:
    """The HTML of every store's text views and per-document table, with its style and
    script; a store that cannot be read for them says why instead."""
    parts = [f"<style>{STYLE}</style>"]
    for i, m in enumerate(result.models):
        try:
            parts.append(_model_html(result, m, tables, i))
        except (StoreError, OSError) as e:
            parts.append(
                f"<p>The text views of {visible(terminal(m.store))} cannot be shown: "
                f"{visible(terminal(e))}</p>"
            )
    parts.append(f"<script>{SCRIPT}</script>")
    return "\n".join(parts)


def markdown_lines() -> list[str]:
    """The Markdown report's place for the text (report.html puts the views there)."""
    return ["\n## What diverged\n", MARKER]


def with_text(page: str, result: Any, tables: dict[str, list[dict[str, Any]]]) -> str:
    """report.html with the text views in the place :func:`markdown_lines` keeps for them."""
    place = f"<h2>What diverged</h2>\n<p>{html.escape(MARKER)}</p>"
    section = text_section(result, tables)
    if place in page:
        return page.replace(place, section, 1)
    return page.replace("</body>", section + "\n</body>", 1)
