"""The scoreboard's delta p of a full record comes from the engine's recomputation (one decode
of the stored rows): equal to numpy's ``q(a) - p(a)``, ``a = argmax p`` over the rows read a
second time, ties (the first maximum) included."""

from __future__ import annotations

import numpy as np
import pytest

from kvcouple.analysis.reading import SUMMARY_READ
from kvcouple.analysis.scoreboard import TOP_DELTA, doc_scores
from kvcouple.analysis.tasks import Options, analyze_doc, analyze_docs
from kvcouple.store.reader import TraceStoreReader
from kvcouple.synth.trace_store import write_synthetic_trace_store

RNG = np.random.default_rng(5)
PAIRS = {
    # Uniform rows: every step's top token is a tie, decided by the first maximum.
    "ties": {"P": np.full((5, 5), 0.2), "Q": np.full((5, 5), 0.2) * 0.6 + 0.4 * np.eye(5)},
    "spread": {"P": RNG.dirichlet(np.ones(5), 5), "Q": RNG.dirichlet(np.ones(5), 5)},
}


@pytest.fixture(scope="module")
def reader(tmp_path_factory):
    path = tmp_path_factory.mktemp("full") / "run.zarr"
    write_synthetic_trace_store(
        path, PAIRS, record="full", horizon=6, branches=2, replicates=8, docs=4, seed=1
    )
    return TraceStoreReader(path)


def _second_read(reader, doc):
    summary = reader.read_summary(doc, SUMMARY_READ)
    assert TOP_DELTA not in summary
    return doc_scores(reader, doc, summary)


def test_delta_p_from_the_recomputation_equals_a_second_read(reader):
    together = analyze_docs(reader, list(reader.done), Options())
    alone = [analyze_doc(reader, d, Options()) for d in reader.done]
    for got in (together, alone):
        for result in got:
            assert result.error is None
            want = _second_read(reader, result.doc)
            for policy in reader.policies:
                dp, ref = result.scores[policy].dp, want[policy].dp
                assert dp is not None and ref is not None and dp.size > 0
                np.testing.assert_array_equal(dp, ref)


def test_delta_p_by_hand_on_the_stored_rows(reader):
    doc = reader.done[0]
    result = analyze_doc(reader, doc, Options())
    for i, policy in enumerate(reader.policies):
        seen = reader.read_summary(doc, ("tokens",))["tokens"][i] >= 0
        p = reader.read("p", (doc, i)).astype(np.float32)[seen]
        q = reader.read("q", (doc, i)).astype(np.float32)[seen]
        top = p.argmax(axis=-1)
        rows = np.arange(len(top))
        want = (q[rows, top] - p[rows, top]).astype(np.float64)
        np.testing.assert_array_equal(result.scores[policy].dp, want)
