"""What a run of :func:`kvcouple.tracer.run.trace` did: documents traced and skipped, tokens,
seconds and the mean occurrence per policy, in one process or on a Dask cluster."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvcouple.policies import Policy
from kvcouple.store.background import WriterStats
from kvcouple.tracer.batches import Written


@dataclass
class RunSummary:
    """What one invocation of :func:`trace` did."""

    store: Path | str  # a local path, or an object-storage URL
    documents: int
    traced: list[int] = field(default_factory=list)
    skipped: int = 0
    generated_tokens: int = 0
    branch_batches: int = 0
    seconds: float = 0.0
    occurrence: dict[str, float] = field(default_factory=dict)
    # Worker address -> models it loaded during the run (a Dask run; {} in one process).
    model_loads: dict[str, int] = field(default_factory=dict)
    writer: WriterStats | None = None  # the background writer's counters (one process)
    _occurrence: dict[int, np.ndarray] = field(default_factory=dict, repr=False)

    def add(self, written: Written) -> None:
        """Count a document written."""
        self.traced.append(written.doc)
        self.generated_tokens += written.generated_tokens
        self.branch_batches += written.branch_batches
        self._occurrence[written.doc] = written.occurrence

    def finish(self, policies: Sequence[Policy], seconds: float) -> None:
        """The mean occurrence per policy, over the documents in index order (the same sum
        whatever order they were written in)."""
        self.seconds = seconds
        self.traced.sort()
        if self.traced:
            mean = np.mean([self._occurrence[d] for d in self.traced], axis=0).tolist()
            self.occurrence = dict(zip([p.spec() for p in policies], mean, strict=True))

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0

    def format(self) -> str:
        lines = [
            f"store: {self.store}",
            f"documents: {len(self.traced)} traced, {self.skipped} already done, "
            f"{self.documents} in the run",
            f"generated tokens (both sides): {self.generated_tokens} in {self.seconds:.1f} s "
            f"({self.tokens_per_second:.1f} tokens/s)",
            f"branch batches: {self.branch_batches}",
        ]
        for spec, value in self.occurrence.items():
            lines.append(f"  {spec}: mean occurrence estimate P(tau <= T) = {value:.4f}")
        return "\n".join(lines)
