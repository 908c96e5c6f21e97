"""Synthetic kernel pairs with exact ground truth (SPEC sections 2 to 6).

>>> from kvcouple import synth
>>> pair = synth.random_pair(vocab=4, states=3, seed=1)
>>> truth = synth.exact(pair, horizon=12, window=4)
>>> est = synth.estimate(pair, horizon=12, window=4, estimator="indicator", replicates=2000, seed=0)
>>> abs(est.mean["expected_mismatches"] - truth.expected_mismatches) < 5 * est.se["expected_mismatches"]
True
"""

from kvcouple.deprecation import module_getattr
from kvcouple.synth.estimators import (
    SYNTH_ESTIMATORS,
    Estimator,
    MonteCarloEstimate,
    estimate,
    simulate,
)
from kvcouple.synth.exact import ExactResult, exact
from kvcouple.synth.interval import Interval, interval, interval_constructions
from kvcouple.synth.pairs import (
    Kernel,
    KernelPair,
    load_pair,
    pair_from_mapping,
    random_pair,
    save_pair,
)

__all__ = [
    "SYNTH_ESTIMATORS",
    "Estimator",
    "ExactResult",
    "Interval",
    "Kernel",
    "KernelPair",
    "MonteCarloEstimate",
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

# Former names, for one release (deprecated): the estimators are named as in the analysis.
__getattr__ = module_getattr(
    __name__,
    {"Estimate": "MonteCarloEstimate", "METHODS": "SYNTH_ESTIMATORS", "Method": "Estimator"},
    globals(),
)
