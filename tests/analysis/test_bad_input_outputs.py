"""Bad input around the analysis and its outputs (issue 11): arguments, outputs only inside
``--out``, escaped ids and names, missing matplotlib, disk full (with a resume test)."""

from __future__ import annotations

import errno
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kvcouple import InvalidInputError, synth
from kvcouple.analysis import analyze
from kvcouple.cli import main
from kvcouple.synth.trace_store import write_synthetic_trace_store
from kvcouple.textsafe import markdown_cell, split_markdown_row, terminal

# A policy name and a model id that would break tables, headings and terminals.
NASTY = "a|b\n# heading\x1b[31mred\u202e"


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as e:
        code = int(e.code or 0)
    cap = capsys.readouterr()
    assert "Traceback" not in cap.err, cap.err
    return code, cap.out, cap.err


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("store") / "s.zarr"
    pair = synth.random_pair(4, 3, seed=2)
    write_synthetic_trace_store(
        path,
        {NASTY: pair, "plain": pair},
        horizon=6,
        window=2,
        replicates=4,
        docs=3,
        model_id="model\n## injected|x",
    )
    return path


@pytest.mark.parametrize(
    ("argv", "text"),
    [
        (["--n-boot", "0"], "argument --n-boot"),
        (["--n-boot", "-3"], "argument --n-boot"),
        (["--tolerance", "nan"], "argument --tolerance"),
        (["--tolerance", "-1"], "argument --tolerance"),
        (["--ci", "1.5"], "argument --ci"),
        (["--ci", "nan"], "argument --ci"),
        (["--seed", "-1"], "argument --seed"),
        (["--window", "-1"], "argument --window"),
        (["--worker-threads", "0"], "argument --worker-threads"),
        (["--io-threads", "0"], "argument --io-threads"),
        (["--scheduler", "tcp://127.0.0.1:1"], "scheduler = 'tcp://127.0.0.1:1' is not reachable"),
        (["--scheduler", "tcp://nohostport"], "needs a host and a port"),
    ],
)
def test_analyze_arguments(store, tmp_path, capsys, argv, text):
    start = time.monotonic()
    code, _, err = _cli(["analyze", str(store), "--out", str(tmp_path / "r"), *argv], capsys)
    assert code == 2 and text in err
    assert time.monotonic() - start < 15  # an unreachable scheduler fails in seconds
    assert not (tmp_path / "r").exists()


@pytest.fixture
def not_a_scheduler():
    """A port that accepts connections and answers HTTP (as a proxy does), not Dask."""
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def answer() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            with conn:
                conn.sendall(b"HTTP/1.0 426 Upgrade Required\r\ncontent-length: 0\r\n\r\n")

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    yield f"tcp://127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join()
    server.close()


def test_a_port_that_is_not_a_dask_scheduler_is_named(store, tmp_path, capsys, not_a_scheduler):
    pytest.importorskip("distributed")
    argv = ["analyze", str(store), "--out", str(tmp_path / "r"), "--scheduler", not_a_scheduler]
    code, _, err = _cli(argv, capsys)
    assert code == 2, err
    assert f"scheduler = '{not_a_scheduler}' accepts connections but does not answer" in err
    assert "out of memory" not in err and not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    ("kwargs", "text"),
    [
        ({"n_boot": 0}, "n_boot"),
        ({"n_boot": 2.5}, "n_boot"),
        ({"tolerance": float("nan")}, "tolerance"),
        ({"ci": 0.0}, "ci"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"window": -2}, "window"),
        ({"worker_threads": 0}, "worker_threads"),
        ({"io_threads": 0}, "io_threads"),
        ({"scheduler": 5}, "scheduler"),
    ],
)
def test_analyze_api_arguments(store, kwargs, text):
    with pytest.raises(InvalidInputError) as info:
        analyze(store, **kwargs)
    assert text in str(info.value)


def test_analyze_out_is_a_file(store, tmp_path, capsys):
    out = tmp_path / "file"
    out.write_text("mine")
    code, _, err = _cli(["analyze", str(store), "--out", str(out)], capsys)
    assert code == 2 and "--out" in err and "not a directory" in err
    assert out.read_text() == "mine"


def test_outputs_only_inside_out(store, tmp_path, capsys):
    out = tmp_path / "r"
    out.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "victim.txt"
    victim.write_text("keep me")
    (out / "summary.csv").symlink_to(victim)
    (out / "report.html").symlink_to(outside / "planted.html")
    (out / "figures").symlink_to(outside)
    code, _, _ = _cli(["analyze", str(store), "--out", str(out), "--n-boot", "50"], capsys)
    assert code == 0
    assert victim.read_text() == "keep me"
    assert sorted(p.name for p in outside.iterdir()) == ["victim.txt"]
    for name in ("summary.csv", "report.html", "figures"):
        assert not (out / name).is_symlink()
    assert "policy" in (out / "summary.csv").read_text()
    assert any((out / "figures").glob("*.png"))


def test_ids_and_names_are_escaped(store, tmp_path, capsys):
    out = tmp_path / "r"
    code, stdout, _ = _cli(["analyze", str(store), "--out", str(out), "--n-boot", "50"], capsys)
    assert code == 0
    assert "\x1b" not in stdout and "\u202e" not in stdout
    assert terminal(NASTY) in stdout
    md = (out / "report.md").read_text()
    assert "\x1b" not in md and "\u202e" not in md
    headings = [ln for ln in md.splitlines() if ln.startswith("#")]
    assert all(not h.startswith(("# heading", "## injected")) for h in headings), headings
    # Every table row has as many cells as its header.
    width = None
    for ln in md.splitlines():
        if not ln.startswith("|"):
            width = None
            continue
        cells = split_markdown_row(ln)
        width = width or len(cells)
        assert len(cells) == width, ln
    assert any(markdown_cell(NASTY) in ln for ln in md.splitlines())
    page = (out / "report.html").read_text()
    assert "\x1b" not in page and "<h1>heading" not in page and "<h2>injected" not in page
    for table in page.split("<table>")[1:]:  # every row as wide as its header
        rows = table.split("</table>")[0].split("<tr>")[1:]
        assert rows and {r.count("<td") for r in rows[1:]} <= {rows[0].count("<th>")}
    assert "a|b" in page  # the name itself, unescaped inside its cell
    # kvcouple info escapes too.
    code, stdout, _ = _cli(["info", str(store)], capsys)
    assert code == 0 and "\x1b" not in stdout and "\\x1b[31m" in stdout


def test_markdown_cells_round_trip():
    for s in ["a|b", "x\\|y", "back\\slash|", "new\nline", "\x1b[0m", "plain"]:
        row = "| " + " | ".join([markdown_cell(s), "2"]) + " |"
        assert split_markdown_row(row) == [terminal(s), "2"]
    assert terminal("tab\there") == "tab\\there"


def test_report_without_matplotlib(store, tmp_path):
    code = (
        "import sys\n"
        "sys.modules['matplotlib'] = None\n"
        "from kvcouple.cli import main\n"
        f"sys.exit(main(['analyze', {str(store)!r}, '--out', 'r', '--n-boot', '50']))\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300
    )
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr
    assert "pip install 'kvcouple[plots]'" in res.stderr and "without figures" in res.stderr
    page = (tmp_path / "r" / "report.html").read_text()
    assert "<table>" in page and "data:image/png" not in page
    assert (tmp_path / "r" / "summary.csv").exists()


def test_report_without_matplotlib_python_api(store, tmp_path, monkeypatch):
    from kvcouple.analysis.report import write_report

    result = analyze(store, n_boot=50)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.warns(UserWarning, match=r"kvcouple\[plots\]"):
        write_report(result, tmp_path / "r")
    assert (tmp_path / "r" / "report.html").exists()
    with pytest.raises(InvalidInputError, match="not a directory"):
        write_report(result, tmp_path / "r" / "report.html")


# --- disk full -------------------------------------------------------------------------------


def _store_arrays(path: Path) -> dict[str, np.ndarray]:
    import xarray as xr

    from kvcouple.store import open_trace_store

    ds = open_trace_store(path)
    try:
        return {k: np.asarray(v.values) for k, v in ds.data_vars.items()}
    finally:
        if isinstance(ds, xr.Dataset):
            ds.close()


def _trace_store_argv(pair: Path, out: Path) -> list[str]:
    return ["synth", "trace-store", f"p={pair}", "--out", str(out)] + (
        "-T 12 -L 4 -K 2 -R 16 --docs 6 --record full".split()
    )


def test_disk_full_while_writing_a_store_then_resume(tmp_path, capsys, monkeypatch):
    """A write fault (ENOSPC) in the middle of the run: one line, exit 1; the rerun resumes
    and the store equals an uninterrupted one."""
    from kvcouple.store.writer import TraceStoreWriter

    pair = tmp_path / "p.npz"
    synth.save_pair(synth.random_pair(5, 3, seed=4), pair)
    ref, out = tmp_path / "ref.zarr", tmp_path / "out.zarr"
    assert _cli(_trace_store_argv(pair, ref), capsys)[0] == 0

    original = TraceStoreWriter.write_doc

    def failing(self, doc, arrays):
        if doc == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path / "hazard"))
        return original(self, doc, arrays)

    monkeypatch.setattr(TraceStoreWriter, "write_doc", failing)
    code, _, err = _cli(_trace_store_argv(pair, out), capsys)
    assert code == 1
    assert err.count("error:") == 1 and "no space left" in err and "rerun" in err
    monkeypatch.setattr(TraceStoreWriter, "write_doc", original)
    assert _cli(_trace_store_argv(pair, out), capsys)[0] == 0
    a, b = _store_arrays(ref), _store_arrays(out)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def _tmpfs(path: Path, size: str) -> bool:
    path.mkdir(exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
    )
    return res.returncode == 0


@pytest.mark.slow
def test_real_disk_full_then_resume(tmp_path, capsys):
    """A real full file system (a small tmpfs; needs root, skipped elsewhere)."""
    disk = tmp_path / "disk"
    if not _tmpfs(disk, "600k"):
        pytest.skip("cannot mount a tmpfs here (not root)")
    try:
        pair = tmp_path / "p.npz"
        synth.save_pair(synth.random_pair(5, 3, seed=4), pair)
        ref, out = tmp_path / "ref.zarr", disk / "out.zarr"
        assert _cli(_trace_store_argv(pair, ref), capsys)[0] == 0
        code, _, err = _cli(_trace_store_argv(pair, out), capsys)
        assert code == 1, err
        assert err.count("error:") == 1 and "no space left" in err
        # The analysis report on a full disk: the same one-line message.
        code, _, err = _cli(
            ["analyze", str(ref), "--out", str(disk / "report"), "--n-boot", "20"], capsys
        )
        assert code == 1 and "no space left" in err
        shutil.rmtree(disk / "report", ignore_errors=True)
        subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
        assert _cli(_trace_store_argv(pair, out), capsys)[0] == 0
        a, b = _store_arrays(ref), _store_arrays(out)
        for k in a:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)
