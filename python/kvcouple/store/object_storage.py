"""Reading a trace store on object storage: who fetches its objects, and how.

:class:`ObjectStorageReads` is the part of :class:`kvcouple.store.reader.TraceStoreReader`
that fetches chunk objects from ``s3://`` (and other fsspec URLs): windows of distribution
chunks for the engine, fetched ahead; the small per-document variables in batches, decoded
from memory.

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
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from kvcouple.errors import StoreError

# Decoded bytes per window of blocks fetched at once from object storage.
REMOTE_WINDOW = 64 * 2**20
# Documents whose small per-document objects (the summary variables) are fetched at once.
SUMMARY_AHEAD = 16

# Guards the reader's per-process state shared by its threads (read-ahead, counters, notices).
_NOTICE_LOCK = threading.Lock()


def is_url(path: str) -> bool:
    """A store address for fsspec (``s3://bucket/run.zarr``) rather than a local path."""
    return "://" in path and not path.startswith("file://")


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


class ObjectStorageReads:
    """Fetching a store's objects from object storage, for :class:`TraceStoreReader`
    (which provides the store's arrays, keys and grids). Per-process state lives in the
    reader's ``__dict__`` under the names :data:`PROCESS_STATE` (not pickled)."""

    PROCESS_STATE = ("_ahead", "_ahead_pool", "_fetcher", "_summary_ahead")

    path: str
    storage_options: dict[str, Any]
    dims: dict[str, int]
    _arrays: dict[str, Any]

    # Provided by the reader.
    def array(self, name: str) -> Any:
        raise NotImplementedError

    def keys(self, name: str, sel: tuple[slice, ...]) -> list[str]:
        raise NotImplementedError

    def chunk_key(self, name: str, coords: tuple[int, ...]) -> str:
        raise NotImplementedError

    def storage_grid(self, name: str) -> tuple[int, ...]:
        raise NotImplementedError

    def row_tolerance(self, name: str) -> float:
        raise NotImplementedError

    def _cells(
        self, name: str, sel: tuple[slice, ...], grid: tuple[int, ...]
    ) -> Iterator[tuple[tuple[int, ...], tuple[slice, ...]]]:
        raise NotImplementedError

    @property
    def _engine_off(self) -> bool:
        raise NotImplementedError

    def _doc_keys(self, names: tuple[str, ...], doc: int) -> list[str]:
        return [
            k
            for n in names
            for k in self.keys(
                n, (slice(doc, doc + 1),) + (slice(None),) * (self.array(n).ndim - 1)
            )
        ]

    def _summary_objects(
        self, names: tuple[str, ...], doc: int
    ) -> tuple[list[str], list[bytes | None]]:
        """The chunk objects of ``names[doc]``: their keys and bytes. They are small and one
        request each, so they are fetched for SUMMARY_AHEAD documents at once (the analysis
        reads documents in order, from several threads); each is taken once."""
        keys = self._doc_keys(names, doc)
        block: list[str] = []
        with _NOTICE_LOCK:
            pending = self.__dict__.setdefault("_summary_ahead", {})
            if any(k not in pending for k in keys):
                block = [k for k in keys if k not in pending]
                for d in range(doc + 1, min(doc + SUMMARY_AHEAD, self.dims["doc"])):
                    block += [k for k in self._doc_keys(names, d) if k not in pending]
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

    def _remote_tv(
        self, p_name: str, q_name: str, blocks: np.ndarray, kind: str, decode_only: bool
    ) -> tuple[np.ndarray, tuple[str, str, str] | None]:
        """:meth:`rows_tv` on object storage: the chunk objects of a window of blocks are
        fetched concurrently (zarr's async store: many requests in flight) while the Rust
        engine verifies, decodes and consumes the previous window
        (``kvcouple._core.store_chunks_tv``). Holds two windows of stored bytes at most."""
        from kvcouple import _core

        keys: dict[str, list[str]] = {}
        for name in (p_name, q_name):
            keys[name] = []
            for b in blocks:
                sel = tuple(slice(int(lo), int(hi)) for lo, hi in b)
                cells = [c for c, _ in self._cells(name, sel, self.storage_grid(name))]
                if len(cells) != 1:
                    return np.empty(0), ("unsupported", "", "a block spans several objects")
                keys[name].append(self.chunk_key(name, cells[0]))
        meta = [self._metadata_document(n) for n in (p_name, q_name)]
        row_bytes = int(blocks[0, -1, 1] - blocks[0, -1, 0]) * self.array(p_name).dtype.itemsize
        rows = np.prod(blocks[:, :-1, 1] - blocks[:, :-1, 0], axis=1)
        # Windows of ~REMOTE_WINDOW decoded bytes (>= 8 blocks): enough requests in flight to
        # hide the round trips, little enough held in memory.
        per = max(8, int(REMOTE_WINDOW // max(1, int(rows.max()) * row_bytes)))
        windows = [range(i, min(i + per, len(blocks))) for i in range(0, len(blocks), per)]

        def fetch(w: range) -> tuple[list[bytes | None], list[bytes | None]]:
            got = self._fetch_ahead([keys[p_name][i] for i in w] + [keys[q_name][i] for i in w])
            return got[: len(w)], got[len(w) :]

        self._read_ahead(p_name, q_name, blocks, per)

        tvs = []
        with ThreadPoolExecutor(max_workers=1) as pool:
            pending = [pool.submit(fetch, w) for w in windows[:1]]
            for n, w in enumerate(windows):
                pc, qc = pending.pop().result()
                pending += [pool.submit(fetch, v) for v in windows[n + 1 : n + 2]]
                tv, problem = _core.store_chunks_tv(
                    meta[0],
                    meta[1],
                    np.ascontiguousarray(blocks[w.start : w.stop]),
                    [keys[p_name][i] for i in w],
                    pc,
                    [keys[q_name][i] for i in w],
                    qc,
                    kind,
                    row_tolerance=self.row_tolerance(p_name),
                    decode_only=decode_only,
                )
                if problem is not None:
                    for f in pending:
                        f.cancel()
                    return np.empty(0), problem
                tvs.append(np.asarray(tv))
        return (np.concatenate(tvs) if tvs else np.empty(0)), None

    def _read_ahead(self, p_name: str, q_name: str, blocks: np.ndarray, per: int) -> None:
        """Start fetching the first window of the same blocks of the next document (the
        analysis reads documents in order), so its round trips overlap this one's decoding.
        At most one window is fetched ahead; a key not asked for is dropped with it."""
        nxt = blocks[:per].copy()
        nxt[:, 0] += 1
        if nxt[0, 0, 1] > self.dims["doc"]:
            return
        ahead = self.__dict__.setdefault("_ahead", {})
        pool = self._ahead_executor()
        want = []
        for name in (p_name, q_name):
            for b in nxt:
                sel = tuple(slice(int(lo), int(hi)) for lo, hi in b)
                cells = [c for c, _ in self._cells(name, sel, self.storage_grid(name))]
                want += [self.chunk_key(name, c) for c in cells]
        with _NOTICE_LOCK:
            if len(ahead) > 4 * len(want):  # not taken: a reader that skips around
                ahead.clear()
            todo = [k for k in want if k not in ahead]
            if todo:
                fut = pool.submit(self.fetch_objects, todo)
                for i, k in enumerate(todo):
                    ahead[k] = (fut, i)

    def _ahead_executor(self) -> Any:
        """The thread that fetches ahead on object storage (one per reader and process)."""
        with _NOTICE_LOCK:
            pool = self.__dict__.get("_ahead_pool")
            if pool is None:
                pool = self.__dict__["_ahead_pool"] = ThreadPoolExecutor(max_workers=1)
        return pool

    def _fetch_ahead(self, keys: list[str]) -> list[bytes | None]:
        """:meth:`fetch_objects`, taking the keys already fetched ahead from there."""
        ahead = self.__dict__.get("_ahead", {})
        with _NOTICE_LOCK:
            found = {k: ahead.pop(k) for k in keys if k in ahead}
        rest = [k for k in keys if k not in found]
        got = dict(zip(rest, self.fetch_objects(rest), strict=True)) if rest else {}
        for k, (fut, i) in found.items():
            got[k] = fut.result()[i]
        return [got[k] for k in keys]

    def _metadata_document(self, name: str) -> str:
        """An array's metadata document as stored (``zarr.json``, or ``.zarray`` for v2)."""
        cache = self.__dict__.setdefault("_metadata_documents", {})
        if name not in cache:
            cache[name] = self._fetch_metadata_document(name)
        return str(cache[name])

    def _fetch_metadata_document(self, name: str) -> str:
        arr = self.array(name)
        # (zarr-python 2's arrays have no ``metadata``: they are format 2)
        fmt = getattr(getattr(arr, "metadata", None), "zarr_format", 2)
        key = f"{arr.path}/{'zarr.json' if fmt == 3 else '.zarray'}"
        if not is_url(self.path):
            try:
                return (Path(self.path) / key).read_text()
            except FileNotFoundError:
                raw = None
        else:
            (raw,) = self.fetch_objects([key], count=False)
        if raw is None:
            raise StoreError(f"{self.path}: the metadata of variable {name!r} is missing")
        return raw.decode()

    def fetch_objects(self, keys: list[str], *, count: bool = True) -> list[bytes | None]:
        """The stored objects ``keys`` (None where absent), fetched concurrently: by the Rust
        engine's own client where :func:`kvcouple.store.remote.engine_settings` allows it,
        else through zarr's store (its credentials, endpoint and ``storage_options``).
        Counted in :attr:`remote_reads` unless ``count`` is false."""
        import time

        fetcher = self._object_fetcher()
        t = time.perf_counter()
        try:
            out = fetcher.fetch(keys) if fetcher is not None else self._fetch_with_zarr(keys)
        except Exception as e:  # fsspec, object_store and the network raise many types
            raise StoreError(
                f"{self.path}: cannot fetch {len(keys)} chunk objects (first {keys[0]}): "
                f"{type(e).__name__}: {e}"
            ) from e
        if count:
            stats = self.__dict__.setdefault("_remote_reads", [0, 0, 0.0])
            with _NOTICE_LOCK:
                stats[0] += len(keys)
                stats[1] += sum(len(o) for o in out if o is not None)
                stats[2] += time.perf_counter() - t
        return out

    def _fetch_with_zarr(self, keys: list[str]) -> list[bytes | None]:
        """The objects ``keys`` through zarr's async store (fsspec), all requests at once."""
        import asyncio

        from zarr.core.buffer import default_buffer_prototype
        from zarr.core.sync import sync

        store = self.array(next(iter(self._arrays))).store_path.store
        proto = default_buffer_prototype()

        async def get_all() -> list[Any]:
            return list(await asyncio.gather(*(store.get(k, prototype=proto) for k in keys)))

        return [None if g is None else g.to_bytes() for g in sync(get_all())]

    def _object_fetcher(self) -> Any | None:
        """This process's engine client for the store (``kvcouple._core.ObjectFetcher``), or
        None where its objects are fetched through zarr's store instead; decided once."""
        with _NOTICE_LOCK:
            if "_fetcher" not in self.__dict__:
                fetcher = None
                settings, _ = engine_settings(self.path, self.storage_options)
                if settings is not None and not self._engine_off:
                    from kvcouple import _core

                    fetcher = _core.ObjectFetcher(self.path.rstrip("/"), settings)
                self.__dict__["_fetcher"] = fetcher
        return self.__dict__["_fetcher"]

    @property
    def fetched_by(self) -> str:
        """Who fetches this store's chunk objects for the engine: "engine" (its own client,
        many requests in flight) or "fsspec" (zarr's store); "local" for a local store."""
        if not is_url(self.path):
            return "local"
        return "engine" if self._object_fetcher() is not None else "fsspec"

    @property
    def remote_reads(self) -> tuple[int, int, float]:
        """Chunk objects fetched from object storage by the engine's path so far: (requests,
        bytes, seconds the fetches took, summed)."""
        r = self.__dict__.get("_remote_reads", [0, 0, 0.0])
        return int(r[0]), int(r[1]), float(r[2])
