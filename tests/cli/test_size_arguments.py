"""The size arguments (horizon, replicates, branches, window, seed) are defined once
(:mod:`kvcouple.cliargs`): the same bad value gets the same message in every command."""

from __future__ import annotations

import pytest

from kvcouple.cli import main

# Each command with what it requires besides the size arguments (argparse reads no file).
COMMANDS = {
    "trace": ["trace", "--policy", "full", "--out", "run.zarr"],
    "demo": ["demo"],
    "prompts": ["prompts", "docs.jsonl", "--out", "prompts.jsonl"],
    "analyze": ["analyze", "run.zarr", "--out", "report"],
    "synth exact": ["synth", "exact", "--pair", "pair.npz", "--horizon", "3"],
    "synth estimate": ["synth", "estimate", "--pair", "pair.npz", "--horizon", "3"],
    "synth random-pair": ["synth", "random-pair", "--vocab", "3", "--out", "pair.npz"],
    "synth trace-store": ["synth", "trace-store", "pair.npz", "--out", "s.zarr", "--horizon", "3"],
}

# (argument, a bad value, the message after the option's name, the commands that have it)
CASES = [
    ("horizon", "0", "0 is not an integer >= 1",
     ["trace", "demo", "synth exact", "synth estimate", "synth trace-store"]),
    ("horizon", "x", "'x' is not an integer",
     ["trace", "demo", "synth exact", "synth estimate", "synth trace-store"]),
    ("replicates", "0", "0 is not an integer >= 1",
     ["trace", "demo", "synth estimate", "synth trace-store"]),
    ("branches", "-1", "-1 is not an integer >= 1",
     ["trace", "demo", "synth estimate", "synth trace-store"]),
    ("window", "-1", "-1 is not an integer >= 0",
     ["trace", "demo", "analyze", "synth exact", "synth estimate", "synth trace-store"]),
    ("seed", "-1", "-1 is not an integer in [0, 18446744073709551615]",
     ["trace", "demo", "prompts", "analyze", "synth random-pair", "synth estimate",
      "synth trace-store"]),
]  # fmt: skip


def _error_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize(
    ("command", "name", "value", "message"),
    [(c, name, value, message) for name, value, message, commands in CASES for c in commands],
)
def test_a_bad_size_gets_the_same_message_in_every_command(capsys, command, name, value, message):
    line = _error_line([*COMMANDS[command], f"--{name}={value}"], capsys)
    assert line.startswith(f"kvcouple {command}: error: argument "), line
    # The option's names (synth adds short ones: -T/--horizon), then the one message.
    assert line.endswith(f"--{name}: {message}"), line
