"""Per (document, policy) estimates from the RB-CMC fields of a trace store (SPEC sections 3-5).

For every replicate r (overlap path with hazards ``h_t``, K branches):

- survival weights ``W_t = prod_{s<=t} (1 - h_s)``; ``E[W_t] = S_t``, ``P(tau = t) = E[W_{t-1} h_t]``;
- occurrence ``O = 1 - W_T``, occupation ``C = sum_t W_{t-1} h_t (T - t)``, tail exposure
  ``sum_t W_{t-1} h_t (T - t - L_w)^+`` (no divergence coin is flipped);
- post-divergence mismatches from the branches: the window part (lags ``1..L_w``) and the
  tail part (lags ``> L_w``, observed only when the store traced branches past ``L_w``); each
  is ``O`` times the mean over the replicate's branches of the summed mismatch indicators
  (``estimator="indicator"``, Rao-Blackwellised: never more variance than naive SMC) or of the
  summed branch-aligned TVs (``estimator="tv"``, usually lower variance, no dominance guarantee).

The document's estimate is the mean over replicates; its Monte Carlo standard error is the
standard deviation over replicates divided by ``sqrt(R)``. Quantities that need the tail
(``expected_mismatches``, ``rho``) are NaN unless branches were traced to the horizon
(``L >= T - 1``); the sharp interval is always reported.

The estimates are computed in Rust for a batch of documents per call
(:func:`estimate_units`: ``kvcouple._core.estimate_units``, all cores, GIL released);
:mod:`kvcouple.reference.estimates` is the plain numpy reference the tests hold it to.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvcouple import _core
from kvcouple.errors import StoreError
from kvcouple.store.engine_reads import SummaryBatch

ESTIMATORS = ("indicator", "tv")
NOISE_OCCURRENCE = 1e-6  # below this a replicate without branches is not an error

# Scalar per-unit quantities, in counts of tokens (divide by T for fractions).
SCALARS = (
    "occurrence",
    "occupation",
    "post_mismatches",
    "expected_mismatches",
    "window_contribution",
    "tail_contribution",
    "tail_exposure",
    "interval_lower",
    "interval_upper",
    "tau_mass",  # sum_t t P(tau = t): the numerator of E[tau | tau <= T]
)


@dataclass
class UnitEstimate:
    """Everything one (document, policy) contributes to the analysis."""

    values: dict[str, float]  # SCALARS, per-unit means over replicates
    stderr: dict[str, float]  # their Monte Carlo standard errors
    survival: np.ndarray  # S_0..S_T
    pmf: np.ndarray  # P(tau = t), t = 1..T
    tv_lag_num: np.ndarray  # per lag 0..L: sum O_r * mean_k tv 1{reached} / R
    tv_lag_den: np.ndarray  # per lag 0..L: sum O_r * mean_k 1{reached} / R
    median_tau: float  # NaN when the document never diverges
    tail_observed: bool


@dataclass
class UnitBatch:
    """A batch's estimates as the engine returns them: unit ``u = d * P + k`` is document
    ``d``'s policy ``k`` (``P`` policies). The table takes them as arrays
    (:meth:`kvcouple.analysis.units.UnitColumns.put_batch`); :meth:`unit` builds one
    :class:`UnitEstimate` where a caller wants it."""

    policies: list[str]
    values: np.ndarray  # (units, SCALARS)
    stderr: np.ndarray  # (units, SCALARS)
    survival: np.ndarray  # (units, T + 1)
    pmf: np.ndarray  # (units, T)
    tv_lag_num: np.ndarray  # (units, L + 1)
    tv_lag_den: np.ndarray  # (units, L + 1)
    median_tau: np.ndarray  # (units,)
    tail_observed: bool

    @property
    def docs(self) -> int:
        return len(self.median_tau) // max(1, len(self.policies))

    def unit(self, d: int, k: int) -> UnitEstimate:
        u = d * len(self.policies) + k
        return UnitEstimate(
            dict(zip(SCALARS, self.values[u].tolist(), strict=True)),
            dict(zip(SCALARS, self.stderr[u].tolist(), strict=True)),
            self.survival[u],
            self.pmf[u],
            self.tv_lag_num[u],
            self.tv_lag_den[u],
            float(self.median_tau[u]),
            self.tail_observed,
        )


class BatchUnits(Mapping[str, UnitEstimate]):
    """Document ``d`` of a :class:`UnitBatch` (policy -> :class:`UnitEstimate`), built on
    demand."""

    __slots__ = ("batch", "d")

    def __init__(self, batch: UnitBatch, d: int) -> None:
        self.batch = batch
        self.d = d

    def __getitem__(self, policy: str) -> UnitEstimate:
        if policy not in self.batch.policies:
            raise KeyError(policy)
        return self.batch.unit(self.d, self.batch.policies.index(policy))

    def __iter__(self) -> Iterator[str]:
        return iter(self.batch.policies)

    def __len__(self) -> int:
        return len(self.batch.policies)

    def __repr__(self) -> str:
        return f"BatchUnits({dict(self)!r})"


def observation_window(stored: int, window: int | str | None) -> int:
    """The observation window L_w (lags of the window/tail split) as an int: ``window`` as the
    analysis settings give it (``None`` or ``"stored"``: the store's L; else lags, at most L).
    The one place the setting becomes a number."""
    if window is None or window == "stored":
        return int(stored)
    if isinstance(window, bool) or not isinstance(window, int | np.integer):
        raise ValueError(
            f"the observation window must be 'stored' or a number of lags, got {window!r}"
        )
    if not 0 <= int(window) <= stored:
        raise ValueError(
            f"the observation window must be in 0..{stored} (the stored window), got {window}"
        )
    return int(window)


def estimate_units(
    summaries: Sequence[dict[str, np.ndarray]],
    doc_ids: list[str],
    policies: list[str],
    *,
    obs_window: int,
    estimator: str = "indicator",
) -> list[BatchUnits]:
    """Every policy's estimates of each document from its summary fields (``hazard[policy,
    rep, step]``, ``branch_step[policy, rep, branch]``, ``branch_mismatch`` and
    ``branch_tv[policy, rep, branch, lag]`` as stored), for a batch of documents in one Rust
    call (all cores, GIL released). A damaged unit raises :class:`StoreError` naming its
    document, policy, replicate and step or branch. ``obs_window`` is ``L_w`` (at most the
    stored L)."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
    if not summaries:
        return []

    def stacked(name: str) -> np.ndarray:  # (docs x policies, ...), as stored
        if isinstance(summaries, SummaryBatch) and name in summaries.stacks:
            v = summaries.stacks[name]  # the engine's stack: (docs, policies, ...)
            return v.reshape(-1, *v.shape[2:])
        return np.concatenate([np.asarray(s[name]) for s in summaries])

    def native(v: np.ndarray, kinds: tuple[type, ...]) -> np.ndarray:
        """``v`` C-contiguous in its own dtype where the Rust call reads it as stored
        (float32 as traced, int32 steps), else converted to the first of ``kinds``."""
        return np.ascontiguousarray(v, v.dtype if v.dtype in kinds else kinds[0])

    mismatch = native(stacked("branch_mismatch"), (np.int8,))
    hazard, tv = stacked("hazard"), stacked("branch_tv")
    floats = (np.float32,) if hazard.dtype == tv.dtype == np.float32 else (np.float64,)
    T, L = hazard.shape[-1], mismatch.shape[-1] - 1
    if not 0 <= obs_window <= L:
        raise ValueError(
            f"the observation window must be in 0..{L} (the stored window), got {obs_window}"
        )
    out = _core.estimate_units(
        native(hazard, floats),
        native(stacked("branch_step"), (np.int64, np.int32)),
        mismatch,
        native(tv, floats),
        int(obs_window),
        estimator,
        L >= T - 1,
    )
    P = len(policies)
    if out["damage"]:
        unit, kind, i, j, value = out["damage"][0]
        raise StoreError(
            _damage(where(doc_ids[unit // P], policies[unit % P]), kind, i, j, value, T)
        )
    batch = UnitBatch(
        list(policies),
        out["values"],
        out["stderr"],
        out["survival"],
        out["pmf"],
        out["tv_lag_num"],
        out["tv_lag_den"],
        out["median_tau"],
        L >= T - 1,
    )
    return [BatchUnits(batch, d) for d in range(len(summaries))]


def estimate_unit(
    hazard: np.ndarray,
    branch_step: np.ndarray,
    branch_mismatch: np.ndarray,
    branch_tv: np.ndarray,
    *,
    obs_window: int,
    estimator: str = "indicator",
    doc_id: str = "?",
    policy: str = "?",
) -> UnitEstimate:
    """Estimates for one (document, policy) from arrays ``hazard[rep, step]``,
    ``branch_step[rep, branch]``, ``branch_mismatch[rep, branch, lag]`` and
    ``branch_tv[rep, branch, lag]`` as stored (:func:`estimate_units` of one unit)."""
    summary = {
        "hazard": np.asarray(hazard)[None],
        "branch_step": np.asarray(branch_step)[None],
        "branch_mismatch": np.asarray(branch_mismatch)[None],
        "branch_tv": np.asarray(branch_tv)[None],
    }
    units = estimate_units(
        [summary], [doc_id], [policy], obs_window=obs_window, estimator=estimator
    )
    return units[0][policy]


def where(doc_id: str, policy: str) -> str:
    """How an error names a unit."""
    return f"document {doc_id!r}, policy {policy!r}"


def _damage(where_: str, kind: str, i: int, j: int, value: float, horizon: int) -> str:
    """The message of a damaged unit (the reference's words)."""
    if kind == "hazard":
        return (
            f"{where_}: hazard {value} at replicate {i}, step {j + 1} is not a probability "
            "(damaged or wrongly written store)"
        )
    if kind == "missing_branch":
        return (
            f"{where_}: replicate {i} diverges with probability {value:.3g} but has no branch "
            "recorded (branch_step 0)"
        )
    return (
        f"{where_}: branch_step {int(value)} of replicate {i}, branch {j + 1} is past the "
        f"horizon T={horizon}"
    )


@dataclass
class Table:
    """Per-document columns of one model (what the document bootstrap resamples): ``cols[name]`` is an array over documents."""

    doc_ids: list[str]
    cols: dict[str, np.ndarray] = field(default_factory=dict)
    # The matrix whose columns ``cols`` are views of, in order (build_table), if any.
    packed: np.ndarray | None = field(default=None, repr=False)

    def matrix(self) -> tuple[list[str], np.ndarray]:
        names = list(self.cols)
        if self.packed is not None and self.packed.shape[1] == len(names):
            return names, self.packed
        return names, np.ascontiguousarray(np.column_stack([self.cols[n] for n in names]))
