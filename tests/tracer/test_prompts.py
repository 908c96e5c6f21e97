"""``kvcouple prompts``: prompt files from JSONL, CSV, Parquet and saved datasets, tokenised with
a tiny local tokenizer built here (nothing downloaded), that ``kvcouple trace`` accepts; filters,
truncation, sampling, length buckets, and a split reproducible from the seed."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvcouple.cli import main  # noqa: E402
from kvcouple.prompts import PromptBuildError, bucket, build_prompts, read_records  # noqa: E402
from kvcouple.testing import tiny_model  # noqa: E402

pytestmark = pytest.mark.torch

WORDS = [f"w{i}" for i in range(100)]
CHAT = (
    "{% for m in messages %}<s> {{ m['content'] }} </s>{% endfor %}"
    "{% if add_generation_prompt %} <s>{% endif %}"
)


def make_model_dir(path, chat: bool = True):
    """A tiny Llama (vocabulary 128) and a word-level tokenizer over ``WORDS`` in one folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="[UNK]", bos_token="<s>", eos_token="</s>"
    )
    if chat:
        tok.chat_template = CHAT
    tiny_model("llama", seed=3).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def records(n: int = 40):
    # Lengths 1..n words: several length buckets, a few below the tracer's minimum.
    return [
        {"id": f"d{i:02d}", "title": WORDS[i % 100], "body": " ".join(WORDS[: 1 + i])}
        for i in range(n)
    ]


def read_lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("tiny"))


def run(*args) -> int:
    return main(["prompts", *map(str, args), "--quiet"])


def test_jsonl_template_filters_buckets_and_split(tmp_path, model_dir):
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records()))
    out, plan = tmp_path / "p.jsonl", tmp_path / "docs.toml"
    common = [src, "--model", model_dir, "--template", "{title} : {body}", "--min-tokens", 4]
    common += ["--max-tokens", 30, "--sample", 12, "--seed", 5]
    assert run(*common, "--out", out, "--exploratory-fraction", 0.25, "--plan-out", plan) == 0
    got = read_lines(out)
    assert len(got) == 12
    lengths = [len(g["input_ids"]) for g in got]
    # "{title} : {body}" with i + 1 body words is i + 3 tokens (":" is unknown: one token).
    for g, n in zip(got, lengths, strict=True):
        assert n == int(g["id"][1:]) + 3 and 4 <= n <= 30
    assert [bucket(n) for n in lengths] == sorted(bucket(n) for n in lengths)  # by bucket
    assert all(max(ns) <= 2 * min(ns) for ns in _runs(lengths))  # each bucket within 2x
    # The same command again: the same file and split; another seed: another sample.
    again, plan2 = tmp_path / "again.jsonl", tmp_path / "again.toml"
    assert run(*common, "--out", again, "--exploratory-fraction", 0.25, "--plan-out", plan2) == 0
    assert again.read_text() == out.read_text() and plan2.read_text() == plan.read_text()
    other = tmp_path / "other.jsonl"
    common[common.index(5)] = 6
    assert run(*common, "--out", other) == 0
    assert other.read_text() != out.read_text()
    # The split is a plan's [documents] section, equal to the plan's own split rule.
    import tomllib

    from kvcouple.analysis.plan import parse_plan

    docs = tomllib.loads(plan.read_text())["documents"]
    ids = [g["id"] for g in got]
    assert sorted(docs["exploratory"] + docs["confirmatory"]) == sorted(ids)
    assert docs["exploratory"] and docs["confirmatory"]
    comparison = {"metric": "rmst", "policy": "recent:retain=0.5"}
    rule = {"split": {"exploratory_fraction": 0.25, "seed": 5}}
    plan_rule = parse_plan({"documents": rule, "comparisons": [comparison]})
    assert docs["exploratory"] == plan_rule.documents(ids, "exploratory")
    plan_lists = parse_plan({"documents": docs, "comparisons": [comparison]})
    assert plan_lists.documents(ids, "confirmatory") == docs["confirmatory"]


def _runs(lengths):
    out = {}
    for n in lengths:
        out.setdefault(bucket(n), []).append(n)
    return out.values()


def test_chat_template_truncation_and_csv(tmp_path, model_dir):
    import csv

    src = tmp_path / "docs.csv"
    with src.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["id", "title", "body"])
        w.writeheader()
        w.writerows(records(12))
    out = tmp_path / "p.jsonl"
    args = [src, "--model", model_dir, "--field", "body", "--chat-template", "--no-buckets"]
    assert run(*args, "--max-tokens", 8, "--truncate", "left", "--out", out) == 0
    got = read_lines(out)
    assert [g["id"] for g in got] == [f"d{i:02d}" for i in range(12)]  # the source's order
    for i, g in enumerate(got):
        # <s> words </s> <s>: the chat template adds three tokens; left truncation keeps the end.
        full = [1, *range(3, 3 + i + 1), 2, 1]
        assert g["input_ids"] == full[-8:]


def test_parquet_and_saved_dataset_and_trace_accepts_them(tmp_path, model_dir):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = records(20)
    parquet = tmp_path / "docs.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    out_pq = tmp_path / "from_parquet.jsonl"
    assert run(parquet, "--model", model_dir, "--field", "body", "--out", out_pq) == 0
    datasets = pytest.importorskip("datasets")
    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(saved))
    out_ds = tmp_path / "from_dataset.jsonl"
    assert (
        run(saved, "--split", "train", "--model", model_dir, "--field", "body", "--out", out_ds)
        == 0
    )
    assert out_ds.read_text() == out_pq.read_text()  # the same records, the same file
    assert len(read_lines(out_pq)) == 19  # the 1-token record is below the tracer's minimum
    store = tmp_path / "run.zarr"
    trace = ["trace", "--model", model_dir, "--prompts", out_ds, "--out", store]
    trace += ["--policy", "recent:retain=0.5", "--horizon", "2", "--replicates", "1"]
    assert main([*map(str, trace), "--branches", "1", "--quiet"]) == 0
    import xarray as xr

    ds = xr.open_zarr(store)
    assert ds.sizes["doc"] == 19 and bool(ds["completed"].all())


def test_jsonl_prompt_file_traces_without_extras(tmp_path, model_dir):
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records(6)))
    out = tmp_path / "p.jsonl"
    assert run(src, "--model", model_dir, "--field", "body", "--out", out) == 0
    trace = ["trace", "--model", model_dir, "--prompts", out, "--out", tmp_path / "r.zarr"]
    trace += ["--policy", "snapkv:retain=0.5,window=2", "--horizon", "2", "--replicates", "1"]
    assert main([*map(str, trace), "--branches", "1", "--quiet"]) == 0


def test_clear_errors(tmp_path, model_dir, capsys):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    with pytest.raises(PromptBuildError, match="no field 'text'; its fields: id, title, body"):
        build_prompts(records(3), tok)
    with pytest.raises(PromptBuildError, match="names field 'question'"):
        build_prompts(records(3), tok, template="{question}")
    with pytest.raises(PromptBuildError, match="no prompt left: 3 read, 3 under 4 tokens$"):
        build_prompts(records(3), tok, text_field="body", min_tokens=4)
    two = [{"id": "a", "text": "w1"}, {"id": "b", "text": "w1 w2 w3 w4"}]
    with pytest.raises(PromptBuildError, match="2 read, 1 under 2 tokens, 1 over 3 tokens"):
        build_prompts(two, tok, max_tokens=3)
    with pytest.raises(PromptBuildError, match="already used"):
        build_prompts([{"id": "a", "text": "w1 w2"}, {"id": "a", "text": "w3 w4"}], tok)
    plain = make_model_dir(tmp_path / "no-chat", chat=False)
    src = tmp_path / "d.jsonl"
    src.write_text(json.dumps({"id": "a", "text": "w1 w2"}) + "\n")
    out = tmp_path / "p.jsonl"
    assert run(src, "--model", plain, "--chat-template", "--out", out) == 2
    assert "has no chat template" in capsys.readouterr().err and not out.exists()
    assert run(tmp_path / "missing.jsonl", "--model", plain, "--out", out) == 2
    assert "no such file" in capsys.readouterr().err
    bad = src.with_suffix(".txt")
    bad.write_text("x")
    with pytest.raises(PromptBuildError, match="unknown kind of file"):
        read_records(bad)
