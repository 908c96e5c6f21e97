"""The scoreboard (llama.cpp's layout) equals a plain recomputation from the stored rows of a
``--record full`` trace: KL(P||Q) and top-1 agreement from the distributions themselves,
delta p's percentiles from P's top token, means and standard errors across documents."""

from __future__ import annotations

import math

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import xarray as xr  # noqa: E402

from kvcouple.analysis import analyze, write_report  # noqa: E402
from kvcouple.analysis.tables import tidy_tables  # noqa: E402
from text_helpers import POLICIES, cached_text_store  # noqa: E402

pytestmark = pytest.mark.torch


@pytest.fixture(scope="module")
def store():
    return cached_text_store("full")


def _board(rows, policy):
    return {(r["quantity"], r["statistic"]): r for r in rows if r["policy"].startswith(policy)}


def _mean_se(per_doc):
    x = np.asarray(per_doc)
    return x.mean(), x.std(ddof=1) / math.sqrt(len(x))


def test_the_scoreboard_equals_a_plain_recomputation_from_the_stored_rows(store, tmp_path):
    result = analyze(store, n_boot=20, seed=0)
    rows = tidy_tables(result)["scoreboard"]
    ds = xr.open_zarr(str(store))  # plain xarray: no kvcouple reader
    for i, policy in enumerate(POLICIES):
        board = _board(rows, policy)
        kl_docs, kl_rows_docs, agree_docs, dp_docs, pooled_dp = [], [], [], [], []
        for d in range(ds.sizes["doc"]):
            seen = ds.tokens[d, i].values >= 0  # (rep, step): the recorded path steps
            p = ds.p[d, i].values.astype(np.float64)[seen]
            q = ds.q[d, i].values.astype(np.float64)[seen]
            # A probability stored as 0 was below float16's smallest subnormal, 2^-24.
            with np.errstate(divide="ignore", invalid="ignore"):
                kl = np.where(p > 0, p * np.log(p / np.maximum(q, 2.0**-24)), 0.0).sum(-1)
            kl_rows_docs.append(kl.mean())
            kl_docs.append(ds.kl_pq[d, i].values[seen].astype(np.float64).mean())
            agree_docs.append((p.argmax(-1) == q.argmax(-1)).mean())
            top = p.argmax(-1)
            dp = q[np.arange(len(top)), top] - p[np.arange(len(top)), top]
            dp_docs.append(dp.mean())
            pooled_dp.append(dp)
        mean, se = _mean_se(kl_docs)
        assert board[("kl_pq", "mean")]["estimate"] == pytest.approx(mean, rel=1e-9)
        assert board[("kl_pq", "mean")]["se"] == pytest.approx(se, rel=1e-9)
        # The recorded KL is the device's, before the rows were stored in float16.
        assert board[("kl_pq", "mean")]["estimate"] == pytest.approx(
            np.mean(kl_rows_docs), rel=2e-2, abs=1e-4
        )
        mean, se = _mean_se(agree_docs)
        assert board[("same_top", "mean")]["estimate"] == pytest.approx(mean, abs=1e-12)
        assert board[("same_top", "mean")]["se"] == pytest.approx(se, abs=1e-12)
        mean, se = _mean_se(dp_docs)
        assert board[("delta_p", "mean")]["estimate"] == pytest.approx(mean, abs=1e-6)
        pooled = np.concatenate(pooled_dp)
        for statistic, pct in (("max", 100), ("99%", 99), ("median", 50), ("1%", 1)):
            assert board[("delta_p", statistic)]["estimate"] == pytest.approx(
                np.percentile(pooled, pct), abs=1e-6
            )
        assert board[("delta_p", "rms")]["estimate"] == pytest.approx(
            np.sqrt(np.mean(pooled**2)), abs=1e-6
        )
        assert board[("kl_pq", "mean")]["steps"] == pooled.size == ds.sizes["rep"] * 3 * 8
    md = (write_report(result, tmp_path / "r", figures=False) / "report.md").read_text()
    assert (
        "## Scoreboard (as llama-perplexity --kl-divergence prints it)" in md
        and "| Same top p | " in md
    )
    assert "scoreboard.csv" in {p.name for p in (tmp_path / "r").iterdir()}
