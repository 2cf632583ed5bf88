"""The 2026 families on a GPU, against a dense model of the same shape, in one run (issue #67: "GPU runs of
Gemma 4, the hybrids and gpt-oss"): ``python -m benchmarks.gpu_families [--dry-run] [--rounds 3] [--out PATH]``.

Random-weight models saved by transformers, all at one shape (``SHAPE``: hidden 1024, 12 layers, 16 query / 8
KV heads of 128, vocabulary 32,000), served in process (``LLM``, no Ray) at their defaults on CUDA (bfloat16,
CUDA graphs for decode steps where the family takes them):

- ``dense``: Qwen3 (the reference);
- ``hybrid``: Qwen3.5, three of every four layers Gated DeltaNet (16 key / 32 value heads of 128: Qwen3.5's
  ratio) and gated full attention on the fourth; prefill steps run the chunked Triton delta rule, decode steps
  the recurrent kernel inside the graphs; prefix caching keeps state snapshots;
- ``gpt-oss``: sinks, 128-token windows on alternate layers, 32 biased experts (top 4, expert intermediate 768)
  with the clamped SwiGLU through the grouped Triton MoE; ``gpt-oss-mxfp4``: the same model with its experts
  rounded to MXFP4 in the checkpoint, kept in 4 bits on the GPU;
- ``gemma4``: sliding (1,024-token window, head_dim 256) and full layers (head_dim 512, one KV head with the
  values equal to the keys), five to one, per-layer inputs, soft-capped logits.

Per system and round: ``--num-seqs`` sequences of ``--prompt-len`` random tokens decoding ``--max-tokens`` each
(EOS ignored, greedy): output tokens per second of the whole ``generate``; then one prompt of ``--long-len``
tokens, 1 token out: its time (TTFT, a prefill alone). Systems interleave over ``--rounds`` rounds; reported:
median [min-max] and each family / dense. The JSON also records each system's parameter count, whether decode
graphs were captured, and the KV blocks. Correctness is the ``-m gpu`` tests' (tests/workers/test_worker_gpu.py:
fp32 tokens against transformers, graphs against eager); this script times.

``--dry-run``: tiny shapes on CPU in float32 (no graphs), to check the plumbing where there is no GPU; its
numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # `python benchmarks/<name>.py`: import from the repo root, not from benchmarks/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks import rounds
from benchmarks.common import add_round_args, finish_rounds, print_run

SHAPE = dict(vocab_size=32000, hidden_size=1024, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=16,
             num_key_value_heads=8, head_dim=128, max_position_embeddings=8192, rms_norm_eps=1e-6,
             tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, rms_norm_eps=1e-6,
            tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
SYSTEMS = ("dense", "hybrid", "gpt-oss", "gpt-oss-mxfp4", "gemma4")


def configs(shape: dict) -> dict:
    """system -> transformers config at ``shape`` (the MXFP4 system shares gpt-oss's)."""
    from transformers import Gemma4TextConfig, GptOssConfig, Qwen3_5TextConfig, Qwen3Config

    hidden, layers, head = shape["hidden_size"], shape["num_hidden_layers"], shape["head_dim"]
    heads = shape["num_attention_heads"]
    window = 128 if hidden >= 512 else 8
    linear = dict(linear_num_key_heads=heads, linear_num_value_heads=2 * heads, linear_key_head_dim=head,
                  linear_value_head_dim=head, linear_conv_kernel_dim=4)
    local, full = "sliding_attention", "full_attention"
    gemma_rope = {local: {"rope_type": "default", "rope_theta": 10_000.0},
                  full: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}}
    return {
        "dense": Qwen3Config(**shape, architectures=["Qwen3ForCausalLM"]),
        "hybrid": Qwen3_5TextConfig(**shape, **linear, architectures=["Qwen3_5ForCausalLM"]),
        "gpt-oss": GptOssConfig(**{**shape, "intermediate_size": max(32, shape["intermediate_size"] // 4)},
                                num_local_experts=32, num_experts_per_tok=4, sliding_window=window,
                                layer_types=[local if i % 2 == 0 else full for i in range(layers)],
                                architectures=["GptOssForCausalLM"]),
        "gemma4": Gemma4TextConfig(**{**shape, "head_dim": 2 * head}, global_head_dim=4 * head,
                                   sliding_window=8 * window, rope_parameters=gemma_rope,
                                   layer_types=[full if i % 6 == 5 else local for i in range(layers)],
                                   attention_k_eq_v=True, num_global_key_value_heads=1, num_kv_shared_layers=0,
                                   hidden_size_per_layer_input=max(16, hidden // 16),
                                   vocab_size_per_layer_input=shape["vocab_size"], final_logit_softcapping=30.0,
                                   architectures=["Gemma4ForCausalLM"]),
    }


def save_models(folder: Path, shape: dict, systems: list[str]) -> dict[str, tuple[str, int]]:
    """system -> (model folder, parameter count); random weights in bfloat16 (float32 for tiny shapes)."""
    import torch
    from pagedray.workers.weights.quantization import quantize_mxfp4
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if shape["hidden_size"] >= 512 else torch.float32
    out, built = {}, configs(shape)
    for system in systems:
        config = built[system.removesuffix("-mxfp4")]
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        path = folder / system
        model.save_pretrained(str(path))
        out[system] = (str(path), sum(p.numel() for p in model.parameters()))
        del model
        if system.endswith("-mxfp4"):   # the experts as an MXFP4 checkpoint stores them: blocks and scales
            tensors = load_file(str(path / "model.safetensors"))
            for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
                blocks, scales = quantize_mxfp4(tensors.pop(name))
                tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
            save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
            data = json.loads((path / "config.json").read_text())
            data["quantization_config"] = {"quant_method": "mxfp4"}
            (path / "config.json").write_text(json.dumps(data))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_round_args(parser, "gpu_families")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU, float32, no graphs")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--num-seqs", type=int, default=None, help="default 64 (dry run: 4)")
    parser.add_argument("--prompt-len", type=int, default=None, help="default 512 (dry run: 16)")
    parser.add_argument("--max-tokens", type=int, default=None, help="default 128 (dry run: 8)")
    parser.add_argument("--long-len", type=int, default=None, help="default 4096 (dry run: 64)")
    args = parser.parse_args(argv)
    dry = args.dry_run
    num_seqs, prompt_len = args.num_seqs or (4 if dry else 64), args.prompt_len or (16 if dry else 512)
    max_tokens, long_len = args.max_tokens or (8 if dry else 128), args.long_len or (64 if dry else 4096)
    shape, device, dtype = (TINY, "cpu", "float32") if dry else (SHAPE, "cuda", "auto")
    systems = [s for s in args.systems.split(",") if s]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or "dense" not in systems:
        parser.error(f"--systems: {unknown or 'dense'} (known: {', '.join(SYSTEMS)}; dense is the reference)")

    from pagedray.cluster import LLM, SamplingParams

    rng = random.Random(0)
    vocab = shape["vocab_size"]
    prompts = [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(num_seqs)]
    long_prompt = [rng.randrange(3, vocab) for _ in range(long_len)]
    decode = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    facts: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as folder:
        models = save_models(Path(folder), shape, systems)
        llms = {}
        try:
            for system, (path, count) in models.items():
                memory = {} if dry else {"gpu_memory_utilization": 0.8 / len(models)}   # every engine on one GPU
                llm = LLM(path, device=device, dtype=dtype, max_num_seqs=max(num_seqs, 8),
                          max_model_len=max(long_len, prompt_len + max_tokens) + 16, enable_prefix_caching=False,
                          **memory)
                worker = llm.engine.executor.worker
                facts[system] = dict(parameters=count, decode_graphs=worker.graph_report is not None,
                                     kv_blocks=llm.engine.block_manager.num_blocks, dtype=str(llm.engine.dtype))
                print(f"{system}: {count / 1e6:.1f}M parameters, {facts[system]}", flush=True)
                llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                             use_tqdm=False)                            # warm-up: compiles, first-call costs
                llms[system] = llm

            def measure(system: str, _round: int) -> dict:
                llm = llms[system]
                start = time.perf_counter()
                results = llm.generate(prompts, decode, use_tqdm=False)
                seconds = time.perf_counter() - start
                tokens = sum(len(r.outputs[0].token_ids) for r in results)
                start = time.perf_counter()
                llm.generate([long_prompt], one, use_tqdm=False)
                return {"output_tok_s": tokens / seconds, "long_prefill_s": time.perf_counter() - start}

            runs = rounds.run_rounds(list(llms), args.rounds, measure, on_run=print_run)
        finally:
            for llm in llms.values():
                llm.shutdown()
    metrics = [rounds.Metric("output_tok_s", "output tok/s"),
               rounds.Metric("long_prefill_s", f"{long_len}-token prefill s", higher_is_better=False)]
    ratios = [rounds.Ratio(system, ("dense",)) for system in llms if system != "dense"]
    config = {**vars(args), "num_seqs": num_seqs, "prompt_len": prompt_len, "max_tokens": max_tokens,
              "long_len": long_len, "device": device, "shape": shape}
    finish_rounds("gpu_families", args.out, runs, metrics, ratios, config, {"systems": facts})
    return 1 if any(run.error for run in runs) else 0


if __name__ == "__main__":
    raise SystemExit(main())
