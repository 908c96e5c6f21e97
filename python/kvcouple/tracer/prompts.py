"""Prompt files: JSON lines of ``{"id", "text"}`` or ``{"id", "input_ids"}``.

Blank lines are skipped. Ids are strings (numbers are converted) and must be unique. A line
that is not valid JSON, lacks an id, or has neither a non-empty ``text`` nor a non-empty
``input_ids`` list raises :class:`PromptFileError` naming the file and line number.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcouple.errors import InvalidInputError


class PromptFileError(InvalidInputError):
    """Prompts that cannot be read or built: a prompt file not as documented, or a JSON-lines
    source of ``kvcouple prompts`` (each names the file and line), or records that cannot make
    a prompt file (:mod:`kvcouple.prompts.build`)."""


@dataclass(frozen=True)
class Prompt:
    """One document: its id and token ids.

    Parameters
    ----------
    id : str
        The document id.
    input_ids : tuple of int
        The prompt's token ids.
    """

    id: str
    input_ids: tuple[int, ...]


def tokenize_text(tokenizer: Any, text: str, chat_template: bool) -> list[int]:
    """The token ids of ``text``: through the tokenizer's chat template (one user turn and the
    generation prompt) or with its special tokens added."""
    if chat_template:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # BatchEncoding in newer versions
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    return [int(i) for i in tokenizer(text, add_special_tokens=True)["input_ids"]]


# Files that are tables, not JSON lines: kvcouple prompts reads them.
_TABLES = (".csv", ".tsv", ".parquet", ".pq", ".json", ".txt")


def _not_jsonl(path: Path) -> str:
    """What to do with a prompt file that is not JSON lines (a CSV, Parquet, a JSON array)."""
    kind = path.suffix.lower() if path.suffix.lower() in _TABLES else "this"
    return (
        f'. A prompt file has one JSON object per line ({{"id": ..., "text": ...}}); '
        f"to trace a {kind.lstrip('.').upper() if kind != 'this' else 'table'} file, build "
        f"the prompt file from it first: kvcouple prompts {path} --field TEXT_COLUMN "
        "--out prompts.jsonl (kvcouple prompts --help)"
    )


def load_prompts(
    path: str | os.PathLike[str],
    tokenizer: Any = None,
    *,
    chat_template: bool = False,
    vocab_size: int | None = None,
) -> list[Prompt]:
    """Read a prompt file; texts are tokenised with ``tokenizer`` (optionally through its chat
    template). ``vocab_size`` bounds the token ids of ``input_ids`` lines.

    Parameters
    ----------
    path : str or os.PathLike
        A JSON-lines prompt file: one document per line, with a text or ``input_ids``.
    tokenizer : transformers tokenizer, optional
        Tokenises text prompts. Default None: only ``input_ids`` lines are accepted.
    chat_template : bool
        Tokenise texts through the tokenizer's chat template. Default False.
    vocab_size : int, optional
        Token ids of ``input_ids`` lines must lie below it. Default None: unchecked.

    Returns
    -------
    list of Prompt
        One per line: its document id and token ids.

    Raises
    ------
    FileNotFoundError
        No file at ``path``.
    kvcouple.tracer.prompts.PromptFileError
        A directory, a malformed line, a text prompt without a tokenizer, or an empty prompt.
    """
    prompts: list[Prompt] = []
    for where, doc_id, text, ids in _records(Path(path), vocab_size):
        if text is not None:
            if tokenizer is None:
                raise PromptFileError(
                    f"{where}: a text prompt needs a tokenizer (the model has none); "
                    'give "input_ids" instead'
                )
            ids = tokenize_text(tokenizer, text, chat_template)
        if not ids:
            raise PromptFileError(f"{where}: empty prompt (document {doc_id!r})")
        prompts.append(Prompt(doc_id, tuple(ids)))
    return prompts


def check_prompt_file(path: str | os.PathLike[str]) -> int:
    """Validate a prompt file without tokenising it (before a model is loaded); returns the
    number of prompts. Raises :class:`PromptFileError` naming the line."""
    return sum(1 for _ in _records(Path(path), None))


def read_json_lines(path: Path, hint: str = "") -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` of each non-blank line of a JSON-lines file; a file that is
    not UTF-8, or a line that is not a JSON object, raises :class:`PromptFileError` naming the
    line (``hint`` appended to the message of a line that is not JSON)."""
    with path.open(encoding="utf-8", errors="strict") as f:
        try:
            lines = list(enumerate(f, start=1))
        except UnicodeDecodeError as e:
            raise PromptFileError(f"{path}: not UTF-8 text ({e.reason})") from None
    for number, line in lines:
        if not line.strip():
            continue
        where = f"{path} line {number}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise PromptFileError(f"{where}: not valid JSON ({e.msg}){hint}") from None
        if not isinstance(obj, dict):
            raise PromptFileError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        yield number, obj


def _records(
    path: Path, vocab_size: int | None
) -> Iterator[tuple[str, str, str | None, list[int] | None]]:
    """``(where, id, text, input_ids)`` of each line, one of text and input_ids set."""
    if not path.exists():
        raise FileNotFoundError(f"prompt file {path} does not exist")
    if path.is_dir():
        raise PromptFileError(f"{path} is a directory, not a prompt file (JSON lines)")
    seen: dict[str, int] = {}
    for number, obj in read_json_lines(path, _not_jsonl(path)):
        where = f"{path} line {number}"
        if (
            "id" not in obj
            or isinstance(obj["id"], bool)
            or not isinstance(obj["id"], (str, int))
            or obj["id"] == ""
        ):
            raise PromptFileError(f'{where}: missing or empty "id" (a string)')
        doc_id = str(obj["id"])
        if doc_id in seen:
            raise PromptFileError(f"{where}: id {doc_id!r} already used on line {seen[doc_id]}")
        seen[doc_id] = number
        if "input_ids" in obj:
            ids = obj["input_ids"]
            if not isinstance(ids, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in ids
            ):
                raise PromptFileError(f'{where}: "input_ids" must be a list of integers')
            bad = [i for i in ids if i < 0 or (vocab_size is not None and i >= vocab_size)]
            if bad:
                raise PromptFileError(
                    f"{where}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})"
                )
            if not ids:
                raise PromptFileError(f"{where}: empty prompt (document {doc_id!r})")
            yield where, doc_id, None, ids
        elif "text" in obj:
            if not isinstance(obj["text"], str):
                raise PromptFileError(f'{where}: "text" must be a string')
            if not obj["text"].strip():
                raise PromptFileError(f"{where}: empty prompt (document {doc_id!r})")
            yield where, doc_id, obj["text"], None
        else:
            raise PromptFileError(f'{where}: needs "text" or "input_ids"')
    if not seen:
        raise PromptFileError(f"{path} holds no prompts")
