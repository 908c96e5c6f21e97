"""Every command's help is complete: each option explains itself and shows its default, and no
reST markup from the docstrings that double as descriptions leaks into the terminal."""

from __future__ import annotations

import argparse
import re

import pytest

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
    assert "(default: rb)" in text
    assert "(default: 1000)" in text
