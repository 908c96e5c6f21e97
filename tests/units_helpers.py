"""The per-unit estimates the analysis computes in Rust against the numpy reference
(``kvcouple.reference.estimates``), for every document and policy of a store."""

from __future__ import annotations

import math

import numpy as np

from kvcouple.analysis.estimates import SCALARS, UnitBatch, UnitEstimate, estimate_units
from kvcouple.analysis.reading import SUMMARY_READ
from kvcouple.reference.estimates import estimate_unit as reference_unit
from kvcouple.store.reader import TraceStoreReader

RTOL = 1e-12


def random_unit_batch(
    rng: np.random.Generator, docs: int, policies: list[str], T: int, lags: int
) -> UnitBatch:
    """A batch of ``docs`` documents' units of ``policies`` with random values of the right
    shapes (survival decreasing; a fifth of the median steps NaN)."""
    units = docs * len(policies)
    return UnitBatch(
        list(policies),
        rng.random((units, len(SCALARS))) * 10,
        rng.random((units, len(SCALARS))),
        np.sort(rng.random((units, T + 1)))[:, ::-1].copy(),
        rng.random((units, T)) / T,
        rng.random((units, lags)) * 3,
        rng.random((units, lags)),
        np.where(rng.random(units) < 0.2, np.nan, rng.integers(1, T, units)),
        True,
    )


def _close(got: float, want: float, what: str) -> None:
    if math.isnan(want):
        assert math.isnan(got), f"{what}: {got} where the reference has NaN"
        return
    assert abs(got - want) <= RTOL * max(1.0, abs(want)), f"{what}: {got} vs {want}"


def assert_unit_equal(got: UnitEstimate, want: UnitEstimate, where: str) -> None:
    for name in SCALARS:
        _close(got.values[name], want.values[name], f"{where} {name}")
        _close(got.stderr[name], want.stderr[name], f"{where} {name} se")
    for field in ("survival", "pmf", "tv_lag_num", "tv_lag_den"):
        a, b = getattr(got, field), getattr(want, field)
        assert a.shape == b.shape, f"{where} {field}: shape {a.shape} vs {b.shape}"
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=RTOL, err_msg=f"{where} {field}")
    _close(got.median_tau, want.median_tau, f"{where} median_tau")
    assert got.tail_observed == want.tail_observed


def assert_store_matches_reference(path: str, obs_windows: list[int] | None = None) -> int:
    """Every finished document of the store, both estimators, each observation window (the
    stored L by default): Rust equals numpy. Returns the units compared."""
    reader = TraceStoreReader(str(path))
    docs = list(reader.done)
    summaries = [reader.read_summary(d, SUMMARY_READ) for d in docs]
    ids = [reader.doc_ids[d] for d in docs]
    compared = 0
    for obs in obs_windows or [reader.window]:
        for estimator in ("indicator", "tv"):
            got = estimate_units(
                summaries, ids, reader.policies, obs_window=obs, estimator=estimator
            )
            for doc_id, summary, units in zip(ids, summaries, got, strict=True):
                for i, pol in enumerate(reader.policies):
                    want = reference_unit(
                        summary["hazard"][i],
                        summary["branch_step"][i],
                        summary["branch_mismatch"][i],
                        summary["branch_tv"][i],
                        obs_window=obs,
                        estimator=estimator,
                        doc_id=doc_id,
                        policy=pol,
                    )
                    where = f"{doc_id}/{pol} L_w={obs} {estimator}"
                    assert_unit_equal(units[pol], want, where)
                    compared += 1
    return compared
