"""The store's text (schema version 4): the prompts' ids and every token's bytes, written by
the tracer, decode as the tokenizer does; stores of version 3 read as before and say they have
no text; damaged text is refused."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import zarr  # noqa: E402

from kvcouple.analysis import analyze  # noqa: E402
from kvcouple.cli import main  # noqa: E402
from kvcouple.errors import StoreError  # noqa: E402
from kvcouple.models import load_tokenizer  # noqa: E402
from kvcouple.store.reader import TraceStoreReader  # noqa: E402
from kvcouple.store.schema import SCHEMA_VERSION, TEXT_SINCE  # noqa: E402
from kvcouple.store.text import TokenTable, open_text, text_status  # noqa: E402
from store_helpers import set_root_attr  # noqa: E402
from text_helpers import DOCS, cached_text_store  # noqa: E402

pytestmark = pytest.mark.torch


@pytest.fixture(scope="module")
def store():
    return cached_text_store("summary")


def _decode(tokenizer, ids):
    return tokenizer.decode([int(i) for i in ids], clean_up_tokenization_spaces=False)


def test_stored_ids_decode_as_the_tokenizer_decodes_them(store):
    """Every sequence the store holds (prompts, paths, both sides of every branch) and random
    sequences of ids decode from the stored bytes exactly as the model's tokenizer decodes
    them, multi-byte characters split over tokens included."""
    tokenizer = load_tokenizer()
    reader = TraceStoreReader(store)
    assert reader.schema_version == SCHEMA_VERSION >= TEXT_SINCE
    text = open_text(reader)
    assert text is not None and text.decoder == "byte-level"
    for d, (_, prompt) in enumerate(DOCS):
        ids = text.prompt_ids(d)
        assert list(ids) == tokenizer(prompt, add_special_tokens=True)["input_ids"]
        assert text.decode(ids) == _decode(tokenizer, ids)
        assert prompt in text.decode(ids)  # the hostile characters survive as they were
        for name in ("tokens", "branch_tokens_p", "branch_tokens_q"):
            block = reader.read(name, (d,))
            for row in block.reshape(-1, block.shape[-1]):
                row = row[row >= 0]
                assert text.decode(row) == _decode(tokenizer, row)
                assert "".join(text.pieces(row)) == text.decode(row)
    rng = np.random.default_rng(0)
    for _ in range(200):
        ids = rng.integers(0, len(tokenizer), size=int(rng.integers(1, 30)))
        assert text.decode(ids) == _decode(tokenizer, ids)


def test_pieces_give_a_split_character_to_the_token_that_completes_it():
    table = TokenTable.of([b"a", "é".encode()[:1], "é".encode()[1:], "🙂".encode()])
    assert table.pieces([0, 1, 2, 3, -1]) == ["a", "", "é", "🙂", ""]
    assert table.decode([1]) == "\ufffd"  # half a character alone: replaced, not raised


def test_info_and_the_status_say_whether_a_store_has_text(store, capsys, tmp_path):
    assert main(["info", str(store)]) == 0
    assert "text      prompts and token strings (byte-level)" in capsys.readouterr().out
    from kvcouple.synth import random_pair
    from kvcouple.synth.trace_store import write_synthetic_trace_store

    synthetic = write_synthetic_trace_store(
        tmp_path / "s.zarr", {"a": random_pair(3, 2, seed=1)}, horizon=4, replicates=2,
        branches=1, docs=2, seed=0, window=None,
    )  # fmt: skip
    assert text_status(TraceStoreReader(synthetic)).startswith("no text (a synthetic store")


def test_a_version_3_store_reads_as_before_and_says_it_has_no_text(store, tmp_path, capsys):
    old = tmp_path / "old.zarr"
    shutil.copytree(store, old)
    set_root_attr(old, "schema_version", 3)
    set_root_attr(old, "text_decoder", delete=True)
    for name in ("prompt_tokens", "token_bytes", "token_ends"):
        shutil.rmtree(old / name)
    reader = TraceStoreReader(old)
    assert open_text(reader) is None
    assert text_status(reader).startswith("no text (schema version 3")
    new, before = analyze(store, n_boot=20, seed=1), analyze(old, n_boot=20, seed=1)
    assert [r["estimate"] for r in before.models[0].tables["summary"]] == [
        r["estimate"] for r in new.models[0].tables["summary"]
    ]
    assert main(["info", str(old)]) == 0
    assert "text      no text (schema version 3" in capsys.readouterr().out
    assert main(["show", str(old), "--doc", DOCS[2][0], "--policy", "recent:retain=0.5"]) == 0
    out = capsys.readouterr().out
    assert "no text (schema version 3" in out and "token ids shown" in out
    assert "[" in out.split("shared", 1)[1]  # ids, not text


def test_damaged_text_is_refused(store, tmp_path):
    bad = tmp_path / "bad.zarr"
    shutil.copytree(store, bad)
    ends = zarr.open_group(str(bad), mode="r+")["token_ends"]
    values = ends[:]
    values[5] = values[4] - 1
    ends[:] = values
    with pytest.raises(StoreError, match="'token_ends' is not a non-decreasing list"):
        open_text(TraceStoreReader(bad))
    zarr.open_group(str(bad), mode="r+")["prompt_tokens"][0, 0] = 10**6
    ends[:] = np.sort(values)
    with pytest.raises(StoreError, match="'prompt_tokens' .* holds ids outside"):
        open_text(TraceStoreReader(bad)).prompt_ids(0)
