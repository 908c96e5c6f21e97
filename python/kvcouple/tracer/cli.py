"""``kvcouple trace``: trace documents x policies with a Hugging Face model into a store.

Example::

    kvcouple trace --model meta-llama/Llama-3.1-8B-Instruct --prompts docs.jsonl \\
        --policy snapkv:retain=0.5 --policy recent:retain=0.5 --horizon 256 \\
        --replicates 8 --branches 4 --window 32 --record summary --seed 0 --out run.zarr

Rerun the same command after an interruption to finish the store; ``--shard i/N`` lets N
processes (one per GPU) fill one store. torch is imported only when the command runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path
from typing import Any

from kvcouple import cliargs
from kvcouple.errors import InvalidInputError, require
from kvcouple.models import (
    check_gguf,
    check_hub_model,
    default_prompts_path,
    dtype_keyword,
    load_model,
    load_tokenizer,
    model_source,
    offline_mode,
    resolve_dtype,
)
from kvcouple.policies import parse_policy
from kvcouple.policies.plugins import load_plugins
from kvcouple.scheduler import check_scheduler, connect_client
from kvcouple.store import Record
from kvcouple.tracer.prompts import check_prompt_file, load_prompts


def register(subparsers: Any) -> None:
    """Add the ``trace`` command."""
    p = subparsers.add_parser(
        "trace",
        help="coupled full-cache vs evicted generation of a model into a trace store",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        default=None,
        help="Hub id, local model directory, or a .gguf file (or a folder holding one; read "
        "through transformers' GGUF support, which dequantises it) (default: the small "
        "embedded model)",
    )
    p.add_argument("--revision", default=None, help="model revision (Hub models)")
    p.add_argument(
        "--prompts",
        default=None,
        help='JSON lines of {"id", "text"} or {"id", "input_ids"} '
        "(default with the embedded model: its shipped prompts)",
    )
    p.add_argument(
        "--chat-template",
        action="store_true",
        help="wrap each text prompt in the tokenizer's chat template",
    )
    p.add_argument(
        "--policy",
        action="append",
        required=True,
        metavar="SPEC",
        help="eviction policy, e.g. snapkv:retain=0.5 (repeatable)",
    )
    add_plugin_argument(p)
    _size_arguments(p)
    _run_arguments(p)
    p.set_defaults(func=run)


def _size_arguments(p: argparse.ArgumentParser) -> None:
    """What is traced per document, and within what memory."""
    cliargs.add_horizon(p, 64)
    cliargs.add_replicates(p, 8)
    cliargs.add_branches(p, 1)
    cliargs.add_window(p, 16)
    p.add_argument("--record", default="summary", help="summary | topk:K | full")
    p.add_argument(
        "--branch-batch",
        type=cliargs.positive_or_auto,
        default="auto",
        help="most branches traced at once (each holds two cache copies); auto (default): the "
        "largest that fits the device's free memory (CUDA; on CPU every branch at once)",
    )
    p.add_argument(
        "--memory",
        type=cliargs.positive_float,
        default=None,
        metavar="GIB",
        help="device memory the run may use in all, weights included, in GiB "
        "(default: the CUDA device's free memory)",
    )
    p.add_argument(
        "--cache-layout",
        default="auto",
        choices=("auto", "shared", "split", "joint"),
        help="cache layout of one-shot policies: shared (the prompt's cache held once for all "
        "replicates), split (P and Q rows as two batches), joint (one batch, Q padded); auto "
        "(default): shared where the model allows it. Results agree to float noise",
    )
    p.add_argument(
        "--compile",
        default="off",
        choices=("off", "auto", "graphs"),
        help="torch.compile of the decoding step: off (default, eager), auto (compiled on "
        "CUDA, eager elsewhere), graphs (CUDA graphs on CUDA: mode=reduce-overhead; inductor "
        "elsewhere). Results equal eager to float noise",
    )
    p.add_argument(
        "--doc-batch",
        type=cliargs.positive_or_auto,
        default="auto",
        help="most documents traced as one batch (shared cache layout); auto (default): as "
        "many as fit the CUDA device together, up to 128 rows; on CPU one at a time",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the memory footprint of every document (cache bytes for P, Q, branches, "
        "activations; the chosen branch batch) and exit without loading weights or writing",
    )


def _run_arguments(p: argparse.ArgumentParser) -> None:
    """The decoding transform, EOS, seed, output and device."""
    p.add_argument(
        "--temperature",
        type=cliargs.finite_float,
        default=1.0,
        help="sampling temperature of both sides",
    )
    p.add_argument(
        "--top-k",
        type=cliargs.positive,
        default=None,
        help="keep the k most likely tokens (default: all)",
    )
    p.add_argument(
        "--top-p",
        type=cliargs.unit_half_open,
        default=None,
        help="nucleus sampling: smallest set with this mass (default: off)",
    )
    p.add_argument(
        "--eos",
        type=int,
        action="append",
        default=None,
        help="EOS token id (repeatable; default: the model's)",
    )
    p.add_argument("--no-eos", action="store_true", help="no absorbing EOS")
    cliargs.add_seed(p, 0, help="random seed of the coupling")
    p.add_argument("--out", required=True, help="trace store (.zarr) to create or resume")
    p.add_argument("--shard", default="0/1", help="i/N: trace documents with index i mod N")
    p.add_argument(
        "--max-docs",
        type=cliargs.nonnegative,
        default=None,
        help="stop after this many newly traced documents",
    )
    p.add_argument("--device", default=None, help="cuda, cuda:1, cpu (default: cuda if any)")
    p.add_argument(
        "--dtype",
        default=None,
        help="bfloat16, float16, float32 (default: bfloat16 on CUDA, float32 on CPU)",
    )
    p.add_argument("--attn", default="sdpa", help="attention implementation: sdpa or eager")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument(
        "--scheduler",
        default=None,
        metavar="ADDRESS",
        help="trace on a Dask cluster (tcp://host:8786): each document batch is a task; every "
        "worker loads the model once and writes into --out, which all must reach (shared "
        "storage or s3://); see docs/distributed-tracing.md",
    )


def add_plugin_argument(p: argparse.ArgumentParser) -> None:
    """``--plugin MODULE`` (repeatable), shared by ``trace`` and ``demo``."""
    p.add_argument(
        "--plugin",
        action="append",
        default=None,
        metavar="MODULE",
        help="import a module (a name, or a .py file) that registers policies, repeatable; "
        "installed packages register theirs through the entry point group kvcouple.policies",
    )


def _load(load_model: Any, args: argparse.Namespace, extra: dict[str, Any]) -> tuple[Any, Any]:
    """The model and its tokenizer; a local model directory without tokenizer files loads with
    no tokenizer (its prompts must then be given as input_ids)."""

    if _has_tokenizer(args):
        return load_model(args.model, device=args.device, dtype=args.dtype, **extra)
    import torch
    from transformers import AutoModelForCausalLM

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    extra = {**extra, dtype_keyword(): resolve_dtype(args.dtype, device)}
    local = Path(args.model)
    model = AutoModelForCausalLM.from_pretrained(local, local_files_only=True, **extra)
    model.to(device)  # type: ignore[arg-type]
    model.eval()
    return model, None


def _has_tokenizer(args: argparse.Namespace) -> bool:
    """False for a local model directory without tokenizer files."""

    local = Path(args.model) if args.model is not None else None
    return (
        local is None
        or not local.is_dir()
        or model_source(args.model).gguf_file is not None  # GGUF files carry their tokenizer
        or any(
            (local / f).exists()
            for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
        )
    )


def settings_of(args: argparse.Namespace) -> Any:
    """The run's ``TraceSettings`` from the arguments (EOS None: the model's)."""
    from kvcouple.tracer.settings import Decoding, TraceSettings

    eos = () if args.no_eos else tuple(args.eos) if args.eos else None
    return TraceSettings(
        horizon=args.horizon,
        replicates=args.replicates,
        branches=args.branches,
        window=args.window,
        decoding=Decoding(args.temperature, args.top_k, args.top_p),
        record=Record.parse(args.record),
        eos_token_ids=eos,
        branch_batch=args.branch_batch,
        cache_layout=args.cache_layout,
        doc_batch=args.doc_batch,
        compile=args.compile,
    )


def _memory(args: argparse.Namespace) -> int | None:
    """``--memory`` in bytes."""
    return None if args.memory is None else int(args.memory * 2**30)


def dry_run(args: argparse.Namespace, policies: list[Any], settings: Any) -> int:
    """Print the run's plan (:func:`~kvcouple.tracer.planner.plan_run`, the planner
    :func:`~kvcouple.tracer.run.trace` uses) from the model's config and the prompts' lengths
    (no weights loaded, nothing written); 1 if the run would be refused."""
    from dataclasses import replace

    import torch
    from transformers import AutoConfig, AutoTokenizer

    from kvcouple.tracer.planner import Budget, parse_shard, plan_run
    from kvcouple.tracer.shape import ModelShape

    src = model_source(args.model)
    kw: dict[str, Any] = {"local_files_only": True} if src.local else {}
    if args.revision:
        kw["revision"] = args.revision
    kw |= src.pretrained_kwargs()  # a GGUF file: config and tokenizer from its metadata
    config = AutoConfig.from_pretrained(src.location, **kw)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    shape = ModelShape.of_unloaded(config, resolve_dtype(args.dtype, device))
    shape = replace(shape, attn_implementation=args.attn)
    tokenizer = AutoTokenizer.from_pretrained(src.location, **kw) if _has_tokenizer(args) else None
    prompts = load_prompts(
        args.prompts or default_prompts_path(),
        tokenizer,
        chat_template=args.chat_template,
        vocab_size=shape.vocab,
    )
    if args.scheduler is not None:  # the plan in the workers' memory, not this machine's
        budget = Budget.cluster(shape, _worker_infos(args, shape), _memory(args))
    else:
        budget = Budget.local(shape, device, _memory(args), loaded=False)
    shard = parse_shard(args.shard)
    run = plan_run(shape, prompts, policies, settings, budget, shard, refuse=False)
    print(run.format())
    return 1 if run.refused else 0


def _worker_infos(args: argparse.Namespace, shape: Any) -> dict[str, Any]:
    """``--dry-run --scheduler``: each worker's device and free memory (weights not loaded)."""
    from kvcouple.tracer.distributed import worker_info

    client, _ = connect_client(None, args.scheduler)
    try:
        return dict(client.run(worker_info, _worker_model(args), shape.weight_bytes))
    finally:
        client.close()


def _worker_model(args: argparse.Namespace) -> Any:
    """How the workers load ``--model`` (a local directory by its absolute path; they resolve
    ``--device`` themselves)."""
    from kvcouple.tracer.distributed import WorkerModel

    src = model_source(args.model)
    if src.gguf_path is not None:
        where = str(src.gguf_path)
    else:
        where = str(Path(src.location).resolve()) if src.local else str(src.location)
    return WorkerModel(where, args.revision, args.dtype, args.attn, args.device)


def run(args: argparse.Namespace) -> int:
    """Run ``kvcouple trace``; returns the exit code."""
    # Validate everything cheap before loading a model.
    from kvcouple.tracer.planner import parse_shard

    check_arguments(args)
    load_plugins(args.plugin)  # before the specs are parsed: they may name plug-in policies
    policies = [parse_policy(s) for s in args.policy]
    settings = settings_of(args)
    shard = parse_shard(args.shard)
    if args.attn not in ("sdpa", "eager"):
        raise ValueError(f"--attn must be sdpa or eager, got {args.attn!r}")
    if args.dry_run:
        if args.model is not None and args.prompts is None:
            raise ValueError("--prompts is required with --model")
        return dry_run(args, policies, settings)

    from kvcouple.tracer.run import trace

    prompts_path = args.prompts
    if prompts_path is None:
        if args.model is not None:
            raise ValueError("--prompts is required with --model")
        prompts_path = default_prompts_path()
    extra = {"attn_implementation": args.attn}
    if args.revision:
        extra["revision"] = args.revision
    check_prompt_file(prompts_path)  # before the model is loaded
    if args.quiet:  # transformers' own "Loading weights" bar
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    model, tokenizer, vocab = _model_and_vocabulary(args, extra)
    check_eos(args.eos, vocab, "the model's")
    prompts = load_prompts(
        prompts_path, tokenizer, chat_template=args.chat_template, vocab_size=vocab
    )
    client, owned = connect_client(None, args.scheduler)  # checked reachable before
    try:
        summary = trace(
            model,
            prompts,
            policies,
            settings,
            args.out,
            seed=args.seed,
            model_id=args.model or "kvcouple-default",
            model_revision=args.revision or "",
            shard=shard,
            max_docs=args.max_docs,
            progress=not args.quiet,
            memory=_memory(args),
            client=client,
            tokenizer=tokenizer,
        )
    finally:
        if owned:
            client.close()
    print(summary.format())
    return 0


def _model_and_vocabulary(args: argparse.Namespace, extra: dict[str, Any]) -> tuple[Any, Any, int]:
    """The model (loaded here, or for the workers to load with ``--scheduler``), its tokenizer
    and the width of its logits."""
    from kvcouple.tracer.model import vocab_size

    if args.scheduler is None:
        model, tokenizer = _load(load_model, args, extra)
        return model, tokenizer, vocab_size(model)
    # The workers load the model; here only its tokenizer and vocabulary.
    from transformers import AutoConfig

    worker = _worker_model(args)
    kw = {"revision": args.revision} if args.revision else {}
    tokenizer = load_tokenizer(args.model, **kw) if _has_tokenizer(args) else None
    src = model_source(args.model)
    local = src.local or offline_mode() is not None
    kw |= src.pretrained_kwargs()
    config = AutoConfig.from_pretrained(src.location, local_files_only=local, **kw)
    return worker, tokenizer, int(config.get_text_config().vocab_size)


def check_arguments(args: argparse.Namespace) -> None:
    """The checks of ``kvcouple trace`` arguments that need no model (run before loading one);
    each error names the option."""
    t = args.temperature
    if not (math.isfinite(t) and t > 0 and math.isfinite(1 / t)):
        raise InvalidInputError(
            f"--temperature must be a finite number > 0 whose inverse is finite, got {t} "
            "(use --top-k 1 for greedy decoding)"
        )
    if args.eos and args.no_eos:
        raise InvalidInputError("--eos and --no-eos contradict each other")
    out = Path(args.out)
    if out.exists():
        if not out.is_dir():
            raise InvalidInputError(f"--out {args.out} is an existing file, not a trace store")
        if not any((out / m).exists() for m in (".zgroup", "zarr.json")):
            what = "an existing directory" if any(out.iterdir()) else "an empty directory"
            raise InvalidInputError(
                f"--out {args.out} is {what}, not a trace store: give a new path"
            )
    if args.scheduler is not None:  # unreachable: fail in seconds, before any model loads
        require("distributed", "trace --scheduler")
        check_scheduler(args.scheduler)
        for name in args.plugin or ():  # workers unpickle plug-in policies by module name
            if name.strip().endswith(".py") or "/" in name or os.sep in name:
                raise InvalidInputError(
                    f"--plugin {name} with --scheduler: the workers import plug-in policies by "
                    "module name; put the file's folder on the workers' PYTHONPATH (and this "
                    f"machine's) and give --plugin {Path(name).stem}"
                )
    src = model_source(args.model)
    if not src.local:  # a Hub id: cached, or the Hub reachable; else fail now, not after retries
        check_hub_model(str(src.location), args.revision)
    if src.gguf_path is not None:  # an architecture or type transformers cannot read: now
        check_gguf(src.gguf_path)
    # The vocabulary bounds --eos before the model loads where the config says it.
    vocab = _config_vocab(Path(src.location)) if src.local else None
    check_eos(args.eos, vocab, "the model config's")
    if args.device is not None or args.dtype is not None:
        _check_device(args.device, args.dtype)


def check_eos(eos: list[int] | None, vocab: int | None, whose: str) -> None:
    """``--eos`` ids must be token ids of the vocabulary (else EOS would never fire)."""

    for e in eos or ():
        if e < 0 or (vocab is not None and e >= vocab):
            bound = f"[0, {vocab}) ({whose} vocabulary)" if vocab is not None else ">= 0"
            raise InvalidInputError(f"--eos {e} is not a token id: must be in {bound}")


def _config_vocab(model_dir: Any) -> int | None:

    try:
        config = json.loads((model_dir / "config.json").read_text())
        vocab = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
    except (OSError, ValueError, AttributeError):
        return None
    return vocab if isinstance(vocab, int) and vocab > 0 else None


def _check_device(device: str | None, dtype: str | None) -> None:

    torch = require("torch", "kvcouple trace")

    try:
        dev = torch.device(device if device is not None else "cpu")
    except (RuntimeError, TypeError) as e:
        raise InvalidInputError(f"--device {device!r}: {e}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidInputError(f"--device {device}: CUDA is not available on this machine")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise InvalidInputError(
            f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)"
        )
    if dtype is not None:
        try:
            resolve_dtype(dtype, dev)
        except InvalidInputError as e:
            raise InvalidInputError(f"--dtype: {e}") from None
