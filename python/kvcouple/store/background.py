"""Writing a store behind the tracer: a thread, a bounded queue, back-pressure.

:class:`BackgroundWriter` takes a document's records (``write_doc``, the same call as
:class:`~kvcouple.store.writer.TraceStoreWriter`) into a queue of at most ``max_pending``
documents and returns; one thread writes them in order, each through ``TraceStoreWriter.
write_doc`` (every variable, then the ``completed`` flag last), so the next document batch traces
while the last one is compressed and written. With zarr-python 3 a variable's chunks are
compressed concurrently on every core (its codec pipeline runs Zstd in threads, which release
the GIL). A full queue blocks the caller until a document is written (back-pressure): records
held on the host are bounded by :func:`host_record_bytes`.

A process killed during a background write leaves that document without its ``completed``
flag, and a resumed run writes it again: the store equals an uninterrupted run's, as with the
synchronous writer. An error in the thread (a full disk) is raised, as it was, by the next
``write_doc`` or by :meth:`BackgroundWriter.close`; documents queued after it are not written.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Protocol

import numpy as np

from kvcouple.store.create import StoreLayout
from kvcouple.store.schema import variables
from kvcouple.store.writer import TraceStoreWriter

__all__ = [
    "BackgroundWriter",
    "DocumentWriter",
    "WriterStats",
    "document_bytes",
    "format_host",
    "host_record_bytes",
    "queue_bound",
]


class DocumentWriter(Protocol):
    """What the tracer writes a document through: a store writer, or one behind a queue."""

    def write_doc(self, doc: int, arrays: dict[str, np.ndarray]) -> None: ...


def document_bytes(layout: StoreLayout) -> int:
    """Bytes of one document's records as the tracer holds them (the stored dtypes)."""
    sizes = layout.sizes()
    total = 0
    for name, (dims, dtype, _) in variables(layout.record).items():
        if name == "completed":
            continue
        total += math.prod(sizes[d] for d in dims[1:]) * np.dtype(dtype).itemsize
    return total


def host_record_bytes(layout: StoreLayout, doc_batch: int, max_pending: int) -> int:
    """The most host memory records take while tracing with a :class:`BackgroundWriter`:
    the batch being traced (``doc_batch`` documents), the queue (``max_pending``) and the
    document being written, plus one document's worth for the encoder's chunk copies and
    compressed buffers."""
    return document_bytes(layout) * (doc_batch + max_pending + 2)


@dataclass
class WriterStats:
    """The writer's own counters (seconds from ``time.perf_counter``).

    Attributes
    ----------
    documents : int
        Documents written.
    bytes : int
        Bytes of records written (before compression).
    write_seconds : float
        Time the thread spent writing.
    blocked_seconds : float
        Time callers waited in ``write_doc`` for room in the queue (back-pressure).
    drain_seconds : float
        Time :meth:`BackgroundWriter.close` waited for the queue to empty.
    overlap_seconds : float
        Writing time during which no caller was waiting on the writer (tracing went on).
    peak_pending : int
        Most documents queued or being written at once.
    peak_bytes : int
        Most bytes of records queued or being written at once.
    """

    documents: int = 0
    bytes: int = 0
    write_seconds: float = 0.0
    blocked_seconds: float = 0.0
    drain_seconds: float = 0.0
    overlap_seconds: float = 0.0
    peak_pending: int = 0
    peak_bytes: int = 0
    # Intervals (start, end) of writes and of waits, to compute the overlap at close.
    _writes: list[tuple[float, float]] = field(default_factory=list, repr=False)
    _waits: list[tuple[float, float]] = field(default_factory=list, repr=False)

    def blocked_fraction(self, run_seconds: float) -> float:
        """Share of a run of ``run_seconds`` spent waiting on the writer (queue full or
        draining at the end)."""
        return (self.blocked_seconds + self.drain_seconds) / run_seconds if run_seconds else 0.0

    def format(self, run_seconds: float) -> str:
        return (
            f"writer: {self.documents} documents, {self.bytes / 2**20:.1f} MiB in "
            f"{self.write_seconds:.2f} s; blocked {self.blocked_seconds:.2f} s (queue full) + "
            f"{self.drain_seconds:.2f} s (final drain) = "
            f"{100 * self.blocked_fraction(run_seconds):.1f}% of {run_seconds:.2f} s; "
            f"overlapped {self.overlap_seconds:.2f} s; peak {self.peak_pending} documents "
            f"({self.peak_bytes / 2**20:.1f} MiB) queued or writing"
        )


def _overlap(writes: list[tuple[float, float]], waits: list[tuple[float, float]]) -> float:
    """Total length of ``writes`` not covered by ``waits`` (both sorted, waits disjoint)."""
    total = 0.0
    for start, end in writes:
        covered = sum(max(0.0, min(end, b) - max(start, a)) for a, b in waits)
        total += max(0.0, end - start - covered)
    return total


_STOP = None


class BackgroundWriter:
    """A :class:`TraceStoreWriter` behind a bounded queue and one writing thread.

    Parameters
    ----------
    writer : TraceStoreWriter
        The store's writer (opened: created or resumed).
    max_pending : int, default 1
        Documents queued at most (>= 1); a ``write_doc`` that finds the queue full waits.

    Use it as a context manager: leaving the block writes what is queued (also after an
    error in the block: those records are whole) and raises the thread's error, if any.
    """

    def __init__(self, writer: TraceStoreWriter, max_pending: int = 1):
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.writer = writer
        self.max_pending = max_pending
        self.stats = WriterStats()
        self._queue: queue.Queue[tuple[int, dict[str, np.ndarray], int] | None] = queue.Queue(
            max_pending
        )
        self._lock = threading.Lock()
        self._pending = 0  # documents queued or being written
        self._pending_bytes = 0
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvcouple-store-writer", daemon=True)
        self._thread.start()

    def __enter__(self) -> BackgroundWriter:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if error is None:
            self.close()
            return
        try:
            self.close()
        except Exception:  # the block's own error is the one to report
            pass

    def write_doc(self, doc: int, arrays: Mapping[str, np.ndarray]) -> None:
        """Queue one document's records (the arrays must not change afterwards); waits while
        the queue is full. Raises the thread's error if an earlier write failed."""
        self._raise()
        if self._closed:
            raise RuntimeError("write_doc on a closed BackgroundWriter")
        size = sum(np.asarray(a).nbytes for a in arrays.values())
        item = (doc, dict(arrays), size)
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            start = time.perf_counter()
            while True:  # wake up now and then: a failed thread stops writing
                try:
                    self._queue.put(item, timeout=0.5)
                    break
                except queue.Full:
                    if self._error is not None:
                        break
            end = time.perf_counter()
            self.stats.blocked_seconds += end - start
            self.stats._waits.append((start, end))
            self._raise()
        # Counted once queued (the thread uncounts it once written): at most max_pending
        # queued plus the one being written.
        with self._lock:
            self._pending += 1
            self._pending_bytes += size
            self.stats.peak_pending = max(self.stats.peak_pending, self._pending)
            self.stats.peak_bytes = max(self.stats.peak_bytes, self._pending_bytes)

    def close(self) -> WriterStats:
        """Write what is queued, stop the thread and return the counters; raises the
        thread's error, if any. Closing twice is harmless."""
        if not self._closed:
            self._closed = True
            start = time.perf_counter()
            self._queue.put(_STOP)
            self._thread.join()
            end = time.perf_counter()
            self.stats.drain_seconds += end - start
            self.stats._waits.append((start, end))
            self.stats.overlap_seconds = _overlap(self.stats._writes, self.stats._waits)
        self._raise()
        return self.stats

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                self._flush()
                return
            if self._error is not None:
                continue  # after a failure: drop the rest (nothing half-marked completed)
            doc, arrays, size = item
            start = time.perf_counter()
            try:
                self.writer.write_doc(doc, arrays)
            except BaseException as e:  # raised in the caller's thread, as it was
                self._error = e
            end = time.perf_counter()
            del arrays, item
            with self._lock:
                self._pending -= 1
                self._pending_bytes -= size
                if self._error is None:
                    self.stats.documents += 1
                    self.stats.bytes += size
                self.stats.write_seconds += end - start
                self.stats._writes.append((start, end))

    def _flush(self) -> None:
        """Write the shards the store writer still holds (sharded stores; also after a
        failed write: the documents held before it are whole)."""
        flush = getattr(self.writer, "flush", None)
        if flush is None:
            return
        start = time.perf_counter()
        try:
            flush()
        except BaseException as e:
            if self._error is None:
                self._error = e
        end = time.perf_counter()
        with self._lock:
            self.stats.write_seconds += end - start
            self.stats._writes.append((start, end))


def queue_bound(batch_sizes: list[int]) -> int:
    """Documents a run queues at most: its largest batch, so a whole batch is handed over
    while the next one traces."""
    return max(batch_sizes, default=1) or 1


def format_host(layout: StoreLayout, batch_sizes: list[int]) -> str:
    """The host-memory line of a run's plan: records held while tracing and writing."""
    batch = max(batch_sizes, default=1) or 1
    per_doc = document_bytes(layout)
    total = host_record_bytes(layout, batch, queue_bound(batch_sizes))
    return (
        f"host memory for records: {total / 2**20:.1f} MiB at most ({per_doc / 2**20:.1f} MiB "
        f"a document; {batch} tracing, {queue_bound(batch_sizes)} queued, 1 writing, "
        "1 for the encoder)"
    )
