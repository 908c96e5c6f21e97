"""Decode-time eviction (``h2o:...,mode=decode``): the evicted cache stays at a fixed budget.

After each generated token, in every Q row, layer and KV head, the new query's attention
(averaged over the query heads of the group) is added to each visible entry's accumulated
score; when a row holds more than ``budget`` visible entries, the entry of lowest score among
those outside the ``recent`` share (by original position) is evicted. The cache tensor keeps
one shape for the whole batch: the newest entry is moved into the evicted slot and its own
column is hidden for that row, so the usual per-row attention mask does the rest.

Branches cannot start from the path's final cache (later evictions overwrote it), so for
decode-time policies each branch replays its path from the prompt cache: its rows are fed the
path tokens up to ``t*`` (evicting as the path did), then continue on their own; all branches
run in one batch, each at its own phase.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvcouple.policies import H2O
from kvcouple.torch_coupling import couple_rows
from kvcouple.tracer import compat
from kvcouple.tracer.prefill import Prefill


class DecodeH2O:
    """Keeps ``copies`` Q rows (those after the first ``copies`` rows) at the H2O budget."""

    def __init__(self, model: Any, pre: Prefill, idx: torch.Tensor, policy: H2O, copies: int):
        self.capture = compat.QueryCapture(model)
        self.rows = slice(copies, 2 * copies)
        keep = idx.shape[-1]
        self.budget = keep + 1  # the kept prompt entries plus the re-fed last token
        self.n_recent = policy.recent_count(self.budget)
        ctx = pre.context()
        self.group = ctx.group_size
        self.scaling = self.capture.scaling
        n1 = pre.prefix_length
        self.acc: list[torch.Tensor] = []
        self.pos: list[torch.Tensor] = []
        for layer in range(ctx.num_layers):
            score = ctx.group_mean(ctx.accumulated_attention(layer)).gather(1, idx[layer])
            score = torch.nn.functional.pad(score, (n1 - keep, 0))
            pos = torch.nn.functional.pad(idx[layer], (n1 - keep, 0), value=-1)
            self.acc.append(score.expand(copies, -1, -1).clone())
            self.pos.append(pos.expand(copies, -1, -1).clone())

    @torch.inference_mode()
    def after_step(self, rows: Any) -> None:
        """Accumulate the new queries' attention, then evict one entry per layer and head from
        every row above budget."""
        valid = rows.valid[self.rows]  # (Bq, S) including the new column
        current = rows.positions[self.rows]  # position of the token just fed
        over = valid.sum(-1) > self.budget  # (Bq,)
        protected_from = (current - self.n_recent)[:, None, None]
        for layer, (keys, values) in enumerate(compat.cache_tensors(rows.cache)):
            kq, vq = keys[self.rows], values[self.rows]  # views into the cache
            q = self.capture.batch_queries(layer, rows=self.rows).float()  # (Bq, H, 1, D)
            k = kq.float().repeat_interleave(self.group, dim=1)
            logits = torch.matmul(q, k.transpose(-1, -2))[:, :, 0] * self.scaling
            logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
            probs = torch.softmax(logits, dim=-1)
            probs = probs.reshape(probs.shape[0], -1, self.group, probs.shape[-1]).mean(2)
            acc = torch.cat([self.acc[layer], torch.zeros_like(probs[..., :1])], -1) + probs
            pos = torch.cat([self.pos[layer], current[:, None, None].expand_as(probs[..., :1])], -1)
            candidate = valid[:, None, :] & (pos <= protected_from)
            victim = torch.where(candidate, acc, float("inf")).argmin(-1)  # (Bq, Hkv)
            oldest = torch.where(valid[:, None, :], pos, torch.iinfo(pos.dtype).max).argmin(-1)
            victim = torch.where(candidate.any(-1), victim, oldest)
            for tensor in (kq, vq, acc, pos):
                index = victim[:, :, None]
                if tensor.dim() == 4:
                    index = index[..., None].expand(-1, -1, 1, tensor.shape[-1])
                newest = tensor[:, :, -1:]
                shape = (-1,) + (1,) * (tensor.dim() - 1)
                moved = torch.where(over.reshape(shape), newest, tensor.gather(2, index))
                tensor.scatter_(2, index, moved)
            self.acc[layer], self.pos[layer] = acc, pos
        rows.valid[self.rows.start : self.rows.stop, -1] = ~over


def replay_branches(
    model: Any,
    pre: Prefill,
    kept: list[tuple[torch.Tensor, torch.Tensor]],
    make_evictor: Any,
    path: Any,
    settings: Any,
    times: np.ndarray,
    branch_u: torch.Tensor,
) -> tuple[dict[str, np.ndarray], int]:
    """Branches of a decode-time policy, each replaying its path up to ``t*``."""
    from kvcouple.tracer.engine import (
        _absorb,
        _branch_record,
        _empty_branch_arrays,
        initial_rows,
    )

    T, L = settings.horizon, settings.window
    out = _empty_branch_arrays(settings, pre)
    out["branch_step"][:] = times
    rr, kk = np.nonzero(times > 0)
    if rr.size == 0:
        return out, 0
    ts = times[rr, kk]
    B = rr.size
    device = pre.input_ids.device
    rows = initial_rows(model, pre, kept, B, make_evictor(B))
    rr_t, kk_t = torch.as_tensor(rr, device=device), torch.as_tensor(kk, device=device)
    ts_t = torch.as_tensor(ts, device=device)
    fed = path.fed[rr_t]  # (B, T)
    names = ["branch_tv", "branch_mismatch", "branch_tokens_p", "branch_tokens_q"]
    names += [
        n for n in out if n.startswith(("branch_topk", "branch_tail", "branch_p", "branch_q"))
    ]
    rec = {}
    for name in dict.fromkeys(names):
        initial = torch.from_numpy(np.ascontiguousarray(out[name][rr, kk]))
        rec[name] = initial if name in ("branch_p", "branch_q") else initial.to(device)
    arange = torch.arange(B, device=device)
    eos = torch.tensor(settings.eos_token_ids or (), dtype=torch.long, device=device)
    x = torch.zeros(B, dtype=torch.long, device=device)
    y = torch.zeros_like(x)
    done = torch.zeros(2 * B, dtype=torch.bool, device=device)
    last = torch.zeros(2 * B, dtype=torch.long, device=device)
    steps = min(T, int((ts + L).max()))
    for g in range(1, steps + 1):
        teacher = g <= ts_t
        token = fed[:, g - 1]
        tokens = torch.cat([torch.where(teacher, token, x), torch.where(teacher, token, y)])
        probs = settings.decoding.probs(rows.step(tokens))
        if eos.numel():
            probs = _absorb(probs, done, last)
        p, q = probs[:B], probs[B:]
        lag = g - ts_t
        active = (lag >= 0) & (lag <= L)
        lag_c = lag.clamp(0, L)
        u = branch_u[lag_c, rr_t, kk_t].clone()
        u[:, 0] = torch.where(lag == 0, 0.0, u[:, 0])  # lag 0: the residuals
        nx, ny, delta, _ = couple_rows(p, q, u)
        x, y = torch.where(active, nx, x), torch.where(active, ny, y)
        values = _branch_record(settings.record, p, q, nx, ny, delta)
        for name, value in values.items():
            target = rec[name]
            index = (arange.to(target.device), lag_c.to(target.device))
            keep = active.to(target.device).reshape((-1,) + (1,) * (value.dim() - 1))
            target[index] = torch.where(keep, value.to(target.dtype), target[index])
        if eos.numel():
            both = torch.cat([nx, ny])
            newly = torch.cat([active, active]) & ~done & torch.isin(both, eos)
            last = torch.where(newly, both, last)
            done = done | newly
    for name, value in rec.items():
        out[name][rr, kk] = value.cpu().numpy()
    out["branch_tv"][rr, kk, 0] = path.hazard[rr, ts - 1]
    return out, 2 * B * steps
