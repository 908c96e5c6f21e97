"""The eviction-policy interface (SPEC section 7): what a policy sees and what it returns.

A policy looks at the prompt cache after prefill and returns, for every layer and KV head,
the indices of the entries it keeps. It sees a :class:`PolicyContext`: per-layer keys and
values ``(kv_heads, length, head_dim)`` (keys with RoPE applied, as cached), and on demand the
post-RoPE queries of the prompt, from which it can ask for attention probabilities. Scores that
come from query heads are averaged over the query heads of each GQA group.

**Kept counts.** ``retain=r`` keeps ``round_half_up(r * n)`` of an ``n``-token prompt,
``budget=b`` keeps ``b``; either way the count is clamped to ``[1, n]``. The tracer re-feeds
the prompt's last token after eviction (so that the evicted model's first distribution sees the
evicted cache), so that token is always kept and counts toward the budget: the policy chooses
``kept - 1`` entries among the first ``n - 1`` (the *prefix*, which is what the context holds).

**Plug-in scorers.** Subclass :class:`ScorePolicy`, give it a ``name`` and a ``score`` method
returning ``(kv_heads, length)`` scores (higher is kept), and decorate it with
:func:`kvcouple.policies.register_policy`; it is then available as ``"name:retain=0.5"`` in
the CLI and in :func:`kvcouple.policies.parse_policy`. ``PARAMS`` declares extra parameters::

    @register_policy
    class KeyMean(ScorePolicy):
        name = "keymean"
        PARAMS = {"sign": (float, 1.0)}

        def score(self, ctx, layer):
            return self.params["sign"] * ctx.keys[layer].float().mean(-1)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from kvcouple.errors import InvalidInputError

if TYPE_CHECKING:
    import torch


class PolicyError(InvalidInputError):
    """A policy spec that cannot be used: unknown policy, unknown or bad parameter."""


class UnknownPolicyError(PolicyError):
    """No policy of this name is registered."""


class PolicyParameterError(PolicyError):
    """A parameter the policy does not take, or a value it cannot use."""


@dataclass
class PolicyContext:
    """What a policy sees of one prompt's cache (batch of one), per layer.

    ``keys[l]`` and ``values[l]``: ``(kv_heads, length, head_dim)``. ``query_fn(l, start)``
    returns the post-RoPE queries of prefix positions ``start..length-1`` of layer ``l`` as
    ``(query_heads, length - start, head_dim)``; ``scaling`` is the attention scale.
    ``attention_fn(l, start, stop)``, when given, returns the layer's own attention
    probabilities of prefix queries ``start..stop-1`` onto every prefix key,
    ``(query_heads, stop - start, length)`` (the tracer computes them with the layer's eager
    attention, so windows, soft-capping and sinks are included); without it attention is
    recomputed from ``query_fn``, ``keys`` and ``scaling`` as plain causal softmax attention.
    ``generator`` is a seeded CPU generator for randomised policies.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    query_fn: Callable[[int, int], torch.Tensor] | None = None
    scaling: float | None = None
    num_query_heads: int | None = None
    generator: torch.Generator | None = None
    attention_fn: Callable[[int, int, int], torch.Tensor] | None = None
    # The accumulated attention of layer l, when the tracer computed it during prefill.
    accumulated_fn: Callable[[int], torch.Tensor] | None = None
    _cache: dict[Any, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def num_kv_heads(self) -> int:
        return int(self.keys[0].shape[0])

    @property
    def length(self) -> int:
        return int(self.keys[0].shape[1])

    @property
    def group_size(self) -> int:
        heads = self.num_query_heads or self.num_kv_heads
        return heads // self.num_kv_heads

    def group_mean(self, scores: torch.Tensor) -> torch.Tensor:
        """Average ``(query_heads, ...)`` scores over each GQA group: ``(kv_heads, ...)``."""
        return scores.reshape(self.num_kv_heads, self.group_size, *scores.shape[1:]).mean(1)

    def _queries(self, layer: int, start: int) -> torch.Tensor:
        if self.query_fn is None:
            raise RuntimeError("this policy needs the prompt's queries, which were not captured")
        return self.query_fn(layer, start)

    def _attention(self, layer: int, start: int, stop: int) -> torch.Tensor:
        """Causal attention probabilities of prefix queries ``start..stop-1`` onto every key:
        ``(query_heads, stop - start, length)`` in float32."""
        import torch

        if self.attention_fn is not None:
            return self.attention_fn(layer, start, stop).float()
        q = self._queries(layer, start)[:, : stop - start].float()
        k = self.keys[layer].float().repeat_interleave(self.group_size, dim=0)
        scale = self.scaling if self.scaling is not None else q.shape[-1] ** -0.5
        logits = torch.matmul(q, k.transpose(-1, -2)) * scale
        query_pos = torch.arange(start, stop, device=q.device)[:, None]
        key_pos = torch.arange(self.length, device=q.device)[None, :]
        logits = logits.masked_fill(key_pos > query_pos, float("-inf"))
        return torch.softmax(logits, dim=-1)

    def window_attention(self, layer: int, window: int) -> torch.Tensor:
        """Attention of the last ``window`` prefix queries: ``(query_heads, window, length)``."""
        key = ("window", layer, window)
        if key not in self._cache:
            self._cache[key] = self._attention(layer, self.length - window, self.length)
        return self._cache[key]

    def accumulated_attention(self, layer: int, chunk: int = 256) -> torch.Tensor:
        """Attention each key received, summed over every prefix query: ``(query_heads, length)``
        (the H2O score). Computed in chunks of queries to bound memory."""
        import torch

        key = ("accumulated", layer)
        if key not in self._cache and self.accumulated_fn is not None:
            self._cache[key] = self.accumulated_fn(layer)
        if key not in self._cache:
            total = None
            for start in range(0, self.length, chunk):
                stop = min(start + chunk, self.length)
                part = self._attention(layer, start, stop).sum(dim=1)
                total = part if total is None else total + part
            assert total is not None
            self._cache[key] = total.to(torch.float32)
        return self._cache[key]


def kept_count(length: int, retain: float | None, budget: int | None) -> int:
    """Entries kept of a ``length``-token prompt: ``round_half_up(retain * length)`` or
    ``budget``, clamped to ``[1, length]``."""
    if retain is not None:
        want = math.floor(retain * length + 0.5)
    elif budget is not None:
        want = budget
    else:
        want = length
    return max(1, min(length, int(want)))


def _parse_value(policy: str, name: str, kind: type, text: str) -> Any:
    try:
        if kind is bool:
            low = text.lower()
            if low not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(text)
            return low in ("1", "true", "yes")
        return kind(text)
    except ValueError:
        raise PolicyParameterError(
            f"policy {policy!r}: parameter {name}={text!r} is not a valid {kind.__name__}"
        ) from None


class Policy:
    """Base class: a named eviction policy with typed parameters.

    Subclasses set ``name``, ``PARAMS`` (``{param: (type, default)}``, beyond ``retain`` and
    ``budget`` which every budgeted policy takes) and implement :meth:`select`.
    """

    name: ClassVar[str] = ""
    PARAMS: ClassVar[dict[str, tuple[type, Any]]] = {}
    BUDGETED: ClassVar[bool] = True
    NEEDS_QUERIES: ClassVar[bool] = False
    # Decode-time policies also evict while generating (see the tracer).
    decode_time: bool = False

    def __init__(self, **params: Any):
        allowed = dict(self.PARAMS)
        if self.BUDGETED:
            allowed = {"retain": (float, None), "budget": (int, None), **allowed}
        unknown = sorted(set(params) - set(allowed))
        if unknown:
            raise PolicyParameterError(
                f"policy {self.name!r} has no parameter {', '.join(unknown)}; it takes "
                f"{', '.join(allowed) or 'no parameters'}"
            )
        values = {k: default for k, (_, default) in allowed.items()}
        for k, v in params.items():
            kind = allowed[k][0]
            values[k] = _parse_value(self.name, k, kind, v) if isinstance(v, str) else kind(v)
        self.params = values
        if self.BUDGETED:
            retain, budget = values["retain"], values["budget"]
            if (retain is None) == (budget is None):
                raise PolicyParameterError(
                    f"policy {self.name!r} needs exactly one of retain= (a fraction in (0, 1]) "
                    f"or budget= (a token count >= 1)"
                )
            if retain is not None and not (0 < retain <= 1):
                raise PolicyParameterError(
                    f"policy {self.name!r}: retain must be in (0, 1], got {retain}"
                )
            if budget is not None and budget < 1:
                raise PolicyParameterError(
                    f"policy {self.name!r}: budget must be >= 1, got {budget}"
                )
        self.validate()

    def validate(self) -> None:
        """Check parameter values; raise :class:`PolicyParameterError`."""

    def prompt_queries(self) -> tuple[int | None, bool]:
        """What selection reads of the prompt's queries: how many of the last ones (None: any)
        and whether their accumulated attention. The tracer captures only that."""
        return (None if self.NEEDS_QUERIES else 0), False

    def spec(self) -> str:
        """The canonical string form, e.g. ``snapkv:retain=0.5,window=32,kernel=7,pool=avg``."""
        items = [f"{k}={v}" for k, v in self.params.items() if v is not None]
        return self.name + (":" + ",".join(items) if items else "")

    def kept_count(self, prompt_length: int) -> int:
        """Prompt-cache entries kept (including the re-fed last token)."""
        if not self.BUDGETED:
            return prompt_length
        return kept_count(prompt_length, self.params["retain"], self.params["budget"])

    def select(self, ctx: PolicyContext, keep: int) -> torch.Tensor:
        """Indices of the ``keep`` prefix entries kept: ``(layers, kv_heads, keep)`` int64,
        ascending along the last axis, each in ``[0, ctx.length)``."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<policy {self.spec()}>"


def top_indices(scores: torch.Tensor, keep: int) -> torch.Tensor:
    """The ``keep`` highest scores per row (ties: lower index first), sorted ascending."""
    import torch

    if keep == 0:
        return torch.zeros((*scores.shape[:-1], 0), dtype=torch.long, device=scores.device)
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :keep]
    return torch.sort(order, dim=-1).values


def recent_indices(ctx: PolicyContext, keep: int, first: int = 0) -> torch.Tensor:
    """``first`` leading entries plus the most recent ones, ``keep`` in all, for every head."""
    import torch

    n = ctx.length
    first = min(first, keep)
    idx = torch.cat([torch.arange(first), torch.arange(n - (keep - first), n)])
    device = ctx.keys[0].device
    return idx.to(device).expand(ctx.num_layers, ctx.num_kv_heads, keep).clone()


class ScorePolicy(Policy):
    """A policy that keeps the highest-scoring entries per layer and KV head.

    Implement ``score(ctx, layer) -> (kv_heads, length)``; higher scores are kept.
    """

    def score(self, ctx: PolicyContext, layer: int) -> torch.Tensor:
        raise NotImplementedError

    def select(self, ctx: PolicyContext, keep: int) -> torch.Tensor:
        import torch

        out = []
        for layer in range(ctx.num_layers):
            s = self.score(ctx, layer)
            if tuple(s.shape) != (ctx.num_kv_heads, ctx.length):
                raise ValueError(
                    f"policy {self.name!r}: score for layer {layer} has shape {tuple(s.shape)}, "
                    f"expected (kv_heads, length) = ({ctx.num_kv_heads}, {ctx.length})"
                )
            out.append(top_indices(s.float(), keep))
        return torch.stack(out)
