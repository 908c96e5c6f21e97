"""Whether a store may be resumed by this run: the one place resume compatibility is
decided (:func:`check_resume`), and the words of each difference (:func:`resume_mismatch`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvcouple.errors import StoreError
from kvcouple.store.schema import RUN_KEYS

# What a mismatch of some run keys means, in the user's terms ({old}: the store's, {new}: this
# run's); other keys get a generic message.
_RESUME_MESSAGES = {
    "vocab_size": "it was traced with a vocabulary of {old} tokens but this model's logits "
    "have {new}. Use the same model",
    "eos_token_id": "it was traced with EOS ids {old} but this run has {new}. Use the same --eos",
    "prompts_sha256": "its prompts (ids and token ids) differ from this run's (another prompt "
    "file, tokenizer or chat template). Use the same prompts",
    "attn_implementation": "it was traced with attention implementation {old!r} but this run "
    "uses {new!r} (the kernels differ by more than float noise between implementations). "
    "Use the same --attn",
}


class VocabularyMismatchError(StoreError):
    """Resuming a store traced with another vocabulary size than the model's."""


def check_resume(path: str | Path, existing: dict[str, Any], run: dict[str, Any]) -> None:
    """Refuse to resume a store whose run-defining attributes (:data:`RUN_KEYS`) differ from
    this run's: the one place resume compatibility is decided. Raises :class:`StoreError`
    (:class:`VocabularyMismatchError` for the vocabulary) naming the first difference.

    Parameters
    ----------
    path : pathlib.Path or str
        The store being resumed (named in the error).
    existing : dict
        The store's attributes.
    run : dict
        This run's attributes. A key absent from both is not compared.

    Returns
    -------
    None

    Raises
    ------
    kvcouple.store.VocabularyMismatchError
        The vocabulary sizes differ.
    kvcouple.errors.StoreError
        Any other run-defining attribute (or the policy specs) differs.
    """
    for key in (*RUN_KEYS, "policy_specs"):
        if key not in run and key not in existing:
            continue
        old, new = existing.get(key), run.get(key)
        if old == new:
            continue
        error = VocabularyMismatchError if key == "vocab_size" else StoreError
        if key in _RESUME_MESSAGES:
            why = _RESUME_MESSAGES[key].format(key=key, old=_as_text(old), new=_as_text(new))
        else:
            why = resume_mismatch(key, old, new)
        raise error(f"cannot resume {path}: {why} or a new --out.")


# The option that sets each run key (named in resume errors).
_OPTIONS = {
    "model_id": "--model",
    "model_revision": "--revision",
    "model_sha256": "--model (the GGUF file's content)",
    "dtype": "--dtype",
    "decoding": "--temperature/--top-k/--top-p",
    "policies": "--policy",
    "policy_specs": "--policy",
    "horizon": "--horizon",
    "window": "--window",
    "branches": "--branches",
    "replicates": "--replicates",
    "record": "--record",
    "seed": "--seed",
    "doc_ids": "--prompts",
}


def _as_text(value: Any) -> str:
    """A store attribute as a reader writes it: policies by their specs, ``k=v`` pairs,
    lists joined by commas (long ones elided), no Python reprs."""
    if isinstance(value, dict):
        if "spec" in value:
            return str(value["spec"])
        return ", ".join(f"{k}={_as_text(v)}" for k, v in value.items())
    if isinstance(value, list | tuple):
        items = [_as_text(v) for v in value]
        if len(items) > 6:
            items = [*items[:3], f"... ({len(items) - 5} more) ...", *items[-2:]]
        return " | ".join(items) if any("," in i for i in items) else ", ".join(items)
    if value is None:
        return "none"
    return str(value)


def resume_mismatch(key: str, old: Any, new: Any) -> str:
    """Why a store cannot be resumed, in words: the setting (and its option), the store's
    value and this run's, and for lists (policies, documents) what was added or removed."""
    option = _OPTIONS.get(key)
    setting = f"{key} ({option})" if option else key
    if isinstance(old, dict) and isinstance(new, dict) and "spec" not in old:
        keys = [k for k in {**old, **new} if old.get(k) != new.get(k)]
        old = {k: old.get(k) for k in keys}
        new = {k: new.get(k) for k in keys}
    text = f"the setting {setting} differs: the store has {_as_text(old)}; this run has {_as_text(new)}"
    if isinstance(old, list) and isinstance(new, list):
        was, now = [_as_text(v) for v in old], [_as_text(v) for v in new]
        gone = [v for v in was if v not in now]
        added = [v for v in now if v not in was]
        parts = [f"dropped: {_as_text(gone)}"] * bool(gone)
        parts += [f"added: {_as_text(added)}"] * bool(added)
        if not parts:
            parts = ["the same entries in another order"]
        text += f" ({'; '.join(parts)})"
    return text + ". Use the same settings"
