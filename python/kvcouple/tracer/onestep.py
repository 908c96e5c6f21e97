"""One step of a policy: the first next-token distributions with the full and the evicted cache.

The tracer's first coupled step, exposed on its own so that what eviction does to a single
distribution can be looked at (and compared with :func:`kvcouple.divergences`) without tracing
a store.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvcouple.policies import Policy, parse_policy
from kvcouple.tracer.engine import prepare
from kvcouple.tracer.model import refresh
from kvcouple.tracer.prefill import prefill
from kvcouple.tracer.settings import TraceSettings
from kvcouple.tracer.shape import ModelShape
from kvcouple.tracer.trajectories import Trajectories


@dataclass(frozen=True)
class FirstStep:
    """The first step of one prompt under one policy.

    Attributes
    ----------
    policy : str
        The policy's canonical spec.
    logits_p : numpy.ndarray
        ``(vocab,)`` float64 next-token logits with the full prompt cache (P).
    logits_q : numpy.ndarray
        ``(vocab,)`` float64 next-token logits after the policy evicted from the prompt cache (Q).
    kept : int
        Prompt tokens Q sees: the kept cache entries plus the last prompt token, re-fed.
    prompt_length : int
        Tokens in the prompt.
    """

    policy: str
    logits_p: np.ndarray
    logits_q: np.ndarray
    kept: int
    prompt_length: int


def first_step(
    model: Any,
    input_ids: Sequence[int] | Any,
    policies: Sequence[Policy | str],
    *,
    seed: int = 0,
    doc_index: int = 0,
) -> list[FirstStep]:
    """Next-token logits of the first generated token, full cache vs each policy's evicted cache.

    The prompt minus its last token is prefilled once; each policy is admitted and selects the
    entries to keep exactly as :func:`kvcouple.tracer.trace` does (a gated policy decides
    what it applies; randomised policies draw from the seed of their (document, policy)),
    and the last prompt token is fed to both caches. ``softmax(logits_p)`` and ``softmax(logits_q)`` are the
    ``(p_1, q_1)`` the coupling starts from, before any decoding transform.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A causal LM (e.g. from :func:`kvcouple.models.load_model`), on any device.
    input_ids : sequence of int or 1-D tensor
        The prompt's token ids, at least 2.
    policies : sequence of Policy or str
        Policies or their specs (``"snapkv:retain=0.5"``).
    seed : int, default 0
        The run's seed: with ``doc_index`` and each policy's place in ``policies`` it seeds
        policies that draw at random (``random``) as ``trace`` does.
    doc_index : int, default 0
        The document's index in the run.

    Returns
    -------
    list of FirstStep
        One per policy, in the order given; logits as float64 numpy arrays on the host.

    Raises
    ------
    kvcouple.tracer.prefill.PromptTooShortError
        The prompt has fewer than 2 tokens.
    kvcouple.policies.PolicyError
        A spec does not parse, or a policy's parameters are invalid.
    """
    refresh(model)
    pols = [parse_policy(p) if isinstance(p, str) else p for p in policies]
    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1)
    pre = prefill(model, ids, any(p.NEEDS_ATTENTION for p in pols), policies=pols)
    last = pre.input_ids[-1:]
    shape = ModelShape.of_model(model)
    settings = TraceSettings(horizon=1)  # the seeds do not depend on the sizes
    out = []
    with torch.inference_mode():
        for i, pol in enumerate(pols):
            unit = prepare(shape, pre, pol, settings, seed, doc_index, i)
            rows = Trajectories.start(model, pre, unit.kept, copies=1, idx=unit.idx)
            logits = rows.step(torch.cat([last, last])).double().cpu().numpy()
            out.append(
                FirstStep(pol.spec(), logits[0], logits[1], unit.kept_length, pre.prompt_length)
            )
    return out
