"""Every bad input gets a clear, typed error naming the argument (issue 11).

Python API cases assert the exception type and that the message names the argument; command
line cases assert the exit status (2: input that cannot be used, 1: a failed run, 130: Ctrl-C),
one line on stderr and no traceback.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest

import kvcouple
from kvcouple import InvalidInputError, InvalidKernelError, ShapeError, synth
from kvcouple.cli import main
from kvcouple.errors import MissingExtraError, require

P = np.full((3, 4), 0.25)
U = np.zeros((3, 3))


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """Exit status and stderr of one in-process command (argparse errors included)."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = int(e.code or 0)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return code, err


def _one_error_line(err: str, *needles: str) -> None:
    lines = [ln for ln in err.splitlines() if "error:" in ln]
    assert len(lines) == 1, err
    for n in needles:
        assert n in lines[0], (n, err)


# --- kernels ---------------------------------------------------------------------------------

KERNEL_CASES = [
    # (call, error type, text the message must hold)
    (lambda: kvcouple.couple(P, P, None), InvalidInputError, "u is None"),
    (lambda: kvcouple.couple(P, P, np.zeros(3)), ShapeError, "u has shape (3,)"),
    (lambda: kvcouple.couple(P, P, np.zeros((3, 3), complex)), InvalidInputError, "u must"),
    (lambda: kvcouple.couple(P, P, [[0, 0], [0]]), InvalidInputError, "u is not an array"),
    (lambda: kvcouple.couple(P, P * 5, U, atol=np.nan), InvalidInputError, "atol"),
    (lambda: kvcouple.couple(P, P, U, atol=-1.0), InvalidInputError, "atol"),
    (lambda: kvcouple.couple(P, P, U, atol="x"), InvalidInputError, "atol"),
    (lambda: kvcouple.couple(None, P, U), InvalidInputError, "p is None"),
    (lambda: kvcouple.couple(P, P, U, renormalize="yes"), InvalidInputError, "renormalize"),
    (lambda: kvcouple.divergences(P, P, atol=np.nan), InvalidInputError, "atol"),
    (lambda: kvcouple.divergences(P, P, logits=True, top_k=-1), InvalidInputError, "top_k"),
    (lambda: kvcouple.divergences(P, P, logits=True, top_k=0), InvalidInputError, "top_k"),
    (lambda: kvcouple.divergences(P, P, logits=True, top_k=1.5), InvalidInputError, "top_k"),
    (lambda: kvcouple.divergences(P, P, logits=True, top_k="3"), InvalidInputError, "top_k"),
    (lambda: kvcouple.divergences(P, P, logits=True, top_k=True), InvalidInputError, "top_k"),
    (lambda: kvcouple.divergences(P, P, logits=True, top_p=np.nan), InvalidInputError, "top_p"),
    (lambda: kvcouple.divergences(P, P, logits=True, top_p=1.5), InvalidInputError, "top_p"),
    (
        lambda: kvcouple.divergences(P, P, logits=True, temperature=1e-320),
        InvalidInputError,
        "temperature",
    ),
    (
        lambda: kvcouple.divergences(P, P, logits=True, temperature=np.inf),
        InvalidInputError,
        "temperature",
    ),
    (
        lambda: kvcouple.divergences(P, P, logits=True, temperature=1j),
        InvalidInputError,
        "temperature",
    ),
    # Decoding settings only apply to logits: refused rather than silently ignored.
    (lambda: kvcouple.divergences(P, P, temperature=0.0), InvalidInputError, "temperature"),
    (lambda: kvcouple.divergences(P, P, temperature=0.5), InvalidInputError, "logits=True"),
    (lambda: kvcouple.divergences(P, P, top_p=np.nan), InvalidInputError, "top_p"),
    (lambda: kvcouple.divergences(P, P, top_k=3), InvalidInputError, "logits=True"),
    (lambda: kvcouple.divergences(P, P, dtype=3), InvalidInputError, "dtype"),
    (lambda: kvcouple.divergences(P, P, logits="no"), InvalidInputError, "logits"),
    (lambda: kvcouple.divergences([[1, 2], [3]], P), InvalidInputError, "p is not an array"),
    (lambda: kvcouple.divergences(P.astype(complex), P), InvalidInputError, "p has dtype"),
    (lambda: kvcouple.set_num_threads(-1), InvalidInputError, "n = -1"),
    (lambda: kvcouple.set_num_threads(10_000), InvalidInputError, "n = 10000"),
    (lambda: kvcouple.set_num_threads(2**70), InvalidInputError, "n = "),
    (lambda: kvcouple.set_num_threads(1.5), InvalidInputError, "n must be an integer"),
]


@pytest.mark.parametrize(("call", "error", "text"), KERNEL_CASES)
def test_kernel_arguments(call, error, text):
    with pytest.raises(error) as info:
        call()
    assert text in str(info.value)


def test_kernel_arguments_that_are_valid():
    logits = np.log(P)
    # top_k beyond the vocabulary keeps everything (as in HF generation).
    big = kvcouple.divergences(logits, logits, logits=True, top_k=2**70)
    np.testing.assert_array_equal(big.tv, 0)
    assert np.all(np.isfinite(big.entropy_p))
    # A tiny temperature is greedy decoding, not NaN.
    z = np.array([[1.0, 3.0, 2.0, 0.0]])
    w = np.array([[3.0, 1.0, 2.0, 0.0]])
    d = kvcouple.divergences(z, w, logits=True, temperature=1e-300)
    assert d.tv[0] == 1.0 and d.entropy_p[0] == 0.0
    d = kvcouple.divergences(z * 1e300, z * 1e300, logits=True, temperature=1e-10)
    assert d.tv[0] == 0.0
    kvcouple.set_num_threads(np.int64(1))
    assert kvcouple.get_num_threads() == 1
    kvcouple.set_num_threads(0)


# --- pair files ------------------------------------------------------------------------------


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
    return {k: v for k, v in d.items() if v is not None}


def _good(tmp_path: Path) -> Path:
    path = tmp_path / "good.npz"
    np.savez(path, **_emitter())
    return path


def _truncated(tmp_path: Path) -> Path:
    data = _good(tmp_path).read_bytes()
    path = tmp_path / "truncated.npz"
    path.write_bytes(data[: len(data) // 2])
    return path


def _garbage(tmp_path: Path) -> Path:
    path = tmp_path / "garbage.npz"
    path.write_bytes(np.random.default_rng(0).bytes(4000))
    return path


def _corrupt_member(tmp_path: Path) -> Path:
    """A zip whose central directory is fine but whose member data is damaged."""
    path = tmp_path / "corrupt.npz"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for k, v in _emitter().items():
            with z.open(f"{k}.npy", "w") as f:
                np.lib.format.write_array(f, np.asarray(v))
    raw = bytearray(path.read_bytes())
    for i in range(60, 120):
        raw[i] ^= 0xFF
    path.write_bytes(bytes(raw))
    return path


def _directory(tmp_path: Path) -> Path:
    path = tmp_path / "dir.npz"
    path.mkdir()
    return path


def _saved(**changes: object):
    def make(tmp_path: Path) -> Path:
        path = tmp_path / "bad.npz"
        np.savez(path, **_emitter(**changes))
        return path

    return make


PAIR_FILE_CASES = [
    # (make the file, text the message must hold)
    (_truncated, "damaged .npz"),
    (_garbage, "not a .npz pair file"),
    (_corrupt_member, "damaged .npz"),
    (_directory, "is a directory"),
    (_saved(Q_next=None), "missing Q_next"),
    (_saved(P_start=np.array([0, 1])), "P_start must be one integer, got an array"),
    (_saved(P_start=np.array("a")), "P_start must be one integer"),
    (_saved(P_start=np.nan), "P_start must be one integer"),
    (_saved(P_next=np.array([[0.0, 1.5], [1.0, 0.0]])), "P_next must hold integer"),
    (_saved(P_next=np.array([[0.0, np.nan], [1.0, 0.0]])), "P_next must hold integer"),
    (_saved(P_next=np.array([[0.0, 1e30], [1.0, 0.0]])), "P_next holds a state index"),
    (_saved(P_next=np.array([["a", "b"], ["c", "d"]])), "P_next must hold integer"),
    (_saved(P_emit=np.array([[0.5, 0.5j], [1.0, 0.0]])), "P_emit must hold real"),
    (_saved(Q_emit=np.array([["a", "b"], ["c", "d"]])), "Q_emit must hold real"),
]


@pytest.mark.parametrize(("make", "text"), PAIR_FILE_CASES)
def test_bad_pair_files_api(tmp_path, make, text):
    from kvcouple.synth.trace_store import as_emitter_pair

    path = make(tmp_path)
    with pytest.raises(InvalidKernelError) as info:
        synth.load_pair(path)
    assert text in str(info.value)
    # The trace-store simulator reads pairs through the same validation.
    with pytest.raises(InvalidKernelError) as info:
        as_emitter_pair(path)
    assert text in str(info.value)


@pytest.mark.parametrize(("make", "text"), PAIR_FILE_CASES)
@pytest.mark.parametrize("command", ["exact", "trace-store"])
def test_bad_pair_files_cli(tmp_path, capsys, make, text, command):
    path = make(tmp_path)
    if command == "exact":
        argv = ["synth", "exact", "--pair", str(path), "-T", "3"]
    else:
        argv = ["synth", "trace-store", str(path), "--out", str(tmp_path / "s.zarr"), "-T", "3"]
    code, err = _cli(argv, capsys)
    assert code == 2
    _one_error_line(err, text, str(path))
    if command == "exact":
        assert "--pair" in err
    assert not (tmp_path / "s.zarr").exists()


def test_missing_pair_file(tmp_path, capsys):
    with pytest.raises(FileNotFoundError):
        synth.load_pair(tmp_path / "nope.npz")
    code, err = _cli(["synth", "exact", "--pair", str(tmp_path / "nope.npz"), "-T", "3"], capsys)
    assert code == 2
    _one_error_line(err, "--pair", "nope.npz", "No such file")


def test_emitter_mapping_of_wrong_types():
    from kvcouple.synth.trace_store import as_emitter_pair

    with pytest.raises(InvalidKernelError, match="missing Q_next"):
        as_emitter_pair({k: v for k, v in _emitter().items() if k != "Q_next"})
    with pytest.raises(InvalidKernelError, match="P_start must be one integer"):
        as_emitter_pair(_emitter(P_start=np.array([0, 1])))
    with pytest.raises(InvalidKernelError, match="P_next must hold integer"):
        as_emitter_pair(_emitter(P_next=np.array([[0, 0.5], [1, 0]])))
    with pytest.raises(InvalidKernelError, match="P_emit must hold real"):
        as_emitter_pair(_emitter(P_emit=np.array([[0.5, 0.5j], [1, 0]])))


STARTS_CASES = [
    ("0:0:0", "'0:0:0' is not a state or sp:sq"),
    ("a", "'a' is not a state"),
    ("0,,1", "'' is not a state"),
    ("1.5", "'1.5' is not a state"),
    ("-1", "negative state"),
    ("0:-1", "negative state"),
    ("5", "start state 5 of P is not a state"),
    ("0:9", "start state 9 of Q is not a state"),
]


@pytest.mark.parametrize(("starts", "text"), STARTS_CASES)
def test_starts_are_parsed_strictly(tmp_path, capsys, starts, text):
    argv = ["synth", "trace-store", str(_good(tmp_path)), "--out", str(tmp_path / "s.zarr")]
    code, err = _cli([*argv, "-T", "3", "--starts", starts], capsys)
    assert code == 2
    _one_error_line(err, text)
    assert "--starts" in err or "start state" in err


@pytest.mark.parametrize(
    ("argv", "text"),
    [
        (["-T", "0"], "argument -T/--horizon"),
        (["-T", "x"], "argument -T/--horizon: 'x' is not an integer"),
        (["-T", "3", "-L", "-1"], "argument -L/--window"),
        (["-T", "3", "-K", "0"], "argument -K/--branches"),
        (["-T", "3", "-R", "-2"], "argument -R/--replicates"),
        (["-T", "3", "--docs", "0"], "argument --docs"),
        (["-T", "3", "--seed", "-1"], "argument --seed"),
        (["-T", "3", "--seed", str(2**64)], "argument --seed"),
        (["-T", str(2**50)], "argument -T/--horizon"),
        (["-T", "2000000"], "horizon = 2000000 is beyond"),
        (["-T", "3", "--docs", "2000000"], "docs = 2000000 is beyond"),
        (["-T", "3", "-R", "2000000"], "replicates x branches = 2000000 x 1"),
    ],
)
def test_trace_store_counts(tmp_path, capsys, argv, text):
    base = ["synth", "trace-store", str(_good(tmp_path)), "--out", str(tmp_path / "s.zarr")]
    code, err = _cli([*base, *argv], capsys)
    assert code == 2 and text in err


def test_trace_store_python_api_counts(tmp_path):
    from kvcouple.synth.trace_store import write_synthetic_trace_store

    pair = {"a": _emitter()}
    for kwargs, text in [
        ({"horizon": 0}, "horizon"),
        ({"horizon": 2.5}, "horizon"),
        ({"horizon": 3, "window": -1}, "window"),
        ({"horizon": 3, "branches": 0}, "branches"),
        ({"horizon": 3, "replicates": True}, "replicates"),
        ({"horizon": 3, "docs": -1}, "docs"),
        ({"horizon": 3, "docs": [(0, 0, 0)]}, "document start"),
        ({"horizon": 3, "seed": -1}, "seed"),
        ({"horizon": 3, "seed": 1.5}, "seed"),
    ]:
        with pytest.raises(InvalidInputError) as info:
            write_synthetic_trace_store(tmp_path / "s.zarr", pair, **kwargs)
        assert text in str(info.value)
    assert not (tmp_path / "s.zarr").exists()


@pytest.mark.parametrize(
    ("argv", "text"),
    [
        (["exact", "-T", "0"], "argument -T/--horizon"),
        (["exact", "-T", "3", "-L", "x"], "argument -L/--window"),
        (["estimate", "-T", "3", "-N", "0"], "argument -N/--replicates"),
        (["estimate", "-T", "3", "--seed", "-5"], "argument --seed"),
    ],
)
def test_synth_counts(tmp_path, capsys, argv, text):
    code, err = _cli(["synth", argv[0], "--pair", str(_good(tmp_path)), *argv[1:]], capsys)
    assert code == 2 and text in err


@pytest.mark.parametrize(
    ("argv", "text"),
    [
        (["--vocab", "0"], "argument --vocab"),
        (["--vocab", "3", "--closeness", "nan"], "argument --closeness"),
        (["--vocab", "3", "--sparsity", "inf"], "argument --sparsity"),
        (["--vocab", "3", "--closeness", "2"], "closeness"),
        (["--vocab", "3", "--seed", "-1"], "argument --seed"),
    ],
)
def test_random_pair_arguments(tmp_path, capsys, argv, text):
    code, err = _cli(["synth", "random-pair", *argv, "--out", str(tmp_path / "p.npz")], capsys)
    assert code == 2 and text in err


def test_memory_limits_are_checked_before_allocating(tmp_path, monkeypatch):
    import kvcouple.resources as resources
    from kvcouple.errors import ResourceLimitError
    from kvcouple.synth.trace_store import write_synthetic_trace_store

    monkeypatch.setattr(resources, "available_memory", lambda: 10**6)
    pair = synth.random_pair(3, 2, seed=0)
    with pytest.raises(ResourceLimitError, match="replicates = 100000"):
        synth.estimate(pair, 3, 2, replicates=100_000)
    with pytest.raises(ResourceLimitError, match="one synthetic document"):
        write_synthetic_trace_store(tmp_path / "s.zarr", {"p": pair}, horizon=64, replicates=4096)
    assert not (tmp_path / "s.zarr").exists()


def test_a_simulation_beyond_its_work_limit_is_refused_before_it_starts(
    tmp_path, capsys, monkeypatch
):
    """-N 2000000 -K 2000000 (a fuzzed line: 33 hours of simulation here) is refused at once,
    naming the product; at the limit a simulation runs, one branch step beyond it is refused."""
    import kvcouple.synth.estimators as estimators
    from kvcouple.errors import ResourceLimitError

    path = tmp_path / "p.npz"
    synth.save_pair(synth.random_pair(3, 2, seed=0), path)
    start = time.monotonic()
    argv = ["synth", "estimate", "--pair", str(path), "-T", "3", "-N", "2000000", "-K", "2000000"]
    code, err = _cli(argv, capsys)
    assert code == 2
    _one_error_line(err, "2000000 x 2000000 x 3", "branch steps")
    assert time.monotonic() - start < 10
    pair = synth.random_pair(3, 2, seed=0)
    monkeypatch.setattr(estimators, "MAX_BRANCH_STEPS", 4 * 5 * 3)
    got = synth.simulate(pair, 3, replicates=4, branches=5)
    assert got["occurrence"].shape == (4,)
    with pytest.raises(ResourceLimitError, match="4 x 5 x 4 = 80 branch steps"):
        synth.simulate(pair, 4, replicates=4, branches=5)
    with pytest.raises(ResourceLimitError, match="5 x 5 x 3"):
        synth.estimate(pair, 3, replicates=5, branches=5)


def test_exact_horizon_limit_is_checked_before_solving(tmp_path, capsys):
    path = tmp_path / "p.npz"
    synth.save_pair(synth.random_pair(16, 16, seed=1), path)
    start = time.monotonic()
    code, err = _cli(["synth", "exact", "--pair", str(path), "-T", "100000"], capsys)
    assert code == 2
    _one_error_line(err, "horizon = 100000", "exact solver")
    assert time.monotonic() - start < 10  # refused up front, not after solving
    with pytest.raises(InvalidInputError, match="horizon = 100000"):
        synth.exact(synth.random_pair(16, 16, seed=1), 100_000, 100_000)


def _interrupt(argv: list[str]) -> tuple[int, str, float]:
    """Run a command, press Ctrl-C after 1.5 s; exit status, stderr, seconds from Ctrl-C."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvcouple.cli", *argv],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    # Interrupt once it is computing: after 3 s of CPU time (start-up imports take less),
    # measured rather than waited for, since the machine may be loaded.
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        if (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK") > 3:
            break
        time.sleep(0.1)
    assert proc.poll() is None, "finished before the interrupt"
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    return proc.returncode, err, time.monotonic() - sent


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
@pytest.mark.parametrize(
    "argv",
    [
        ["exact", "-T", "2000"],
        ["estimate", "-T", "20000", "-L", "10", "-N", "10000000"],
    ],
)
def test_ctrl_c_stops_long_rust_computations(tmp_path, argv):
    path = tmp_path / "p.npz"
    synth.save_pair(synth.random_pair(16, 16, seed=1), path)
    code, err, seconds = _interrupt(["synth", argv[0], "--pair", str(path), *argv[1:]])
    assert code == 130, err
    assert "interrupted" in err and "Traceback" not in err
    assert seconds < 5  # within a second, plus interpreter shutdown on a loaded machine


# --- the command line itself -----------------------------------------------------------------


def test_debug_shows_the_traceback(tmp_path, capsys):
    path = _garbage(tmp_path)
    code, err = _cli(["synth", "exact", "--pair", str(path), "-T", "3"], capsys)
    assert code == 2 and err.startswith("kvcouple synth exact: error:")
    with pytest.raises(InvalidKernelError):
        main(["--debug", "synth", "exact", "--pair", str(path), "-T", "3"])
    # --debug was that call's: the next in-process call reports one line again.
    assert "KVCOUPLE_DEBUG" not in os.environ
    code, err = _cli(["synth", "exact", "--pair", str(path), "-T", "3"], capsys)
    assert code == 2 and err.startswith("kvcouple synth exact: error:")


def test_errors_map_to_exit_statuses():
    import errno

    from kvcouple.cli import describe

    assert describe(InvalidInputError("x"))[1] == 2
    assert describe(kvcouple.StoreError("x"))[1] == 2
    assert describe(KeyboardInterrupt())[1] == 130
    msg, code = describe(OSError(errno.ENOSPC, "No space left on device", "/x/y"))
    assert code == 1 and "no space left" in msg and "/x/y" in msg and "resume" in msg
    msg, code = describe(ModuleNotFoundError("No module named 'torch'", name="torch"))
    assert code == 1 and "pip install 'kvcouple[tracer]'" in msg
    msg, code = describe(TypeError("boom"))
    assert code == 1 and "internal error" in msg and "TypeError: boom" in msg
    assert describe(kvcouple.InternalError("panic"))[1] == 1
    msg, code = describe(MemoryError("Unable to allocate 23.8 GiB"))
    assert code == 1 and "out of memory" in msg and "internal" not in msg


# --- missing optional dependencies -----------------------------------------------------------


def test_require_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingExtraError, match=r"pip install 'kvcouple\[plots\]'"):
        require("matplotlib", "figures")
    assert issubclass(MissingExtraError, ImportError)


def _without(modules: list[str], argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    code = (
        "import sys\n"
        f"for m in {modules!r}: sys.modules[m] = None\n"
        "from kvcouple.cli import main\n"
        f"sys.exit(main({argv!r}))\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, timeout=300
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["demo", "--out", "demo", "--docs", "1"],
        ["trace", "--policy", "full", "--out", "x.zarr"],
    ],
)
def test_commands_without_torch_name_the_extra(tmp_path, argv):
    res = _without(["torch", "transformers"], argv, tmp_path)
    assert res.returncode == 1, res.stderr
    assert "Traceback" not in res.stderr
    assert "this needs the `tracer` extra" in res.stderr
    assert "pip install 'kvcouple[tracer]'" in res.stderr


def test_environment_debug_variable(tmp_path):
    env = {**os.environ, "KVCOUPLE_DEBUG": "1"}
    res = subprocess.run(
        [sys.executable, "-m", "kvcouple.cli", "synth", "exact", "--pair", str(_garbage(tmp_path))]
        + ["-T", "3"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert res.returncode != 0 and "Traceback" in res.stderr
