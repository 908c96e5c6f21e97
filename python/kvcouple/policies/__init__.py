"""KV-cache eviction policies (SPEC section 7), a registry, and spec-string parsing.

``parse_policy("snapkv:retain=0.5")`` builds a policy from its CLI form
``name[:param=value[,param=value...]]``. See :mod:`kvcouple.policies.base` for the interface,
the rounding of kept counts, and how to plug in a scorer of your own.
"""

from __future__ import annotations

from kvcouple.policies.base import (
    POLICIES,
    Admission,
    Policy,
    ScorePolicy,
    kept_count,
    register_policy,
    top_indices,
)
from kvcouple.policies.context import PolicyContext
from kvcouple.policies.decode import (
    DecodeCache,
    DecodeContext,
    DecodeRule,
    RescoreRule,
    SlotScoreRule,
)
from kvcouple.policies.errors import PolicyError, PolicyParameterError, UnknownPolicyError
from kvcouple.policies.full import Full
from kvcouple.policies.h2o import H2O
from kvcouple.policies.knorm import KNorm
from kvcouple.policies.kvpress import KVPress
from kvcouple.policies.observed import Observed
from kvcouple.policies.page import PAGE
from kvcouple.policies.random import Random
from kvcouple.policies.recent import Recent
from kvcouple.policies.snapkv import SnapKV
from kvcouple.policies.streaming import Streaming
from kvcouple.policies.tova import TOVA
from kvcouple.policies.valuediff import ValueDiff

_BUILTIN = (Full, SnapKV, Recent, Streaming, H2O, Observed, Random, KNorm, TOVA, ValueDiff, PAGE)
for _cls in (*_BUILTIN, KVPress):
    register_policy(_cls)


def parse_policy(spec: str) -> Policy:
    """Build a policy from ``name[:k=v,...]``, e.g. ``"snapkv:budget=512,window=32"``.

    Raises :class:`UnknownPolicyError` or :class:`PolicyParameterError` (both ``ValueError``)
    naming what is wrong and what is allowed.

    Parameters
    ----------
    spec : str
        ``name`` (case-insensitive, a key of :data:`POLICIES`) optionally followed by
        ``:`` and comma-separated ``param=value`` pairs.

    Returns
    -------
    Policy
        The configured policy.

    Raises
    ------
    kvcouple.policies.UnknownPolicyError
        No policy of that name is registered.
    kvcouple.policies.PolicyParameterError
        A malformed or repeated parameter, or one the policy refuses.
    """
    text = spec.strip()
    name, _, rest = text.partition(":")
    name = name.strip().lower()
    if name not in POLICIES:
        raise UnknownPolicyError(
            f"unknown policy {name!r} in {spec!r}; known policies: {', '.join(sorted(POLICIES))} "
            "(a plug-in policy is registered by importing its module: `kvcouple trace --plugin "
            "MODULE`, or its package's kvcouple.policies entry point)"
        )
    params: dict[str, str] = {}
    items = [s for s in (s.strip() for s in rest.split(",")) if s]
    positional = POLICIES[name].POSITIONAL
    if positional is not None and items and "=" not in items[0]:
        items[0] = f"{positional}={items[0]}"  # e.g. kvpress:SnapKVPress -> press=SnapKVPress
    for item in items:
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not key or not value.strip():
            raise PolicyParameterError(f"policy {spec!r}: expected param=value, got {item!r}")
        if key in params:
            raise PolicyParameterError(f"policy {spec!r}: parameter {key!r} given twice")
        params[key] = value.strip()
    return POLICIES[name](**params)


__all__ = [
    "PAGE",
    "Admission",
    "DecodeCache",
    "DecodeContext",
    "DecodeRule",
    "H2O",
    "KNorm",
    "KVPress",
    "Observed",
    "POLICIES",
    "TOVA",
    "Full",
    "Policy",
    "PolicyContext",
    "PolicyError",
    "PolicyParameterError",
    "Random",
    "Recent",
    "RescoreRule",
    "ScorePolicy",
    "SlotScoreRule",
    "SnapKV",
    "Streaming",
    "UnknownPolicyError",
    "ValueDiff",
    "kept_count",
    "parse_policy",
    "register_policy",
    "top_indices",
]
