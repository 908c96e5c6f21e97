"""Prespecified analysis plans (TOML): every setting that changes a number, the comparisons, and
the split of documents into exploratory and confirmatory sets. See docs/statistics.md.

Example::

    name = "snapkv vs recent"
    alpha = 0.05
    correction = "holm"          # "holm", "bonferroni" or "none"
    estimator = "indicator"      # "indicator" or "tv"
    window = "stored"            # observation window L_w: "stored" (the store's L) or a lag
    early_late_split = "half"    # early lags 1..s, late s+1..L_w: "half" (L_w // 2) or s
    n_boot = 2000
    seed = 0                     # the bootstrap seed
    ci_level = 0.95              # level of the summary tables' CIs
    ci_method = "studentized"    # "percentile", "bca", "expanded-bca" or "studentized"
    reference = "recent"         # optional: gaps are policy - reference
    pool_models = false          # also pool gaps across the stores (models)

    [documents]                  # either explicit lists ...
    exploratory = ["doc0000", "doc0001"]
    confirmatory = ["doc0002", "doc0003"]
    # ... or a deterministic split by hashed document id:
    # split = { exploratory_fraction = 0.25, seed = 1 }

    [[comparisons]]              # paired: metric(b) - metric(a) against value (default 0)
    name = "snapkv loses more tokens than recent"
    metric = "mismatch_fraction" # any quantity of the summary table
    a = "recent"
    b = "snapkv"
    direction = "greater"        # b - a > value; "less"; "two-sided"

    [[comparisons]]              # within one policy: metric(policy) against value
    metric = "late_minus_early_tv"
    policy = "snapkv"
    value = 0.0
    direction = "greater"

Every key is checked: an unknown key, a value of the wrong type or out of range is a
:class:`PlanError` naming the key and what is allowed. Omitted settings take their defaults,
and the plan's hash is SHA-256 of the completed content in canonical JSON, so the hash covers
every setting (comments and layout do not change it). The analysis takes its settings from the
plan and refuses options that contradict it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcouple.analysis.estimates import ESTIMATORS
from kvcouple.analysis.intervals import CI_METHODS, DEFAULT_CI_METHOD
from kvcouple.analysis.quantities import current_name
from kvcouple.analysis.stats import SUMMARY_DEFINITIONS
from kvcouple.document_split import split_documents
from kvcouple.errors import InvalidInputError
from kvcouple.store.schema import RUN_KEYS

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib

DIRECTIONS = ("greater", "less", "two-sided")
CORRECTIONS = ("holm", "bonferroni", "none")


class PlanError(InvalidInputError):
    """A plan that is malformed, unregistered, or contradicted by the analysis settings."""


# Settings that change a number, with their defaults (the analysis without a plan uses them).
DEFAULTS: dict[str, Any] = {
    "alpha": 0.05,
    "correction": "holm",
    "estimator": "indicator",
    "window": "stored",
    "early_late_split": "half",
    "n_boot": 2000,
    "seed": 0,
    "ci_level": 0.95,
    "ci_method": DEFAULT_CI_METHOD,
    "pool_models": False,
}
_TOP_KEYS = {*DEFAULTS, "name", "description", "reference", "documents", "comparisons"}
_COMPARISON_KEYS = {"name", "metric", "a", "b", "policy", "value", "direction", "model"}


@dataclass(frozen=True)
class Comparison:
    """``policy`` set: a within-policy test of ``metric(policy)`` against ``value``; else a
    paired test of ``metric(b) - metric(a)`` against ``value``."""

    name: str
    metric: str
    a: str | None
    b: str | None
    direction: str
    value: float = 0.0
    policy: str | None = None
    model: str | None = None

    @property
    def policies(self) -> tuple[str, ...]:
        return (self.policy,) if self.policy is not None else (str(self.a), str(self.b))


@dataclass(frozen=True)
class Plan:
    """An analysis plan, loaded and completed with defaults by
    :func:`kvcouple.analysis.load_plan`.

    The number-changing settings (``alpha``, ``correction``, ``estimator``, ``window``,
    ``early_late_split``, ``n_boot``, ``seed``, ``ci_level``, ``ci_method``, ``pool_models``
    and ``reference``) are readable as attributes, e.g. ``plan.alpha``.

    Attributes
    ----------
    content : dict
        The plan's content completed with the defaults; this is what the hash covers.
    hash : str
        SHA-256 hex digest of the canonical JSON of ``content``.
    name : str
        The plan's name (the file's stem when the plan has no ``name`` key).
    comparisons : tuple of Comparison
        The registered comparisons, in the order the plan lists them.
    """

    content: dict[str, Any]  # completed with defaults: what the hash covers
    hash: str
    name: str
    comparisons: tuple[Comparison, ...]

    def __getattr__(self, key: str) -> Any:
        # The settings: plan.alpha, plan.n_boot, ... read from the completed content.
        if key in DEFAULTS or key == "reference":
            return self.__dict__["content"].get(key)
        raise AttributeError(key)

    def settings(self) -> dict[str, Any]:
        """Every number-changing setting (the plan fixes each one)."""
        return {k: self.content.get(k) for k in (*DEFAULTS, "reference")}

    def documents(self, doc_ids: list[str], which: str) -> list[str]:
        """The exploratory or confirmatory documents among ``doc_ids`` (in store order)."""
        docs = self.content.get("documents", {})
        if which not in ("exploratory", "confirmatory"):
            raise PlanError(f"document set must be exploratory or confirmatory, got {which!r}")
        if "split" in docs:
            split = docs["split"]
            return split_documents(doc_ids, split["exploratory_fraction"], split["seed"], which)
        listed = set(docs.get(which, []))
        if not listed:
            raise PlanError(
                f"the plan lists no {which} documents ([documents] {which} = [...] "
                f"or split = {{ exploratory_fraction = ... }})"
            )
        unknown = sorted(listed - set(doc_ids))
        if unknown:
            raise PlanError(
                f"the plan's {which} documents are not in the store(s): {', '.join(unknown[:10])}"
            )
        return [d for d in doc_ids if d in listed]


def plan_hash(content: dict[str, Any]) -> str:
    canonical = json.dumps(content, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


class _Checker:
    def __init__(self, where: str):
        self.where = where

    def fail(self, key: str, problem: str) -> PlanError:
        return PlanError(f"{self.where}: {key} {problem}")

    def unknown(self, table: dict[str, Any], allowed: set[str], prefix: str = "") -> None:
        extra = sorted(set(table) - allowed)
        if extra:
            raise self.fail(
                prefix + extra[0],
                f"is not a plan key; allowed{' in ' + prefix.rstrip('.') if prefix else ''}: "
                f"{', '.join(sorted(allowed))}",
            )

    def string(self, key: str, v: Any, choices: tuple[str, ...] | None = None) -> str:
        if not isinstance(v, str) or (choices is not None and v not in choices):
            allowed = f"one of {', '.join(map(repr, choices))}" if choices else "a string"
            raise self.fail(key, f"must be {allowed}, got {v!r}")
        return v

    def number(self, key: str, v: Any, lo: float, hi: float, what: str) -> float:
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise self.fail(key, f"must be a number {what}, got {v!r}")
        if not lo < v < hi:
            raise self.fail(key, f"must be {what}, got {v!r}")
        return float(v)

    def integer(self, key: str, v: Any, lo: int, hi: int) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise self.fail(key, f"must be an integer in [{lo}, {hi}], got {v!r}")
        return int(v)


def parse_plan(content: dict[str, Any], where: str = "plan") -> Plan:
    """Check a parsed plan completely and complete it with the defaults."""
    c = _Checker(where)
    if not isinstance(content, dict):
        raise PlanError(f"{where}: a plan is a TOML table")
    c.unknown(content, _TOP_KEYS)
    out = _parse_settings(content, c)
    out["documents"] = _parse_documents(content.get("documents", {}), c)
    comps = _parse_comparisons(content.get("comparisons", []), where)
    out["comparisons"] = [entry for entry, _ in comps]
    return Plan(out, plan_hash(out), out.get("name", "plan"), tuple(comp for _, comp in comps))


def _parse_settings(content: dict[str, Any], c: _Checker) -> dict[str, Any]:
    """The top-level keys: name, description and every number-changing setting."""
    out: dict[str, Any] = {}
    for key in ("name", "description"):
        if key in content:
            out[key] = c.string(key, content[key])
    get = lambda k: content.get(k, DEFAULTS[k])  # noqa: E731
    out["alpha"] = c.number("alpha", get("alpha"), 0, 1, "in (0, 1)")
    out["correction"] = c.string("correction", get("correction"), CORRECTIONS)
    out["estimator"] = c.string("estimator", get("estimator"), ESTIMATORS)
    out["window"] = _word_or_integer(c, "window", get("window"), "stored", 0)
    out["early_late_split"] = _word_or_integer(
        c, "early_late_split", get("early_late_split"), "half", 1
    )
    out["n_boot"] = c.integer("n_boot", get("n_boot"), 100, 10**7)
    out["seed"] = c.integer("seed", get("seed"), 0, 2**63 - 1)
    out["ci_level"] = c.number("ci_level", get("ci_level"), 0, 1, "in (0, 1)")
    out["ci_method"] = c.string("ci_method", get("ci_method"), CI_METHODS)
    if not isinstance(get("pool_models"), bool):
        raise c.fail("pool_models", f"must be true or false, got {get('pool_models')!r}")
    out["pool_models"] = get("pool_models")
    if "reference" in content:
        out["reference"] = c.string("reference", content["reference"])
    return out


def _word_or_integer(c: _Checker, key: str, v: Any, word: str, least: int) -> Any:
    """A setting that is ``word`` or an integer >= ``least``."""
    if v == word:
        return v
    if isinstance(v, str):
        return c.string(key, v, (word,))
    return c.integer(key, v, least, 10**9)


def _parse_documents(docs: Any, c: _Checker) -> dict[str, Any]:
    """``[documents]``: explicit disjoint lists, or a split by hashed document id."""
    if not isinstance(docs, dict):
        raise c.fail("documents", "must be a table ([documents])")
    c.unknown(docs, {"exploratory", "confirmatory", "split"}, "documents.")
    if "split" in docs and ({"exploratory", "confirmatory"} & set(docs)):
        raise c.fail("documents", "takes either split or the exploratory/confirmatory lists")
    out_docs: dict[str, Any] = {}
    if "split" in docs:
        split_t = docs["split"]
        if not isinstance(split_t, dict):
            raise c.fail("documents.split", "must be a table { exploratory_fraction, seed }")
        c.unknown(split_t, {"exploratory_fraction", "seed"}, "documents.split.")
        out_docs["split"] = {
            "exploratory_fraction": c.number(
                "documents.split.exploratory_fraction",
                split_t.get("exploratory_fraction", 0.5),
                0,
                1,
                "in (0, 1)",
            ),
            "seed": c.integer("documents.split.seed", split_t.get("seed", 0), 0, 2**63 - 1),
        }
    for which in ("exploratory", "confirmatory"):
        if which in docs:
            ids = docs[which]
            if not isinstance(ids, list) or not all(isinstance(d, str) for d in ids):
                raise c.fail(f"documents.{which}", f"must be a list of document ids, got {ids!r}")
            out_docs[which] = sorted(set(ids))
    if "exploratory" in out_docs and "confirmatory" in out_docs:
        both = set(out_docs["exploratory"]) & set(out_docs["confirmatory"])
        if both:
            raise c.fail("documents", f"lists documents in both sets: {', '.join(sorted(both))}")
    return out_docs


def _parse_comparisons(comps_in: Any, where: str) -> list[tuple[dict[str, Any], Comparison]]:
    """``[[comparisons]]``: each completed entry (what the hash covers) and its Comparison."""
    if not isinstance(comps_in, list) or not all(isinstance(x, dict) for x in comps_in):
        raise _Checker(where).fail("comparisons", "must be an array of tables ([[comparisons]])")
    if not comps_in:
        raise PlanError(f"{where}: a plan needs at least one [[comparisons]] entry")
    return [
        _parse_comparison(comp, _Checker(f"{where}: comparison {i + 1}"))
        for i, comp in enumerate(comps_in)
    ]


def _parse_comparison(comp: dict[str, Any], cc: _Checker) -> tuple[dict[str, Any], Comparison]:
    cc.unknown(comp, _COMPARISON_KEYS)
    metric = comp.get("metric")
    if isinstance(metric, str):  # a renamed quantity is read as its new name, with a warning
        metric = current_name(metric, f"{cc.where}: metric")
    metric = cc.string("metric", metric, tuple(SUMMARY_DEFINITIONS))
    direction = cc.string("direction", comp.get("direction", "two-sided"), DIRECTIONS)
    value = cc.number("value", comp.get("value", 0.0), -math.inf, math.inf, "(finite)")
    model = cc.string("model", comp["model"]) if "model" in comp else None
    entry: dict[str, Any] = {"metric": metric, "direction": direction, "value": value}
    a = b = policy = None
    if "policy" in comp:
        if "a" in comp or "b" in comp:
            raise cc.fail("policy", "names one policy: give either policy or a and b")
        policy = cc.string("policy", comp["policy"])
        entry["policy"] = policy
        default_name = f"{policy}: {metric} {_SIGN[direction]} {value:g}"
    else:
        if "a" not in comp or "b" not in comp:
            raise cc.fail("a/b", "are required: a comparison names a and b (paired) or policy")
        a, b = cc.string("a", comp["a"]), cc.string("b", comp["b"])
        if a == b:
            raise cc.fail(
                "b",
                f"is the same policy as a ({a!r}): a paired difference would be 0; "
                "for a test within one policy write policy = ... (and value)",
            )
        entry.update(a=a, b=b)
        default_name = f"{b} vs {a}: {metric}"
    name = cc.string("name", comp.get("name", default_name))
    entry["name"] = name
    if model is not None:
        entry["model"] = model
    return entry, Comparison(name, metric, a, b, direction, value, policy, model)


_SIGN = {"greater": ">", "less": "<", "two-sided": "!="}


def load_plan(path: str | os.PathLike[str]) -> Plan:
    """Parse and check a plan file; raise :class:`PlanError` naming what is wrong.

    Parameters
    ----------
    path : str or os.PathLike
        A TOML plan file. A plan without a ``name`` key is named after the file's stem.

    Returns
    -------
    Plan
        The checked plan.

    Raises
    ------
    kvcouple.analysis.PlanError
        No file at ``path``, invalid TOML, or a plan whose content is wrong.
    """
    path = Path(path)
    try:
        content = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise PlanError(f"no plan file at {path}") from None
    except tomllib.TOMLDecodeError as e:
        raise PlanError(f"{path} is not valid TOML: {e}") from e
    plan = parse_plan(content, str(path))
    if "name" not in plan.content:
        object.__setattr__(plan, "name", path.stem)
    return plan


# ---- registration (the registry file itself: kvcouple.store.registry) ----


def _store_attrs(store: Path) -> dict[str, Any]:
    import zarr

    return dict(zarr.open_group(str(store), mode="r").attrs)


def _store_state(store: Path) -> tuple[dict[str, Any], list[str], list[bool]]:
    import numpy as np
    import zarr

    group = zarr.open_group(str(store), mode="r")
    attrs: dict[str, Any] = dict(group.attrs)

    def values(name: str) -> np.ndarray:
        arr = group[name]
        if not isinstance(arr, zarr.Array):
            raise TypeError(f"{store}: {name!r} is a group, not an array")
        return np.asarray(arr[...])

    ids = [str(x) for x in attrs.get("doc_ids", [])] or [str(x) for x in values("doc_id")]
    return attrs, ids, [bool(x) for x in values("completed")]


def _registered(content: dict[str, Any], plan: Plan, where: str) -> dict[str, Any] | None:
    regs = content["registrations"]
    if not regs:
        return None
    first = regs[0]
    if first["plan_hash"] != plan.hash:
        raise PlanError(
            f"{where} already has plan {first['plan_name']!r} (hash {first['plan_hash'][:12]}, "
            f"registered {first['registered']}) registered; this plan has hash "
            f"{plan.hash[:12]}. A store's confirmatory documents are tested under one plan, "
            "registered once, before they are traced"
        )
    return dict(first)


def register_plan(plan: Plan, store: str | os.PathLike[str]) -> dict[str, Any]:
    """Record ``plan``'s hash, content and time in ``store``'s registry (or, if the store does
    not exist yet, in the registration the writer takes over when it creates it). Registering
    the same plan again returns the first registration; another plan is refused."""
    from kvcouple.store import registry as reg

    store = Path(store)
    entry: dict[str, Any] = {
        "plan_hash": plan.hash,
        "plan_name": plan.name,
        "plan": plan.content,
        "registered": reg.now(),
    }
    if not store.exists():
        pending = reg.pending_path(store)
        content = reg.read_registry_file(pending) if pending.exists() else reg.new_registry()
        first = _registered(content, plan, str(store))
        if first is not None:
            return first
        entry.update(store_existed=False, confirmatory_documents=None, confirmatory_done=0)
        out = reg.append(content, entry)
        reg.save_pending(store, content)
        return out
    attrs, ids, done = _store_state(store)
    try:
        content = reg.load(store, attrs)
    except reg.RegistryError:
        if attrs.get(reg.MARKER_ATTR) or reg.registry_path(store).exists():
            raise
        content = reg.new_registry(reg.fingerprint(attrs, RUN_KEYS))  # an older store
        content["fingerprint_keys"] = reg.fingerprint_keys(RUN_KEYS)
    first = _registered(content, plan, str(store))
    if first is not None:
        return first
    conf = set(plan.documents(ids, "confirmatory"))
    entry.update(
        store_existed=True,
        confirmatory_documents=len(conf),
        confirmatory_done=sum(1 for i, d in zip(ids, done, strict=True) if d and i in conf),
    )
    out = reg.append(content, entry)
    reg.save(store, content)
    return out


def registration_status(
    plan: Plan | None, store: str | os.PathLike[str], attrs: dict[str, Any] | None = None
) -> tuple[bool, str]:
    """``(preregistered, what to stamp on every output)`` for analysing ``store`` under
    ``plan``'s confirmatory documents (``plan=None``: without a plan). ``attrs``: the store's
    attributes where the caller has read them already (else they are read here)."""
    from kvcouple.store import registry as reg

    if not Path(store).is_dir():
        return False, f"not preregistered: the registry of {store} is not checked (not local)"
    if attrs is None:
        attrs = _store_attrs(Path(store))
    try:
        content = reg.load(store, attrs)
    except reg.RegistryError as e:
        return False, f"not preregistered: {e}"
    regs = content["registrations"]
    if plan is None:
        if regs:
            return False, (
                f"not preregistered: analysed without the store's registered plan "
                f"{regs[0]['plan_name']!r} ({regs[0]['plan_hash'][:12]})"
            )
        return False, "not preregistered: no plan"
    if not regs:
        return False, f"not preregistered: plan {plan.hash[:12]} is not registered in {store}"
    first = regs[0]
    if first["plan_hash"] != plan.hash:
        return False, (
            f"not preregistered: {store} has plan {first['plan_name']!r} "
            f"({first['plan_hash'][:12]}, registered {first['registered']}) registered, "
            f"not this plan ({plan.hash[:12]})"
        )
    if first.get("confirmatory_done"):
        return False, (
            f"not preregistered: plan {plan.hash[:12]} was registered {first['registered']}, "
            f"after {first['confirmatory_done']} of its confirmatory documents were traced"
        )
    return True, (
        f"preregistered: plan {plan.hash[:12]} registered {first['registered']}, before its "
        "confirmatory documents were traced"
    )
