"""Hybrid attention on CPU: decode throughput of a Qwen3.5-shaped hybrid model against a dense Qwen3 model of the
same size, in one run (issue #67's "done when").

Both models are random-weight, of SmolLM2-135M's shape: vocabulary 49,152 (tied), hidden 576, 30 layers,
intermediate 1,536, 9 query / 3 KV heads of 64. The hybrid (``Qwen3_5ForCausalLM``) makes three of every four
layers Gated DeltaNet (3 key / 9 value heads of 64, a 4-tap convolution; the recurrent state and the convolution
window per sequence, in the state pool) and the fourth gated full attention (partial rotary 0.25); the dense one
(``Qwen3ForCausalLM``) is full attention everywhere. Their parameter counts are printed and written (within a
few per cent of each other).

Workload: ``--num-seqs`` sequences (16) of ``--prompt-len`` random tokens (32), ``--max-tokens`` new tokens each
(128, EOS ignored, greedy), one ``LLM.generate`` call, in process (LocalExecutor, ``--threads`` torch threads),
at ``--dtype`` (``auto``: bfloat16 where the CPU has a fast path). The prompts are short so the time is mostly
decode steps; the metric is output tokens per second of the whole call. Systems interleave over ``--rounds``
rounds (``benchmarks.rounds``); reported: each system's median [min-max], and hybrid / dense per round.

Usage: ``python -m benchmarks.hybrid_decode [--rounds 3] [--num-seqs 16] [--max-tokens 128]``
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # `python benchmarks/<name>.py`: import from the repo root, not from benchmarks/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks import rounds
from benchmarks.common import add_round_args, finish_rounds, print_ratio, print_run

SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
             num_key_value_heads=3, head_dim=64, max_position_embeddings=2048, rms_norm_eps=1e-5,
             tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
LINEAR = dict(linear_num_key_heads=3, linear_num_value_heads=9, linear_key_head_dim=64, linear_value_head_dim=64,
              linear_conv_kernel_dim=4)


def save_models(folder: Path) -> dict[str, tuple[str, int]]:
    """system -> (model folder, parameter count)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig, Qwen3Config

    configs = {"hybrid": Qwen3_5TextConfig(**SHAPE, **LINEAR, architectures=["Qwen3_5ForCausalLM"]),
               "dense": Qwen3Config(**SHAPE, architectures=["Qwen3ForCausalLM"])}
    out = {}
    for system, config in configs.items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        path = folder / system
        model.save_pretrained(str(path))
        out[system] = (str(path), sum(p.numel() for p in model.parameters()))
        del model
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_round_args(parser, "hybrid_decode")
    parser.add_argument("--num-seqs", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args(argv)

    from pagedray.cluster import LLM, SamplingParams

    rng = random.Random(0)
    prompts = [[rng.randrange(3, SHAPE["vocab_size"]) for _ in range(args.prompt_len)] for _ in range(args.num_seqs)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    with tempfile.TemporaryDirectory() as folder:
        models = save_models(Path(folder))
        for system, (_, count) in models.items():
            print(f"{system}: {count / 1e6:.1f}M parameters", flush=True)
        llms = {system: LLM(path, dtype=args.dtype, threads_per_worker=args.threads, max_num_seqs=args.num_seqs,
                            enable_prefix_caching=False) for system, (path, _) in models.items()}
        try:
            for llm in llms.values():                      # warm-up: first-call costs outside the timing
                llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)

            def measure(system: str, _round: int) -> dict:
                start = time.perf_counter()
                results = llms[system].generate(prompts, params, use_tqdm=False)
                seconds = time.perf_counter() - start
                tokens = sum(len(r.outputs[0].token_ids) for r in results)
                return {"output_tok_s": tokens / seconds}

            runs = rounds.run_rounds(list(llms), args.rounds, measure, on_run=print_run)
            dtype = str(next(iter(llms.values())).engine.dtype)
        finally:
            for llm in llms.values():
                llm.shutdown()
    metrics = [rounds.Metric("output_tok_s", "output tok/s")]
    ratios = [rounds.Ratio("hybrid", ("dense",))]
    config = {**vars(args), "dtype_used": dtype, "parameters": {s: count for s, (_, count) in models.items()},
              "shape": SHAPE, "linear": LINEAR}
    report = finish_rounds("hybrid_decode", args.out, runs, metrics, ratios, config)
    print_ratio(report, "hybrid / dense", "output_tok_s", "hybrid / dense decode throughput", "measured, no goal")
    return 1 if any(run.error for run in runs) else 0


if __name__ == "__main__":
    raise SystemExit(main())
