"""Bad input to ``kvcouple trace``, model loading, prompt files and stores (issue 11).

Everything here must be refused before a model is loaded: ``load_model`` is replaced by a
function that fails the test if it is called.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

import kvcouple.models
import kvcouple.tracer.cli as tracer_cli
from kvcouple import InvalidInputError, StoreError, synth
from kvcouple.cli import main
from kvcouple.models import ModelSource, model_source
from kvcouple.policies import PolicyError, parse_policy
from kvcouple.synth.trace_store import write_synthetic_trace_store
from store_helpers import set_root_attr


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as e:
        code = int(e.code or 0)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return code, err


@pytest.fixture
def no_model_load(monkeypatch):
    def refuse(*_a, **_k):
        raise AssertionError("the model was loaded before the arguments were checked")

    # The name the trace command calls (bound at its import; patching kvcouple.models alone
    # would miss it once imported, or leak into it when first imported here).
    monkeypatch.setattr(tracer_cli, "load_model", refuse)
    monkeypatch.setattr(kvcouple.models, "load_model", refuse)


@pytest.fixture
def prompts(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"id": "a", "input_ids": [1, 2, 3, 4]}\n')
    return path


def _trace(tmp_path: Path, *extra: str) -> list[str]:
    return ["trace", "--policy", "full", "--out", str(tmp_path / "t.zarr"), *extra]


TRACE_CASES = [
    # (extra arguments, text of the one error line)
    (["--temperature", "1e-320"], "--temperature"),
    (["--temperature", "0"], "--temperature"),
    (["--temperature", "nan"], "--temperature"),
    (["--temperature", "inf"], "--temperature"),
    (["--top-k", "0"], "--top-k"),
    (["--top-p", "nan"], "--top-p"),
    (["--top-p", "1.5"], "--top-p"),
    (["--seed", "-1"], "--seed"),
    (["--max-docs", "-1"], "--max-docs"),
    (["--eos", "-1"], "--eos -1"),
    (["--eos", "99999"], "--eos 99999 is not a token id: must be in [0, 512)"),
    (["--eos", "3", "--no-eos"], "--no-eos"),
    (["--horizon", "0"], "--horizon"),
    (["--horizon", str(2**50)], "--horizon"),
    (["--window", "-1"], "--window"),
    (["--branch-batch", "0"], "--branch-batch"),
    (["--branch-batch", "-5"], "--branch-batch"),
    (["--policy", "random:retain=0.5,seed=99999999999999999"], "seed must be in [0, 2**32)"),
    (["--policy", "snapkv:retain=nan"], "retain"),
    (["--device", "bogus"], "--device"),
    (["--dtype", "int8"], "--dtype"),
    (["--model", "./no/such/model"], "no such local directory"),
    (["--model", "no/such/model"], "no such local directory"),
    (["--model", "white space"], "no such local directory"),
]


@pytest.mark.torch
@pytest.mark.parametrize(("extra", "text"), TRACE_CASES)
def test_trace_arguments(tmp_path, capsys, no_model_load, prompts, extra, text):
    pytest.importorskip("torch")
    start = time.monotonic()
    code, err = _cli(_trace(tmp_path, "--prompts", str(prompts), *extra), capsys)
    assert code == 2, err
    assert err.count("error:") == 1 and text in err, err
    assert time.monotonic() - start < 10  # no Hub retries
    assert not (tmp_path / "t.zarr").exists()


@pytest.mark.torch
def test_trace_out_that_is_not_a_store(tmp_path, capsys, no_model_load, prompts):
    pytest.importorskip("torch")
    file = tmp_path / "file"
    file.write_text("mine")
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    empty = tmp_path / "empty"
    empty.mkdir()
    for out, text in [(file, "existing file"), (other, "existing directory"), (empty, "empty")]:
        argv = ["trace", "--policy", "full", "--prompts", str(prompts), "--out", str(out)]
        code, err = _cli(argv, capsys)
        assert code == 2 and "--out" in err and text in err, err
    assert file.read_text() == "mine" and (other / "notes.txt").read_text() == "mine"


PROMPT_CASES = [
    (lambda p: p.mkdir(), "is a directory"),
    (lambda p: p.write_text(""), "holds no prompts"),
    (lambda p: p.write_text('{"id": "a", "text": "x"}\nnot json\n'), "line 2: not valid JSON"),
    (lambda p: p.write_text('{"id": true, "text": "x"}\n'), 'line 1: missing or empty "id"'),
    (lambda p: p.write_text('{"id": "a", "input_ids": [1, -2]}\n'), "token id -2"),
    (lambda p: p.write_text('{"id": "a", "input_ids": []}\n'), "empty prompt"),
    (lambda p: p.write_text('{"id": "a"}\n'), 'needs "text" or "input_ids"'),
    (lambda p: p.write_bytes(b'{"id": "a", "text": "\xff\xfe"}\n'), "not UTF-8"),
]


@pytest.mark.torch
@pytest.mark.parametrize(("make", "text"), PROMPT_CASES)
def test_prompts_are_checked_before_the_model_loads(tmp_path, capsys, no_model_load, make, text):
    pytest.importorskip("torch")
    path = tmp_path / "p.jsonl"
    make(path)
    code, err = _cli(_trace(tmp_path, "--prompts", str(path)), capsys)
    assert code == 2 and text in err and str(path) in err, err


@pytest.mark.torch
def test_missing_prompt_file(tmp_path, capsys, no_model_load):
    pytest.importorskip("torch")
    code, err = _cli(_trace(tmp_path, "--prompts", str(tmp_path / "none.jsonl")), capsys)
    assert code == 2 and "none.jsonl" in err


# --- model loading ---------------------------------------------------------------------------


def test_model_source(tmp_path):
    with pytest.raises(InvalidInputError, match="no such local directory"):
        model_source("./no/such/model")
    with pytest.raises(InvalidInputError, match="no such local directory"):
        model_source("a/b/c")
    (tmp_path / "f").write_text("x")
    with pytest.raises(InvalidInputError, match="a file, not a model directory"):
        model_source(tmp_path / "f")
    with pytest.raises(InvalidInputError, match="no config.json"):
        model_source(tmp_path)
    with pytest.raises(InvalidInputError, match="model must be"):
        model_source(3)  # type: ignore[arg-type]
    assert model_source("meta-llama/Llama-3.1-8B") == ModelSource("meta-llama/Llama-3.1-8B", False)
    assert model_source("gpt2") == ModelSource("gpt2", False)
    assert model_source(None).local is True
    # GGUF: a .gguf file, or a directory holding exactly one (and no config.json).
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    assert model_source(tmp_path) == ModelSource(tmp_path.resolve(), True, "m.gguf")
    assert model_source(tmp_path / "m.gguf").gguf_path == tmp_path.resolve() / "m.gguf"
    (tmp_path / "n.gguf").write_bytes(b"GGUF")
    with pytest.raises(InvalidInputError, match="2 GGUF files"):
        model_source(tmp_path)


@pytest.mark.torch
def test_load_model_fails_at_once_on_a_missing_path():
    pytest.importorskip("torch")
    start = time.monotonic()
    with pytest.raises(InvalidInputError, match="no such local directory"):
        kvcouple.models.load_model("./no/such/model")
    assert time.monotonic() - start < 5


@pytest.mark.torch
@pytest.mark.parametrize("variable", ["HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"])
def test_offline_mode_is_said(tmp_path, capsys, monkeypatch, prompts, variable):
    pytest.importorskip("transformers")
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):  # CI sets one of them itself
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(variable, "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty cache
    with pytest.raises(InvalidInputError, match=f"offline mode is on \\({variable}=1\\)"):
        kvcouple.models.load_model("kvcouple-test/not-cached-model")
    argv = _trace(tmp_path, "--prompts", str(prompts), "--model", "kvcouple-test/not-cached")
    code, err = _cli(argv, capsys)
    assert code == 2 and "offline mode" in err and "kvcouple-test/not-cached" in err


def test_random_policy_seed_range():
    with pytest.raises(PolicyError, match=r"seed must be in \[0, 2\*\*32\)"):
        parse_policy("random:retain=0.5,seed=4294967296")
    with pytest.raises(PolicyError, match="seed"):
        parse_policy("random:retain=0.5,seed=-1")
    assert issubclass(PolicyError, InvalidInputError)
    assert parse_policy("random:retain=0.5,seed=4294967295").params["seed"] == 2**32 - 1


@pytest.mark.torch
def test_torch_decoding_tiny_temperatures():
    torch = pytest.importorskip("torch")
    import kvcouple
    from kvcouple.torch_coupling import apply_decoding

    with pytest.raises(InvalidInputError, match="temperature"):
        apply_decoding(torch.zeros(1, 3), 1e-320)
    with pytest.raises(InvalidInputError, match="top_k"):
        apply_decoding(torch.zeros(1, 3), 1.0, top_k=1.5)  # type: ignore[arg-type]
    logits = np.array([[1.0, 3.0, 2.0], [-1e300, -2e300, -3e300], [5e307, 1e308, 0.0]])
    for t in (1e-300, 1e-10, 1.0):
        ours = apply_decoding(torch.from_numpy(logits), t).numpy()
        assert np.all(np.isfinite(ours))
        # The Rust transform agrees (entropy 0 where both are one-hot).
        d = kvcouple.divergences(logits, logits, logits=True, temperature=t)
        assert np.all(np.isfinite(d.entropy_p))
    np.testing.assert_array_equal(apply_decoding(torch.from_numpy(logits), 1e-300)[0], [0, 1, 0])


# --- stores ----------------------------------------------------------------------------------


@pytest.fixture
def pair_file(tmp_path: Path) -> Path:
    path = tmp_path / "p.npz"
    synth.save_pair(synth.random_pair(3, 2, seed=1), path)
    return path


def test_writer_refuses_non_store_paths(tmp_path, capsys, pair_file):
    file = tmp_path / "file"
    file.write_text("mine")
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    for out, text in [(file, "is a file"), (other, "a directory without a Zarr group")]:
        code, err = _cli(
            ["synth", "trace-store", str(pair_file), "--out", str(out), "-T", "3"], capsys
        )
        assert code == 2 and text in err and "not a kvcouple trace store" in err, err
        with pytest.raises(StoreError, match=text):
            write_synthetic_trace_store(out, {"p": pair_file}, horizon=3)
    assert file.read_text() == "mine"


def _set_schema_version(path: Path, version: object) -> None:
    set_root_attr(path, "schema_version", version)


@pytest.mark.parametrize("version", ["1", "2", 1.0, None, [2]])
def test_schema_version_of_the_wrong_type(tmp_path, capsys, pair_file, version):
    store = tmp_path / "s.zarr"
    write_synthetic_trace_store(store, {"p": pair_file}, horizon=3, replicates=2)
    _set_schema_version(store, version)
    code, err = _cli(["analyze", str(store), "--out", str(tmp_path / "r")], capsys)
    assert code == 2
    if version is None:
        assert "not a kvcouple trace store" in err
    else:
        assert f"schema_version is {version!r}" in err and "cannot read it" not in err
    code, err = _cli(
        ["synth", "trace-store", str(pair_file), "--out", str(store), "-T", "3", "-R", "2"], capsys
    )
    assert code == 2 and "schema_version" in err
