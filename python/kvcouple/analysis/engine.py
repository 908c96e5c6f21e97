"""The analysis engine: trace stores in, per (document, policy) estimates and across-document
statistics out (SPEC section 9).

:func:`analyze` checks the options, resolves the settings (a plan fixes every one that changes a
number), selects the documents, runs the per-document work in batches of documents
(:mod:`kvcouple.analysis.tasks`: locally or on a Dask cluster; only the small per-document
results travel back) and computes
the statistics on the caller from those results, so both paths give identical numbers.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
from threadpoolctl import threadpool_limits  # type: ignore[import-untyped]

from kvcouple.analysis import stats as st
from kvcouple.analysis.bootstrap import bootstrap_table
from kvcouple.analysis.comparisons import pool_gaps, run_tests
from kvcouple.analysis.estimates import ESTIMATORS
from kvcouple.analysis.folds import FinishedStore, StoreFold, finish_stores
from kvcouple.analysis.memory import on_small_pages
from kvcouple.analysis.plan import DEFAULTS, Plan, PlanError, load_plan, registration_status
from kvcouple.analysis.results import AnalysisResult, DocumentsReady, ModelResult, StoreDocuments
from kvcouple.analysis.tasks import (
    DocResult,
    Options,
    analyze_doc,
    check_scheduler,
    connect_client,
    run_docs,
)
from kvcouple.errors import InvalidInputError, StoreError
from kvcouple.resources import check_memory
from kvcouple.store.reader import TraceStoreReader

# The analysis's entry points; its results (kvcouple.analysis.results), per-document task
# (kvcouple.analysis.tasks) and comparisons (kvcouple.analysis.comparisons) as users reach them.
__all__ = [
    "DEFAULT_N_BOOT",
    "SEALED",
    "AnalysisResult",
    "DocResult",
    "ModelResult",
    "Options",
    "analyze",
    "analyze_doc",
    "check_options",
    "pool_gaps",
    "resolve_settings",
    "run_tests",
]

# Document bootstrap resamples when neither the caller nor a plan says (CLI, demo, API).
DEFAULT_N_BOOT = DEFAULTS["n_boot"]  # one default, the plan's


def _select_docs(reader: TraceStoreReader, plan: Plan | None, doc_set: str) -> list[int]:
    if doc_set == "all" or plan is None:
        if doc_set != "all":
            raise ValueError(f"--docs {doc_set} needs a plan (--plan) that defines the sets")
        return list(reader.done)
    wanted = set(plan.documents(reader.doc_ids, doc_set))
    unfinished = [
        reader.doc_ids[i]
        for i in range(len(reader.doc_ids))
        if reader.doc_ids[i] in wanted and i not in set(reader.done)
    ]
    if unfinished and doc_set == "confirmatory":
        # A confirmatory set analysed partially is a different analysis: say so loudly.
        raise StoreError(
            f"{reader.path}: {len(unfinished)} confirmatory documents are unfinished "
            f"({', '.join(unfinished[:10])}); finish the run first"
        )
    return [i for i in reader.done if reader.doc_ids[i] in wanted]


def _is_int(v: Any) -> bool:
    return isinstance(v, int | np.integer) and not isinstance(v, bool)


def check_options(
    *,
    window: Any = None,
    worker_threads: Any = None,
    tolerance: Any = None,
    n_boot: Any = None,
    seed: Any = None,
    ci: Any = 0.95,
    io_threads: Any = 2,
    scheduler: Any = None,
) -> None:
    """Refuse bad :func:`analyze` options up front (before any store is opened), naming each;
    a scheduler address is tried for a few seconds (refused: not reachable)."""
    for name, v, least in (
        ("window", window, 0),
        ("worker_threads", worker_threads, 1),
        ("n_boot", n_boot, 1),
        ("seed", seed, 0),
    ):
        if v is not None and (not _is_int(v) or v < least):
            raise InvalidInputError(f"{name} must be an integer >= {least}, got {v!r}")
    if not _is_int(io_threads) or not 1 <= io_threads <= 1024:
        raise InvalidInputError(f"io_threads must be an integer in [1, 1024], got {io_threads!r}")
    if seed is not None and seed >= 2**64:
        raise InvalidInputError(f"seed must be below 2**64, got {seed}")
    if tolerance is not None and not (
        isinstance(tolerance, int | float | np.floating)
        and math.isfinite(tolerance)
        and tolerance >= 0
    ):
        raise InvalidInputError(f"tolerance must be a finite number >= 0, got {tolerance!r}")
    if not (isinstance(ci, int | float | np.floating) and 0 < ci < 1):
        raise InvalidInputError(f"ci must be a confidence level in (0, 1), got {ci!r}")
    if scheduler is not None:
        check_scheduler(scheduler)


# Options that change a number: with a plan each is fixed by it (a contradicting value is
# refused); without a plan the defaults of kvcouple.analysis.plan.DEFAULTS apply.
SEALED = ("window", "estimator", "n_boot", "seed", "ci_level", "ci_method", "early_late_split",
          "reference", "pool_models")  # fmt: skip


def resolve_settings(plan: Plan | None, given: dict[str, Any]) -> dict[str, Any]:
    """The analysis settings: the plan's (refusing any given option that contradicts it), or
    the given options over the defaults."""
    base = plan.settings() if plan is not None else {**DEFAULTS, "reference": None}
    out = dict(base)
    for key in SEALED:
        v = given.get(key)
        if v is None:
            continue
        planned = base.get(key)
        if plan is not None and v != planned:
            raise PlanError(
                f"{key} = {v!r} contradicts the plan's {key} = {planned!r} (plan "
                f"{plan.hash[:12]}): a plan fixes every setting that changes a number; "
                "edit the plan (its hash changes) or drop the option"
            )
        out[key] = v
    return out


@on_small_pages  # the batches' arrays off 2 MB pages (kvcouple.analysis.memory)
def analyze(
    stores: str | os.PathLike[str] | list[str | os.PathLike[str]],
    *,
    window: int | None = None,
    estimator: str | None = None,
    allow_incomplete: bool = False,
    client: Any = None,
    scheduler: str | None = None,
    worker_threads: int | None = None,
    recompute: bool = True,
    tolerance: float | None = None,
    n_boot: int | None = None,
    seed: int | None = None,
    ci: float | None = None,
    ci_method: str | None = None,
    early_late_split: int | None = None,
    reference: str | None = None,
    pool_models: bool | None = None,
    plan: str | os.PathLike[str] | Plan | None = None,
    doc_set: str = "all",
    allow_unregistered: bool = False,
    io_threads: int = 2,
    storage_options: dict[str, Any] | None = None,
    progress: bool = False,
    on_documents: Callable[[DocumentsReady], None] | None = None,
) -> AnalysisResult:
    """Analyse one or more trace stores (one per model), as ``kvcouple analyze`` does.

    With a ``plan`` every number-changing setting (window, estimator, n_boot, seed, CI level
    and method, early/late split, gap reference and pooling) comes from the plan; an argument
    that contradicts it raises :class:`~kvcouple.analysis.plan.PlanError`. ``doc_set`` is
    ``"all"``, or with a plan ``"exploratory"`` or ``"confirmatory"``. A confirmatory analysis
    needs the plan registered in every store before its confirmatory documents were traced
    (``kvcouple plan register``); otherwise it is refused, or with ``allow_unregistered`` run
    and stamped "not preregistered" in every output (``result.preregistration``). Damaged or
    unfinished documents raise :class:`~kvcouple.errors.StoreError` unless
    ``allow_incomplete``, which skips them (listed in ``result.skipped``); a confirmatory set
    is never analysed partially.

    Parameters
    ----------
    stores : str, os.PathLike or list of them
        One trace store path, or a list of them (one per model).
    window : int, optional
        Window in tokens; None (default) uses the window each store was traced with.
    estimator : str, optional
        One of the analysis estimators (default from the plan, else ``"indicator"``).
    allow_incomplete : bool
        Skip damaged or unfinished documents instead of raising. Default False.
    client : distributed.Client, optional
        A Dask client to run on. Default None.
    scheduler : str, optional
        A Dask scheduler address to connect to when no ``client`` is given. Default None.
    worker_threads : int, optional
        Kernel threads per worker (>= 1). Default None: the kernels' default.
    recompute : bool
        Recompute divergences from the stored distributions. Default True.
    tolerance : float, optional
        Tolerance for checking stored values against recomputed ones. Default None.
    n_boot : int, optional
        Bootstrap resamples (default from the plan, else 2000).
    seed : int, optional
        Bootstrap seed, below ``2**64`` (default from the plan, else 0).
    ci : float, optional
        Confidence level in ``(0, 1)`` (default from the plan, else 0.95).
    ci_method : str, optional
        Confidence-interval method (default from the plan).
    early_late_split : int, optional
        Step splitting early from late (default from the plan, else half the horizon).
    reference : str, optional
        Reference policy for gaps (default from the plan).
    pool_models : bool, optional
        Pool models in the estimates (default from the plan, else False).
    plan : str, os.PathLike or Plan, optional
        An analysis plan, or a path given to :func:`load_plan`. Default None.
    doc_set : str
        ``"all"`` (default), ``"exploratory"`` or ``"confirmatory"``.
    allow_unregistered : bool
        Run a confirmatory analysis of an unregistered plan, stamped "not preregistered".
        Default False.
    io_threads : int
        Reader threads per store, in ``[1, 1024]``. Default 2.
    storage_options : dict, optional
        Options passed to the storage backend (for example S3 credentials). Default None.
    progress : bool
        Show a progress bar. Default False.
    on_documents : callable, optional
        Called once every document is read and before the statistics run, with their
        estimates (:class:`~kvcouple.analysis.results.DocumentsReady`): work on the
        per-document results (``kvcouple analyze`` writes ``per_document.csv`` in a thread)
        then runs beside the statistics (which keep to one BLAS thread, always: their numbers
        do not depend on the machine's cores). Default None.

    Returns
    -------
    AnalysisResult
        Per-model results, skipped documents and the preregistration stamp.

    Raises
    ------
    kvcouple.errors.InvalidInputError
        An option out of range, or a scheduler that cannot be reached.
    ValueError
        No stores, an unknown ``doc_set`` or estimator.
    kvcouple.analysis.PlanError
        An argument contradicting the plan, or a refused confirmatory analysis.
    kvcouple.errors.StoreError
        Damaged or unfinished documents without ``allow_incomplete``, or a store with none
        to analyse.
    """
    check_options(
        window=window,
        worker_threads=worker_threads,
        tolerance=tolerance,
        n_boot=n_boot,
        seed=seed,
        ci=0.95 if ci is None else ci,
        io_threads=io_threads,
        scheduler=scheduler,
    )
    given = {
        "window": window,
        "estimator": estimator,
        "n_boot": n_boot,
        "seed": seed,
        "ci_level": ci,
        "ci_method": ci_method,
        "early_late_split": early_late_split,
        "reference": reference,
        "pool_models": pool_models,
    }
    paths, the_plan, cfg = _resolve(stores, plan, doc_set, given)
    readers = [TraceStoreReader(p, storage_options) for p in paths]
    for reader in readers:
        if not allow_incomplete:
            reader.require_complete()
    labels = _model_labels(readers)
    selected = [_select_docs(reader, the_plan, doc_set) for reader in readers]
    preregistration = _preregistration(
        the_plan, readers, paths, labels, doc_set, allow_unregistered
    )
    options = Options(
        None,  # each store's own observation window: StoreFold resolves it, once
        cfg["estimator"],
        recompute,
        tolerance,
        io_threads,
    )
    folds = [StoreFold(reader, sel, cfg) for reader, sel in zip(readers, selected, strict=True)]
    results = _read_documents(
        readers, selected, options, client, scheduler, worker_threads, progress, folds
    )
    skipped = _unread(readers)
    strict = not allow_incomplete or doc_set == "confirmatory"
    finished = finish_stores(labels, folds, results, strict, skipped)
    # estimator, document set, plan hash: the result's first fields; then its stamp.
    stamps = (cfg["estimator"], doc_set, the_plan.hash if the_plan else "none", preregistration)
    models = _statistics(finished, cfg, stamps, on_documents)
    result = AnalysisResult(
        models,
        *stamps[:3],
        the_plan.name if the_plan else None,
        skipped=skipped,
        preregistration=preregistration,
        settings=_settings_record(cfg, recompute, tolerance, paths, readers, models),
    )
    _compare(result, cfg, the_plan)
    return result


def _resolve(
    stores: str | os.PathLike[str] | list[str | os.PathLike[str]],
    plan: str | os.PathLike[str] | Plan | None,
    doc_set: str,
    given: dict[str, Any],
) -> tuple[list[str | os.PathLike[str]], Plan | None, dict[str, Any]]:
    """Step 1: the store paths, the plan and the settings (the plan's, or the options over
    the defaults)."""
    paths = [stores] if isinstance(stores, str | os.PathLike) else list(stores)
    if not paths:
        raise ValueError("give at least one trace store")
    the_plan = load_plan(plan) if isinstance(plan, str | os.PathLike) else plan
    if doc_set not in ("all", "exploratory", "confirmatory"):
        raise ValueError(f"doc_set must be all, exploratory or confirmatory, got {doc_set!r}")
    cfg = resolve_settings(the_plan, given)
    if cfg["estimator"] not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, got {cfg['estimator']!r}")
    return paths, the_plan, cfg


def _preregistration(
    plan: Plan | None,
    readers: list[TraceStoreReader],
    paths: list[str | os.PathLike[str]],
    labels: list[str],
    doc_set: str,
    allow_unregistered: bool,
) -> str:
    """Step 2: every store's registration status as one stamp; a confirmatory analysis of an
    unregistered plan is refused unless ``allow_unregistered``."""
    stamps = []
    for reader, p in zip(readers, paths, strict=True):
        ok, stamp = registration_status(plan, p, reader.attrs)
        if doc_set == "confirmatory" and not ok and not allow_unregistered:
            raise PlanError(
                f"refusing a confirmatory analysis of {reader.path}: {stamp}. Register the plan "
                "before tracing (kvcouple plan register PLAN --store STORE), or run with "
                "--not-preregistered to have every output stamped as such"
            )
        if doc_set != "confirmatory" and ok:
            ok, stamp = False, f"not preregistered: {doc_set} documents (exploratory analysis)"
        stamps.append(stamp)
    if len(set(stamps)) == 1:
        return stamps[0]
    return "; ".join(f"{lab}: {st_}" for lab, st_ in zip(labels, stamps, strict=True))


def _read_documents(
    readers: list[TraceStoreReader],
    selected: list[list[int]],
    options: Options,
    client: Any,
    scheduler: str | None,
    worker_threads: int | None,
    progress: bool,
    folds: list[StoreFold],
) -> list[DocResult]:
    """Step 3: one task per selected document of every store (locally or on a Dask cluster),
    in store then document order, each batch folded into its store's columns as it returns."""
    tasks = [(reader, d) for reader, sel in zip(readers, selected, strict=True) for d in sel]
    by_store = {id(f.reader): f for f in folds}

    def fold(store: TraceStoreReader, results: list[DocResult]) -> list[DocResult]:
        return by_store[id(store)].fold(results)

    the_client, owned = connect_client(client, scheduler)
    # The running moments' products run beside the engine's reads on the core those leave
    # idle: one BLAS thread, as a second one's spinning between calls slows the reads (100k
    # documents: 1.5 s more).
    blas = (
        threadpool_limits(1, user_api="blas")
        if any(f.columns.running for f in folds)
        else contextlib.nullcontext()
    )
    try:
        # Each store's documents with its own observation window, resolved once (StoreFold).
        per_store = {f.reader: replace(options, window=f.obs_window) for f in folds}
        with blas:
            return run_docs(tasks, per_store, the_client, worker_threads, progress, fold)
    finally:
        if owned:
            the_client.close()


def _unread(readers: list[TraceStoreReader]) -> list[dict[str, str]]:
    """The documents no task read: unfinished, or flagged damaged by the tracer."""
    skipped = []
    for reader in readers:
        for i in reader.unfinished():
            skipped.append(
                {"store": reader.path, "doc_id": reader.doc_ids[i], "reason": "unfinished"}
            )
        for i, why in reader.flag_errors.items():
            skipped.append({"store": reader.path, "doc_id": reader.doc_ids[i], "reason": why})
    return skipped


def _settings_record(
    cfg: dict[str, Any],
    recompute: bool,
    tolerance: float | None,
    paths: list[str | os.PathLike[str]],
    readers: list[TraceStoreReader],
    models: list[ModelResult],
) -> dict[str, Any]:
    """Every number-changing setting used, with the recomputation settings and the stores,
    and how each store's resamples were drawn (``bootstrap_draws``: ``documents``, or
    ``gaussian limit`` from GAUSSIAN_MIN_DOCS documents)."""
    return {
        **{k: cfg[k] for k in SEALED},
        "ci": cfg["ci_level"],
        "recompute": recompute,
        "tolerance": tolerance,
        "stores": [str(p) for p in paths],
        # What protected each store's chunks ("no checksums" for stores before schema 3).
        "store_checksums": {reader.path: reader.checksums for reader in readers},
        "bootstrap_draws": {
            m.store: "gaussian limit" if m.bootstrap and m.bootstrap.gaussian else "documents"
            for m in models
        },
    }


def _compare(result: AnalysisResult, cfg: dict[str, Any], plan: Plan | None) -> None:
    """Step 6: the comparisons across models (pooled gaps) and the plan's tests."""
    if cfg["pool_models"]:
        result.pooled = pool_gaps(result.models, cfg)
    if plan is not None:
        result.tests = run_tests(result, plan)


def _model_labels(readers: list[TraceStoreReader]) -> list[str]:
    labels = [i.model for i in readers]
    return [lab if labels.count(lab) == 1 else f"{lab}#{k}" for k, lab in enumerate(labels)]


def _statistics(
    finished: list[FinishedStore],
    cfg: dict[str, Any],
    stamps: tuple[str, str, str, str],
    on_documents: Callable[[DocumentsReady], None] | None,
) -> list[ModelResult]:
    """Step 5: every store's across-document statistics, once ``on_documents`` has the
    documents (``stamps``: estimator, document set, plan hash, preregistration)."""
    if on_documents is not None:
        stores = [
            StoreDocuments(f.label, f.store.reader.policies, f.store.reader.horizon, f.docs)
            for f in finished
        ]
        on_documents(DocumentsReady(stores, *stamps))
    # One BLAS thread: the numbers then do not depend on the machine's cores (a product's
    # rounding does on its threads), and on_documents' work has the other cores.
    with threadpool_limits(1, user_api="blas"):
        return [_model_result(f, cfg) for f in finished]


def _model_result(finished: FinishedStore, cfg: dict[str, Any]) -> ModelResult:
    """One store's across-document statistics."""
    store, docs, table = finished.store, finished.docs, finished.table
    reader, columns = store.reader, store.columns
    T, L = reader.horizon, reader.window
    n_boot = cfg["n_boot"]
    # The resamples' means and their cross moments (n_boot x columns, and about three column
    # pairs per column) are doubles; nothing is (n_boot x documents): refuse before
    # allocating, not abort.
    check_memory(
        f"--n-boot {n_boot} ({columns.layout.width} quantities)",
        8 * 4 * n_boot * columns.layout.width,
    )
    bs = bootstrap_table(
        table, n_boot, cfg["seed"], cfg["ci_level"], cfg["ci_method"], moments=finished.moments
    )
    tables = st.summarise(bs, reader.policies, T, L + 1, cfg["reference"])
    label = finished.label
    return ModelResult(
        label, reader.path, reader.policies, T, L, store.obs_window, docs, tables, bs, table,
        store.scoreboard.rows(label),
        store.scoreboard.doc_means([store.slot[d.doc] for d in docs]), reader,
    )  # fmt: skip
