"""The per-unit RB-CMC estimates (survival weights, occurrence, occupation, window and tail
parts, TV by lag, median tau, the sharp interval's ends) are computed in Rust for a batch of
documents per call; each equals the plain numpy reference (``kvcouple.reference.estimates``)
to 1e-12 on synthetic stores, stores with short windows (tail unobserved), absorbing EOS, and
damaged units, which both refuse with the same words (a damaged document skipped alone:
test_analysis_batches). The real-model store's case is in tests/real_model."""

from __future__ import annotations

import numpy as np
import pytest

from kvcouple import _core, synth
from kvcouple.analysis.estimates import estimate_units
from kvcouple.errors import ShapeError, StoreError
from kvcouple.reference.estimates import estimate_unit as reference_unit
from kvcouple.synth.trace_store import write_synthetic_trace_store
from units_helpers import assert_store_matches_reference


def _pairs(absorbing: bool = False) -> dict[str, object]:
    return {
        "mild": synth.random_pair(5, 3, seed=1, closeness=0.8, absorbing=absorbing),
        "harsh": synth.random_pair(5, 3, seed=2, closeness=0.3, absorbing=absorbing),
    }


@pytest.mark.parametrize(
    ("window", "absorbing", "obs_windows"),
    [
        (None, False, [0, 3, 11]),  # branches to the horizon: tail observed
        (4, False, [2, 4]),  # a short stored window: the tail is unobserved
        (None, True, [5, 11]),  # absorbing EOS: the paths stop early
    ],
)
def test_rust_units_equal_the_numpy_reference(tmp_path, window, absorbing, obs_windows):
    store = write_synthetic_trace_store(
        tmp_path / "s.zarr", _pairs(absorbing), horizon=12, window=window, branches=2,
        replicates=5, docs=6, seed=3,
    )  # fmt: skip
    assert assert_store_matches_reference(str(store), obs_windows) == 6 * 2 * 2 * len(obs_windows)


def _summary(rng: np.random.Generator) -> dict[str, np.ndarray]:
    P, R, T, K, L = 2, 3, 6, 2, 5
    return {
        "hazard": rng.uniform(0, 0.4, (P, R, T)).astype(np.float32),
        "branch_step": rng.integers(1, T + 1, (P, R, K)).astype(np.int32),
        "branch_mismatch": rng.integers(-1, 2, (P, R, K, L + 1)).astype(np.int8),
        "branch_tv": rng.uniform(0, 1, (P, R, K, L + 1)).astype(np.float16),
    }


@pytest.mark.parametrize(
    ("field", "index", "value"),
    [
        ("hazard", (1, 2, 4), 1.5),
        ("hazard", (0, 0, 0), np.nan),
        ("branch_step", (1, 1, 0), 0),  # a diverging replicate without its branch
        ("branch_step", (0, 2, 1), 9),  # past the horizon
    ],
)
def test_damage_is_refused_with_the_reference_words(field, index, value):
    summary = _summary(np.random.default_rng(7))
    summary[field][index] = value
    with pytest.raises(StoreError) as rust:
        estimate_units([summary], ["d0"], ["a", "b"], obs_window=3)
    pol = index[0]
    with pytest.raises(StoreError) as numpy:
        reference_unit(
            *(summary[k][pol] for k in ("hazard", "branch_step", "branch_mismatch", "branch_tv")),
            obs_window=3, doc_id="d0", policy="ab"[pol],
        )  # fmt: skip
    assert str(rust.value) == str(numpy.value)


@pytest.mark.parametrize("estimator", ["indicator", "tv"])
@pytest.mark.parametrize("damaged", [None, "hazard", "branch_step"])
def test_stored_dtypes_are_read_as_they_are(estimator, damaged):
    """The Rust call reads float32 hazards and TVs and int32 steps as traced (no converted
    copy of the batch): the same bits as the batch converted to float64 and int64, NaN and
    infinite TVs and the damage it names included."""
    rng = np.random.default_rng(11)
    units, R, T, K, L = 9, 4, 16, 2, 17
    hazard = rng.uniform(0, 0.3, (units, R, T)).astype(np.float32)
    steps = rng.integers(1, T + 1, (units, R, K)).astype(np.int32)
    mismatch = rng.integers(-1, 2, (units, R, K, L)).astype(np.int8)
    tv = rng.uniform(0, 1, (units, R, K, L)).astype(np.float32)
    tv[0, 0, 0, 3], tv[1, 1, 1, 4], tv[2, 0, 1, 5] = np.nan, np.inf, -np.inf
    if damaged == "hazard":
        hazard[4, 2, 7] = 1.5
    elif damaged == "branch_step":
        steps[5, 1, 0] = T + 3
    stored = _core.estimate_units(hazard, steps, mismatch, tv, 6, estimator, True)
    wide = _core.estimate_units(
        hazard.astype(np.float64), steps.astype(np.int64), mismatch, tv.astype(np.float64),
        6, estimator, True,
    )  # fmt: skip
    assert stored["damage"] == wide["damage"] and bool(stored["damage"]) == (damaged is not None)
    for key, values in wide.items():
        if key != "damage":
            assert values.tobytes() == stored[key].tobytes(), key
    with pytest.raises(ShapeError, match="both of one dtype"):
        _core.estimate_units(hazard, steps, mismatch, tv.astype(np.float64), 6, estimator, True)
    with pytest.raises(ShapeError, match="int32 or int64"):
        _core.estimate_units(hazard, steps.astype(np.int16), mismatch, tv, 6, estimator, True)
