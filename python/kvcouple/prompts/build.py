"""Build the prompt file the tracer reads (``{"id", "input_ids"}`` JSON lines) from local data.

Steps, each deterministic: read the records (:func:`read_records`: JSON lines, CSV, Parquet, or
a ``datasets.save_to_disk`` folder); make each record's text (one field, or a template over
several, ``str.format`` style); tokenise it with the model's tokenizer, optionally through its
chat template (:func:`~kvcouple.tracer.prompts.tokenize_text`, as ``kvcouple trace`` does);
keep lengths within ``[min_tokens, max_tokens]`` (or truncate to ``max_tokens``); sample
``sample`` of them with ``seed``; order them by length bucket (``[2^k, 2^(k+1))`` tokens, so that
consecutive prompts, which the tracer batches together, are within a factor of two); and split
the ids into exploratory and confirmatory sets by the plan's own rule
(:func:`kvcouple.document_split.split_documents`, as ``split = {exploratory_fraction, seed}``),
written as explicit lists in a plan's ``[documents]`` section.
"""

from __future__ import annotations

import csv
import json
import os
import random
import string
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcouple.document_split import split_documents
from kvcouple.errors import MissingExtraError
from kvcouple.tracer.prompts import Prompt, PromptFileError, read_json_lines, tokenize_text

TRUNCATE = ("none", "left", "right")


# The error of records that cannot make a prompt file is the prompt files' one: one class
# (this name, which kvcouple.prompts exported, stays an alias of it).
PromptBuildError = PromptFileError


def read_records(source: str | os.PathLike[str], split: str | None = None) -> list[dict[str, Any]]:
    """The records of ``source`` as dicts, in file order.

    Parameters
    ----------
    source : str or os.PathLike
        A ``.jsonl`` file (one JSON object a line), a ``.csv`` file (a header row), a
        ``.parquet`` file (needs pyarrow), or a folder written by ``datasets``'
        ``save_to_disk`` (needs datasets).
    split : str, optional
        The split of a saved ``DatasetDict`` folder (required when it has several).

    Returns
    -------
    list of dict
        One per record.
    """
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"no such file or folder: {path}")
    if path.is_dir():
        return _saved_dataset(path, split)
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        return _jsonl(path)
    if suffix == ".csv":
        with path.open(encoding="utf-8", newline="") as f:
            return [dict(row) for row in csv.DictReader(f)]
    if suffix in (".parquet", ".pq"):
        try:
            import pyarrow.parquet as pq  # type: ignore[import-not-found,unused-ignore]
        except ModuleNotFoundError as e:
            raise MissingExtraError(
                "reading Parquet needs pyarrow: pip install 'kvcouple[prompts]'"
            ) from e
        return [dict(r) for r in pq.read_table(path).to_pylist()]
    raise PromptFileError(
        f"{path}: unknown kind of file (expected .jsonl, .csv, .parquet, or a datasets folder)"
    )


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [obj for _, obj in read_json_lines(path)]


def _saved_dataset(path: Path, split: str | None) -> list[dict[str, Any]]:
    try:
        import datasets  # type: ignore[import-not-found,unused-ignore]
    except ModuleNotFoundError as e:
        raise MissingExtraError(
            f"{path} is a folder: reading a saved dataset needs datasets: "
            "pip install 'kvcouple[prompts]'"
        ) from e
    try:
        data = datasets.load_from_disk(str(path))
    except FileNotFoundError as e:
        raise PromptFileError(f"{path} is not a folder written by save_to_disk ({e})") from None
    if isinstance(data, datasets.DatasetDict):
        names = sorted(data)
        if split is None and len(names) == 1:
            split = names[0]
        if split not in data:
            raise PromptFileError(
                f"{path} holds the splits {', '.join(names)}: choose one with --split"
            )
        data = data[split]
    elif split is not None:
        raise PromptFileError(f"{path} holds one dataset, not splits: drop --split {split}")
    return [dict(r) for r in data]


@dataclass
class Built:
    """What :func:`build_prompts` made: the prompts (in output order) and what was dropped.

    Attributes
    ----------
    prompts : list of Prompt
        The prompt file's documents, in order.
    read : int
        Records read.
    too_short, too_long, truncated : int
        Records dropped below ``min_tokens``, dropped above ``max_tokens``, and truncated.
    exploratory, confirmatory : list of str
        The split's document ids (empty without a split).
    """

    prompts: list[Prompt]
    read: int
    too_short: int = 0
    too_long: int = 0
    truncated: int = 0
    exploratory: list[str] = field(default_factory=list)
    confirmatory: list[str] = field(default_factory=list)

    def buckets(self) -> dict[int, int]:
        """Prompts per length bucket ``2^k`` (lengths ``[2^k, 2^(k+1))``)."""
        out: dict[int, int] = {}
        for p in self.prompts:
            b = bucket(len(p.input_ids))
            out[b] = out.get(b, 0) + 1
        return out


def bucket(length: int) -> int:
    """The length bucket ``2^k`` with ``2^k <= length < 2^(k+1)``."""
    return 1 << (max(1, length).bit_length() - 1)


def _text_of(record: dict[str, Any], text_field: str | None, template: str | None, where: str):
    if template is not None:
        names = [n for _, n, _, _ in string.Formatter().parse(template) if n]
        missing = [n for n in names if n.split(".")[0].split("[")[0] not in record]
        if missing:
            raise PromptFileError(
                f"{where}: the template names field {missing[0]!r}, which the record lacks; "
                f"its fields: {', '.join(map(str, record))}"
            )
        return template.format_map(record)
    assert text_field is not None
    if text_field not in record:
        raise PromptFileError(
            f"{where}: no field {text_field!r}; its fields: {', '.join(map(str, record))}"
        )
    value = record[text_field]
    if not isinstance(value, str):
        raise PromptFileError(
            f"{where}: field {text_field!r} is a {type(value).__name__}, not text"
        )
    return value


def build_prompts(
    records: list[dict[str, Any]],
    tokenizer: Any,
    *,
    text_field: str | None = "text",
    template: str | None = None,
    id_field: str | None = None,
    chat_template: bool = False,
    min_tokens: int = 2,
    max_tokens: int | None = None,
    truncate: str = "none",
    sample: int | None = None,
    seed: int = 0,
    buckets: bool = True,
    exploratory_fraction: float | None = None,
    progress: Callable[[Iterable[Any]], Iterable[Any]] | None = None,
) -> Built:
    """Prompts from ``records`` (see the module docstring for the steps).

    Parameters
    ----------
    records : list of dict
        From :func:`read_records`.
    tokenizer : transformers tokenizer
        The model's tokenizer.
    text_field : str, optional
        The field holding each prompt's text (default ``"text"``); ignored with ``template``.
    template : str, optional
        A ``str.format`` template over the record's fields, e.g.
        ``"{context}\\n\\nQuestion: {question}"``.
    id_field : str, optional
        The field holding each document's id (default: ``"id"`` when every record has one,
        else ``doc00000``, ``doc00001``, ... by record number).
    chat_template : bool
        Tokenise through the tokenizer's chat template (one user turn).
    min_tokens, max_tokens : int
        Token-length bounds (the tracer needs at least 2).
    truncate : str
        Over ``max_tokens``: ``"none"`` drops the prompt, ``"right"`` keeps its first
        ``max_tokens`` tokens, ``"left"`` its last (a chat template's generation prompt stays).
    sample : int, optional
        Keep ``sample`` prompts drawn without replacement with ``seed`` (after the filters).
    seed : int
        Seeds the sample and the split.
    buckets : bool
        Order the prompts by length bucket (default); False keeps the records' order.
    exploratory_fraction : float, optional
        Split the ids: a share of about this fraction is exploratory, the rest confirmatory.
    progress : callable, optional
        Wraps the record iterator (a progress bar).
    """
    if template is None and text_field is None:
        raise PromptFileError("give a text field or a template")
    if truncate not in TRUNCATE:
        raise PromptFileError(f"truncate must be one of {', '.join(TRUNCATE)}, got {truncate!r}")
    if min_tokens < 2:
        raise PromptFileError(f"min_tokens must be >= 2 (the tracer needs 2), got {min_tokens}")
    if max_tokens is not None and max_tokens < min_tokens:
        raise PromptFileError(f"max_tokens ({max_tokens}) is below min_tokens ({min_tokens})")
    if truncate != "none" and max_tokens is None:
        raise PromptFileError("truncation needs max_tokens")
    if sample is not None and sample < 1:
        raise PromptFileError(f"sample must be >= 1, got {sample}")
    if exploratory_fraction is not None and not 0 < exploratory_fraction < 1:
        raise PromptFileError(
            f"the exploratory fraction must be in (0, 1), got {exploratory_fraction}"
        )
    if not records:
        raise PromptFileError("the source holds no records")
    if chat_template and not getattr(tokenizer, "chat_template", None):
        raise PromptFileError(
            f"the tokenizer ({type(tokenizer).__name__}) has no chat template: drop "
            "--chat-template, or use a model whose tokenizer has one"
        )
    if id_field is None:
        id_field = "id" if all("id" in r for r in records) else None
    built = Built([], len(records))
    seen: dict[str, int] = {}
    rows = enumerate(records)
    for number, record in progress(rows) if progress is not None else rows:
        where = f"record {number}"
        if id_field is not None:
            if id_field not in record:
                raise PromptFileError(f"{where}: no id field {id_field!r}")
            doc_id = str(record[id_field])
        else:
            doc_id = f"doc{number:05d}"
        if doc_id in seen:
            raise PromptFileError(f"{where}: id {doc_id!r} already used by record {seen[doc_id]}")
        seen[doc_id] = number
        ids = tokenize_text(tokenizer, _text_of(record, text_field, template, where), chat_template)
        if max_tokens is not None and len(ids) > max_tokens:
            if truncate == "none":
                built.too_long += 1
                continue
            ids = ids[:max_tokens] if truncate == "right" else ids[-max_tokens:]
            built.truncated += 1
        if len(ids) < min_tokens:
            built.too_short += 1
            continue
        built.prompts.append(Prompt(doc_id, tuple(ids)))
    if not built.prompts:
        over = f", {built.too_long} over {max_tokens} tokens" if max_tokens is not None else ""
        raise PromptFileError(
            f"no prompt left: {built.read} read, {built.too_short} under {min_tokens} tokens{over}"
        )
    if sample is not None and sample < len(built.prompts):
        chosen = sorted(random.Random(seed).sample(range(len(built.prompts)), sample))
        built.prompts = [built.prompts[i] for i in chosen]
    if buckets:
        built.prompts.sort(key=lambda p: bucket(len(p.input_ids)))  # stable: record order within
    if exploratory_fraction is not None:
        doc_ids = [p.id for p in built.prompts]
        built.exploratory = split_documents(doc_ids, exploratory_fraction, seed, "exploratory")
        built.confirmatory = split_documents(doc_ids, exploratory_fraction, seed, "confirmatory")
    return built


def write_prompt_file(prompts: list[Prompt], path: str | os.PathLike[str]) -> None:
    """``{"id", "input_ids"}`` JSON lines, the format ``kvcouple trace --prompts`` reads."""
    tmp = Path(f"{os.fspath(path)}.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for p in prompts:
            f.write(json.dumps({"id": p.id, "input_ids": list(p.input_ids)}) + "\n")
    tmp.replace(path)


def documents_section(built: Built, source: str, fraction: float, seed: int) -> str:
    """The ``[documents]`` section of an analysis plan holding the split as explicit lists."""
    lines = [
        f"# {len(built.prompts)} documents of {source}: split by kvcouple prompts with",
        f"# exploratory_fraction = {fraction}, seed = {seed} (the rule of the plan's",
        f"# split = {{ exploratory_fraction = {fraction}, seed = {seed} }}).",
        "[documents]",
        "exploratory = " + json.dumps(built.exploratory),
        "confirmatory = " + json.dumps(built.confirmatory),
    ]
    return "\n".join(lines) + "\n"


__all__ = [
    "Built",
    "PromptBuildError",
    "bucket",
    "build_prompts",
    "documents_section",
    "read_records",
    "write_prompt_file",
]
