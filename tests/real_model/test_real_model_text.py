"""What diverged, on a real model: SmolLM2-135M-Instruct (the ``smollm2_dir`` fixture) traced
from a text prompt through its chat template, analysed end to end. The store's text decodes as
the model's own tokenizer decodes the same ids; ``kvcouple show`` prints both sides around the
first divergence; the report shows them."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvcouple.cli import main  # noqa: E402
from kvcouple.models import load_tokenizer  # noqa: E402
from kvcouple.store.reader import TraceStoreReader  # noqa: E402
from kvcouple.store.text import open_text  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.real_model]

TEXT = (
    "Summarise this licence in one sentence. Permission is hereby granted, free of charge, to "
    "any person obtaining a copy of this software, to deal in the software without restriction, "
    "including the rights to use, copy, modify, merge, publish and distribute it."
)


@pytest.fixture(scope="module")
def traced(smollm2_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("real-text")
    prompts = tmp / "docs.jsonl"
    prompts.write_text(json.dumps({"id": "licence", "text": TEXT}) + "\n")
    out = tmp / "run.zarr"
    argv = ["trace", "--model", str(smollm2_dir), "--prompts", str(prompts), "--out", str(out)]
    argv += ["--chat-template", "--policy", "recent:retain=0.5", "--horizon", "12"]
    argv += ["--window", "12", "--replicates", "2", "--branches", "1", "--seed", "0", "--quiet"]
    assert main(argv) == 0
    return out


def test_stored_ids_decode_as_smollm2s_tokenizer_decodes_them(traced, smollm2_dir):
    tokenizer = load_tokenizer(smollm2_dir)
    reader = TraceStoreReader(traced)
    text = open_text(reader)
    assert text is not None and text.decoder == "byte-level"
    prompt = text.prompt_ids(0)
    assert "Summarise this licence" in text.decode(prompt)
    for ids in [prompt, *(r[r >= 0] for r in reader.read("tokens", (0, 0)))]:
        want = tokenizer.decode([int(i) for i in ids], clean_up_tokenization_spaces=False)
        assert text.decode(ids) == want
    for name in ("branch_tokens_p", "branch_tokens_q"):
        for row in reader.read(name, (0,)).reshape(-1, reader.dims["lag"]):
            row = row[row >= 0]
            want = tokenizer.decode([int(i) for i in row], clean_up_tokenization_spaces=False)
            assert text.decode(row) == want
    rng = np.random.default_rng(0)
    for _ in range(50):
        ids = [int(i) for i in rng.integers(0, len(tokenizer), size=16)]
        assert text.decode(ids) == tokenizer.decode(ids, clean_up_tokenization_spaces=False)


def test_show_and_the_report_give_the_text_around_the_divergence(traced, tmp_path, capsys):
    assert main(["show", str(traced), "--doc", "licence"]) == 0
    out = capsys.readouterr().out
    assert "prompt (" in out and "assistant" in out  # the chat template's last lines
    assert "  P    >> " in out or "no divergence within the horizon" in out
    assert main(["analyze", str(traced), "--out", str(tmp_path / "r"), "--quiet"]) == 0
    page = (tmp_path / "r" / "report.html").read_text()
    assert "<h2>What diverged</h2>" in page and "licence" in page
    assert "Summarise this licence in one sentence" in page  # the prompt, folded
    assert 'class="tv-sides"' in page or "no divergence within the horizon" in page
