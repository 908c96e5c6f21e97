"""The tracer, continued: resume and shards, bad input, the CLI, decode-time eviction, dtypes.

See test_tracer.py for the first four properties the tracer must hold.

The six properties the tracer must hold: the full policy has no hazard and the model's own
distributions; uniform evictions equal a masked full forward; SnapKV's kept indices equal a
plain recomputation from eager attention weights; first-step marginals follow p and q;
kill-and-resume and sharded runs equal an uninterrupted run; bad input is refused clearly.
"""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import xarray as xr  # noqa: E402

from kvcouple.cli import main as cli_main  # noqa: E402
from kvcouple.errors import StoreError  # noqa: E402
from kvcouple.policies import PolicyError, parse_policy  # noqa: E402
from kvcouple.store import Record, VocabularyMismatchError  # noqa: E402
from kvcouple.testing.tiny_models import tiny_model  # noqa: E402
from kvcouple.torch_coupling import apply_decoding  # noqa: E402
from kvcouple.tracer import (  # noqa: E402
    Decoding,
    Prompt,
    PromptFileError,
    TraceSettings,
    load_prompts,
    trace,
    trace_document,
)
from kvcouple.tracer.prefill import PromptTooShortError  # noqa: E402

pytestmark = pytest.mark.torch

from tracer_helpers import (  # noqa: E402
    PROMPT,
    VOCAB,
    distributions,
    model,
    one_thread,  # noqa: F401 - autouse fixture
)


# 5 ------------------------------------------------------------------------------------------
def _prompts(count: int) -> list[Prompt]:
    rng = np.random.default_rng(9)
    return [
        Prompt(f"doc{i}", tuple(int(t) for t in rng.integers(1, VOCAB, 12 + 3 * i)))
        for i in range(count)
    ]


def test_resume_and_shards_equal_uninterrupted(tmp_path):
    m = model("qwen2")
    prompts = _prompts(3)
    policies = ["snapkv:retain=0.5,window=4", "random:retain=0.5", "h2o:retain=0.4"]
    settings = TraceSettings(
        horizon=4,
        replicates=2,
        branches=2,
        window=2,
        record=Record("topk", 3),
        eos_token_ids=(VOCAB - 1,),
    )
    kw = {"seed": 5, "model_id": "tiny-qwen2", "progress": False}
    ref_path, resumed, sharded = tmp_path / "a.zarr", tmp_path / "b.zarr", tmp_path / "c.zarr"
    trace(m, prompts, policies, settings, ref_path, **kw)

    first = trace(m, prompts, policies, settings, resumed, max_docs=1, **kw)
    assert first.traced == [0]
    import zarr

    group = zarr.open_group(str(resumed), mode="r+")
    group["tokens"][1] = 99  # a document half-written when the process was killed
    again = trace(m, prompts, policies, settings, resumed, **kw)
    assert again.traced == [1, 2] and again.skipped == 1

    assert trace(m, prompts, policies, settings, sharded, shard=(1, 2), **kw).traced == [1]
    assert trace(m, prompts, policies, settings, sharded, shard=(0, 2), **kw).traced == [0, 2]

    ref = xr.open_zarr(ref_path).load()
    assert ref["completed"].values.all()
    assert (ref["branch_step"].values > 0).any()
    for other in (resumed, sharded):
        ds = xr.open_zarr(other).load()
        assert ds.identical(ref), other
    with pytest.raises(StoreError, match="seed"):
        trace(m, prompts, policies, settings, ref_path, **{**kw, "seed": 6})
    other_eos = TraceSettings(
        horizon=4, replicates=2, branches=2, window=2, record=Record("topk", 3), eos_token_ids=()
    )
    with pytest.raises(StoreError, match="EOS ids"):
        trace(m, prompts, policies, other_eos, ref_path, **kw)
    changed = [prompts[0], Prompt(prompts[1].id, prompts[1].input_ids[:-1]), prompts[2]]
    with pytest.raises(StoreError, match="prompts"):
        trace(m, changed, policies, settings, ref_path, **kw)


# 6 ------------------------------------------------------------------------------------------
def test_bad_prompt_files(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"id": "a", "input_ids": [1, 2, 3]}\n{"id": "b", "input_ids": [1, 2\n')
    with pytest.raises(PromptFileError, match="line 2: not valid JSON"):
        load_prompts(f)
    f.write_text('{"id": "a", "input_ids": [1, 2]}\n\n{"id": "b", "text": "  "}\n')
    with pytest.raises(PromptFileError, match="line 3: empty prompt"):
        load_prompts(f)
    f.write_text('{"id": "a", "input_ids": []}\n')
    with pytest.raises(PromptFileError, match="line 1: empty prompt"):
        load_prompts(f)
    f.write_text('{"text": "hello"}\n')
    with pytest.raises(PromptFileError, match="line 1: missing"):
        load_prompts(f)
    f.write_text('{"id": 1, "input_ids": [1]}\n{"id": "1", "input_ids": [2]}\n')
    with pytest.raises(PromptFileError, match="line 2: id '1' already used on line 1"):
        load_prompts(f)
    f.write_text('{"id": "a", "input_ids": [1, 500]}\n')
    with pytest.raises(PromptFileError, match="token id 500"):
        load_prompts(f, vocab_size=VOCAB)
    f.write_text('{"id": "a", "text": "hello"}\n')
    with pytest.raises(PromptFileError, match="needs a tokenizer"):
        load_prompts(f)
    assert issubclass(PromptFileError, ValueError)


def test_bad_trace_arguments(tmp_path):
    m = model("llama")
    with pytest.raises(ValueError, match="horizon must be >= 1"):
        TraceSettings(horizon=0)
    with pytest.raises(PromptTooShortError, match="1 token"):
        trace_document(m, [5], ["full"], TraceSettings(horizon=2))
    with pytest.raises(PolicyError, match="unknown policy"):
        trace_document(m, PROMPT, ["lru:retain=0.5"], TraceSettings(horizon=2))
    settings = TraceSettings(horizon=2, replicates=1, branches=1, window=1)
    out = tmp_path / "v.zarr"
    trace(m, _prompts(1), ["recent:retain=0.5"], settings, out, model_id="x", progress=False)
    flash = tiny_model("llama", seed=7)
    flash.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="takes no 4-D attention masks"):
        trace_document(flash, PROMPT, ["full"], TraceSettings(horizon=2))
    small = tiny_model("llama", seed=7, vocab_size=64)
    with pytest.raises(VocabularyMismatchError, match="vocabulary of 128 tokens.*have 64"):
        trace(
            small, _prompts(1), ["recent:retain=0.5"], settings, out, model_id="x", progress=False
        )


def test_cli_end_to_end_and_errors(tmp_path, capsys):
    model_dir = tmp_path / "tiny"
    model("llama").save_pretrained(model_dir)
    prompts = tmp_path / "docs.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"id": p.id, "input_ids": list(p.input_ids)}) + "\n" for p in _prompts(2)
        )
    )
    out = tmp_path / "run.zarr"
    base = [
        "trace",
        "--model",
        str(model_dir),
        "--prompts",
        str(prompts),
        "--out",
        str(out),
        "--quiet",
    ]
    args = [
        *base,
        "--policy",
        "snapkv:retain=0.5,window=4",
        "--policy",
        "recent:retain=0.5",
        "--horizon",
        "3",
        "--replicates",
        "2",
        "--branches",
        "1",
        "--window",
        "2",
        "--device",
        "cpu",
    ]
    assert cli_main(args) == 0
    assert "2 traced" in capsys.readouterr().out
    ds = xr.open_zarr(out)
    assert ds.sizes["doc"] == 2 and ds.sizes["policy"] == 2 and bool(ds["completed"].all())
    assert cli_main(args) == 0  # rerun: nothing left to do
    assert "0 traced, 2 already done" in capsys.readouterr().out

    for extra, message in [
        (["--policy", "nope"], "unknown policy 'nope'"),
        (["--policy", "snapkv:retain=0.5,size=3"], "no parameter size"),
        (["--policy", "full", "--shard", "2/2"], "0 <= i < N"),
        (["--policy", "full", "--record", "topk:0"], "record must be"),
    ]:
        assert cli_main([*base, *extra]) == 2
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit:  # argparse's usage error (kvcouple.cliargs)
        cli_main([*base, "--policy", "full", "--horizon", "0"])
    assert exit.value.code == 2
    assert "argument --horizon: 0 is not an integer >= 1" in capsys.readouterr().err
    prompts.write_text('{"id": "a", "input_ids": [1, 2, 3]}\nnot json\n')
    assert cli_main([*base[:-1], "--out", str(tmp_path / "x.zarr"), "--policy", "full"]) == 2
    assert "line 2" in capsys.readouterr().err


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_decode_time_h2o_sliding_window_equals_masked_forward(arch):
    """With recent=1 decode-time H2O is a sliding window: the path and every branch (replayed
    from the prompt cache) equal a full forward whose queries see only the last kept tokens."""
    m = model(arch)
    T, L = 6, 3
    settings = TraceSettings(
        horizon=T, replicates=2, branches=2, window=L, record=Record("topk", VOCAB)
    )
    arr, _ = trace_document(m, PROMPT, ["h2o:budget=8,recent=1.0,mode=decode"], settings, seed=3)
    n, kept = len(PROMPT), int(arr["kept_length"][0])

    def sliding(tokens):
        size = len(tokens)
        allowed = torch.ones(size, size, dtype=torch.bool).tril()
        for i in range(n - 1, size):
            # the re-fed last prompt token sees `kept` entries, later tokens kept + 1 (itself)
            allowed[i, : max(0, i - kept + (1 if i == n - 1 else 0))] = False
        mask = torch.zeros(size, size).masked_fill(~allowed, torch.finfo(torch.float32).min)
        with torch.no_grad():
            logits = m(
                input_ids=torch.tensor([tokens]),
                attention_mask=mask[None, None],
                position_ids=torch.arange(size)[None],
            ).logits[0, n - 1 :]
        return apply_decoding(logits).numpy()

    branches = 0
    for rep in range(2):
        path = arr["tokens"][0, rep]
        np.testing.assert_allclose(
            distributions(arr, "q", 0, rep), sliding(PROMPT + path[:-1].tolist()), atol=1e-5
        )
        for k in range(2):
            start = int(arr["branch_step"][0, rep, k])
            lags = min(L, T - start)
            ys = arr["branch_tokens_q"][0, rep, k, :lags].tolist()
            want = sliding(PROMPT + path[: start - 1].tolist() + ys)[start - 1 : start + lags]
            ids = arr["branch_topk_ids_q"][0, rep, k, : lags + 1].astype(np.int64)
            got = np.zeros((lags + 1, VOCAB))
            np.put_along_axis(got, ids, arr["branch_topk_probs_q"][0, rep, k, : lags + 1], axis=1)
            np.testing.assert_allclose(got, want, atol=1e-5)
            branches += 1
    assert branches == 4
    heavy, _ = trace_document(m, PROMPT, ["h2o:budget=8,recent=0.25,mode=decode"], settings, seed=3)
    assert not np.allclose(heavy["hazard"], arr["hazard"])  # heavy hitters change the kernel


def test_text_prompts_are_tokenised(tmp_path):
    class Tokenizer:
        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [0] * add_special_tokens + [ord(c) % 50 + 1 for c in text]}

        def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True):
            return (
                [7, 7] + self(messages[0]["content"], add_special_tokens=False)["input_ids"] + [9]
            )

    f = tmp_path / "p.jsonl"
    f.write_text('{"id": "a", "text": "hi"}\n{"id": "b", "input_ids": [4, 5]}\n')
    plain = load_prompts(f, Tokenizer())
    assert plain[0] == Prompt("a", (0, ord("h") % 50 + 1, ord("i") % 50 + 1))
    assert plain[1] == Prompt("b", (4, 5))
    chat = load_prompts(f, Tokenizer(), chat_template=True)
    assert chat[0].input_ids == (7, 7, ord("h") % 50 + 1, ord("i") % 50 + 1, 9)


def test_killed_process_resumes_to_the_same_store(tmp_path):
    """SIGKILL a CLI run once a document is done; rerunning the command gives the same store
    as an uninterrupted run."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import zarr

    model_dir = tmp_path / "tiny"
    model("llama").save_pretrained(model_dir)
    prompts = tmp_path / "docs.jsonl"
    lines = (json.dumps({"id": p.id, "input_ids": list(p.input_ids)}) + "\n" for p in _prompts(6))
    prompts.write_text("".join(lines))
    args = [
        "trace",
        "--model",
        str(model_dir),
        "--prompts",
        str(prompts),
        "--quiet",
        "--policy",
        "snapkv:retain=0.5,window=4",
        "--policy",
        "recent:retain=0.5",
        "--horizon",
        "24",
        "--replicates",
        "4",
        "--branches",
        "2",
        "--window",
        "4",
        "--seed",
        "3",
        "--device",
        "cpu",
    ]
    killed, ref = tmp_path / "killed.zarr", tmp_path / "ref.zarr"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvcouple.cli", *args, "--out", str(killed)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 180
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            if np.asarray(zarr.open_group(str(killed), mode="r")["completed"][...]).any():
                break
        except Exception:  # the store is not there yet
            pass
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    finished = np.asarray(zarr.open_group(str(killed), mode="r")["completed"][...])
    print(f"killed with {finished.sum()} of {finished.size} documents done")
    assert cli_main([*args, "--out", str(killed)]) == 0
    assert cli_main([*args, "--out", str(ref)]) == 0
    assert xr.open_zarr(killed).load().identical(xr.open_zarr(ref).load())


def test_all_zero_chunks_are_written(tmp_path):
    """The full policy's hazards are all zero: the chunk must still exist on disk, since
    readers take a missing chunk for a damaged store."""
    out = tmp_path / "full.zarr"
    settings = TraceSettings(horizon=3, replicates=2, branches=1, window=1)
    trace(model("llama"), _prompts(1), ["full"], settings, out, progress=False)
    assert (out / "hazard" / "0.0.0.0").exists()
    assert (out / "branch_step" / "0.0.0.0").exists()


def test_greedy_decoding_stops_the_path_at_hazard_one():
    """With top_k=1 both kernels are point masses: the hazard is 0 or 1, a hazard of 1 ends
    the path (tokens -1, hazard 0, distributions blank after it) and is the branch time."""
    settings = TraceSettings(
        horizon=6,
        replicates=1,
        branches=1,
        window=6,
        decoding=Decoding(top_k=1),
        record=Record("topk", 2),
    )
    stops = 0
    for seed in range(4):
        ids = [int(t) for t in np.random.default_rng(seed).integers(1, VOCAB - 1, 20)]
        arr, _ = trace_document(model("qwen2"), ids, ["recent:budget=1"], settings, seed=seed)
        hazard, tokens = arr["hazard"][0, 0], arr["tokens"][0, 0]
        assert set(np.unique(hazard)) <= {0.0, 1.0}
        hits = np.flatnonzero(hazard == 1)
        if hits.size:
            stops += 1
            t = hits[0]
            assert (tokens[t:] == -1).all() and (tokens[:t] >= 0).all()
            assert (hazard[t + 1 :] == 0).all()
            assert arr["branch_step"][0, 0, 0] == t + 1
            assert np.isnan(arr["topk_probs_p"][0, 0, t + 1 :]).all()
            assert arr["branch_tokens_p"][0, 0, 0, 0] != arr["branch_tokens_q"][0, 0, 0, 0]
        else:
            assert arr["branch_step"][0, 0, 0] == 0
    assert stops > 0


def test_branch_batches_change_only_float_noise():
    import dataclasses

    settings = TraceSettings(
        horizon=8, replicates=3, branches=3, window=4, record=Record("topk", 3)
    )
    ids = PROMPT[:20]
    # (Not seed 4: one of its branch uniforms, 0.49969274, lies 1e-7 from a boundary of a
    # residual's CDF, where float noise of the batch legitimately flips the draw.)
    a, ta = trace_document(model("llama"), ids, ["snapkv:retain=0.5,window=8"], settings, seed=5)
    small = dataclasses.replace(settings, branch_batch=2)
    b, tb = trace_document(model("llama"), ids, ["snapkv:retain=0.5,window=8"], small, seed=5)
    assert ta == tb
    for name in a:
        if a[name].dtype.kind == "f":
            np.testing.assert_allclose(a[name], b[name], atol=1e-5, err_msg=name)
        else:
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_bfloat16_model():
    """The GPU default dtype, on CPU: full policy exact, an eviction traced end to end."""
    m = tiny_model("qwen2", seed=7).to(torch.bfloat16)
    settings = TraceSettings(horizon=4, replicates=2, branches=1, window=2)
    arr, _ = trace_document(m, PROMPT, ["full", "snapkv:retain=0.5,window=4"], settings, seed=1)
    assert arr["hazard"][0].max() <= 1e-6
    assert arr["hazard"][1].max() > 0 and np.isfinite(arr["entropy_q"][1]).all()


def test_analysis_reads_a_traced_store_and_agrees_with_its_distributions(tmp_path):
    """Integration: the analysis recomputes hazards and branch TVs from the stored float16
    distributions of a traced store and finds no disagreement; the full policy has no loss."""
    from kvcouple.analysis import analyze

    out = tmp_path / "full.zarr"
    settings = TraceSettings(
        horizon=6,
        replicates=3,
        branches=2,
        window=3,
        record=Record("full"),
        decoding=Decoding(temperature=0.9, top_p=0.95),
        eos_token_ids=(VOCAB - 1,),
    )
    policies = ["full", "snapkv:retain=0.5,window=4", "h2o:retain=0.5,mode=decode"]
    trace(model("qwen3"), _prompts(2), policies, settings, out, model_id="tiny", progress=False)
    result = analyze(out, n_boot=50)
    assert result.checks() == []
    docs = result.models[0].docs
    assert all(d.check is not None for d in docs)
    for d in docs:
        assert d.units["full"].survival.min() == pytest.approx(1.0)  # never diverges
        assert d.units[parse_policy(policies[1]).spec()].survival[-1] < 1.0
