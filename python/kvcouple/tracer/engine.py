"""Coupled generation for one prompt and one policy (SPEC section 4, RB-CMC), on the device.

1. **Overlap path.** P rows (full cache) and Q rows (evicted cache) of ``R`` replicates run as
   one batch of ``2R``; each step both kernels see the same prefix, the path token is drawn
   from the overlap ``min(p, q)`` with the torch sampler (``u0 = 1``), and the hazard, KL
   both ways, entropies and top-1 agreement are computed on the device. A step with no
   overlap (hazard 1) stops the path.
2. **Branches.** ``K`` branch times per replicate are drawn from ``W_{t-1} h_t / O-hat``; each
   branch copies its replicate's cache, hides the path entries from ``t*`` on, re-feeds the
   token of step ``t*`` to get ``(p, q)`` at ``t*``, draws ``X ~ r^P``, ``Y ~ r^Q``
   (``u0 = 0``), then continues both trajectories with the maximal coupling for ``L`` lags,
   all branches in one batch.

EOS is absorbing: once a trajectory emits an EOS id its kernel is a point mass on that id.
Every uniform comes from a NumPy generator seeded with ``(seed, doc index, policy index)``,
drawn in a fixed order, so a document's records depend on nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from kvcouple.policies import Policy
from kvcouple.store.schema import (
    NO_GATE,
    NO_TOKEN,
    Record,
    distribution_variables,
    empty_arrays,
    variables,
)
from kvcouple.torch_coupling import apply_decoding, couple_rows
from kvcouple.tracer import compat
from kvcouple.tracer.prefill import Prefill, gather_kept, select


@dataclass(frozen=True)
class Decoding:
    """The decoding transform shared by both kernels."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        apply_decoding(torch.zeros(1, 2), self.temperature, self.top_k, self.top_p)  # validates

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return apply_decoding(logits, self.temperature, self.top_k, self.top_p)

    def as_dict(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p}


@dataclass(frozen=True)
class TraceSettings:
    """Sizes of one run: horizon T, replicates R, branches K, window L (lags traced)."""

    horizon: int
    replicates: int = 1
    branches: int = 1
    window: int = 0
    decoding: Decoding = field(default_factory=Decoding)
    record: Record = field(default_factory=Record)
    # Absorbing EOS ids; None (the default) means the model's own, resolved by `trace`
    # exactly as `kvcouple trace` does; () means no absorbing EOS.
    eos_token_ids: tuple[int, ...] | None = None
    # Most branches traced in one batch (each is two rows with a copy of the cache); None: all;
    # "auto": the largest that fits the device, chosen per document by the memory plan
    # (kvcouple.tracer.memory) in trace/trace_document (every branch when memory is unknown).
    branch_batch: int | Literal["auto"] | None = "auto"

    def __post_init__(self) -> None:
        for name in ("horizon", "replicates", "branches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.branch_batch != "auto" and self.branch_batch is not None:
            if isinstance(self.branch_batch, str) or self.branch_batch < 1:
                raise ValueError(f"branch_batch must be >= 1 or 'auto', got {self.branch_batch!r}")
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


class _Rows:
    """A batch of trajectories sharing one cache tensor per layer, with per-row visibility."""

    def __init__(
        self,
        model: Any,
        kv: list[tuple[torch.Tensor, torch.Tensor]],
        valid: torch.Tensor,
        positions: torch.Tensor,
        padded: bool,
        evictor: Any = None,
        key_positions: list[torch.Tensor] | None = None,
    ):
        self.model = model
        self.cache = compat.cache_from_tensors(kv, key_positions)
        self.valid = valid
        self.positions = positions
        self.padded = padded or evictor is not None
        self.dtype = kv[0][0].dtype
        # A decode-time policy: evicts from some rows after each step (see decode_eviction).
        self.evictor = evictor

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per row; returns ``(rows, vocab)`` logits."""
        ones = torch.ones(self.valid.shape[0], 1, dtype=torch.bool, device=self.valid.device)
        self.valid = torch.cat([self.valid, ones], dim=1)
        mask = compat.additive_mask(self.valid, self.dtype) if self.padded else None
        if self.evictor is None:
            logits = compat.forward(
                self.model, tokens[:, None], self.cache, self.positions[:, None], mask
            )
        else:
            with self.evictor.capture:
                logits = compat.forward(
                    self.model, tokens[:, None], self.cache, self.positions[:, None], mask
                )
            self.evictor.after_step(self)
        self.positions = self.positions + 1
        return logits


def _absorb(probs: torch.Tensor, done: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """EOS is absorbing: rows that emitted EOS become a point mass on it."""
    point = torch.nn.functional.one_hot(last, probs.shape[-1]).to(probs.dtype)
    return torch.where(done[:, None], point, probs)


def _metrics(p: torch.Tensor, q: torch.Tensor) -> dict[str, torch.Tensor]:
    """KL both ways, entropies (nats) and top-1 agreement per row, on the device."""
    lp, lq = torch.log(p), torch.log(q)
    zero = torch.zeros((), dtype=p.dtype, device=p.device)
    return {
        "kl_pq": torch.where(p > 0, p * (lp - lq), zero).sum(-1),
        "kl_qp": torch.where(q > 0, q * (lq - lp), zero).sum(-1),
        "entropy_p": -torch.where(p > 0, p * lp, zero).sum(-1),
        "entropy_q": -torch.where(q > 0, q * lq, zero).sum(-1),
        "top1_agree": p.argmax(-1) == q.argmax(-1),
    }


def _distribution_records(
    record: Record, side: str, probs: torch.Tensor, prefix: str
) -> dict[str, torch.Tensor]:
    """Top-k ids/probs/tail mass, or the whole distribution, for one side."""
    if record.kind == "topk":
        k = min(record.k, probs.shape[-1])
        vals, ids = torch.topk(probs, k, dim=-1)
        pad = record.k - k
        if pad:
            fills = distribution_variables(record)
            ids = torch.nn.functional.pad(ids, (0, pad), value=fills["topk_ids_p"].fill)
            vals = torch.nn.functional.pad(vals, (0, pad), value=fills["topk_probs_p"].fill)
        return {
            f"{prefix}topk_ids_{side}": ids.to(torch.int32),
            f"{prefix}topk_probs_{side}": vals.to(torch.float32),
            f"{prefix}tail_mass_{side}": (1.0 - vals.nan_to_num(0.0).sum(-1)).clamp(min=0.0),
        }
    if record.kind == "full":
        return {f"{prefix}{side}": probs.to(torch.float16).cpu()}
    return {}


def _branch_record(
    record: Record,
    p: torch.Tensor,
    q: torch.Tensor,
    x: torch.Tensor,
    y: torch.Tensor,
    delta: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """What one branch step records: TV, mismatch, both tokens, and the distributions."""
    rec = {
        "branch_tv": delta,
        "branch_mismatch": (x != y).to(torch.int8),
        "branch_tokens_p": x,
        "branch_tokens_q": y,
    }
    for side, probs_side in (("p", p), ("q", q)):
        rec.update(_distribution_records(record, side, probs_side, "branch_"))
    return rec


_SCHEMA = variables(Record())


def _host(steps: list[dict[str, torch.Tensor]], axis: int) -> dict[str, np.ndarray]:
    """Stack per-step device records along ``axis`` and bring them to the host at once."""
    if not steps:
        return {}
    return {
        name: torch.stack([s[name] for s in steps], dim=axis).cpu().numpy() for name in steps[0]
    }


@dataclass
class _Path:
    arrays: dict[str, np.ndarray]
    hazard: np.ndarray  # (R, T) float64
    fed: torch.Tensor  # (R, T) token fed at each step (step 1: last prompt token)
    rows: _Rows | None  # None once the branches no longer need the path's cache


def initial_rows(
    model: Any,
    pre: Prefill,
    kept: list[tuple[torch.Tensor, torch.Tensor]],
    copies: int,
    evictor: Any = None,
    idx: torch.Tensor | None = None,
) -> _Rows:
    """``copies`` P rows on the full prefix cache, then ``copies`` Q rows on the kept entries
    (left-padded to the prefix length, the padding hidden), all about to feed the last prompt
    token at position ``n - 1``. ``idx``: the kept positions ``(layers, kv_heads, keep)``,
    which sliding-window layers need."""
    n1 = pre.prefix_length
    keep = kept[0][0].shape[2]
    device = pre.input_ids.device
    pad = (0, 0, n1 - keep, 0)
    kv: list[tuple[torch.Tensor, torch.Tensor]] = []
    for (kp, vp), (kq, vq) in zip(pre.kv, kept, strict=True):
        k, v = (
            torch.cat(
                [
                    full.expand(copies, -1, -1, -1),
                    torch.nn.functional.pad(part, pad).expand(copies, -1, -1, -1),
                ]
            )
            for full, part in ((kp, kq), (vp, vq))
        )
        kv.append((k, v))
    valid = torch.ones(2 * copies, n1, dtype=torch.bool, device=device)
    valid[copies:, : n1 - keep] = False
    positions = torch.full((2 * copies,), n1, device=device)
    key_positions = None
    if idx is not None:
        full_pos = torch.arange(n1, device=device).expand(copies, idx.shape[1], n1)
        key_positions = [
            torch.cat(
                [
                    full_pos,
                    torch.nn.functional.pad(kept_pos.to(device), (n1 - keep, 0)).expand(
                        copies, -1, -1
                    ),
                ]
            )
            for kept_pos in idx
        ]
    return _Rows(model, kv, valid, positions, keep < n1, evictor, key_positions)


def _overlap_path(
    model: Any,
    pre: Prefill,
    kept: list[tuple[torch.Tensor, torch.Tensor]],
    settings: TraceSettings,
    path_u: torch.Tensor,
    evictor: Any = None,
    idx: torch.Tensor | None = None,
) -> _Path:
    R, T = settings.replicates, settings.horizon
    device = pre.input_ids.device
    rows = initial_rows(model, pre, kept, R, evictor, idx)

    eos = torch.tensor(settings.eos_token_ids or (), dtype=torch.long, device=device)
    alive = torch.ones(R, dtype=torch.bool, device=device)
    done = torch.zeros(R, dtype=torch.bool, device=device)
    last = torch.zeros(R, dtype=torch.long, device=device)
    tokens = torch.full((R,), int(pre.input_ids[-1]), dtype=torch.long, device=device)
    u = torch.zeros(R, 3, dtype=torch.float64, device=device)
    u[:, 0] = 1.0  # u0 = 1: always the overlap branch
    fed, steps = [], []
    for t in range(T):
        fed.append(tokens)
        probs = settings.decoding.probs(rows.step(torch.cat([tokens, tokens])))
        if eos.numel():
            probs = _absorb(probs, torch.cat([done, done]), torch.cat([last, last]))
        p, q = probs[:R], probs[R:]
        u[:, 1] = path_u[t]
        z, _, delta, overlap = couple_rows(p, q, u)
        has_overlap = overlap > 0
        rec = {
            "hazard": torch.where(alive, torch.where(has_overlap, delta, 1.0), 0.0),
            "tokens": torch.where(alive & has_overlap, z, NO_TOKEN),
        }
        for name, value in _metrics(p, q).items():
            rec[name] = torch.where(alive, value, _SCHEMA[name].fill)
        for side, probs_side in (("p", p), ("q", q)):
            for name, value in _distribution_records(settings.record, side, probs_side, "").items():
                rec[name] = value
        steps.append(rec)
        alive = alive & has_overlap
        if eos.numel():
            newly = alive & ~done & torch.isin(z, eos)
            last = torch.where(newly, z, last)
            done = done | newly
        tokens = torch.where(alive, z, 0)
    arrays = _host(steps, axis=1)
    # After a stop (a step with no overlap) nothing is observed: blank the distributions.
    stopped = (arrays["tokens"] == NO_TOKEN) & (arrays["hazard"] == 0)
    for name, var in distribution_variables(settings.record).items():
        arrays[name][stopped] = var.fill
    return _Path(arrays, arrays["hazard"].astype(np.float64), torch.stack(fed, dim=1), rows)


def branch_times(hazard: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Draw branch times ``t* ~ W_{t-1} h_t / O-hat`` (1-based; 0 where ``O-hat = 0``).

    ``hazard``: ``(R, T)``; ``u``: ``(R, K)`` uniforms. Inverse CDF in time order.
    """
    survival_before = np.cumprod(
        np.concatenate([np.ones_like(hazard[:, :1]), 1 - hazard[:, :-1]], axis=1), axis=1
    )
    weight = survival_before * hazard
    total = weight.sum(axis=1)
    cum = np.cumsum(weight, axis=1)
    out = np.zeros(u.shape, dtype=np.int64)
    for r in range(hazard.shape[0]):
        if total[r] <= 0:
            continue
        idx = (cum[r][None, :] <= (u[r] * total[r])[:, None]).sum(axis=1)
        last_positive = int(np.flatnonzero(weight[r] > 0)[-1])
        out[r] = np.where(idx < hazard.shape[1], idx, last_positive) + 1
    return out


def _branches(
    model: Any,
    pre: Prefill,
    path: _Path,
    settings: TraceSettings,
    times: np.ndarray,
    branch_u: torch.Tensor,
) -> tuple[dict[str, np.ndarray], int, int]:
    """Every branch of every replicate, ``branch_batch`` branches at a time. Returns the
    arrays, the tokens generated and the number of batches run."""
    out = _empty_branch_arrays(settings, pre)
    out["branch_step"][:] = times
    rr, kk = np.nonzero(times > 0)
    size = settings.branch_batch if isinstance(settings.branch_batch, int) else max(rr.size, 1)
    tokens = batches = 0
    for start in range(0, rr.size, size):
        batches += 1
        tokens += _branch_group(
            model,
            pre,
            path,
            settings,
            rr[start : start + size],
            kk[start : start + size],
            times,
            branch_u,
            out,
        )
    return out, tokens, batches


def _branch_group(
    model: Any,
    pre: Prefill,
    path: _Path,
    settings: TraceSettings,
    rr: np.ndarray,
    kk: np.ndarray,
    times: np.ndarray,
    branch_u: torch.Tensor,
    out: dict[str, np.ndarray],
) -> int:
    """Branches ``(rr[i], kk[i])`` in one batch: copy each replicate's path cache, hide the
    path from ``t*`` on, re-feed step ``t*``'s token, draw the residuals, continue ``L`` lags.
    Writes into ``out``; returns the tokens generated."""
    R, T, L = settings.replicates, settings.horizon, settings.window
    n1 = pre.prefix_length
    ts = times[rr, kk]
    B = rr.size
    device = pre.input_ids.device
    rr_t = torch.as_tensor(rr, device=device)
    kk_t = torch.as_tensor(kk, device=device)
    ts_t = torch.as_tensor(ts, device=device)
    index = torch.cat([rr_t, rr_t + R])
    assert path.rows is not None
    kv = [
        (k.index_select(0, index), v.index_select(0, index))
        for k, v in compat.cache_tensors(path.rows.cache)
    ]
    valid = path.rows.valid.index_select(0, index)
    columns = torch.arange(valid.shape[1], device=device)
    first_hidden = (n1 + torch.cat([ts_t, ts_t]) - 1)[:, None]  # path column of step t*
    valid = valid & (columns[None, :] < first_hidden)
    positions = torch.cat([ts_t, ts_t]) + n1 - 1
    key_positions = compat.cache_positions(path.rows.cache)
    if key_positions is not None:
        key_positions = [p.index_select(0, index) for p in key_positions]
    rows = _Rows(model, kv, valid, positions, padded=True, key_positions=key_positions)
    tokens = path.fed[rr_t, ts_t - 1]
    tokens = torch.cat([tokens, tokens])

    eos = torch.tensor(settings.eos_token_ids or (), dtype=torch.long, device=device)
    done = torch.zeros(2 * B, dtype=torch.bool, device=device)
    last = torch.zeros(2 * B, dtype=torch.long, device=device)
    lags = min(L, T - int(ts.min()))
    steps = []
    for lag in range(lags + 1):
        probs = settings.decoding.probs(rows.step(tokens))
        if eos.numel():
            probs = _absorb(probs, done, last)
        p, q = probs[:B], probs[B:]
        u = branch_u[lag][rr_t, kk_t]
        if lag == 0:
            u = u.clone()
            u[:, 0] = 0.0  # u0 = 0: the residuals (the branch starts with X != Y)
        x, y, delta, _ = couple_rows(p, q, u)
        steps.append(_branch_record(settings.record, p, q, x, y, delta))
        tokens = torch.cat([x, y])
        if eos.numel():
            newly = ~done & torch.isin(tokens, eos)
            last = torch.where(newly, tokens, last)
            done = done | newly
    got = _host(steps, axis=1)  # (B, lags + 1, ...)
    got["branch_tv"][:, 0] = path.hazard[rr, ts - 1]
    inside = (ts[:, None] + np.arange(lags + 1)[None, :]) <= T
    for name, value in got.items():
        target = out[name]
        fill = target[rr, kk, : lags + 1]
        mask = inside.reshape(inside.shape + (1,) * (value.ndim - 2))
        target[rr, kk, : lags + 1] = np.where(mask, value.astype(target.dtype), fill)
    return 2 * B * (lags + 1)


def _empty_branch_arrays(settings: TraceSettings, pre: Prefill) -> dict[str, np.ndarray]:
    """Every branch variable of one (document, policy), at its schema fill value."""
    sizes = settings.sizes(pre.vocab_size)
    return empty_arrays(settings.record, sizes, ("doc", "policy"), having="branch")


@dataclass
class PolicyTrace:
    """One policy's records for one document: every store variable of the (document, policy)
    region, without the doc/policy axes (``kept_length`` and the gate variables 0-d)."""

    arrays: dict[str, np.ndarray]
    generated_tokens: int
    branch_batches: int


def random_streams(
    seed: int, doc_index: int, policy_index: int, settings: TraceSettings
) -> dict[str, np.ndarray]:
    """Every uniform one (document, policy) uses, drawn in a fixed order."""
    rng = np.random.default_rng([seed, doc_index, policy_index])
    R, K, T, L = settings.replicates, settings.branches, settings.horizon, settings.window
    return {
        "policy_seed": rng.integers(0, 2**62, size=1),
        "path": rng.random((T, R)),
        "branch_time": rng.random((R, K)),
        "branch": rng.random((L + 1, R, K, 3)),
    }


@torch.inference_mode()
def trace_policy(
    model: Any,
    pre: Prefill,
    policy: Policy,
    settings: TraceSettings,
    seed: int,
    doc_index: int,
    policy_index: int,
) -> PolicyTrace:
    """Coupled generation of one document under one policy."""
    streams = random_streams(seed, doc_index, policy_index, settings)
    device = pre.input_ids.device
    gen = torch.Generator().manual_seed(int(streams["policy_seed"][0]))
    idx = select(policy, pre, gen)
    kept = gather_kept(pre.kv, idx)
    path_u = torch.as_tensor(streams["path"], device=device)
    branch_u = torch.as_tensor(streams["branch"], device=device)
    if getattr(policy, "decode_time", False):
        from kvcouple.policies import H2O
        from kvcouple.tracer.decode_eviction import DecodeH2O, replay_branches

        if not isinstance(policy, H2O):
            raise ValueError(
                f"policy {policy.spec()}: the tracer evicts during decoding only for h2o"
            )

        def make_evictor(copies: int) -> DecodeH2O:
            return DecodeH2O(model, pre, idx, policy, copies)

        path = _overlap_path(model, pre, kept, settings, path_u, make_evictor(settings.replicates))
        path.rows = None  # branches replay from the prompt cache; free the path's cache
        times = branch_times(path.hazard, streams["branch_time"])
        branch_arrays = _empty_branch_arrays(settings, pre)
        branch_arrays["branch_step"][:] = times
        rr, kk = np.nonzero(times > 0)
        size = settings.branch_batch or max(rr.size, 1)
        branch_tokens = batches = 0
        for start in range(0, rr.size, size):
            r, k = rr[start : start + size], kk[start : start + size]
            group_times = np.zeros_like(times)
            group_times[r, k] = times[r, k]
            got, tokens = replay_branches(
                model, pre, kept, make_evictor, path, settings, group_times, branch_u
            )
            for name, value in got.items():
                branch_arrays[name][r, k] = value[r, k]
            branch_tokens += tokens
            batches += 1
    else:
        path = _overlap_path(model, pre, kept, settings, path_u, idx=idx)
        times = branch_times(path.hazard, streams["branch_time"])
        branch_arrays, branch_tokens, batches = _branches(
            model, pre, path, settings, times, branch_u
        )
    kept_length = idx.shape[-1] + 1
    arrays = {
        **path.arrays,
        **branch_arrays,
        "kept_length": np.asarray(kept_length, dtype=np.int32),
        "gate_score": np.asarray(np.nan, dtype=np.float32),
        "gate_class": np.asarray(NO_GATE, dtype=np.int8),
        "eviction_applied": np.asarray(
            kept_length < pre.prompt_length or policy.decode_time, dtype=bool
        ),
    }
    del path
    return PolicyTrace(arrays, 2 * settings.replicates * settings.horizon + branch_tokens, batches)
