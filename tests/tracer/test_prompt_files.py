"""Prompt files read and checked without torch: the line-level errors `kvcouple trace` reports
before a model loads, ids and token bounds. Nothing here imports torch or transformers, so it
runs (not skips) where they are not installed (tests/docs/test_suite_layout.py checks that)."""

from __future__ import annotations

import json

import pytest

from kvcouple.tracer.prompts import Prompt, PromptFileError, check_prompt_file, load_prompts

BAD_FILES = [
    (lambda p: p.mkdir(), "is a directory"),
    (lambda p: p.write_text('{"id": "a", "text": "x"}\nnot json\n'), "line 2: not valid JSON"),
    (lambda p: p.write_text("[1, 2]\n"), "expected a JSON object, got list"),
    (lambda p: p.write_text('{"id": true, "text": "x"}\n'), 'line 1: missing or empty "id"'),
    (lambda p: p.write_text('{"id": "", "text": "x"}\n'), 'line 1: missing or empty "id"'),
    (lambda p: p.write_text('{"id": "a", "input_ids": [1, -2]}\n'), "token id -2"),
    (lambda p: p.write_text('{"id": "a"}\n'), 'needs "text" or "input_ids"'),
    (lambda p: p.write_bytes(b'{"id": "a", "text": "\xff\xfe"}\n'), "not UTF-8"),
    (
        lambda p: p.write_text('{"id": "a", "input_ids": [1]}\n{"id": "a", "input_ids": [2]}\n'),
        "id 'a' already used on line 1",
    ),
]


@pytest.mark.parametrize(("make", "text"), BAD_FILES)
def test_bad_prompt_files_are_refused_naming_the_line(tmp_path, make, text):
    path = tmp_path / "p.jsonl"
    make(path)
    with pytest.raises(PromptFileError) as info:
        check_prompt_file(path)
    assert text in str(info.value) and str(path) in str(info.value), info.value


def test_missing_file_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="none.jsonl"):
        check_prompt_file(tmp_path / "none.jsonl")


def test_token_id_lines_load_in_order_with_blank_lines_skipped(tmp_path):
    path = tmp_path / "p.jsonl"
    rows = [{"id": "b", "input_ids": [5, 6, 7]}, {"id": 3, "input_ids": [1, 2]}]
    path.write_text(json.dumps(rows[0]) + "\n\n" + json.dumps(rows[1]) + "\n")
    assert check_prompt_file(path) == 2
    assert load_prompts(path) == [Prompt("b", (5, 6, 7)), Prompt("3", (1, 2))]


def test_vocab_bound_and_text_without_tokenizer(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"id": "a", "input_ids": [1, 9]}\n')
    assert load_prompts(path, vocab_size=10)[0].input_ids == (1, 9)
    with pytest.raises(PromptFileError, match="9"):
        load_prompts(path, vocab_size=9)
    path.write_text('{"id": "a", "text": "hello"}\n')
    assert check_prompt_file(path) == 1  # a text line is valid; only tokenising needs a model
    with pytest.raises(PromptFileError, match="needs a tokenizer"):
        load_prompts(path)
