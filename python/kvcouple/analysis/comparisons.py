"""Comparisons beyond one store's summary: gap attribution pooled across models
(:func:`pool_gaps`) and a plan's confirmatory tests (:func:`run_tests`), both from the stores'
document bootstraps."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from kvcouple.analysis import stats as st
from kvcouple.analysis.bootstrap import bootstrap_table
from kvcouple.analysis.estimates import Table
from kvcouple.analysis.plan import Plan, PlanError
from kvcouple.analysis.pvalues import holm
from kvcouple.analysis.results import AnalysisResult, ModelResult

__all__ = ["pool_gaps", "run_tests"]


def pool_gaps(models: list[ModelResult], cfg: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Gap attribution pooled across models (equal weight per model), bootstrapped over the
    union of documents aligned by id (documents shared by models are resampled together)."""
    if len(models) < 2:
        raise ValueError("pooling gaps across models needs at least two stores")
    common = [p for p in models[0].policies if all(p in m.policies for m in models)]
    ids = sorted({d.doc_id for m in models for d in m.docs})
    row = {d: i for i, d in enumerate(ids)}
    joint = Table(ids)
    for m in models:
        assert m.table is not None
        at = np.array([row[d] for d in m.table.doc_ids])
        for name, col in m.table.cols.items():
            full = np.full(len(ids), np.nan)
            full[at] = col
            joint.cols[f"{m.model}::{name}"] = full
    bs = bootstrap_table(joint, cfg["n_boot"], cfg["seed"], cfg["ci_level"], cfg["ci_method"])
    rows: list[dict[str, Any]] = []
    for a, b in st.policy_pairs(common, cfg["reference"]):
        fns = st.pooled_gap_fns(a, b, [(f"{m.model}::", m.horizon) for m in models])
        rows += st.gap_rows(
            bs, fns, {"model": "pooled: " + " + ".join(m.model for m in models),
                      "policy_a": a, "policy_b": b},
            st.gap_scales(min(m.horizon for m in models)),
        )  # fmt: skip
    return {"gap_attribution": rows}


def run_tests(result: AnalysisResult, plan: Plan) -> list[dict[str, Any]]:
    """The plan's comparisons: estimate, CI at level 1 - alpha, bootstrap p-value (of the
    interval's method), corrected for multiplicity over every test (paired and within-policy)."""
    rows: list[dict[str, Any]] = []
    for c in plan.comparisons:
        models = [m for m in result.models if c.model in (None, m.model)]
        if not models:
            raise PlanError(
                f"comparison {c.name!r}: no model {c.model!r} among "
                f"{[m.model for m in result.models]}"
            )
        for m in models:
            for pol in c.policies:
                if pol not in m.policies:
                    raise PlanError(
                        f"comparison {c.name!r}: policy {pol!r} is not in "
                        f"{m.store} (policies: {', '.join(m.policies)})"
                    )
            assert m.bootstrap is not None
            bs = m.bootstrap.at_level(1.0 - plan.alpha)
            if c.policy is not None:
                fn = st.quantity_fn(c.policy, c.metric, m.horizon)
            else:
                fa = st.quantity_fn(str(c.a), c.metric, m.horizon)
                fb = st.quantity_fn(str(c.b), c.metric, m.horizon)
                fn = st.difference(fa, fb)
            scale = st.quantity_scale(c.metric, m.horizon, paired=c.policy is None)
            est = bs.evaluate(fn, c.policy is not None and c.metric in st.INVERTED_SUMMARY, scale)
            p_value = bs.p_value(est, c.direction, c.value)
            if c.policy is not None and c.metric == "median_tau" and bs.method == "studentized":
                # A policy's median step: the summary's test-inversion set and its test's
                # p-value at the value.
                pmf = st.pmf_columns(c.policy, m.horizon)
                inverted = bs.median_step(pmf)
                if inverted is not None:
                    est = replace(inverted, scale=scale)
                    p_value = bs.median_step_p_value(pmf, c.direction, c.value)
            if c.policy is None and c.metric == "median_tau" and bs.method == "studentized":
                # A paired median difference: the test-inversion set and its test's p-value.
                pmf_a, pmf_b = (st.pmf_columns(str(p), m.horizon) for p in (c.a, c.b))
                inverted = bs.median_difference(pmf_a, pmf_b)
                if inverted is not None:
                    est = replace(inverted, scale=scale)
                    p_value = bs.median_difference_p_value(pmf_a, pmf_b, c.direction, c.value)
            rows.append(
                {
                    "comparison": c.name,
                    "model": m.model,
                    "metric": c.metric,
                    "policy_a": c.a or "",
                    "policy_b": c.b or "",
                    "policy": c.policy or "",
                    "value": c.value,
                    "direction": c.direction,
                    "estimate": est.estimate,
                    "ci_low": est.ci_low,
                    "ci_high": est.ci_high,
                    "ci_method": est.method,
                    "p_value": p_value,
                    "n_docs": bs.n_docs,
                    "doc_set": result.doc_set,
                }
            )
    raw = [r["p_value"] for r in rows]
    if plan.correction == "holm":
        adj = holm(raw)
    elif plan.correction == "bonferroni":
        adj = [min(1.0, p * len(raw)) for p in raw]
    else:
        adj = raw
    for r, p in zip(rows, adj, strict=True):
        r["p_adjusted"] = p
        r["correction"] = plan.correction
        r["alpha"] = plan.alpha
        r["reject_h0"] = bool(p < plan.alpha)
    return rows
