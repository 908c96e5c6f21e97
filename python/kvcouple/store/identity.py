"""What makes a store one run's: its layout and its run attributes, built in one place for
every writer (the tracer and the synthetic simulator), so that both describe a run alike."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvcouple.store.create import StoreLayout
from kvcouple.store.schema import Record

__all__ = ["run_identity"]


def run_identity(
    doc_ids: Sequence[str],
    policies: Sequence[tuple[str, str, Mapping[str, Any]]],
    *,
    horizon: int,
    window: int,
    branches: int,
    replicates: int,
    vocab_size: int,
    record: Record,
    model_id: str,
    seed: int,
    decoding: Mapping[str, Any],
    eos_token_id: list[int] | None,
    source: str,
    **attrs: Any,
) -> tuple[StoreLayout, dict[str, Any]]:
    """The store layout and run attributes of a run of RB-CMC replicates.

    ``policies``: ``(spec, name, params)`` each; ``source``: ``"model"`` or ``"synthetic"``;
    ``attrs``: what else the writer records (provenance, prompt digest, synthetic starts).
    """
    layout = StoreLayout(
        doc_ids=list(doc_ids),
        policies=[spec for spec, _, _ in policies],
        horizon=horizon,
        window=window,
        branches=branches,
        replicates=replicates,
        vocab_size=vocab_size,
        record=record,
    )
    run = {
        "model_id": model_id,
        "decoding": dict(decoding),
        "policies": [{"spec": s, "name": n, "params": dict(p)} for s, n, p in policies],
        "seed": seed,
        "eos_token_id": eos_token_id,
        "estimator": "rb",
        "source": source,
        **attrs,
    }
    return layout, run
