"""Benchmark 5 (CUDA GPU): the nano-vllm throughput shape on a Qwen3-0.6B-shaped random-weight model.

256 sequences, prompt and output lengths uniform in [100, 1024] (fixed seed, random token ids),
ignore EOS, greedy; pagedray LLM through the in-process LocalExecutor in bfloat16, then HF
transformers continuous batching (the manager ``generate_batch`` wraps, with per-request
max_new_tokens) on the same data in the same script. Prints output tokens/s and the ratio.
Goal on an H100: >= 12,000 output tokens/s for pagedray.

``--dry-run``: a tiny Qwen3-shaped model, 8 sequences of lengths in [8, 32], on CPU in float32, to check
that the script works where there is no GPU (the numbers then mean nothing).

Usage: ``python -m benchmarks.gpu_engine [--dry-run] [--num-seqs 256] [--skip-hf]``
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

if not __package__:  # `python benchmarks/<name>.py`: import from the repo root, not from benchmarks/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.common import Timer, hf_continuous_batching, print_table, write_json

QWEN3_0_6B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
                  rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=True)
TINY = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=True)


def save_random_qwen3(folder: str, shape: dict, dtype) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**shape, bos_token_id=0, eos_token_id=1)).to(dtype)
    model.save_pretrained(folder)


def workload(num: int, low: int, high: int, vocab: int, seed: int = 0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(2, vocab) for _ in range(rng.randint(low, high))] for _ in range(num)]
    outputs = [rng.randint(low, high) for _ in range(num)]
    return prompts, outputs


def run_pagedray(folder: str, prompts, outputs, dtype: str, device: str) -> dict:
    from pagedray.cluster import LLM, SamplingParams

    llm = LLM(folder, dtype=dtype, device=device, max_num_seqs=256, max_num_batched_tokens=16384)
    try:
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)   # warm-up
        params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in outputs]
        with Timer() as t:
            results = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()
    produced = sum(len(r.outputs[0].token_ids) for r in results)
    return {"seconds": t.seconds, "output_tokens": produced, "output_tok_s": produced / t.seconds}


def run_hf(folder: str, prompts, outputs, torch_dtype, device: str) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype).to(device).eval()
    run = hf_continuous_batching(model, prompts, outputs, pad_token_id=0, timeout_s=1200)
    return {**run, "output_tok_s": run["output_tokens"] / run["seconds"]}


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--num-seqs", type=int, default=None)
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()
    if args.dry_run:
        shape, num, low, high, dtype, device = TINY, args.num_seqs or 8, 8, 32, "float32", "cpu"
    else:
        if not torch.cuda.is_available():
            raise SystemExit("benchmarks.gpu_engine needs a CUDA GPU (use --dry-run to check the script on CPU)")
        shape, num, low, high, dtype, device = QWEN3_0_6B, args.num_seqs or 256, 100, 1024, "bfloat16", "cuda"
    torch_dtype = getattr(torch, dtype)
    prompts, outputs = workload(num, low, high, shape["vocab_size"])
    runs = {}
    with tempfile.TemporaryDirectory(prefix="pagedray-qwen3-") as folder:
        save_random_qwen3(folder, shape, torch_dtype)
        runs["pagedray_local"] = run_pagedray(folder, prompts, outputs, dtype, device)
        if not args.skip_hf:
            try:
                runs["hf_generate_batch"] = run_hf(folder, prompts, outputs, torch_dtype, device)
            except Exception as exc:  # recorded in the table and the JSON, not hidden
                runs["hf_generate_batch"] = {"error": f"{type(exc).__name__}: {exc}"}
    hf = runs.get("hf_generate_batch", {})
    if "output_tok_s" in hf:
        runs["pagedray_local"]["vs_hf_generate_batch"] = runs["pagedray_local"]["output_tok_s"] / hf["output_tok_s"]
    print_table([{"run": k, **v} for k, v in runs.items()],
                ["run", "seconds", "output_tokens", "output_tok_s", "vs_hf_generate_batch", "error"])
    write_json("gpu_dry_run" if args.dry_run else "gpu", {"num_seqs": num, "dtype": dtype, "device": device,
                                                          "dry_run": args.dry_run, "runs": runs})


if __name__ == "__main__":
    main()
