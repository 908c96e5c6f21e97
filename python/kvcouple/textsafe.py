"""Text from stores and files (document ids, policy names, model ids) made safe to show.

Ids come from users' prompt files and stores: a newline or ``|`` would split a Markdown table
cell or start a heading, an escape sequence would reach the terminal. Everything shown passes
through one of these functions.
"""

from __future__ import annotations

from typing import Any

_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def terminal(value: Any) -> str:
    """``str(value)`` with every non-printable character (control characters, escape
    sequences, bidirectional overrides) written as a visible escape such as ``\\x1b``."""
    s = str(value)
    if s.isprintable():
        return s
    out = []
    for c in s:
        if c.isprintable():
            out.append(c)
        elif c in _ESCAPES:
            out.append(_ESCAPES[c])
        elif ord(c) < 0x100:
            out.append(f"\\x{ord(c):02x}")
        elif ord(c) < 0x10000:
            out.append(f"\\u{ord(c):04x}")
        else:
            out.append(f"\\U{ord(c):08x}")
    return "".join(out)


def markdown_cell(value: Any) -> str:
    """Text for one Markdown table cell: on one line, ``|`` and ``\\`` escaped."""
    return terminal(value).replace("\\", "\\\\").replace("|", "\\|")


def split_markdown_row(line: str) -> list[str]:
    """The cells of a Markdown table row written with :func:`markdown_cell`, unescaped."""
    inner = line.strip()
    inner = inner[1:] if inner.startswith("|") else inner
    inner = inner[:-1] if inner.endswith("|") and not inner.endswith("\\|") else inner
    cells, cur, i = [], [], 0
    while i < len(inner):
        c = inner[i]
        if c == "\\" and i + 1 < len(inner):
            cur.append(inner[i + 1])
            i += 2
            continue
        if c == "|":
            cells.append("".join(cur).strip())
            cur = []
        else:
            cur.append(c)
        i += 1
    cells.append("".join(cur).strip())
    return cells
