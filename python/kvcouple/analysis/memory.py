"""How an analysis's memory is backed: numpy's huge-page advice off while it runs.

numpy advises the kernel to back every array of 4 MB or more with 2 MB pages. An analysis's
batches allocate and free such arrays by the thousand, and with the kernel's usual settings
(``transparent_hugepage`` and its ``defrag`` on ``madvise``) every page given back and touched
again is zeroed 2 MB at a time, or waits for the kernel to compact memory into a free 2 MB
page: with a page cache full of store data, seconds. At 100k documents, about 0.7 CPU-seconds
of page zeroing and 1-3 s of stalls in some runs. Only the speed changes, never a number.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, cast

import numpy as np

# numpy's switch (numpy 1.x: numpy.core); absent: nothing to switch.
_CORE = getattr(np, "_core", None) or getattr(np, "core", None)
_SWITCH: Callable[[bool], bool] | None = getattr(
    getattr(_CORE, "multiarray", None), "_set_madvise_hugepage", None
)
# The user's own choice, which is kept.
HUGEPAGE_ENV = "NUMPY_MADVISE_HUGEPAGE"

_lock = threading.Lock()
_depth = 0  # analyses running with the advice off
_before = False  # the setting the first of them found

F = TypeVar("F", bound=Callable[..., Any])


@contextlib.contextmanager
def small_pages() -> Iterator[None]:
    """numpy's huge-page advice off inside, unless the user set ``NUMPY_MADVISE_HUGEPAGE``;
    the setting the first of any concurrent callers found is restored when the last leaves."""
    global _depth, _before
    if _SWITCH is None or HUGEPAGE_ENV in os.environ:
        yield
        return
    with _lock:
        if _depth == 0:
            _before = _SWITCH(False)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                _SWITCH(_before)


def on_small_pages(fn: F) -> F:
    """``fn`` run inside :func:`small_pages`."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with small_pages():
            return fn(*args, **kwargs)

    return cast(F, run)
