"""The decoding transform and coupling sampler the tracer uses (named in ``transform.rs``).

Both live in :mod:`kvcouple.torch_coupling`; this module re-exports them under the name the
Rust documentation gives.
"""

from kvcouple.torch_coupling import apply_decoding, couple_rows, couple_torch

__all__ = ["apply_decoding", "couple_rows", "couple_torch"]
