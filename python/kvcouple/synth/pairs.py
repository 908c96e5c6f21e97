"""Synthetic kernels and pairs (SPEC section 6): emitters, Markov tables, pair files."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvcouple import _core
from kvcouple.errors import InvalidInputError, InvalidKernelError

EMITTER_KEYS = ("P_emit", "P_next", "P_start", "Q_emit", "Q_next", "Q_start")
MARKOV_KEYS = ("P", "Q", "start")

PairArrays = tuple[
    npt.NDArray[np.float64],
    npt.NDArray[np.int64],
    int,
    npt.NDArray[np.float64],
    npt.NDArray[np.int64],
    int,
]


# Largest state index or start accepted from a float array (exact in float64, fits in int64).
_MAX_INDEX = 2**53


def _matrix(x: Any, name: str, dtype: type) -> np.ndarray:
    try:
        a = np.asarray(x)
    except (TypeError, ValueError) as e:
        raise InvalidKernelError(f"{name} is not an array ({e})") from None
    if a.ndim != 2:
        raise InvalidKernelError(f"{name} must be 2-D (states x vocab), got shape {a.shape}")
    kind = a.dtype.kind
    if dtype is np.int64:
        if kind == "f":
            if not np.all(np.isfinite(a)) or np.any(np.mod(a, 1) != 0):
                raise InvalidKernelError(
                    f"{name} must hold integer state indices, got non-integer values ({a.dtype})"
                )
            if a.size and np.abs(a).max() > _MAX_INDEX:
                raise InvalidKernelError(f"{name} holds a state index beyond 2**53")
        elif kind not in "iub":
            raise InvalidKernelError(f"{name} must hold integer state indices, got {a.dtype}")
        if kind == "u" and a.size and a.max() > _MAX_INDEX:
            raise InvalidKernelError(f"{name} holds a state index beyond 2**53")
    elif kind not in "iuf":
        raise InvalidKernelError(f"{name} must hold real probabilities, got {a.dtype}")
    return np.ascontiguousarray(a, dtype=dtype)


def check_seed(seed: int) -> int:
    """Seeds are 64-bit unsigned integers."""
    if (
        isinstance(seed, bool)
        or not isinstance(seed, int | np.integer)
        or not 0 <= int(seed) < 2**64
    ):
        raise InvalidInputError(f"seed = {seed!r} must be an integer in [0, 2**64)")
    return int(seed)


def _index(x: Any, name: str) -> int:
    """One integer (a start state or token), from a Python or numpy scalar or a 0-d array."""
    if isinstance(x, bool | np.bool_):
        raise InvalidKernelError(f"{name} must be one integer, got {x!r}")
    try:
        a = np.asarray(x)
    except (TypeError, ValueError):
        raise InvalidKernelError(f"{name} must be one integer, got {x!r}") from None
    ok = a.ndim == 0 and (
        a.dtype.kind in "iu"
        or (a.dtype.kind == "f" and np.isfinite(a) and float(a) == int(a) and abs(a) <= _MAX_INDEX)
    )
    if not ok:
        shown = f"an array of shape {a.shape}" if a.ndim else repr(x)
        raise InvalidKernelError(f"{name} must be one integer, got {shown}")
    return int(a)


@dataclass(frozen=True, eq=False)
class Kernel:
    """A probabilistic finite-state emitter: in state ``s`` it emits token ``v`` with
    probability ``emit[s, v]`` and moves to state ``next[s, v]``; it starts in ``start``.

    Parameters
    ----------
    emit : numpy.ndarray
        Emission probabilities, shape ``(S, V)`` (states x vocabulary); each row must sum to 1
        (within 1e-6 when validated by :class:`KernelPair`).
    next : numpy.ndarray
        Integer next-state table, shape ``(S, V)``, entries in ``[0, S)``.
    start : int
        The initial state, in ``[0, S)``.
    """

    emit: npt.NDArray[np.float64]
    next: npt.NDArray[np.int64]
    start: int

    @classmethod
    def markov(cls, table: npt.ArrayLike, start: int) -> Kernel:
        """A first-order Markov table ``table[prev, token]`` started after token ``start``."""
        t = _matrix(table, "Markov table", np.float64)
        if t.shape[0] != t.shape[1]:
            raise InvalidKernelError(f"a Markov table must be square (V x V), got shape {t.shape}")
        nxt = np.tile(np.arange(t.shape[1], dtype=np.int64), (t.shape[0], 1))
        return cls(t, nxt, _index(start, "start"))

    @property
    def states(self) -> int:
        return int(self.emit.shape[0])

    @property
    def vocab(self) -> int:
        return int(self.emit.shape[1])

    def is_markov(self) -> bool:
        s, v = self.emit.shape
        return s == v and bool(np.all(self.next == np.arange(v)))


@dataclass(frozen=True, eq=False)
class KernelPair:
    """Two kernels over one vocabulary: ``p`` the reference, ``q`` the perturbed one.

    Construction validates both (shapes, stochastic rows within 1e-6, state indices in range)
    and renormalises rows exactly; errors are :class:`kvcouple.InvalidKernelError` naming the
    offending array, row or entry.

    Parameters
    ----------
    p : Kernel
        The reference kernel.
    q : Kernel
        The perturbed kernel, over the same vocabulary as ``p``.
    """

    p: Kernel
    q: Kernel

    def __post_init__(self) -> None:
        arrays = (
            _matrix(self.p.emit, "P_emit", np.float64),
            _matrix(self.p.next, "P_next", np.int64),
            _index(self.p.start, "P_start"),
            _matrix(self.q.emit, "Q_emit", np.float64),
            _matrix(self.q.next, "Q_next", np.int64),
            _index(self.q.start, "Q_start"),
        )
        pe, pn, ps, qe, qn, qs = _core.synth_validate(arrays)
        object.__setattr__(self, "p", Kernel(pe, pn, ps))
        object.__setattr__(self, "q", Kernel(qe, qn, qs))

    @classmethod
    def markov(cls, p: npt.ArrayLike, q: npt.ArrayLike, start: int) -> KernelPair:
        """Two first-order Markov tables (V x V) started after the same token."""
        return cls(Kernel.markov(p, start), Kernel.markov(q, start))

    @classmethod
    def from_arrays(cls, arrays: PairArrays) -> KernelPair:
        pe, pn, ps, qe, qn, qs = arrays
        return cls(Kernel(pe, pn, ps), Kernel(qe, qn, qs))

    @property
    def vocab(self) -> int:
        return self.p.vocab

    # Flat names, so tools that take "an object with the pair-file keys" accept a KernelPair.
    @property
    def p_emit(self) -> npt.NDArray[np.float64]:
        return self.p.emit

    @property
    def p_next(self) -> npt.NDArray[np.int64]:
        return self.p.next

    @property
    def p_start(self) -> int:
        return self.p.start

    @property
    def q_emit(self) -> npt.NDArray[np.float64]:
        return self.q.emit

    @property
    def q_next(self) -> npt.NDArray[np.int64]:
        return self.q.next

    @property
    def q_start(self) -> int:
        return self.q.start

    def arrays(self) -> PairArrays:
        """``(P_emit, P_next, P_start, Q_emit, Q_next, Q_start)``."""
        return (self.p.emit, self.p.next, self.p.start, self.q.emit, self.q.next, self.q.start)

    def save(self, path: str | os.PathLike[str], *, markov: bool = False) -> None:
        save_pair(self, path, markov=markov)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> KernelPair:
        return load_pair(path)


def save_pair(pair: KernelPair, path: str | os.PathLike[str], *, markov: bool = False) -> None:
    """Write a pair file (``.npz``) with the emitter keys ``P_emit, ..., Q_start``, or with
    ``markov=True`` the shorthand ``P, Q, start`` (for Markov pairs with one start token).

    Parameters
    ----------
    pair : KernelPair
        The pair to write.
    path : str or os.PathLike
        Destination file (numpy adds ``.npz`` when the name lacks it).
    markov : bool
        Write the Markov shorthand ``P, Q, start``. Default False.

    Returns
    -------
    None

    Raises
    ------
    kvcouple.errors.InvalidKernelError
        ``markov=True`` for a pair that is not Markov (S = V, ``next[s, v] = v``) with one
        start state shared by both kernels.
    """
    if not markov:
        np.savez(
            path,
            P_emit=pair.p.emit,
            P_next=pair.p.next,
            P_start=pair.p.start,
            Q_emit=pair.q.emit,
            Q_next=pair.q.next,
            Q_start=pair.q.start,
        )
        return
    if not (pair.p.is_markov() and pair.q.is_markov() and pair.p.start == pair.q.start):
        raise InvalidKernelError(
            "the Markov shorthand needs S = V, next[s, v] = v and one start for both kernels"
        )
    np.savez(path, P=pair.p.emit, Q=pair.q.emit, start=pair.p.start)


def pair_from_mapping(f: Any, where: str = "pair") -> KernelPair:
    """A pair from a mapping with the emitter keys or the Markov shorthand ``P, Q, start``.

    Errors are :class:`~kvcouple.errors.InvalidKernelError` whose message starts with
    ``where``.

    Parameters
    ----------
    f : Mapping
        Arrays under the emitter keys ``P_emit, P_next, P_start, Q_emit, Q_next, Q_start``,
        or the Markov shorthand ``P, Q, start``.
    where : str
        Prefix of error messages (a file name, for example). Default ``"pair"``.

    Returns
    -------
    KernelPair
        The validated pair.

    Raises
    ------
    kvcouple.errors.InvalidKernelError
        ``f`` is not a mapping, lacks the keys, or its arrays do not form a pair.
    """
    if not hasattr(f, "keys"):
        raise InvalidKernelError(f"{where}: expected a mapping of arrays, got {type(f).__name__}")
    try:
        return _pair_from_mapping(f, where)
    except InvalidKernelError as e:
        if str(e).startswith(where):
            raise
        raise InvalidKernelError(f"{where}: {e}") from None


def _pair_from_mapping(f: Any, where: str) -> KernelPair:
    keys = set(f.keys())
    if set(EMITTER_KEYS) <= keys:
        return KernelPair(
            Kernel(f["P_emit"], f["P_next"], _index(f["P_start"], "P_start")),
            Kernel(f["Q_emit"], f["Q_next"], _index(f["Q_start"], "Q_start")),
        )
    if set(MARKOV_KEYS) <= keys:
        p, q = (_matrix(f[k], k, np.float64) for k in ("P", "Q"))
        if p.shape != q.shape:
            raise InvalidKernelError(f"{where}: P has shape {p.shape} but Q has shape {q.shape}")
        return KernelPair.markov(p, q, _index(f["start"], "start"))
    missing = sorted(set(EMITTER_KEYS) - keys) if keys & set(EMITTER_KEYS) else None
    hint = f"; missing {', '.join(missing)}" if missing else ""
    raise InvalidKernelError(
        f"{where}: a pair file needs the keys {', '.join(EMITTER_KEYS)} or the Markov "
        f"shorthand {', '.join(MARKOV_KEYS)}; found {sorted(keys)}{hint}"
    )


_ZIP_MAGIC = b"PK\x03\x04"


def load_pair(path: str | os.PathLike[str]) -> KernelPair:
    """Read and validate a pair file (``.npz``) in either form.

    A file that is not there raises :class:`FileNotFoundError`; a directory, a file that is not
    an ``.npz`` archive (or a truncated one) or arrays that do not form a pair raise
    :class:`~kvcouple.errors.InvalidKernelError` naming the file.

    Parameters
    ----------
    path : str or os.PathLike
        A ``.npz`` pair file, with the emitter keys or the Markov shorthand.

    Returns
    -------
    KernelPair
        The validated pair.

    Raises
    ------
    FileNotFoundError
        No file at ``path``.
    kvcouple.errors.InvalidKernelError
        A directory, a file that is not a (whole) ``.npz`` archive, or arrays that do not
        form a pair.
    """
    where = os.fspath(path)
    if os.path.isdir(where):
        raise InvalidKernelError(f"{where} is a directory, not a .npz pair file")
    with open(where, "rb") as fh:  # FileNotFoundError / PermissionError as they are
        magic = fh.read(4)
    if magic != _ZIP_MAGIC:
        raise InvalidKernelError(
            f"{where} is not a .npz pair file (an .npz is a zip archive; this file starts "
            f"with {magic!r})"
        )
    try:
        with np.load(where, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}  # read now: a damaged member fails here
    except Exception as e:  # zipfile.BadZipFile, zlib.error, EOFError, ValueError, OSError
        raise InvalidKernelError(
            f"{where} is a damaged .npz pair file (truncated or corrupted: {type(e).__name__}: {e})"
        ) from e
    return pair_from_mapping(arrays, where)


def random_pair(
    vocab: int,
    states: int | None = None,
    *,
    seed: int = 0,
    closeness: float = 0.5,
    sparsity: float = 0.0,
    absorbing: bool = False,
    deterministic: float = 0.0,
    markov: bool = False,
) -> KernelPair:
    """A seeded random pair for tests and tutorials.

    ``closeness`` in [0, 1] mixes Q's rows and transitions towards P's (1: Q = P);
    ``sparsity`` zeroes each emission entry with that probability (rows keep one token);
    ``absorbing`` makes token ``V - 1`` an EOS after which each kernel emits it forever;
    ``deterministic`` is the probability that a row is a point mass (and that Q's row is
    drawn independently of P's, so TV-1 steps occur); ``markov`` gives V x V Markov tables
    (``states`` is then ignored). Without ``markov``, ``states`` defaults to ``vocab``.

    Parameters
    ----------
    vocab : int
        Vocabulary size ``V`` (>= 1).
    states : int, optional
        Number of states ``S``; None (default) uses ``vocab``. Ignored with ``markov``.
    seed : int
        Seed in ``[0, 2**64)``. Default 0.
    closeness : float
        In ``[0, 1]``: how far Q is mixed towards P (1: Q = P). Default 0.5.
    sparsity : float
        Probability of zeroing each emission entry. Default 0.0.
    absorbing : bool
        Make token ``V - 1`` an absorbing EOS. Default False.
    deterministic : float
        Probability that a row is a point mass. Default 0.0.
    markov : bool
        Give V x V Markov tables. Default False.

    Returns
    -------
    KernelPair
        The random pair.

    Raises
    ------
    kvcouple.errors.InvalidInputError
        A bad seed, size or probability out of range.
    """
    s = vocab if states is None else states
    arrays = _core.synth_random_pair(
        vocab,
        s,
        check_seed(seed),
        closeness=closeness,
        sparsity=sparsity,
        absorbing=absorbing,
        deterministic=deterministic,
        markov=markov,
    )
    return KernelPair.from_arrays(arrays)
