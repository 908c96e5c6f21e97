"""The report as one self-contained HTML page, rendered from its Markdown (same content).

Tables fit the page: every table sits in its own box that scrolls sideways when the table is
wider than the page (``.table-box``, ``overflow-x: auto``), and a cell may wrap between an
estimate and its interval (``0.605 [0.561, 0.632]``) but not inside the interval."""

from __future__ import annotations

import html
import re

from kvcouple.textsafe import split_markdown_row

_INTERVAL = re.compile(r"(\[[^\[\]]*\])")


_NUMBER = re.compile(r"^(-?\d|n/a$|nan$)")


def _cell(tag: str, text: str) -> str:
    """One table cell: :func:`_inline`, each bracketed interval kept on one line; numbers
    right-aligned (class ``num``), text left-aligned."""
    body = _INTERVAL.sub(r'<span class="ci">\1</span>', _inline(text))
    num = ' class="num"' if tag == "td" and _NUMBER.match(text) else ""
    return f"<{tag}{num}>{body}</{tag}>"


def _inline(text: str) -> str:
    """Escaped HTML of one Markdown line's text: **bold**, *italic* and `code`."""
    out = html.escape(text)
    out = re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", out)
    out = re.sub(r"(?<![\w*])\*(?!\s)(.+?)(?<!\s)\*(?![\w*])", r"<em>\1</em>", out)
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", out)


def html_page(markdown: str, images: dict[str, bytes], title: str) -> str:
    """A self-contained page rendered from the report's Markdown (same content): tables as
    HTML tables, figures inlined as base64 PNG with their captions."""
    import base64

    body: list[str] = []
    in_table = False
    in_list = False
    paragraph: list[str] = []

    def flush() -> None:
        if paragraph:
            body.append("<p>" + " ".join(_inline(x) for x in paragraph) + "</p>")
            paragraph.clear()

    for line in markdown.splitlines():
        if line.startswith("|"):
            flush()
            cells = split_markdown_row(line)
            if set("".join(cells)) <= set("-"):
                continue
            tag = "th" if not in_table else "td"
            if not in_table:
                body.append('<div class="table-box"><table>')
                in_table = True
            body.append("<tr>" + "".join(_cell(tag, c) for c in cells) + "</tr>")
            continue
        if in_table:
            body.append("</table></div>")
            in_table = False
        if in_list and not line.startswith("- "):
            body.append("</ul>")
            in_list = False
        figure = re.match(r"!\[(.*)\]\(figures/(.+)\.png\)$", line)
        if line.startswith("# "):
            flush()
            body.append(f"<h1>{_inline(line[2:])}</h1>")
        elif line.startswith("## "):
            flush()
            body.append(f"<h2>{_inline(line[3:])}</h2>")
        elif line.startswith("- "):
            flush()
            if not in_list:
                body.append("<ul>")
                in_list = True
            body.append(f"<li>{_inline(line[2:])}</li>")
        elif figure is not None:
            flush()
            alt, name = figure.groups()
            if name in images:
                data = base64.b64encode(images[name]).decode()
                body.append(
                    f'<figure><img alt="{html.escape(alt)}" src="data:image/png;base64,{data}"/>'
                )
        elif line.startswith("*Figure "):
            flush()
            body.append(f"<figcaption>{_inline(line)}</figcaption></figure>")
        elif line.strip():
            paragraph.append(line)
        else:
            flush()
    flush()
    if in_table:
        body.append("</table></div>")
    if in_list:
        body.append("</ul>")
    style = (
        "body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;"
        "color:#222;line-height:1.45}h1{font-size:1.6em}h2{margin-top:1.6em;border-bottom:1px solid #ddd}"
        ".table-box{max-width:100%;overflow-x:auto;margin:1em 0}"
        "table{border-collapse:collapse;font-size:92%}"
        "td,th{border:1px solid #ccc;padding:4px 9px;text-align:left;vertical-align:top}"
        "td.num{text-align:right}.ci{white-space:nowrap}th{background:#f0f0f0}"
        "img{max-width:100%}figure{margin:1.5em 0}figcaption{font-size:95%;color:#333;max-width:900px}"
        "code{background:#f4f4f4;padding:0 3px}li{margin:.3em 0}"
    )
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{style}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
    )
