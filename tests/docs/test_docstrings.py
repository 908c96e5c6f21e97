"""Public docstrings: numpy sections where the API reference promises them, and no reference
to a kvcouple module or function that does not exist (help() must not send users nowhere)."""

from __future__ import annotations

import importlib
import inspect
import re

import pytest

import kvcouple
from kvcouple import analysis, policies, store, synth

NUMPY_STYLE = [
    kvcouple.divergences,
    kvcouple.couple,
    kvcouple.plain_pass,
    kvcouple.set_num_threads,
    kvcouple.get_num_threads,
    kvcouple.total_variation,
    analysis.write_report,
    analysis.analyze,
    analysis.load_plan,
    synth.estimate,
    synth.exact,
    synth.interval,
    synth.interval_constructions,
    synth.load_pair,
    synth.pair_from_mapping,
    synth.random_pair,
    synth.save_pair,
    synth.simulate,
    store.check_resume,
    store.open_trace_store,
    store.text.open_text,
    store.variables,
    policies.kept_count,
    policies.parse_policy,
    policies.register_policy,
    policies.top_indices,
]
try:  # the tracer needs torch (an optional extra)
    from kvcouple.tracer import batches as _batches
    from kvcouple.tracer import engine as _engine
    from kvcouple.tracer import prompts as _prompts
except ImportError:
    pass
else:
    NUMPY_STYLE += [_prompts.load_prompts, _batches.trace_document, _engine.trace_policy]
PUBLIC = ["kvcouple", "kvcouple.analysis", "kvcouple.synth", "kvcouple.store", "kvcouple.policies"]


@pytest.mark.parametrize("fn", NUMPY_STYLE, ids=lambda f: f.__qualname__)
def test_numpy_sections(fn):
    doc = inspect.getdoc(fn) or ""
    params = [p for p in inspect.signature(fn).parameters if p != "self"]
    if params:
        assert re.search(r"^Parameters\n-{10}", doc, re.M), f"{fn.__qualname__}: no Parameters"
    assert re.search(r"^Returns\n-{7}", doc, re.M), f"{fn.__qualname__}: no Returns"
    for p in params:
        assert re.search(rf"^(\w+, )*{p}(, \w+)*( :|$)", doc, re.M), f"{fn.__qualname__}: {p}"


def _references(doc: str) -> set[str]:
    return set(re.findall(r"\bkvcouple(?:\.[A-Za-z_][A-Za-z0-9_]*)+", doc))


def _resolves(name: str) -> bool:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_no_docstring_points_to_a_missing_name():
    seen: dict[str, str] = {}
    for mod_name in PUBLIC:
        mod = importlib.import_module(mod_name)
        objs = [mod] + [getattr(mod, n) for n in getattr(mod, "__all__", [])]
        for obj in objs:
            for ref in _references(inspect.getdoc(obj) or ""):
                seen.setdefault(ref, getattr(obj, "__qualname__", getattr(obj, "__name__", "")))
    missing = {ref: where for ref, where in seen.items() if not _resolves(ref)}
    assert not missing, f"docstrings name what does not exist: {missing}"
    assert "kvcouple.decoding" not in (kvcouple.divergences.__doc__ or "")
    assert synth  # imported: its docstrings are scanned through PUBLIC


NUMPY_CLASSES = [
    analysis.AnalysisResult,
    analysis.Options,
    analysis.Plan,
    synth.MonteCarloEstimate,
    synth.ExactResult,
    synth.Interval,
    synth.Kernel,
    synth.KernelPair,
    store.Record,
    store.StoreLayout,
    store.TraceStoreWriter,
    policies.Policy,
    policies.ScorePolicy,
    policies.SnapKV,
    policies.Recent,
    policies.Streaming,
    policies.H2O,
    policies.TOVA,
    policies.KNorm,
    policies.ValueDiff,
    policies.Random,
    policies.Full,
    policies.PAGE,
    policies.RescoreRule,
    policies.SlotScoreRule,
    policies.DecodeRule,
    policies.DecodeCache,
    policies.DecodeContext,
    policies.PolicyContext,
    policies.Admission,
]


try:  # the tracer needs torch (an optional extra)
    from kvcouple import tracer as _tracer
except ImportError:
    pass
else:
    NUMPY_CLASSES += [_tracer.Decoding, _tracer.TraceSettings, _tracer.PolicyTrace, _tracer.Prompt]


@pytest.mark.parametrize("cls", NUMPY_CLASSES, ids=lambda c: c.__qualname__)
def test_class_numpy_sections(cls):
    doc = inspect.getdoc(cls) or ""
    assert re.search(r"^(Parameters|Attributes)\n-{10}", doc, re.M), f"{cls.__qualname__}"
