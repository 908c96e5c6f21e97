"""The real model's cache is shared by processes running side by side (the suite's workers, a
notebook's kernel): one fetches and converts, the others wait and find the folder converted.
The download and the conversion are stood in for here; the lock is the real one."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

from kvcouple.testing import real_model


def _stand_ins(monkeypatch, calls: list[str]) -> None:
    def fetch(folder: Path, timeout: float) -> Path:
        calls.append("fetch")
        gguf = folder / "smollm2" / real_model.SMOLLM2_GGUF
        gguf.parent.mkdir(parents=True, exist_ok=True)
        gguf.touch()
        return gguf

    def convert(gguf: Path, out: Path) -> Path:
        calls.append("convert")
        time.sleep(0.5)  # long enough for the other caller to arrive while this one works
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"")
        return out

    monkeypatch.setattr(real_model, "_fetch", fetch)
    monkeypatch.setattr(real_model, "convert_gguf", convert)


def test_two_callers_on_a_cold_cache_convert_once(tmp_path, monkeypatch):
    calls: list[str] = []
    _stand_ins(monkeypatch, calls)
    got: list[Path] = []
    callers = [
        threading.Thread(target=lambda: got.append(real_model.smollm2_folder(tmp_path)))
        for _ in range(2)
    ]
    for c in callers:
        c.start()
    for c in callers:
        c.join(timeout=30)
    assert got == [tmp_path / "smollm2" / "hf"] * 2
    assert calls.count("convert") == 1, calls  # the second found the first one's folder
    assert calls.count("fetch") == 2


def test_a_held_cache_keeps_another_process_waiting(tmp_path):
    code = (
        "import sys, time; from pathlib import Path; from kvcouple.testing import real_model\n"
        "with real_model.cache_lock(Path(sys.argv[1])): print(time.time(), flush=True)"
    )
    with real_model.cache_lock(tmp_path):
        child = subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True
        )
        time.sleep(2.0)  # the child has started and is waiting for the lock
        assert child.poll() is None, "the child took a lock another process holds"
        released = time.time()
    out, _ = child.communicate(timeout=60)
    assert child.returncode == 0
    assert float(out) >= released
