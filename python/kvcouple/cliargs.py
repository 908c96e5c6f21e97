"""Argument types shared by the ``kvcouple`` subcommands, and the size arguments every command
that has them adds through one definition (:func:`add_horizon`, :func:`add_replicates`,
:func:`add_branches`, :func:`add_window`, :func:`add_seed`).

Each type is an ``argparse`` ``type=`` callable: a bad value becomes argparse's usage error
naming the option (``argument --horizon: 0 is not an integer >= 1``), exit status 2, the same
message in every command.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any, Literal

# Counts above this are refused outright (no run of kvcouple needs more; a typo like 1e20 should
# not turn into an allocation attempt).
MAX_COUNT = 2**40


def _int(text: str) -> int:
    try:
        return int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def _bounded(text: str, least: int, most: int = MAX_COUNT) -> int:
    n = _int(text)
    if n < least and most == MAX_COUNT:
        raise argparse.ArgumentTypeError(f"{n} is not an integer >= {least}")
    if not least <= n <= most:
        raise argparse.ArgumentTypeError(f"{n} is not an integer in [{least}, {most}]")
    return n


def positive(text: str) -> int:
    """An integer >= 1."""
    return _bounded(text, 1)


def nonnegative(text: str) -> int:
    """An integer >= 0."""
    return _bounded(text, 0)


def seed(text: str) -> int:
    """A random seed: an integer in [0, 2**64)."""
    return _bounded(text, 0, 2**64 - 1)


def finite_float(text: str) -> float:
    """A finite float (no nan, no inf)."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(x):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number")
    return x


def nonnegative_float(text: str) -> float:
    """A finite float >= 0."""
    x = finite_float(text)
    if not x >= 0:
        raise argparse.ArgumentTypeError(f"{text} is not a number >= 0")
    return x


def positive_float(text: str) -> float:
    """A finite float > 0."""
    x = finite_float(text)
    if not x > 0:
        raise argparse.ArgumentTypeError(f"{text} is not a number > 0")
    return x


def unit_open(text: str) -> float:
    """A float in (0, 1)."""
    x = finite_float(text)
    if not 0 < x < 1:
        raise argparse.ArgumentTypeError(f"{text} is not in (0, 1)")
    return x


def unit_half_open(text: str) -> float:
    """A float in (0, 1]."""
    x = finite_float(text)
    if not 0 < x <= 1:
        raise argparse.ArgumentTypeError(f"{text} is not in (0, 1]")
    return x


def positive_or_auto(text: str) -> int | Literal["auto"]:
    """An integer >= 1, or ``auto``."""
    if text == "auto":
        return "auto"
    try:
        return positive(text)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{e} (or 'auto')") from None


# The size arguments: one definition each (flag, type, help), so that a bad value gets the same
# message in every command. A command may give its own default, help or short flag (synth: -T).


def _size(
    p: argparse.ArgumentParser,
    flags: tuple[str, ...],
    kind: Callable[[str], int],
    help: str,
    default: Any,
    required: bool,
) -> None:
    if required:
        p.add_argument(*flags, type=kind, required=True, help=help)
    else:
        p.add_argument(*flags, type=kind, default=default, help=help)


def add_horizon(
    p: argparse.ArgumentParser,
    default: int | None = None,
    *,
    required: bool = False,
    help: str = "T: new tokens per trajectory",
    short: str | None = None,
) -> None:
    """``--horizon`` T: an integer >= 1."""
    _size(p, (*_short(short), "--horizon"), positive, help, default, required)


def add_replicates(
    p: argparse.ArgumentParser,
    default: int | None = None,
    *,
    help: str = "R: overlap paths per document",
    short: str | None = None,
) -> None:
    """``--replicates`` R: an integer >= 1."""
    _size(p, (*_short(short), "--replicates"), positive, help, default, False)


def add_branches(
    p: argparse.ArgumentParser,
    default: int | None = None,
    *,
    help: str = "K: residual branches per path",
    short: str | None = None,
) -> None:
    """``--branches`` K: an integer >= 1."""
    _size(p, (*_short(short), "--branches"), positive, help, default, False)


def add_window(
    p: argparse.ArgumentParser,
    default: int | None = None,
    *,
    help: str = "L: lags traced after a branch (>= horizon: to the horizon)",
    short: str | None = None,
) -> None:
    """``--window`` L: an integer >= 0."""
    _size(p, (*_short(short), "--window"), nonnegative, help, default, False)


def add_seed(
    p: argparse.ArgumentParser, default: int | None = 0, *, help: str = "random seed"
) -> None:
    """``--seed``: an integer in [0, 2**64)."""
    _size(p, ("--seed",), seed, help, default, False)


def _short(flag: str | None) -> tuple[str, ...]:
    return () if flag is None else (flag,)
