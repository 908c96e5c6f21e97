"""Synthetic kernel pairs with exact ground truth (SPEC sections 2 to 6).

>>> from kvcouple import synth
>>> pair = synth.random_pair(vocab=4, states=3, seed=1)
>>> truth = synth.exact(pair, horizon=12, window=4)
>>> est = synth.estimate(pair, horizon=12, window=4, method="rb", replicates=2000, seed=0)
>>> abs(est.mean["expected_mismatches"] - truth.expected_mismatches) < 5 * est.se["expected_mismatches"]
True
"""

from kvcouple.synth.estimators import (
    METHODS,
    Estimate,
    ExactResult,
    Interval,
    Method,
    estimate,
    exact,
    interval,
    interval_constructions,
    simulate,
)
from kvcouple.synth.pairs import (
    Kernel,
    KernelPair,
    load_pair,
    pair_from_mapping,
    random_pair,
    save_pair,
)

__all__ = [
    "METHODS",
    "Estimate",
    "ExactResult",
    "Interval",
    "Kernel",
    "KernelPair",
    "Method",
    "estimate",
    "exact",
    "interval",
    "interval_constructions",
    "load_pair",
    "pair_from_mapping",
    "random_pair",
    "save_pair",
    "simulate",
]
