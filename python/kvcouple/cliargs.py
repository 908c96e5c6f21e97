"""Argument types shared by the ``kvcouple`` subcommands.

Each is an ``argparse`` ``type=`` callable: a bad value becomes argparse's usage error naming
the option (``argument --horizon: 0 is not an integer >= 1``), exit status 2.
"""

from __future__ import annotations

import argparse
import math

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
