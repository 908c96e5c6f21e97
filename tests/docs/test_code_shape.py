"""The analysis reads along its seams: no function in python/kvcouple/analysis/ longer than
80 lines of code (docstrings, comments and blank lines not counted)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ANALYSIS = Path(__file__).parents[2] / "python" / "kvcouple" / "analysis"
LIMIT = 80


def code_lines(source: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    body = source[node.lineno - 1 : node.end_lineno]
    code = [line for line in body if line.strip() and not line.strip().startswith("#")]
    doc = ast.get_docstring(node, clean=False)
    return len(code) - (len(doc.splitlines()) if doc else 0)


@pytest.mark.parametrize("path", sorted(ANALYSIS.glob("*.py")), ids=lambda p: p.name)
def test_no_analysis_function_is_longer_than_80_lines(path):
    text = path.read_text()
    source = text.splitlines()
    long = [
        f"{node.name} ({code_lines(source, node)} lines)"
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and code_lines(source, node) > LIMIT
    ]
    assert not long, f"{path.name}: split these along their seams: {long}"


def test_the_count_sees_a_long_function():
    source = "def f():\n    '''doc\n    more'''\n" + "    x = 1\n" * 81
    node = ast.parse(source).body[0]
    assert isinstance(node, ast.FunctionDef)
    assert code_lines(source.splitlines(), node) == 82  # the def line and 81 statements
