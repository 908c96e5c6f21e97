"""The suite's own layout: folders by area, markers used where they belong, and the torch-free
tests run (not skipped) where torch is not installed."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parents[1]
ROOT = TESTS.parent
AREAS = {
    "kernels", "synth", "store", "tracer", "analysis", "cli", "docs", "interop", "real_model"
}  # fmt: skip
# Tests that need no torch although they exercise tracer modules: prompt parsing and the
# memory footprint from numbers. They must pass, not skip, without torch.
TORCH_FREE = ["tests/tracer/test_prompt_files.py", "tests/tracer/test_memory_footprint.py"]
# What a test needs -> the marker it must carry.
NEEDS = {
    "torch": "torch",
    "transformers": "torch",
    "dask.distributed": "dask",
    "nbclient": "notebooks",
}


def _marks(decorators: list[ast.expr]) -> set[str]:
    out = set()
    for d in decorators:
        node = d.func if isinstance(d, ast.Call) else d
        if isinstance(node, ast.Attribute) and ast.unparse(node.value) == "pytest.mark":
            out.add(node.attr)
    return out


def _module_marks(tree: ast.Module) -> set[str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets
        ):
            values = node.value.elts if isinstance(node.value, ast.List) else [node.value]
            return _marks(values)
    return set()


def _needed(node: ast.AST) -> set[str]:
    """Markers the code under ``node`` needs: pytest.importorskip of a heavy dependency."""
    out = set()
    for call in ast.walk(node):
        if (
            isinstance(call, ast.Call)
            and ast.unparse(call.func) == "pytest.importorskip"
            and call.args
            and isinstance(call.args[0], ast.Constant)
        ):
            for module, mark in NEEDS.items():
                if call.args[0].value == module:
                    out.add(mark)
    return out


def _test_files() -> list[Path]:
    return sorted(TESTS.rglob("test_*.py"))


def test_test_files_live_in_area_folders():
    stray = [p.relative_to(TESTS) for p in _test_files() if p.parent.name not in AREAS]
    assert not stray, f"test files outside tests/{{{','.join(sorted(AREAS))}}}/: {stray}"
    documented = (ROOT / "docs" / "testing.md").read_text()
    for area in AREAS:
        assert f"tests/{area}/" in documented, f"docs/testing.md does not describe tests/{area}/"


@pytest.mark.parametrize("path", _test_files(), ids=lambda p: str(p.relative_to(TESTS)))
def test_tests_that_skip_without_a_dependency_carry_its_marker(path):
    """A test that importorskips torch (or dask.distributed, nbclient) is marked so that
    ``-m "not torch"`` deselects it instead of reporting a skip."""
    tree = ast.parse(path.read_text())
    module_marks = _module_marks(tree)
    at_top = set().union(*(_needed(n) for n in tree.body if not isinstance(n, ast.FunctionDef)))
    missing = [f"module needs {sorted(at_top - module_marks)}"] if at_top - module_marks else []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
            lacking = _needed(node) - module_marks - _marks(node.decorator_list)
            if lacking:
                missing.append(f"{node.name} needs {sorted(lacking)}")
    assert not missing, f"{path.relative_to(ROOT)}: unmarked: {missing}"


def test_torch_free_tests_pass_without_torch():
    """Run with torch and transformers unimportable: every test passes, none is skipped."""
    blocker = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] in ('torch', 'transformers'):\n"
        "            raise ImportError(f'No module named {name!r} (blocked)')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import pytest\n"
        f"sys.exit(pytest.main(['-q', '-rs', '-p', 'no:cacheprovider', *{TORCH_FREE!r}]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", blocker],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert " passed" in last and "skipped" not in last, last
