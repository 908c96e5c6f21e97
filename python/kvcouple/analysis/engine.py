"""The analysis engine: trace stores in, per (document, policy) estimates and across-document
statistics out (SPEC section 9).

Work is split by document (a document is one chunk along ``doc`` in every variable): each task
reads one document's RB-CMC fields, estimates every policy, and for ``full``/``topk`` records
recomputes the hazards and branch TVs from the stored distributions, chunk by chunk. Locally the
tasks run one after another (each overlapping its chunk decoding with the Rust kernels); on a
Dask cluster (``client=`` or ``scheduler=``) they run on the workers, which open the store
themselves (so the store's path must be readable from every worker: a shared filesystem), and
only the small per-document results travel back. The statistics are computed on
the caller from those results, so both paths give identical numbers.

**Threads under Dask.** Each worker process runs kvcouple's Rust kernels in its own thread pool.
The engine sets every worker's pool to that worker's ``nthreads`` (``kvcouple.set_num_threads``)
so that ``n_workers x threads`` stays within the machine; to choose it yourself set
``KVCOUPLE_NUM_THREADS`` in the workers' environment, or pass ``worker_threads=``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvcouple.analysis import stats as st
from kvcouple.analysis.estimates import ESTIMATORS, UnitEstimate, estimate_unit
from kvcouple.analysis.plan import Plan, check_registry, documents_key, load_plan
from kvcouple.analysis.reading import (
    SUMMARY_READ,
    RecomputeCheck,
    recompute_full,
    recompute_topk,
)
from kvcouple.errors import InvalidInputError, StoreError, require
from kvcouple.store.reader import TraceStoreReader, check_memory, is_url

# Document bootstrap resamples when neither the caller nor a plan says (CLI, demo, API).
DEFAULT_N_BOOT = 2000


@dataclass(frozen=True)
class Options:
    """Per-document settings (picklable: they travel to Dask workers)."""

    window: int | None = None  # observation window L_w (default: the store's L)
    estimator: str = "indicator"
    recompute: bool = True
    tolerance: float | None = None
    io_threads: int = 2


@dataclass
class DocResult:
    doc: int
    doc_id: str
    units: dict[str, UnitEstimate] | None
    check: RecomputeCheck | None
    error: str | None = None


def analyze_doc(info: TraceStoreReader, doc: int, options: Options) -> DocResult:
    """Everything one document contributes (a Dask task). Store damage is returned, not raised,
    so the caller decides whether to skip the document or stop."""
    doc_id = info.doc_ids[doc]
    try:
        summary = info.read_summary(doc, SUMMARY_READ)
        L = info.window
        obs = L if options.window is None else int(options.window)
        units = {
            pol: estimate_unit(
                summary["hazard"][i],
                summary["branch_step"][i],
                summary["branch_mismatch"][i],
                summary["branch_tv"][i],
                obs_window=obs,
                estimator=options.estimator,
                doc_id=doc_id,
                policy=pol,
            )
            for i, pol in enumerate(info.policies)
        }
        check = None
        if options.recompute and info.record == "full":
            check = recompute_full(info, doc, summary, options.tolerance, options.io_threads)
        elif options.recompute and info.record.startswith("topk"):
            check = recompute_topk(info, doc, summary, options.tolerance)
        return DocResult(doc, doc_id, units, check)
    except StoreError as e:
        return DocResult(doc, doc_id, None, None, str(e))


@dataclass
class ModelResult:
    """The analysis of one store (one model)."""

    model: str
    store: str
    policies: list[str]
    horizon: int
    window: int  # stored L
    obs_window: int  # L_w used for the window/tail split
    docs: list[DocResult]
    tables: dict[str, list[dict[str, Any]]]
    bootstrap: st.Bootstrap | None = None


@dataclass
class AnalysisResult:
    models: list[ModelResult]
    estimator: str
    doc_set: str
    plan_hash: str
    plan_name: str | None
    tests: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[dict[str, str]] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)

    def checks(self) -> list[dict[str, Any]]:
        """Recomputation summary per model and the disagreements themselves."""
        rows = []
        for m in self.models:
            for d in m.docs:
                if d.check is None:
                    continue
                for x in d.check.disagreements:
                    rows.append({"model": m.model, **x.__dict__})
        return rows


def _limit_worker_threads(threads: int | None = None, dask_worker: Any = None) -> int:
    """Run on each Dask worker (``client.run`` passes ``dask_worker``): size kvcouple's Rust
    pool to the worker's thread budget."""
    import kvcouple

    n = threads
    if n is None:
        env = os.environ.get("KVCOUPLE_NUM_THREADS")
        if env:
            n = int(env)
        else:
            n = dask_worker.state.nthreads if dask_worker is not None else 0
    kvcouple.set_num_threads(int(n))
    return kvcouple.get_num_threads()


def _client(client: Any, scheduler: str | None) -> tuple[Any, bool]:
    if client is not None:
        return client, False
    if scheduler is None:
        return None, False
    require("distributed", "--scheduler")
    from distributed import Client

    try:
        return Client(scheduler, timeout=_CONNECT_TIMEOUT), True
    except (OSError, TimeoutError) as e:
        raise InvalidInputError(f"scheduler = {scheduler!r}: cannot connect ({e})") from None


def _run_docs(
    tasks: list[tuple[TraceStoreReader, int]],
    options: Options,
    client: Any,
    worker_threads: int | None,
    progress: bool = False,
) -> list[DocResult]:
    from tqdm import tqdm  # type: ignore[import-untyped]

    bar = tqdm(total=len(tasks), unit="doc", desc="kvcouple analyze", disable=not progress)
    try:
        if client is None:
            # A few documents in flight: a document may be one chunk per variable, and the Rust
            # engine (GIL released) decodes the chunks of all documents in flight on every
            # core. Memory: a few documents' summaries plus a block pair per engine thread.
            from concurrent.futures import ThreadPoolExecutor

            def one(task: tuple[TraceStoreReader, int]) -> DocResult:
                r = analyze_doc(task[0], task[1], options)
                bar.update(1)
                return r

            with ThreadPoolExecutor(max(1, options.io_threads)) as pool:
                return list(pool.map(one, tasks))
        from distributed import as_completed

        client.run(_limit_worker_threads, worker_threads)
        futures = client.map(
            analyze_doc, [t[0] for t in tasks], [t[1] for t in tasks], options=options, pure=False
        )
        for _ in as_completed(futures):
            bar.update(1)
        return list(client.gather(futures))
    finally:
        bar.close()


def _select_docs(info: TraceStoreReader, plan: Plan | None, doc_set: str) -> list[int]:
    if doc_set == "all" or plan is None:
        if doc_set != "all":
            raise ValueError(f"--docs {doc_set} needs a plan (--plan) that defines the sets")
        return list(info.done)
    wanted = set(plan.documents(info.doc_ids, doc_set))
    unfinished = [
        info.doc_ids[i]
        for i in range(len(info.doc_ids))
        if info.doc_ids[i] in wanted and i not in set(info.done)
    ]
    if unfinished and doc_set == "confirmatory":
        # A confirmatory set analysed partially is a different analysis: say so loudly.
        raise StoreError(
            f"{info.path}: {len(unfinished)} confirmatory documents are unfinished "
            f"({', '.join(unfinished[:10])}); finish the run first"
        )
    return [i for i in info.done if info.doc_ids[i] in wanted]


_CONNECT_TIMEOUT = 5  # seconds to reach a Dask scheduler (distributed's default is 30)


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
        _check_scheduler(scheduler)


def _check_scheduler(scheduler: Any) -> None:
    """A ``tcp://host:port`` address must accept a connection within a few seconds."""
    import socket
    from urllib.parse import urlsplit

    if not isinstance(scheduler, str) or not scheduler:
        raise InvalidInputError(
            f"scheduler must be an address such as tcp://host:8786, got {scheduler!r}"
        )
    parts = urlsplit(scheduler if "://" in scheduler else f"tcp://{scheduler}")
    if parts.scheme not in ("tcp", "tls"):
        return  # other transports (inproc, ucx): let distributed judge
    try:
        host, port = parts.hostname, parts.port
    except ValueError as e:
        raise InvalidInputError(f"scheduler = {scheduler!r}: {e}") from None
    if not host or port is None:
        raise InvalidInputError(
            f"scheduler = {scheduler!r} needs a host and a port (tcp://host:8786)"
        )
    try:
        socket.create_connection((host, port), timeout=_CONNECT_TIMEOUT).close()
    except OSError as e:
        raise InvalidInputError(
            f"scheduler = {scheduler!r} is not reachable ({e.strerror or e})"
        ) from None


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
    ci: float = 0.95,
    plan: str | os.PathLike[str] | Plan | None = None,
    doc_set: str = "all",
    registry: str | os.PathLike[str] | None = None,
    io_threads: int = 2,
    storage_options: dict[str, Any] | None = None,
    progress: bool = False,
) -> AnalysisResult:
    """Analyse one or more trace stores (one per model). See ``kvcouple analyze --help``.

    ``doc_set`` is ``"all"``, or with a ``plan`` ``"exploratory"`` or ``"confirmatory"``; a
    confirmatory run checks and records the plan's hash in ``registry`` (default: a file
    inside the first store) and raises :class:`~kvcouple.analysis.plan.PlanError` if the plan
    changed since its first confirmatory run on the same documents. Damaged or unfinished
    documents raise :class:`~kvcouple.errors.StoreError` unless ``allow_incomplete``, which
    skips them (listed in ``result.skipped``).
    """
    check_options(
        window=window,
        worker_threads=worker_threads,
        tolerance=tolerance,
        n_boot=n_boot,
        seed=seed,
        ci=ci,
        io_threads=io_threads,
        scheduler=scheduler,
    )
    paths = [stores] if isinstance(stores, str | os.PathLike) else list(stores)
    if not paths:
        raise ValueError("give at least one trace store")
    the_plan = load_plan(plan) if isinstance(plan, str | os.PathLike) else plan
    if doc_set not in ("all", "exploratory", "confirmatory"):
        raise ValueError(f"doc_set must be all, exploratory or confirmatory, got {doc_set!r}")
    estimator = estimator or (the_plan.estimator if the_plan else None) or "indicator"
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
    n_boot = int(n_boot or (the_plan.n_boot if the_plan else None) or DEFAULT_N_BOOT)
    seed = int(
        seed
        if seed is not None
        else (the_plan.seed if the_plan and the_plan.seed is not None else 0)
    )
    infos = [TraceStoreReader(p, storage_options) for p in paths]
    for info in infos:
        if not allow_incomplete:
            info.require_complete()
    labels = _model_labels(infos)
    selected = [_select_docs(info, the_plan, doc_set) for info in infos]
    if doc_set == "confirmatory" and the_plan is not None:
        if registry is None and is_url(str(paths[0])):
            raise ValueError(
                f"{paths[0]} is on object storage: give a local plan registry file (--registry)"
            )
        reg = Path(registry) if registry else Path(paths[0]) / "kvcouple_plan_registry.json"
        ids = [
            f"{lab}/{info.doc_ids[d]}"
            for lab, info, sel in zip(labels, infos, selected, strict=True)
            for d in sel
        ]
        check_registry(reg, the_plan, documents_key(labels, ids), len(ids))
    options = Options(window, estimator, recompute, tolerance, io_threads)
    tasks = [(info, d) for info, sel in zip(infos, selected, strict=True) for d in sel]
    the_client, owned = _client(client, scheduler)
    try:
        results = _run_docs(tasks, options, the_client, worker_threads, progress)
    finally:
        if owned:
            the_client.close()
    skipped = []
    for info in infos:
        for i in info.unfinished():
            skipped.append({"store": info.path, "doc_id": info.doc_ids[i], "reason": "unfinished"})
        for i, why in info.flag_errors.items():
            skipped.append({"store": info.path, "doc_id": info.doc_ids[i], "reason": why})
    models = []
    pos = 0
    for label, info, sel in zip(labels, infos, selected, strict=True):
        docs = results[pos : pos + len(sel)]
        pos += len(sel)
        bad = [d for d in docs if d.error is not None]
        if bad and not allow_incomplete:
            more = f" (and {len(bad) - 1} more damaged documents)" if len(bad) > 1 else ""
            raise StoreError(bad[0].error + more)
        for d in bad:
            skipped.append({"store": info.path, "doc_id": d.doc_id, "reason": str(d.error)})
        good = [d for d in docs if d.error is None]
        if not good:
            raise StoreError(f"{info.path}: no finished, undamaged documents to analyse")
        models.append(_model_result(label, info, good, window, n_boot, seed, ci))
    result = AnalysisResult(
        models,
        estimator,
        doc_set,
        the_plan.hash if the_plan else "none",
        the_plan.name if the_plan else None,
        skipped=skipped,
    )
    result.settings = {
        "n_boot": n_boot,
        "seed": seed,
        "ci": ci,
        "recompute": recompute,
        "tolerance": tolerance,
        "stores": [str(p) for p in paths],
    }
    if the_plan is not None:
        result.tests = run_tests(result, the_plan)
    return result


def _model_labels(infos: list[TraceStoreReader]) -> list[str]:
    labels = [i.model for i in infos]
    return [lab if labels.count(lab) == 1 else f"{lab}#{k}" for k, lab in enumerate(labels)]


def _model_result(
    label: str,
    info: TraceStoreReader,
    docs: list[DocResult],
    window: int | None,
    n_boot: int,
    seed: int,
    ci: float,
) -> ModelResult:
    T, L = info.horizon, info.window
    obs = L if window is None else int(window)
    units = [d.units for d in docs if d.units is not None]
    table = st.build_table([d.doc_id for d in docs], units, info.policies, T, obs)
    names, _ = table.matrix()
    # The resamples are n_boot x quantities doubles: refuse before allocating, not abort.
    check_memory(f"--n-boot {n_boot} ({len(names)} quantities)", 8 * n_boot * len(names))
    bs = st.bootstrap_table(table, n_boot, seed, ci)
    tables = st.summarise(bs, info.policies, T, L + 1)
    return ModelResult(label, info.path, info.policies, T, L, obs, docs, tables, bs)


def run_tests(result: AnalysisResult, plan: Plan) -> list[dict[str, Any]]:
    """The plan's comparisons: estimate, CI at level 1 - alpha, bootstrap p-value, corrected."""
    rows = []
    for c in plan.comparisons:
        models = [m for m in result.models if c.model in (None, m.model)]
        if not models:
            raise ValueError(
                f"comparison {c.name!r}: no model {c.model!r} among "
                f"{[m.model for m in result.models]}"
            )
        for m in models:
            for pol in (c.a, c.b):
                if pol not in m.policies:
                    raise ValueError(
                        f"comparison {c.name!r}: policy {pol!r} is not in "
                        f"{m.store} (policies: {', '.join(m.policies)})"
                    )
            assert m.bootstrap is not None
            fa = st.quantity_fn(c.a, c.metric, m.horizon)
            fb = st.quantity_fn(c.b, c.metric, m.horizon)
            bs = st.Bootstrap(
                m.bootstrap.names,
                m.bootstrap.point,
                m.bootstrap.reps,
                1.0 - plan.alpha,
                m.bootstrap.n_docs,
            )
            est, lo, hi, boot = bs.evaluate(lambda g, fa=fa, fb=fb: fb(g) - fa(g))
            rows.append(
                {
                    "comparison": c.name,
                    "model": m.model,
                    "metric": c.metric,
                    "policy_a": c.a,
                    "policy_b": c.b,
                    "direction": c.direction,
                    "difference": est,
                    "ci_low": lo,
                    "ci_high": hi,
                    "p_value": st.bootstrap_p_value(boot, c.direction),
                    "n_docs": bs.n_docs,
                    "doc_set": result.doc_set,
                }
            )
    raw = [r["p_value"] for r in rows]
    if plan.correction == "holm":
        adj = st.holm(raw)
    elif plan.correction == "bonferroni":
        adj = [min(1.0, p * len(raw)) for p in raw]
    else:
        adj = raw
    for r, p in zip(rows, adj, strict=True):
        r["p_adjusted"] = p
        r["correction"] = plan.correction
        r["alpha"] = plan.alpha
        r["reject_h0"] = bool(p < plan.alpha)
    return rows
