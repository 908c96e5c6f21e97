"""Shared synthetic pairs: hypothesis strategies of the synth tests, and two-policy Markov pairs
for small synthetic stores."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from kvcouple import synth


@st.composite
def tiny_kernel(draw: st.DrawFn, vocab: int) -> synth.Kernel:
    """Rows from small integer weights: exact zeros and ties between P and Q are common."""
    states = draw(st.integers(1, 2))
    weights = draw(
        st.lists(
            st.lists(st.integers(0, 3), min_size=vocab, max_size=vocab).filter(any),
            min_size=states,
            max_size=states,
        )
    )
    emit = np.array(weights, dtype=float)
    emit /= emit.sum(1, keepdims=True)
    nxt = draw(
        st.lists(st.integers(0, states - 1), min_size=states * vocab, max_size=states * vocab)
    )
    return synth.Kernel(
        emit, np.array(nxt).reshape(states, vocab), draw(st.integers(0, states - 1))
    )


def two_policy_pairs(seed: int, mix: tuple[float, float]) -> dict[str, dict[str, object]]:
    """Policies "a" and "b": Markov pairs over 5 tokens sharing one random P, each Q that P
    mixed with a random kernel (weights ``mix``), starting from tokens 0 and 1."""
    rng = np.random.default_rng(seed)
    P = rng.dirichlet(np.ones(5), 5)
    return {
        name: {"P": P, "Q": (1 - w) * P + w * rng.dirichlet(np.ones(5), 5), "start": start}
        for start, (name, w) in enumerate(zip("ab", mix, strict=True))
    }
