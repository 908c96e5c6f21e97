"""Monte Carlo estimators on synthetic pairs: Rust vs the numba reference, and RB-CMC's
statistical efficiency over naive simulation.

For each reference pair, prints (all measured in this one run):
- replicates per second of naive and indicator (K=1) in Rust and in the numba reference (same
  algorithms, same random numbers: the replicates agree to rounding), with 1 thread and with all
  threads, and Rust's speed-up. The Rust core caches per-state-pair step tables (TV, running
  sums of the overlap and residual weights); the reference recomputes rows at every step;
- per-replicate variance of the total loss M and cost in kernel evaluations (2 per step);
- the efficiency ratio Var(naive) * cost(naive) / (Var(e) * cost(e)) of each estimator e
  (indicator, tv).
Usage: python benchmarks/bench_estimators.py [--replicates 20000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import time

import numba
import numpy as np

import kvcouple
from kvcouple import synth
from kvcouple.reference.synth import simulate_ref

# name, pair, horizon, window
REFERENCE_PAIRS = [
    ("markov V=4, close", lambda: synth.random_pair(4, seed=1, closeness=0.97, markov=True), 12, 4),
    (
        "emitter V=8 S=8, EOS",
        lambda: synth.random_pair(8, 8, seed=2, closeness=0.95, absorbing=True),
        32,
        8,
    ),
    ("emitter V=16 S=16, rare", lambda: synth.random_pair(16, 16, seed=3, closeness=0.995), 64, 16),
    (
        "markov V=64, close",
        lambda: synth.random_pair(64, seed=4, closeness=0.99, markov=True),
        64,
        16,
    ),
]


def best_time(fn, repeat: int) -> float:
    fn()  # warm-up (numba compilation, thread pools)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicates", type=int, default=20000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    n = args.replicates
    all_threads = os.cpu_count() or 1
    print(f"kvcouple {kvcouple.__version__}, numba {numba.__version__}, {all_threads} cores")
    print(f"{n} replicates per run, median of {args.repeat}\n")
    for name, make, horizon, window in REFERENCE_PAIRS:
        pair = make()
        truth = synth.exact(pair, horizon, window)
        print(
            f"== {name}: T={horizon}, L={window}, exact E[M] = {truth.expected_mismatches:.4f}, "
            f"P(tau<=T) = {truth.occurrence:.4f}"
        )
        for estimator in ("naive", "indicator"):
            for threads in sorted({1, all_threads}):
                kvcouple.set_num_threads(threads)
                numba.set_num_threads(threads)
                t_rust = best_time(
                    lambda m=estimator: synth.simulate(
                        pair, horizon, window, estimator=m, replicates=n
                    ),
                    args.repeat,
                )
                t_numba = best_time(
                    lambda m=estimator: simulate_ref(
                        pair.arrays(), horizon, window, estimator=m, replicates=n
                    ),
                    args.repeat,
                )
                print(
                    f"  {estimator:9s} {threads} thread(s): rust {n / t_rust:12,.0f} rep/s   "
                    f"numba {n / t_numba:12,.0f} rep/s   rust/numba {t_numba / t_rust:5.1f}x"
                )
        kvcouple.set_num_threads(0)
        numba.set_num_threads(all_threads)
        runs = {
            m: synth.estimate(pair, horizon, window, estimator=m, replicates=n, seed=7)
            for m in synth.SYNTH_ESTIMATORS
        }
        naive = runs["naive"]
        v0, c0 = naive.variance("expected_mismatches"), naive.evaluations
        for m, est in runs.items():
            v, c = est.variance("expected_mismatches"), est.evaluations
            ratio = (v0 * c0) / (v * c) if v > 0 else float("inf")
            print(
                f"  {m:9s} mean {est.mean['expected_mismatches']:.4f} "
                f"+- {est.se['expected_mismatches']:.4f}   Var/rep {v:9.4f}   "
                f"cost/rep {c:7.1f} evals   efficiency vs naive {ratio:7.2f}x"
            )
        print()


if __name__ == "__main__":
    main()
