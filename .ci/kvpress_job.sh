#!/usr/bin/env bash
# kvpress interop: kvcouple's `kvpress:` policies keep exactly what kvpress's own pipeline
# keeps (prefill), for every kvpress ScorerPress that runs on a tiny Llama on CPU, and
# `tova:heads=all` / `observed` equal TOVAPress / ObservedAttentionPress
# (tests/interop/test_kvpress.py). kvpress pins transformers<5.3, so this runs in its own fresh
# virtual environment: the built wheel with its `kvpress` extra (kvpress 0.5.5 and the
# transformers it accepts), plus pytest. The same environment has pyarrow and datasets (the
# `prompts` extra), so `kvcouple prompts` from Parquet and saved datasets is tested here too
# (tests/tracer/test_prompts.py; elsewhere those cases skip). The real-model cases use the
# SmolLM2 folder the main suite converted (~/.cache/kvcouple/test-models; gguf is installed
# too, so the job converts it itself where the suite has not run).
# Usage: .ci/kvpress_job.sh WHEEL
set -euo pipefail
wheel=$(realpath "$1")
PYTHON=${PYTHON:-python3}
export HF_HUB_OFFLINE=1 PIP_DISABLE_PIP_VERSION_CHECK=1
venv=build/venv-kvpress
rm -rf "$venv"
$PYTHON -m venv "$venv"
"$venv/bin/pip" install -q "$wheel[kvpress,prompts,gguf]" "kvpress==0.5.5" pytest hypothesis
# The test skips where kvpress cannot be imported: make sure it can, so the job tests something.
"$venv/bin/python" - <<'PY'
import importlib.metadata as md

import datasets  # noqa: F401
import kvpress  # noqa: F401
import pyarrow  # noqa: F401

print("kvpress", md.version("kvpress"), "transformers", md.version("transformers"),
      "torch", md.version("torch"))
PY
# kvcouple comes from the wheel (the checkout keeps its sources under python/, not on the path).
"$venv/bin/python" -m pytest -q -p no:cacheprovider -rs tests/interop/test_kvpress.py \
    tests/tracer/test_prompts.py
