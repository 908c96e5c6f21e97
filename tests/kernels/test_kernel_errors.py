"""Bad input gets a typed ValueError naming the first offending row; nothing panics."""

from __future__ import annotations

import numpy as np
import pytest

import kvcouple
from kvcouple import InvalidInputError, ShapeError

P = np.full((3, 4), 0.25)


def test_error_classes_are_value_errors():
    assert issubclass(InvalidInputError, ValueError)
    assert issubclass(ShapeError, InvalidInputError)
    assert issubclass(kvcouple.InvalidKernelError, ValueError)


@pytest.mark.parametrize("fn", ["divergences", "couple"])
@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda q: q.__setitem__((1, 2), np.nan), "row 1: .*NaN"),
        (lambda q: q.__setitem__((2, 0), np.inf), "row 2: .*infinity"),
        (lambda q: q.__setitem__((1, slice(None)), [0.5, 0.75, -0.25, 0.0]), "row 1: .*negative"),
        (lambda q: q.__setitem__((0, 0), 0.5), "row 0: q sums to 1.25"),
    ],
)
def test_bad_values_name_the_row(fn, mutate, match):
    q = P.copy()
    mutate(q)
    args = (P, q) if fn == "divergences" else (P, q, np.zeros((3, 3)))
    with pytest.raises(InvalidInputError, match=match):
        getattr(kvcouple, fn)(*args)


def test_shapes():
    with pytest.raises(ShapeError, match="shape"):
        kvcouple.divergences(P, P[:2])
    with pytest.raises(ShapeError, match="2-D"):
        kvcouple.divergences(P[0], P[0])
    with pytest.raises(ShapeError, match="empty"):
        kvcouple.divergences(np.zeros((0, 4)), np.zeros((0, 4)))
    with pytest.raises(ShapeError, match="empty"):
        kvcouple.couple(np.zeros((2, 0)), np.zeros((2, 0)), np.zeros((2, 3)))
    with pytest.raises(ShapeError, match=r"u has shape \(2, 3\), expected \(3, 3\)"):
        kvcouple.couple(P, P, np.zeros((2, 3)))
    huge = np.lib.stride_tricks.as_strided(np.zeros(1, np.float16), (1, 2**31), (0, 0))
    with pytest.raises(ShapeError, match="int32"):
        kvcouple.divergences(huge, huge)


def test_uniforms_outside_unit_interval():
    for bad in (1.0, -0.1, np.nan):
        u = np.zeros((3, 3))
        u[2, 1] = bad
        with pytest.raises(InvalidInputError, match="row 2: uniform u1"):
            kvcouple.couple(P, P, u)


def test_dtypes():
    with pytest.raises(InvalidInputError, match="dtype"):
        kvcouple.divergences(P.astype(np.int64), P.astype(np.int64))
    with pytest.raises(InvalidInputError, match="bfloat16"):
        kvcouple.divergences(P.astype(np.uint16), P.astype(np.uint16))
    with pytest.raises(InvalidInputError, match="one dtype"):
        kvcouple.divergences(P, P.astype(np.float32))
    with pytest.raises(InvalidInputError, match="temperature"):
        kvcouple.divergences(P, P, logits=True, temperature=0.0)
    with pytest.raises(InvalidInputError, match="top_p"):
        kvcouple.divergences(P, P, logits=True, top_p=0.0)
    with pytest.raises(InvalidInputError, match="all -inf"):
        kvcouple.divergences(np.full((1, 3), -np.inf), np.zeros((1, 3)), logits=True)


def test_non_contiguous_input_is_accepted():
    wide = np.full((3, 8), 0.125)
    d = kvcouple.divergences(wide[:, ::2] * 2, wide[:, 1::2] * 2)
    assert np.all(d.tv == 0)
