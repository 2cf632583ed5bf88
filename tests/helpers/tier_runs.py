"""The second KV tier's test pieces: a small random KV cache, and the engine scenario (a prompt, a flood that evicts
its blocks into the tier, then the prompt again)."""

from __future__ import annotations

import random

import torch
from pagedray.cluster import SamplingParams
from pagedray.cluster.engine import Engine
from pagedray.workers.kv_cache import KVCache

from helpers.engine_runs import run_alone

NEW = 8
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


def small_kv_cache(quantized: bool, device: str = "cpu") -> KVCache:
    """[layers 3, 2, blocks 6, block_size 4, heads 2, dim 8] of random bf16, or int8 rows with float16 scales."""
    gen = torch.Generator().manual_seed(0)
    shape = (3, 2, 6, 4, 2, 8)
    if quantized:
        data = torch.randint(-128, 127, shape, generator=gen, dtype=torch.int8)
        return KVCache(data.to(device), torch.rand(shape[:-1], generator=gen).to(torch.float16).to(device))
    return KVCache(torch.randn(shape, generator=gen).to(torch.bfloat16).to(device))


def evict_then_return(engine: Engine, corrupt=None) -> tuple[list[int], list[int], int]:
    """A prompt, a flood that evicts every block it left, then the prompt again with more tokens:
    (that prompt, its tokens, its cached prompt tokens). ``corrupt()`` runs before the return."""
    rng = random.Random(5)
    first = [rng.randrange(2, 500) for _ in range(35)]
    run_alone(engine, "first", first, GREEDY)
    for i in range(3):
        run_alone(engine, f"flood{i}", [rng.randrange(2, 500) for _ in range(60)], GREEDY)
    assert engine.block_manager.num_cached_prefix_tokens(first) == 0       # gone from the cache ...
    assert engine.block_manager.stats().num_tier_blocks > 0                 # ... into the tier
    if corrupt is not None:
        corrupt()
    again = first + [rng.randrange(2, 500) for _ in range(6)]
    tokens, cached = run_alone(engine, "again", again, GREEDY)
    engine.block_manager.check_invariants()
    return again, tokens, cached
