"""Benchmark 4: how many sequences run concurrently at a fixed KV budget: paged blocks vs a contiguous
max_model_len preallocation per sequence.

The KV budget is ``num_blocks * block_size`` token slots. The contiguous peer reserves max_model_len
slots per admitted sequence (what a static KV cache does), so it runs ``budget // max_model_len``
sequences at once. The paged run drives the real Scheduler + BlockManager through a synthetic
workload (sampled tokens are stand-ins: admission depends on lengths only, not on token values)
and records the number of running sequences at each step.

Workload (fixed seed): 512 requests, prompt lengths uniform in [32, 2*mean_prompt-32], max_tokens uniform
in [16, 2*mean_output-16]; mean total length <= max_model_len / 4 by default.

A third system, ``paged 8-bit KV``, holds the same bytes in 8-bit rows (``kv_cache_dtype`` int8 / fp8_e4m3:
a row of ``--head-dim`` codes plus its float16 scale, against ``--head-dim`` bf16 values): its block count
is the budget's bytes over an 8-bit block's (``workers.kv_cache.KVCacheSpec``, the engine's own count).

Every system runs ``--rounds`` times in alternating order (``benchmarks.rounds``), like every
comparison script; the counts depend on lengths only, so their spread is 0 -- a non-zero spread would mean
the simulation is not deterministic. The table shows the per-round ratios paged / contiguous and 8-bit /
16-bit (goal of #37: 2x, within the scales' overhead).

Usage: ``python -m benchmarks.kv_memory [--rounds 3] [--max-model-len 2048] [--num-blocks 2048]``
(or ``python benchmarks/kv_memory.py ...``)
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

if not __package__:  # `python benchmarks/<name>.py`: import from the repo root, not from benchmarks/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from pagedray.block_manager import BlockManager
from pagedray.cluster.scheduler import Scheduler
from pagedray.workers.contract.config import SchedulerConfig
from pagedray.workers.contract.sampling_params import SamplingParams
from pagedray.workers.contract.wire import SampledToken

from benchmarks.common import add_round_args, finish_rounds, print_run
from benchmarks.rounds import Metric, Ratio, run_rounds

CONTIGUOUS, PAGED, PAGED_8BIT = "contiguous max_model_len", "paged", "paged 8-bit KV"
METRICS = [Metric("peak_concurrent", "peak concurrent"),
           Metric("mean_concurrent_first_half", "mean concurrent (first half)"),
           Metric("mean_kv_usage_first_half", "mean KV usage (first half)"),
           Metric("preemptions", higher_is_better=False), Metric("steps", higher_is_better=False)]
RATIOS = [Ratio(PAGED, (CONTIGUOUS,), ("peak_concurrent", "mean_concurrent_first_half")),
          Ratio(PAGED_8BIT, (PAGED,), ("peak_concurrent", "mean_concurrent_first_half"))]


def run_paged(lengths, block_size: int, num_blocks: int, max_model_len: int) -> dict:
    bm = BlockManager(block_size, num_blocks, enable_prefix_caching=False, watermark=0.01)
    sched = Scheduler(SchedulerConfig(max_num_seqs=1024, max_num_batched_tokens=8192, max_queued_requests=10_000),
                      bm, max_model_len=max_model_len)
    rng = random.Random(1)
    for i, (prompt_len, max_tokens) in enumerate(lengths):
        sched.enqueue(str(i), [rng.randrange(3, 30000) for _ in range(prompt_len)],
                          SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    running, usage = [], []
    while sched.has_unfinished():
        out = sched.schedule()
        running.append(sched.num_running)
        usage.append(bm.usage)
        sched.update(out, [SampledToken(s.seq.seq_id, 5) for s in out.scheduled if s.samples])
    steady = running[: max(1, len(running) // 2)]   # first half: the queue is still full
    return {"peak_concurrent": max(running), "mean_concurrent_first_half": statistics.mean(steady),
            "mean_kv_usage_first_half": statistics.mean(usage[: len(steady)]), "steps": len(running),
            "preemptions": sched.num_preemptions}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_round_args(parser, "kv_memory")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--num-blocks", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--mean-prompt", type=int, default=384)
    parser.add_argument("--mean-output", type=int, default=96)
    parser.add_argument("--num-requests", type=int, default=512)
    parser.add_argument("--head-dim", type=int, default=128, help="KV head size (sets the 8-bit row's overhead)")
    args = parser.parse_args(argv)
    rng = random.Random(0)
    lengths = [(rng.randint(32, 2 * args.mean_prompt - 32), rng.randint(16, 2 * args.mean_output - 16))
               for _ in range(args.num_requests)]
    mean_len = statistics.mean(p + o for p, o in lengths)
    budget = args.num_blocks * args.block_size
    contiguous = budget // args.max_model_len
    blocks_8bit = eight_bit_blocks(args.num_blocks, args.block_size, args.head_dim)

    def measure(system: str, _round: int) -> dict:
        if system == CONTIGUOUS:  # max_model_len slots reserved per sequence: a fixed number at once
            return {"peak_concurrent": contiguous, "mean_concurrent_first_half": contiguous}
        num_blocks = blocks_8bit if system == PAGED_8BIT else args.num_blocks
        return run_paged(lengths, args.block_size, num_blocks, args.max_model_len)

    print(f"KV budget {budget} slots, max_model_len {args.max_model_len}, mean sequence length {mean_len:.0f} "
          f"({mean_len / args.max_model_len:.2f} x max_model_len); the same bytes hold {blocks_8bit} blocks "
          f"of 8-bit rows (head_dim {args.head_dim})")
    runs = run_rounds([CONTIGUOUS, PAGED, PAGED_8BIT], args.rounds, measure, on_run=print_run)
    return finish_rounds("kv_memory", args.out, runs, METRICS, RATIOS, vars(args),
                         {"mean_length": mean_len, "kv_budget_slots": budget, "blocks_8bit": blocks_8bit})


def eight_bit_blocks(num_blocks: int, block_size: int, head_dim: int) -> int:
    """Blocks of 8-bit rows in the bytes of ``num_blocks`` bf16 blocks (one layer, one KV head: the ratio
    does not depend on them)."""
    import torch
    from pagedray.workers.kv_cache import KVCacheSpec

    bf16 = KVCacheSpec(1, block_size, 1, head_dim, torch.bfloat16)
    return KVCacheSpec(1, block_size, 1, head_dim, torch.int8).blocks_for_bytes(num_blocks * bf16.bytes_per_block)


if __name__ == "__main__":
    main()
