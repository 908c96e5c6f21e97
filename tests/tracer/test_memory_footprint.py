"""The memory footprint from numbers: a model's shape given as figures, no model, no torch.

These run without torch installed (the compat venv and ``-m "not torch"`` run them): the
footprint is arithmetic on the shape, the prompt length, the policies and R, K, L, T.
``tests/tracer/test_tracer_scale.py`` checks the same footprint against the tensors a traced
document holds.
"""

from __future__ import annotations

import pytest

from kvcouple.policies import parse_policy
from kvcouple.tracer.memory import (
    FootprintTooLargeError,
    Sizes,
    choose_branch_batch,
    document_footprint,
)
from kvcouple.tracer.shape import ModelShape, choose_layout

GIB = 1 << 30


def llama3_8b(shared: bool = True, windowed: bool = False) -> ModelShape:
    """Llama-3-8B's shape in bf16: 32 layers, 8 KV heads of 128, 32 query heads."""
    return ModelShape(
        layers=32,
        kv_heads=8,
        head_dim=128,
        query_heads=32,
        hidden=4096,
        intermediate=14336,
        vocab=128256,
        itemsize=2,
        weight_bytes=16 * GIB,
        windowed=windowed,
        shared_prefix=shared,
    )


SIZES = Sizes(horizon=256, replicates=8, branches=4, window=32)


def test_token_bytes_are_keys_and_values_of_every_layer_and_head():
    assert llama3_8b().token_bytes == 2 * 32 * 8 * 128 * 2 == 131072


@pytest.mark.parametrize("spec", ["recent:retain=0.5", "snapkv:retain=0.25", "h2o:budget=512"])
def test_components_add_up(spec):
    shape, n = llama3_8b(), 4096
    plan = document_footprint(shape, n, [parse_policy(spec)], SIZES, 8)
    c = shape.token_bytes
    assert plan.prompt_cache == (n - 1) * c  # the last prompt token is fed as the first step
    assert plan.branch_count == SIZES.replicates * SIZES.branches
    assert plan.branch_batch == 8
    assert plan.peak == max(plan.phases.values()) and plan.phases[plan.phase] == plan.peak
    if plan.layout == "shared":
        # Rows hold their own columns only; the prefixes are held once.
        assert plan.path_p == plan.path_q == SIZES.replicates * SIZES.horizon * c
    assert plan.fits  # no budget: fits


def test_a_larger_branch_batch_never_needs_less():
    shape, pol = llama3_8b(shared=False), [parse_policy("recent:retain=0.5")]
    peaks = [document_footprint(shape, 8192, pol, SIZES, b).peak for b in (1, 2, 4, 8, 16, 32)]
    assert peaks == sorted(peaks) and peaks[0] < peaks[-1]


def test_the_largest_fitting_branch_batch_is_chosen():
    shape, pol, n = llama3_8b(shared=False), [parse_policy("recent:retain=0.5")], 32768
    at = {b: document_footprint(shape, n, pol, SIZES, b).peak for b in range(1, 33)}
    budget = (at[5] + at[6]) // 2  # 5 fits, 6 does not
    plan = choose_branch_batch(shape, n, pol, SIZES, budget)
    assert plan.branch_batch == 5 and plan.fits and plan.budget == budget
    assert choose_branch_batch(shape, n, pol, SIZES, at[32]).branch_batch == 32


def test_a_document_that_does_not_fit_one_branch_at_a_time_is_refused_with_figures():
    shape, pol = llama3_8b(shared=False), [parse_policy("recent:retain=0.5")]
    one = document_footprint(shape, 32768, pol, SIZES, 1)
    with pytest.raises(FootprintTooLargeError) as e:
        choose_branch_batch(shape, 32768, pol, SIZES, one.peak - 1, doc_id="long")
    text = str(e.value)
    assert "long" in text and "GiB" in text


def test_shared_prefix_holds_less_than_joint_or_split():
    pol = [parse_policy("recent:retain=0.5")]
    shared = document_footprint(llama3_8b(shared=True), 32768, pol, SIZES, 32)
    other = document_footprint(llama3_8b(shared=False), 32768, pol, SIZES, 32)
    assert shared.layout == "shared" and other.layout in ("joint", "split")
    assert shared.peak < other.peak / 4


def test_layout_rules():
    shape = llama3_8b(shared=False)
    # Decode-time eviction and sliding-window models stay joint whatever the setting.
    assert choose_layout(shape, 1000, 500, 8, decode_time=True, setting="split") == "joint"
    windowed = llama3_8b(shared=True, windowed=True)
    assert choose_layout(windowed, 1000, 500, 8, decode_time=False) == "joint"
    assert choose_layout(llama3_8b(), 1000, 500, 8, decode_time=False) == "shared"
    # Nothing evicted: nothing to split.
    assert choose_layout(shape, 1000, 1000, 8, decode_time=False, setting="split") == "joint"
    assert choose_layout(shape, 1000, 500, 8, decode_time=False, setting="split") == "split"
    # auto splits once the padded columns outweigh the weights read a second time.
    c, R = shape.token_bytes, 8
    evicted = shape.weight_bytes // (R * c)  # padded bytes == weights
    assert choose_layout(shape, 2 * evicted, evicted, R, False) == "split"
    assert choose_layout(shape, 2 * evicted - 2, evicted, R, False) == "joint"


def test_the_memory_plan_names_still_read_with_a_warning():
    """The footprint's former names (the "memory plan"), deprecated aliases for one release."""
    from kvcouple.tracer import memory

    for old, new in (
        ("MemoryPlanError", "FootprintTooLargeError"),
        ("DocumentPlan", "DocumentFootprint"),
        ("HostPlan", "HostFootprint"),
        ("plan_document", "document_footprint"),
        ("plan_documents", "document_footprints"),
        ("plan_loaded", "loaded_footprints"),
        ("plan_host", "host_footprint"),
        ("format_plan", "format_footprints"),
    ):
        with pytest.warns(DeprecationWarning, match=f"use {new!r}"):
            assert getattr(memory, old) is getattr(memory, new)
