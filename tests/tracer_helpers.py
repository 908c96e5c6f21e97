"""Shared pieces of the tracer tests: tiny models (cached), reference computations."""

import functools

import numpy as np
import pytest
import torch

from kvcouple.policies import PolicyContext, parse_policy
from kvcouple.testing.tiny_models import tiny_model
from kvcouple.torch_coupling import apply_decoding

VOCAB = 128
PROMPT = [int(x) for x in np.random.default_rng(0).integers(1, VOCAB - 1, size=26)]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Tiny models on a shared 2-core machine: one thread avoids oversubscription stalls.
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def is_tensor(o: object) -> bool:
    """isinstance, except that a ``weakref.proxy`` whose referent died (left by an earlier test's
    library) raises ReferenceError on any attribute lookup: such an object holds no tensor."""
    try:
        return isinstance(o, torch.Tensor)
    except ReferenceError:
        return False


def model(arch: str, attn: str = "sdpa"):
    try:
        return _model(arch, attn)
    except ImportError as e:  # an architecture the installed transformers lacks
        pytest.skip(str(e))


@functools.cache
def _model(arch: str, attn: str):
    return tiny_model(arch, seed=7, attn_implementation=attn)


def distributions(arr: dict, side: str, policy: int, rep: int) -> np.ndarray:
    """Path distributions ``(T, V)`` rebuilt from a ``topk:V`` record."""
    ids = arr[f"topk_ids_{side}"][policy, rep]
    probs = arr[f"topk_probs_{side}"][policy, rep]
    out = np.zeros((ids.shape[0], VOCAB))
    np.put_along_axis(out, ids.astype(np.int64), probs, axis=1)
    return out


def masked_forward(m, tokens: list[int], prompt_length: int, kept: set[int]) -> np.ndarray:
    """Next-token distributions of the full model where queries from the last prompt token on
    cannot see evicted prompt positions (same position ids)."""
    L = len(tokens)
    allowed = torch.ones(L, L, dtype=torch.bool).tril()
    hidden = torch.tensor([j < prompt_length - 1 and j not in kept for j in range(L)])
    allowed[prompt_length - 1 :, :] &= ~hidden[None, :]
    mask = torch.zeros(L, L).masked_fill(~allowed, torch.finfo(torch.float32).min)
    with torch.no_grad():
        logits = m(
            input_ids=torch.tensor([tokens]),
            attention_mask=mask[None, None],
            position_ids=torch.arange(L)[None],
        ).logits[0, prompt_length - 1 :]
    return apply_decoding(logits).numpy()


def kept_positions(spec: str, n: int) -> set[int]:
    """Prompt positions a content-independent policy keeps (the last token always)."""
    policy = parse_policy(spec)
    zeros = [torch.zeros(2, n - 1, 16)]
    idx = policy.select(PolicyContext(zeros, zeros), policy.kept_count(n) - 1)
    return set(idx[0, 0].tolist()) | {n - 1}
