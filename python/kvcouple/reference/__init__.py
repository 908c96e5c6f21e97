"""Independent numba implementations of kvcouple's kernels: test oracles and benchmark peers.

Deliberately simple, readable loops; they share no code with the Rust core.
numba cannot take float16 or bfloat16, so widen inputs to float64 first
(:func:`widen` does it, reading bfloat16 from uint16 bits).
"""
