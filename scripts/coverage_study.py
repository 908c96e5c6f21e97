"""Coverage of every confidence interval ``kvcouple analyze`` reports, against exact truth.

A population of synthetic documents (each a random Markov pair: one reference kernel P and
three evicted kernels; "harsh2" is "harsh" slightly changed, so their gap is small) has exact
values from the exact solver (``kvcouple.synth.exact``). Each study replicate draws ``n``
documents from the population, takes an independent RB-CMC simulation of each (the code the
synthetic trace store writes, ``simulate_doc_policy``), runs the analysis's statistics
(``build_table``, the Rust document bootstrap, ``evaluate_many``) and records whether each CI
covers the population truth. Printed: coverage per quantity, number of documents and interval
method (a Markdown table), with the Monte Carlo standard error of a coverage.

To keep the simulation cheap each population document gets a pool of independent simulations
and a study replicate draws (document, simulation) pairs without replacement: replicates are
then slightly dependent, which widens the spread of the coverage estimate a little but does not
bias it.

    python scripts/coverage_study.py                 # default: about a minute on 2 busy cores
    python scripts/coverage_study.py --reps 400 --pool 20 --n-boot 1000    # the docs table
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from kvcouple import synth
from kvcouple.analysis import stats as st
from kvcouple.analysis.estimates import estimate_unit
from kvcouple.store.schema import Record, empty_arrays
from kvcouple.store.writer import StoreLayout
from kvcouple.synth.trace_store import as_emitter_pair, simulate_doc_policy

POLICIES = ("mild", "harsh", "harsh2")
PAIRS = (("mild", "harsh"), ("harsh", "harsh2"))
SUMMARY = (
    "mismatch_fraction",
    "occurrence",
    "exposure",
    "rho",
    "mean_tau",
    "median_tau",
    "rmst",
    "late_minus_early_tv",
)
DIFFERENCES = ("mismatch_fraction", "rmst", "occurrence")
GAPS = ("gap", "exposure_term", "exposure_share")


def population(n: int, vocab: int, seed: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(n):
        P = rng.dirichlet(np.ones(vocab) * 0.8, size=vocab)
        noise = rng.dirichlet(np.ones(vocab), size=vocab)
        mild, harsh = rng.uniform(0.03, 0.2), rng.uniform(0.15, 0.5)
        Q = {
            "mild": (1 - mild) * P + mild * noise,
            "harsh": (1 - harsh) * P + harsh * noise,
            "harsh2": (1 - harsh * 1.05) * P + harsh * 1.05 * noise,
        }
        docs.append({"P": P, **Q})
    return docs


def exact_doc(doc: dict[str, np.ndarray], horizon: int) -> dict[str, synth.ExactResult]:
    return {
        pol: synth.exact(
            synth.pair_from_mapping({"P": doc["P"], "Q": doc[pol], "start": 0}), horizon=horizon
        )
        for pol in POLICIES
    }


def truth(exacts: list[dict[str, synth.ExactResult]], horizon: int) -> dict[tuple, float]:
    """Population values of every checked statistic (ratios are ratios of population means,
    as the analysis defines them)."""
    T = float(horizon)
    out: dict[tuple, float] = {}
    mean = lambda pol, f: float(np.mean([f(e[pol]) for e in exacts]))  # noqa: E731
    half = (horizon - 1) // 2
    for pol in POLICIES:
        occ = mean(pol, lambda e: e.occurrence)
        occupation = mean(pol, lambda e: e.occupation)
        em = mean(pol, lambda e: e.expected_mismatches)
        pmf = np.mean([e[pol].divergence_time_pmf for e in exacts], axis=0)
        steps = np.arange(1, horizon + 1)
        cum = np.cumsum(pmf)
        w = np.sum([e[pol].branch_lag_weight for e in exacts], axis=0)
        tv = np.sum(
            [np.nan_to_num(e[pol].branch_tv_by_lag) * e[pol].branch_lag_weight for e in exacts],
            axis=0,
        )
        early = tv[:half].sum() / w[:half].sum()
        late = tv[half:].sum() / w[half:].sum()
        out[(pol, "mismatch_fraction")] = em / T
        out[(pol, "occurrence")] = occ
        out[(pol, "exposure")] = occupation / T
        out[(pol, "rho")] = (em - occ) / occupation
        out[(pol, "mean_tau")] = float(pmf @ steps) / occ
        out[(pol, "median_tau")] = float(np.argmax(2 * cum >= cum[-1] * (1 - 1e-12)) + 1)
        out[(pol, "rmst")] = T - occupation
        out[(pol, "late_minus_early_tv")] = late - early
        out[(pol, "survival")] = np.mean([e[pol].survival for e in exacts], axis=0)
    for a, b in PAIRS:
        for q in DIFFERENCES:
            out[("diff", a, b, q)] = out[(b, q)] - out[(a, q)]
        f = {p: out[(p, "occurrence")] / T for p in (a, b)}
        e = {p: out[(p, "exposure")] for p in (a, b)}
        r = {p: out[(p, "rho")] for p in (a, b)}
        gap = (f[b] + e[b] * r[b]) - (f[a] + e[a] * r[a])
        exposure = 0.5 * (r[a] + r[b]) * (e[b] - e[a])
        out[("gap", a, b, "gap")] = gap
        out[("gap", a, b, "exposure_term")] = exposure
        out[("gap", a, b, "exposure_share")] = exposure / gap
        out[("band", a, b)] = out[(b, "survival")][1:] - out[(a, "survival")][1:]
    return out


def simulate_pool(
    docs: list[dict[str, np.ndarray]], pool: int, horizon: int, replicates: int, seed: int
) -> list[list[dict]]:
    """``pool`` independent RB-CMC simulations of each document: UnitEstimates per policy."""
    vocab = docs[0]["P"].shape[0]
    layout = StoreLayout(
        doc_ids=["d"],
        policies=list(POLICIES),
        horizon=horizon,
        window=horizon - 1,
        branches=1,
        replicates=replicates,
        vocab_size=vocab,
        record=Record.parse("summary"),
    )
    out = []
    for i, doc in enumerate(docs):
        sims = []
        for j in range(pool):
            arrays = empty_arrays(layout.record, layout.sizes(), float_dtype="float64")
            units = {}
            for k, pol in enumerate(POLICIES):
                pair = as_emitter_pair({"P": doc["P"], "Q": doc[pol], "start": 0})
                simulate_doc_policy(pair, layout, np.random.default_rng([seed, i, j, k]), arrays, k)
                units[pol] = estimate_unit(
                    arrays["hazard"][k],
                    arrays["branch_step"][k],
                    arrays["branch_mismatch"][k],
                    arrays["branch_tv"][k],
                    obs_window=horizon - 1,
                )
            sims.append(units)
        out.append(sims)
    return out


def statistics(horizon: int) -> list[tuple[tuple, st.StatFn, bool]]:
    stats: list[tuple[tuple, st.StatFn, bool]] = []
    for pol in POLICIES:
        for q in SUMMARY:
            stats.append(((pol, q), st.quantity_fn(pol, q, horizon), q in st.DISCRETE))
    for a, b in PAIRS:
        for q in DIFFERENCES:
            fa, fb = st.quantity_fn(a, q, horizon), st.quantity_fn(b, q, horizon)
            stats.append((("diff", a, b, q), lambda g, fa=fa, fb=fb: fb(g) - fa(g), False))
        gf = st.gap_fns(a, b, horizon)
        for term in GAPS:
            stats.append((("gap", a, b, term), gf[term], False))
    return stats


def label(key: tuple) -> str:
    if key[0] == "diff":
        return f"difference {key[3]} ({key[2]} - {key[1]})"
    if key[0] == "gap":
        return f"gap term {key[3]} ({key[2]} - {key[1]})"
    if key[0] == "band":
        return f"survival difference band, all t ({key[2]} - {key[1]})"
    return f"{key[1]} ({key[0]})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=200, help="study replicates per size")
    ap.add_argument("--sizes", default="16,32", help="numbers of documents")
    ap.add_argument("--population", type=int, default=40, help="documents in the population")
    ap.add_argument("--pool", type=int, default=12, help="simulations per population document")
    ap.add_argument("--replicates", type=int, default=16, help="RB-CMC replicates per document")
    ap.add_argument("--horizon", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4)
    ap.add_argument("--n-boot", type=int, default=1000)
    ap.add_argument("--level", type=float, default=0.95)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    T = args.horizon
    t0 = time.time()
    docs = population(args.population, args.vocab, args.seed)
    exact = [exact_doc(d, T) for d in docs]
    target = truth(exact, T)
    pool = simulate_pool(docs, args.pool, T, args.replicates, args.seed)
    print(f"# population {len(docs)} documents x {args.pool} simulations ready in "
          f"{time.time() - t0:.0f} s", file=sys.stderr)  # fmt: skip
    stats = statistics(T)
    methods = st.CI_METHODS
    keys = [k for k, _, _ in stats] + [("band", a, b) for a, b in PAIRS]
    hits = {(k, n, m): 0 for k in keys for n in sizes for m in methods}
    counted = {(k, n, m): 0 for k in keys for n in sizes for m in methods}
    rng = np.random.default_rng(args.seed + 1)
    items = [(i, j) for i in range(len(docs)) for j in range(args.pool)]
    for n in sizes:
        for rep in range(args.reps):
            pick = rng.choice(len(items), size=n, replace=False)
            chosen = [pool[items[p][0]][items[p][1]] for p in pick]
            table = st.build_table([f"d{p}" for p in pick], chosen, list(POLICIES), T, T - 1)
            base = st.bootstrap_table(table, args.n_boot, args.seed * 7919 + rep, args.level)
            for m in methods:
                bs = base if m == base.method else st.Bootstrap(
                    base.names, base.point, base.reps, base.level, base.n_docs, base.jack, m
                )  # fmt: skip
                ests = bs.evaluate_many([f for _, f, _ in stats], [d for _, _, d in stats])
                for (key, _, _), e in zip(stats, ests, strict=True):
                    if not (np.isfinite(e.estimate)):
                        continue
                    counted[(key, n, m)] += 1
                    hits[(key, n, m)] += int(e.ci_low <= target[key] <= e.ci_high)
            for a, b in PAIRS:  # the simultaneous band does not depend on the method
                rows = st.survival_band(base, a, b, T)
                lo = np.array([r["band_low"] for r in rows])
                hi = np.array([r["band_high"] for r in rows])
                ok = bool(
                    np.all(
                        (lo - 1e-12 <= target[("band", a, b)])
                        & (target[("band", a, b)] <= hi + 1e-12)
                    )
                )
                for m in methods:
                    counted[(("band", a, b), n, m)] += 1
                    hits[(("band", a, b), n, m)] += int(ok)
    print(f"# {args.reps} replicates per size, n_boot {args.n_boot}, level {args.level}, "
          f"T={T}, {args.replicates} RB-CMC replicates per document; "
          f"coverage MC standard error ~{np.sqrt(0.95 * 0.05 / args.reps):.3f}; "
          f"{time.time() - t0:.0f} s", file=sys.stderr)  # fmt: skip
    head = ["quantity"] + [f"{m} n={n}" for n in sizes for m in methods]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for k in keys:
        cells = []
        for n in sizes:
            for m in methods:
                c = counted[(k, n, m)]
                cells.append(f"{hits[(k, n, m)] / c:.3f}" if c else "n/a")
        print("| " + " | ".join([label(k)] + cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
