"""Coupled tracing throughput vs ``model.generate`` with the same total batch, on CPU.

Throughput is generated tokens per second with both sides counted: a coupled step of ``R``
replicates produces ``2R`` tokens (P and Q rows), exactly like ``generate`` with batch ``2R``.
Both include the prompt's prefill. The trace is timed twice: overlap path only (``window=0``:
one branch step per replicate) and with ``K`` branches traced for ``L`` lags; then the same
for a decode-time policy (``--decode-policy``, evicting after every generated token; its
branches are replayed from the prompt).

    python benchmarks/bench_trace.py                # small Llama-shaped model, 1 thread
    python benchmarks/bench_trace.py --threads 2 --replicates 8

Goal: ratio >= 0.7.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch


def small_model(vocab: int, hidden: int, layers: int, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 32,
        num_key_value_heads=max(1, hidden // 128),
        max_position_embeddings=4096,
        attn_implementation="sdpa",
        initializer_range=0.1,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.eval()


def best_of_interleaved(repeats: int, fns: list) -> list[float]:
    """Best time of each function, running them in turn so that load on a shared machine
    hits all of them alike."""
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens")
    ap.add_argument("--horizon", type=int, default=64)
    ap.add_argument("--replicates", type=int, default=4, help="R (generate batch is 2R)")
    ap.add_argument("--branches", type=int, default=1)
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--policy", default="snapkv:retain=0.5")
    ap.add_argument("--decode-policy", default="h2o:retain=0.5,mode=decode")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from kvcouple.tracer import TraceSettings, trace_document

    torch.set_num_threads(args.threads)
    model = small_model(args.vocab, args.hidden, args.layers)
    prompt = np.random.default_rng(0).integers(0, args.vocab, args.prompt).tolist()
    R, T = args.replicates, args.horizon

    def run_generate() -> None:
        ids = torch.tensor([prompt] * (2 * R))
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                top_k=0,
                max_new_tokens=T,
                min_new_tokens=T,
                pad_token_id=0,
            )

    tokens = {}

    def run_trace(settings: TraceSettings, key: str, policy: str = args.policy) -> None:
        _, tokens[key] = trace_document(model, prompt, [policy], settings, seed=1)

    path_only = TraceSettings(horizon=T, replicates=R, branches=1, window=0)
    with_branches = TraceSettings(
        horizon=T, replicates=R, branches=args.branches, window=args.window
    )
    run_generate()  # warm-up
    run_trace(path_only, "path")
    run_trace(path_only, "decode path", args.decode_policy)
    gen_s, path_s, branch_s, dpath_s, dbranch_s = best_of_interleaved(
        args.repeats,
        [
            run_generate,
            lambda: run_trace(path_only, "path"),
            lambda: run_trace(with_branches, "branches"),
            lambda: run_trace(path_only, "decode path", args.decode_policy),
            lambda: run_trace(with_branches, "decode branches", args.decode_policy),
        ],
    )

    gen_tps = 2 * R * T / gen_s
    print(
        f"model: Llama-shaped, vocab {args.vocab}, hidden {args.hidden}, {args.layers} layers; "
        f"prompt {args.prompt}, T={T}, R={R} (batch {2 * R}), policy {args.policy}, "
        f"{args.threads} thread(s)"
    )
    print(f"generate:                  {gen_tps:9.1f} tokens/s ({gen_s:.2f} s)")
    print(f"decode-time policy: {args.decode_policy}")
    for name, secs, key in [
        ("trace, overlap path", path_s, "path"),
        (f"trace, K={args.branches} L={args.window}", branch_s, "branches"),
        ("decode-time, path", dpath_s, "decode path"),
        (f"decode-time, K={args.branches} L={args.window}", dbranch_s, "decode branches"),
    ]:
        tps = tokens[key] / secs
        print(f"{name:26s} {tps:9.1f} tokens/s ({secs:.2f} s)   ratio {tps / gen_tps:.2f}x")


if __name__ == "__main__":
    main()
