"""What one tracing run is asked to do: sizes, the decoding transform, the record level."""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import torch

from kvcouple.store.schema import Record
from kvcouple.torch_coupling import apply_decoding


@dataclass(frozen=True)
class Decoding:
    """The decoding transform shared by both kernels.

    Parameters
    ----------
    temperature : float, optional
        Softmax temperature, finite and > 0 (default 1.0).
    top_k : int or None, optional
        Keep only the ``top_k`` most probable tokens (an integer >= 1); ``None`` (the default)
        keeps all.
    top_p : float or None, optional
        Nucleus sampling mass in ``(0, 1]``; ``None`` (the default) keeps all.
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        apply_decoding(torch.zeros(1, 2), self.temperature, self.top_k, self.top_p)  # validates

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return apply_decoding(logits, self.temperature, self.top_k, self.top_p)

    def as_dict(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p}


COMPILE_CHOICES = ("off", "auto", "graphs")


@dataclass(frozen=True)
class TraceSettings:
    """Sizes of one run: horizon T, replicates R, branches K, window L (lags traced).

    Parameters
    ----------
    horizon : int
        Number of generated tokens T per replicate (>= 1).
    replicates : int, optional
        Replicates R per document and policy (>= 1; default 1).
    branches : int, optional
        Branches K per replicate (>= 1; default 1).
    window : int, optional
        Window L, the lags traced after a divergence (>= 0; default 0).
    decoding : Decoding, optional
        The decoding transform (default ``Decoding()``: temperature 1, no truncation).
    record : Record, optional
        What is recorded beyond the summary (default ``Record()``: summary only).
    eos_token_ids : tuple of int or None, optional
        Absorbing EOS token ids; ``None`` (the default) uses the model's own, ``()`` none.
    branch_batch : int, "auto" or None, optional
        Most branches traced in one batch (>= 1); ``None`` traces all at once; ``"auto"``
        (the default) picks the largest that fits the device, per document.
    cache_layout : {"auto", "joint", "split", "shared"}, optional
        Cache layout of one-shot policies: ``"joint"`` (P and Q rows in one batch),
        ``"split"`` (two batches), ``"shared"`` (one batch, the prompt's cache and the kept
        entries held once for all replicates) or ``"auto"`` (the default: shared where the
        model allows it, else the cheaper of the other two). Results agree to float noise.
    doc_batch : int or "auto", optional
        Most documents whose overlap paths run as one batch (shared layout only; >= 1).
        ``"auto"`` (the default) batches documents on CUDA while their planned peaks fit the
        device together, up to 128 rows (``2R`` per document); one at a time on CPU.
    compile : {"off", "auto", "graphs"}, optional
        The decoding step's forward pass through ``torch.compile`` (:func:`compile_mode`):
        ``"off"`` (the default: eager), ``"auto"`` (compiled on CUDA, eager elsewhere) or
        ``"graphs"`` (``mode="reduce-overhead"``, CUDA graphs, on CUDA; inductor on CPU).
        Results equal eager to float noise.
    """

    horizon: int
    replicates: int = 1
    branches: int = 1
    window: int = 0
    decoding: Decoding = field(default_factory=Decoding)
    record: Record = field(default_factory=Record)
    # Absorbing EOS ids; None (the default) means the model's own, resolved where a model is
    # traced (kvcouple.tracer.batches.with_model_eos: trace, trace_document, kvcouple trace);
    # () means no absorbing EOS.
    eos_token_ids: tuple[int, ...] | None = None
    # Most branches traced in one batch (each is two rows with a copy of the cache); None: all;
    # "auto": the largest that fits the device, chosen per document by its memory footprint
    # (kvcouple.tracer.memory) in trace/trace_document (every branch when memory is unknown).
    branch_batch: int | Literal["auto"] | None = "auto"
    # Cache layout of one-shot policies (kvcouple.tracer.shape.choose_layout).
    cache_layout: Literal["auto", "joint", "split", "shared"] = "auto"
    # Documents traced as one batch (kvcouple.tracer.planner.document_batches).
    doc_batch: int | Literal["auto"] = "auto"
    # torch.compile of the decoding step (compile_mode).
    compile: Literal["off", "auto", "graphs"] = "off"

    def __post_init__(self) -> None:
        if self.compile not in COMPILE_CHOICES:
            raise ValueError(f"compile must be off, auto or graphs, got {self.compile!r}")
        for name in ("horizon", "replicates", "branches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.branch_batch != "auto" and self.branch_batch is not None:
            if isinstance(self.branch_batch, str) or self.branch_batch < 1:
                raise ValueError(f"branch_batch must be >= 1 or 'auto', got {self.branch_batch!r}")
        if self.cache_layout not in ("auto", "joint", "split", "shared"):
            raise ValueError(
                f"cache_layout must be auto, joint, split or shared, got {self.cache_layout!r}"
            )
        if self.doc_batch != "auto" and (
            isinstance(self.doc_batch, str)
            or isinstance(self.doc_batch, bool)
            or self.doc_batch < 1
        ):
            raise ValueError(f"doc_batch must be >= 1 or 'auto', got {self.doc_batch!r}")
        if self.window < 0:
            raise ValueError(f"window must be >= 0, got {self.window}")

    def sizes(self, vocab_size: int) -> dict[str, int]:
        """The store's dimension sizes for this run (see :mod:`kvcouple.store.schema`)."""
        return {
            "rep": self.replicates,
            "step": self.horizon,
            "branch": self.branches,
            "lag": self.window + 1,
            "k": max(self.record.k, 1),
            "vocab": vocab_size,
        }


def compile_mode(choice: str, device: torch.device | str) -> str | None:
    """The ``torch.compile`` mode of the decoding step for ``TraceSettings.compile`` on
    ``device``: None for eager (``off``; ``auto`` off CUDA), ``"reduce-overhead"`` for
    ``graphs`` on CUDA, ``"default"`` (inductor) otherwise."""
    if choice not in COMPILE_CHOICES:
        raise ValueError(f"compile must be off, auto or graphs, got {choice!r}")
    cuda = torch.device(device).type == "cuda"
    if choice == "off" or (choice == "auto" and not cuda):
        return None
    return "reduce-overhead" if choice == "graphs" and cuda else "default"


# The compile mode of the run in progress (None: eager). While it is set the tracer runs under
# ``no_grad`` instead of ``inference_mode``: compiled graphs cannot take inference tensors
# (the preallocated caches) as inputs they write to, so every tensor the step reads must be
# created outside inference mode, from the prefill on.
_COMPILING: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "kvcouple_tracer_compile", default=None
)


@contextlib.contextmanager
def compiling(mode: str | None) -> Iterator[None]:
    """Run the enclosed tracing with the decoding step compiled in ``mode`` (None: eager)."""
    token = _COMPILING.set(mode)
    try:
        yield
    finally:
        _COMPILING.reset(token)


def active_compile_mode() -> str | None:
    """The compile mode of the run in progress (None: eager)."""
    return _COMPILING.get()


def grad_off() -> contextlib.AbstractContextManager[Any]:
    """No autograd: ``inference_mode`` (cheaper) unless the step is compiled (``no_grad``)."""
    return torch.no_grad() if _COMPILING.get() is not None else torch.inference_mode()


F = TypeVar("F", bound=Callable[..., Any])


def without_grad(fn: F) -> F:
    """Decorator: call ``fn`` under :func:`grad_off` (chosen at call time)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with grad_off():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
