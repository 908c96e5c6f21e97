"""The plan registry of a trace store: which analysis plan was registered, and when.

A confirmatory analysis is only preregistered if its plan was fixed before its confirmatory
documents were traced. The registry is a JSON file inside the store
(``kvcouple_plan_registry.json``) created together with the store by the writer, which marks
the store's attributes (``plan_registry``), so a deleted registry is detected. The registry's
id is a fingerprint of the store's run-defining attributes (model, policies, settings, seed,
documents; deterministic, so identical runs stay identical), so a registry copied from another
run is detected. Each registration carries a digest chained to the registry's id and the
previous registration, so an entry edited by hand is detected too (tamper evidence against
accidents, not a cryptographic seal).

A plan can be registered before the store exists (``kvcouple plan register PLAN --store S``
with S not yet traced): the registration waits beside it in ``S.kvcouple_plan_registry.json``
and the writer moves it into the store when it creates it.

This module knows the file format only; :mod:`kvcouple.analysis.plan` decides what a
registration means for an analysis.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kvcouple.errors import StoreError
from kvcouple.store.schema import RUN_KEYS

REGISTRY_NAME = "kvcouple_plan_registry.json"
REGISTRY_FORMAT = "kvcouple plan registry 1"
MARKER_ATTR = "plan_registry"


class RegistryError(StoreError):
    """A registry that is missing, replaced, edited or refuses a registration."""


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def registry_path(store: str | os.PathLike[str]) -> Path:
    return Path(store) / REGISTRY_NAME


def pending_path(store: str | os.PathLike[str]) -> Path:
    """Where a registration made before the store exists waits for the writer."""
    store = Path(store)
    return store.with_name(store.name + "." + REGISTRY_NAME)


def _digest(uid: str, previous: str, entry: dict[str, Any]) -> str:
    body = {k: v for k, v in entry.items() if k != "digest"}
    text = json.dumps([uid, previous, body], sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _write(path: Path, content: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(content, indent=1, sort_keys=True))
    os.replace(tmp, path)


def new_uid() -> str:
    return secrets.token_hex(16)


def fingerprint_keys(run_keys: Iterable[str]) -> list[str]:
    return sorted({*run_keys, "doc_ids", "policy_specs"})


def fingerprint(attrs: dict[str, Any], keys: Iterable[str]) -> str:
    """The registry id of a store: its run-defining attributes, hashed."""
    keys = fingerprint_keys(keys)
    body = json.dumps({k: attrs.get(k) for k in keys}, sort_keys=True, default=str)
    return hashlib.sha256(body.encode()).hexdigest()


def new_registry(uid: str | None = None) -> dict[str, Any]:
    # No creation time: identical runs write byte-identical stores, registry included.
    return {"format": REGISTRY_FORMAT, "uid": uid or new_uid(), "registrations": []}


def create_registry(
    directory: str | os.PathLike[str],
    store: str | os.PathLike[str] | None,
    uid: str,
    keys: Iterable[str],
) -> None:
    """Called by the writer while it creates ``store`` (in the temporary ``directory``): write
    the registry with ``uid`` (the store's :func:`fingerprint`), taking over a
    registration made before the store existed."""
    content = new_registry(uid)
    content["fingerprint_keys"] = fingerprint_keys(keys)
    pending = pending_path(store) if store is not None else None
    if pending is not None and pending.exists():
        waiting = read_registry_file(pending)
        for entry in waiting["registrations"]:
            append(content, {k: v for k, v in entry.items() if k != "digest"})
    _write(Path(directory) / REGISTRY_NAME, content)


def discard_pending(store: str | os.PathLike[str]) -> None:
    """After the store is in place its registry holds what was pending."""
    pending = pending_path(store)
    if pending.exists() and registry_path(store).exists():
        pending.unlink()


def read_registry_file(path: Path) -> dict[str, Any]:
    try:
        content = json.loads(path.read_text())
    except FileNotFoundError:
        raise RegistryError(f"no plan registry at {path}") from None
    except json.JSONDecodeError as e:
        raise RegistryError(f"the plan registry {path} is not valid JSON: {e}") from e
    if not isinstance(content, dict) or content.get("format") != REGISTRY_FORMAT:
        raise RegistryError(f"{path} is not a kvcouple plan registry ({REGISTRY_FORMAT})")
    previous = ""
    for i, entry in enumerate(content.get("registrations", [])):
        if entry.get("digest") != _digest(content["uid"], previous, entry):
            raise RegistryError(
                f"the plan registry {path} was edited by hand: registration {i + 1} "
                f"(plan {str(entry.get('plan_hash'))[:12]}) does not match its digest"
            )
        previous = entry["digest"]
    return content


def append(content: dict[str, Any], entry: dict[str, Any]) -> dict[str, Any]:
    regs = content["registrations"]
    previous = regs[-1]["digest"] if regs else ""
    entry = dict(entry)
    entry["digest"] = _digest(content["uid"], previous, entry)
    regs.append(entry)
    return entry


def load(store: str | os.PathLike[str], store_attrs: dict[str, Any]) -> dict[str, Any]:
    """The store's registry, checked against the store: raises :class:`RegistryError` saying
    whether it was deleted, replaced or edited."""
    path = registry_path(store)
    if not path.exists():
        if store_attrs.get(MARKER_ATTR):
            raise RegistryError(
                f"{store}: the plan registry created with the store was deleted ({path})"
            )
        raise RegistryError(f"{store}: the store has no plan registry (written before registries)")
    content = read_registry_file(path)
    # The keys the registry was made with (a later kvcouple may define more run keys).
    uid = fingerprint(store_attrs, content.get("fingerprint_keys", RUN_KEYS))
    if content["uid"] != uid:
        raise RegistryError(
            f"{store}: the plan registry was replaced (its id {content['uid'][:12]} is not the "
            f"store's {str(uid)[:12]})"
        )
    return content


def save(store: str | os.PathLike[str], content: dict[str, Any]) -> None:
    _write(registry_path(store), content)


def save_pending(store: str | os.PathLike[str], content: dict[str, Any]) -> None:
    _write(pending_path(store), content)
