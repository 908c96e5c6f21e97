"""Every module a kvcouple command imports is declared by the extra that command needs.

The analysis core runs in a subprocess under an import hook that records each import statement
(and ``importlib.import_module`` call) made by a kvcouple module of a top-level module that is neither the standard library nor a dependency the
package declares for that command (core, or core plus named extras), read from the installed
package's own metadata. scipy in the analysis (declared only by the test extra) failed the
README's main command on a fresh machine; this catches it where the dev install hides it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path

import pytest

_REQ_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirements() -> list[tuple[str, str, set[str]]]:
    """kvcouple's declared requirements as (distribution, extra or "" for the core, the
    extras of a self-reference such as ``kvcouple[tracer]``)."""
    out = []
    for req in metadata.requires("kvcouple") or []:
        name = _REQ_NAME.match(req)
        assert name, req
        extra = re.search(r"extra\s*==\s*['\"]([^'\"]+)['\"]", req.partition(";")[2])
        inner = re.search(r"\[([^\]]+)\]", req.partition(";")[0])
        nested = {e.strip() for e in inner.group(1).split(",")} if inner else set()
        out.append((_normalise(name.group(1)), extra.group(1) if extra else "", nested))
    return out


def declared_modules(extras: set[str]) -> set[str]:
    """Top-level import names of the distributions kvcouple declares directly for the core
    plus ``extras``, following self-references (``all`` -> ``kvcouple[tracer,...]``)."""
    reqs = _requirements()
    groups = {""} | set(extras)
    while True:
        more = {e for name, g, nested in reqs if g in groups and name == "kvcouple" for e in nested}
        if more <= groups:
            break
        groups |= more
    dists = {name for name, g, _ in reqs if g in groups and name != "kvcouple"}
    return {
        module
        for module, owners in metadata.packages_distributions().items()
        if any(_normalise(o) in dists for o in owners)
    }


HOOK = textwrap.dedent(
    r"""
    import builtins, importlib, json, sys
    allowed = set(json.loads(sys.argv[1]))
    report = sys.argv[2]
    found = []

    def note(importer, name):
        top = name.partition(".")[0]
        if importer.partition(".")[0] != "kvcouple" or top == "kvcouple":
            return
        if top not in allowed and top not in sys.stdlib_module_names:
            found.append([importer, name])

    # Every import statement, whether or not the module is loaded already (a dependency's own
    # import of it would hide a meta-path finder), and every importlib.import_module call.
    original_import = builtins.__import__
    def recorded_import(name, globals=None, locals=None, fromlist=(), level=0):
        if level == 0 and globals is not None:
            note(globals.get("__name__", ""), name)
        return original_import(name, globals, locals, fromlist, level)
    builtins.__import__ = recorded_import

    original_import_module = importlib.import_module
    def recorded_import_module(name, package=None):
        if not name.startswith("."):
            note(sys._getframe(1).f_globals.get("__name__", ""), name)
        return original_import_module(name, package)
    importlib.import_module = recorded_import_module

    import atexit
    atexit.register(lambda: open(report, "w").write(json.dumps(sorted(set(map(tuple, found))))))
    sys.argv = ["kvcouple", *sys.argv[3:]]
    from kvcouple.cli import main
    sys.exit(main())
    """
)


def run_recorded(tmp_path: Path, extras: set[str], argv: list[str]) -> list[list[str]]:
    report = tmp_path / f"imports-{len(list(tmp_path.iterdir()))}.json"
    allowed = sorted(declared_modules(extras))
    proc = subprocess.run(
        [sys.executable, "-c", HOOK, json.dumps(allowed), str(report), *argv],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(report.read_text())


def test_declared_modules_reads_the_metadata():
    core = declared_modules(set())
    assert {"numpy", "xarray", "zarr", "pandas"} <= core
    assert "torch" not in core and "scipy" not in core
    tracer = declared_modules({"tracer"})
    assert {"torch", "transformers"} <= tracer
    assert "matplotlib" in declared_modules({"all"})


def test_analysis_core_imports_only_declared_modules(tmp_path):
    """`kvcouple synth trace-store` and `kvcouple analyze --no-figures`: the core extra only."""
    pair = tmp_path / "pair.npz"
    store = tmp_path / "s.zarr"
    found = run_recorded(
        tmp_path, set(), ["synth", "random-pair", "--vocab", "10", "--out", str(pair)]
    )
    found += run_recorded(
        tmp_path,
        set(),
        ["synth", "trace-store", f"A={pair}", "--out", str(store), "-T", "8", "-R", "8",
         "--docs", "4", "--quiet"],
    )  # fmt: skip
    found += run_recorded(
        tmp_path,
        set(),
        ["analyze", str(store), "--out", str(tmp_path / "r"), "--no-figures", "--quiet"],
    )
    assert found == [], f"undeclared imports by kvcouple modules: {found}"


def test_the_hook_sees_an_undeclared_import(tmp_path):
    """The check itself: with numpy taken out of the allowed set, the same run reports it."""
    allowed = sorted(declared_modules(set()) - {"numpy"})
    report = tmp_path / "imports.json"
    proc = subprocess.run(
        [sys.executable, "-c", HOOK, json.dumps(allowed), str(report), "synth", "random-pair",
         "--vocab", "4", "--out", str(tmp_path / "p.npz")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert any(name.partition(".")[0] == "numpy" for _, name in json.loads(report.read_text()))


@pytest.mark.torch
def test_demo_imports_only_what_all_declares(tmp_path):
    """`kvcouple demo` (one document, a short horizon) with the `all` extra."""
    pytest.importorskip("torch")
    found = run_recorded(
        tmp_path,
        {"all"},
        ["demo", "--docs", "1", "--horizon", "4", "--jobs", "1", "--quiet", "--out",
         str(tmp_path / "demo")],
    )  # fmt: skip
    assert found == [], f"undeclared imports by kvcouple modules: {found}"
