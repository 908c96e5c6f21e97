"""``kvcouple demo``: the main job end to end on the embedded default model (or ``--model``:
a model directory, a .gguf file or a Hub id, on the same prompts).

Traces the shipped prompts with the small model kvcouple trains and ships, under the three
policies the paper compares (SnapKV at 50% retention, SnapKV with a fixed budget, recent-token
retention at 50%), then analyses the store, prints the decomposition per policy (occurrence,
first-mismatch contribution, exposure, mismatch rate, E[M]/T, with document-bootstrap CIs)
and writes the report. Nothing is downloaded.

Where it writes: OUT/run-<hash>/run.zarr and OUT/run-<hash>/report/, where OUT (the parent
folder) is --out, else $KVCOUPLE_DEMO_DIR, else $XDG_CACHE_HOME/kvcouple/demo
(~/.cache/kvcouple/demo), and <hash> is a short hash of the trace settings, so rerunning the
same command resumes an interrupted trace (or, when it is complete, only analyses it again)
and other settings get their own folder.

The documents are traced by --jobs processes at once (one per core by default), each filling
its share of one store (kvcouple trace --shard i/N): the model is small, so one process keeps
only one core busy.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvcouple import cliargs
from kvcouple.errors import InvalidInputError
from kvcouple.models import check_gguf, model_source
from kvcouple.store.schema import SCHEMA_VERSION
from kvcouple.tracer.cli import add_plugin_argument

DEMO_POLICIES = ("snapkv:retain=0.5", "snapkv:budget=64", "recent:retain=0.5")


def default_dir() -> Path:
    """Where the demo writes unless ``--out`` says otherwise.

    Returns
    -------
    pathlib.Path
        ``$KVCOUPLE_DEMO_DIR`` if set, else ``$XDG_CACHE_HOME/kvcouple/demo`` (by default
        ``~/.cache/kvcouple/demo``).
    """
    if os.environ.get("KVCOUPLE_DEMO_DIR"):
        return Path(os.environ["KVCOUPLE_DEMO_DIR"])
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "kvcouple" / "demo"


def cores() -> int:
    """CPU cores this process may use (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "demo",
        help="trace and analyse the embedded default model (no download)",
        description=__doc__,
    )
    p.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="parent folder: each run writes DIR/run-<hash>/ (run.zarr and report/), <hash> "
        "naming its settings (default: $KVCOUPLE_DEMO_DIR, else ~/.cache/kvcouple/demo)",
    )
    cliargs.add_horizon(p, 32)
    cliargs.add_replicates(p, 6)
    cliargs.add_branches(p, 2)
    cliargs.add_window(
        p,
        help="L: lags traced after a branch (default: to the horizon, so the decomposition "
        "is observed in full; a shorter window gives the sharp interval instead)",
    )
    p.add_argument(
        "--docs",
        type=cliargs.positive,
        default=None,
        help="trace only the first N prompts (default: all 16)",
    )
    p.add_argument(
        "--model",
        default=None,
        metavar="PATH",
        help="another model: a local model directory, a .gguf file (or a folder holding one) "
        "or a Hub id, traced on the same prompts (default: the embedded model)",
    )
    p.add_argument(
        "--chat-template",
        action="store_true",
        help="give each prompt to --model as a user message through its chat template",
    )
    p.add_argument(
        "--policy",
        action="append",
        default=None,
        metavar="SPEC",
        help=f"a policy to trace, repeatable (default: {', '.join(DEMO_POLICIES)})",
    )
    add_plugin_argument(p)
    cliargs.add_seed(p, 0, help="random seed of the coupling")
    p.add_argument(
        "--jobs",
        type=cliargs.positive,
        default=None,
        help="tracing processes (default: one per available core)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvcouple.cli import main

    _require_tracer()
    _check(args)
    trace_argv = [
        "--horizon", str(args.horizon),
        "--replicates", str(args.replicates),
        "--branches", str(args.branches),
        "--window", str(args.window if args.window is not None else args.horizon),
        "--record", "summary",
        "--seed", str(args.seed),
    ]  # fmt: skip
    for spec in args.policy or DEMO_POLICIES:
        trace_argv += ["--policy", spec]
    if args.model is not None:  # by its absolute path: the trace processes resolve it alike
        src = model_source(args.model)
        where = src.gguf_path or (Path(src.location).resolve() if src.local else src.location)
        trace_argv += ["--model", str(where)]
    if args.chat_template:
        trace_argv.append("--chat-template")
    # The store's schema version too: a store an older kvcouple wrote is not resumed.
    key = hashlib.sha256(json.dumps([trace_argv, args.docs, SCHEMA_VERSION]).encode()).hexdigest()[
        :8
    ]
    for module in args.plugin or ():  # not in the key: plug-ins add policies, not settings
        trace_argv += [
            "--plugin",
            str(Path(module).resolve()) if module.endswith(".py") else module,
        ]
    out = (Path(args.out) if args.out else default_dir()) / f"run-{key}"
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    store = out / "run.zarr"
    try:
        prompts = _prompts(out, args.docs)
        trace_argv = ["trace", "--prompts", str(prompts), "--out", str(store), *trace_argv]
        n_docs = sum(1 for line in prompts.read_text().splitlines() if line.strip())
        before = _documents_done(store) or 0
        todo = n_docs - before
        # The embedded model is too small to spread over cores: one process per core. Another
        # model spreads its own forward passes: one process.
        jobs = max(1, min(args.jobs or (cores() if args.model is None else 1), todo))
        if todo == 0:
            print(f"== kvcouple demo: {n_docs} of {n_docs} documents already traced in {store}")
        else:
            resumed = f", resuming: {before} of {n_docs} already traced" if before else ""
            print(
                f"== kvcouple demo: tracing {args.model or 'the embedded model'} into {store} "
                f"({jobs} processes{resumed})"
            )
        start = time.perf_counter()
        code = _trace(trace_argv, jobs, n_docs, store, args.quiet)
    finally:
        # A run that wrote nothing leaves no folder behind (the prompt slice is all it held).
        if created and not store.exists():
            shutil.rmtree(out, ignore_errors=True)
    if code:
        return code
    if todo == 0:
        print("== nothing left to trace (the store's settings were checked)")
    else:
        docs = "document" if todo == 1 else "documents"
        print(f"== traced {todo} {docs} in {time.perf_counter() - start:.0f} s")
    report = out / "report"
    print(f"== kvcouple demo: analysing {store} into {report}")
    argv = ["analyze", str(store), "--out", str(report)]
    code = main(argv + (["--quiet"] if args.quiet else []))
    if code == 0:
        print("\n".join(closing(store, report)))
        print(f"== done: open {report / 'report.html'}")
    return code


def _percent(value: str) -> str:
    from kvcouple.analysis.labels import percent

    return "n/a" if value in ("", "nan") else percent(float(value))


def found_lines(est: dict[tuple[str, str], str], labels: dict[str, str], horizon: int) -> list[str]:
    """One plain sentence per policy (``labels``: policy -> short label) from the estimates
    of summary.csv (``est``: (policy, quantity) -> estimate as written there)."""
    import textwrap

    T = horizon
    lines = ["== what it found"]
    for pol, label in labels.items():
        rho = est.get((pol, "rho"), "")
        after = f"{_percent(rho)} of its tokens differed"
        if rho not in ("", "nan") and float(rho) > 1:  # a Monte Carlo ratio of few documents
            after = (
                f"nearly all of its tokens differed (the estimate, {_percent(rho)}, is above "
                "100%: too few documents or replicates to pin it down)"
            )
        sentence = (
            f"{label}: the evicted model wrote a different token from the full-cache one "
            f"within {T} tokens in {_percent(est.get((pol, 'occurrence'), ''))} of "
            f"trajectories; after that first difference {after}, so "
            f"{_percent(est.get((pol, 'mismatch_fraction'), ''))} of all {T} tokens differ."
        )
        lines += textwrap.wrap(sentence, 96, initial_indent="  ", subsequent_indent="    ")
    return lines


def closing(store: Path, report: Path, color: bool | None = None) -> list[str]:
    """What the demo found, in words: one sentence per policy (from the report's
    summary.csv), then one pair of diverging continuations: the policy with the largest
    E[M]/T, on its document that diverged earliest (kvcouple show's view, short)."""
    import csv

    from kvcouple.analysis.labels import policy_labels
    from kvcouple.analysis.text_view import document_view, pair_lines
    from kvcouple.show import use_color
    from kvcouple.store.reader import TraceStoreReader
    from kvcouple.textsafe import terminal

    with (report / "summary.csv").open() as f:
        rows = list(csv.DictReader(f))
    est = {(r["policy"], r["quantity"]): r["estimate"] for r in rows}
    reader = TraceStoreReader(store)
    labels = policy_labels(reader.policies)
    lines = found_lines(est, {p: terminal(labels[p]) for p in reader.policies}, reader.dims["step"])
    worst = max(
        reader.policies, key=lambda p: float(est.get((p, "mismatch_fraction"), "nan") or "nan")
    )
    with (report / "per_document.csv").open() as f:
        docs = [r for r in csv.DictReader(f) if r["policy"] == worst]
    if not docs:
        return lines
    doc_id = max(docs, key=lambda r: float(r["occupation"]))["doc_id"]
    doc = reader.doc_ids.index(doc_id)
    view = document_view(reader, doc, reader.policies.index(worst), 0)
    lines.append(
        f"== one pair of continuations: {terminal(labels[worst])} on document "
        f"'{terminal(doc_id)}' (its earliest divergence), replicate 0; all of it:"
    )
    lines.append(f"   kvcouple show {store} --doc '{terminal(doc_id)}'")
    lines += pair_lines(view, use_color("auto") if color is None else color)
    return lines


def _check(args: argparse.Namespace) -> None:
    """Every setting argparse cannot check (:mod:`kvcouple.cliargs` checks the numbers),
    naming it, before a folder is made or a process started; the policy specs too, after the
    plug-ins that may define them are loaded."""
    from kvcouple.policies import parse_policy
    from kvcouple.policies.plugins import load_plugins

    if args.model is not None:  # a missing path or unreadable GGUF file: before any process
        src = model_source(args.model)
        if src.gguf_path is not None:
            check_gguf(src.gguf_path)
    if args.chat_template and args.model is None:
        raise InvalidInputError("--chat-template needs --model (the embedded model has none)")
    load_plugins(args.plugin)
    for spec in args.policy or DEMO_POLICIES:
        parse_policy(spec)


def _require_tracer() -> None:
    """Fail here, naming the extra, rather than in every tracing process."""
    import importlib.util

    from kvcouple.errors import missing_extra

    for module in ("torch", "transformers"):
        if importlib.util.find_spec(module) is None:
            err = missing_extra(ModuleNotFoundError(f"No module named {module!r}", name=module))
            assert err is not None
            raise err


def _trace(argv: list[str], jobs: int, n_docs: int, store: Path, quiet: bool) -> int:
    """Run ``kvcouple trace`` as ``jobs`` shard processes filling one store; one progress bar
    over documents, read from the store's completion flags."""
    from tqdm import tqdm  # type: ignore[import-untyped]

    # Each process gets its share of the cores for torch's intra-op threads.
    threads = str(max(1, cores() // jobs))
    env = {**os.environ, "OMP_NUM_THREADS": threads, "KVCOUPLE_NUM_THREADS": threads}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "kvcouple.cli", *argv, "--shard", f"{i}/{jobs}", "--quiet"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(jobs)
    ]
    bar = tqdm(
        total=n_docs,
        initial=_documents_done(store) or 0,
        unit="doc",
        desc="kvcouple demo: tracing",
        disable=quiet,
    )
    try:
        while any(p.poll() is None for p in procs):
            time.sleep(0.5)
            done = _documents_done(store)
            if done is not None and done != bar.n:
                bar.update(done - bar.n)
        done = _documents_done(store)
        if done is not None and done != bar.n:
            bar.update(done - bar.n)
    except KeyboardInterrupt:
        for p in procs:
            p.terminate()
        raise
    finally:
        bar.close()
    code = 0
    for i, p in enumerate(procs):
        stdout, stderr = p.communicate()
        if p.returncode:
            print(f"-- shard {i}/{jobs} failed:\n{stderr}", file=sys.stderr)
            code = code or p.returncode
        elif not quiet and jobs == 1:
            print(stdout, end="")
    return code


def _documents_done(store: Path) -> int | None:
    """Finished documents in a store being written, or None while it is not readable yet."""
    import numpy as np
    import zarr

    try:
        completed = zarr.open_group(str(store), mode="r")["completed"]
        if not isinstance(completed, zarr.Array):
            return None
        return int(np.asarray(completed[...]).sum())
    except Exception:  # not created yet, or a flag chunk mid-write: ask again next tick
        return None


def _prompts(out: Path, limit: int | None) -> Path:
    """The shipped prompts, or the first ``limit`` of them."""
    from kvcouple.models import default_prompts_path

    src = default_prompts_path()
    if limit is None:
        return src
    lines = [ln for ln in src.read_text().splitlines() if ln.strip()][:limit]
    dst = out / f"prompts-{limit}.jsonl"
    dst.write_text("\n".join(lines) + "\n")
    return dst
