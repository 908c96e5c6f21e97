"""Prespecified plans (hashing, confirmatory refusal, document sets, Holm), gap attribution,
paired differences and the bootstrap's reproducibility."""

from __future__ import annotations

import numpy as np
import pytest

import kvcouple
from kvcouple import _core
from kvcouple.analysis import PlanError, analyze, load_plan
from kvcouple.analysis.plan import register_plan
from kvcouple.analysis.pvalues import bootstrap_p_value, holm
from kvcouple.cli import main
from kvcouple.synth.trace_store import write_synthetic_trace_store

V = 4
_rng = np.random.default_rng(7)
_P = _rng.dirichlet(np.ones(V), size=V)
PAIRS = {
    "mild": {"P": _P, "Q": 0.9 * _P + 0.1 * _rng.dirichlet(np.ones(V), size=V), "start": 0},
    "harsh": {"P": _P, "Q": 0.5 * _P + 0.5 * _rng.dirichlet(np.ones(V), size=V), "start": 0},
}
DOCS = [0, 1, 2, 3, 0, 1, 2, 3]

PLAN = """
name = "harsh vs mild"
alpha = 0.05
correction = "holm"
n_boot = 300

[documents]
exploratory = ["doc0000", "doc0001", "doc0002"]
confirmatory = ["doc0003", "doc0004", "doc0005", "doc0006", "doc0007"]

[[comparisons]]
name = "harsh loses more"
metric = "mismatch_fraction"
a = "mild"
b = "harsh"
direction = "greater"

[[comparisons]]
metric = "occurrence"
a = "mild"
b = "harsh"
direction = "two-sided"
"""


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "run.zarr"
    return write_synthetic_trace_store(path, PAIRS, horizon=8, replicates=100, docs=DOCS, seed=1)


def _row(rows, **kw):
    return next(r for r in rows if all(r[k] == v for k, v in kw.items()))


def test_gap_attribution_identity(store):
    result = analyze(store, n_boot=300)
    m = result.models[0]
    g = {r["term"]: r for r in m.tables["gap_attribution"]}
    total = g["delta_first_mismatch"]["estimate"] + g["exposure_term"]["estimate"]
    total += g["rate_term"]["estimate"]
    assert g["gap"]["estimate"] == pytest.approx(total, rel=1e-12)
    diff = _row(m.tables["differences"], quantity="mismatch_fraction")
    assert (diff["policy_a"], diff["policy_b"]) == ("mild", "harsh")
    assert g["gap"]["estimate"] == pytest.approx(diff["difference"], rel=1e-12)
    assert g["gap"]["estimate"] > 0 and g["gap"]["ci_low"] > 0  # harsh is clearly worse
    for term in g.values():
        assert term["ci_low"] <= term["estimate"] <= term["ci_high"]
    share = g["exposure_share"]["estimate"]
    assert share == pytest.approx(g["exposure_term"]["estimate"] / g["gap"]["estimate"])


def test_plan_hash_ignores_layout_but_not_content(tmp_path):
    a, b, c = tmp_path / "a.toml", tmp_path / "b.toml", tmp_path / "c.toml"
    a.write_text(PLAN)
    b.write_text("# a comment\n" + PLAN.replace("alpha = 0.05", "alpha    = 0.05  # five"))
    c.write_text(PLAN.replace("alpha = 0.05", "alpha = 0.1"))
    assert load_plan(a).hash == load_plan(b).hash != load_plan(c).hash


def test_confirmatory_refuses_a_changed_plan(tmp_path):
    store = write_synthetic_trace_store(
        tmp_path / "run.zarr", PAIRS, horizon=8, replicates=100, docs=DOCS, seed=1
    )
    plan, changed = tmp_path / "plan.toml", tmp_path / "changed.toml"
    plan.write_text(PLAN)
    changed.write_text(PLAN.replace('direction = "two-sided"', 'direction = "less"'))
    register_plan(load_plan(plan), store)
    first = analyze(store, plan=plan, doc_set="confirmatory", allow_unregistered=True)
    assert [d.doc_id for d in first.models[0].docs] == [f"doc000{i}" for i in range(3, 8)]
    assert first.plan_hash == load_plan(plan).hash
    # Registered after its confirmatory documents were traced: stamped, refused by default.
    assert first.preregistration.startswith("not preregistered: plan")
    with pytest.raises(PlanError, match="after 5 of its confirmatory documents"):
        analyze(store, plan=plan, doc_set="confirmatory")
    again = analyze(store, plan=plan, doc_set="confirmatory", allow_unregistered=True)
    assert again.tests == first.tests
    with pytest.raises(PlanError, match="not this plan"):
        analyze(store, plan=changed, doc_set="confirmatory")
    with pytest.raises(PlanError, match="already has plan"):
        register_plan(load_plan(changed), store)
    # Exploratory analyses may change the plan freely.
    explo = analyze(store, plan=changed, doc_set="exploratory")
    assert [d.doc_id for d in explo.models[0].docs] == ["doc0000", "doc0001", "doc0002"]
    # The command line says why it refuses.
    out = tmp_path / "out"
    args = ["analyze", str(store), "--out", str(out), "--docs", "confirmatory", "--no-figures"]
    assert main([*args, "--plan", str(plan), "--not-preregistered"]) == 0
    assert load_plan(plan).hash in (out / "tests.csv").read_text()
    assert "not preregistered" in (out / "tests.csv").read_text()
    assert main([*args, "--plan", str(plan)]) == 2
    assert main([*args, "--plan", str(changed), "--not-preregistered"]) == 0
    assert "not this plan" in (out / "report.md").read_text()


def test_tests_are_corrected_and_recorded(store, tmp_path):
    plan = tmp_path / "plan.toml"
    plan.write_text(PLAN.replace("n_boot = 300", 'n_boot = 300\nci_method = "percentile"'))
    result = analyze(store, plan=plan, doc_set="exploratory")
    assert len(result.tests) == 2
    t = result.tests[0]
    assert t["comparison"] == "harsh loses more" and t["correction"] == "holm"
    assert t["p_value"] <= t["p_adjusted"] <= 1
    assert t["estimate"] > 0 and t["reject_h0"]
    assert result.tests[1]["p_adjusted"] >= result.tests[1]["p_value"]
    # Three documents under expanded-bca (t with 2 df): the bootstrap cannot resolve a 95%
    # end, which is extrapolated below every replicate; the p-value agrees with the CI.
    plan.write_text(PLAN.replace("n_boot = 300", 'n_boot = 300\nci_method = "expanded-bca"'))
    res = analyze(store, plan=plan, doc_set="exploratory")
    t = res.tests[0]
    boot = res.models[0].bootstrap
    assert t["ci_method"] == "expanded-bca" and np.isfinite(t["ci_low"])
    assert (t["p_value"] < 0.05) == (t["ci_low"] > 0)
    assert boot is not None and boot.n_docs == 3 and np.isfinite(t["ci_high"])
    diffs = boot.evaluate(lambda g: g("harsh|expected_mismatches") - g("mild|expected_mismatches"))
    assert t["ci_low"] < diffs.boot.min() / 8  # beyond every replicate (per token: / T)


def test_plan_errors_name_the_problem(tmp_path, store):
    bad = tmp_path / "bad.toml"
    bad.write_text(PLAN.replace('metric = "occurrence"', 'metric = "vibes"'))
    with pytest.raises(PlanError, match="metric must be one of .*got 'vibes'"):
        load_plan(bad)
    bad.write_text(PLAN.replace('"doc0003", ', '"nope", '))
    with pytest.raises(PlanError, match="not in the store.*nope"):
        analyze(store, plan=bad, doc_set="confirmatory")
    bad.write_text(PLAN.replace('b = "harsh"\ndirection = "greater"', 'b = "h2o"\n'))
    with pytest.raises(ValueError, match="policy 'h2o' is not in"):
        analyze(store, plan=bad, doc_set="exploratory")


def test_split_by_hash_is_deterministic_and_disjoint(tmp_path):
    text = PLAN.split("[documents]")[0] + "[documents]\nsplit = { exploratory_fraction = 0.5 }\n"
    text += "[[comparisons]]" + PLAN.split("[[comparisons]]")[1]
    plan_file = tmp_path / "s.toml"
    plan_file.write_text(text)
    plan = load_plan(plan_file)
    ids = [f"doc{i:04d}" for i in range(200)]
    ex, co = plan.documents(ids, "exploratory"), plan.documents(ids, "confirmatory")
    assert not set(ex) & set(co) and len(ex) + len(co) == 200 and 60 < len(ex) < 140
    assert ex == load_plan(plan_file).documents(list(reversed(ids))[::-1], "exploratory")


def test_holm_and_p_values():
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert holm([0.5, 0.001]) == pytest.approx([0.5, 0.002])
    boot = np.linspace(0.01, 1, 99)
    assert bootstrap_p_value(boot, "greater") == pytest.approx(1 / 100)
    assert bootstrap_p_value(boot, "less") == pytest.approx(1.0)
    assert bootstrap_p_value(boot, "two-sided") == pytest.approx(2 / 100)


@pytest.mark.parametrize("accel", [-0.2, 0.0, 0.2])
def test_p_value_far_beyond_every_replicate_is_small_not_nan(accel):
    # Replicates far above 0: the normal tail underflows; BCa with accel < 0 used to give NaN.
    boot = np.random.default_rng(3).normal(50.0, 1.0, size=400)
    for kwargs in ({"z0": 0.1, "accel": accel}, {"z0": 0.1, "accel": accel, "n_docs": 16}):
        greater = bootstrap_p_value(boot, "greater", **kwargs)
        less = bootstrap_p_value(boot, "less", **kwargs)
        two = bootstrap_p_value(boot, "two-sided", **kwargs)
        assert np.isfinite([greater, less, two]).all()
        assert greater < 1e-3 and less > 0.999 and two < 2e-3


def test_bootstrap_is_seeded_and_thread_independent():
    values = np.random.default_rng(0).normal(size=(50, 3))
    a = _core.bootstrap_means(values, 200, 5)
    kvcouple.set_num_threads(1)
    try:
        b = _core.bootstrap_means(values, 200, 5)
    finally:
        kvcouple.set_num_threads(0)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, _core.bootstrap_means(values, 200, 6))
    assert abs(a.mean(0) - values.mean(0)).max() < 0.05
    assert np.allclose(a.std(0), values.std(0) / np.sqrt(50), rtol=0.2)
    with pytest.raises(ValueError, match="n_boot"):
        _core.bootstrap_means(values, 0, 5)


def test_several_stores_are_reported_per_model(store, tmp_path):
    other = write_synthetic_trace_store(
        tmp_path / "other.zarr",
        PAIRS,
        horizon=8,
        replicates=50,
        docs=[0, 1, 2],
        seed=9,
        model_id="other-model",
    )
    result = analyze([store, other], n_boot=100)
    assert [m.model for m in result.models] == ["synthetic", "other-model"]
    assert [len(m.docs) for m in result.models] == [8, 3]
    out = tmp_path / "rep"
    assert (
        main(
            [
                "analyze",
                str(store),
                str(other),
                "--out",
                str(out),
                "--n-boot",
                "100",
                "--no-figures",
            ]
        )
        == 0
    )
    text = (out / "summary.csv").read_text()
    assert "other-model,harsh,mismatch_fraction" in text and "synthetic,mild,occurrence" in text
