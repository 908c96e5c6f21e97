"""Host resources: refuse an allocation before making it when it cannot fit in memory.

Used wherever a command builds a large array in one piece (the synthetic estimators and
store writer, the analysis), so that it fails with one clear :class:`ResourceLimitError`
instead of being killed by the kernel's out-of-memory handler.
"""

from __future__ import annotations

import os

from kvcouple.errors import ResourceLimitError

__all__ = ["available_memory", "check_memory"]


def check_memory(what: str, nbytes: int, fraction: float = 0.8) -> None:
    """Refuse an allocation of ``nbytes`` that would not fit in the memory available now."""
    avail = available_memory()
    if avail is not None and nbytes > fraction * avail:
        raise ResourceLimitError(
            f"{what} needs {nbytes / 1e9:.3g} GB but only {avail / 1e9:.3g} GB of memory is "
            f"available; ask for less"
        )


def available_memory() -> int | None:
    """Bytes of memory available to this process now (Linux MemAvailable, else sysconf)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None
