"""Pair files, validation errors, the random generator and the ``kvcouple synth`` CLI."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import kvcouple
from kvcouple import synth
from kvcouple.cli import main


def test_save_load_roundtrip(tmp_path: Path) -> None:
    pair = synth.random_pair(5, 3, seed=2, sparsity=0.3)
    path = tmp_path / "pair.npz"
    synth.save_pair(pair, path)
    back = synth.load_pair(path)
    for a, b in zip(pair.arrays(), back.arrays(), strict=True):
        np.testing.assert_array_equal(a, b)
    with np.load(path) as f:
        assert sorted(f.keys()) == sorted(synth.pairs.EMITTER_KEYS)


def test_markov_shorthand_file(tmp_path: Path) -> None:
    p = np.array([[0.5, 0.5], [0.1, 0.9]])
    q = np.array([[0.6, 0.4], [0.1, 0.9]])
    path = tmp_path / "markov.npz"
    np.savez(path, P=p, Q=q, start=1)
    pair = synth.load_pair(path)
    assert pair.p.states == 2 and pair.p.is_markov() and pair.p.start == 1
    np.testing.assert_array_equal(pair.q.next, [[0, 1], [0, 1]])
    same = synth.KernelPair.markov(p, q, start=1)
    short = tmp_path / "short.npz"
    same.save(short, markov=True)
    with np.load(short) as f:
        assert sorted(f.keys()) == ["P", "Q", "start"]
    with pytest.raises(kvcouple.InvalidKernelError, match="shorthand"):
        synth.random_pair(3, 2, seed=0).save(short, markov=True)
    a, b = synth.exact(pair, 5, 2), synth.exact(same, 5, 2)
    assert a.expected_mismatches == b.expected_mismatches


def _emitter(**changes: object) -> dict[str, object]:
    d: dict[str, object] = {
        "P_emit": np.array([[0.5, 0.5], [1.0, 0.0]]),
        "P_next": np.array([[0, 1], [1, 0]]),
        "P_start": 0,
        "Q_emit": np.array([[0.4, 0.6], [1.0, 0.0]]),
        "Q_next": np.array([[0, 1], [1, 0]]),
        "Q_start": 0,
    }
    d.update(changes)
    return d


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"P_emit": np.array([[0.5, 0.4], [1.0, 0.0]])}, "P_emit row 0 sums to"),
        ({"Q_emit": np.array([[1.2, -0.2], [1.0, 0.0]])}, r"Q_emit\[0, 1\] = -0.2"),
        ({"Q_emit": np.array([[np.nan, 1.0], [1.0, 0.0]])}, r"Q_emit\[0, 0\] = NaN"),
        ({"P_next": np.array([[0, 2], [1, 0]])}, r"P_next\[0, 1\] = 2 is outside the states"),
        ({"Q_next": np.array([[0, -1], [1, 0]])}, r"Q_next\[0, 1\] = -1"),
        ({"P_start": 2}, "P_start = 2 is outside"),
        ({"Q_next": np.array([[0, 1]])}, "Q_emit has shape"),
        (
            {"Q_emit": np.ones((2, 3)) / 3, "Q_next": np.zeros((2, 3), int)},
            "P has 2 tokens but Q has 3",
        ),
        ({"P_emit": np.array([0.5, 0.5])}, "P_emit must be 2-D"),
        ({"P_next": np.array([[0.5, 1], [1, 0]])}, "P_next must hold integer"),
        ({"Q_start": 0.5}, "Q_start must be one integer"),
    ],
)
def test_invalid_pairs_name_the_problem(
    tmp_path: Path, changes: dict[str, object], message: str
) -> None:
    path = tmp_path / "bad.npz"
    np.savez(path, **_emitter(**changes))
    with pytest.raises(kvcouple.InvalidKernelError, match=message):
        synth.load_pair(path)


def test_bad_pair_files(tmp_path: Path) -> None:
    path = tmp_path / "keys.npz"
    np.savez(path, P_emit=np.eye(2), P_next=np.zeros((2, 2), int))
    with pytest.raises(kvcouple.InvalidKernelError, match="missing P_start, Q_emit, Q_next"):
        synth.load_pair(path)
    path = tmp_path / "other.npz"
    np.savez(path, A=np.eye(2))
    with pytest.raises(kvcouple.InvalidKernelError, match="needs the keys"):
        synth.load_pair(path)
    path = tmp_path / "square.npz"
    np.savez(path, P=np.ones((2, 3)) / 3, Q=np.ones((2, 3)) / 3, start=0)
    with pytest.raises(kvcouple.InvalidKernelError, match="square"):
        synth.load_pair(path)
    path = tmp_path / "garbage.npz"
    path.write_bytes(b"not a zip")
    with pytest.raises(kvcouple.InvalidKernelError, match="not a .npz pair file"):
        synth.load_pair(path)
    with pytest.raises(FileNotFoundError):
        synth.load_pair(tmp_path / "missing.npz")
    assert issubclass(kvcouple.InvalidKernelError, ValueError)


def test_rows_are_renormalised_within_tolerance() -> None:
    emit = np.array([[0.5, 0.5 + 1e-8]])
    pair = synth.KernelPair(
        synth.Kernel(emit, np.zeros((1, 2), int), 0), synth.Kernel(emit, np.zeros((1, 2), int), 0)
    )
    assert abs(pair.p.emit.sum() - 1) < 1e-15


def test_random_pair_options() -> None:
    a = synth.random_pair(6, 4, seed=3, sparsity=0.5, deterministic=0.3)
    b = synth.random_pair(6, 4, seed=3, sparsity=0.5, deterministic=0.3)
    for x, y in zip(a.arrays(), b.arrays(), strict=True):
        np.testing.assert_array_equal(x, y)
    c = synth.random_pair(6, 4, seed=4, sparsity=0.5, deterministic=0.3)
    assert not np.array_equal(a.p.emit, c.p.emit)
    same = synth.random_pair(4, 3, seed=1, closeness=1.0)
    assert synth.exact(same, 10, 3).expected_mismatches == 0
    m = synth.random_pair(4, seed=1, markov=True)
    assert m.p.is_markov() and m.q.is_markov()
    eos = synth.random_pair(4, 3, seed=2, absorbing=True)
    for k in (eos.p, eos.q):
        s = k.next[k.start, 3]
        assert k.emit[s, 3] == 1.0 and np.all(k.next[s] == s)
    with pytest.raises(kvcouple.InvalidInputError, match="closeness"):
        synth.random_pair(3, 3, closeness=1.5)
    with pytest.raises(kvcouple.InvalidInputError, match="absorbing"):
        synth.random_pair(3, 1, absorbing=True)


def test_kernel_pair_has_the_pair_file_attributes() -> None:
    pair = synth.random_pair(3, 2, seed=0)
    assert pair.p_emit is pair.p.emit and pair.q_start == pair.q.start and pair.vocab == 3


def test_cli_random_pair_exact_estimate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "pair.npz"
    assert (
        main(
            [
                "synth",
                "random-pair",
                "--vocab",
                "4",
                "--states",
                "3",
                "--seed",
                "5",
                "--out",
                str(path),
            ]
        )
        == 0
    )
    assert path.exists()
    capsys.readouterr()
    assert (
        main(["synth", "exact", "--pair", str(path), "--horizon", "10", "--window", "3", "--json"])
        == 0
    )
    exact = json.loads(capsys.readouterr().out)
    for key in (
        "expected_mismatches",
        "mismatch_fraction",
        "occurrence",
        "survival",
        "divergence_time_pmf",
        "occupation",
        "exposure",
        "rho",
        "first_mismatch",
        "window_contribution",
        "tail_contribution",
        "tail_exposure",
        "interval_lower",
        "interval_upper",
        "branch_tv_by_lag",
    ):
        assert key in exact
    assert len(exact["survival"]) == 11
    truth = synth.exact(synth.load_pair(path), 10, 3)
    assert exact["expected_mismatches"] == truth.expected_mismatches
    args = ["synth", "estimate", "--pair", str(path), "--horizon", "10", "--window", "3"]
    args += [
        "--estimator",
        "indicator",
        "--replicates",
        "3000",
        "--branches",
        "2",
        "--seed",
        "1",
        "--json",
    ]
    assert main(args) == 0
    est = json.loads(capsys.readouterr().out)
    assert est["estimator"] == "indicator" and est["replicates"] == 3000 and est["branches"] == 2
    for key in ("expected_mismatches", "occurrence", "window_contribution", "interval_upper"):
        assert set(est[key]) == {"mean", "se"}
        assert abs(est[key]["mean"] - getattr(truth, key)) <= 5 * est[key]["se"] + 1e-9
    assert main(["synth", "exact", "--pair", str(path), "-T", "10"]) == 0
    assert "interval_upper" in capsys.readouterr().out


def test_cli_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.npz"
    np.savez(path, **_emitter(P_start=7))
    assert main(["synth", "exact", "--pair", str(path), "--horizon", "5"]) == 2
    assert "P_start = 7" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["synth", "exact", "--pair", str(path), "--horizon", "0"])
    with pytest.raises(SystemExit):
        main(["synth", "estimate", "--pair", str(path), "--horizon", "3", "--estimator", "fast"])
