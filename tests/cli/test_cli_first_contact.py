"""First contact (issue 19): plug-in policies from the command line (``--plugin`` and the
``kvcouple.policies`` entry point group), resume mismatches in words, Hub ids that cannot be
reached failing at once, and the demo refusing bad settings before it makes a folder."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvcouple.cli import main
from kvcouple.errors import InvalidInputError, StoreError
from kvcouple.policies import POLICIES, parse_policy
from kvcouple.policies.plugins import (
    ENTRY_POINT_GROUP,
    PluginError,
    import_plugin,
    load_entry_points,
)
from kvcouple.store.resume import check_resume, resume_mismatch

PLUGIN = '''
from kvcouple.policies import ScorePolicy, register_policy


@register_policy
class {cls}(ScorePolicy):
    """Keeps the keys with the largest norm."""

    name = "{name}"
    PARAMS = {{"power": (float, 1.0)}}

    def score(self, ctx, layer):
        return ctx.keys[layer].float().norm(dim=-1) ** self.params["power"]
'''


@pytest.fixture
def registry():
    """Restore the policy registry after a test that registers plug-ins."""
    saved = dict(POLICIES)
    yield POLICIES
    POLICIES.clear()
    POLICIES.update(saved)


def _prompts(tmp_path: Path, n: int = 1) -> Path:
    from kvcouple.models import default_prompts_path

    lines = default_prompts_path().read_text().splitlines()[:n]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def _trace_argv(tmp_path: Path, out: Path, *extra: str) -> list[str]:
    return [
        "trace", "--prompts", str(_prompts(tmp_path)), "--out", str(out), "--horizon", "3",
        "--replicates", "2", "--window", "3", "--device", "cpu", "--quiet", *extra,
    ]  # fmt: skip


# --- --plugin ----------------------------------------------------------------------------


def test_plugin_file_and_module_register_their_policies(tmp_path, registry, monkeypatch):
    file = tmp_path / "fc_norm_policy.py"
    file.write_text(PLUGIN.format(cls="FcNorm", name="fcnorm"))
    assert "fcnorm" not in registry
    import_plugin(str(file))
    assert parse_policy("fcnorm:retain=0.5,power=2").spec() == "fcnorm:retain=0.5,power=2.0"
    (tmp_path / "fc_mod_policy.py").write_text(PLUGIN.format(cls="FcMod", name="fcmod"))
    monkeypatch.syspath_prepend(str(tmp_path))
    import_plugin("fc_mod_policy")
    assert "fcmod" in registry


def test_plugin_errors_name_the_plugin(tmp_path):
    with pytest.raises(PluginError, match="--plugin no_such_fc_module: no module named"):
        import_plugin("no_such_fc_module")
    with pytest.raises(PluginError, match="no such .py file"):
        import_plugin(str(tmp_path / "missing.py"))
    broken = tmp_path / "fc_broken.py"
    broken.write_text("import fc_dependency_that_is_missing\n")
    with pytest.raises(PluginError, match="importing it failed.*fc_dependency_that_is_missing"):
        import_plugin(str(broken))
    raises = tmp_path / "fc_raises.py"
    raises.write_text("raise RuntimeError('plugin says no')\n")
    with pytest.raises(PluginError, match="RuntimeError: plugin says no"):
        import_plugin(str(raises))
    assert isinstance(PluginError("x"), ValueError)  # bad input: exit status 2 on the CLI


@pytest.mark.torch
def test_trace_loads_a_plugin_given_on_the_command_line(tmp_path, registry, capsys):
    pytest.importorskip("transformers")
    file = tmp_path / "fc_cli_policy.py"
    file.write_text(PLUGIN.format(cls="FcCli", name="fccli"))
    out = tmp_path / "run.zarr"
    argv = _trace_argv(tmp_path, out, "--policy", "fccli:retain=0.5")
    assert main(argv) == 2  # not registered without the plug-in
    assert "unknown policy 'fccli'" in capsys.readouterr().err
    assert main([*argv, "--plugin", str(file)]) == 0, capsys.readouterr().err
    import xarray as xr

    assert list(xr.open_zarr(out).policy.values) == ["fccli:retain=0.5,power=1.0"]


def _dist(
    tmp_path: Path, entry_points: str, module: str = "", name: str = "fc_ep_policies"
) -> Path:
    """A minimal installed distribution on a path of its own: dist-info with entry_points.txt."""
    root = tmp_path / "site"
    info = root / "fc_plugin_pkg-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fc-plugin-pkg\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(textwrap.dedent(entry_points))
    if module:
        (root / f"{name}.py").write_text(module)
    importlib.invalidate_caches()
    return root


def test_entry_points_register_modules_and_classes(tmp_path, registry, monkeypatch):
    module = (
        PLUGIN.format(cls="FcEp", name="fcep")
        + "\n\n"
        + PLUGIN.format(cls="FcEpClass", name="fcepclass").replace("@register_policy\n", "")
    )
    root = _dist(
        tmp_path,
        f"""
        [{ENTRY_POINT_GROUP}]
        fcep = fc_ep_policies
        fcepclass = fc_ep_policies:FcEpClass
        """,
        module,
    )
    monkeypatch.syspath_prepend(str(root))
    loaded = load_entry_points()
    assert "fcep = fc_ep_policies" in loaded and "fcepclass = fc_ep_policies:FcEpClass" in loaded
    assert {"fcep", "fcepclass"} <= set(registry)  # the class was registered by the loader
    assert parse_policy("fcepclass:budget=4").spec().startswith("fcepclass:budget=4")


def test_a_broken_entry_point_names_its_package(tmp_path, registry, monkeypatch):
    root = _dist(tmp_path, f"[{ENTRY_POINT_GROUP}]\nbad = fc_ep_missing_module\n")
    monkeypatch.syspath_prepend(str(root))
    with pytest.raises(
        PluginError, match=r"entry point bad = fc_ep_missing_module .*fc-plugin-pkg"
    ):
        load_entry_points()


@pytest.mark.torch
def test_trace_sees_installed_entry_points(tmp_path, registry, monkeypatch, capsys):
    pytest.importorskip("transformers")
    root = _dist(
        tmp_path,
        f"[{ENTRY_POINT_GROUP}]\nfcep = fc_ep_cli_policies\n",
        PLUGIN.format(cls="FcEpCli", name="fcepcli"),
        name="fc_ep_cli_policies",
    )
    monkeypatch.syspath_prepend(str(root))
    out = tmp_path / "ep.zarr"
    code = main(_trace_argv(tmp_path, out, "--policy", "fcepcli:retain=0.5"))
    assert code == 0, capsys.readouterr().err


# --- resume mismatches ------------------------------------------------------------------


def test_resume_mismatch_names_the_setting_in_words():
    old = [{"spec": "snapkv:retain=0.5,window=32,kernel=7,pool=avg", "name": "snapkv"}]
    new = [{"spec": "recent:retain=0.5", "name": "recent"}]
    with pytest.raises(StoreError) as e:
        check_resume("s.zarr", {"policies": old}, {"policies": new})
    text = str(e.value)
    assert "the setting policies (--policy) differs" in text
    assert "the store has snapkv:retain=0.5,window=32,kernel=7,pool=avg" in text
    assert "this run has recent:retain=0.5" in text
    assert "dropped: snapkv:retain=0.5" in text and "added: recent:retain=0.5" in text
    assert "{" not in text and "'" not in text  # no Python reprs
    decoding = resume_mismatch(
        "decoding",
        {"temperature": 1.0, "top_k": None, "top_p": None},
        {"temperature": 0.7, "top_k": None, "top_p": None},
    )
    assert decoding.startswith("the setting decoding (--temperature/--top-k/--top-p) differs")
    assert "the store has temperature=1.0; this run has temperature=0.7" in decoding
    assert "top_k" not in decoding  # only what differs
    assert "the store has 32; this run has 64" in resume_mismatch("horizon", 32, 64)
    ids = resume_mismatch("doc_ids", [f"d{i}" for i in range(20)], ["d0"])
    assert "(19 more)" not in ids and "more)" in ids and len(ids) < 300


@pytest.mark.torch
def test_resuming_with_other_policies_prints_them_as_text(tmp_path, capsys):
    pytest.importorskip("transformers")
    out = tmp_path / "r.zarr"
    assert main(_trace_argv(tmp_path, out, "--policy", "recent:retain=0.5")) == 0
    capsys.readouterr()
    assert main(_trace_argv(tmp_path, out, "--policy", "snapkv:retain=0.5")) == 2
    err = capsys.readouterr().err
    assert "the setting policies (--policy) differs" in err, err
    assert "the store has recent:retain=0.5; this run has snapkv:retain=0.5" in err, err
    assert "{" not in err


# --- Hub ids that cannot be reached ------------------------------------------------------


def _trace_cli(tmp_path: Path, env: dict[str, str]) -> tuple[subprocess.CompletedProcess, float]:
    argv = ["--model", "kvcouple-test/never-cached", "--policy", "recent:retain=0.5"]
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "kvcouple.cli", "trace", "--prompts", str(_prompts(tmp_path)),
         "--out", str(tmp_path / "hub.zarr"), *argv],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    return done, time.monotonic() - start


def test_an_unreachable_hub_fails_at_once(tmp_path):
    pytest.importorskip("huggingface_hub")
    env = {k: v for k, v in os.environ.items() if "PROXY" not in k.upper()}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_ENDPOINT="http://127.0.0.1:9")  # nothing listens
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        env.pop(name, None)
    done, seconds = _trace_cli(tmp_path, env)
    assert done.returncode == 2, done.stderr
    assert (
        "not in the local Hugging Face cache and the Hub (http://127.0.0.1) cannot be reached"
        in (done.stderr)
    )
    assert "HF_HUB_OFFLINE=1" in done.stderr
    assert seconds < 20  # the Hub client's retries alone take ~25 s
    env["HF_HUB_OFFLINE"] = "1"
    done, seconds = _trace_cli(tmp_path, env)
    assert done.returncode == 2 and "offline mode is on (HF_HUB_OFFLINE=1)" in done.stderr
    assert seconds < 20
    assert not (tmp_path / "hub.zarr").exists()


def test_a_cached_hub_model_passes_the_check(tmp_path, monkeypatch):
    hub = pytest.importorskip("huggingface_hub")
    from kvcouple.models import check_hub_model

    cache = tmp_path / "hub"
    snapshot = cache / "models--kvcouple-test--cached" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (cache / "models--kvcouple-test--cached" / "refs").mkdir()
    (cache / "models--kvcouple-test--cached" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    real = hub.try_to_load_from_cache

    def cached(repo_id, filename, **kw):
        return real(repo_id, filename, cache_dir=str(cache), **kw)

    monkeypatch.setattr(hub, "try_to_load_from_cache", cached)
    check_hub_model("kvcouple-test/cached")  # no error: offline but cached
    with pytest.raises(InvalidInputError, match="offline mode is on"):
        check_hub_model("kvcouple-test/other")


# --- the demo's settings -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--horizon", "0"], "argument --horizon: 0 is not an integer >= 1"),
        (["--replicates", "0"], "argument --replicates: 0 is not an integer >= 1"),
        (["--window", "-1"], "argument --window: -1 is not an integer >= 0"),
        (["--docs", "0"], "argument --docs: 0 is not an integer >= 1"),
        (["--policy", "nosuch:retain=0.5"], "unknown policy 'nosuch'"),
        (["--plugin", "no_such_fc_plugin"], "--plugin no_such_fc_plugin: no module named"),
    ],
)
@pytest.mark.torch
def test_demo_refuses_bad_settings_before_making_a_folder(tmp_path, capsys, argv, message):
    pytest.importorskip("transformers")
    out = tmp_path / "demo"
    try:
        code = main(["demo", "--out", str(out), "--quiet", *argv])
    except SystemExit as e:  # argparse's usage error (kvcouple.cliargs), after its usage line
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith("kvcouple demo: error: ") and message in err, err
    assert not out.exists()


@pytest.mark.torch
def test_demo_traces_a_plugin_policy_and_says_when_nothing_is_left(tmp_path):
    pytest.importorskip("transformers")
    file = tmp_path / "fc_demo_policy.py"
    file.write_text(PLUGIN.format(cls="FcDemo", name="fcdemo"))
    out = tmp_path / "demo"
    argv = [sys.executable, "-m", "kvcouple.cli", "demo", "--out", str(out), "--docs", "1"]
    argv += ["--horizon", "3", "--replicates", "2", "--branches", "1", "--jobs", "1", "--quiet"]
    argv += ["--plugin", str(file), "--policy", "fcdemo:retain=0.5"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    first = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr
    assert "== traced 1 document in" in first.stdout
    assert "  fcdemo:retain=0.5 = fcdemo:retain=0.5,power=1.0" in first.stdout
    (run,) = out.glob("run-*")  # DIR/run-<hash>/: --out is the parent folder
    assert (run / "run.zarr").is_dir() and (run / "report" / "report.html").is_file()
    again = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr
    assert "1 of 1 documents already traced" in again.stdout
    assert "nothing left to trace" in again.stdout and "== traced" not in again.stdout
