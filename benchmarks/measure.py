"""What the benchmarks measure of their own process: peak resident memory, CPU seconds and the
best wall time of a call."""

from __future__ import annotations

import resource
import time
from collections.abc import Callable


def peak_rss_mb() -> float:
    """Peak resident memory of this process image (VmHWM: ru_maxrss would carry over the
    parent's peak across fork and exec)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def best_seconds(fn: Callable[[], object], repeats: int = 5) -> float:
    """The fastest of ``repeats`` wall times of ``fn()``."""
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best
