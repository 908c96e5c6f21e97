"""kvcouple: what a KV-cache eviction policy does to generation, token by token.

The analysis core (kernels, estimators, stores) needs only numpy/xarray/zarr; the tracer
(:mod:`kvcouple.tracer`) needs torch and transformers and is imported on demand.
"""

from kvcouple._core import __version__
from kvcouple.errors import (
    InternalError,
    InvalidInputError,
    InvalidKernelError,
    SchemaVersionError,
    ShapeError,
    StoreError,
)
from kvcouple.kernels import (
    Divergences,
    couple,
    divergences,
    get_num_threads,
    plain_pass,
    set_num_threads,
    total_variation,
)

__all__ = [
    "Divergences",
    "InternalError",
    "InvalidInputError",
    "InvalidKernelError",
    "SchemaVersionError",
    "ShapeError",
    "StoreError",
    "__version__",
    "couple",
    "divergences",
    "get_num_threads",
    "plain_pass",
    "set_num_threads",
    "total_variation",
]
