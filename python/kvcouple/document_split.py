"""The split of a run's documents into exploratory and confirmatory sets, by id alone.

The analysis plan's ``split = {exploratory_fraction, seed}`` (:mod:`kvcouple.analysis.plan`)
and ``kvcouple prompts --exploratory-fraction`` (:mod:`kvcouple.prompts.build`) both split by
this rule, so a prompt file's written split and a plan's agree.
"""

from __future__ import annotations

import hashlib


def split_documents(
    doc_ids: list[str], exploratory_fraction: float, seed: int, which: str
) -> list[str]:
    """The exploratory or confirmatory documents among ``doc_ids`` (in their order) under
    ``split = { exploratory_fraction, seed }``: a document is exploratory when the SHA-256 of
    the seed and its id, read as a number in [0, 1), is below the fraction. It depends on the
    id alone, so adding documents never moves another between the sets."""
    frac, key = float(exploratory_fraction), str(seed)
    return [d for d in doc_ids if (_unit_hash(key, d) < frac) == (which == "exploratory")]


def _unit_hash(seed: str, doc_id: str) -> float:
    h = hashlib.sha256(f"{seed}\0{doc_id}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2.0**64
