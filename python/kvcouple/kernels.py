"""Divergence and coupling kernels over ``(rows, vocab)`` arrays, run in Rust.

Both functions read numpy memory without copying (C-contiguous arrays; others are made
contiguous first), release the GIL and use every core (see :func:`set_num_threads`).

**Element formats.** ``float16``, ``float32`` and ``float64`` arrays are passed as they are.
numpy has no bfloat16: pass bfloat16 data as a ``uint16`` array of the raw bits with
``dtype="bfloat16"`` (for torch: ``t.view(torch.int16).numpy().view(np.uint16)``), or an
``ml_dtypes.bfloat16`` array, which is recognised and viewed as bits. Sums are accumulated in
float64.

**Conventions.** Natural logarithms (nats), ``0 log 0 = 0``; ``kl_pq`` is ``+inf`` where some
``p > 0`` meets ``q = 0``. Rows must sum to 1 within ``atol`` (default: 1e-2 for half formats,
whose tiny probabilities underflow, 1e-4 for float32, 1e-6 for float64); ``renormalize=True``
divides each row by its own sum instead.
"""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass, fields

import numpy as np

from kvcouple import _core
from kvcouple._core import InvalidInputError

_HALF = {"float16", "bfloat16"}
_MAX_VOCAB = 2**31 - 1


def _as_rows(a: object, name: str, dtype: str | None) -> tuple[np.ndarray, str]:
    """Return a C-contiguous 2-D array and its logical dtype name (halves as uint16 bits)."""
    if a is None:
        raise InvalidInputError(f"{name} is None; pass a 2-D array (rows, vocab)")
    try:
        arr = np.asarray(a)
    except (TypeError, ValueError) as e:  # ragged lists and the like
        raise InvalidInputError(f"{name} is not an array: {e}") from None
    kind = dtype
    if arr.dtype.name == "bfloat16":  # ml_dtypes
        arr, kind = arr.view(np.uint16), "bfloat16"
    elif kind is None:
        if arr.dtype == np.uint16:
            raise InvalidInputError(
                f"{name} is uint16: pass dtype='bfloat16' or dtype='float16' to say what the bits are"
            )
        kind = arr.dtype.name
    if kind in _HALF:
        if arr.dtype == np.float16:
            arr = arr.view(np.uint16)
        if arr.dtype != np.uint16:
            raise InvalidInputError(
                f"{name}: dtype={kind!r} expects float16 or uint16 bits, got {arr.dtype}"
            )
    elif kind not in ("float32", "float64"):
        raise InvalidInputError(
            f"{name} has dtype {arr.dtype}; use float16, bfloat16, float32 or float64"
        )
    if arr.ndim != 2:
        raise _core.ShapeError(f"{name} must be 2-D (rows, vocab), got shape {arr.shape}")
    if arr.shape[1] > _MAX_VOCAB:
        raise _core.ShapeError(
            f"{name} has vocab {arr.shape[1]}, above the int32 range of token ids ({_MAX_VOCAB})"
        )
    return np.ascontiguousarray(arr), kind


def _int_arg(name: str, value: object) -> int:
    """An integer argument (Python or numpy int; not bool, not float)."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Integral):
        raise InvalidInputError(f"{name} must be an integer, got {value!r}")
    return int(value)


def _float_arg(name: str, value: object) -> float:
    """A real number argument (not bool, not complex, not a string)."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Real):
        raise InvalidInputError(f"{name} must be a real number, got {value!r}")
    return float(value)


def _flag(name: str, value: object) -> bool:
    if not isinstance(value, bool | np.bool_):
        raise InvalidInputError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def _atol(atol: object) -> float | None:
    if atol is None:
        return None
    a = _float_arg("atol", atol)
    if not a >= 0:  # NaN too
        raise InvalidInputError(f"atol must be a number >= 0, got {atol!r}")
    return a


def _check_dtype_arg(dtype: object) -> str | None:
    if dtype is not None and not isinstance(dtype, str):
        raise InvalidInputError(f"dtype must be a string such as 'bfloat16', got {dtype!r}")
    return dtype


def _pair(p: object, q: object, dtype: str | None) -> tuple[np.ndarray, np.ndarray, str]:
    pa, kp = _as_rows(p, "p", dtype)
    qa, kq = _as_rows(q, "q", dtype)
    if kp != kq:
        raise InvalidInputError(f"p is {kp} but q is {kq}; pass both in one dtype")
    return pa, qa, kp


@dataclass(frozen=True)
class Divergences:
    """Per-row divergences between p and q, each a float64 array of shape ``(rows,)``.

    Attributes
    ----------
    tv : numpy.ndarray
        Total variation ``0.5 * sum_v |p(v) - q(v)|``, in [0, 1]: under the maximal coupling,
        the probability that the two sides emit different tokens.
    kl_pq, kl_qp : numpy.ndarray
        ``KL(p || q)`` and ``KL(q || p)`` in nats; ``+inf`` where one side puts mass on a token
        the other gives probability 0.
    js : numpy.ndarray
        Jensen-Shannon divergence in nats, in [0, ln 2].
    hellinger : numpy.ndarray
        Hellinger distance, in [0, 1].
    entropy_p, entropy_q : numpy.ndarray
        Entropies of p and q in nats.
    overlap : numpy.ndarray
        ``sum_v min(p(v), q(v)) = 1 - tv``.
    top1_agree : numpy.ndarray
        Boolean: the most likely token is the same (first index on ties).
    """

    tv: np.ndarray
    kl_pq: np.ndarray
    kl_qp: np.ndarray
    js: np.ndarray
    hellinger: np.ndarray
    entropy_p: np.ndarray
    entropy_q: np.ndarray
    overlap: np.ndarray
    top1_agree: np.ndarray

    def as_dict(self) -> dict[str, np.ndarray]:
        """Every field by name."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def divergences(
    p: object,
    q: object,
    *,
    logits: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    renormalize: bool = False,
    atol: float | None = None,
    dtype: str | None = None,
) -> Divergences:
    """TV, KL both ways, Jensen-Shannon, Hellinger, entropies, overlap and top-1 agreement,
    row by row, in one vectorised pass (Rust, every core, no copy of C-contiguous input).

    Parameters
    ----------
    p, q : array_like
        ``(rows, vocab)`` next-token probabilities (each row sums to 1 within ``atol``), or
        logits with ``logits=True``. float16, float32, float64; bfloat16 as ``uint16`` bits
        with ``dtype="bfloat16"`` or as an ``ml_dtypes.bfloat16`` array. Both in one dtype.
    logits : bool, default False
        Treat ``p`` and ``q`` as logits and apply the decoding transform to both identically:
        temperature, then top-k, then top-p, then softmax (the transform the tracer applies;
        :func:`kvcouple.torch_coupling.apply_decoding` is its torch twin).
    temperature : float, default 1.0
        Divides the logits; finite and > 0 (``top_k=1`` is greedy decoding).
    top_k : int, optional
        Keep the ``top_k`` most likely tokens (ties at the threshold all kept).
    top_p : float, optional
        Keep the smallest set of most likely tokens with mass >= ``top_p``, in (0, 1].
    renormalize : bool, default False
        Divide each row by its own sum instead of requiring it to be 1.
    atol : float, optional
        Tolerance on row sums; default 1e-2 for half formats, 1e-4 for float32, 1e-6 for
        float64.
    dtype : str, optional
        What ``uint16`` input holds: ``"bfloat16"`` or ``"float16"``.

    Returns
    -------
    Divergences
        Per-row ``tv``, ``kl_pq``, ``kl_qp``, ``js``, ``hellinger``, ``entropy_p``,
        ``entropy_q``, ``overlap``, ``top1_agree``; information quantities in nats.

    Raises
    ------
    kvcouple.errors.InvalidInputError
        A ``ValueError`` naming the first bad row (NaN, negative, sum off by more than
        ``atol``) or argument (temperature, top_k, top_p, dtype).
    kvcouple.errors.ShapeError
        ``p`` and ``q`` are not 2-D of the same shape.
    """
    logits = _flag("logits", logits)
    renormalize = _flag("renormalize", renormalize)
    temperature = _float_arg("temperature", temperature)
    if not (math.isfinite(temperature) and temperature > 0 and math.isfinite(1 / temperature)):
        raise InvalidInputError(
            f"temperature must be a finite number > 0 whose inverse is finite (>= 5.6e-309), "
            f"got {temperature!r} (use top_k=1 for greedy decoding)"
        )
    if top_k is not None:
        k = _int_arg("top_k", top_k)
        if k < 1:
            raise InvalidInputError(f"top_k must be >= 1, got {k}")
        top_k = min(k, 2**62)  # beyond the vocabulary it keeps everything
    if top_p is not None:
        top_p = _float_arg("top_p", top_p)
        if not 0 < top_p <= 1:
            raise InvalidInputError(f"top_p must be in (0, 1], got {top_p!r}")
    if not logits and (temperature != 1.0 or top_k is not None or top_p is not None):
        raise InvalidInputError(
            "temperature, top_k and top_p transform logits: pass logits=True (p and q are "
            "probabilities otherwise)"
        )
    pa, qa, kind = _pair(p, q, _check_dtype_arg(dtype))
    out = _core.divergences(
        pa,
        qa,
        kind,
        logits=logits,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        renormalize=renormalize,
        atol=_atol(atol),
    )
    return Divergences(**out)


def couple(
    p: object,
    q: object,
    u: object,
    *,
    renormalize: bool = False,
    atol: float | None = None,
    dtype: str | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Draw one token pair per row from the maximal coupling of ``p`` and ``q`` (SPEC §2).

    ``x`` follows ``p``, ``y`` follows ``q``, and ``P(x != y) = TV(p, q)``, the least any
    coupling allows. Deterministic in its inputs; the torch sampler
    :func:`kvcouple.torch_coupling.couple_torch` returns the same tokens.

    Parameters
    ----------
    p, q : array_like
        ``(rows, vocab)`` probabilities, formats as in :func:`divergences`.
    u : array_like
        ``(rows, 3)`` uniforms in [0, 1): ``u0`` chooses overlap vs residual (residual iff
        ``u0 < tv``), ``u1`` the overlap or P-residual token, ``u2`` the Q-residual token, each
        by inverse CDF in vocabulary order.
    renormalize : bool, default False
        Divide each row by its own sum instead of requiring it to be 1.
    atol : float, optional
        Tolerance on row sums (defaults as in :func:`divergences`).
    dtype : str, optional
        What ``uint16`` input holds: ``"bfloat16"`` or ``"float16"``.

    Returns
    -------
    x, y : numpy.ndarray
        int64 token ids of shape ``(rows,)`` drawn from ``p`` and ``q``.
    diverged : numpy.ndarray
        bool, ``x != y``.

    Raises
    ------
    kvcouple.errors.InvalidInputError
        A bad row of ``p`` or ``q``, or ``u`` outside [0, 1).
    kvcouple.errors.ShapeError
        Shapes that do not match (``u`` must be ``(rows, 3)``).
    """
    renormalize = _flag("renormalize", renormalize)
    atol = _atol(atol)
    pa, qa, kind = _pair(p, q, _check_dtype_arg(dtype))
    if u is None:
        raise InvalidInputError("u is None; pass uniforms in [0, 1) of shape (rows, 3)")
    try:
        ua = np.asarray(u)
    except (TypeError, ValueError) as e:
        raise InvalidInputError(f"u is not an array: {e}") from None
    if ua.dtype.kind not in "iuf":
        raise InvalidInputError(f"u must hold real numbers in [0, 1), got dtype {ua.dtype}")
    if ua.shape != (pa.shape[0], 3):
        raise _core.ShapeError(f"u has shape {ua.shape}, expected ({pa.shape[0]}, 3)")
    ua = np.ascontiguousarray(ua, dtype=np.float64)
    return _core.couple(pa, qa, ua, kind, renormalize=renormalize, atol=atol)


def total_variation(p: object, q: object, *, dtype: str | None = None) -> np.ndarray:
    """Total variation ``1/2 sum |p - q|`` of each row pair.

    TV only: the quantity hazards are made of, without the logarithms the other divergences
    need (it runs near the speed of a plain memory pass). Rows holding NaN or infinity
    (unrecorded rows of a store) give NaN rather than an error.

    Parameters
    ----------
    p, q : array_like
        ``(rows, vocab)`` probability arrays, formats as in :func:`divergences`.
    dtype : str, optional
        What ``uint16`` input holds: ``"bfloat16"`` or ``"float16"``. Default None.

    Returns
    -------
    numpy.ndarray
        float64 ``(rows,)``: the total variation distance of each row pair, in ``[0, 1]``.

    Raises
    ------
    kvcouple.errors.InvalidInputError
        Inputs that are not arrays of probabilities, or a bad ``dtype``.
    kvcouple.errors.ShapeError
        ``p`` and ``q`` differ in shape or are not two-dimensional.
    """
    pa, qa, kind = _pair(p, q, dtype)
    return _core.row_tv(pa, qa, kind)


def plain_pass(p: object, q: object, *, dtype: str | None = None) -> np.ndarray:
    """Convert and sum every row of both arrays: the memory-bandwidth floor of the kernels.

    Parameters
    ----------
    p, q : array_like
        ``(rows, vocab)`` arrays, formats as in :func:`divergences`.
    dtype : str, optional
        What ``uint16`` input holds: ``"bfloat16"`` or ``"float16"``.

    Returns
    -------
    numpy.ndarray
        float64 ``(rows,)``: ``sum(p[i]) + sum(q[i])``. Benchmarks compare the kernels' speed
        with this pass.
    """
    pa, qa, kind = _pair(p, q, _check_dtype_arg(dtype))
    return _core.plain_pass(pa, qa, kind)


def set_num_threads(n: int) -> None:
    """Use ``n`` threads in every Rust kernel.

    Under Dask, set this (or ``KVCOUPLE_NUM_THREADS``) to the worker's thread budget so that
    worker processes do not oversubscribe the machine.

    Parameters
    ----------
    n : int
        Threads, in ``[0, max_threads()]``; 0 restores the default (every core).

    Returns
    -------
    None

    Raises
    ------
    kvcouple.errors.InvalidInputError
        ``n`` is not an integer in range (a pool far larger than the machine only adds
        start-up time and memory).
    """
    k = _int_arg("n", n)
    if not 0 <= k <= max_threads():
        raise InvalidInputError(
            f"set_num_threads: n = {k} must be in [0, {max_threads()}] (0: all cores)"
        )
    _core.set_num_threads(k)


def max_threads() -> int:
    """The largest thread count :func:`set_num_threads` accepts.

    Returns
    -------
    int
        8 per core, at least 256.
    """
    return max(256, 8 * (os.cpu_count() or 1))


def get_num_threads() -> int:
    """The number of threads the Rust kernels use.

    Returns
    -------
    int
        Threads in the kernels' pool (all cores unless :func:`set_num_threads` or
        ``KVCOUPLE_NUM_THREADS`` said otherwise).
    """
    return _core.get_num_threads()
