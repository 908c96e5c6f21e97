"""The tracer's core: one schema, one place for resume checks, --branch-batch from the CLI."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import xarray as xr  # noqa: E402

from kvcouple.cli import main as cli_main  # noqa: E402
from kvcouple.errors import StoreError  # noqa: E402
from kvcouple.store import Record, variables  # noqa: E402
from kvcouple.store.schema import empty_arrays  # noqa: E402
from kvcouple.tracer import Prompt, TraceSettings, trace  # noqa: E402

pytestmark = pytest.mark.torch

from tracer_helpers import (  # noqa: E402
    VOCAB,
    model,
    one_thread,  # noqa: F401 - autouse fixture
)


def _prompts(count: int, length: int = 14) -> list[Prompt]:
    rng = np.random.default_rng(21)
    return [
        Prompt(f"d{i}", tuple(int(t) for t in rng.integers(1, VOCAB - 1, length + i)))
        for i in range(count)
    ]


def test_schema_is_the_one_source_of_arrays():
    """Empty arrays come from the schema's fill values; the synthetic writer and the tracer
    write exactly the schema's variables with its dtypes."""
    record = Record("topk", 3)
    sizes = {"doc": 2, "policy": 2, "rep": 2, "step": 4, "branch": 1, "lag": 3, "k": 3}
    table = variables(record)
    per_doc = empty_arrays(record, sizes)
    assert set(per_doc) == set(table) - {"completed"}
    for name, value in per_doc.items():
        var = table[name]
        assert value.dtype == np.dtype(var.dtype), name
        assert value.shape == tuple(sizes[d] for d in var.dims[1:]), name
        fill = np.asarray(var.fill, dtype=var.dtype)
        assert np.array_equal(value, np.broadcast_to(fill, value.shape), equal_nan=True), name
    branch = empty_arrays(record, sizes, ("doc", "policy"), having="branch")
    assert set(branch) == {n for n, v in table.items() if "branch" in v.dims}
    assert branch["branch_mismatch"].shape == (2, 1, 3) and (branch["branch_mismatch"] == -1).all()


def test_traced_store_holds_the_schema_variables(tmp_path):
    settings = TraceSettings(horizon=3, replicates=2, branches=1, window=1, record=Record("full"))
    out = tmp_path / "s.zarr"
    trace(model("llama"), _prompts(1), ["full", "recent:retain=0.5"], settings, out, progress=False)
    ds = xr.open_zarr(out)
    table = variables(Record("full"))
    for name, var in table.items():
        assert ds[name].dims == var.dims, name
        assert ds[name].dtype == np.dtype(var.dtype), name
    assert ds["gate_class"].values.tolist() == [[-1, -1]]
    assert np.isnan(ds["gate_score"].values).all()
    assert ds["eviction_applied"].values.tolist() == [[False, True]]


def test_resume_checks_include_the_attention_implementation(tmp_path):
    """A store traced with sdpa refuses to be resumed with eager, with a StoreError naming
    both implementations; sdpa resumes."""
    prompts = _prompts(2)
    settings = TraceSettings(horizon=3, replicates=2, branches=1, window=1)
    out = tmp_path / "a.zarr"
    kw = {"model_id": "tiny", "progress": False, "seed": 2}
    first = trace(model("llama"), prompts, ["recent:retain=0.5"], settings, out, max_docs=1, **kw)
    assert first.traced == [0]
    assert xr.open_zarr(out).attrs["attn_implementation"] == "sdpa"
    with pytest.raises(StoreError, match="attention implementation 'sdpa'.*'eager'"):
        trace(model("llama", "eager"), prompts, ["recent:retain=0.5"], settings, out, **kw)
    again = trace(model("llama"), prompts, ["recent:retain=0.5"], settings, out, **kw)
    assert again.traced == [1]


def _cli_args(tmp_path, model_dir, prompts, out, *extra):
    return [
        "trace",
        "--model",
        str(model_dir),
        "--prompts",
        str(prompts),
        "--out",
        str(out),
        "--quiet",
        "--device",
        "cpu",
        "--policy",
        "snapkv:retain=0.5,window=4",
        "--policy",
        "h2o:retain=0.5,mode=decode",
        "--horizon",
        "5",
        "--replicates",
        "3",
        "--branches",
        "2",
        "--window",
        "3",
        "--record",
        "topk:4",
        *extra,
    ]


def test_branch_batch_reaches_the_tracer_and_changes_only_float_noise(tmp_path, capsys):
    model_dir = tmp_path / "tiny"
    model("llama").save_pretrained(model_dir)
    prompts = tmp_path / "docs.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"id": p.id, "input_ids": list(p.input_ids)}) + "\n" for p in _prompts(2)
        )
    )
    stores, batches = {}, {}
    for name, extra in (("default", []), ("one", ["--branch-batch", "1"])):
        out = tmp_path / f"{name}.zarr"
        assert cli_main(_cli_args(tmp_path, model_dir, prompts, out, *extra)) == 0
        text = capsys.readouterr().out
        batches[name] = int(text.split("branch batches: ")[1].split()[0])
        stores[name] = xr.open_zarr(out).load()
    # 2 documents x 2 policies, one batch each by default; one branch per batch with 1.
    branches = int((stores["one"]["branch_step"].values > 0).sum())
    assert batches["default"] == 4 and batches["one"] == branches > 4
    a, b = stores["default"], stores["one"]
    for name in a.data_vars:
        if a[name].dtype.kind == "f":
            np.testing.assert_allclose(a[name].values, b[name].values, atol=1e-5, err_msg=name)
        else:
            np.testing.assert_array_equal(a[name].values, b[name].values, err_msg=name)
    with pytest.raises(SystemExit) as exit:  # argparse's usage error (kvcouple.cliargs)
        cli_main(
            _cli_args(tmp_path, model_dir, prompts, tmp_path / "x.zarr", "--branch-batch", "-5")
        )
    assert exit.value.code == 2
    assert "argument --branch-batch: -5 is not an integer >= 1 (or 'auto')" in (
        capsys.readouterr().err
    )


def test_issue_command_on_the_embedded_model_and_analyze_reads_it(tmp_path, capsys):
    """The command of the tracer-core issue (decode-time streaming and SnapKV, PAGE over
    SnapKV, one branch per batch) on the embedded model and two of its shipped prompts; then
    ``kvcouple analyze`` reads the store and reports every policy."""
    from kvcouple.models import default_prompts_path

    lines = default_prompts_path().read_text().splitlines()[:2]
    prompts = tmp_path / "two.jsonl"
    prompts.write_text("\n".join(lines) + "\n")
    out = tmp_path / "issue.zarr"
    policies = [
        "streaming:budget=12,mode=decode",
        "snapkv:retain=0.5,mode=decode",
        "page:base=snapkv,retain=0.5",
    ]
    args = ["trace", "--prompts", str(prompts), "--out", str(out), "--quiet", "--device", "cpu"]
    for spec in policies:
        args += ["--policy", spec]
    args += ["--branch-batch", "1", "--horizon", "4", "--replicates", "2", "--branches", "2"]
    args += ["--window", "2"]
    assert cli_main(args) == 0
    assert "2 traced" in capsys.readouterr().out
    ds = xr.open_zarr(out)
    assert bool(ds["completed"].all())
    gate = ds["gate_class"].values
    assert (gate[:, :2] == -1).all() and set(gate[:, 2].tolist()) <= {0, 1}
    assert np.isfinite(ds["gate_score"].values[:, 2]).all()
    report = tmp_path / "report"
    assert cli_main(["analyze", str(out), "--out", str(report), "--n-boot", "20", "--quiet"]) == 0
    summary = (report / "summary.csv").read_text()
    for name in ("streaming", "snapkv", "page"):
        assert name in summary
