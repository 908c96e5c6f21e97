"""Build the documentation site (``make docs``): execute every notebook, generate the CLI
reference, assemble ``build/docs-src`` and run ``mkdocs build --strict`` into ``build/site``.

    python scripts/build_docs.py            # everything
    python scripts/build_docs.py --reuse    # keep notebooks executed from the same source

A notebook that raises fails the build (nbclient stops at the first error cell). Executed
notebooks are kept in ``build/notebooks-executed``, each stamped with its source's sha256;
the test suite executes them there with this script's :func:`execute`
(``tests/docs/test_notebooks.py``), so CI's docs build, run after the tests on the same
checkout, reuses them (``--reuse``) instead of running every notebook a second time.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "build" / "docs-src"
SITE = ROOT / "build" / "site"
EXECUTED = ROOT / "build" / "notebooks-executed"


def source_sha256(notebook: Path) -> str:
    """The stamp an executed notebook carries of the source it ran."""
    return hashlib.sha256(notebook.read_bytes()).hexdigest()


def execute(notebook: Path, out: Path, timeout: int) -> float:
    """Run ``notebook`` top to bottom in a scratch folder; write it with outputs to ``out``
    (only if every cell ran), stamped with its source's sha256."""
    import nbclient
    import nbformat

    nb = nbformat.read(notebook, as_version=4)
    # The kernel's inline backend, whatever the caller's: figures become outputs.
    env = {k: v for k, v in os.environ.items() if k != "MPLBACKEND"}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvcouple-docs-") as cwd:
        client = nbclient.NotebookClient(
            nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": cwd}}
        )
        client.execute(env=env)
    seconds = time.perf_counter() - start
    nb.metadata["kvcouple_execution_seconds"] = round(seconds, 1)
    nb.metadata["kvcouple_source_sha256"] = source_sha256(notebook)
    out.parent.mkdir(parents=True, exist_ok=True)
    part = out.with_name(f".{out.name}.part")
    nbformat.write(nb, part)
    os.replace(part, out)  # whole or absent
    return seconds


def executed_from(notebook: Path, out: Path) -> bool:
    """Whether ``out`` holds ``notebook`` executed from its current source."""
    try:
        stamp = json.loads(out.read_text()).get("metadata", {}).get("kvcouple_source_sha256")
    except (OSError, ValueError):  # absent or not a notebook: executed again
        return False
    return stamp == source_sha256(notebook)


def notebook_title(path: Path) -> str:
    cells = json.loads(path.read_text())["cells"]
    for cell in cells:
        if cell["cell_type"] == "markdown":
            for line in "".join(cell["source"]).splitlines():
                if line.startswith("# "):
                    return line[2:].strip()
    return path.stem


def cli_reference() -> str:
    """Every command's ``--help``, as the terminal shows it."""
    import argparse as ap

    sys.path.insert(0, str(ROOT / "python"))
    from kvcouple.cli import build_parser

    def walk(parser: ap.ArgumentParser, name: str) -> list[tuple[str, ap.ArgumentParser]]:
        out = [(name, parser)]
        for action in parser._actions:
            if isinstance(action, ap._SubParsersAction):
                for sub, p in action.choices.items():
                    out += walk(p, f"{name} {sub}")
        return out

    os.environ["COLUMNS"] = "100"
    lines = [
        "# Command line",
        "",
        "`kvcouple COMMAND --help` prints each of these. Every option shows its default.",
        "",
    ]
    for name, parser in walk(build_parser(), "kvcouple"):
        lines += [f"## `{name}`", "", "```text", parser.format_help().rstrip(), "```", ""]
    return "\n".join(lines)


def rewrite_repo_links(text: str) -> str:
    """Links from docs/*.md to files outside docs/ (sources, notebooks) become plain text
    naming the path in the repository: the site has no copy of them."""
    text = re.sub(r"\]\(\.\./notebooks/?\)", "](index.md#start-here)", text)
    return re.sub(r"\[([^\]]+)\]\(\.\./([^)]+)\)", r"\1 (`\2` in the repository)", text)


# The parts of MathJax 2 (from the jupyter-server-mathjax package) that the notebook pages
# need for their maths: the combined TeX config, HTML-CSS output and its STIX web fonts (about
# 6 MB of the package's 12). The pages load it from the site itself (mkdocs.yml:
# custom_mathjax_url), never from a CDN.
MATHJAX_PARTS = (
    "MathJax.js", "LICENSE", "config", "extensions", "jax/input", "jax/element",
    "jax/output/HTML-CSS", "fonts/HTML-CSS",
)  # fmt: skip


def bundle_mathjax(dst: Path) -> None:
    """Copy MathJax's parts (:data:`MATHJAX_PARTS`) into the site's sources at ``dst``."""
    try:
        import jupyter_server_mathjax
    except ModuleNotFoundError:
        raise SystemExit(
            "the docs' maths renderer is missing: pip install -e '.[docs]' (jupyter-server-mathjax)"
        ) from None
    static = Path(jupyter_server_mathjax.__file__).parent / "static"
    for part in MATHJAX_PARTS:
        src = static / part
        if src.is_dir():
            shutil.copytree(src, dst / part)
        else:
            (dst / part).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / part)


def assemble(reuse: bool, timeout: int) -> list[tuple[str, str]]:
    if SRC.exists():
        shutil.rmtree(SRC)
    SRC.mkdir(parents=True)
    for md in (ROOT / "docs").rglob("*"):
        if md.is_file():
            dst = SRC / md.relative_to(ROOT / "docs")
            dst.parent.mkdir(parents=True, exist_ok=True)
            if md.suffix == ".md":
                dst.write_text(rewrite_repo_links(md.read_text()))
            else:
                shutil.copy2(md, dst)
    tutorials = []
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        out = EXECUTED / nb.name
        if reuse and executed_from(nb, out):
            print(f"== {nb.name}: executed from this source already", flush=True)
        else:
            print(f"== executing {nb.name}", flush=True)
            seconds = execute(nb, out, timeout)
            print(f"   {seconds:.0f} s", flush=True)
        (SRC / "notebooks").mkdir(exist_ok=True)
        shutil.copy2(out, SRC / "notebooks" / nb.name)
        tutorials.append((notebook_title(nb), f"notebooks/{nb.name}"))
    index = SRC / "index.md"
    index.write_text(
        index.read_text().replace(
            "{tutorials}", "\n".join(f"- [{title}]({path})" for title, path in tutorials)
        )
    )
    (SRC / "reference").mkdir(exist_ok=True)
    (SRC / "reference" / "cli.md").write_text(cli_reference())
    bundle_mathjax(SRC / "assets" / "mathjax")
    return tutorials


def build(tutorials: list[tuple[str, str]]) -> None:
    import yaml

    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    config["docs_dir"] = str(SRC)
    config["site_dir"] = str(SITE)
    for section in config["nav"]:
        if "Tutorials" in section:
            section["Tutorials"] = [{title: path} for title, path in tutorials]
    generated = ROOT / "build" / "mkdocs.yml"
    generated.write_text(yaml.safe_dump(config, sort_keys=False))
    subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--clean", "-f", str(generated)],
        check=True,
        cwd=ROOT,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--reuse", action="store_true", help="keep notebooks already executed from their source"
    )
    parser.add_argument("--timeout", type=int, default=900, help="seconds per notebook cell")
    args = parser.parse_args()
    tutorials = assemble(args.reuse, args.timeout)
    build(tutorials)
    print(f"site: {SITE / 'index.html'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
