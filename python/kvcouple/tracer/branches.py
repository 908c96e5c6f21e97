"""Residual branches (SPEC section 4): from ``t*`` both sides continue on their own prefixes.

One loop runs every branch of a batch (:func:`run_branch_group`); a :class:`BranchStrategy`
only says how the batch's rows get the path's cache up to ``t*``:

- :class:`ForkBranches` copies each replicate's final path cache and hides the path from
  ``t*`` on (the cache never changes during decoding, so it holds the prefix as it was).
- :class:`ReplayBranches` starts from the prompt cache and re-feeds the path's tokens up to
  ``t*`` (evicting as the path did), needed when the cache changes while decoding.

Each row of the batch has an ``offset``: at loop iteration ``i`` it computes lag
``i - offset`` (forks: offset 0; replays: ``t* - 1``). A row is fed the path token while its
lag is ``<= 0`` (the token of step ``t*`` at lag 0), its own coupled draw afterwards, and
records lags ``0..min(L, T - t*)``; at lag 0 the residuals are drawn (``u0 = 0``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from kvcouple.store.schema import empty_arrays
from kvcouple.tracer.prefill import Prefill
from kvcouple.tracer.records import HostRecords, LagRecords, branch_values, staged_names
from kvcouple.tracer.rows import Rows, StepHook
from kvcouple.tracer.settings import TraceSettings
from kvcouple.tracer.step import EosState, coupled_step
from kvcouple.tracer.trajectories import Trajectories


@dataclass
class Path:
    """What the branches need of the overlap path."""

    arrays: dict[str, np.ndarray]
    hazard: np.ndarray  # (R, T) float64
    fed: torch.Tensor  # (R, T) token fed at each step (step 1: the last prompt token)
    rows: Rows | None  # the path's batch with its final cache (None once not needed)


class BranchStrategy(Protocol):
    """How a batch of branches ``(replicate rr[i], time ts[i])`` gets the path's prefix."""

    def start(
        self, rr: torch.Tensor, ts: torch.Tensor, lags: torch.Tensor
    ) -> tuple[Rows, torch.Tensor]:
        """The batch's rows (``B`` P rows, then ``B`` Q rows), with room for every step up to
        each branch's last lag ``lags``, and each row's offset."""
        ...


class ForkBranches:
    """Copy each replicate's path cache; hide the path from ``t*`` on.

    ``prefix_length``: the prompt's prefix length (``n - 1``), or per replicate when the
    path's rows hold several documents (a batch of documents)."""

    def __init__(self, path: Path, prefix_length: int | torch.Tensor):
        self.path = path
        self.prefix_length = prefix_length

    def start(
        self, rr: torch.Tensor, ts: torch.Tensor, lags: torch.Tensor
    ) -> tuple[Rows, torch.Tensor]:
        if self.path.rows is None:
            raise ValueError("forking branches needs the path's final cache")
        replicates = self.path.fed.shape[0]
        index = torch.cat([rr, rr + replicates])
        length = self.prefix_length
        if isinstance(length, torch.Tensor):
            length = length[rr]
        column = torch.cat([length + ts, length + ts]) - 1  # path column of step t*
        steps = int(lags.max()) + 1  # re-fed t*, then the lags
        return self.path.rows.fork(index, column, steps), torch.zeros_like(ts)


class ReplayBranches:
    """Start from the prompt cache and re-feed the path up to ``t*``; ``make_hook(rr)`` builds
    the decode-time evictor of rows following replicates ``rr``."""

    def __init__(
        self,
        model: Any,
        pre: Prefill,
        kept: list[tuple[torch.Tensor, torch.Tensor]],
        make_hook: Callable[[torch.Tensor], StepHook],
    ):
        self.model, self.pre, self.kept, self.make_hook = model, pre, kept, make_hook

    def start(
        self, rr: torch.Tensor, ts: torch.Tensor, lags: torch.Tensor
    ) -> tuple[Rows, torch.Tensor]:
        steps = int((ts - 1 + lags).max()) + 1  # the path up to t*, then the lags
        rows = Trajectories.start(
            self.model, self.pre, self.kept, int(rr.shape[0]), self.make_hook(rr), steps=steps
        )
        return rows, ts - 1


def run_branches(
    strategy: BranchStrategy,
    path: Path,
    settings: TraceSettings,
    times: np.ndarray,
    branch_u: torch.Tensor,
    vocab_size: int,
) -> tuple[dict[str, np.ndarray], int, int]:
    """Every branch of every replicate, ``settings.branch_batch`` at a time. Returns the
    branch arrays of one (document, policy), the tokens generated and the batches run."""
    out = empty_arrays(
        settings.record, settings.sizes(vocab_size), ("doc", "policy"), having="branch"
    )
    out["branch_step"][:] = times
    rr, kk = np.nonzero(times > 0)
    size = settings.branch_batch if isinstance(settings.branch_batch, int) else max(rr.size, 1)
    tokens = batches = 0
    for first in range(0, rr.size, size):
        group = slice(first, first + size)
        tokens += run_branch_group(
            strategy, path, settings, rr[group], kk[group], times, branch_u, out
        )
        batches += 1
    return out, tokens, batches


def run_branch_group(
    strategy: BranchStrategy,
    path: Path,
    settings: TraceSettings,
    rr: np.ndarray,
    kk: np.ndarray,
    times: np.ndarray,
    branch_u: torch.Tensor,
    out: dict[str, np.ndarray],
) -> int:
    """Branches ``(rr[i], kk[i])`` in one batch; writes into ``out``, returns tokens fed."""
    T, L = settings.horizon, settings.window
    device = path.fed.device
    ts_np = times[rr, kk]
    B = rr.size
    rr_t, kk_t = torch.as_tensor(rr, device=device), torch.as_tensor(kk, device=device)
    ts = torch.as_tensor(ts_np, device=device)
    lags = (T - ts).clamp(max=L)  # last lag each branch records
    rows, offset = strategy.start(rr_t, ts, lags)
    iterations = int((offset + lags).max()) + 1
    fed = path.fed[rr_t]  # (B, T)
    arange = torch.arange(B, device=device)
    # Whole distributions go to pinned host slots as they are made: at iteration i the rows
    # recording (lag 0..lags) are known on the host, so slot j holds (row[j], lag[j]) and is
    # scattered into ``out`` after one synchronisation (the rest never touches the device).
    # The small records are written at each row's lag into preallocated device buffers
    # (LagRecords: one op per variable and step) and copied once at the end.
    lag_grid = np.arange(iterations)[:, None] - offset.cpu().numpy()[None, :]
    it, row = np.nonzero((lag_grid >= 0) & (lag_grid <= np.minimum(T - ts_np, L)))
    bounds = np.searchsorted(it, np.arange(iterations + 1)).tolist()
    recording = torch.as_tensor(row, device=device)
    staged = HostRecords(staged_names(settings.record, "branch_"), row.size, device)
    names = [n for n in out if n != "branch_step" and n not in staged.names]
    records = LagRecords({name: out[name][rr, kk] for name in names}, device)
    spare = L + 1  # the column rows write at a step they do not record
    eos = EosState(settings.eos_token_ids, 2 * B, device)
    own = torch.zeros(2 * B, dtype=torch.long, device=device)
    # Every iteration's inputs laid out once, (iterations, rows): each row's lag, whether it
    # is fed the path's token (lag <= 0) and which, its uniforms (lag 0: the residuals),
    # whether it records and where. A step then runs only what depends on the draws.
    lag = torch.arange(iterations, device=device)[:, None] - offset[None, :]
    teacher = (lag <= 0).repeat(1, 2)
    path_token = fed[arange[None, :], (ts + lag - 1).clamp(0, T - 1)].repeat(1, 2)
    u = branch_u[lag.clamp(0, L), rr_t[None, :], kk_t[None, :]]  # (iterations, B, 3)
    u[..., 0] = torch.where(lag == 0, 0.0, u[..., 0])
    active = (lag >= 0) & (lag <= lags)
    both = active.repeat(1, 2)
    slot = torch.where(active, lag, spare)
    per_step = zip(teacher, path_token, u, both, slot, strict=True)  # (views, no ops a step)
    for i, (teach, fed_token, step_u, recorded, column) in enumerate(per_step):
        tokens = torch.where(teach, fed_token, own)
        step = coupled_step(rows, tokens, settings.decoding, eos, step_u)
        drawn = torch.cat([step.x, step.y])
        own = torch.where(recorded, drawn, own)
        values = branch_values(settings.record, step.probs, step.x, step.y, step.tv)
        staged.take(values, recording[bounds[i] : bounds[i + 1]])
        records.write(values, column)
        eos.advance(drawn, recorded)
    for name, value in records.arrays().items():
        out[name][rr, kk] = value
    staged.scatter(out, (rr[row], kk[row], lag_grid[it, row]))
    out["branch_tv"][rr, kk, 0] = path.hazard[rr, ts_np - 1]
    return 2 * B * iterations
