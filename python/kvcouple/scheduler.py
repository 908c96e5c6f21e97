"""Reaching a Dask scheduler: shared by ``kvcouple analyze --scheduler`` and ``kvcouple trace
--scheduler`` (an address that cannot be reached fails in seconds, in one line)."""

from __future__ import annotations

import socket
from typing import Any
from urllib.parse import urlsplit

from kvcouple.errors import InvalidInputError, require

CONNECT_TIMEOUT = 5  # seconds to reach a Dask scheduler (distributed's default is 30)


def check_scheduler(scheduler: Any) -> None:
    """A ``tcp://host:port`` address must accept a connection within a few seconds."""
    if not isinstance(scheduler, str) or not scheduler:
        raise InvalidInputError(
            f"scheduler must be an address such as tcp://host:8786, got {scheduler!r}"
        )
    parts = urlsplit(scheduler if "://" in scheduler else f"tcp://{scheduler}")
    if parts.scheme not in ("tcp", "tls"):
        return  # other transports (inproc, ucx): let distributed judge
    try:
        host, port = parts.hostname, parts.port
    except ValueError as e:
        raise InvalidInputError(f"scheduler = {scheduler!r}: {e}") from None
    if not host or port is None:
        raise InvalidInputError(
            f"scheduler = {scheduler!r} needs a host and a port (tcp://host:8786)"
        )
    try:
        socket.create_connection((host, port), timeout=CONNECT_TIMEOUT).close()
    except OSError as e:
        raise InvalidInputError(
            f"scheduler = {scheduler!r} is not reachable ({e.strerror or e})"
        ) from None


def connect_client(client: Any, scheduler: str | None) -> tuple[Any, bool]:
    """The Dask client to run on and whether it was opened here (and must be closed): ``client``
    itself, one connected to ``scheduler``, or None (run locally)."""
    if client is not None:
        return client, False
    if scheduler is None:
        return None, False
    require("distributed", "--scheduler")
    from distributed import Client

    try:
        return Client(scheduler, timeout=CONNECT_TIMEOUT), True
    except (OSError, TimeoutError) as e:
        raise InvalidInputError(f"scheduler = {scheduler!r}: cannot connect ({e})") from None
    except (MemoryError, ValueError, TypeError, EOFError) as e:
        # Something else listens there (an HTTP proxy, say): its reply read as Dask's frame
        # header can be a length of exabytes.
        raise InvalidInputError(
            f"scheduler = {scheduler!r} accepts connections but does not answer as a Dask "
            f"scheduler ({type(e).__name__}: {str(e)[:120]})"
        ) from None
