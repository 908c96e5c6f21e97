"""``streaming``: attention sinks plus recent tokens (StreamingLLM).

Keeps the first ``sinks`` prompt tokens and the most recent ones, ``kept`` in all. When the
budget is smaller than ``sinks`` (plus the re-fed last token) only the first tokens fit.
"""

from __future__ import annotations

from kvcouple.policies.base import Policy, PolicyContext, PolicyParameterError, recent_indices


class Streaming(Policy):
    """``sinks`` first tokens + most recent tokens."""

    name = "streaming"
    PARAMS = {"sinks": (int, 4)}

    def validate(self) -> None:
        if self.params["sinks"] < 0:
            raise PolicyParameterError(f"streaming: sinks must be >= 0, got {self.params['sinks']}")

    def select(self, ctx: PolicyContext, keep: int):
        return recent_indices(ctx, keep, first=self.params["sinks"])
