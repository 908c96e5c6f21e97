"""Model loading, and the small model kvcouple ships so that demos run with no download.

The embedded default model (``data/default_model``) is a tiny Llama-style causal LM with
grouped-query attention (4 query heads, 2 KV heads, 4 layers, hidden 128, byte-level BPE with
512 tokens), trained by ``scripts/train_default_model.py`` on Python standard-library
docstrings. It is far too small to be useful as a language model; it exists so that the
tracer, the README demo and the notebooks have real, non-degenerate next-token distributions
on any machine, offline. ``data/prompts.jsonl`` holds held-out documents for it.

torch and transformers are imported inside the functions, so ``import kvcouple.models``
works without them.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcouple.errors import InvalidInputError, require

_DATA = Path(__file__).resolve().parent / "data"

__all__ = [
    "default_model_path",
    "default_prompts",
    "default_prompts_path",
    "dtype_keyword",
    "load_model",
    "load_tokenizer",
    "GGUFFacts",
    "ModelSource",
    "check_gguf",
    "check_hub_model",
    "file_sha256",
    "model_origin",
    "model_source",
    "offline_mode",
    "resolve_dtype",
]


def default_model_path() -> Path:
    """Directory of the embedded default model (a Hugging Face model directory)."""
    return _DATA / "default_model"


def default_prompts_path() -> Path:
    """JSON-lines file of held-out prompts for the default model: ``{"id", "text", ...}``."""
    return _DATA / "prompts.jsonl"


def default_prompts() -> list[dict[str, Any]]:
    """The shipped prompts as a list of dicts (each has at least ``id`` and ``text``)."""
    with default_prompts_path().open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def dtype_keyword() -> str:
    """``from_pretrained``'s dtype keyword: ``dtype`` from transformers 4.56, ``torch_dtype`` before.

    Newer versions still accept ``torch_dtype`` but warn; older ones silently ignore ``dtype``
    (it ends up in the config), so the choice matters.

    Returns
    -------
    str
        ``"dtype"`` or ``"torch_dtype"``.
    """
    import transformers
    from packaging.version import Version

    return "dtype" if Version(transformers.__version__).release >= (4, 56) else "torch_dtype"


def resolve_dtype(dtype: Any, device: Any) -> Any:
    """The torch dtype to load weights in.

    Parameters
    ----------
    dtype : torch.dtype, str or None
        A floating dtype or its name (``"bfloat16"``, ``"torch.float16"``); None: bfloat16 on
        CUDA, float32 elsewhere.
    device : torch.device
        Where the model will run.

    Returns
    -------
    torch.dtype
        The resolved floating dtype.

    Raises
    ------
    kvcouple.errors.InvalidInputError
        ``dtype`` names no floating torch dtype.
    """
    import torch

    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        resolved = getattr(torch, dtype.removeprefix("torch."), None)
        if isinstance(resolved, torch.dtype) and resolved.is_floating_point:
            return resolved
    raise InvalidInputError(f"dtype must be a floating torch.dtype or its name, got {dtype!r}")


# Hub ids: "name" or "owner/name" of letters, digits, "-", "_", "." (at most 96 characters).
_HUB_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]{0,95}/)?[A-Za-z0-9][\w.-]{0,95}$")


def offline_mode() -> str | None:
    """The environment variable that puts Hugging Face in offline mode (``None``: online)."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on"):
            return f"{name}={os.environ[name]}"
    return None


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from, checked without loading anything.

    ``location`` is a local directory or a Hub id; ``gguf_file`` names the GGUF file inside a
    local directory when the model is one (transformers reads it with ``gguf_file=``, tokenizer
    and chat template included, and dequantises the weights).
    """

    location: str | Path
    local: bool
    gguf_file: str | None = None

    @property
    def gguf_path(self) -> Path | None:
        """The GGUF file, for a GGUF model."""
        return Path(self.location) / self.gguf_file if self.gguf_file else None

    def pretrained_kwargs(self) -> dict[str, Any]:
        """What ``from_pretrained`` needs beyond the location: ``gguf_file`` (and nothing
        from the network) for a GGUF file."""
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


def _gguf_in(directory: Path) -> str | None:
    """The one ``.gguf`` file of a directory without ``config.json`` (None if there is none)."""
    files = sorted(f.name for f in directory.iterdir() if f.suffix.lower() == ".gguf")
    if len(files) > 1:
        raise InvalidInputError(
            f"model {directory}: the directory holds {len(files)} GGUF files "
            f"({', '.join(files[:4])}{', ...' if len(files) > 4 else ''}): give the file's path"
        )
    return files[0] if files else None


def model_source(name_or_path: str | os.PathLike[str] | None) -> ModelSource:
    """Where :func:`load_model` loads from, checked without loading anything: a local
    directory must hold a ``config.json`` or exactly one ``.gguf`` file; a path to a ``.gguf``
    file is a GGUF model; a name that is neither an existing path nor a valid Hub id
    (``owner/name``) fails at once instead of after Hub retries."""
    if name_or_path is None:
        source = default_model_path()
        if not (source / "config.json").is_file():
            raise FileNotFoundError(
                f"the embedded default model is missing from {source}; "
                "run scripts/train_default_model.py or reinstall kvcouple"
            )
        return ModelSource(source, True)
    if not isinstance(name_or_path, str | os.PathLike) or not os.fspath(name_or_path):
        raise InvalidInputError(
            f"model must be a Hub id, a local directory or a .gguf file, got {name_or_path!r}"
        )
    text = os.fspath(name_or_path)
    path = Path(text).expanduser()
    if path.exists():
        if not path.is_dir():
            if path.suffix.lower() != ".gguf":
                raise InvalidInputError(
                    f"model {text}: a file, not a model directory (nor a .gguf file)"
                )
            return ModelSource(path.resolve().parent, True, path.name)
        if (path / "config.json").is_file():
            return ModelSource(path, True)
        gguf = _gguf_in(path)
        if gguf is None:
            raise InvalidInputError(
                f"model {text}: the directory has no config.json (not a Hugging Face model) "
                "and no .gguf file"
            )
        return ModelSource(path.resolve(), True, gguf)
    if not _HUB_ID.match(text) or ".." in text or "--" in text:
        raise InvalidInputError(
            f"model {text}: no such local directory or file (and not a Hub id such as owner/name)"
        )
    return ModelSource(text, False)


@dataclass(frozen=True)
class GGUFFacts:
    """What :func:`check_gguf` read from a GGUF file's header."""

    architecture: str
    tensor_types: tuple[str, ...]  # the distinct GGML types of its tensors, e.g. ("Q4_1", "F32")


@functools.lru_cache(maxsize=8)
def _check_gguf(path: Path, size: int, mtime_ns: int) -> GGUFFacts:
    gguf = require("gguf", "loading a GGUF model")
    require("accelerate", "loading a GGUF model")  # transformers' GGUF loader needs it
    require("transformers", "loading a GGUF model")
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    try:
        reader = gguf.GGUFReader(path)
        field = reader.fields["general.architecture"]
        architecture = bytes(field.parts[field.data[0]]).decode("utf-8")
    except KeyError:
        raise InvalidInputError(f"model {path}: the GGUF file names no architecture") from None
    except Exception as e:  # noqa: BLE001 - gguf raises bare ValueErrors and worse
        raise InvalidInputError(f"model {path}: not a readable GGUF file ({e})") from None
    if architecture not in GGUF_SUPPORTED_ARCHITECTURES:
        raise InvalidInputError(
            f"model {path}: transformers cannot read GGUF models of architecture "
            f"{architecture!r} (it reads {', '.join(sorted(GGUF_SUPPORTED_ARCHITECTURES))})"
        )
    # A type is readable if gguf dequantises it: try the first row of one tensor of each type.
    first: dict[Any, Any] = {}
    for tensor in reader.tensors:
        first.setdefault(tensor.tensor_type, tensor)
    unreadable = []
    for qtype, tensor in first.items():
        try:
            gguf.quants.dequantize(tensor.data[:1], qtype)
        except NotImplementedError:
            unreadable.append(f"{qtype.name} (tensor {tensor.name})")
    if unreadable:
        raise InvalidInputError(
            f"model {path}: its quantisation types cannot be dequantised by the installed gguf "
            f"package: {', '.join(unreadable)}"
        )
    return GGUFFacts(architecture, tuple(sorted(t.name for t in first)))


def check_gguf(path: str | os.PathLike[str]) -> GGUFFacts:
    """Refuse, naming what is unsupported, a GGUF file transformers cannot load: an
    architecture it has no converter for, or a quantisation type gguf cannot dequantise. Reads
    only the header and one row per tensor type (memory-mapped); kept per file version.

    Raises
    ------
    kvcouple.errors.InvalidInputError
        The file is not GGUF, or names an unsupported architecture or quantisation type.
    kvcouple.errors.MissingExtraError
        gguf (the ``gguf`` extra) is not installed.
    """
    p = Path(path).resolve()
    st = p.stat()
    return _check_gguf(p, st.st_size, st.st_mtime_ns)


def file_sha256(path: str | os.PathLike[str]) -> str:
    """The hex sha256 of a file (read in 4 MiB blocks: memory stays flat for large models)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(4 << 20):
            digest.update(block)
    return digest.hexdigest()


# model -> {"model_file": name, "model_sha256": hex} for models loaded from GGUF files; read by
# the tracer's provenance. Kept here (weakly), not as attributes on transformers' objects.
_ORIGINS: weakref.WeakKeyDictionary[Any, dict[str, str]] = weakref.WeakKeyDictionary()


def model_origin(model: Any) -> dict[str, str]:
    """The file a model was loaded from, when :func:`load_model` read it from a GGUF file:
    ``{"model_file": name, "model_sha256": hex}`` (empty otherwise)."""
    try:
        return dict(_ORIGINS.get(model, {}))
    except TypeError:  # not weakly referenceable: not loaded here
        return {}


_PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")


def check_hub_model(repo_id: str, revision: str | None = None) -> None:
    """Fail at once for a Hub id that cannot be loaded, instead of after the Hub client's
    retries (about 25 s per file): it must be in the local Hugging Face cache, or the Hub must
    answer a connection.

    Parameters
    ----------
    repo_id : str
        A Hub model id (``owner/name``), as :func:`model_source` returned it.
    revision : str, optional
        The branch, tag or commit to look for in the cache (default: ``main``).

    Raises
    ------
    kvcouple.errors.InvalidInputError
        The model is not cached and offline mode is on (``HF_HUB_OFFLINE``), or the Hub's host
        cannot be reached (no network, no DNS). Behind a proxy the reachability is left to the
        Hub client.
    kvcouple.errors.MissingExtraError
        huggingface_hub (the ``tracer`` extra) is not installed.
    """
    import socket
    from urllib.parse import urlsplit

    hub = require("huggingface_hub", "loading a Hub model")
    cached = hub.try_to_load_from_cache(repo_id, "config.json", revision=revision)
    if isinstance(cached, str):
        return
    offline = offline_mode()
    if offline:
        raise InvalidInputError(
            f"model {repo_id!r} is not in the local Hugging Face cache and offline mode is on "
            f"({offline}): download it while online, pass a local directory, or unset it"
        )
    if any(os.environ.get(v) for v in _PROXY_VARIABLES):
        return  # the proxy decides: a direct connection proves nothing
    endpoint = urlsplit(hub.constants.ENDPOINT)
    host = endpoint.hostname or "huggingface.co"
    port = endpoint.port or (80 if endpoint.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=5).close()
    except OSError as e:
        raise InvalidInputError(
            f"model {repo_id!r} is not in the local Hugging Face cache and the Hub "
            f"({endpoint.scheme}://{host}) cannot be reached ({e.strerror or e}): connect to the "
            "network, pass a local model directory, or download the model first; "
            "HF_HUB_OFFLINE=1 makes every lookup local (no retries)"
        ) from None


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def load_model(
    name_or_path: str | Path | None = None,
    *,
    device: Any = None,
    dtype: Any = None,
    **from_pretrained_kwargs: Any,
) -> tuple[Any, Any]:
    """Load a causal LM and its tokenizer; returns ``(model, tokenizer)``, model in eval mode.

    Parameters
    ----------
    name_or_path:
        ``None`` for the embedded default model; otherwise a local model directory (loaded
        with ``local_files_only=True``, never touching the network) or a Hugging Face Hub id.
    device:
        Where to put the model; default ``"cuda"`` if available, else ``"cpu"``.
    dtype:
        A torch dtype or its name (``"bfloat16"``); default bfloat16 on CUDA, float32 on CPU.
    **from_pretrained_kwargs:
        Passed to ``AutoModelForCausalLM.from_pretrained`` (e.g. ``attn_implementation``,
        ``revision``).
    """
    src = model_source(name_or_path)
    source, local = src.location, src.local
    if not local:
        check_hub_model(str(source), from_pretrained_kwargs.get("revision"))
    require("torch", "loading a model")
    require("transformers", "loading a model")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if src.gguf_path is not None:
        check_gguf(src.gguf_path)  # before any weights are read
    dev = torch.device(
        device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    )
    torch_dtype = resolve_dtype(dtype, dev)
    kwargs = dict(from_pretrained_kwargs) | src.pretrained_kwargs()
    offline = offline_mode()
    if local or offline:
        kwargs["local_files_only"] = True
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            source,
            **{
                k: v
                for k, v in kwargs.items()
                if k in ("local_files_only", "revision", "token", "gguf_file")
            },
        )
        kwargs[dtype_keyword()] = torch_dtype
        model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    except OSError as e:
        if local:
            raise InvalidInputError(
                f"model {os.fspath(source)} cannot be loaded: {_first_line(e)}"
            ) from e
        if offline:
            raise InvalidInputError(
                f"model {source!r} is not in the local Hugging Face cache and offline mode is on "
                f"({offline}): download it while online, pass a local directory, or unset it"
            ) from e
        raise InvalidInputError(
            f"model {source!r} could not be loaded from the Hugging Face Hub: {_first_line(e)}"
        ) from e
    # transformers types ``to`` as functools.wraps(torch.nn.Module.to), which mypy binds wrongly.
    model.to(dev)  # type: ignore[arg-type]
    model.eval()
    if src.gguf_path is not None:
        _ORIGINS[model] = {
            "model_file": src.gguf_path.name,
            "model_sha256": file_sha256(src.gguf_path),
        }
    return model, tokenizer


def load_tokenizer(name_or_path: str | Path | None = None, *, revision: str | None = None) -> Any:
    """The tokenizer of a model, without loading the model: the embedded default model's for
    ``None``, a local model directory's (never touching the network), or a Hub id's.

    Parameters
    ----------
    name_or_path:
        ``None``, a local directory or a Hugging Face Hub id (as :func:`load_model`).
    revision:
        The Hub revision (ignored for local directories).
    """
    src = model_source(name_or_path)
    source, local = src.location, src.local
    if not local:
        check_hub_model(str(source), revision)
    require("transformers", "loading a tokenizer")
    from transformers import AutoTokenizer

    if src.gguf_path is not None:
        check_gguf(src.gguf_path)
    kwargs: dict[str, Any] = src.pretrained_kwargs()
    if local or offline_mode():
        kwargs["local_files_only"] = True
    if revision and not local:
        kwargs["revision"] = revision
    try:
        return AutoTokenizer.from_pretrained(source, **kwargs)
    except (OSError, ValueError) as e:
        raise InvalidInputError(
            f"the tokenizer of {os.fspath(source)} cannot be loaded: {_first_line(e)}"
        ) from e
