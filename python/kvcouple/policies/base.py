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

This module holds :class:`Policy`, :class:`ScorePolicy`, the registry and the kept-count
helpers; the context a policy sees is in :mod:`kvcouple.policies.context`, the decode-time rules
in :mod:`kvcouple.policies.decode`, the errors in :mod:`kvcouple.policies.errors`. Every name is
importable from here and from :mod:`kvcouple.policies`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from kvcouple.deprecation import RenamedAttribute, warn_renamed
from kvcouple.policies.context import PolicyContext
from kvcouple.policies.decode import (
    DecodeCache,
    DecodeContext,
    DecodeRule,
    RescoreRule,
    SlotScoreRule,
)
from kvcouple.policies.errors import PolicyError, PolicyParameterError, UnknownPolicyError

if TYPE_CHECKING:
    import torch

# The interface a plug-in policy is written against, in one place (docs/policies.md: plug-in
# authors import every name from here): defined here or in its parts (context, decode, errors).
__all__ = [
    "POLICIES",
    "query_needs",
    "Admission",
    "DecodeCache",
    "DecodeContext",
    "DecodeRule",
    "Policy",
    "PolicyContext",
    "PolicyError",
    "PolicyParameterError",
    "RescoreRule",
    "ScorePolicy",
    "SlotScoreRule",
    "UnknownPolicyError",
    "kept_count",
    "recent_indices",
    "register_policy",
    "top_indices",
]


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
    # Whether selection reads attention scores (the prompt's queries, PolicyContext.attention):
    # the tracer captures the queries at prefill only for such policies.
    NEEDS_ATTENTION: ClassVar[bool] = False
    NEEDS_QUERIES = RenamedAttribute("NEEDS_ATTENTION")  # the former name, deprecated
    # Whether selection reads each attention layer's inputs (PolicyContext.layer_inputs): the
    # tracer records them at prefill only for such policies.
    NEEDS_LAYER_INPUTS: ClassVar[bool] = False
    # A parameter given without its name as the spec's first item (``kvpress:SnapKVPress,...``).
    POSITIONAL: ClassVar[str | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # A plug-in written before the rename sets the former name: read for one release.
        if "NEEDS_QUERIES" in cls.__dict__:
            warn_renamed("NEEDS_QUERIES", "NEEDS_ATTENTION", cls.__name__)
            cls.NEEDS_ATTENTION = cls.__dict__["NEEDS_QUERIES"]

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
            implied = retain is None and budget is None and self.budget_implied()
            if (retain is None) == (budget is None) and not implied:
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
        return 32 if self.NEEDS_ATTENTION else 0

    def selects_per_head(self) -> bool:
        """Whether :meth:`select` treats every layer's KV heads each on its own, drawing
        nothing at random: then a context whose heads are several caches' heads selects for
        each as for itself, and the decode-time :class:`RescoreRule` runs once over every row
        of a batch (its rows folded into the head axis). Default: no (one call per row)."""
        return False

    def validate(self) -> None:
        """Check parameter values; raise :class:`PolicyParameterError`."""

    def budget_implied(self) -> bool:
        """Whether the policy's own parameters set its kept count when neither ``retain`` nor
        ``budget`` is given (then it overrides :meth:`kept_count`). Default: no."""
        return False

    def prompt_queries(self) -> tuple[int | None, bool]:
        """What selection reads of the prompt's queries: how many of the last ones (None: any)
        and whether their accumulated attention. The tracer captures only that."""
        return (None if self.NEEDS_ATTENTION else 0), False

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


def query_needs(policies: Sequence[Policy]) -> tuple[bool, int | None, bool]:
    """What to capture for ``policies``: whether anything, how many of the last queries
    (None: all), and whether accumulated attention (see ``Policy.prompt_queries``)."""
    needs = [p.prompt_queries() for p in policies if p.NEEDS_ATTENTION]
    if not needs:
        return False, None, False
    windows = [w for w, _ in needs if w is not None]
    keep = max(windows) if len(windows) == len(needs) else None  # None: some reads every query
    return True, keep, any(acc for _, acc in needs)
