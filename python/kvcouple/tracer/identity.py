"""The identity of a traced run's store: its layout and attributes (what a resumed run must
match), the prompts' digest, and the text a new store keeps."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

from kvcouple.policies import Policy
from kvcouple.store import StoreLayout
from kvcouple.store.identity import run_identity
from kvcouple.store.text import TextTables
from kvcouple.tracer.model import facts
from kvcouple.tracer.prompts import Prompt
from kvcouple.tracer.provenance import provenance
from kvcouple.tracer.settings import TraceSettings


def prompts_digest(prompts: Sequence[Prompt]) -> str:
    """SHA-256 of the documents' ids and token ids: a resumed run must trace the same prompts."""
    text = json.dumps([[p.id, list(p.input_ids)] for p in prompts], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def store_text(tokenizer: Any, prompts: Sequence[Prompt], layout: StoreLayout) -> TextTables | None:
    """The text a new store keeps (the prompts' ids, every token's bytes): None without a
    tokenizer."""
    if tokenizer is None:
        return None
    return TextTables.of(tokenizer, [p.input_ids for p in prompts], layout.vocab_size)


def store_identity(
    model: Any,
    prompts: Sequence[Prompt],
    policies: Sequence[Policy],
    settings: TraceSettings,
    seed: int,
    model_id: str,
    model_revision: str,
) -> tuple[StoreLayout, dict[str, Any]]:
    """The store layout and run attributes of a traced run (EOS ids resolved)."""
    return run_identity(
        [p.id for p in prompts],
        [(p.spec(), p.name, p.params) for p in policies],
        horizon=settings.horizon,
        window=settings.window,
        branches=settings.branches,
        replicates=settings.replicates,
        vocab_size=facts(model).vocab,
        record=settings.record,
        model_id=model_id,
        seed=seed,
        decoding=settings.decoding.as_dict(),
        eos_token_id=list(settings.eos_token_ids or ()),
        source="model",
        prompts_sha256=prompts_digest(prompts),
        # Versions, device, dtype, attention implementation, the resolved model revision.
        **provenance(model, model_revision),
    )
