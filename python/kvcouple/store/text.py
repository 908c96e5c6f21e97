"""The text a trace store keeps (schema version 4): enough to show prompts and continuations
without the model or its tokenizer at hand.

The tracer writes, when the store is created and the run has a tokenizer, the prompts' token
ids (``prompt_tokens``, -1 past each prompt) and the bytes of every token id of the vocabulary
(``token_bytes``, delimited by ``token_ends``): a sequence of ids decodes to the concatenation
of its tokens' bytes read as UTF-8, which is what a byte-level BPE tokenizer's ``decode``
gives (GPT-2, Llama 3, Qwen, SmolLM2). The attribute ``text_decoder`` says how the bytes were
derived (:func:`token_bytes`). The whole vocabulary is kept rather than the ids that occur,
because the store is created before anything is generated: 49,152 tokens (SmolLM2) are about
300 kB before compression.

Reading: :func:`open_text` gives a :class:`StoreText` (or None, with :func:`text_status`
saying why: a store of schema version 3 or older, a synthetic store, a run without a
tokenizer).
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvcouple.errors import StoreError
from kvcouple.store.schema import NO_TOKEN, TEXT_SINCE, TEXT_VARIABLES

__all__ = [
    "StoreText",
    "TextTables",
    "TokenTable",
    "open_text",
    "text_status",
    "token_bytes",
]

# The attribute that marks a store with text and names how its token bytes were derived.
TEXT_ATTR = "text_decoder"


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the printable character that stands for each
    byte in a byte-level BPE vocabulary -> the byte."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def _decoder_config(tokenizer: Any) -> dict[str, Any]:
    """The fast tokenizer's decoder as JSON (empty for a slow tokenizer)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return {}
    try:
        return dict(json.loads(backend.to_str()).get("decoder") or {})
    except Exception:  # a backend that cannot serialise itself: decode token by token
        return {}


def _decoders(config: dict[str, Any]) -> list[dict[str, Any]]:
    if config.get("type") == "Sequence":
        return [d for d in config.get("decoders", []) if isinstance(d, dict)]
    return [config] if config else []


def token_bytes(tokenizer: Any, vocab_size: int) -> tuple[list[bytes], str]:
    """Every token id's bytes (ids past the tokenizer's vocabulary: empty) and how they were
    derived: ``"byte-level"`` (each character of the token stands for one byte: exact),
    ``"metaspace"`` (SentencePiece: ``▁`` is a space, ``<0xNN>`` a byte; the tokenizer's own
    decode also drops the first token's leading space) or ``"decode-each"`` (the tokenizer's
    decode of each id alone: exact for whole characters). Added and special tokens are their
    text."""
    n = min(int(vocab_size), len(tokenizer))
    pieces = tokenizer.convert_ids_to_tokens(list(range(n)))
    added = {int(i): str(getattr(t, "content", t)) for i, t in _added(tokenizer).items()}
    kinds = [d.get("type") for d in _decoders(_decoder_config(tokenizer))]
    out: list[bytes] = []
    if "ByteLevel" in kinds:
        table = _byte_decoder()
        method = "byte-level"
        for i, piece in enumerate(pieces):
            if i in added or piece is None:
                out.append(added.get(i, "").encode())
            elif all(c in table for c in piece):
                out.append(bytes(table[c] for c in piece))
            else:  # a token outside the byte alphabet: its text
                out.append(piece.encode())
    elif "Metaspace" in kinds or "ByteFallback" in kinds:
        method = "metaspace"
        for i, piece in enumerate(pieces):
            if i in added or piece is None:
                out.append(added.get(i, "").encode())
            elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                out.append(bytes([int(piece[3:5], 16)]))
            else:
                out.append(piece.replace("▁", " ").encode())
    else:
        method = "decode-each"
        for i in range(n):
            text = tokenizer.decode([i], clean_up_tokenization_spaces=False)
            out.append(str(text).encode())
    out += [b""] * (int(vocab_size) - n)
    return out, method


def _added(tokenizer: Any) -> dict[int, Any]:
    try:
        return dict(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    except Exception:  # a tokenizer without the table: no added tokens known
        return {}


@dataclass(frozen=True)
class TokenTable:
    """Every token id's bytes: ``data[ends[i-1]:ends[i]]`` (``ends[-1]`` = ``len(data)``)."""

    data: bytes
    ends: np.ndarray

    @classmethod
    def of(cls, pieces: Sequence[bytes]) -> TokenTable:
        ends = np.cumsum([len(p) for p in pieces], dtype=np.int64)
        return cls(b"".join(pieces), ends)

    def __len__(self) -> int:
        return len(self.ends)

    def piece(self, token: int) -> bytes:
        """The bytes of one id; an id outside the vocabulary (-1: none) has none."""
        if not 0 <= token < len(self.ends):
            return b""
        start = int(self.ends[token - 1]) if token else 0
        return self.data[start : int(self.ends[token])]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """The text of a sequence of ids (-1 entries skipped), invalid UTF-8 replaced."""
        return b"".join(self.piece(int(t)) for t in ids if int(t) >= 0).decode(
            "utf-8", errors="replace"
        )

    def pieces(self, ids: Sequence[int] | np.ndarray) -> list[str]:
        """Each id's share of :meth:`decode`'s text, in order: a character split over several
        tokens belongs to the token that completes it (the others get ``""``), so the pieces
        join to the decoded text."""
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        out = [decoder.decode(self.piece(int(t))) for t in ids]
        tail = decoder.decode(b"", final=True)
        if tail and out:
            out[-1] += tail
        return out


@dataclass(frozen=True)
class TextTables:
    """What the writer stores: the prompts and the token table (see the module docstring)."""

    prompts: list[np.ndarray]
    table: TokenTable
    decoder: str

    @classmethod
    def of(
        cls, tokenizer: Any, prompts: Sequence[Sequence[int]], vocab_size: int | None = None
    ) -> TextTables:
        """The text of a run: ``prompts``' ids, ``tokenizer``'s bytes for every id (up to
        ``vocab_size``, the model's logits; default the tokenizer's own size)."""
        pieces, method = token_bytes(
            tokenizer, len(tokenizer) if vocab_size is None else vocab_size
        )
        return cls([np.asarray(p, np.int32) for p in prompts], TokenTable.of(pieces), method)

    def arrays(self, vocab_size: int) -> dict[str, np.ndarray]:
        """The three variables of :data:`~kvcouple.store.schema.TEXT_VARIABLES`, the token
        table cut or padded (ids without bytes) to the store's ``vocab_size``."""
        width = max(1, max((len(p) for p in self.prompts), default=1))
        ids = np.full((len(self.prompts), width), NO_TOKEN, np.int32)
        for d, p in enumerate(self.prompts):
            ids[d, : len(p)] = p
        ends = self.table.ends[:vocab_size]
        if len(ends) < vocab_size:
            last = ends[-1] if len(ends) else 0
            ends = np.concatenate([ends, np.full(vocab_size - len(ends), last, np.int64)])
        data = np.frombuffer(self.table.data[: int(ends[-1]) if len(ends) else 0], np.uint8)
        if not data.size:  # a zero-length array cannot be chunked: one byte nobody reads
            data = np.zeros(1, np.uint8)
        return {"prompt_tokens": ids, "token_bytes": data, "token_ends": ends}


def text_status(reader: Any) -> str:
    """Whether the store keeps text, in words (``kvcouple info``, ``kvcouple show``)."""
    version = int(reader.attrs.get("schema_version", 0))
    if version < TEXT_SINCE:
        return (
            f"no text (schema version {version}: stores before version {TEXT_SINCE} keep "
            "token ids only)"
        )
    decoder = reader.attrs.get(TEXT_ATTR)
    if not decoder:
        if reader.attrs.get("source") == "synthetic":
            return "no text (a synthetic store: its tokens are states of a kernel pair)"
        return "no text (traced without a tokenizer)"
    return f"prompts and token strings ({decoder})"


class StoreText:
    """The text of an open store: the token table (read once) and each document's prompt
    ids (read when asked), every block checked."""

    def __init__(self, reader: Any):
        self.reader = reader
        self.decoder = str(reader.attrs.get(TEXT_ATTR))
        vocab = int(reader.attrs.get("vocab_size", 0))
        for name, var in TEXT_VARIABLES.items():
            arr = reader.array(name)
            if len(arr.shape) != len(var.dims):
                raise StoreError(
                    f"{reader.path}: variable {name!r} has {len(arr.shape)} dimensions, the "
                    f"schema has {len(var.dims)} {var.dims}; the store is damaged"
                )
        ends = np.asarray(reader.read("token_ends", (slice(None),)), np.int64)
        data = np.asarray(reader.read("token_bytes", (slice(None),)), np.uint8)
        if ends.shape != (vocab,):
            raise StoreError(
                f"{reader.path}: variable 'token_ends' has {ends.shape[0]} entries but the "
                f"vocabulary {vocab}; the store is damaged"
            )
        if (ends.size and (ends[0] < 0 or np.any(np.diff(ends) < 0))) or (
            ends.size and ends[-1] > data.size
        ):
            raise StoreError(
                f"{reader.path}: variable 'token_ends' is not a non-decreasing list of offsets "
                f"within 'token_bytes' ({data.size} bytes); the store is damaged"
            )
        self.table = TokenTable(data.tobytes()[: int(ends[-1]) if ends.size else 0], ends)
        docs = int(reader.array("prompt_tokens").shape[0])
        if docs != len(reader.doc_ids):
            raise StoreError(
                f"{reader.path}: variable 'prompt_tokens' has {docs} documents, the store "
                f"{len(reader.doc_ids)}; the store is damaged"
            )

    def prompt_ids(self, doc: int) -> np.ndarray:
        """Document ``doc``'s prompt token ids (checked against the vocabulary)."""
        row = np.asarray(self.reader.read("prompt_tokens", (int(doc),)), np.int64)
        n = int((row != NO_TOKEN).sum())
        ids = row[:n]
        bad = (ids < 0) | (ids >= len(self.table)) if len(self.table) else ids < 0
        if bad.any() or (row[n:] != NO_TOKEN).any():
            raise StoreError(
                f"{self.reader.path}: variable 'prompt_tokens' (document "
                f"{self.reader.doc_ids[doc]!r}) holds ids outside [0, {len(self.table)}) or "
                "-1 inside the prompt; the store is damaged"
            )
        return ids

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self.table.decode(ids)

    def pieces(self, ids: Sequence[int] | np.ndarray) -> list[str]:
        return self.table.pieces(ids)


def open_text(reader: Any) -> StoreText | None:
    """The text an open store keeps.

    Parameters
    ----------
    reader : kvcouple.store.reader.TraceStoreReader
        The open store.

    Returns
    -------
    StoreText or None
        Its prompts' ids and token table (:meth:`StoreText.decode`, :meth:`StoreText.pieces`,
        :meth:`StoreText.prompt_ids`); None where the store keeps no text (schema version 3
        or older, a synthetic store, a run without a tokenizer): :func:`text_status` says
        which.

    Raises
    ------
    kvcouple.errors.StoreError
        The text's arrays are damaged (offsets out of order or past the bytes, a wrong
        number of documents).
    """
    if int(reader.attrs.get("schema_version", 0)) < TEXT_SINCE or not reader.attrs.get(TEXT_ATTR):
        return None
    return StoreText(reader)
