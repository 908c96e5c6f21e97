"""The package's import graph: no cycles between its modules, and the tracer's layer order.

Every import statement counts, wherever it stands (module level, inside a function, under
``if``), so a cycle held apart only by a deferred import is still a cycle here. Only imports
of the package's own modules make edges: deferring an optional heavy dependency (torch,
transformers, zarr, dask, matplotlib) is fine.

The second test reads the tracer's code map in ``docs/tracer.md`` (one line a module, bottom
up) and checks that each tracer module imports only modules listed before it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "python" / "kvcouple"
DOC = ROOT / "docs" / "tracer.md"


def module_names() -> dict[str, Path]:
    """Dotted name -> file, for every module of the package (``pkg/__init__.py`` is ``pkg``;
    a ``.pyi`` stub stands for a compiled module: the Rust core)."""
    out = {}
    for path in sorted([*PACKAGE.rglob("*.py"), *PACKAGE.rglob("*.pyi")]):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement at any depth (``if TYPE_CHECKING:`` ones too: a cycle of
    annotations is still two modules that each need the other to be read)."""
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]


def _lazy_exports(tree: ast.Module) -> list[str]:
    """Modules named by a module-level ``_EXPORTS = {name: "module"}`` table (a package
    ``__getattr__`` importing them on first use: still an edge)."""
    out = []
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in node.targets)
            and isinstance(node.value, ast.Dict)
        ):
            for value in node.value.values:
                if isinstance(value, ast.Constant) and isinstance(value.value, str):
                    out.append(value.value)
    return out


def import_graph() -> dict[str, set[str]]:
    """Package module -> the package modules it imports (any depth)."""
    modules = module_names()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: list[str] = list(_lazy_exports(tree))
        for node in _imports(tree):
            if isinstance(node, ast.Import):
                targets += [alias.name for alias in node.names]
                continue
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            # `from pkg import sub` imports the submodule (its package is imported first
            # anyway, as for every import); `from pkg import name` reads the package.
            subs = [f"{source}.{alias.name}" for alias in node.names]
            targets += [s for s in subs if s in modules]
            if len(subs) > len([s for s in subs if s in modules]):
                targets.append(source)
        for target in targets:
            if target in modules and target != name:
                graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_a_cycle(graph, set(c), c[0]) for c in components]


def _a_cycle(graph: dict[str, set[str]], members: set[str], start: str) -> list[str]:
    """A shortest cycle through ``start`` within one component (breadth first)."""
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [*reversed(path), start]
                if w not in previous:
                    previous[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start}")  # pragma: no cover


def test_the_graph_sees_deferred_and_relative_imports():
    graph = import_graph()
    # A module-level import, and one inside a function (the CLI's error handling).
    assert "kvcouple.errors" in graph["kvcouple.tracer.prompts"]
    assert "kvcouple.errors" in graph["kvcouple.cli"]
    # The tracer package's lazy exports are edges too.
    assert "kvcouple.tracer.run" in graph["kvcouple.tracer"]
    tree = ast.parse("def f():\n    from . import b\n    from .c import d\n")
    assert len(_imports(tree)) == 2


def test_cycles_are_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_between_package_modules():
    found = cycles(import_graph())
    assert not found, "import cycles (imports at any depth count):\n" + "\n".join(
        " -> ".join(c) for c in found
    )


def code_map() -> list[str]:
    """The tracer modules listed in docs/tracer.md's code map, bottom up."""
    text = DOC.read_text()
    section = text.split("## Code map", 1)
    assert len(section) == 2, "docs/tracer.md has no '## Code map' section"
    body = section[1].split("\n## ", 1)[0]
    return re.findall(r"^\d+\.\s+`tracer/(\w+)\.py`", body, flags=re.MULTILINE)


def test_tracer_modules_import_only_the_layers_below_them():
    order = code_map()
    tracer = {n.rpartition(".")[2] for n in module_names() if n.startswith("kvcouple.tracer.")}
    assert len(order) == len(set(order)), f"a module is listed twice: {order}"
    assert set(order) == tracer, (
        f"docs/tracer.md's code map and tracer/ differ: missing {sorted(tracer - set(order))}, "
        f"not modules {sorted(set(order) - tracer)}"
    )
    layer = {name: i for i, name in enumerate(order)}
    graph = import_graph()
    upward = []
    for name in order:
        for target in sorted(graph[f"kvcouple.tracer.{name}"]):
            short = target.removeprefix("kvcouple.tracer.")
            if short in layer and layer[short] >= layer[name]:
                upward.append(
                    f"{name} (layer {layer[name]}) imports {short} (layer {layer[short]})"
                )
    assert not upward, "tracer imports against docs/tracer.md's layer order:\n" + "\n".join(upward)


def _code_lines(path: Path, node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines of code of a function: no docstring, blank lines or comments."""
    body = node.body
    first = body[0]
    docstring = isinstance(first, ast.Expr) and isinstance(
        getattr(first, "value", None), ast.Constant
    )
    start = (body[1].lineno if len(body) > 1 else node.end_lineno) if docstring else first.lineno
    lines = path.read_text().splitlines()[(start or 1) - 1 : node.end_lineno]
    return sum(1 for line in lines if line.strip() and not line.strip().startswith("#"))


def test_tracer_functions_are_short():
    """A function of the tracer reads in one screen: at most 80 lines of code."""
    long = []
    for path in sorted((PACKAGE / "tracer").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = _code_lines(path, node)
                if n > 80:
                    long.append(f"{path.name}:{node.lineno} {node.name}: {n} lines")
    assert not long, "\n".join(long)
