"""``page``: gated eviction, an admission decision per input (PAGE).

``page:base=<policy>,<base params>,threshold=x[,k=K,queries=W,span=s]`` computes one
label-free scalar from the prompt's attention, the **agreement drop**, and applies the base
evictor only to inputs it classes *dilution-prone*; *capacity-bound* inputs (drop above the
threshold) keep the whole cache. Precisely, on the prompt prefix (the prompt minus its re-fed
last token, ``n - 1`` entries):

1. per layer ``l`` and query head ``h``: the attention of the last ``W = min(queries, n - 1)``
   prefix queries onto every prefix key, summed over those queries; the head's key set
   ``S_{l,h}`` is its top ``k' = min(k, n - 1)`` keys (ties: the lower position);
2. agreement of two heads: the Jaccard index ``|S_i & S_j| / |S_i | S_j|``; a layer's
   agreement ``a_l`` is its mean over all pairs of query heads (GQA heads included: each query
   head has its own attention);
3. ``early`` = mean ``a_l`` over the first ``m`` layers, ``late`` over the last ``m``, with
   ``m = max(1, round(span * layers))`` (``span`` defaults to a third);
4. **drop** = ``early - late`` (in ``[-1, 1]``); ``drop > threshold``: capacity-bound.

The tracer records the drop (``gate_score``), the class (``gate_class``: 1 capacity-bound, 0
dilution-prone) and whether eviction was applied (``eviction_applied``) per document and policy.
``threshold`` defaults to 0.1; it is model-specific and should be calibrated (the published
description gives no universal value). Parameters other than ``base``, ``threshold``, ``k``,
``queries`` and ``span`` go to the base policy (including ``mode=decode``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvcouple.policies.base import POLICIES, Admission, Policy
from kvcouple.policies.context import PolicyContext
from kvcouple.policies.errors import PolicyParameterError, UnknownPolicyError
from kvcouple.policies.full import Full

if TYPE_CHECKING:
    import torch


class PAGE(Policy):
    """Partition-aware gated eviction: the base policy, or the full cache when the input is
    capacity-bound.

    Parameters are keyword arguments or the ``key=value`` pairs of a spec string parsed by
    :func:`kvcouple.policies.parse_policy` (e.g. ``"page:base=snapkv,budget=512,threshold=0.1"``).
    Parameters other than those below go to the base policy (``retain`` or ``budget``, its own
    parameters, ``mode`` and ``every``).

    Parameters
    ----------
    base : str
        Name of the base policy applied to dilution-prone inputs (required; any registered
        policy but ``page``).
    threshold : float, optional
        Agreement-drop threshold in ``[-1, 1]``: inputs whose drop exceeds it are
        capacity-bound and keep the whole cache (default 0.1; model-specific, calibrate it).
    k : int, optional
        Size of each query head's top-key set, ``k' = min(k, n - 1)`` (>= 1; default 16).
    queries : int, optional
        Number of last prefix queries whose attention is summed, ``W = min(queries, n - 1)``
        (>= 1; default 8).
    span : float, optional
        Share of layers in the early and late groups, in ``(0, 0.5]`` (default: a third).
    """

    name = "page"
    BUDGETED = False
    NEEDS_ATTENTION = True
    PARAMS = {
        "base": (str, None),
        "threshold": (float, 0.1),
        "k": (int, 16),
        "queries": (int, 8),
        "span": (float, None),
    }

    def __init__(self, **params: Any):
        own = {k: v for k, v in params.items() if k in self.PARAMS}
        rest = {k: v for k, v in params.items() if k not in self.PARAMS}
        base = own.get("base")
        if base is None:
            raise PolicyParameterError("policy 'page' needs base=<policy>, e.g. base=snapkv")
        base = str(base).strip().lower()
        if base not in POLICIES or base == self.name:
            known = ", ".join(sorted(n for n in POLICIES if n != self.name))
            raise UnknownPolicyError(f"page: unknown base policy {base!r}; known: {known}")
        self.base = POLICIES[base](**rest)
        super().__init__(**{**own, "base": base})

    def validate(self) -> None:
        p = self.params
        if not -1 <= p["threshold"] <= 1:
            raise PolicyParameterError(f"page: threshold must be in [-1, 1], got {p['threshold']}")
        if p["k"] < 1 or p["queries"] < 1:
            raise PolicyParameterError(
                f"page: k and queries must be >= 1, got k={p['k']}, queries={p['queries']}"
            )
        if p["span"] is not None and not 0 < p["span"] <= 0.5:
            raise PolicyParameterError(f"page: span must be in (0, 0.5], got {p['span']}")

    def spec(self) -> str:
        own = [f"{k}={v}" for k, v in self.params.items() if v is not None and k != "base"]
        base_items = self.base.spec().partition(":")[2]
        return f"{self.name}:base={self.base.name}," + ",".join(
            own + [base_items] * bool(base_items)
        )

    @property
    def decode_time(self) -> bool:
        return self.base.decode_time

    def kept_count(self, prompt_length: int) -> int:
        # The gate may keep everything: plan for the whole prompt.
        return prompt_length

    def prompt_queries(self) -> tuple[int | None, bool]:
        window, accumulate = self.base.prompt_queries()
        if self.base.NEEDS_ATTENTION and window is None:
            return None, accumulate
        return max(self.params["queries"], int(window or 0)), accumulate

    def agreement(self, ctx: PolicyContext) -> torch.Tensor:
        """Per-layer mean pairwise Jaccard agreement of the query heads' top-k key sets."""
        import torch

        n = ctx.length
        w, k = min(self.params["queries"], n), min(self.params["k"], n)
        out = []
        for layer in range(ctx.num_layers):
            votes = ctx.window_attention(layer, w).sum(dim=1)  # (heads, n)
            order = torch.sort(votes, dim=-1, descending=True, stable=True).indices[:, :k]
            sets = torch.zeros(votes.shape, dtype=torch.float32, device=votes.device)
            sets.scatter_(1, order, 1.0)
            inter = sets @ sets.T
            union = 2 * k - inter
            heads = sets.shape[0]
            if heads < 2:  # one head agrees with itself
                out.append(torch.ones((), device=votes.device))
                continue
            pairs = torch.triu(torch.ones(heads, heads, dtype=torch.bool), diagonal=1)
            out.append((inter / union)[pairs.to(votes.device)].mean())
        return torch.stack(out).cpu()

    def drop(self, ctx: PolicyContext) -> float:
        """The early-to-late drop in head agreement (the gate's score)."""
        agreement = self.agreement(ctx)
        layers = agreement.shape[0]
        span = self.params["span"] if self.params["span"] is not None else 1 / 3
        m = max(1, round(span * layers))
        return float(agreement[:m].mean() - agreement[layers - m :].mean())

    def admit(self, ctx: PolicyContext) -> Admission:
        score = self.drop(ctx)
        capacity_bound = score > self.params["threshold"]
        return Admission(Full() if capacity_bound else self.base, score, capacity_bound)

    def select(self, ctx: PolicyContext, keep: int):
        raise PolicyParameterError("page is applied through its gate (Policy.admit)")
