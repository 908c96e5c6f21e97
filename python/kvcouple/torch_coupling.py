"""The coupling sampler and the decoding transform in torch, batched over rows, on any device.

:func:`couple_torch` implements, step for step, the sampler documented in
``rust/core/src/couple.rs`` (and exposed as :func:`kvcouple.couple`); :func:`apply_decoding`
implements the decoding transform of ``rust/core/src/transform.rs``. Both accumulate in
float64 on the tensors' device. Running sums are taken with ``cumsum`` (sequential on CPU, as
in Rust), so on CPU the tokens equal Rust's for the same float64 inputs; on a GPU the scan
may round differently in the last bit, which can only matter for a uniform within ~1e-16 of a
cumulative boundary.
"""

from __future__ import annotations

import numbers
from typing import TYPE_CHECKING

from kvcouple.errors import InvalidInputError

if TYPE_CHECKING:
    import torch


def apply_decoding(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> torch.Tensor:
    """Turn ``(rows, vocab)`` logits into float64 probabilities: temperature, top-k, top-p.

    1. ``z = logits / temperature``;
    2. top-k keeps every entry ``>=`` the k-th largest value (ties at the cut are kept);
    3. top-p sorts the probabilities descending (stable: ties by index) and keeps each entry
       whose preceding mass is ``< top_p`` (so at least one entry survives);
    4. softmax over the survivors (in float64).

    ``-inf`` logits are masked entries. Raises :class:`~kvcouple.InvalidInputError` (a ``ValueError``) for bad parameters.
    """
    import torch

    if not (temperature > 0 and temperature < float("inf")) or 1.0 / temperature == float("inf"):
        raise InvalidInputError(
            f"temperature must be a finite number > 0 whose inverse is finite, got {temperature} "
            "(use top_k=1 for greedy decoding)"
        )
    if top_k is not None and (
        isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 1
    ):
        raise InvalidInputError(f"top_k must be an integer >= 1, got {top_k!r}")
    if top_p is not None and not (0 < top_p <= 1):
        raise InvalidInputError(f"top_p must be in (0, 1], got {top_p}")
    inv_t = 1.0 / temperature
    z = logits if logits.dtype == torch.float64 else logits.to(torch.float64)
    top = z.amax(dim=-1, keepdim=True)
    if inv_t != 1.0:
        # As in Rust: where z / t would overflow, scale z - max instead (shift-invariance).
        # At t = 1 the shift is 0 and the scale 1, exactly: skipped (fewer passes, same bits).
        shift = torch.where(torch.isfinite(top) & ~torch.isfinite(top * inv_t), top, 0.0)
        z = (z - shift) * inv_t
        top = z.amax(dim=-1, keepdim=True)
    vocab = z.shape[-1]
    if top_k is not None and top_k < vocab:
        kth = torch.topk(z, top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))  # the max survives (it is >= the k-th)
    # Softmax as in Rust: subtract the max, exponentiate, divide by a sequential sum.
    e = torch.exp(z - top)
    probs = e / torch.cumsum(e, dim=-1)[..., -1:]
    if top_p is not None and top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        before = torch.cat([torch.zeros_like(cum[..., :1]), cum[..., :-1]], dim=-1)
        # Rust walks only the positive entries; zeros sort last and have preceding mass ~1.
        drop_sorted = (before >= top_p) | (sorted_p <= 0)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / torch.cumsum(probs, dim=-1)[..., -1:]
    return probs


def _inverse_cdf(weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per row: the first index whose running weight exceeds ``target``, else the last index
    of positive weight (0 if none)."""
    import torch

    cum = torch.cumsum(weight, dim=-1)
    idx = (cum <= target.unsqueeze(-1)).sum(dim=-1)
    vocab = weight.shape[-1]
    positions = torch.arange(vocab, device=weight.device)
    last_positive = torch.where(weight > 0, positions, -1).amax(dim=-1).clamp(min=0)
    # An index < vocab has positive weight (its running weight rose past the target), so it
    # is <= the last positive one: the minimum picks it, and the fallback where idx == vocab.
    return torch.minimum(idx, last_positive)


def couple_rows(
    p: torch.Tensor, q: torch.Tensor, u: torch.Tensor, residuals: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sampler without input checks: ``(x, y, tv, overlap)`` per row (int64, int64,
    float64, float64); ``overlap`` is ``sum min(a, b)``, 0 when the rows share no support.

    With ``u0 = 1`` every row with ``overlap > 0`` draws from the overlap (the RB-CMC path);
    with ``u0 = 0`` every row with ``tv > 0`` draws from the residuals (a branch start).
    ``residuals=False`` (the path, ``u0 = 1``): only the overlap draw is made, ``x = y = z``
    (the same bits as the full sampler wherever ``overlap > 0``; rows without overlap stop the
    path, so their draw is never used).

    ``p``, ``q``: ``(rows, vocab)`` nonnegative with positive row sums; ``u``: ``(rows, 3)``.
    """
    import torch

    a = p if p.dtype == torch.float64 else p.to(torch.float64)
    b = q if q.dtype == torch.float64 else q.to(torch.float64)
    # Rust scales by the reciprocal of a sequential sum; cumsum's last entry is that sum.
    # (torch.reciprocal is ``1.0 / x`` without its multiplication by 1.0: the same bits.)
    a = a * torch.reciprocal(torch.cumsum(a, dim=-1)[..., -1:])
    b = b * torch.reciprocal(torch.cumsum(b, dim=-1)[..., -1:])
    if u.dtype != torch.float64 or u.device != a.device:
        u = u.to(device=a.device, dtype=torch.float64)
    d = a - b
    delta = (0.5 * torch.cumsum(d.abs(), dim=-1)[..., -1]).clamp(max=1.0)
    overlap_w = torch.minimum(a, b)
    overlap = torch.cumsum(overlap_w, dim=-1)[..., -1]
    z = _inverse_cdf(overlap_w, u[:, 1] * overlap)
    if not residuals:
        return z, z, delta, overlap
    res_p_w = d.clamp(min=0.0)
    res_q_w = (-d).clamp(min=0.0)
    res_p = torch.cumsum(res_p_w, dim=-1)[..., -1]
    res_q = torch.cumsum(res_q_w, dim=-1)[..., -1]

    use_overlap = (u[:, 0] >= delta) & (overlap > 0)
    # A residual whose mass was lost to rounding falls back to the row itself.
    x_w = torch.where((res_p > 0).unsqueeze(-1), res_p_w, a)
    x_t = torch.where(res_p > 0, u[:, 1] * res_p, u[:, 1])
    y_w = torch.where((res_q > 0).unsqueeze(-1), res_q_w, b)
    y_t = torch.where(res_q > 0, u[:, 2] * res_q, u[:, 2])
    x = torch.where(use_overlap, z, _inverse_cdf(x_w, x_t))
    y = torch.where(use_overlap, z, _inverse_cdf(y_w, y_t))
    return x, y, delta, overlap


def couple_torch(
    p: torch.Tensor,
    q: torch.Tensor,
    u: torch.Tensor,
    *,
    renormalize: bool = False,
    atol: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stepwise maximal coupling of each row pair, the same sampler as :func:`kvcouple.couple`.

    ``p``, ``q``: ``(rows, vocab)`` probabilities (any float dtype, any device); ``u``:
    ``(rows, 3)`` uniforms in [0, 1). Returns ``(x, y, diverged)`` as int64 / int64 / bool
    tensors on ``p``'s device. Rows must sum to 1 within ``atol`` (default 1e-2 for half
    formats, 1e-4 for float32, 1e-6 for float64) unless ``renormalize``; a bad row raises
    :class:`~kvcouple.errors.InvalidInputError` naming it.
    """
    import torch

    from kvcouple.errors import InvalidInputError, ShapeError

    if p.ndim != 2 or q.shape != p.shape:
        raise ShapeError(
            f"p and q must be 2-D of one shape, got {tuple(p.shape)} and {tuple(q.shape)}"
        )
    u = torch.as_tensor(u, dtype=torch.float64, device=p.device)
    if u.shape != (p.shape[0], 3):
        raise ShapeError(f"u has shape {tuple(u.shape)}, expected ({p.shape[0]}, 3)")
    bad_u = ~((u >= 0) & (u < 1)).all(dim=-1)
    if bad_u.any():
        r = int(bad_u.nonzero()[0, 0])
        raise InvalidInputError(f"row {r}: uniforms {u[r].tolist()} are not all in [0, 1)")
    if atol is None:
        atol = {torch.float16: 1e-2, torch.bfloat16: 1e-2, torch.float32: 1e-4}.get(p.dtype, 1e-6)
    for side, t in (("p", p), ("q", q)):
        t64 = t.to(torch.float64)
        if not torch.isfinite(t64).all() or (t64 < 0).any():
            r = int((~torch.isfinite(t64) | (t64 < 0)).any(dim=-1).nonzero()[0, 0])
            raise InvalidInputError(f"row {r}: {side} contains NaN, infinity or a negative entry")
        total = torch.cumsum(t64, dim=-1)[..., -1]
        if (total <= 0).any():
            r = int((total <= 0).nonzero()[0, 0])
            raise InvalidInputError(f"row {r}: {side} sums to 0")
        if not renormalize and ((total - 1).abs() > atol).any():
            r = int(((total - 1).abs() > atol).nonzero()[0, 0])
            raise InvalidInputError(
                f"row {r}: {side} sums to {float(total[r]):.6f}, not 1 within atol={atol} "
                "(pass renormalize=True to normalise rows)"
            )
    x, y, _, _ = couple_rows(p, q, u)
    return x, y, x != y
