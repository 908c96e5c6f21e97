"""A small store with text, traced from the embedded default model (which ships a tokenizer):
hostile document ids and prompt text (markup, control characters, multi-byte characters), the
full record (so the path's rows can be recomputed), two policies."""

from __future__ import annotations

import atexit
import functools
import json
import shutil
import tempfile
from pathlib import Path

# Ids and texts as a hostile user might write them: markup, an escape sequence, a bell,
# characters of two, three and four bytes.
DOCS = [
    ("<script>alert('id')</script>", "Dear colleague, <b>thank you</b> & for the draft; I have"),
    ("esc\x1b[31mred", "To build the package from a checkout, first install \x07 a Rust"),
    ("café ☃", "Über naïve café — 北京 🙂 the weather today is"),
]
POLICIES = ["recent:retain=0.5", "snapkv:retain=0.5"]


def write_prompts(path: Path) -> Path:
    path.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in DOCS))
    return path


def trace_text_store(folder: Path, record: str = "full", horizon: int = 8) -> Path:
    """Trace :data:`DOCS` under :data:`POLICIES` into ``folder/run.zarr`` (a few seconds)."""
    from kvcouple.models import load_model
    from kvcouple.store.schema import Record
    from kvcouple.tracer import load_prompts
    from kvcouple.tracer.run import trace
    from kvcouple.tracer.settings import TraceSettings

    model, tokenizer = load_model(None, device="cpu")
    prompts = load_prompts(write_prompts(folder / "docs.jsonl"), tokenizer)
    settings = TraceSettings(
        horizon=horizon, replicates=2, branches=2, window=horizon, record=Record.parse(record)
    )
    out = folder / "run.zarr"
    trace(
        model, prompts, POLICIES, settings, out, seed=0, progress=False, tokenizer=tokenizer,
        model_id="kvcouple-default",
    )  # fmt: skip
    return out


@functools.cache
def cached_text_store(record: str = "summary", horizon: int = 8) -> Path:
    """:func:`trace_text_store` once per test process and settings (the tests that change a
    store copy it first); removed when the process ends."""
    folder = Path(tempfile.mkdtemp(prefix="kvcouple-text-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return trace_text_store(folder, record=record, horizon=horizon)


def add_text(store: Path, pieces: list[bytes], prompts: list[list[int]]) -> Path:
    """Give a store (a synthetic one: its tokens are a kernel pair's states) the text of a
    traced one: ``pieces`` as the bytes of its token ids, ``prompts`` as its prompts' ids."""
    import warnings

    import numpy as np
    import zarr

    from kvcouple.store.create import create_array as _create_array
    from kvcouple.store.schema import TEXT_VARIABLES
    from kvcouple.store.text import TEXT_ATTR, TextTables, TokenTable
    from store_helpers import set_root_attr

    text = TextTables([np.asarray(p, np.int32) for p in prompts], TokenTable.of(pieces), "test")
    group = zarr.open_group(str(store), mode="r+")
    for name, values in text.arrays(len(pieces)).items():
        dims = TEXT_VARIABLES[name].dims
        chunks = (1, *values.shape[1:]) if dims[0] == "doc" else values.shape
        _create_array(group, name, values, chunks, TEXT_VARIABLES[name].dtype, dims)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        zarr.consolidate_metadata(str(store))
    set_root_attr(store, TEXT_ATTR, "byte-level")
    return store


def synthetic_text_store(path: Path, docs: int, horizon: int = 32) -> Path:
    """A synthetic store of ``docs`` documents under three policies, its 64 states given the
    text of the embedded model's first 64 ordinary tokens (a few fast seconds)."""
    from kvcouple import synth
    from kvcouple.models import load_tokenizer
    from kvcouple.store.text import token_bytes
    from kvcouple.synth.trace_store import write_synthetic_trace_store

    pairs = {
        spec: synth.random_pair(64, 4, seed=1, closeness=c)
        for spec, c in (
            ("snapkv:retain=0.5", 0.7),
            ("snapkv:budget=64", 0.6),
            ("recent:retain=0.5", 0.8),
        )
    }
    store = write_synthetic_trace_store(
        path, pairs, horizon=horizon, replicates=1, branches=1, docs=docs, seed=0
    )
    pieces, _ = token_bytes(load_tokenizer(), 512)
    ordinary = pieces[256 : 256 + 64]  # merged tokens: words and parts of words
    prompt = [i % 64 for i in range(200)]
    return add_text(store, ordinary, [prompt] * docs)
