"""One prepared GPU check: trace an 8B-shaped Llama (random bf16 weights) on a 4k-token prompt
with SnapKV, and compare with ``model.generate`` at the same total batch.

    python benchmarks/gpu_trace.py                 # on a CUDA machine (about 20 GB + caches)
    python benchmarks/gpu_trace.py --tiny          # the same code path on CPU, in seconds

Prints generated tokens per second (both sides counted) for the coupled trace and for
``generate`` with batch ``2R``, their ratio, the trace's forward steps per second, and peak
GPU memory. Weights are random (no download): distributions are nearly uniform, which does not
change the cost of a step.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch


def build_model(tiny: bool, device: torch.device, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    if tiny:
        shape = dict(
            vocab_size=512,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    else:  # Llama-3.1-8B
        shape = dict(
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
        )
    config = LlamaConfig(
        **shape,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        attn_implementation="sdpa",
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device), torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    # Parameters are already in `dtype`; casting again would also round the float32 RoPE buffers.
    return model.to(device=device).eval()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="small config on CPU (a quick check)")
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 4096)")
    ap.add_argument("--horizon", type=int, default=None, help="T (default 128)")
    ap.add_argument("--replicates", type=int, default=8, help="R; generate runs batch 2R")
    ap.add_argument("--branches", type=int, default=1)
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--policy", default="snapkv:retain=0.5")
    args = ap.parse_args(argv)

    from kvcouple.tracer import TraceSettings, compat, trace_document

    tiny = args.tiny
    device = torch.device("cpu" if tiny else "cuda")
    dtype = torch.float32 if tiny else torch.bfloat16
    n = args.prompt or (96 if tiny else 4096)
    T = args.horizon or (8 if tiny else 128)
    R = args.replicates if not tiny else min(args.replicates, 2)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --tiny for the CPU-size check")

    start = time.perf_counter()
    model = build_model(tiny, device, dtype)
    vocab = model.config.vocab_size
    prompt = np.random.default_rng(0).integers(2, vocab, n).tolist()
    print(
        f"model built in {time.perf_counter() - start:.1f} s: "
        f"{sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters, {dtype}, {device}"
    )

    steps = [0]
    forward = compat.forward

    def counting_forward(*a, **kw):
        steps[0] += 1
        return forward(*a, **kw)

    compat.forward = counting_forward

    def run_trace(horizon: int, reps: int) -> tuple[float, int]:
        settings = TraceSettings(
            horizon=horizon, replicates=reps, branches=args.branches, window=args.window
        )
        synchronize(device)
        t0 = time.perf_counter()
        arrays, tokens = trace_document(model, prompt, [args.policy], settings, seed=1)
        synchronize(device)
        return time.perf_counter() - t0, tokens

    def run_generate(horizon: int, reps: int) -> float:
        ids = torch.tensor([prompt] * (2 * reps), device=device)
        synchronize(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                top_k=0,
                max_new_tokens=horizon,
                min_new_tokens=horizon,
                pad_token_id=1,
            )
        synchronize(device)
        return time.perf_counter() - t0

    run_trace(2, R)  # warm-up: kernels, allocator
    run_generate(2, R)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    steps[0] = 0
    trace_s, trace_tokens = run_trace(T, R)
    trace_steps = steps[0]
    gen_s = run_generate(T, R)
    compat.forward = forward

    trace_tps = trace_tokens / trace_s
    gen_tps = 2 * R * T / gen_s
    result = {
        "trace_tokens_per_s": trace_tps,
        "generate_tokens_per_s": gen_tps,
        "ratio": trace_tps / gen_tps,
        "trace_steps_per_s": trace_steps / trace_s,
    }
    print(
        f"prompt {n} tokens, T={T}, R={R} (batch {2 * R}), K={args.branches}, "
        f"L={args.window}, policy {args.policy}"
    )
    print(
        f"trace:    {trace_tokens} tokens in {trace_s:.2f} s = {trace_tps:.1f} tokens/s, "
        f"{trace_steps} forward steps = {result['trace_steps_per_s']:.2f} steps/s "
        f"(includes prefill and SnapKV selection)"
    )
    print(f"generate: {2 * R * T} tokens in {gen_s:.2f} s = {gen_tps:.1f} tokens/s")
    print(f"ratio trace/generate: {result['ratio']:.2f}x")
    if device.type == "cuda":
        print(f"peak GPU memory: {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB")
    return result


if __name__ == "__main__":
    main()
