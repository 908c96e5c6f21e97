"""The value checks of a batch of documents at once (``StoreValidation.batch_allowed``) pass
exactly where the document-by-document checks pass: every kind of damage the per-document
check refuses makes the batch check say "check by document" (it never accepts damage), and
a clean batch, with its NaN where nothing was recorded, is accepted."""

from __future__ import annotations

import numpy as np
import pytest

from kvcouple.analysis.reading import SUMMARY_READ
from kvcouple.errors import StoreError
from kvcouple.store.reader import TraceStoreReader
from kvcouple.synth.trace_store import write_synthetic_trace_store

_rng = np.random.default_rng(4)
_P = _rng.dirichlet(np.ones(5), size=5)
# An absorbing token (4) ends some paths early: NaN after the end is allowed.
_Q = 0.5 * _P + 0.5 * _rng.dirichlet(np.ones(5), size=5)
PAIRS = {"a": {"P": _P, "Q": _Q, "start": 0}, "b": {"P": _P, "Q": _Q[::-1], "start": 1}}
NAMES = (*SUMMARY_READ, "prompt_length")


@pytest.fixture(scope="module")
def reader(tmp_path_factory):
    path = tmp_path_factory.mktemp("batch") / "run.zarr"
    write_synthetic_trace_store(
        path, PAIRS, horizon=8, window=3, branches=2, replicates=6, docs=5, seed=2
    )
    return TraceStoreReader(path)


def _stacks(reader):
    names = tuple(dict.fromkeys(NAMES))
    stacks, supported, problem = reader.engine_reads._read_stacked(names, list(reader.done))
    assert supported and problem is None and stacks is not None
    return stacks


def _per_document_ok(reader, stacks):
    try:
        for k, doc in enumerate(reader.done):
            blocks = {n: v[k, ...] for n, v in stacks.items()}
            reader.validation.check_values("prompt_length", blocks["prompt_length"], (doc,))
            reader.validation.prompt_lengths[doc] = int(blocks["prompt_length"])
            for n, b in blocks.items():
                reader.validation.check_values(n, b, (doc,) + (0,) * b.ndim, blocks)
    except StoreError:
        return False
    return True


def _batch_ok(reader, stacks):
    prompts = stacks["prompt_length"].reshape(-1)
    return all(reader.validation.batch_allowed(n, v, stacks, prompts) for n, v in stacks.items())


def test_a_clean_batch_is_accepted_with_its_unrecorded_nan(reader):
    stacks = _stacks(reader)
    assert np.isnan(stacks["branch_tv"]).any()  # branches past the window: not recorded
    assert _batch_ok(reader, stacks) and _per_document_ok(reader, stacks)


def _damages(stacks):
    """(name, index, value): each breaks a rule the per-document check enforces."""
    tokens = stacks["tokens"]
    recorded = np.argwhere(tokens >= 0)[-1]  # a recorded step of the last document
    marked = np.argwhere(stacks["branch_mismatch"] != -1)[0]
    yield "kl_pq", tuple(recorded), np.nan  # NaN where the path was recorded
    yield "entropy_p", tuple(recorded), np.inf
    yield "hazard", tuple(recorded), np.nan  # hazard never holds NaN
    yield "hazard", tuple(recorded), 1.5
    yield "branch_tv", tuple(marked), np.nan  # NaN where a branch was recorded
    yield "tokens", tuple(recorded), -2
    yield "branch_mismatch", tuple(marked), 2
    yield "branch_step", (0,) * stacks["branch_step"].ndim, 10**6
    yield "kept_length", (2,) + (0,) * (stacks["kept_length"].ndim - 1), 10**6
    yield "prompt_length", (1,), 0


@pytest.mark.parametrize("case", range(10))
def test_damage_is_never_accepted_by_the_batch_check(reader, case):
    stacks = {n: v.copy() for n, v in _stacks(reader).items()}
    name, index, value = list(_damages(stacks))[case]
    stacks[name][index] = value
    assert not _per_document_ok(reader, stacks), (name, index, value)
    assert not _batch_ok(reader, stacks), (name, index, value)
