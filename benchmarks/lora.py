"""Serving many LoRA adapters of one model against the base model alone (#63):
``python -m benchmarks.lora [--adapters 8] [--rank 16] [--rounds 3] [--dry-run]``

Workload (fixed seed): ``--num-requests`` prompts of 8-120 random words, ``--max-tokens`` output tokens each
(EOS ignored), greedy, offline ``LLM.generate`` on this machine's default device and dtype, the requests
submitted at once. Systems, interleaved by rounds (``benchmarks.rounds``), each in a fresh ``LLM`` (loading
outside the timing):

- ``base``: the model at its defaults, no LoRA;
- ``lora-on``: ``enable_lora`` with no adapter requested (what enabling LoRA costs by itself: the slots'
  products are part of every step's layers, in the one-call CPU decode and in the CUDA graphs);
- ``lora-N``: ``--adapters`` random adapters of rank ``--rank`` (all seven projections, PEFT files written to
  a temporary folder), ``max_loras`` = N, the requests spread over the adapters round-robin.

Reported: output tok/s median [min-max] and the ratios lora-N / base (the goal: >= 0.8 on CPU, >= 0.85 on GPU
at batch 64) and lora-on / base. ``--random-qwen3``: a random-weight Qwen3-0.6B-shaped model written to a
temporary folder instead of ``--model`` (a lent GPU machine has no model files; the prompts are then random
token ids). ``--dry-run``: SmolLM2's shape is kept but only 4 requests of 4 tokens in 3 rounds, to check the
plumbing; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # `python benchmarks/<name>.py`: import from the repo root, not from benchmarks/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch
from safetensors.torch import save_file

from benchmarks.common import add_round_args, finish_rounds, make_prompts, print_run
from benchmarks.rounds import Metric, Ratio, run_rounds

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION = TARGETS[:4]


def module_shapes(config) -> dict[str, tuple[int, int]]:
    """(in, out) features of each target projection of a Hugging Face decoder config (a hybrid's ``layer_types``:
    its gated q_proj holds a gate row beside each query row)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    gated = 2 if getattr(config, "layer_types", None) and "linear_attention" in config.layer_types else 1
    hidden = config.hidden_size
    inter = getattr(config, "intermediate_size", None) or config.moe_intermediate_size   # a MoE: one expert's
    return {"q_proj": (hidden, gated * q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def save_random_adapter(folder, model_path: str, targets, rank: int, alpha: float, seed: int,
                        layers=None, rslora: bool = False, std: float = 0.15) -> str:
    """A random LoRA adapter of ``model_path``'s model in PEFT's layout (every layer, or ``layers``; a hybrid's
    attention targets in its full-attention layers only), saved to ``folder``; returns the folder."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    shapes = module_shapes(config)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    kinds = getattr(config, "layer_types", None)
    for layer in layers if layers is not None else range(config.num_hidden_layers):
        for target in targets:
            if target in ATTENTION and kinds and kinds[layer] == "linear_attention":
                continue
            fan_in, fan_out = shapes[target]
            prefix = f"base_model.model.model.layers.{layer}.{'self_attn' if target in ATTENTION else 'mlp'}.{target}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * std
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * std
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets), "bias": "none",
        "use_rslora": rslora, "lora_dropout": 0.0, "base_model_name_or_path": str(model_path),
        "layers_to_transform": None if layers is None else list(layers)}))
    return str(folder)


def measure(system: str, model_path: str, prompts: list[str], max_tokens: int, adapters: list[str],
            rank: int) -> dict:
    from pagedray.cluster import LLM, LoRARequest, SamplingParams

    kwargs = {} if system == "base" else {"enable_lora": True, "max_lora_rank": rank,
                                           "max_loras": max(1, len(adapters))}
    loras = None
    if system.startswith("lora-") and system != "lora-on":
        loras = [LoRARequest(f"adapter{i % len(adapters)}", adapters[i % len(adapters)]) for i in range(len(prompts))]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    with LLM(model_path, **kwargs) as llm:
        llm.generate(prompts[:2], SamplingParams(max_tokens=2), use_tqdm=False,
                     lora_request=None if loras is None else loras[:2])             # warm-up, loads two adapters
        start = time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        seconds = time.perf_counter() - start
    tokens = sum(len(r.outputs[0].token_ids) for r in results)
    return {"output_tok_per_s": tokens / seconds, "seconds": seconds, "dtype": llm.engine.dtype}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="benchmarks.lora", description=__doc__.split("\n\n")[0])
    add_round_args(parser, "lora")
    parser.add_argument("--model", default="default")
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--random-qwen3", action="store_true", help="a random Qwen3-0.6B-shaped model (GPU lease)")
    parser.add_argument("--dry-run", action="store_true", help="4 requests of 4 tokens: the plumbing only")
    args = parser.parse_args(argv)
    from pagedray.workers.weights.default_model import resolve_model_path

    if args.dry_run:
        args.num_requests, args.max_tokens, args.adapters = 4, 4, 2
    lora_system = f"lora-{args.adapters}"
    with tempfile.TemporaryDirectory(prefix="pagedray-lora-bench-") as folder:
        prompts = make_prompts(args.num_requests, 8, 120, args.seed)
        if args.random_qwen3:
            from benchmarks.gpu_engine import QWEN3_0_6B, save_random_qwen3, workload

            model_path = str(Path(folder) / "model")
            save_random_qwen3(model_path, QWEN3_0_6B, torch.bfloat16)
            prompts, _ = workload(args.num_requests, 8, 160, QWEN3_0_6B["vocab_size"], args.seed)
        else:
            model_path = str(resolve_model_path(args.model))
        adapters = [save_random_adapter(Path(folder) / f"a{i}", model_path, TARGETS, args.rank, 2 * args.rank,
                                        seed=100 + i, std=0.02) for i in range(args.adapters)]
        runs = run_rounds(["base", "lora-on", lora_system], args.rounds,
                          lambda system, _: measure(system, model_path, prompts, args.max_tokens, adapters, args.rank),
                          on_run=print_run)
    metrics = [Metric("output_tok_per_s", "output tok/s")]
    ratios = [Ratio(lora_system, ("base",), None, f"{lora_system} / base"), Ratio("lora-on", ("base",), None,
                                                                                    "lora-on / base")]
    out = "/dev/null" if args.dry_run and args.out == parser.get_default("out") else args.out
    return finish_rounds("lora", out, runs, metrics, ratios, vars(args))


if __name__ == "__main__":
    main()
