"""Count, on any device, what a GPU step would pay for: ATen ops (a proxy for kernel launches
and eager host overhead) and the ops that force a device-to-host synchronisation.

On CPU nothing synchronises, but the same calls would on CUDA, so they are counted by what
they are: ``aten._local_scalar_dense`` (``.item()``, ``bool(t)``, ``int(t)``), ops whose output
size depends on the data (``nonzero``, ``masked_select``, boolean-mask indexing, ``unique``),
and host copies (``.cpu()``, ``.tolist()``, ``.numpy()``).

:func:`per_step` reports marginal counts per decoding step: the difference between two runs
of different horizons divided by the difference of the horizons, so prefill, setup and the
final host copies (the same in both runs) drop out.

This module needs torch (the ``tracer`` extra).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# ATen ops that wait for the device: a scalar read, or an output whose size is data-dependent.
SYNC_OPS = {
    "aten._local_scalar_dense",
    "aten.nonzero",
    "aten.masked_select",
    "aten._unique",
    "aten._unique2",
    "aten.unique_dim",
    "aten.unique_consecutive",
}
# repeat_interleave with tensor repeats and no output_size must read the repeats back.
DATA_SIZED_REPEATS = "aten.repeat_interleave"
# Tensor methods that copy to the host (seen through torch-function dispatch).
HOST_COPIES = {"cpu", "tolist", "numpy"}


def _op_name(func: Any) -> str:
    # "aten.index.Tensor" -> "aten.index"
    name = str(func)
    return name.rsplit(".", 1)[0] if name.count(".") >= 2 else name


@dataclass
class OpCounts:
    """What one counted region ran."""

    ops: int = 0
    syncs: int = 0
    sync_sites: Counter[str] = field(default_factory=Counter)
    by_op: Counter[str] = field(default_factory=Counter)


class _DispatchCounter(TorchDispatchMode):
    def __init__(self, counts: OpCounts) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = _op_name(func)
        self.counts.ops += 1
        self.counts.by_op[name] += 1
        sync = (
            name in SYNC_OPS
            or (
                name == DATA_SIZED_REPEATS
                and str(func).endswith("Tensor")
                and (kwargs or {}).get("output_size") is None
            )
            or (
                name in ("aten.index", "aten.index_put", "aten._index_put_impl")
                and any(
                    isinstance(i, torch.Tensor) and i.dtype == torch.bool
                    for i in (
                        args[1] if len(args) > 1 and isinstance(args[1], list | tuple) else ()
                    )
                )
            )
        )
        if sync:
            self.counts.syncs += 1
            self.counts.sync_sites[name] += 1
        return func(*args, **(kwargs or {}))


class _HostCopyCounter(TorchFunctionMode):
    def __init__(self, counts: OpCounts) -> None:
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in HOST_COPIES:
            self.counts.syncs += 1
            self.counts.sync_sites[f"Tensor.{name}"] += 1
        return func(*args, **(kwargs or {}))


class count_ops:  # noqa: N801 (used as a context manager, like torch's modes)
    """``with count_ops() as counts: ...`` counts every ATen op and every sync in the block."""

    def __init__(self) -> None:
        self.counts = OpCounts()
        self._modes = (_HostCopyCounter(self.counts), _DispatchCounter(self.counts))

    def __enter__(self) -> OpCounts:
        for mode in self._modes:
            mode.__enter__()
        return self.counts

    def __exit__(self, *exc: Any) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


@dataclass(frozen=True)
class StepCounts:
    """Marginal counts per decoding step."""

    ops_per_step: float
    syncs_per_step: float
    sync_sites_per_step: dict[str, float]


def per_step(run: Callable[[int], Any], horizons: tuple[int, int] = (4, 12)) -> StepCounts:
    """Marginal ops and syncs per step of ``run(horizon)``, from two horizons ``h1 < h2``."""
    h1, h2 = horizons
    if not 0 < h1 < h2:
        raise ValueError(f"horizons must be 0 < h1 < h2, got {horizons}")
    run(h1)  # warm-up: lazy initialisation and caches are not steps
    with count_ops() as short:
        run(h1)
    with count_ops() as long:
        run(h2)
    steps = h2 - h1
    sites = {
        k: (long.sync_sites[k] - short.sync_sites[k]) / steps
        for k in set(long.sync_sites) | set(short.sync_sites)
        if long.sync_sites[k] != short.sync_sites[k]
    }
    return StepCounts(
        ops_per_step=(long.ops - short.ops) / steps,
        syncs_per_step=(long.syncs - short.syncs) / steps,
        sync_sites_per_step=sites,
    )


def generate_peer(model: Any, prompt: list[int], rows: int) -> Callable[[int], None]:
    """``run(horizon)`` for :func:`per_step`: ``model.generate`` sampling exactly ``horizon``
    new tokens for ``rows`` copies of ``prompt`` (the peer the tracer's step is measured against)."""

    def run(horizon: int) -> None:
        ids = torch.tensor([prompt] * rows)
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                top_k=0,
                max_new_tokens=horizon,
                min_new_tokens=horizon,
                pad_token_id=0,
            )

    return run
