"""Property tests (issue 11): random bad values into the public kernels and the command line
give a typed kvcouple error or a valid result: never another exception, never a hang."""

from __future__ import annotations

import math
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvcouple
import kvcouple.models
import kvcouple.tracer.cli
from kvcouple import synth
from kvcouple.cli import main
from kvcouple.errors import InvalidInputError, StoreError

# Seconds any one example may take (a hang would be minutes).
BOUND = 60.0  # generous: two shared cores under a parallel CI job

WEIRD = [
    None,
    True,
    0,
    1,
    -1,
    3,
    2**70,
    -(2**70),
    1.5,
    0.0,
    -0.0,
    1e-320,
    1e300,
    math.nan,
    math.inf,
    -math.inf,
    1j,
    "x",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    [],
    [[1.0]],
    [[0.5, 0.5], [1.0]],
    np.float64(0.5),
    np.int64(2),
]


@st.composite
def matrices(draw: st.DrawFn) -> object:
    kind = draw(st.sampled_from(["array", "weird"]))
    if kind == "weird":
        return draw(st.sampled_from(WEIRD))
    dtype = draw(
        st.sampled_from(
            [np.float64, np.float32, np.float16, np.uint16, np.int64, np.bool_, np.complex128]
        )
    )
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(0, 4), min_size=ndim, max_size=ndim)))
    fill = draw(st.sampled_from([0.25, 0.5, 1.0, -1.0, math.nan, math.inf, 0.0, 5.0]))
    with np.errstate(invalid="ignore", over="ignore"):
        a = np.full(shape, fill).astype(dtype)
    if draw(st.booleans()) and a.ndim == 2 and a.shape[1] > 1:
        a = a[:, ::2]  # not contiguous
    return a


ROWS = np.full((2, 4), 0.25)


def _valid_divergences(d: kvcouple.Divergences, rows: int) -> None:
    for name, v in d.as_dict().items():
        assert v.shape == (rows,), name
    assert np.all((d.tv >= 0) & (d.tv <= 1 + 1e-12))
    assert not np.any(np.isnan(d.tv))


def _check(call) -> None:
    start = time.monotonic()
    try:
        call()
    except InvalidInputError:
        pass
    assert time.monotonic() - start < BOUND


@settings(
    max_examples=200,
    deadline=timedelta(seconds=BOUND),
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    p=st.one_of(matrices(), st.just(ROWS)),
    q=st.one_of(matrices(), st.just(ROWS)),
    kwargs=st.dictionaries(
        st.sampled_from(
            ["logits", "temperature", "top_k", "top_p", "renormalize", "atol", "dtype"]
        ),
        st.sampled_from(WEIRD),
        max_size=4,
    ),
)
def test_divergences_fuzz(p, q, kwargs):
    def call():
        d = kvcouple.divergences(p, q, **kwargs)
        _valid_divergences(d, np.asarray(p).shape[0])

    _check(call)


@settings(
    max_examples=200,
    deadline=timedelta(seconds=BOUND),
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    p=st.one_of(matrices(), st.just(ROWS)),
    q=st.one_of(matrices(), st.just(ROWS)),
    u=st.one_of(matrices(), st.just(np.zeros((2, 3))), st.just(np.full((2, 3), 0.99))),
    kwargs=st.dictionaries(
        st.sampled_from(["renormalize", "atol", "dtype"]), st.sampled_from(WEIRD), max_size=3
    ),
)
def test_couple_fuzz(p, q, u, kwargs):
    def call():
        x, y, diverged = kvcouple.couple(p, q, u, **kwargs)
        rows = np.asarray(p).shape[0]
        vocab = np.asarray(p).shape[1]
        assert x.shape == y.shape == diverged.shape == (rows,)
        assert np.all((x >= 0) & (x < vocab) & (y >= 0) & (y < vocab))
        np.testing.assert_array_equal(diverged, x != y)

    _check(call)


@settings(max_examples=60, deadline=timedelta(seconds=BOUND))
@given(n=st.sampled_from([*WEIRD, 2, 8, 10_000, 2**31, 2**64]))
def test_set_num_threads_fuzz(n):
    before = kvcouple.get_num_threads()
    try:
        _check(lambda: kvcouple.set_num_threads(n))
    finally:
        kvcouple.set_num_threads(0)
    assert kvcouple.get_num_threads() >= 1 and before >= 1


# --- the command line ------------------------------------------------------------------------

NUMBERS = [
    "",
    "0",
    "-1",
    "1",
    "2",
    "3",
    "1.5",
    "nan",
    "inf",
    "-inf",
    "1e-320",
    "abc",
    "0x10",
    str(2**64),
    str(2**70),
    "2000000",  # refused where a size (horizon, documents, vocabulary) is bounded
    "10000000000000",  # refused by memory checks (replicates)
    "\x1b[31m",
    "a|b",
    "1:1",
    "0:0:0",
    "-",
]

# Per command: the options a user could get wrong, and a valid base command line.
OPTIONS = {
    "exact": ["-T", "-L", "--horizon", "--window"],
    "estimate": ["-T", "-L", "-N", "-K", "--seed", "--estimator", "--trace"],
    "random-pair": [
        "--vocab",
        "--states",
        "--seed",
        "--closeness",
        "--sparsity",
        "--deterministic",
    ],
    "trace-store": ["-T", "-L", "-K", "-R", "--docs", "--starts", "--record", "--seed"],
    "analyze": [
        "--window",
        "--estimator",
        "--n-boot",
        "--seed",
        "--ci",
        "--tolerance",
        "--worker-threads",
        "--io-threads",
        "--docs",
        "--plan",
        "--scheduler",
    ],
    "info": [],
    "trace": [
        "--horizon",
        "--replicates",
        "--branches",
        "--window",
        "--record",
        "--branch-batch",
        "--temperature",
        "--top-k",
        "--top-p",
        "--eos",
        "--seed",
        "--shard",
        "--max-docs",
        "--device",
        "--dtype",
        "--attn",
        "--policy",
        "--model",
        "--memory",
    ],
}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from kvcouple.synth.trace_store import write_synthetic_trace_store

    root = tmp_path_factory.mktemp("fuzz")
    pair = root / "pair.npz"
    synth.save_pair(synth.random_pair(3, 2, seed=1), pair)
    store = root / "store.zarr"
    write_synthetic_trace_store(store, {"p": pair}, horizon=4, replicates=3, docs=2)
    prompts = root / "prompts.jsonl"
    prompts.write_text('{"id": "a", "input_ids": [1, 2, 3]}\n')
    return {"root": root, "pair": pair, "store": store, "prompts": prompts}


def _base(command: str, f: dict[str, Path], out: Path) -> list[str]:
    return {
        "exact": ["synth", "exact", "--pair", str(f["pair"]), "-T", "3"],
        "estimate": ["synth", "estimate", "--pair", str(f["pair"]), "-T", "3", "-N", "50"],
        "random-pair": ["synth", "random-pair", "--vocab", "3", "--out", str(out / "p.npz")],
        "trace-store": ["synth", "trace-store", str(f["pair"]), "--out", str(out / "s.zarr")]
        + ["-T", "3", "-R", "2"],
        "analyze": ["analyze", str(f["store"]), "--out", str(out / "r"), "--n-boot", "20"]
        + ["--no-figures"],
        "info": ["info", str(f["store"])],
        "trace": ["trace", "--policy", "full", "--prompts", str(f["prompts"])]
        + ["--out", str(out / "t.zarr")],
    }[command]


@st.composite
def command_lines(draw: st.DrawFn) -> tuple[str, list[tuple[str, str]]]:
    command = draw(st.sampled_from(sorted(OPTIONS)))
    options = OPTIONS[command]
    if not options:
        return command, []
    pairs = draw(
        st.lists(
            st.tuples(st.sampled_from(options), st.sampled_from(NUMBERS)), min_size=1, max_size=3
        )
    )
    return command, pairs


@settings(
    max_examples=120,
    deadline=timedelta(seconds=BOUND),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(line=command_lines())
def test_command_line_fuzz(files, capsys, monkeypatch, tmp_path_factory, line):
    def no_model(*_a, **_k):
        raise InvalidInputError("(test) the arguments passed: model loading reached")

    # `kvcouple trace` calls the name it imported: patch both, or a valid line traces for real
    monkeypatch.setattr(kvcouple.models, "load_model", no_model)
    monkeypatch.setattr(kvcouple.tracer.cli, "load_model", no_model)
    command, pairs = line
    out = tmp_path_factory.mktemp("out")
    argv = _base(command, files, out)
    for option, value in pairs:
        argv += [f"{option}={value}"]  # '=' so that values like "-1" stay values
    start = time.monotonic()
    try:
        code = main(argv)
    except SystemExit as e:  # argparse: usage errors
        code = e.code if isinstance(e.code, int) else 2
    elapsed = time.monotonic() - start
    err = capsys.readouterr().err
    assert elapsed < BOUND, (argv, elapsed)
    assert "Traceback" not in err and "internal error" not in err, (argv, err)
    assert code in (0, 1, 2), (argv, code, err)
    if code == 1:  # a failed run is only ever a missing extra or a full disk here
        assert "extra" in err or "no space" in err, (argv, err)
    if code != 0:
        lines = [ln for ln in err.splitlines() if "error:" in ln]
        assert len(lines) == 1, (argv, err)


def test_store_errors_are_typed(files):
    """The one non-ValueError kvcouple error class the command line reports as input."""
    with pytest.raises(StoreError):
        kvcouple.analysis.analyze(files["pair"])
