"""One writer at a time: the writer lock of a trace store, and what readers say about it.

A run that writes a store (``kvcouple trace``, its Dask client, ``kvcouple synth
trace-store``) holds a lock on the part it writes: the whole store, or ``shard-i-of-N`` for
``--shard i/N``. The lock is a small JSON file inside the store, ``.kvcouple-lock/<part>.json``
(a hidden folder that no Zarr reader takes for an array or a group), naming the process, its
host, when it started and its command. It is created atomically (written aside, then
hard-linked into place, which fails if the file exists; on object storage a conditional
write, ``If-None-Match: *``), and removed when the run ends, also by an exception.

A second writer of the same part, or of a part sharing documents with it (the whole store and
any shard; ``--shard 0/2`` and ``--shard 0/4``), is refused with :class:`StoreLockError`
naming the first. A lock whose process is gone is *stale* and the next run takes it over, so
kill -9 and a rerun keep working: on the same host, the process is gone when no process has
its id, or the one that has it started at another time (a reused id; Linux records the
start in ``/proc/<pid>/stat``), or the machine was restarted since (Linux's boot id). A lock
held on another host cannot be checked from here: it is treated as live, and the refusal
says which file to delete once that process is known to be gone.

Readers (``kvcouple analyze``, ``kvcouple info``) call :func:`writers` to say "being written
by ..." of an unfinished store instead of "the run was interrupted".
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shlex
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from kvcouple.errors import StoreError
from kvcouple.store.geometry import is_url
from kvcouple.store.parts import parts_overlap

LOCK_DIR = ".kvcouple-lock"
LOCK_FORMAT = "kvcouple writer lock 1"

Status = Literal["live", "stale", "elsewhere"]


class StoreLockError(StoreError):
    """Another live process writes the same part of the store (or a part sharing documents)."""


class StoreBeingWrittenError(StoreError):
    """Reading an unfinished store that a live writer holds: wait for it (not interrupted)."""


def part_name(index: int, count: int) -> str:
    """The part a writer of ``--shard index/count`` writes: ``all`` for the whole store."""
    return "all" if count == 1 else f"shard-{index}-of-{count}"


def _host() -> str:
    return socket.gethostname()


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _process_start(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (Linux), or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces: split after it.
    fields = stat.rpartition(")")[2].split()
    try:
        return int(fields[19])  # field 22, starttime
    except (IndexError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    except OSError:
        return False
    return True


@dataclass(frozen=True)
class WriterLock:
    """A lock file's content: who writes which part of the store.

    Attributes
    ----------
    part : str
        ``all`` or ``shard-i-of-N``.
    shard : tuple of int
        ``(i, N)``; ``(0, 1)`` for the whole store.
    pid : int
        The writing process.
    host : str
        The host it runs on.
    started : str
        When it took the lock (UTC, ISO 8601).
    command : str
        Its command line.
    process_start : int or None
        The process's start time in clock ticks since boot (Linux): tells a reused process id.
    boot_id : str or None
        The host's boot id (Linux): a lock from before a restart is stale.
    """

    part: str
    shard: tuple[int, int]
    pid: int
    host: str
    started: str
    command: str
    process_start: int | None = None
    boot_id: str | None = None

    @classmethod
    def mine(cls, shard: tuple[int, int]) -> WriterLock:
        pid = os.getpid()
        return cls(
            part=part_name(*shard),
            shard=(int(shard[0]), int(shard[1])),
            pid=pid,
            host=_host(),
            started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            command=shlex.join(sys.argv)[:500],
            process_start=_process_start(pid),
            boot_id=_boot_id(),
        )

    def to_json(self) -> bytes:
        body = {"format": LOCK_FORMAT, **self.__dict__, "shard": list(self.shard)}
        return json.dumps(body, indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, part: str) -> WriterLock:
        """A lock file's content; an unreadable one (cut short) names nobody alive."""
        try:
            body = json.loads(data)
            return cls(
                part=str(body["part"]),
                shard=(int(body["shard"][0]), int(body["shard"][1])),
                pid=int(body["pid"]),
                host=str(body["host"]),
                started=str(body["started"]),
                command=str(body.get("command", "")),
                process_start=body.get("process_start"),
                boot_id=body.get("boot_id"),
            )
        except (ValueError, KeyError, TypeError, IndexError):
            return cls(part, (0, 1), -1, _host(), "?", "(an unreadable lock file)")

    def status(self) -> Status:
        """``live`` (its process runs), ``stale`` (it is gone) or ``elsewhere`` (held on
        another host: cannot be checked from here)."""
        if self.host != _host():
            return "elsewhere"
        if self.pid < 0:
            return "stale"
        mine = _boot_id()
        if self.boot_id and mine and self.boot_id != mine:
            return "stale"  # the host restarted since
        if not _alive(self.pid):
            return "stale"
        now = _process_start(self.pid)
        if self.process_start is not None and now is not None and now != self.process_start:
            return "stale"  # another process has its id now
        return "live"

    def describe(self) -> str:
        """``process 123 on host h (since 2026-...Z: kvcouple trace ...)``."""
        what = f"process {self.pid} on host {self.host} (since {self.started}"
        return what + (f": {self.command})" if self.command else ")")


class _Files:
    """The lock folder of a store, local or on object storage (fsspec)."""

    def __init__(self, store: str | os.PathLike[str], storage_options: dict[str, Any] | None):
        self.store = str(store)
        self.remote = is_url(self.store)
        if self.remote:
            import fsspec

            self.fs, root = fsspec.core.url_to_fs(self.store, **(storage_options or {}))
            self.dir = f"{root.rstrip('/')}/{LOCK_DIR}"
        else:
            self.dir = str(Path(self.store) / LOCK_DIR)

    def path(self, part: str) -> str:
        return f"{self.dir}/{part}.json"

    def shown(self, part: str) -> str:
        """The lock file as the user names it (with the URL's scheme on object storage)."""
        return f"{self.store.rstrip('/')}/{LOCK_DIR}/{part}.json"

    def create(self, part: str, data: bytes) -> bool:
        """Write the lock file unless it exists: atomic. False if it exists."""
        path = self.path(part)
        if self.remote:
            try:
                self.fs.pipe_file(path, data, mode="create")  # If-None-Match: * on S3
            except FileExistsError:
                return False
            except (TypeError, NotImplementedError):  # no exclusive writes (docs/store.md)
                self.fs.invalidate_cache()
                if self.fs.exists(path):
                    return False
                self.fs.pipe_file(path, data)
            return True
        tmp = f"{self.dir}/.{part}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        for attempt in range(3):  # the folder goes when its last lock does: make it again
            os.makedirs(self.dir, exist_ok=True)
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
                break
            except FileNotFoundError:
                if attempt == 2:
                    raise
        try:
            os.link(tmp, path)  # fails if the lock exists; the file appears whole
            return True
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)

    def read(self, part: str) -> bytes | None:
        try:
            if self.remote:
                self.fs.invalidate_cache()
                return bytes(self.fs.cat_file(self.path(part)))
            return Path(self.path(part)).read_bytes()
        except FileNotFoundError:
            return None

    def remove(self, part: str, expected: bytes) -> bool:
        """Remove the lock file if it still holds ``expected``; True if removed (or gone)."""
        if self.remote:
            if self.read(part) not in (expected, None):
                return False
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(self.path(part))
            return True
        # Moved aside first: of two processes taking over one stale lock, one moves it.
        aside = f"{self.path(part)}.{os.getpid()}.{secrets.token_hex(4)}.old"
        try:
            os.rename(self.path(part), aside)
        except FileNotFoundError:
            return True
        moved = Path(aside).read_bytes()
        if moved != expected:  # someone else's fresh lock: put it back
            with contextlib.suppress(FileExistsError):
                os.link(aside, self.path(part))
            os.unlink(aside)
            return False
        os.unlink(aside)
        with contextlib.suppress(OSError):
            os.rmdir(self.dir)  # only once empty
        return True

    def parts(self) -> list[str]:
        try:
            if self.remote:
                self.fs.invalidate_cache()
                names = [str(p).rsplit("/", 1)[-1] for p in self.fs.ls(self.dir, detail=False)]
            else:
                names = os.listdir(self.dir)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(n[: -len(".json")] for n in names if n.endswith(".json"))


def writers(
    store: str | os.PathLike[str], storage_options: dict[str, Any] | None = None
) -> list[tuple[WriterLock, Status]]:
    """Every lock in ``store`` with its status (``live``, ``stale``, ``elsewhere``)."""
    try:
        files = _Files(store, storage_options)
        found = []
        for part in files.parts():
            data = files.read(part)
            if data is not None:
                lock = WriterLock.from_json(data, part)
                found.append((lock, lock.status()))
        return found
    except (OSError, ImportError):  # a reader says what it can: no lock is not an error
        return []


def writing_note(
    store: str | os.PathLike[str], storage_options: dict[str, Any] | None = None
) -> str | None:
    """What a reader says of an unfinished store's writers: ``being written by ...`` where a
    writer holds a lock (or may: on another host), None where none does (interrupted)."""
    held = [(lock, s) for lock, s in writers(store, storage_options) if s != "stale"]
    if not held:
        return None
    parts = []
    for lock, status in held:
        where = "" if lock.part == "all" else f" ({lock.part})"
        text = f"being written by {lock.describe()}{where}"
        if status == "elsewhere":
            text += (
                " on another host, so it cannot be checked from here; if that process is gone, "
                f"the run was interrupted: delete {_Files(store, storage_options).shown(lock.part)}"
                " and rerun the same trace command"
            )
        parts.append(text)
    return "; ".join(parts)


def _refusal(files: _Files, store: str, part: str, lock: WriterLock, status: Status) -> str:
    text = f"{store} is being written by {lock.describe()}"
    text += "" if lock.part == "all" else f", which writes {lock.part}"
    if status == "elsewhere":
        return (
            f"{text}; it runs on another host, so this one cannot tell whether it still runs. "
            f"Wait for it to finish; if it is gone (killed, its machine lost), delete "
            f"{files.shown(lock.part)} and rerun."
        )
    mine = (
        f"this run's part, {part}"
        if lock.part == part
        else f"documents of this run's part, {part}, too"
    )
    return f"{text} ({mine}). Wait for it to finish, or stop it and rerun this command."


def acquire(
    store: str | os.PathLike[str],
    shard: tuple[int, int],
    n_docs: int,
    storage_options: dict[str, Any] | None = None,
    docs_per_shard: int = 1,
) -> tuple[_Files, WriterLock, bytes]:
    """Take the lock on ``shard`` of ``store`` (which exists), taking over stale locks.
    Raises :class:`StoreLockError` naming a live writer of any overlapping part (parts as
    :mod:`kvcouple.store.parts` assigns documents, ``docs_per_shard`` to a stored object)."""
    files = _Files(store, storage_options)
    shown = str(store)
    mine = WriterLock.mine(shard)
    data = mine.to_json()
    for _ in range(5):  # a takeover raced by another run: look again
        if files.create(mine.part, data):
            break
        held = files.read(mine.part)
        if held is None:
            continue
        other = WriterLock.from_json(held, mine.part)
        status = other.status()
        if status != "stale":
            raise StoreLockError(_refusal(files, shown, mine.part, other, status))
        files.remove(mine.part, held)  # stale: taken over
    else:
        raise StoreLockError(f"{shown}: cannot take the writer lock {files.shown(mine.part)}")
    # Other parts that share documents with this one.
    for part in files.parts():
        if part == mine.part:
            continue
        held = files.read(part)
        if held is None:
            continue
        other = WriterLock.from_json(held, part)
        if not parts_overlap(other.shard, mine.shard, n_docs, docs_per_shard):
            continue
        status = other.status()
        if status == "stale":
            files.remove(part, held)
            continue
        files.remove(mine.part, data)
        raise StoreLockError(_refusal(files, shown, mine.part, other, status))
    return files, mine, data


@contextlib.contextmanager
def writer_lock(
    store: str | os.PathLike[str],
    shard: tuple[int, int],
    n_docs: int,
    storage_options: dict[str, Any] | None = None,
    docs_per_shard: int = 1,
) -> Iterator[WriterLock]:
    """Hold the writer lock of ``shard`` (``(i, N)``; ``(0, 1)``: the whole store) of
    ``store`` while the block runs; released on leaving it, also by an exception.

    Raises
    ------
    StoreLockError
        A live process (or one on another host) writes the same part, or a part sharing
        documents with it; the message names it and what to do.
    """
    files, mine, data = acquire(store, shard, n_docs, storage_options, docs_per_shard)
    try:
        yield mine
    finally:
        with contextlib.suppress(OSError):
            files.remove(mine.part, data)


def visible(store: str | os.PathLike[str]) -> bool:
    """Whether this process sees ``store`` (a URL, or a local folder holding a Zarr group):
    a Dask client whose workers share a folder it lacks takes no lock (docs/store.md)."""
    if is_url(str(store)):
        return True
    return any((Path(store) / m).exists() for m in ("zarr.json", ".zgroup"))
