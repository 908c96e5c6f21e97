# Type stubs of the private compiled module kvcouple._core (checked by `make stubtest`).
# Sections are grouped by the Rust binding file that defines them.
import os
from typing import Any, final

import numpy as np
import numpy.typing as npt

__version__: str

# --- errors.rs ---
class InvalidInputError(ValueError): ...
class ShapeError(InvalidInputError): ...
class InvalidKernelError(InvalidInputError): ...
class InternalError(RuntimeError): ...
class ObjectStoreError(OSError): ...

# --- object_fetcher.rs ---
@final
class ObjectFetcher:
    """A trace store's root on S3 (or an S3-compatible server) and the client that reads it:
    ``config`` holds object_store's S3 settings by name; nothing is read from the environment. ``concurrency``: requests in flight (default 64)."""

    def __new__(
        cls, url: str, config: list[tuple[str, str]], *, concurrency: int = ...
    ) -> ObjectFetcher: ...
    def fetch(self, keys: list[str]) -> list[bytes | None]: ...
    @property
    def url(self) -> str: ...

# --- kernels.rs ---
def divergences(
    p: npt.NDArray[Any],
    q: npt.NDArray[Any],
    dtype: str,
    *,
    logits: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    renormalize: bool = False,
    atol: float | None = None,
) -> dict[str, npt.NDArray[Any]]: ...
def couple(
    p: npt.NDArray[Any],
    q: npt.NDArray[Any],
    u: npt.NDArray[np.float64],
    dtype: str,
    *,
    renormalize: bool = False,
    atol: float | None = None,
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.bool_]]: ...
def plain_pass(p: npt.NDArray[Any], q: npt.NDArray[Any], dtype: str) -> npt.NDArray[np.float64]: ...
def row_tv(p: npt.NDArray[Any], q: npt.NDArray[Any], dtype: str) -> npt.NDArray[np.float64]: ...
def set_num_threads(n: int) -> None: ...
def get_num_threads() -> int: ...

# --- tables.rs ---
@final
class TextColumns:
    """A table given column-wise, taken once and then written a block of rows at a time:
    ``columns`` (name, kind, j) in order, kind "number", "flag" or "label" reading column j of
    ``numbers`` (rows x width, float64), ``flags`` (rows x width, bool) or ``codes`` (rows x
    width, uint32: indices into ``labels[j]``)."""

    def __new__(
        cls,
        columns: list[tuple[str, str, int]],
        numbers: npt.NDArray[np.float64],
        flags: npt.NDArray[np.bool_],
        codes: npt.NDArray[np.uint32],
        labels: list[list[str]],
    ) -> TextColumns: ...
    def text(self, format: str, start: int, stop: int) -> bytes: ...
    def append_to(
        self,
        csv: str | os.PathLike[str],
        json: str | os.PathLike[str],
        block_rows: int = 4096,
        threads: int = 0,
    ) -> None: ...
    @property
    def rows(self) -> int: ...

# --- stats.rs ---
def bootstrap_means(
    values: npt.NDArray[np.float64], n_boot: int, seed: int
) -> npt.NDArray[np.float64]: ...
def bootstrap_counts(docs: int, n_boot: int, seed: int) -> npt.NDArray[np.uint32]: ...
def count_float_keys(
    values: npt.NDArray[np.float32], counts: npt.NDArray[np.int64], bits: int
) -> None: ...
def path_steps(
    values: npt.NDArray[np.float32] | npt.NDArray[np.float64],
    tokens: npt.NDArray[np.int32],
    flags: npt.NDArray[np.bool_] | None = None,
) -> dict[str, Any]: ...
def segment_sums(
    values: npt.NDArray[np.float64], sizes: npt.NDArray[np.int64]
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]: ...
def bootstrap_moments(
    values: npt.NDArray[np.float64],
    centers: npt.NDArray[np.float64],
    pairs: npt.NDArray[np.int64],
    n_boot: int,
    seed: int,
) -> npt.NDArray[np.float64]: ...
def bootstrap_intervals(
    reps: npt.NDArray[np.float64],
    point: npt.NDArray[np.float64],
    jack: npt.NDArray[np.float64],
    z_lower: float,
    z_upper: float,
    bca: bool,
) -> npt.NDArray[np.float64]: ...
def jackknife_se(
    values: npt.NDArray[np.float64], weights: npt.NDArray[np.float64]
) -> npt.NDArray[np.float64]: ...

# --- store.rs ---
def store_blocks_tv(
    root: str,
    p: str,
    q: str,
    blocks: npt.NDArray[np.int64],
    dtype: str,
    *,
    row_tolerance: float | None = None,
    decode_only: bool = False,
    top_delta: bool = False,
) -> tuple[npt.NDArray[np.float64], tuple[str, str, str] | None]: ...
def store_crc32c(data: bytes) -> int: ...
def store_vlen_utf8(data: bytes) -> list[str]: ...
def store_decode_chunks(
    metas: list[str],
    which: list[int],
    keys: list[str],
    *,
    root: str | None = None,
    chunks: list[bytes | None] | None = None,
    inner: list[int] | None = None,
    group: int | None = None,
    runs: list[int] | None = None,
) -> tuple[list[npt.NDArray[np.uint8]], tuple[str, str, str] | None]: ...
def store_chunks_tv(
    p_meta: str,
    q_meta: str,
    blocks: npt.NDArray[np.int64],
    p_keys: list[str],
    p_chunks: list[bytes | None],
    q_keys: list[str],
    q_chunks: list[bytes | None],
    dtype: str,
    *,
    row_tolerance: float | None = None,
    decode_only: bool = False,
    top_delta: bool = False,
) -> tuple[npt.NDArray[np.float64], tuple[str, str, str] | None]: ...

# --- store_write.rs ---
def store_encode_shard(
    data: npt.NDArray[np.uint8],
    itemsize: int,
    shard: list[int] | tuple[int, ...],
    inner: list[int] | tuple[int, ...],
    present: int,
    *,
    level: int = 1,
) -> bytes: ...

# --- units.rs ---
def estimate_units(
    hazard: npt.NDArray[np.float32] | npt.NDArray[np.float64],
    branch_step: npt.NDArray[np.int32] | npt.NDArray[np.int64],
    branch_mismatch: npt.NDArray[np.int8],
    branch_tv: npt.NDArray[np.float32] | npt.NDArray[np.float64],
    obs_window: int,
    estimator: str,
    tail_observed: bool,
) -> dict[str, Any]: ...

# --- synth.rs ---
_PairArrays = tuple[
    npt.NDArray[np.float64],
    npt.NDArray[np.int64],
    int,
    npt.NDArray[np.float64],
    npt.NDArray[np.int64],
    int,
]

def synth_validate(
    pair: _PairArrays,
) -> _PairArrays: ...
def synth_random_pair(
    vocab: int,
    states: int,
    seed: int,
    *,
    closeness: float = 0.5,
    sparsity: float = 0.0,
    absorbing: bool = False,
    deterministic: float = 0.0,
    markov: bool = False,
) -> _PairArrays: ...
def synth_exact(
    pair: _PairArrays,
    horizon: int,
    window: int,
) -> dict[str, Any]: ...
def synth_simulate(
    pair: _PairArrays,
    horizon: int,
    window: int,
    *,
    estimator: str,
    replicates: int,
    branches: int = 1,
    seed: int = 0,
    trace_to_horizon: bool = True,
) -> dict[str, npt.NDArray[np.float64]]: ...
def synth_interval_constructions(
    pair: _PairArrays,
    horizon: int,
    window: int,
) -> tuple[_PairArrays, _PairArrays]: ...
