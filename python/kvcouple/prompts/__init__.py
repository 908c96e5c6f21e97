"""``kvcouple prompts``: the prompt file the tracer reads, built from local data (JSON lines,
CSV, Parquet, a saved ``datasets`` folder) with the model's tokenizer; see
:mod:`kvcouple.prompts.build`."""

from kvcouple.prompts.build import (
    Built,
    PromptBuildError,
    bucket,
    build_prompts,
    documents_section,
    read_records,
    write_prompt_file,
)

__all__ = [
    "Built",
    "PromptBuildError",
    "bucket",
    "build_prompts",
    "documents_section",
    "read_records",
    "write_prompt_file",
]
