"""``kvcouple analyze`` and ``kvcouple info``."""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvcouple import cliargs
from kvcouple.analysis.engine import DEFAULT_N_BOOT
from kvcouple.analysis.estimates import ESTIMATORS
from kvcouple.analysis.intervals import CI_METHODS, DEFAULT_CI_METHOD
from kvcouple.analysis.memory import small_pages
from kvcouple.errors import StoreError, debug_requested
from kvcouple.textsafe import terminal

if TYPE_CHECKING:
    from kvcouple.store.reader import TraceStoreReader


def _import_figures() -> None:
    for module in ("matplotlib.figure", "matplotlib.backends.backend_agg"):
        try:
            importlib.import_module(module)
        except Exception:  # noqa: BLE001 (the report's own import says what is wrong)
            return


# The command's threshold for collecting young objects: a 100k-document analysis makes
# about 500k objects the collector tracks (its documents' results), and at Python's 700 it
# collected about 780 times for 0.3 s, under the GIL, beside the reads; at 50,000, 8 times
# for 0.07 s.
COMMAND_GC_THRESHOLD = 50_000


@contextlib.contextmanager
def frozen_garbage_collector() -> Iterator[None]:
    """The objects alive when the command starts (its modules', about 200k) kept out of the
    cyclic garbage collector's walks while it runs: they live as long as the process, and
    every full collection walked them all again, under the GIL, beside the reads. Young
    objects are collected in batches of :data:`COMMAND_GC_THRESHOLD`. Both are undone on
    the way out."""
    thresholds = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(COMMAND_GC_THRESHOLD, *thresholds[1:])
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()


def _analyze(args: argparse.Namespace) -> int:
    # The report's modules first, so that their objects are frozen with the others.
    importlib.import_module("kvcouple.analysis.report")
    with small_pages(), frozen_garbage_collector():
        return _analyze_store(args)


def _analyze_store(args: argparse.Namespace) -> int:
    from kvcouple.analysis.console import format_decomposition, run_stamp
    from kvcouple.analysis.engine import analyze
    from kvcouple.analysis.report import DocumentFiles, write_report
    from kvcouple.errors import InvalidInputError, MissingExtraError, require

    out_dir = Path(args.out)
    if out_dir.exists() and not out_dir.is_dir():
        raise InvalidInputError(f"--out {args.out} exists and is not a directory")
    figures = not args.no_figures
    if figures:
        try:
            require("matplotlib", "the report's figures")
        except MissingExtraError as e:
            print(f"warning: {e}; writing the report without figures", file=sys.stderr)
            figures = False
    if figures:
        # matplotlib's import (~0.5 s of Python) while the analysis runs, mostly in Rust.
        threading.Thread(target=_import_figures, daemon=True).start()
    # per_document.csv (and results.json's rows) written while the statistics run.
    documents = DocumentFiles(out_dir)
    try:
        result = analyze(
            args.stores,
            window=args.window,
            estimator=args.estimator,
            allow_incomplete=args.allow_incomplete,
            scheduler=args.scheduler,
            worker_threads=args.worker_threads,
            recompute=not args.no_recompute,
            tolerance=args.tolerance,
            n_boot=args.n_boot,
            seed=args.seed,
            ci=args.ci,
            ci_method=args.ci_method,
            early_late_split=args.early_late_split,
            reference=args.reference,
            pool_models=True if args.pool_models else None,
            plan=args.plan,
            doc_set=args.docs,
            allow_unregistered=args.not_preregistered,
            io_threads=args.io_threads,
            progress=not args.quiet,
            on_documents=documents.start,
        )
    except BaseException:
        documents.discard()
        raise
    out = write_report(
        result, out_dir, figures=figures, html_report=not args.no_figures, documents=documents
    )
    for s in result.skipped:
        print(
            f"skipped {terminal(s['doc_id'])} ({terminal(s['store'])}): {terminal(s['reason'])}",
            file=sys.stderr,
        )
    for store, checksums in result.settings.get("store_checksums", {}).items():
        if checksums.startswith("no checksums"):
            print(
                f"note: {terminal(store)} has {checksums}: damage that still decodes is caught "
                "only by the value checks",
                file=sys.stderr,
            )
    n_bad = len(result.checks())
    if n_bad:
        print(
            f"warning: {n_bad} recorded TVs disagree with the stored distributions beyond "
            f"the tolerance; see {out / 'recompute_check.csv'}",
            file=sys.stderr,
        )
    print(format_decomposition(result), end="")
    print(f"{run_stamp(result)}; wrote {out}")
    return 0


def store_summary(
    path: str, check: bool = False, storage_options: dict[str, Any] | None = None
) -> dict[str, Any]:
    """What ``kvcouple info`` prints: schema, model, policies, documents done, size; with
    ``check``, every problem the reader finds in the finished documents."""
    from kvcouple.store.reader import TraceStoreReader
    from kvcouple.store.text import text_status

    reader = TraceStoreReader(path, storage_options)
    a = reader.attrs
    ids = reader.doc_ids
    out: dict[str, Any] = {
        "store": str(path),
        "schema_version": a.get("schema_version"),
        "kvcouple_version": a.get("kvcouple_version"),
        "model_id": a.get("model_id"),
        "model_revision": a.get("model_revision"),
        "source": a.get("source"),
        "record": a.get("record"),
        "dtype": a.get("dtype"),
        "policies": [
            p.get("spec", p.get("name")) if isinstance(p, dict) else p
            for p in a.get("policies", [])
        ]
        or list(a.get("policy_specs", [])),
        "horizon": a.get("horizon"),
        "window": a.get("window"),
        "branches": a.get("branches"),
        "replicates": a.get("replicates"),
        "vocab_size": a.get("vocab_size"),
        "documents": len(ids),
        "documents_done": len(reader.done),
        "unfinished": [ids[i] for i in reader.unfinished()][:20],
        # "being written by ..." while a live run holds the store's lock (kvcouple.store.lock)
        "writing": reader.writing() if reader.unfinished() else None,
        "size_bytes": reader.size_bytes(),
        "checksums": reader.checksums,
        "docs_per_shard": docs_per_object(reader),
        "text": text_status(reader),
    }
    if check:
        out["problems"] = reader.check(data=True)
    return out


def docs_per_object(reader: TraceStoreReader) -> int:
    """Documents per stored object of the store's path variables (a Zarr shard's documents;
    1 where the store is not sharded)."""
    return int(reader.geometry.storage_grid("hazard")[0])


def human_size(n_bytes: int) -> str:
    """``1234567`` -> ``"1.18 MiB"``: binary units, three significant digits."""
    size = float(n_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.3g} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _info(args: argparse.Namespace) -> int:
    info = store_summary(args.store, check=args.check)
    if args.json:
        print(json.dumps(info, indent=1, default=str))
        return 0
    # Ids and names come from the store: shown with control characters escaped.
    info = {
        k: [terminal(x) for x in v]
        if isinstance(v, list)
        else terminal(v)
        if isinstance(v, str)
        else v
        for k, v in info.items()
    }
    size = info["size_bytes"]
    where = f"{human_size(size)} on disk" if size is not None else "object storage"
    print(
        f"{info['store']}: kvcouple trace store, schema v{info['schema_version']} "
        f"(written by kvcouple {info['kvcouple_version']}), {where}"
    )
    print(
        f"  model     {info['model_id']} {info['model_revision'] or ''} ({info['source']}, "
        f"{info['dtype']})"
    )
    print(
        f"  record    {info['record']}; T={info['horizon']} L={info['window']} "
        f"K={info['branches']} R={info['replicates']} vocab={info['vocab_size']}"
    )
    print(f"  policies  {', '.join(map(str, info['policies']))}")
    print(f"  checksums {info['checksums']}")
    per = info["docs_per_shard"]
    print(
        f"  layout    {per} documents a stored object (Zarr shards)"
        if per > 1
        else "  layout    one stored object per document and policy"
    )
    print(f"  text      {info['text']}")
    print(
        f"  documents {info['documents_done']} of {info['documents']} done"
        + (f"; unfinished: {', '.join(info['unfinished'])}" if info["unfinished"] else "")
    )
    if info["writing"]:
        print(f"  writing   {info['writing']}")
    elif info["unfinished"]:
        print(
            "  writing   no run holds it (interrupted or stopped early: rerun the same trace command)"
        )
    if args.check:
        problems = info["problems"]
        print(f"  check     {'no problems' if not problems else f'{len(problems)} problems'}")
        for m in problems[:20]:
            print(f"    {terminal(m)}")
        return 1 if problems else 0
    return 0


def _plan(args: argparse.Namespace) -> int:
    from kvcouple.analysis.plan import PlanError, load_plan, register_plan, registration_status
    from kvcouple.store.registry import RegistryError

    try:
        plan = load_plan(args.plan)
        if args.action == "hash":
            print(plan.hash)
            return 0
        if args.action == "register":
            if not args.store:
                raise PlanError("plan register needs --store STORE (the store to trace into)")
            for store in args.store:
                entry = register_plan(plan, store)
                when = "before the store exists" if not entry.get("store_existed") else ""
                print(
                    f"{store}: plan {plan.name!r} {plan.hash} registered {entry['registered']}"
                    + (f" ({when})" if when else "")
                    + (
                        f"; warning: {entry['confirmatory_done']} confirmatory documents were "
                        "already traced, so analyses will say 'not preregistered'"
                        if entry.get("confirmatory_done")
                        else ""
                    )
                )
            return 0
        # show: the completed plan (every setting, defaults filled in) and its hash
        print(json.dumps({"hash": plan.hash, "plan": plan.content}, indent=1))
        for store in args.store or []:
            if not Path(store).exists():
                print(f"{store}: not created yet")
                continue
            print(f"{store}: {registration_status(plan, store)[1]}")
        return 0
    except (PlanError, RegistryError, StoreError) as e:
        if debug_requested():
            raise
        print(f"kvcouple plan {args.action}: error: {e}", file=sys.stderr)
        return 2


def register(subparsers: Any) -> None:
    """The ``plan``, ``analyze`` and ``info`` commands."""
    _register_plan(subparsers)
    _register_analyze(subparsers)
    _register_info(subparsers)


def _register_plan(subparsers: Any) -> None:
    pl = subparsers.add_parser(
        "plan",
        help="prespecified analysis plans: hash, register in a store, show",
        description="hash: print the plan's hash (SHA-256 of the completed plan in canonical "
        "JSON; not sha256sum of the file). register: record the plan's hash, content and time "
        "in each store's registry, before tracing its confirmatory documents (a store that "
        "does not exist yet takes the registration over when it is created). show: the plan "
        "with every setting filled in, and its registration status in each --store.",
    )
    pl.add_argument(
        "action",
        choices=["hash", "register", "show"],
        help="hash: print the hash; register: record it in each --store; show: the completed "
        "plan and its registration status",
    )
    pl.add_argument("plan", help="the plan (TOML)")
    pl.add_argument("--store", action="append", default=None, help="a trace store (repeatable)")
    pl.set_defaults(func=_plan)


def _register_analyze(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "analyze",
        help="analyse trace stores: estimates, bootstrap CIs, tests, report",
        description="Per document x policy (x model) RB-CMC estimates, document-level "
        "bootstrap CIs, paired policy differences, gap attribution, early-vs-late window TV, "
        "a prespecified plan's tests, tables, figures and an HTML report.",
    )
    _documents_arguments(p)
    _settings_arguments(p)
    _run_arguments(p)
    p.set_defaults(func=_analyze)


def _documents_arguments(p: Any) -> None:
    """What is analysed: the stores, the plan and the document set."""
    p.add_argument("stores", nargs="+", help="trace stores (one per model)")
    p.add_argument("--out", required=True, help="folder for tables, figures and report.html")
    p.add_argument("--plan", default=None, help="prespecified analysis plan (TOML)")
    p.add_argument(
        "--docs",
        choices=["all", "exploratory", "confirmatory"],
        default="all",
        help="document set (exploratory/confirmatory need --plan)",
    )
    p.add_argument(
        "--not-preregistered",
        action="store_true",
        help="run a confirmatory analysis whose plan is not registered in the store (or was "
        "registered after its documents were traced); every output says so",
    )
    p.add_argument(
        "--allow-incomplete",
        action="store_true",
        help="analyse the finished, undamaged documents and list the others",
    )


def _settings_arguments(p: Any) -> None:
    """The settings that change a number (a plan fixes each one)."""
    cliargs.add_window(
        p, help="observation window L_w for the window/tail split (default: stored L)"
    )
    p.add_argument(
        "--estimator",
        choices=list(ESTIMATORS),
        default=None,
        help="branch mismatches from indicators (default, Rao-Blackwellised) or TVs",
    )
    p.add_argument(
        "--reference",
        default=None,
        help="gap attribution and differences as POLICY - reference (default: every pair)",
    )
    p.add_argument(
        "--pool-models",
        action="store_true",
        help="also pool gap attribution across the stores (models), equal weight per model",
    )
    sealed = " (a plan fixes it: a different value is refused)"
    p.add_argument(
        "--n-boot",
        type=cliargs.positive,
        default=None,
        help=f"document bootstrap resamples (default: the plan's n_boot, else {DEFAULT_N_BOOT})"
        + sealed,
    )
    cliargs.add_seed(p, None, help="bootstrap seed (default: the plan's seed, else 0)" + sealed)
    p.add_argument(
        "--ci",
        type=cliargs.unit_open,
        default=None,
        help="confidence level (default: the plan's ci_level, else 0.95)" + sealed,
    )
    p.add_argument(
        "--ci-method",
        choices=list(CI_METHODS),
        default=None,
        help=f"bootstrap interval (default: the plan's, else {DEFAULT_CI_METHOD}; see "
        "docs/statistics.md)" + sealed,
    )
    p.add_argument(
        "--early-late-split",
        type=cliargs.positive,
        default=None,
        help="early lags 1..S, late S+1..L_w (default: the plan's, else L_w // 2)" + sealed,
    )


def _run_arguments(p: Any) -> None:
    """How it runs (no number changes): Dask, threads, recomputation checks, outputs."""
    p.add_argument("--scheduler", default=None, help="Dask scheduler address (tcp://host:port)")
    p.add_argument(
        "--worker-threads",
        type=cliargs.positive,
        default=None,
        help="Rust threads per Dask worker (default: KVCOUPLE_NUM_THREADS in the workers' "
        "environment, else the worker's nthreads, so workers do not oversubscribe cores)",
    )
    p.add_argument(
        "--tolerance",
        type=cliargs.nonnegative_float,
        default=None,
        help="recorded vs recomputed TV tolerance (default by stored dtype: "
        "float16 2e-3, bfloat16 1e-2, float32 1e-5)",
    )
    p.add_argument(
        "--no-recompute", action="store_true", help="skip recomputing TVs from full/top-k records"
    )
    p.add_argument(
        "--io-threads",
        type=cliargs.positive,
        default=2,
        help="threads reading and decoding chunks ahead of the computation",
    )
    p.add_argument("--no-figures", action="store_true", help="tables only")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _register_info(subparsers: Any) -> None:
    i = subparsers.add_parser(
        "info",
        help="summarise a trace store",
        description="Schema version, model, policies, documents done, size.",
    )
    i.add_argument("store", help="the trace store (.zarr folder or URL)")
    i.add_argument(
        "--check",
        action="store_true",
        help="also read every finished document: missing or undecodable chunks, values "
        "outside the schema's ranges",
    )
    i.add_argument("--json", action="store_true", help="print the summary as JSON")
    i.set_defaults(func=_info)
