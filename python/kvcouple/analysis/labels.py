"""How policies and numbers are written in tables, figures and the terminal.

Stores record each policy's canonical spec with every parameter spelled out
(``snapkv:retain=0.5,window=32,kernel=7,pool=avg``); reports label columns with the spec
minus the parameters at their registered defaults (``snapkv:retain=0.5``) and list the full
specs once, in a legend.

Numbers follow one rule everywhere (:func:`number`): :data:`SIGNIFICANT` significant figures.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

SIGNIFICANT = 3


def number(value: float, integer: bool = False) -> str:
    """``value`` to :data:`SIGNIFICANT` significant figures: ``0.605``, ``0.0189``, ``12.3``;
    exact zero as ``0``, magnitudes of 1000 and more as whole numbers (no exponent).

    Parameters
    ----------
    value : float
        A finite number (``nan`` and infinities are written as ``nan``, ``inf``).
    integer : bool, default False
        An integer-valued quantity (a step, a count): written as a whole number.

    Returns
    -------
    str
        The number as text.
    """
    v = float(value)
    if not math.isfinite(v):
        return str(v)
    if integer or abs(v) >= 10**SIGNIFICANT:
        return f"{v:.0f}"
    if v == 0:
        return "0"
    text = f"{v:#.{SIGNIFICANT}g}"
    if "e+" in text:  # 999.7 rounds up to 1.00e+03
        return f"{v:.0f}"
    return text.rstrip(".") if "e" not in text else text


def percent(value: float) -> str:
    """A fraction as a percentage by the same rule: ``0.605`` -> ``60.5%``.

    Parameters
    ----------
    value : float
        A fraction (1.0 is 100%).

    Returns
    -------
    str
        The percentage as text.
    """
    return number(100 * value) + "%"


def short_label(spec: str) -> str:
    """The policy spec without parameters that equal the policy's defaults.

    Parameters
    ----------
    spec : str
        A policy spec ``name[:param=value,...]`` as stored (or as typed on the command line).

    Returns
    -------
    str
        ``name:param=value,...`` keeping only the parameters that differ from the defaults of
        the registered policy ``name``; the spec unchanged when ``name`` is not registered
        (a plug-in policy of another session) or a value does not parse.
    """
    from kvcouple.policies import POLICIES

    name, _, rest = spec.partition(":")
    cls = POLICIES.get(name.strip().lower())
    if cls is None or not rest:
        return spec
    defaults: dict[str, tuple[type, Any]] = dict(cls.PARAMS)
    kept = []
    for item in rest.split(","):
        key, _, value = item.partition("=")
        if key in defaults:
            kind, default = defaults[key]
            try:
                if default is not None and kind(value) == default:
                    continue
            except (TypeError, ValueError):
                return spec
        kept.append(item)
    return name + (":" + ",".join(kept) if kept else "")


def policy_labels(specs: Sequence[str]) -> dict[str, str]:
    """Short, distinct labels for ``specs``: :func:`short_label`, or the full spec for any two
    that would otherwise read the same.

    Parameters
    ----------
    specs : sequence of str
        Policy specs (as stored).

    Returns
    -------
    dict
        ``{spec: label}`` in the order given.
    """
    short = {s: short_label(s) for s in specs}
    values = list(short.values())
    return {s: (lab if values.count(lab) == 1 else s) for s, lab in short.items()}
