# Type stubs of the private compiled module kvcouple._core (checked by `make stubtest`).
# Sections are grouped by the Rust binding file that defines them.
from typing import Any

import numpy as np
import numpy.typing as npt

__version__: str

# --- errors.rs ---
class InvalidInputError(ValueError): ...
class ShapeError(InvalidInputError): ...
class InvalidKernelError(InvalidInputError): ...
class InternalError(RuntimeError): ...

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
def set_num_threads(n: int) -> None: ...
def get_num_threads() -> int: ...
