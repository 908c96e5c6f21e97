"""Reading a trace store on object storage: who fetches its objects, and how.

:class:`ObjectStorageReads` is the part of :class:`kvcouple.store.reader.TraceStoreReader`
that fetches chunk objects from ``s3://`` (and other fsspec URLs) for the Rust engine's reads
(:mod:`kvcouple.store.engine_reads`): windows of distribution chunks, fetched ahead; the small
per-document variables in batches, decoded from memory.

The engine fetches an ``s3://`` store's objects itself (``kvcouple._core.ObjectFetcher``:
object_store, many requests in flight, the GIL released) when every setting it needs is
given explicitly, in ``storage_options`` or the standard AWS environment variables:

- credentials (``key``/``secret``, or ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``), or
  anonymous access (``anon=True``);
- an endpoint (``endpoint_url``, ``client_kwargs={"endpoint_url": ...}``,
  ``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL``) or a region (``client_kwargs={"region_name":
  ...}``, ``AWS_REGION``/``AWS_DEFAULT_REGION``).

Anything else (profiles in ``~/.aws``, SSO, instance roles, a storage option only fsspec
knows, ``gs://``, ``az://``) is read through fsspec, whose credential chain is botocore's: the
same bytes, more slowly. :func:`engine_settings` says which, and why.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np

from kvcouple.errors import StoreError
from kvcouple.store.geometry import StoreGeometry, is_url

# Documents whose small per-document objects (the summary variables) are fetched at once.
SUMMARY_AHEAD = 16

# Guards the per-process state its threads share (read-ahead, the client, counters).
_STATE_LOCK = threading.Lock()


# fsspec (s3fs) storage options the engine's client understands; any other is fsspec's alone.
_UNDERSTOOD = {"key", "secret", "token", "anon", "endpoint_url", "client_kwargs"}
_CLIENT_KWARGS = {"endpoint_url", "region_name"}


def _first(environ: Mapping[str, str], *names: str) -> str | None:
    for n in names:
        if environ.get(n):
            return environ[n]
    return None


def engine_settings(
    url: str, storage_options: Mapping[str, Any], environ: Mapping[str, str] | None = None
) -> tuple[list[tuple[str, str]] | None, str]:
    """``(settings, why)``: object_store's S3 settings for the engine's own client, or None
    (read through fsspec) with the reason. Options override the environment, as in s3fs."""
    env = os.environ if environ is None else environ
    if not url.startswith("s3://"):
        return None, f"{url.split('://')[0]}:// is read through fsspec"
    unknown = sorted(set(storage_options) - _UNDERSTOOD)
    client = dict(storage_options.get("client_kwargs") or {})
    unknown += sorted(f"client_kwargs.{k}" for k in set(client) - _CLIENT_KWARGS)
    if unknown:
        return None, f"storage option {unknown[0]!r} is understood by fsspec only"
    endpoint = (
        storage_options.get("endpoint_url")
        or client.get("endpoint_url")
        or _first(env, "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
    )
    region = client.get("region_name") or _first(env, "AWS_REGION", "AWS_DEFAULT_REGION")
    if not endpoint and not region:
        return None, "no endpoint or region is set (botocore would look the region up)"
    settings: list[tuple[str, str]] = []
    if endpoint:
        settings.append(("aws_endpoint_url", str(endpoint)))
        if str(endpoint).startswith("http://"):
            settings.append(("aws_allow_http", "true"))
    # object_store signs for us-east-1 when no region is given, as S3-compatible servers expect.
    settings.append(("aws_region", str(region or "us-east-1")))
    if storage_options.get("anon"):
        return settings + [("aws_skip_signature", "true")], "anonymous"
    key = storage_options.get("key") or env.get("AWS_ACCESS_KEY_ID")
    secret = storage_options.get("secret") or env.get("AWS_SECRET_ACCESS_KEY")
    if not key or not secret:
        return None, "no explicit credentials (botocore's chain finds profiles and roles)"
    settings += [("aws_access_key_id", str(key)), ("aws_secret_access_key", str(secret))]
    token = storage_options.get("token") or (
        env.get("AWS_SESSION_TOKEN") if "key" not in storage_options else None
    )
    if token:
        settings.append(("aws_session_token", str(token)))
    return settings, "explicit credentials"


class EngineUse(Protocol):
    """Whether the Rust engine reads the store (:class:`kvcouple.store.engine_reads.
    EngineSwitch`): where it does not, its client fetches nothing either."""

    @property
    def off(self) -> bool: ...


class ObjectStorageReads:
    """Fetching a store's objects from object storage (its keys and grids from the
    :class:`~kvcouple.store.geometry.StoreGeometry`). The read-ahead, the client and the
    thread that fetches ahead belong to the process that made them: a pickled copy (a Dask
    worker's) makes its own."""

    def __init__(self, geometry: StoreGeometry, docs: int, engine: EngineUse):
        self.geometry = geometry
        self.path = geometry.path
        self.docs = docs  # documents in the store: the read-ahead stops at the last
        self.engine = engine
        # Fetched objects by key: (what fetches them, index in its result).
        self._ahead: dict[str, tuple[Future[list[bytes | None]], int]] = {}
        self._summary_ahead: dict[str, tuple[Future[list[bytes | None]], int]] = {}
        self._ahead_pool: ThreadPoolExecutor | None = None
        self._fetcher: Any = None
        self._fetcher_decided = False
        self._remote_reads: list[Any] = [0, 0, 0.0]

    def __getstate__(self) -> dict[str, Any]:
        process: dict[str, Any] = {
            "_ahead": {},
            "_summary_ahead": {},
            "_ahead_pool": None,
            "_fetcher": None,
        }
        return {**self.__dict__, **process, "_fetcher_decided": False}

    def summary_objects(
        self, names: tuple[str, ...], doc: int
    ) -> tuple[list[str], list[bytes | None]]:
        """The chunk objects of ``names[doc]``: their keys and bytes. They are small and one
        request each, so they are fetched for SUMMARY_AHEAD documents at once (the analysis
        reads documents in order, from several threads); each is taken once."""
        keys = self.geometry.doc_keys(names, doc)
        block: list[str] = []
        with _STATE_LOCK:
            pending = self._summary_ahead
            if any(k not in pending for k in keys):
                block = [k for k in keys if k not in pending]
                for d in range(doc + 1, min(doc + SUMMARY_AHEAD, self.docs)):
                    block += [k for k in self.geometry.doc_keys(names, d) if k not in pending]
                fut: Future[list[bytes | None]] = Future()
                pending.update({k: (fut, i) for i, k in enumerate(block)})
            found = [pending.pop(k) for k in keys]
        if block:  # fetched by this thread; another that needs them waits on the future
            try:
                fut.set_result(self.fetch_objects(block))
            except BaseException as e:
                fut.set_exception(e)
                raise
        return keys, [fut.result()[i] for fut, i in found]

    def block_keys(self, name: str, blocks: np.ndarray) -> list[str] | None:
        """The key of the one stored object holding each block of ``name`` (``blocks``:
        [block, axis, (start, stop)]); None if a block spans several objects."""
        geometry, grid = self.geometry, self.geometry.storage_grid(name)
        keys = []
        for b in blocks:
            sel = tuple(slice(int(lo), int(hi)) for lo, hi in b)
            cells = [c for c, _ in geometry.cells(name, sel, grid)]
            if len(cells) != 1:
                return None
            keys.append(geometry.chunk_key(name, cells[0]))
        return keys

    def read_ahead(self, p_name: str, q_name: str, blocks: np.ndarray, per: int) -> None:
        """Start fetching the first window of the same blocks of the next document (the
        analysis reads documents in order), so its round trips overlap this one's decoding.
        At most one window is fetched ahead; a key not asked for is dropped with it."""
        nxt = blocks[:per].copy()
        nxt[:, 0] += 1
        if nxt[0, 0, 1] > self.docs:
            return
        geometry = self.geometry
        pool = self._ahead_executor()
        want = []
        for name in (p_name, q_name):
            for b in nxt:
                sel = tuple(slice(int(lo), int(hi)) for lo, hi in b)
                cells = [c for c, _ in geometry.cells(name, sel, geometry.storage_grid(name))]
                want += [geometry.chunk_key(name, c) for c in cells]
        with _STATE_LOCK:
            ahead = self._ahead
            if len(ahead) > 4 * len(want):  # not taken: a reader that skips around
                ahead.clear()
            todo = [k for k in want if k not in ahead]
            if todo:
                fut = pool.submit(self.fetch_objects, todo)
                for i, k in enumerate(todo):
                    ahead[k] = (fut, i)

    def _ahead_executor(self) -> ThreadPoolExecutor:
        """The thread that fetches ahead on object storage (one per reader and process)."""
        with _STATE_LOCK:
            if self._ahead_pool is None:
                self._ahead_pool = ThreadPoolExecutor(max_workers=1)
            return self._ahead_pool

    def fetch_ahead(self, keys: list[str]) -> list[bytes | None]:
        """:meth:`fetch_objects`, taking the keys already fetched ahead from there."""
        with _STATE_LOCK:
            found = {k: self._ahead.pop(k) for k in keys if k in self._ahead}
        rest = [k for k in keys if k not in found]
        got = dict(zip(rest, self.fetch_objects(rest), strict=True)) if rest else {}
        for k, (fut, i) in found.items():
            got[k] = fut.result()[i]
        return [got[k] for k in keys]

    def fetch_objects(self, keys: list[str], *, count: bool = True) -> list[bytes | None]:
        """The stored objects ``keys`` (None where absent), fetched concurrently: by the Rust
        engine's own client where :func:`engine_settings` allows it, else through zarr's
        store (its credentials, endpoint and ``storage_options``). Counted in
        :attr:`remote_reads` unless ``count`` is false."""
        fetcher = self.object_fetcher()
        t = time.perf_counter()
        try:
            out = fetcher.fetch(keys) if fetcher is not None else self.fetch_with_zarr(keys)
        except Exception as e:  # fsspec, object_store and the network raise many types
            raise StoreError(
                f"{self.path}: cannot fetch {len(keys)} chunk objects (first {keys[0]}): "
                f"{type(e).__name__}: {e}"
            ) from e
        if count:
            stats = self._remote_reads
            with _STATE_LOCK:
                stats[0] += len(keys)
                stats[1] += sum(len(o) for o in out if o is not None)
                stats[2] += time.perf_counter() - t
        return out

    def fetch_with_zarr(self, keys: list[str]) -> list[bytes | None]:
        """The objects ``keys`` through zarr's async store (fsspec), all requests at once."""
        import asyncio

        from zarr.core.buffer import default_buffer_prototype
        from zarr.core.sync import sync

        store = self.geometry.any_array().store_path.store
        proto = default_buffer_prototype()

        async def get_all() -> list[Any]:
            return list(await asyncio.gather(*(store.get(k, prototype=proto) for k in keys)))

        return [None if g is None else g.to_bytes() for g in sync(get_all())]

    def object_fetcher(self) -> Any | None:
        """This process's engine client for the store (``kvcouple._core.ObjectFetcher``), or
        None where its objects are fetched through zarr's store instead; decided once."""
        with _STATE_LOCK:
            if not self._fetcher_decided:
                settings, _ = engine_settings(self.path, self.geometry.storage_options)
                if settings is not None and not self.engine.off:
                    from kvcouple import _core

                    self._fetcher = _core.ObjectFetcher(self.path.rstrip("/"), settings)
                self._fetcher_decided = True
        return self._fetcher

    @property
    def fetched_by(self) -> str:
        """Who fetches this store's chunk objects for the engine: "engine" (its own client,
        many requests in flight) or "fsspec" (zarr's store); "local" for a local store."""
        if not is_url(self.path):
            return "local"
        return "engine" if self.object_fetcher() is not None else "fsspec"

    @property
    def remote_reads(self) -> tuple[int, int, float]:
        """Chunk objects fetched from object storage by the engine's path so far: (requests,
        bytes, seconds the fetches took, summed)."""
        r = self._remote_reads
        return int(r[0]), int(r[1]), float(r[2])
