"""The confirmatory protocol: strict plans, within-policy tests against exact truth, sealed
settings, the store's plan registry, and the "not preregistered" stamp."""

from __future__ import annotations

import hashlib
import json
import shutil

import numpy as np
import pytest

from kvcouple import synth
from kvcouple.analysis import PlanError, analyze, load_plan, write_report
from kvcouple.analysis.plan import parse_plan, register_plan
from kvcouple.cli import main
from kvcouple.synth.trace_store import write_synthetic_trace_store

V, T = 3, 8
_rng = np.random.default_rng(3)
_P = _rng.dirichlet(np.ones(V), size=V)
PAIRS = {
    "mild": {"P": _P, "Q": 0.9 * _P + 0.1 * _rng.dirichlet(np.ones(V), size=V), "start": 0},
    "harsh": {"P": _P, "Q": 0.4 * _P + 0.6 * _rng.dirichlet(np.ones(V), size=V), "start": 0},
}
STARTS = [0, 1, 2] * 4  # 12 documents
CONF = [f"doc{i:04d}" for i in range(3, 12)]

PLAN = f"""
name = "confirmatory"
n_boot = 400
[documents]
exploratory = ["doc0000", "doc0001", "doc0002"]
confirmatory = {json.dumps(CONF)}

[[comparisons]]
metric = "mismatch_fraction"
a = "mild"
b = "harsh"
direction = "greater"

[[comparisons]]
metric = "late_minus_early_tv"
policy = "harsh"
direction = "two-sided"
"""


def _exact(policy: str, start: int) -> synth.ExactResult:
    pair = dict(PAIRS[policy], start=start)
    return synth.exact(synth.pair_from_mapping(pair), horizon=T)


def _truth_mismatch_fraction(policy: str, docs: list[int]) -> float:
    return float(np.mean([_exact(policy, STARTS[d]).mismatch_fraction for d in docs]))


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("conf") / "run.zarr"
    return write_synthetic_trace_store(path, PAIRS, horizon=T, replicates=200, docs=STARTS, seed=4)


def _plan(tmp_path, text=PLAN, name="plan.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


# ---- strict plans ----

BAD = [
    ('corection = "none"', "corection is not a plan key; allowed: "),
    ('[[comparisons]]\nmetric = "rho"\na = "x"\nb = "y"\ndirecton = "less"', "direction"),
    ("[documents]\nsplit = { exploratory_fraction = 2.0 }", "exploratory_fraction must be"),
    ("comparisons = 5", "comparisons must be an array of tables"),
    ("alpha = 1.5", r"alpha must be in \(0, 1\), got 1.5"),
    ('alpha = "0.05"', "alpha must be a number"),
    ("n_boot = 10", r"n_boot must be an integer in \[100,"),
    ("n_boot = true", "n_boot must be an integer"),
    ('ci_method = "normal"', "ci_method must be one of 'percentile', 'bca', 'expanded-bca'"),
    ('estimator = "naive"', "estimator must be one of 'indicator', 'tv'"),
    ('window = "all"', "window must be one of 'stored'"),
    ("pool_models = 1", "pool_models must be true or false"),
    ('[[comparisons]]\nmetric = "rho"\na = "mild"\nb = "mild"', "same policy as a"),
    ('[[comparisons]]\nmetric = "rho"\npolicy = "mild"\na = "harsh"', "either policy or a and b"),
    ('[[comparisons]]\nmetric = "rho"\na = "mild"', "a/b are required"),
    ('[[comparisons]]\nmetric = "rho"\npolicy = "mild"\nvalue = "x"', "value must be a number"),
]


@pytest.mark.parametrize(("extra", "match"), BAD)
def test_strict_plan_errors_name_the_key(tmp_path, extra, match):
    base = 'name = "p"\n[[comparisons]]\nmetric = "rho"\na = "mild"\nb = "harsh"\n'
    if extra.startswith("[[comparisons]]") or extra.startswith("comparisons"):
        text = 'name = "p"\n' + extra + "\n"
    elif extra.startswith("["):
        text = base.replace('name = "p"\n', 'name = "p"\n' + extra + "\n")
    else:
        text = extra + "\n" + base
    if "directon" in extra:
        match = "directon is not a plan key; allowed: a, b, direction"
    with pytest.raises(PlanError, match=match):
        load_plan(_plan(tmp_path, text))


def test_hash_covers_every_sealed_setting_and_defaults(tmp_path):
    base = load_plan(_plan(tmp_path))
    # Spelling out a default does not change the plan; sha256sum of the file is not the hash.
    explicit = PLAN.replace("n_boot = 400", 'n_boot = 400\nseed = 0\nci_method = "studentized"')
    assert load_plan(_plan(tmp_path, explicit, "e.toml")).hash == base.hash
    assert base.hash != hashlib.sha256(PLAN.encode()).hexdigest()
    changes = {
        "window": "window = 3",
        "estimator": 'estimator = "tv"',
        "n_boot": "n_boot = 500",
        "seed": "seed = 7",
        "ci_level": "ci_level = 0.9",
        "ci_method": 'ci_method = "percentile"',
        "early_late_split": "early_late_split = 2",
        "reference": 'reference = "mild"',
        "pool_models": "pool_models = true",
        "alpha": "alpha = 0.01",
        "correction": 'correction = "bonferroni"',
    }
    hashes = {base.hash}
    for key, line in changes.items():
        text = PLAN.replace("n_boot = 400", "") if key == "n_boot" else PLAN
        plan = load_plan(_plan(tmp_path, line + "\n" + text, f"{key}.toml"))
        assert plan.settings()[key] != base.settings()[key], key
        hashes.add(plan.hash)
    docs = PLAN.replace('"doc0002"]', '"doc0002", "doc0003"]').replace(
        '"doc0003", "doc0004"', '"doc0004"'
    )
    hashes.add(load_plan(_plan(tmp_path, docs, "docs.toml")).hash)
    assert len(hashes) == len(changes) + 2


def test_contradicting_options_are_refused(store, tmp_path):
    plan = _plan(tmp_path)
    for kw in (
        {"window": 3},
        {"estimator": "tv"},
        {"seed": 7},
        {"n_boot": 100},
        {"ci_method": "percentile"},
        {"ci": 0.9},
        {"early_late_split": 2},
        {"reference": "mild"},
    ):
        with pytest.raises(PlanError, match="contradicts the plan's"):
            analyze(store, plan=plan, doc_set="exploratory", **kw)
    # Repeating the plan's own value is fine.
    same = analyze(store, plan=plan, doc_set="exploratory", n_boot=400, estimator="indicator")
    assert same.settings["n_boot"] == 400
    args = ["analyze", str(store), "--out", str(tmp_path / "o"), "--no-figures", "--plan"]
    assert main([*args, str(plan), "--docs", "exploratory", "--window", "3", "--seed", "7"]) == 2


# ---- within-policy tests against the exact solver ----


def test_within_policy_test_against_exact_truth(store, tmp_path):
    docs = list(range(len(STARTS)))
    truth = _truth_mismatch_fraction("harsh", docs)
    # late - early branch TV of "harsh", pooled as the analysis defines it (O-weighted).
    num = {"early": 0.0, "late": 0.0}
    den = {"early": 0.0, "late": 0.0}
    for d in docs:
        e = _exact("harsh", STARTS[d])
        w = np.asarray(e.branch_lag_weight)  # lags 1..L
        tv = np.nan_to_num(np.asarray(e.branch_tv_by_lag)) * w
        L = len(w)
        for part, lags in (("early", range(1, L // 2 + 1)), ("late", range(L // 2 + 1, L + 1))):
            num[part] += sum(tv[lag - 1] for lag in lags)
            den[part] += sum(w[lag - 1] for lag in lags)
    late_minus_early = num["late"] / den["late"] - num["early"] / den["early"]
    # n_boot 2000: the smallest p-value a bootstrap resolves is about 1/(n_boot + 1).
    text = (
        PLAN.split("[[comparisons]]")[0].replace("n_boot = 400", "n_boot = 2000")
        + f"""
[[comparisons]]
name = "below truth"
metric = "mismatch_fraction"
policy = "harsh"
value = {truth - 0.04}
direction = "greater"

[[comparisons]]
name = "above truth"
metric = "mismatch_fraction"
policy = "harsh"
value = {truth + 0.04}
direction = "greater"

[[comparisons]]
name = "late minus early"
metric = "late_minus_early_tv"
policy = "harsh"
direction = "two-sided"

[[comparisons]]
metric = "mismatch_fraction"
a = "mild"
b = "harsh"
direction = "greater"
"""
    )
    result = analyze(store, plan=_plan(tmp_path, text))
    rows = {r["comparison"]: r for r in result.tests}
    assert len(rows) == 4 and all(r["correction"] == "holm" for r in rows.values())
    below, above = rows["below truth"], rows["above truth"]
    assert below["policy"] == "harsh" and below["policy_a"] == "" and below["value"] < truth
    assert below["ci_low"] <= truth <= below["ci_high"]
    assert below["reject_h0"] and not above["reject_h0"], (below, above)
    # Holm over all four: the adjusted p-values are the step-down of the raw ones.
    raw = [r["p_value"] for r in result.tests]
    order = np.argsort(raw)
    assert rows["below truth"]["p_adjusted"] >= rows["below truth"]["p_value"]
    assert max(r["p_adjusted"] for r in result.tests) <= 1
    assert result.tests[order[0]]["p_adjusted"] == pytest.approx(min(1, 4 * raw[order[0]]))
    lme = rows["late minus early"]
    assert lme["ci_low"] - 0.02 <= late_minus_early <= lme["ci_high"] + 0.02
    # The within-policy estimate is the summary's value of the metric.
    summary = {(r["policy"], r["quantity"]): r for r in result.models[0].tables["summary"]}
    assert below["estimate"] == summary[("harsh", "mismatch_fraction")]["estimate"]


def _median_tests(store, tmp_path, who: str, cases: tuple[tuple[str, float, str], ...]):
    """A plan of median_tau comparisons (``who``: the policy or pair lines; ``cases``: name,
    value, direction) analysed: its rows by name and the bootstrap at the plan's level."""
    text = PLAN.split("[[comparisons]]")[0] + "".join(
        f"""
[[comparisons]]
name = "{name}"
metric = "median_tau"
{who}
value = {value}
direction = "{direction}"
"""
        for name, value, direction in cases
    )
    result = analyze(store, plan=_plan(tmp_path, text))
    model = result.models[0]
    assert model.bootstrap is not None
    return {r["comparison"]: r for r in result.tests}, model.bootstrap.at_level(0.95), model


def test_paired_median_difference_takes_the_test_inversion_set_and_its_p_value(store, tmp_path):
    # A plan's paired median_tau: the set of analysis/median_shift.py at 1 - alpha, and the
    # p-value of the same test at the value, so that it rejects where the set excludes it.
    cases = (("zero", 0.0, "two-sided"), ("far", -3.0, "greater"))
    rows, bs, _ = _median_tests(store, tmp_path, 'a = "mild"\nb = "harsh"', cases)
    pmf = [[f"{p}|pmf|{t}" for t in range(1, T + 1)] for p in ("mild", "harsh")]
    want = bs.median_difference(*pmf)
    assert want is not None and not want.constant
    for name, value, direction in cases:
        row = rows[name]
        assert (row["estimate"], row["ci_low"], row["ci_high"]) == (
            want.estimate, want.ci_low, want.ci_high,
        )  # fmt: skip
        assert row["p_value"] == bs.median_difference_p_value(*pmf, direction, value)
        assert -T <= row["ci_low"] <= row["estimate"] <= row["ci_high"] <= T
    # Two-sided at 0: rejected exactly where the set excludes 0 (away from its ends).
    zero = rows["zero"]
    assert (zero["p_value"] < 0.05) == (not zero["ci_low"] <= 0.0 <= zero["ci_high"])
    # Far below the set, "greater" is rejected.
    assert rows["far"]["ci_low"] > -3.0 and rows["far"]["p_value"] < 0.05


def test_a_policys_median_step_takes_the_test_inversion_set_and_its_p_value(store, tmp_path):
    # A plan's median_tau of one policy: the summary's test-inversion set (not a percentile
    # interval) and the p-value of the same test at the value.
    cases = (("at two", 2.0, "two-sided"), ("far", 0.75, "greater"))
    rows, bs, model = _median_tests(store, tmp_path, 'policy = "harsh"', cases)
    pmf = [f"harsh|pmf|{t}" for t in range(1, T + 1)]
    want = bs.median_step(pmf)
    assert want is not None and not want.constant and want.method == "studentized"
    summary = {(r["policy"], r["quantity"]): r for r in model.tables["summary"]}
    assert summary[("harsh", "median_tau")]["ci_low"] == want.ci_low
    for name, value, direction in cases:
        row = rows[name]
        assert row["ci_method"] == "studentized"
        assert (row["estimate"], row["ci_low"], row["ci_high"]) == (
            want.estimate, want.ci_low, want.ci_high,
        )  # fmt: skip
        assert row["p_value"] == bs.median_step_p_value(pmf, direction, value)
    two = rows["at two"]
    assert (two["p_value"] < 0.05) == (not two["ci_low"] <= 2.0 <= two["ci_high"])
    assert rows["far"]["ci_low"] > 0.75 and rows["far"]["p_value"] < 0.05


# ---- registry and preregistration ----


def test_registered_before_tracing_is_preregistered_everywhere(tmp_path):
    plan = _plan(tmp_path)
    store = tmp_path / "new.zarr"
    assert main(["plan", "register", str(plan), "--store", str(store)]) == 0
    write_synthetic_trace_store(store, PAIRS, horizon=T, replicates=60, docs=STARTS, seed=4)
    assert not (tmp_path / "new.zarr.kvcouple_plan_registry.json").exists()
    result = analyze(store, plan=plan, doc_set="confirmatory")
    assert result.preregistration.startswith("preregistered: plan")
    assert [d.doc_id for d in result.models[0].docs] == CONF
    out = write_report(result, tmp_path / "out", figures=False, html_report=False)
    for name in ("summary.csv", "tests.csv", "gap_attribution.csv", "report.md"):
        assert "preregistered: plan" in (out / name).read_text(), name
    assert json.loads((out / "results.json").read_text())["meta"]["preregistration"].startswith(
        "preregistered"
    )
    # An exploratory look at the same store is not preregistered, and says so.
    explo = analyze(store, plan=plan, doc_set="exploratory")
    assert explo.preregistration.startswith("not preregistered: exploratory")
    # Analysing the store without its plan is stamped.
    assert "without the store's registered plan" in analyze(store, n_boot=100).preregistration


@pytest.mark.parametrize("damage", ["deleted", "replaced", "edited"])
def test_damaged_registry_is_refused_or_stamped(tmp_path, damage):
    plan = _plan(tmp_path)
    store = tmp_path / "s.zarr"
    register_plan(load_plan(plan), store)
    write_synthetic_trace_store(store, PAIRS, horizon=T, replicates=40, docs=STARTS, seed=4)
    reg = store / "kvcouple_plan_registry.json"
    if damage == "deleted":
        reg.unlink()
    elif damage == "replaced":
        other = tmp_path / "o.zarr"
        register_plan(load_plan(plan), other)
        write_synthetic_trace_store(other, PAIRS, horizon=T, replicates=10, docs=STARTS, seed=4)
        shutil.copy(other / "kvcouple_plan_registry.json", reg)
    else:
        content = json.loads(reg.read_text())
        content["registrations"][0]["registered"] = "1999-01-01T00:00:00+00:00"
        reg.write_text(json.dumps(content))
    with pytest.raises(PlanError, match=damage if damage != "edited" else "edited by hand"):
        analyze(store, plan=plan, doc_set="confirmatory")
    stamped = analyze(store, plan=plan, doc_set="confirmatory", allow_unregistered=True)
    assert stamped.preregistration.startswith("not preregistered")
    assert all(r["reject_h0"] in (True, False) for r in stamped.tests)
    # A replaced or deleted registry cannot be re-registered into.
    if damage != "edited":
        with pytest.raises(Exception, match=damage):
            register_plan(load_plan(plan), store)


def test_unregistered_confirmatory_is_refused(store, tmp_path):
    with pytest.raises(PlanError, match="is not registered"):
        analyze(store, plan=_plan(tmp_path), doc_set="confirmatory")


def test_plan_command_hash_and_show(tmp_path, capsys, store):
    plan = _plan(tmp_path)
    assert main(["plan", "hash", str(plan)]) == 0
    assert capsys.readouterr().out.strip() == load_plan(plan).hash
    assert main(["plan", "show", str(plan), "--store", str(store)]) == 0
    out = capsys.readouterr().out
    shown = json.loads(out[: out.rindex("}") + 1])
    assert shown["hash"] == load_plan(plan).hash
    assert shown["plan"]["ci_method"] == "studentized" and shown["plan"]["window"] == "stored"
    assert "not registered" in out
    bad = _plan(tmp_path, PLAN + "\ncorection = 1\n", "bad.toml")
    assert main(["plan", "hash", str(bad)]) == 2
    assert "corection" in capsys.readouterr().err


def test_parse_plan_refuses_a_non_table():
    with pytest.raises(PlanError, match="a plan is a TOML table"):
        parse_plan([1, 2])  # type: ignore[arg-type]


@pytest.mark.parametrize("method", ["percentile", "bca", "expanded-bca", "studentized"])
def test_p_values_agree_with_the_intervals(method):
    """A one-sided test at alpha rejects exactly when the (1 - 2 alpha) interval's lower end
    lies above the tested value, for every interval method (p-values invert the intervals)."""
    from kvcouple.analysis.bootstrap import bootstrap_table
    from kvcouple.analysis.estimates import Table

    rng = np.random.default_rng(5)
    table = Table([f"d{i}" for i in range(16)], {"x|v": rng.lognormal(0, 0.8, 16)})
    bs = bootstrap_table(table, 4000, 3, 0.90, method)
    est = bs.evaluate(lambda g: g("x|v"))
    values = np.linspace(est.ci_low - 0.3, est.ci_high + 0.3, 41)
    agree = [
        (bs.p_value(est, "greater", v) < 0.05) == (est.ci_low > v)
        and (bs.p_value(est, "less", v) < 0.05) == (est.ci_high < v)
        for v in values
    ]
    assert sum(agree) >= len(values) - 2  # up to the replicates' granularity at the ends
    assert bs.p_value(est, "greater", est.ci_low - 1.0) < 0.01


def test_the_docs_example_plan_is_valid(tmp_path):
    """docs/statistics.md's confirmatory plan parses and says what the paper claims."""
    from pathlib import Path

    text = (Path(__file__).parents[2] / "docs" / "statistics.md").read_text()
    toml = text.split("```toml\n", 1)[1].split("```", 1)[0]
    plan = load_plan(_plan(tmp_path, toml, "paper_plan.toml"))
    within = [c for c in plan.comparisons if c.policy is not None]
    assert [(c.metric, c.policy, c.direction) for c in within] == [
        ("late_minus_early_tv", "snapkv:retain=0.5", "greater")
    ]
    assert len(plan.comparisons) == 3 and plan.reference == "recent:retain=0.5"
    assert plan.settings()["ci_method"] == "studentized" and plan.pool_models is True
