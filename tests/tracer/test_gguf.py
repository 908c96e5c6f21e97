"""GGUF files the tracer cannot read are refused before any weights are read or any store is
made, naming what is unsupported: an architecture transformers has no converter for, a
quantisation type gguf cannot dequantise, a file that is not GGUF. (Loading and tracing a
real GGUF file: tests/real_model.)"""

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")

from kvcouple.cli import main as cli_main  # noqa: E402
from kvcouple.errors import InvalidInputError  # noqa: E402
from kvcouple.models import check_gguf, model_source  # noqa: E402

pytestmark = pytest.mark.torch


def write_gguf(path, arch: str, qtype=gguf.GGMLQuantizationType.F32):
    w = gguf.GGUFWriter(str(path), arch)
    if qtype == gguf.GGMLQuantizationType.F32:
        w.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    else:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        w.add_tensor("token_embd.weight", np.zeros((4, size), dtype=np.uint8), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_an_architecture_transformers_cannot_read_is_named(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", "rwkv6")
    with pytest.raises(InvalidInputError, match="architecture 'rwkv6'"):
        check_gguf(path)


def test_a_quantisation_type_gguf_cannot_dequantise_is_named(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", "llama", gguf.GGMLQuantizationType.Q8_1)
    with pytest.raises(InvalidInputError, match=r"Q8_1 \(tensor token_embd.weight\)"):
        check_gguf(path)
    ok = write_gguf(tmp_path / "ok.gguf", "llama", gguf.GGMLQuantizationType.Q4_1)
    facts = check_gguf(ok)
    assert facts.architecture == "llama" and facts.tensor_types == ("Q4_1",)


def test_the_cli_refuses_before_a_store_exists(tmp_path, capsys):
    bad = write_gguf(tmp_path / "rwkv.gguf", "rwkv6")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "input_ids": [1, 2, 3]}\n')
    for model in (bad, tmp_path):  # the file, and the folder holding it
        out = tmp_path / "s.zarr"
        argv = ["trace", "--model", str(model), "--prompts", str(prompts), "--out", str(out)]
        assert cli_main([*argv, "--policy", "full", "--quiet"]) == 2
        assert "architecture 'rwkv6'" in capsys.readouterr().err
        assert not out.exists()
    assert model_source(tmp_path).gguf_file == "rwkv.gguf"
    junk = tmp_path / "junk" / "x.gguf"
    junk.parent.mkdir()
    junk.write_bytes(b"not gguf at all")
    argv = ["trace", "--model", str(junk), "--prompts", str(prompts), "--out", str(tmp_path / "j")]
    assert cli_main([*argv, "--policy", "full", "--quiet"]) == 2
    assert "not a readable GGUF file" in capsys.readouterr().err
