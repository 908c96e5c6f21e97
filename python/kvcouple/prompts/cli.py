"""``kvcouple prompts``: build the prompt file ``kvcouple trace --prompts`` reads from local data.

Examples::

    kvcouple prompts docs.parquet --field text --out prompts.jsonl
    kvcouple prompts squad_saved/ --split validation \\
        --template "{context}\\n\\nQuestion: {question}" --chat-template \\
        --model meta-llama/Llama-3.1-8B-Instruct --max-tokens 2048 --truncate left \\
        --sample 400 --seed 1 --exploratory-fraction 0.25 --plan-out documents.toml \\
        --out prompts.jsonl

The file holds ``{"id", "input_ids"}`` lines tokenised with the model's tokenizer (through its
chat template with ``--chat-template``), so trace it without ``--chat-template``. Prompts are
ordered by length bucket (``[2^k, 2^(k+1))`` tokens) so that the tracer's document batches hold
prompts within a factor of two. ``--plan-out`` writes the ``[documents]`` section of an
analysis plan: the ids split into exploratory and confirmatory sets, reproducibly from
``--seed``. Reading Parquet needs pyarrow and a saved dataset needs datasets
(``pip install 'kvcouple[prompts]'``).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kvcouple import cliargs


def register(subparsers: Any) -> None:
    """Add the ``prompts`` command."""
    p = subparsers.add_parser(
        "prompts",
        help="build the tracer's prompt file from local data (JSONL, CSV, Parquet, datasets)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("source", help="a .jsonl, .csv or .parquet file, or a save_to_disk folder")
    p.add_argument("--out", required=True, help="the prompt file to write (JSON lines)")
    text = p.add_mutually_exclusive_group()
    text.add_argument("--field", default=None, help="the field holding the text (default: text)")
    text.add_argument(
        "--template", default=None, help='a template over the fields, e.g. "{title}: {body}"'
    )
    p.add_argument("--id-field", default=None, help="the field holding the id (default: id)")
    p.add_argument("--split", default=None, help="the split of a saved DatasetDict folder")
    p.add_argument("--model", default=None, help="whose tokenizer (default: the embedded model's)")
    p.add_argument("--revision", default=None, help="model revision (Hub models)")
    p.add_argument(
        "--chat-template", action="store_true", help="tokenise through the chat template"
    )
    p.add_argument("--min-tokens", type=cliargs.positive, default=2, help="drop shorter prompts")
    p.add_argument(
        "--max-tokens", type=cliargs.positive, default=None, help="drop (or truncate) longer ones"
    )
    p.add_argument(
        "--truncate",
        choices=["none", "left", "right"],
        default="none",
        help="over --max-tokens: drop (none), keep the last (left) or first (right) tokens",
    )
    p.add_argument(
        "--sample", type=cliargs.positive, default=None, metavar="N", help="keep N at random"
    )
    cliargs.add_seed(p, 0, help="seeds --sample and the split")
    p.add_argument(
        "--no-buckets", action="store_true", help="keep the source's order (no length buckets)"
    )
    p.add_argument(
        "--exploratory-fraction",
        type=cliargs.unit_open,
        default=None,
        help="split the ids: about this share exploratory (needs --plan-out)",
    )
    p.add_argument("--plan-out", default=None, help="write the split as a plan's [documents]")
    p.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run ``kvcouple prompts``; returns the exit code."""
    from tqdm import tqdm  # type: ignore[import-untyped]

    from kvcouple.models import load_tokenizer
    from kvcouple.prompts.build import (
        build_prompts,
        documents_section,
        read_records,
        write_prompt_file,
    )
    from kvcouple.tracer.prompts import PromptFileError

    if (args.exploratory_fraction is None) != (args.plan_out is None):
        raise PromptFileError("--exploratory-fraction and --plan-out go together")
    records = read_records(args.source, args.split)  # before the tokenizer: cheap errors first
    tokenizer = load_tokenizer(args.model, revision=args.revision)

    def progress(rows: Any) -> Any:
        return tqdm(rows, total=len(records), desc="kvcouple prompts", unit="doc")

    built = build_prompts(
        records,
        tokenizer,
        text_field=args.field or "text",
        template=args.template,
        id_field=args.id_field,
        chat_template=args.chat_template,
        min_tokens=args.min_tokens,
        max_tokens=args.max_tokens,
        truncate=args.truncate,
        sample=args.sample,
        seed=args.seed,
        buckets=not args.no_buckets,
        exploratory_fraction=args.exploratory_fraction,
        progress=None if args.quiet else progress,
    )
    write_prompt_file(built.prompts, args.out)
    if args.plan_out is not None:
        Path(args.plan_out).write_text(
            documents_section(built, args.source, args.exploratory_fraction, args.seed),
            encoding="utf-8",
        )
    if not args.quiet:
        lengths = [len(p.input_ids) for p in built.prompts]
        print(
            f"wrote {len(built.prompts)} prompts to {args.out} ({built.read} read; dropped "
            f"{built.too_short} short, {built.too_long} long; truncated {built.truncated}); "
            f"tokens {min(lengths)}..{max(lengths)}"
        )
        print(
            "length buckets: "
            + ", ".join(f"{b}-{2 * b - 1}: {n}" for b, n in sorted(built.buckets().items()))
        )
        if args.plan_out is not None:
            print(
                f"split: {len(built.exploratory)} exploratory, {len(built.confirmatory)} "
                f"confirmatory -> {args.plan_out}"
            )
    return 0
