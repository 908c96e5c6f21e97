"""Prespecified analysis plans (TOML): comparisons, directions, alpha, multiplicity correction,
and the split of documents into exploratory and confirmatory sets.

Example::

    name = "snapkv vs recent"
    alpha = 0.05
    correction = "holm"          # "holm", "bonferroni" or "none"
    estimator = "indicator"      # optional: "indicator" or "tv"
    n_boot = 2000                # optional
    seed = 0                     # optional: the bootstrap seed

    [documents]                  # either explicit lists ...
    exploratory = ["doc0000", "doc0001"]
    confirmatory = ["doc0002", "doc0003"]
    # ... or a deterministic split by hashed document id:
    # split = { exploratory_fraction = 0.25, seed = 1 }

    [[comparisons]]
    name = "snapkv loses more tokens than recent"
    metric = "mismatch_fraction" # any quantity of the summary table
    a = "recent"                 # policies (names as in the store)
    b = "snapkv"
    direction = "greater"        # b > a; "less": b < a; "two-sided"

The plan's hash is SHA-256 of its parsed content in canonical JSON (so comments and layout do
not change it). A confirmatory analysis records the hash in a registry keyed by the
confirmatory documents and refuses, later, any plan with another hash on those documents.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kvcouple.analysis.stats import QUANTITIES

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

DIRECTIONS = ("greater", "less", "two-sided")
CORRECTIONS = ("holm", "bonferroni", "none")
REGISTRY_NAME = "kvcouple_plan_registry.json"


class PlanError(ValueError):
    """A plan that is malformed, or that changed after its confirmatory run."""


@dataclass(frozen=True)
class Comparison:
    name: str
    metric: str
    a: str
    b: str
    direction: str
    model: str | None = None


@dataclass(frozen=True)
class Plan:
    content: dict[str, Any]
    hash: str
    name: str
    alpha: float
    correction: str
    comparisons: tuple[Comparison, ...]
    estimator: str | None
    n_boot: int | None
    seed: int | None

    def documents(self, doc_ids: list[str], which: str) -> list[str]:
        """The exploratory or confirmatory documents among ``doc_ids`` (in store order)."""
        docs = self.content.get("documents", {})
        if which not in ("exploratory", "confirmatory"):
            raise PlanError(f"document set must be exploratory or confirmatory, got {which!r}")
        if "split" in docs:
            split = docs["split"]
            frac = float(split.get("exploratory_fraction", 0.5))
            seed = str(split.get("seed", 0))
            chosen = [
                d for d in doc_ids if (_unit_hash(seed, d) < frac) == (which == "exploratory")
            ]
            return chosen
        listed = set(map(str, docs.get(which, [])))
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


def _unit_hash(seed: str, doc_id: str) -> float:
    h = hashlib.sha256(f"{seed}\0{doc_id}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2.0**64


def plan_hash(content: dict[str, Any]) -> str:
    canonical = json.dumps(content, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def load_plan(path: str | os.PathLike[str]) -> Plan:
    """Parse and check a plan file; raise :class:`PlanError` naming what is wrong."""
    path = Path(path)
    try:
        content = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise PlanError(f"no plan file at {path}") from None
    except tomllib.TOMLDecodeError as e:
        raise PlanError(f"{path} is not valid TOML: {e}") from e
    alpha = float(content.get("alpha", 0.05))
    if not 0 < alpha < 1:
        raise PlanError(f"{path}: alpha must be in (0, 1), got {alpha}")
    correction = str(content.get("correction", "holm"))
    if correction not in CORRECTIONS:
        raise PlanError(f"{path}: correction must be one of {CORRECTIONS}, got {correction!r}")
    comps = []
    for i, c in enumerate(content.get("comparisons", [])):
        missing = [k for k in ("metric", "a", "b") if k not in c]
        if missing:
            raise PlanError(f"{path}: comparison {i + 1} lacks {', '.join(missing)}")
        if c["metric"] not in QUANTITIES:
            raise PlanError(
                f"{path}: comparison {i + 1} has unknown metric {c['metric']!r}; "
                f"choose from {', '.join(QUANTITIES)}"
            )
        direction = str(c.get("direction", "two-sided"))
        if direction not in DIRECTIONS:
            raise PlanError(f"{path}: comparison {i + 1} direction must be one of {DIRECTIONS}")
        comps.append(
            Comparison(
                str(c.get("name", f"{c['b']} vs {c['a']}: {c['metric']}")),
                str(c["metric"]),
                str(c["a"]),
                str(c["b"]),
                direction,
                c.get("model"),
            )
        )
    if not comps:
        raise PlanError(f"{path}: a plan needs at least one [[comparisons]] entry")
    return Plan(
        content,
        plan_hash(content),
        str(content.get("name", path.stem)),
        alpha,
        correction,
        tuple(comps),
        content.get("estimator"),
        content.get("n_boot"),
        content.get("seed"),
    )


def check_registry(registry: Path, plan: Plan, doc_key: str, doc_count: int) -> dict[str, Any]:
    """Confirmatory runs: the first run on a set of documents records the plan's hash; a later
    run with another hash on the same documents raises :class:`PlanError`."""
    entries: dict[str, Any] = {}
    if registry.exists():
        try:
            entries = json.loads(registry.read_text())
        except json.JSONDecodeError as e:
            raise PlanError(f"the plan registry {registry} is unreadable: {e}") from e
    entry = entries.get(doc_key)
    if entry is not None:
        if entry["plan_hash"] != plan.hash:
            raise PlanError(
                f"refusing a confirmatory analysis: the plan changed after it was first run on "
                f"these {doc_count} confirmatory documents (first run {entry['first_run']} with "
                f"plan {entry['plan_name']!r}, hash {entry['plan_hash'][:12]}; this plan has "
                f"hash {plan.hash[:12]}). Registry: {registry}"
            )
        return dict(entry)
    entry = {
        "plan_hash": plan.hash,
        "plan_name": plan.name,
        "documents": doc_count,
        "first_run": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    entries[doc_key] = entry
    registry.parent.mkdir(parents=True, exist_ok=True)
    tmp = registry.with_suffix(".tmp")
    tmp.write_text(json.dumps(entries, indent=2, sort_keys=True))
    os.replace(tmp, registry)
    return entry


def documents_key(models: list[str], doc_ids: list[str]) -> str:
    return hashlib.sha256(json.dumps([sorted(models), sorted(doc_ids)]).encode()).hexdigest()
