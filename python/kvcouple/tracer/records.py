"""What a step records, on the device: path metrics, distributions, branch records."""

from __future__ import annotations

import numpy as np
import torch

from kvcouple.store.schema import Record, distribution_variables, variables

SCHEMA = variables(Record())


def path_metrics(p: torch.Tensor, q: torch.Tensor) -> dict[str, torch.Tensor]:
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


def distribution_records(
    record: Record, side: str, probs: torch.Tensor, prefix: str
) -> dict[str, torch.Tensor]:
    """Top-k ids/probs/tail mass, or the whole distribution (on the host), for one side."""
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


def branch_record(
    record: Record,
    p: torch.Tensor,
    q: torch.Tensor,
    x: torch.Tensor,
    y: torch.Tensor,
    tv: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """What one branch step records: TV, mismatch, both tokens, and the distributions."""
    rec = {
        "branch_tv": tv,
        "branch_mismatch": (x != y).to(torch.int8),
        "branch_tokens_p": x,
        "branch_tokens_q": y,
    }
    for side, probs_side in (("p", p), ("q", q)):
        rec.update(distribution_records(record, side, probs_side, "branch_"))
    return rec


def to_host(steps: list[dict[str, torch.Tensor]], axis: int) -> dict[str, np.ndarray]:
    """Stack per-step device records along ``axis`` and bring them to the host at once."""
    if not steps:
        return {}
    return {
        name: torch.stack([s[name] for s in steps], dim=axis).cpu().numpy() for name in steps[0]
    }
