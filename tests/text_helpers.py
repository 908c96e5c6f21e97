"""A small store with text, traced from the embedded default model (which ships a tokenizer):
hostile document ids and prompt text (markup, control characters, multi-byte characters), the
full record (so the path's rows can be recomputed), two policies."""

from __future__ import annotations

import json
from pathlib import Path

# Ids and texts as a hostile user might write them: markup, an escape sequence, a bell,
# characters of two, three and four bytes.
DOCS = [
    ("<script>alert('id')</script>", "Dear colleague, <b>thank you</b> & for the draft; I have"),
    ("esc\x1b[31mred", "To build the package from a checkout, first install \x07 a Rust"),
    ("café ☃", "Über naïve café — 北京 🙂 the weather today is"),
]
POLICIES = ["recent:retain=0.5", "snapkv:retain=0.5"]


def write_prompts(path: Path) -> Path:
    path.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in DOCS))
    return path


def trace_text_store(folder: Path, record: str = "full", horizon: int = 8) -> Path:
    """Trace :data:`DOCS` under :data:`POLICIES` into ``folder/run.zarr`` (a few seconds)."""
    from kvcouple.models import load_model
    from kvcouple.store.schema import Record
    from kvcouple.tracer import load_prompts
    from kvcouple.tracer.run import trace
    from kvcouple.tracer.settings import TraceSettings

    model, tokenizer = load_model(None, device="cpu")
    prompts = load_prompts(write_prompts(folder / "docs.jsonl"), tokenizer)
    settings = TraceSettings(
        horizon=horizon, replicates=2, branches=2, window=horizon, record=Record.parse(record)
    )
    out = folder / "run.zarr"
    trace(model, prompts, POLICIES, settings, out, seed=0, progress=False, tokenizer=tokenizer)
    return out
