"""Train kvcouple's embedded default model: a tiny Llama-style causal LM with GQA.

Why: the README demo, the notebooks and the tests need a real (trained, non-degenerate)
language model on a fresh machine with no network. This script builds one on CPU in a few
minutes, from text that is already on every machine: the docstrings of the Python standard
library and the reference-manual topics shipped in ``pydoc_data``. Nothing is downloaded.

Outputs (defaults shown):
- ``python/kvcouple/data/default_model/``: a Hugging Face model directory (config.json,
  generation_config.json, model.safetensors, tokenizer files, training.json with the recipe,
  the corpus hash and the losses);
- ``python/kvcouple/data/prompts.jsonl``: held-out documents ``{"id", "text"}`` of 150-400
  tokens each, drawn from modules/topics the model never saw in training.

Reproducibility: everything is seeded and the number of optimiser steps is fixed (not a time
budget). The corpus depends on the Python version's standard library, so training.json records
the Python version and the corpus SHA-256; the same Python version, torch build and thread
count reproduce the same weights.

Run from the repository root::

    python scripts/train_default_model.py            # 600 steps, ~8 min on one core of a busy 2-core machine
    python scripts/train_default_model.py --steps 50 --out /tmp/m --prompts-out /tmp/p.jsonl
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import os
import platform
import re
import sys
import sysconfig
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "python" / "kvcouple" / "data"

BOS, EOS = "<|bos|>", "<|eos|>"
SKIP_PARTS = {"test", "tests", "idlelib", "site-packages", "lib2to3", "turtledemo", "__pycache__"}


# --------------------------------------------------------------------------- corpus


def _stdlib_docstrings() -> list[tuple[str, str]]:
    """(unit, text) for every docstring of the stdlib, in sorted file order.

    Files are parsed with ``ast`` (nothing is imported), so the result depends only on the
    stdlib sources of this Python version.
    """
    lib = Path(sysconfig.get_paths()["stdlib"])
    out: list[tuple[str, str]] = []
    for path in sorted(lib.rglob("*.py")):
        rel = path.relative_to(lib)
        if SKIP_PARTS.intersection(rel.parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        unit = "stdlib:" + rel.as_posix()
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node, clean=True)
                if doc and len(doc) >= 40:
                    out.append((unit, doc))
    return out


def _pydoc_topics() -> list[tuple[str, str]]:
    """(unit, text) for the language-reference topics in ``pydoc_data.topics``."""
    from pydoc_data.topics import topics

    return [("topic:" + k, re.sub(r"\n{3,}", "\n\n", v.strip())) for k, v in sorted(topics.items())]


def _is_heldout(unit: str, fraction: int = 10) -> bool:
    """Hold out whole modules/topics (~1/fraction of them), so prompts are unseen text."""
    return hashlib.sha256(unit.encode()).digest()[0] % fraction == 0


def build_corpus() -> tuple[list[tuple[str, str]], list[tuple[str, str]], str]:
    """Train and held-out documents, and the SHA-256 of the whole corpus."""
    docs = _pydoc_topics() + _stdlib_docstrings()
    h = hashlib.sha256()
    for unit, text in docs:
        h.update(unit.encode() + b"\0" + text.encode() + b"\0")
    train = [d for d in docs if not _is_heldout(d[0])]
    held = [d for d in docs if _is_heldout(d[0])]
    return train, held, h.hexdigest()


# --------------------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE (no unknown tokens) wrapped as a ``PreTrainedTokenizerFast``.

    Encoding prepends BOS (a stable first position, which attention-sink policies rely on);
    EOS ends every training document (a whole module or topic).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id, eos_id = tok.token_to_id(BOS), tok.token_to_id(EOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id), (EOS, eos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=EOS,
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )


# --------------------------------------------------------------------------- prompts


def _prose_score(text: str) -> float:
    """Fraction of letters and spaces: high for prose, low for code and tables."""
    if not text:
        return 0.0
    return sum(c.isalpha() or c == " " for c in text) / len(text)


def select_prompts(held, tokenizer, n: int, lo: int, hi: int) -> list[dict]:
    """``n`` held-out documents of ``lo..hi`` tokens (BOS included), one per unit, prose first.

    Long documents are cut at paragraph boundaries; ties are broken deterministically.
    """

    def n_tokens(text: str) -> int:
        return len(tokenizer.backend_tokenizer.encode(text).ids)

    candidates = []
    for unit, text in held:
        paras = [p for p in text.split("\n\n") if p.strip()]
        chunk: list[str] = []
        for p in paras:
            trial = "\n\n".join([*chunk, p])
            if n_tokens(trial) > hi:
                break
            chunk.append(p)
        body = "\n\n".join(chunk)
        ntok = n_tokens(body)
        if lo <= ntok <= hi and ">>>" not in body:
            candidates.append((unit, body, ntok, _prose_score(body)))
    seen: set[str] = set()
    picked = []
    for unit, body, ntok, _score in sorted(candidates, key=lambda c: (-round(c[3], 3), c[0])):
        if unit in seen:
            continue
        seen.add(unit)
        picked.append((unit, body, ntok))
        if len(picked) == n:
            break
    picked.sort(key=lambda c: c[0])
    out = []
    for i, (unit, body, ntok) in enumerate(picked):
        slug = re.sub(r"[^a-z0-9]+", "-", unit.split(":", 1)[1].lower()).strip("-")
        out.append({"id": f"{i:02d}-{slug}", "text": body, "source": unit, "n_tokens": ntok})
    return out


# --------------------------------------------------------------------------- model


def make_config(vocab_size: int, bos_id: int, eos_id: int):
    """The default model's architecture: Llama with grouped-query attention (4 Q, 2 KV heads)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        initializer_range=0.02,
    )


def _rel(path: str) -> str:
    """A path relative to the repository when inside it (no machine paths in the manifest)."""
    p = Path(path).resolve()
    return p.relative_to(REPO).as_posix() if p.is_relative_to(REPO) else str(p)


def _make_portable(out: Path) -> None:
    """Keep the saved directory loadable by transformers 4.45+ as well as 5.x.

    transformers 5 names the tokenizer class ``TokenizersBackend`` and writes RoPE settings as
    ``rope_parameters``; 4.x knows neither, so the portable spellings are written too.
    """
    tc_path = out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    tc_path.write_text(json.dumps(tc, indent=2) + "\n")
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    theta = cfg.get("rope_parameters", {}).get("rope_theta", cfg.get("rope_theta", 10000.0))
    cfg["rope_theta"] = theta
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for f in out.iterdir():
        f.chmod(0o644)


def train(args: argparse.Namespace) -> None:
    import torch
    from transformers import GenerationConfig, LlamaForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t0 = time.time()

    train_docs, held_docs, corpus_sha = build_corpus()
    print(
        f"corpus: {len(train_docs)} train docs ({sum(len(t) for _, t in train_docs) / 1e6:.2f} M chars), "
        f"{len(held_docs)} held-out docs, sha256 {corpus_sha[:16]}"
    )
    tokenizer = train_tokenizer([t for _, t in train_docs], args.vocab_size)
    bos_id, eos_id = tokenizer.bos_token_id, tokenizer.eos_token_id

    def pack(docs) -> torch.Tensor:
        # One training document per unit (a module's docstrings joined by blank lines, or a
        # topic): EOS then comes only at the end of long documents, so sampled continuations
        # of a prompt rarely stop early (EOS is absorbing in kvcouple's kernels).
        units: dict[str, list[str]] = {}
        for unit, text in docs:
            units.setdefault(unit, []).append(text)
        texts = ["\n\n".join(parts) for parts in units.values()]
        ids: list[int] = []
        for enc in tokenizer.backend_tokenizer.encode_batch(texts):
            ids.extend(enc.ids)  # BOS + text
            ids.append(eos_id)
        return torch.tensor(ids, dtype=torch.long)

    train_ids, held_ids = pack(train_docs), pack(held_docs)
    print(
        f"tokens: {train_ids.numel() / 1e6:.2f} M train, {held_ids.numel() / 1e6:.3f} M held-out "
        f"({sum(len(t) for _, t in train_docs) / train_ids.numel():.2f} chars/token); "
        f"setup {time.time() - t0:.1f}s"
    )

    prompts = select_prompts(held_docs, tokenizer, args.n_prompts, args.prompt_min, args.prompt_max)
    if len(prompts) < args.n_prompts:
        raise SystemExit(f"only {len(prompts)} held-out prompts in the token band")

    config = make_config(len(tokenizer), bos_id, eos_id)
    model = LlamaForCausalLM(config)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f} M parameters")

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    warmup = max(1, args.steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return args.lr * (step + 1) / warmup
        frac = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    gen = torch.Generator().manual_seed(args.seed)
    L = args.seq_len

    def batch(ids: torch.Tensor, bsz: int, g: torch.Generator) -> torch.Tensor:
        starts = torch.randint(0, ids.numel() - L - 1, (bsz,), generator=g)
        return torch.stack([ids[s : s + L] for s in starts.tolist()])

    @torch.no_grad()
    def held_loss(nbatch: int = 8) -> float:
        model.eval()
        g = torch.Generator().manual_seed(args.seed + 1)
        losses = [
            model(input_ids=(x := batch(held_ids, 8, g)), labels=x).loss.item()
            for _ in range(nbatch)
        ]
        model.train()
        return sum(losses) / len(losses)

    history = []
    t_train = time.time()
    ema = None
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        x = batch(train_ids, args.batch_size, gen)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            el = time.time() - t_train
            print(
                f"step {step + 1:5d}  loss {loss.item():.3f}  ema {ema:.3f}  lr {lr_at(step):.2e}  {el:6.1f}s",
                flush=True,
            )
            history.append({"step": step + 1, "loss": round(loss.item(), 4), "ema": round(ema, 4)})
    train_seconds = time.time() - t_train
    final_held = held_loss()
    print(
        f"trained {args.steps} steps in {train_seconds:.0f}s; final train loss (ema) {ema:.3f}, held-out loss {final_held:.3f}"
    )

    model.eval()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*"):
        if stale.is_file():
            stale.unlink()
    model.generation_config = GenerationConfig(
        bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=eos_id, do_sample=False
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    _make_portable(out)
    manifest = {
        "what": "kvcouple embedded default model (tiny Llama, GQA 4Q/2KV), trained by scripts/train_default_model.py",
        "corpus": "Python stdlib docstrings + pydoc_data topics (held-out units excluded)",
        "corpus_sha256": corpus_sha,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "tokenizers": __import__("tokenizers").__version__,
        "args": {k: _rel(v) if k in ("out", "prompts_out") else v for k, v in vars(args).items()},
        "n_params": n_params,
        "train_tokens": int(train_ids.numel()),
        "tokens_seen": args.steps * args.batch_size * L,
        "train_seconds": round(train_seconds, 1),
        "final_train_loss_ema": round(ema, 4),
        "final_heldout_loss": round(final_held, 4),
        "history": history,
    }
    (out / "training.json").write_text(json.dumps(manifest, indent=1) + "\n")
    with open(args.prompts_out, "w") as f:
        for p in prompts:
            f.write(json.dumps({"id": p["id"], "text": p["text"], "source": p["source"]}) + "\n")
    ntoks = [p["n_tokens"] for p in prompts]
    print(
        f"wrote {out} and {len(prompts)} prompts ({min(ntoks)}-{max(ntoks)} tokens) to {args.prompts_out}"
    )
    print(f"total {time.time() - t0:.0f}s")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(DATA / "default_model"))
    p.add_argument("--prompts-out", default=str(DATA / "prompts.jsonl"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--n-prompts", type=int, default=16)
    p.add_argument("--prompt-min", type=int, default=150)
    p.add_argument("--prompt-max", type=int, default=400)
    p.add_argument("--log-every", type=int, default=50)
    args = p.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    train(args)


if __name__ == "__main__":
    sys.exit(main())
