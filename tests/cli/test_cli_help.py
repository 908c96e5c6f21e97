"""Every command's help is complete: each option explains itself and shows its default, and no
reST markup from the docstrings that double as descriptions leaks into the terminal."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

import pytest

import kvcouple
from kvcouple.cli import build_parser


def _commands(
    parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()
) -> list[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    out = [(prefix, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out += _commands(sub, (*prefix, name))
    return out


COMMANDS = _commands(build_parser())
IDS = [" ".join(c) or "kvcouple" for c, _ in COMMANDS]


def test_the_commands_are_all_there() -> None:
    names = {" ".join(c) for c, _ in COMMANDS}
    for want in ("trace", "analyze", "info", "demo", "synth exact", "synth trace-store"):
        assert want in names, sorted(names)


@pytest.mark.parametrize(("command", "parser"), COMMANDS, ids=IDS)
def test_every_option_has_help_and_shows_its_default(
    command: tuple[str, ...], parser: argparse.ArgumentParser
) -> None:
    text = parser.format_help()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction | argparse._VersionAction):
            continue
        if isinstance(action, argparse._SubParsersAction):
            continue
        name = "/".join(action.option_strings) or action.dest
        assert action.help, f"kvcouple {' '.join(command)}: {name} has no help"
        shows_default = action.default in (None, False, argparse.SUPPRESS) or action.required
        if not shows_default and action.option_strings:
            expanded = parser._get_formatter()._get_help_string(action) % {
                "default": action.default
            }
            assert "default" in expanded.lower(), f"{name}: default {action.default!r} not shown"
            assert str(action.default) in expanded or "default:" in expanded.lower(), name
    assert "``" not in text, f"reST literal markup in `kvcouple {' '.join(command)} --help`"
    assert not re.search(r":(class|func|mod|meth):`", text), "reST roles in help"
    assert not re.search(r"::\s*$", text, re.M), "reST literal-block marker in help"


def test_defaults_appear_in_the_formatted_help() -> None:
    parser = dict(COMMANDS)[("synth", "estimate")]
    text = " ".join(parser.format_help().split())
    assert "(default: horizon)" in text  # --trace: a choice default, formatted by argparse
    assert "(default: 1000)" in text


def test_each_area_adds_the_commands_the_cli_lists_for_it() -> None:
    """A command line imports only the area that owns its command (``kvcouple.cli._AREAS``),
    so the table must name exactly what each area registers."""
    import importlib

    from kvcouple.cli import _AREAS, ArgumentParser

    for name, commands in _AREAS.items():
        parser = ArgumentParser(prog="kvcouple")
        sub = parser.add_subparsers(dest="command", parser_class=ArgumentParser)
        importlib.import_module(name).register(sub)
        assert tuple(sub.choices) == commands, name


@pytest.mark.parametrize(
    ("argv", "areas"),
    [
        (["analyze", "s.zarr"], ["kvcouple.analysis.cli"]),
        (["--debug", "trace", "--help"], ["kvcouple.tracer.cli"]),
        (["--help", "analyze"], None),  # the top-level help lists every command
        (["analyse", "s.zarr"], None),  # a misspelt command: the error lists every choice
        ([], None),
    ],
)
def test_a_command_line_imports_only_its_area(argv: list[str], areas: list[str] | None) -> None:
    from kvcouple.cli import _AREAS, _areas_for

    assert _areas_for(argv) == (list(_AREAS) if areas is None else areas)


def test_analyze_imports_neither_the_tracer_nor_the_writer(tmp_path) -> None:
    """``kvcouple analyze`` on a real store runs without what tracing and writing need (torch,
    the tracer's models, the synthetic trace writer): its fixed cost is start-up it uses."""
    import subprocess
    import sys

    from kvcouple.cli import main

    pair, store = tmp_path / "pair.npz", tmp_path / "s.zarr"
    assert main(["synth", "random-pair", "--vocab", "6", "--seed", "1", "--out", str(pair)]) == 0
    argv = ["synth", "trace-store", str(pair), "--out", str(store), "-T", "4", "-R", "2"]
    assert main(argv) == 0
    code = (
        "import sys\n"
        "from kvcouple.cli import main\n"
        "code = main(['analyze', sys.argv[1], '--out', sys.argv[2], '--no-figures', '--quiet'])\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')"
        " or m.startswith(('kvcouple.tracer', 'kvcouple.synth', 'kvcouple.models')))\n"
        "print(code, heavy)\n"
    )
    run = [sys.executable, "-c", code, str(store), str(tmp_path / "out")]
    out = subprocess.run(run, capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "0 []", out


def test_python_dash_m_kvcouple_is_the_command() -> None:
    """``python -m kvcouple`` runs the same command line (exit codes included)."""
    ok = subprocess.run(
        [sys.executable, "-m", "kvcouple", "--version"], capture_output=True, text=True
    )
    assert ok.returncode == 0 and kvcouple.__version__ in ok.stdout + ok.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "kvcouple", "synth", "exact", "--pair", "/nonexistent", "-T", "3"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "kvcouple synth exact: error: --pair" in bad.stderr
