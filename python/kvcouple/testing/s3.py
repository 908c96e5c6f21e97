"""A real S3-compatible server on 127.0.0.1 for tests and benchmarks (moto in server mode).

Stores on object storage are read through zarr-python's fsspec layer (s3fs), which takes the
endpoint and credentials from the standard AWS environment variables; :func:`local_s3` sets
them for the server it starts and restores them afterwards.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

ENV = {
    "AWS_ACCESS_KEY_ID": "kvcouple",
    "AWS_SECRET_ACCESS_KEY": "kvcouple",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class ServerUnavailable(RuntimeError):
    """The local S3 server could not be started (moto or s3fs missing, no free port)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def local_s3(bucket: str = "kvcouple", timeout: float = 30.0) -> Iterator[str]:
    """Start ``moto`` in server mode on a free port, create ``bucket``, point the AWS
    environment at it, and yield ``s3://bucket``. Raises :class:`ServerUnavailable`."""
    try:
        import moto.server  # noqa: F401
        import s3fs
    except ImportError as e:
        raise ServerUnavailable(f"needs moto[server] and s3fs ({e})") from e
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    saved = {k: os.environ.get(k) for k in (*ENV, "AWS_ENDPOINT_URL")}
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                urllib.request.urlopen(f"{url}/moto-api/", timeout=1)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise ServerUnavailable(f"moto server did not start on {url}") from None
                time.sleep(0.2)
        os.environ.update(ENV)
        os.environ["AWS_ENDPOINT_URL"] = url
        s3fs.S3FileSystem.clear_instance_cache()
        s3fs.S3FileSystem().mkdir(bucket)
        yield f"s3://{bucket}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        # s3fs caches its clients by arguments: one made here must not outlive the server.
        s3fs.S3FileSystem.clear_instance_cache()
