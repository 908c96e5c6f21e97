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

**Decode-time eviction** (``mode=decode``, every budgeted policy): the cache is kept at the
budget while generating too. After each generated token the tracer shows the policy's
:class:`DecodeRule` the evicted rows' cache (:class:`DecodeCache`); every ``every=N`` steps
(default 1) the rule says which ``budget`` entries each row, layer and KV head keeps. Rules:
``recent`` (the newest entries), ``streaming`` (sinks + rolling window), ``h2o`` (Algorithm 1:
accumulated attention, a protected recent share) each in its own module; every other policy,
plug-in scorers included, re-runs its own :meth:`Policy.select` on the current cache
(:class:`RescoreRule`, as kvpress's decoding wrapper does for any scorer), seeing it through a
:class:`DecodeContext` whose queries are those of the most recent tokens.

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

    Attributes
    ----------
    keys : list of torch.Tensor
        Per layer, ``(kv_heads, length, head_dim)`` cached keys.
    values : list of torch.Tensor
        Per layer, ``(kv_heads, length, head_dim)`` cached values.
    query_fn : callable or None
        ``query_fn(l, start)``: post-RoPE queries of prefix positions ``start..length-1``.
    scaling : float or None
        The attention scale (``None``: ``head_dim ** -0.5``).
    num_query_heads : int or None
        Number of query heads (``None``: as many as KV heads).
    generator : torch.Generator or None
        Seeded CPU generator for randomised policies.
    attention_fn : callable or None
        ``attention_fn(l, start, stop)``: the layer's own attention probabilities.
    accumulated_fn : callable or None
        ``accumulated_fn(l)``: the accumulated attention of layer ``l``, when the tracer
        computed it during prefill.
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


@dataclass
class DecodeContext(PolicyContext):
    """A :class:`PolicyContext` over one row's cache while decoding (for :class:`RescoreRule`).

    Keys and values are the entries the row holds now, sorted by original position per KV head
    (``key_positions[l]``: ``(kv_heads, length)``). Queries are those of the most recent tokens
    (``recent_queries[l]``: ``(query_heads, W, head_dim)``, oldest first, at
    ``query_positions``), so :meth:`window_attention` is the attention of the last ``window``
    generated (or prompt) tokens, causal by original position. Accumulated attention over every
    query is not kept while decoding. The attributes not listed below are those of
    :class:`PolicyContext`.

    Attributes
    ----------
    key_positions : list of torch.Tensor
        Per layer, ``(kv_heads, length)`` original positions of the held entries.
    recent_queries : list of torch.Tensor
        Per layer, ``(query_heads, W, head_dim)`` queries of the most recent tokens, oldest
        first.
    query_positions : torch.Tensor or None
        Original positions of those queries.
    """

    key_positions: list[torch.Tensor] = field(default_factory=list)
    recent_queries: list[torch.Tensor] = field(default_factory=list)
    query_positions: torch.Tensor | None = None

    def window_attention(self, layer: int, window: int) -> torch.Tensor:
        import torch

        key = ("window", layer, window)
        if key in self._cache:
            return self._cache[key]
        queries = self.recent_queries[layer]
        if self.query_positions is None or window > queries.shape[1]:
            raise PolicyError(
                f"window attention of the last {window} queries needs them buffered while "
                f"decoding, but only {0 if self.query_positions is None else queries.shape[1]} "
                "are (see Policy.decode_query_window)"
            )
        q = queries[:, queries.shape[1] - window :].float()
        k = self.keys[layer].float().repeat_interleave(self.group_size, dim=0)
        scale = self.scaling if self.scaling is not None else q.shape[-1] ** -0.5
        logits = torch.matmul(q, k.transpose(-1, -2)) * scale  # (query_heads, window, length)
        key_pos = self.key_positions[layer].repeat_interleave(self.group_size, dim=0)
        query_pos = self.query_positions[self.query_positions.shape[0] - window :]
        logits = logits.masked_fill(key_pos[:, None, :] > query_pos[None, :, None], float("-inf"))
        self._cache[key] = torch.softmax(logits, dim=-1)
        return self._cache[key]

    def accumulated_attention(self, layer: int, chunk: int = 256) -> torch.Tensor:
        raise PolicyError(
            "accumulated attention over every query is not available while decoding; a policy "
            "that needs it brings its own DecodeRule (as h2o does)"
        )


@dataclass
class DecodeCache:
    """What a :class:`DecodeRule` sees of the evicted rows' cache of one layer after a step.

    The cache is a batch of ``B`` rows of ``S`` slots; a row attends to its ``visible`` slots
    (the same for every KV head), and per KV head a slot holds one entry whose original position
    is ``state["position"]``. ``state`` holds slot-aligned ``(B, kv_heads, S)`` tensors that move
    with their entries when the cache is compacted: ``position`` always, plus what the rule's
    :meth:`DecodeRule.start` added (new slots start at 0). ``attention`` (when the rule asks for
    it) is the newest query's attention over the slots, averaged over each GQA group; ``queries``
    (when the rule asks for a query window) are the post-RoPE queries of the most recent tokens,
    ``(B, query_heads, W, head_dim)``, oldest first, at ``query_positions`` ``(W,)`` per row
    ``(B, W)``.

    Attributes
    ----------
    layer : int
        The layer index.
    keys : torch.Tensor
        ``(B, kv_heads, S, head_dim)`` cached keys.
    values : torch.Tensor
        ``(B, kv_heads, S, head_dim)`` cached values.
    visible : torch.Tensor
        ``(B, S)`` bool: the slots each row attends to.
    state : dict of str to torch.Tensor
        Slot-aligned ``(B, kv_heads, S)`` tensors: ``position`` plus the rule's own state.
    current : torch.Tensor
        ``(B,)`` position of the token just fed.
    rows : torch.Tensor
        ``(B,)`` the trajectory each row follows (for reproducible randomness).
    scaling : float
        The attention scale.
    num_query_heads : int
        Number of query heads.
    attention : torch.Tensor or None
        The newest query's attention over the slots, averaged over each GQA group, when the
        rule asks for it (``None`` otherwise).
    queries : torch.Tensor or None
        ``(B, query_heads, W, head_dim)`` post-RoPE queries of the most recent tokens, when
        the rule asks for a query window (``None`` otherwise).
    query_positions : torch.Tensor or None
        ``(B, W)`` positions of those queries (``None`` without a query window).
    """

    layer: int
    keys: torch.Tensor  # (B, kv_heads, S, head_dim)
    values: torch.Tensor
    visible: torch.Tensor  # (B, S) bool
    state: dict[str, torch.Tensor]
    current: torch.Tensor  # (B,) position of the token just fed
    rows: torch.Tensor  # (B,) the trajectory each row follows (for reproducible randomness)
    scaling: float
    num_query_heads: int
    attention: torch.Tensor | None = None
    queries: torch.Tensor | None = None
    query_positions: torch.Tensor | None = None

    @property
    def positions(self) -> torch.Tensor:
        return self.state["position"]


class DecodeRule:
    """A policy's rule for keeping the cache at its budget while generating.

    The tracer calls :meth:`start` once (per-slot state of the kept prompt entries),
    :meth:`observe` after every step, and :meth:`keep` whenever a row holds ``every`` entries
    more than the budget; :meth:`keep` returns, per layer, the ``budget`` slots each row and KV
    head keeps, ``(B, kv_heads, budget)`` indices of visible slots.

    Parameters
    ----------
    policy : Policy
        The policy the rule belongs to (its ``every`` parameter sets how often it evicts).
    budget : int
        Entries each row, layer and KV head keeps.
    """

    needs_attention: ClassVar[bool] = False

    def __init__(self, policy: Policy, budget: int):
        self.policy = policy
        self.budget = budget
        self.every = int(policy.params.get("every") or 1)

    @property
    def query_window(self) -> int:
        """How many recent queries :meth:`keep` needs buffered (0: none)."""
        return 0

    def start(self, ctx: PolicyContext, idx: torch.Tensor) -> dict[str, list[torch.Tensor]]:
        """Slot state of the kept prompt entries ``idx`` ``(layers, kv_heads, keep)``: name ->
        per-layer ``(kv_heads, keep)`` tensors. Default: none beyond positions."""
        return {}

    def observe(self, cache: DecodeCache) -> None:
        """Update slot state after a step (in place). Default: nothing."""

    def keep(self, caches: list[DecodeCache]) -> list[torch.Tensor]:
        raise NotImplementedError


class SlotScoreRule(DecodeRule):
    """Keeps the ``budget`` visible slots of highest :meth:`score` per row and KV head (ties:
    the lower position, as at prefill).

    Parameters
    ----------
    policy : Policy
        The policy the rule belongs to (its ``every`` parameter sets how often it evicts).
    budget : int
        Entries each row, layer and KV head keeps.
    """

    def score(self, cache: DecodeCache) -> torch.Tensor:
        """``(B, kv_heads, S)`` float64 scores; higher is kept."""
        raise NotImplementedError

    def keep(self, caches: list[DecodeCache]) -> list[torch.Tensor]:
        import torch

        out = []
        for cache in caches:
            score = self.score(cache).to(torch.float64)
            score = score.masked_fill(~cache.visible[:, None, :], float("-inf"))
            # Slots by position, then a stable sort by score: ties keep the lower position.
            by_position = torch.argsort(cache.positions, dim=-1, stable=True)
            ranked = torch.argsort(
                score.gather(-1, by_position), dim=-1, descending=True, stable=True
            )
            out.append(by_position.gather(-1, ranked[..., : self.budget]))
        return out


class RescoreRule(DecodeRule):
    """The generic rule: every ``every`` steps, re-run the policy's own :meth:`Policy.select`
    on each row's current cache (a :class:`DecodeContext`) and keep what it keeps.

    Parameters
    ----------
    policy : Policy
        The policy whose :meth:`Policy.select` is re-run.
    budget : int
        Entries each row, layer and KV head keeps.
    seed : int, optional
        Seed of the per-row generators given to randomised policies (default 0).
    """

    def __init__(self, policy: Policy, budget: int, seed: int = 0):
        super().__init__(policy, budget)
        self.seed = seed

    @property
    def query_window(self) -> int:
        return self.policy.decode_query_window()

    def keep(self, caches: list[DecodeCache]) -> list[torch.Tensor]:
        import torch

        first = caches[0]
        rows = first.visible.shape[0]
        kept: list[list[torch.Tensor]] = [[] for _ in caches]
        for b in range(rows):
            slots = torch.nonzero(first.visible[b]).flatten()
            keys, values, key_positions, order = [], [], [], []
            for cache in caches:
                pos = cache.positions[b][:, slots]  # (kv_heads, V)
                sort = torch.argsort(pos, dim=-1, stable=True)
                slot_order = slots[sort]  # (kv_heads, V) slots by position
                index = slot_order[..., None].expand(-1, -1, cache.keys.shape[-1])
                keys.append(cache.keys[b].gather(1, index))
                values.append(cache.values[b].gather(1, index))
                key_positions.append(pos.gather(1, sort))
                order.append(slot_order)
            queries = [c.queries[b] for c in caches if c.queries is not None]
            ctx = DecodeContext(
                keys=keys,
                values=values,
                scaling=first.scaling,
                num_query_heads=first.num_query_heads,
                # Randomised policies draw from (seed, trajectory, position): a replayed branch
                # evicts exactly as its path did.
                generator=torch.Generator().manual_seed(
                    (self.seed * 1_000_003 + int(first.rows[b]) * 65_537 + int(first.current[b]))
                    % 2**63
                ),
                key_positions=key_positions,
                recent_queries=queries,
                query_positions=None if first.query_positions is None else first.query_positions[b],
            )
            idx = self.policy.select(ctx, self.budget)  # (layers, kv_heads, budget)
            for layer, slot_order in enumerate(order):
                kept[layer].append(slot_order.gather(1, idx[layer].to(slot_order.device)))
        return [torch.stack(k) for k in kept]


def kept_count(length: int, retain: float | None, budget: int | None) -> int:
    """Entries kept of a ``length``-token prompt: ``round_half_up(retain * length)`` or
    ``budget``, clamped to ``[1, length]``.

    Parameters
    ----------
    length : int
        Prompt length in tokens.
    retain : float or None
        Fraction of the prompt to keep; takes precedence over ``budget``.
    budget : int or None
        Entries to keep. With neither ``retain`` nor ``budget``, the whole prompt is kept.

    Returns
    -------
    int
        Entries kept, in ``[1, length]``.
    """
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


@dataclass(frozen=True)
class Admission:
    """What a policy applies to one input: itself, or (for a gated policy such as ``page``)
    the decision of its gate: ``capacity_bound`` (None: no gate) and the gate's ``score``.

    Attributes
    ----------
    policy : Policy
        The policy applied to the input (for ``page``: the base policy, or ``full`` when the
        input is capacity-bound).
    score : float
        The gate's score (for ``page``: the agreement drop); NaN (the default) without a gate.
    capacity_bound : bool or None
        The gate's decision; ``None`` (the default) without a gate.
    """

    policy: Policy
    score: float = math.nan
    capacity_bound: bool | None = None


class Policy:
    """Base class: a named eviction policy with typed parameters.

    Subclasses set ``name``, ``PARAMS`` (``{param: (type, default)}``, beyond ``retain`` and
    ``budget`` which every budgeted policy takes) and implement :meth:`select`.

    Parameters
    ----------
    **params : Any
        Spec keys, as keyword arguments or strings (spec values). Every budgeted policy takes
        ``retain`` (float in (0, 1]: the share of prompt entries kept) or ``budget`` (int >= 1:
        the number kept), exactly one of them. Every policy takes ``mode`` (``"prefill"``, the
        default: evict once after the prompt; or ``"decode"``: also keep the cache at its budget
        while generating) and ``every`` (int >= 1, default 1; with ``mode=decode`` only: evict
        back to the budget once every ``every`` generated tokens). Beyond those, the
        subclass's own ``PARAMS``.
    """

    name: ClassVar[str] = ""
    PARAMS: ClassVar[dict[str, tuple[type, Any]]] = {}
    BUDGETED: ClassVar[bool] = True
    NEEDS_QUERIES: ClassVar[bool] = False

    def __init__(self, **params: Any):
        allowed = dict(self.PARAMS)
        if self.BUDGETED:
            allowed = {"retain": (float, None), "budget": (int, None), **allowed}
        # Every policy may evict while decoding; None means the default (prefill, every 1),
        # left out of the canonical spec.
        allowed = {**allowed, "mode": (str, None), "every": (int, None)}
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
        if values["mode"] not in (None, "prefill", "decode"):
            raise PolicyParameterError(
                f"policy {self.name!r}: mode must be 'prefill' or 'decode', got {values['mode']!r}"
            )
        if values["mode"] == "prefill":
            values["mode"] = None  # the default, one canonical spec
        if values["every"] is not None:
            if values["mode"] != "decode":
                raise PolicyParameterError(
                    f"policy {self.name!r}: every= applies only with mode=decode"
                )
            if values["every"] < 1:
                raise PolicyParameterError(
                    f"policy {self.name!r}: every must be >= 1, got {values['every']}"
                )
            if values["every"] == 1:
                values["every"] = None
        self.validate()

    @property
    def decode_time(self) -> bool:
        """Whether the policy also evicts while generating (``mode=decode``)."""
        return self.params.get("mode") == "decode"

    def decode_rule(self, budget: int, seed: int = 0) -> DecodeRule | None:
        """The rule that keeps the cache at ``budget`` entries while decoding (None: prefill
        only). Default: :class:`RescoreRule` (re-run :meth:`select` every ``every`` steps);
        ``seed`` seeds randomised policies."""
        if not self.decode_time:
            return None
        return RescoreRule(self, budget, seed)

    def admit(self, ctx: PolicyContext) -> Admission:
        """The policy to apply to this input (an ungated policy: itself)."""
        return Admission(self)

    def decode_query_window(self) -> int:
        """Recent queries :meth:`select` needs while decoding (its window attention): 32 for
        query-scored policies unless they say otherwise, 0 for the rest."""
        return 32 if self.NEEDS_QUERIES else 0

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


POLICIES: dict[str, type[Policy]] = {}


def register_policy(cls: type[Policy]) -> type[Policy]:
    """Class decorator: make a :class:`Policy` subclass available by its ``name``.

    Parameters
    ----------
    cls : type of Policy
        The subclass; its ``name`` becomes its key in :data:`POLICIES` (replacing any class
        registered under that name).

    Returns
    -------
    type of Policy
        ``cls`` itself.

    Raises
    ------
    ValueError
        ``cls.name`` is empty or contains ``:`` or ``,``.
    """
    if not cls.name or ":" in cls.name or "," in cls.name:
        raise ValueError(f"a policy needs a name without ':' or ',', got {cls.name!r}")
    POLICIES[cls.name] = cls
    return cls


def top_indices(scores: torch.Tensor, keep: int) -> torch.Tensor:
    """The ``keep`` highest scores per row (ties: lower index first), sorted ascending.

    Parameters
    ----------
    scores : torch.Tensor
        Scores, ``(..., n)``: one row per last dimension.
    keep : int
        Indices to keep per row, in ``[0, n]``.

    Returns
    -------
    torch.Tensor
        ``long`` indices ``(..., keep)`` on the device of ``scores``, sorted ascending.
    """
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

    Parameters
    ----------
    **params : Any
        The spec keys of :class:`Policy` (``retain`` or ``budget``, ``mode``, ``every``) and the
        subclass's own ``PARAMS``.
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
