"""Every tutorial notebook runs top to bottom without error (they are docs; docs must work).
They run as the docs build runs them (``scripts/build_docs.py``'s ``execute``: a scratch
folder, the inline backend) and are kept where it keeps them, stamped with their source, so
that CI's docs build after the suite reuses them rather than running each a second time."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def _build_docs():
    spec = importlib.util.spec_from_file_location("build_docs", ROOT / "scripts" / "build_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.notebooks
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path: Path) -> None:
    pytest.importorskip("nbformat")
    pytest.importorskip("nbclient")
    docs = _build_docs()
    out = docs.EXECUTED / path.name
    docs.execute(path, out, timeout=600)  # raises at the first cell that raises
    nb = json.loads(out.read_text())
    errors = [
        o
        for cell in nb["cells"]
        if cell["cell_type"] == "code"
        for o in cell.get("outputs", [])
        if o.get("output_type") == "error"
    ]
    assert not errors, errors
    assert docs.executed_from(path, out)
    assert any(c.get("outputs") for c in nb["cells"] if c["cell_type"] == "code")


def test_the_docs_build_reuses_a_notebook_only_executed_from_its_source(tmp_path: Path) -> None:
    docs = _build_docs()
    source = tmp_path / "n.ipynb"
    source.write_text(json.dumps({"cells": [], "metadata": {}, "nbformat": 4}))
    out = tmp_path / "executed" / "n.ipynb"
    assert not docs.executed_from(source, out)  # never executed
    out.parent.mkdir()
    stamp = {"kvcouple_source_sha256": docs.source_sha256(source)}
    out.write_text(json.dumps({"cells": [], "metadata": stamp, "nbformat": 4}))
    assert docs.executed_from(source, out)
    source.write_text(source.read_text() + "\n")  # the source changed since
    assert not docs.executed_from(source, out)
    out.write_text(json.dumps({"cells": [], "metadata": {}, "nbformat": 4}))  # no stamp
    source.write_text(json.dumps({"cells": [], "metadata": {}, "nbformat": 4}))
    assert not docs.executed_from(source, out)
    out.write_text('{"cells": [')  # cut short
    assert not docs.executed_from(source, out)
