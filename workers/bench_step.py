"""Per-step host overhead of the ModelRunner vs the forward it feeds (CPU, fp32).

For decode batches of several sizes (every sequence at the same context length), one timed step is
split into: ``prepare`` (mirror update + ``build_batch``: the per-step Python/tensor work of the
runner) and ``forward`` (model forward + LM head at the sampling rows). The ratio prepare / forward
is what matters: it says how much the host-side work of a step adds to the model work of the same
step on the same machine.

    python -m pagedray.workers.bench_step [--model PATH|default|tiny] [--json out.json]

``tiny``: a random 2-layer Llama built with transformers in a temp folder (overhead-dominated);
``default``: SmolLM2-135M-Instruct.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

from ..cluster.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from ..cluster.sampling_params import SamplingParams
from ..cluster.wire import NewSequence, RunningDelta, StepPlan
from .input_batch import build_batch
from .worker import Worker

BLOCK_SIZE = 16
CONTEXT = 128


def _tiny_model(folder: str) -> str:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1000, architectures=["LlamaForCausalLM"])
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def _prefill(worker: Worker, num_seqs: int) -> None:
    blocks = -(-(CONTEXT + 64) // BLOCK_SIZE)
    params = SamplingParams(temperature=0.0)
    new = [NewSequence(i, [7 + i] * CONTEXT, [], 0, CONTEXT, list(range(i * blocks, (i + 1) * blocks)), params)
           for i in range(num_seqs)]
    worker.execute(StepPlan(0, new_seqs=new))


def _time_steps(worker: Worker, num_seqs: int, steps: int) -> tuple[float, float]:
    runner = worker.runner
    prepare = forward = 0.0
    for step in range(1, steps + 1):
        plan = StepPlan(step, running=[RunningDelta(i, 1, [], 11) for i in range(num_seqs)])
        start = time.perf_counter()
        batch = runner.mirror.apply(plan)
        inputs = build_batch(batch, runner.block_size, runner.device)
        middle = time.perf_counter()
        with torch.inference_mode():
            hidden = runner.model(inputs.input_ids, inputs.positions, runner.kv_cache, inputs.meta)
            runner.model.compute_logits(hidden[inputs.logits_indices])
        runner.mirror.mark_computed(batch)
        end = time.perf_counter()
        prepare += middle - start
        forward += end - middle
    return prepare / steps * 1e3, forward / steps * 1e3


def run(model: str, batch_sizes: list[int], steps: int) -> list[dict]:
    rows = []
    for num_seqs in batch_sizes:
        blocks = num_seqs * -(-(CONTEXT + 64) // BLOCK_SIZE)
        config = EngineConfig(model=ModelConfig(model=model), cache=CacheConfig(block_size=BLOCK_SIZE,
                              num_blocks=blocks), parallel=ParallelConfig(threads_per_worker=1))
        worker = Worker(config)
        worker.init_kv_cache(blocks)
        _prefill(worker, num_seqs)
        _time_steps(worker, num_seqs, 3)   # warm-up
        prepare_ms, forward_ms = _time_steps(worker, num_seqs, steps)
        rows.append({"batch": num_seqs, "context": CONTEXT, "prepare_ms": prepare_ms, "forward_ms": forward_ms,
                     "prepare_over_forward": prepare_ms / forward_ms})
        worker.shutdown()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", default="bench_step.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        model = _tiny_model(folder) if args.model == "tiny" else args.model
        rows = run(model, [int(b) for b in args.batch_sizes.split(",")], args.steps)
    print(f"{'batch':>6} {'context':>8} {'prepare ms':>11} {'forward ms':>11} {'prepare/forward':>16}")
    for r in rows:
        print(f"{r['batch']:>6} {r['context']:>8} {r['prepare_ms']:>11.3f} {r['forward_ms']:>11.3f} "
              f"{r['prepare_over_forward']:>16.3f}")
    with open(args.json, "w") as out:
        json.dump({"model": args.model, "threads": 1, "rows": rows}, out, indent=2)


if __name__ == "__main__":
    main()
