"""The tracer at paper scale on one GPU: an 8B-shaped Llama (random bf16 weights) on 4k, 16k
and 32k-token prompts with SnapKV, R=8, K=4, L=32, T=256, against ``model.generate``.

    python benchmarks/gpu_trace.py --out gpu_trace.json     # one CUDA device (H200: < 10 min)
    python benchmarks/gpu_trace.py --tiny                   # the same code on CPU, in seconds

For every prompt length: the memory footprint (kvcouple.tracer.memory, branch batch ``auto``), the
coupled trace's generated tokens per second (at the shortest length also in the joint cache
layout, against the shared one ``auto`` picks) (both sides counted, prefill and selection
included), ``generate``'s at the same batch ``2R`` and the same prompt, their ratio, and the
trace's peak device memory (less the weights) against the plan's peak. Everything goes into
one JSON (printed, and written to ``--out``) with the run's wall time. Then several short
documents (``--short-docs`` of ``--short-length`` tokens) traced as one batch of documents
(``doc_batch``, the shared layout) against one at a time: tokens/s of both and the ratio of
their wall times. Weights are random (no
download): distributions are nearly uniform, which does not change the cost of a step.

The decoding step itself, per prompt length and ``--compile`` mode (``off`` and ``graphs`` by
default on CUDA): milliseconds per step of the tracer's overlap path (2R rows) and of
``generate`` on the same 2R rows, each marginal over two horizons (``--decode-horizons``), so
prefill, selection and setup drop out; tokens/s from them; and the weight-read floor, the
weights' bytes over the device's measured copy bandwidth (a step cannot read its weights
faster). Needs only the kvcouple wheel with torch and transformers: no zarr (nothing is
written to a store), no network.
``generate`` running out of memory is recorded, not fatal; lengths left when ``--budget-s`` is
spent are recorded as skipped. The eager step is measured at every length first, the compiled
modes after (shortest prompt first), so that their compilation does not cost the longer
prompts' measurements.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from typing import Any

import numpy as np
import torch


def build_model(tiny: bool, device: torch.device, dtype: torch.dtype) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    if tiny:
        shape: dict[str, Any] = dict(
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


def short_documents(
    model: Any,
    policy: Any,
    settings: Any,
    count: int,
    length: int,
    rng: np.random.Generator,
    device: torch.device,
) -> dict[str, Any]:
    """``count`` documents of ``length`` tokens traced as one batch of documents and one at a
    time (the same records to float noise): tokens/s of both."""
    from kvcouple.tracer.batches import trace_documents_records
    from kvcouple.tracer.memory import loaded_footprints

    vocab = model.config.vocab_size
    prompts = [rng.integers(2, vocab, length).tolist() for _ in range(count)]
    plans = loaded_footprints(model, [(f"s{i}", length) for i in range(count)], [policy], settings)
    docs = [
        (torch.tensor(p), i, f"s{i}", replace(settings, branch_batch=plan.branch_batch))
        for i, (p, plan) in enumerate(zip(prompts, plans, strict=True))
    ]
    out: dict[str, Any] = {"documents": count, "prompt_tokens": length}
    for name, batches in (("batched", [docs]), ("one_at_a_time", [[d] for d in docs])):
        synchronize(device)
        t0 = time.perf_counter()
        tokens = sum(
            doc.generated_tokens
            for batch in batches
            for doc in trace_documents_records(model, batch, [policy], seed=1)
        )
        synchronize(device)
        seconds = time.perf_counter() - t0
        out.update({f"{name}_s": seconds, f"{name}_tokens_per_s": tokens / seconds})
    # The same documents and records either way: the ratio of wall times (token counts differ,
    # since a batch of branches counts the steps its shorter rows wait).
    out["ratio"] = out["one_at_a_time_s"] / out["batched_s"]
    return out


def guarded_short_documents(*args: Any) -> dict[str, Any]:
    """:func:`short_documents`, a failure recorded rather than raised (the JSON so far is kept)."""
    try:
        return short_documents(*args)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {str(e)[:800]}"}


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second the device moves in a large copy (read plus write), best of five."""
    size = (1 << 30) if device.type == "cuda" else (64 << 20)
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    best = float("inf")
    for _ in range(5):
        synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        best = min(best, time.perf_counter() - t0)
    del src, dst
    return 2 * size / best


def marginal_ms(run: Any, horizons: tuple[int, int], device: torch.device) -> float:
    """Milliseconds per decoding step of ``run(horizon)``: the difference of two horizons'
    wall times over the difference of the horizons (prefill and setup drop out)."""
    h1, h2 = horizons
    times = []
    for h in (h1, h2):
        synchronize(device)
        t0 = time.perf_counter()
        run(h)
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return 1e3 * max(times[1] - times[0], 0.0) / (h2 - h1)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    doc = __doc__ or ""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="small config on CPU (a quick check)")
    ap.add_argument("--prompts", type=_ints, default=None, help="prompt lengths, comma-separated")
    ap.add_argument("--horizon", type=int, default=None, help="T (default 256; tiny 8)")
    ap.add_argument("--replicates", type=int, default=None, help="R (default 8; tiny 2)")
    ap.add_argument("--branches", type=int, default=4, help="K")
    ap.add_argument("--window", type=int, default=None, help="L (default 32; tiny 4)")
    ap.add_argument("--policy", default="snapkv:retain=0.5")
    ap.add_argument("--short-docs", type=int, default=None, help="documents (default 8; tiny 3)")
    ap.add_argument("--short-length", type=int, default=None, help="tokens (default 1024; tiny 32)")
    ap.add_argument(
        "--compile",
        default=None,
        help="compile modes of the decoding step, comma-separated (default off,graphs; tiny off)",
    )
    ap.add_argument(
        "--decode-horizons",
        type=_ints,
        default=None,
        help="two horizons for ms per step (default 8,40; tiny 2,6)",
    )
    ap.add_argument("--budget-s", type=float, default=540.0, help="skip lengths after this")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)

    from kvcouple.policies import parse_policy
    from kvcouple.tracer import TraceSettings, lse_attention, trace_document
    from kvcouple.tracer.memory import ModelShape, loaded_footprints
    from kvcouple.tracer.provenance import device_name

    wall = time.perf_counter()
    tiny = args.tiny
    device = torch.device("cpu" if tiny else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --tiny for the CPU-size check")
    dtype = torch.float32 if tiny else torch.bfloat16
    lengths = args.prompts or ([64, 128] if tiny else [4096, 16384, 32768])
    T = args.horizon or (8 if tiny else 256)
    R = args.replicates or (2 if tiny else 8)
    L = args.window if args.window is not None else (4 if tiny else 32)
    settings = TraceSettings(horizon=T, replicates=R, branches=args.branches, window=L)
    policy = parse_policy(args.policy)
    modes = (args.compile or ("off" if tiny else "off,graphs")).split(",")
    for mode in modes:
        TraceSettings(horizon=1, compile=mode)  # type: ignore[arg-type]  (validates)
    h1, h2 = args.decode_horizons or ([2, 6] if tiny else [8, 40])
    if not 0 < h1 < h2:
        raise SystemExit(f"--decode-horizons must be 0 < h1 < h2, got {h1},{h2}")

    model = build_model(tiny, device, dtype)
    shape = ModelShape.of_model(model)
    # cascade attention's kernel here (CUDA: the memory-efficient kernel, once it passed its
    # self-check on this device; else the matrix products)
    attention_path = lse_attention.fused_path(device, dtype, shape.head_dim)
    # one document's P and Q rows as the kernel's batch (checked on the device; else per head)
    sides_batched = lse_attention.sides_batched(device, dtype, shape.head_dim)
    vocab = model.config.vocab_size
    rng = np.random.default_rng(0)
    built_s = time.perf_counter() - wall
    print(
        f"model built in {built_s:.1f} s: {shape.weight_bytes / 2**30:.2f} GiB of weights, "
        f"{dtype}, {device_name(device)}; cascade attention: {attention_path}"
        f"{' (one document: sides batched)' if sides_batched else ''}",
        flush=True,
    )

    def run_trace(prompt: list[int], run: TraceSettings) -> tuple[float, int]:
        synchronize(device)
        t0 = time.perf_counter()
        _, tokens = trace_document(model, prompt, [policy], run, seed=1)
        synchronize(device)
        return time.perf_counter() - t0, tokens

    def run_generate(prompt: list[int], horizon: int) -> float:
        ids = torch.tensor([prompt] * (2 * R), device=device)
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

    bandwidth = copy_bandwidth(device)
    floor_ms = 1e3 * shape.weight_bytes / bandwidth
    print(
        f"copy bandwidth {bandwidth / 1e9:.1f} GB/s: weight-read floor {floor_ms:.2f} ms/step",
        flush=True,
    )

    def decode_step(
        prompt: list[int], which: list[str], gen_ms: float | None = None
    ) -> dict[str, Any]:
        """ms per decoding step of the overlap path (one branch of lag 0 per replicate, the
        same at both horizons) per compile mode of ``which``, and of generate on 2R rows
        (measured unless ``gen_ms`` gives it)."""
        out: dict[str, Any] = {"horizons": [h1, h2], "floor_ms": floor_ms}
        for mode in which:
            run = TraceSettings(horizon=h1, replicates=R, branches=1, window=0, compile=mode)

            def trace_h(h: int, run: TraceSettings = run) -> None:
                trace_document(model, prompt, [policy], replace(run, horizon=h), seed=1)

            try:
                t0 = time.perf_counter()
                trace_h(h1)  # warm-up (and the compilation, for a compiled mode)
                if mode != "off":
                    # Each horizon is its own cache capacity, so its own shape: compile both
                    # before timing (else the second horizon's compilation counts as steps).
                    trace_h(h2)
                warmup_s = time.perf_counter() - t0
                ms = marginal_ms(trace_h, (h1, h2), device)
            except Exception as e:  # a mode that fails on this device is recorded, not fatal
                out[mode] = {"error": f"{type(e).__name__}: {str(e)[:800]}"}
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            out[mode] = {
                "trace_ms_per_step": ms,
                "trace_tokens_per_s": 2 * R * 1e3 / ms if ms > 0 else None,
                "over_floor": ms / floor_ms,
                "warmup_s": warmup_s,
            }
        if attention_path != "matrix" and "off" in which:
            # The eager step again with cascade attention's matrix path forced: what the fused
            # kernel buys, side by side (the first H200 run had only the matrix path).
            lse_attention.FORCE_MATRIX = True
            try:
                run = TraceSettings(horizon=h1, replicates=R, branches=1, window=0)
                ms = marginal_ms(
                    lambda h: trace_document(
                        model, prompt, [policy], replace(run, horizon=h), seed=1
                    ),
                    (h1, h2),
                    device,
                )
                forced = {"trace_ms_per_step": ms, "over_floor": ms / floor_ms}
            except Exception as e:
                forced = {"error": f"{type(e).__name__}: {str(e)[:800]}"}
            finally:
                lse_attention.FORCE_MATRIX = False
            out["off_matrix_attention"] = forced
        if gen_ms is None:
            gen_ms = marginal_ms(lambda h: run_generate(prompt, h), (h1, h2), device)
        out["generate_ms_per_step"] = gen_ms
        out["generate_tokens_per_s"] = 2 * R * 1e3 / gen_ms if gen_ms > 0 else None
        for mode in [*which, "off_matrix_attention"]:
            if "trace_ms_per_step" in out.get(mode, {}):
                ms = out[mode]["trace_ms_per_step"]
                out[mode]["ratio_to_generate"] = gen_ms / ms if ms > 0 else None
        return out

    warm = rng.integers(2, vocab, min(lengths)).tolist()
    run_trace(warm, TraceSettings(horizon=2, replicates=R, branches=1, window=1))  # kernels
    run_generate(warm, 2)

    results: list[dict[str, Any]] = []

    def report_now(short: dict[str, Any], partial: bool) -> dict[str, Any]:
        """The JSON so far; written to ``--out`` after every prompt length too, so that a run
        cut short (the device's time spent) still leaves what it measured."""
        report = {
            "device": device_name(device),
            "dtype": str(dtype).removeprefix("torch."),
            "torch_version": torch.__version__,
            "model": {
                "layers": shape.layers,
                "kv_heads": shape.kv_heads,
                "head_dim": shape.head_dim,
                "vocab": shape.vocab,
                "weight_bytes": shape.weight_bytes,
            },
            "settings": {"R": R, "K": args.branches, "L": L, "T": T, "policy": policy.spec()},
            "compile_modes": modes,
            "attention_path": attention_path,
            "sides_batched": sides_batched,
            "copy_bandwidth_bytes_per_s": bandwidth,
            "weight_read_floor_ms": floor_ms,
            "model_build_s": built_s,
            "results": results,
            "short_documents": short,
            "wall_s": time.perf_counter() - wall,
        }
        if partial:
            report["partial"] = True
        if args.out:
            with open(args.out, "w") as f:
                f.write(json.dumps(report, indent=1) + "\n")
        return report

    # Eager first at every length, then the compiled modes (their compilation is minutes on an
    # 8B model): a lent GPU's budget measures every length before it compiles anything.
    eager = [m for m in modes if m == "off"]
    compiled = [m for m in modes if m != "off"]
    prompts: dict[int, list[int]] = {}

    def print_decode(n: int, decode: dict[str, Any], which: list[str]) -> None:
        for mode in [*which, "off_matrix_attention"]:
            step = decode.get(mode)
            if step is not None and "error" in step:
                print(f"  prompt {n}, decode, compile {mode}: failed: {step['error'][:300]}")
            elif step is not None:
                print(
                    f"  prompt {n}, decode, compile {mode}: {step['trace_ms_per_step']:.2f} "
                    f"ms/step ({step['over_floor']:.1f}x the weight-read floor), generate "
                    f"{decode['generate_ms_per_step']:.2f} ms/step",
                    flush=True,
                )

    for n in lengths:
        if time.perf_counter() - wall > args.budget_s:
            results.append({"prompt_tokens": n, "skipped": "time budget spent"})
            continue
        prompt = prompts[n] = rng.integers(2, vocab, n).tolist()
        (plan,) = loaded_footprints(model, [(f"n{n}", n)], [policy], settings)
        row: dict[str, Any] = {
            "prompt_tokens": n,
            "branch_batch": plan.branch_batch,
            "plan_peak_bytes": plan.peak,
            "plan_phase": plan.phase,
            "cache_layout": plan.layout,
            "plan_budget_bytes": plan.budget,
        }
        if device.type == "cuda":
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        try:
            trace_s, tokens = run_trace(prompt, settings)
        except Exception as e:  # out of memory (the plan was wrong) or a failure: record, go on
            row["trace_error"] = f"{type(e).__name__}: {str(e)[:800]}"
            results.append(row)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            report_now({"skipped": "not reached yet"}, partial=True)
            continue
        row.update(trace_s=trace_s, trace_tokens=tokens, trace_tokens_per_s=tokens / trace_s)
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device) - base
            row.update(peak_bytes=peak, peak_over_plan=peak / plan.peak)
        else:
            row.update(peak_bytes=None, peak_over_plan=None)
        if n == min(lengths) and plan.layout == "shared":
            # The shared layout trades bytes for kernel launches: at the shortest prompt, where
            # launches weigh most, the joint layout side by side (the data for `auto`).
            try:
                joint_s, joint_tokens = run_trace(prompt, replace(settings, cache_layout="joint"))
                row.update(joint_trace_tokens_per_s=joint_tokens / joint_s)
                row["shared_over_joint"] = (
                    row["trace_tokens_per_s"] / row["joint_trace_tokens_per_s"]
                )
            except torch.cuda.OutOfMemoryError:
                row["joint_error"] = "out of memory"
                torch.cuda.empty_cache()
        try:
            gen_s = run_generate(prompt, T)
            row.update(generate_s=gen_s, generate_tokens_per_s=2 * R * T / gen_s)
            row["ratio"] = row["trace_tokens_per_s"] / row["generate_tokens_per_s"]
        except torch.cuda.OutOfMemoryError:
            row.update(generate_s=None, generate_tokens_per_s=None, ratio=None)
            row["generate_error"] = f"out of memory at batch {2 * R}"
        try:
            row["decode"] = decode_step(prompt, eager)
        except Exception as e:  # (each compile mode's own failure is recorded inside)
            row["decode"] = {"error": f"{type(e).__name__}: {str(e)[:800]}"}
        if device.type == "cuda":
            torch.cuda.empty_cache()
        results.append(row)
        report_now({"skipped": "not reached yet"}, partial=True)
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.2f}x"
        over = "-" if row["peak_over_plan"] is None else f"{row['peak_over_plan']:.2f}"
        print(
            f"prompt {n}: trace {row['trace_tokens_per_s']:.0f} tokens/s, ratio to generate "
            f"{ratio}, peak/plan {over}, branch batch {plan.branch_batch}, {plan.layout} layout",
            flush=True,
        )
        print_decode(n, row["decode"], eager)

    # The compiled modes, shortest prompt first, while the budget lasts (generate's ms per
    # step is the eager pass's, measured on the same rows).
    for row in results:
        decode = row.get("decode")
        if not compiled or decode is None or "generate_ms_per_step" not in decode:
            continue
        n = row["prompt_tokens"]
        if time.perf_counter() - wall > args.budget_s:
            for mode in compiled:
                decode[mode] = {"skipped": "time budget spent"}
            continue
        try:
            more = decode_step(prompts[n], compiled, decode["generate_ms_per_step"])
            decode.update({m: more[m] for m in compiled if m in more})
        except Exception as e:
            decode.update({m: {"error": f"{type(e).__name__}: {str(e)[:800]}"} for m in compiled})
        report_now({"skipped": "not reached yet"}, partial=True)
        print_decode(n, decode, compiled)

    short: dict[str, Any] = {"skipped": "time budget spent"}
    if time.perf_counter() - wall <= args.budget_s:
        short = guarded_short_documents(
            model,
            policy,
            settings,
            args.short_docs or (3 if tiny else 8),
            args.short_length or (32 if tiny else 1024),
            rng,
            device,
        )
    if "ratio" in short:
        print(
            f"{short['documents']} documents of {short['prompt_tokens']} tokens: "
            f"{short['batched_tokens_per_s']:.0f} tokens/s as one batch, "
            f"{short['one_at_a_time_tokens_per_s']:.0f} one at a time ({short['ratio']:.2f}x "
            "faster as one batch)",
            flush=True,
        )

    report = report_now(short, partial=False)
    print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
