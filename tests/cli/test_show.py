"""``kvcouple show``: the prompt's last lines, the shared continuation, the first divergence
marked and both sides after it, per branch; plain text off a terminal, shaded with --color,
JSON with --json; store text with control characters never reaches the terminal raw."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvcouple.cli import main  # noqa: E402
from kvcouple.store.reader import TraceStoreReader  # noqa: E402
from kvcouple.store.text import open_text  # noqa: E402
from text_helpers import DOCS, POLICIES, cached_text_store  # noqa: E402

pytestmark = pytest.mark.torch


@pytest.fixture(scope="module")
def store():
    return cached_text_store("summary")


def test_show_prints_both_sides_around_the_first_divergence(store, capsys):
    doc_id = DOCS[0][0]
    assert main(["show", str(store), "--doc", doc_id]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out  # not a terminal: plain text
    for policy in POLICIES:
        assert f"policy {policy}" in out  # the full spec: snapkv's defaults spelled out
    assert "Dear colleague, <b>thank you</b> & for the draft; I have" in out
    assert "first divergence at step" in out and "  P    >> " in out and "  Q    >> " in out
    # The JSON holds the same views; the sides' text is the stored ids decoded.
    assert main(["show", str(store), "--doc", doc_id, "--policy", POLICIES[0], "--json"]) == 0
    (view,) = json.loads(capsys.readouterr().out)
    assert view["doc_id"] == doc_id and view["policy"].startswith(POLICIES[0]) and view["has_text"]
    reader = TraceStoreReader(store)
    text = open_text(reader)
    assert text is not None
    steps = reader.read("branch_step", (0, 0, 0))
    for b, branch in enumerate(view["branches"]):
        assert branch["step"] == int(steps[b])
        if branch["step"]:
            p = reader.read("branch_tokens_p", (0, 0, 0, b))
            assert [t["id"] for t in branch["p"]] == [int(x) for x in p[p >= 0]]
            assert branch["p"][0]["step"] == branch["step"]
            assert len(branch["shared"]) == branch["step"] - 1
        ids = [t["id"] for t in branch["shared"] + branch["p"]]
        assert "".join(t["text"] for t in branch["shared"] + branch["p"]) == text.decode(ids)


def test_show_shades_with_color_and_escapes_control_characters(store, capsys):
    doc_id = DOCS[1][0]  # an id with an escape sequence, a prompt with a bell
    assert main(["show", str(store), "--doc", doc_id, "--color", "always"]) == 0
    out = capsys.readouterr().out
    assert "\x1b[48;5;" in out  # tokens shaded by TV
    assert "esc\\x1b[31mred" in out and "\x1b[31m" not in out
    assert "\\x07" in out and "\x07" not in out


def test_show_names_what_it_cannot_find(store, capsys):
    assert main(["show", str(store), "--doc", "nope"]) == 2
    err = capsys.readouterr().err
    assert "has no document 'nope'; its documents: " in err and "café ☃" in err
    assert main(["show", str(store), "--doc", DOCS[2][0], "--policy", "h2o:retain=0.5"]) == 2
    assert "its policies: 'recent:retain=0.5'" in capsys.readouterr().err
    assert main(["show", str(store), "--doc", DOCS[2][0], "--rep", "5"]) == 2
    assert "--rep must be in 0..1" in capsys.readouterr().err
