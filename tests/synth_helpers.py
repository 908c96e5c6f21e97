"""Shared hypothesis strategies of the synth tests."""

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
