"""Warm scale-up (deploy/serve/warm_up.py): the prefixes a replica's prefix hits reused most
(``BlockManager.hot_prefixes``) and a new replica prefilled with them.

The issue's goal, checked without Serve's scaling (the same engine calls, in process): under the routing
benchmark's independent workload (8 system prompts x 16 questions), a replica warmed with an old one's
hot prefixes hits the prefix cache on its first 20 requests within 10 points of the old replica, and far
above a cold one. The Serve path (a new replica asking a running one through the deployment handle) runs
in test_failover_serve.py's app."""

from __future__ import annotations

import asyncio

import pytest
from helpers.tiny_models import save_tiny_llama
from pagedray.block_manager import BlockManager
from pagedray.deploy.serve.served_engine import ServedEngine
from pagedray.workers.contract.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from pagedray.workers.contract.sampling_params import SamplingParams

from benchmarks.routing import workload


def _register(bm: BlockManager, seq_id: int, tokens: list[int]) -> None:
    bm.allocate_slots(seq_id, tokens, len(tokens) - bm.num_cached_prefix_tokens(tokens))


def test_hot_prefixes_rank_reused_prefixes_within_the_budget():
    bm = BlockManager(block_size=4, num_blocks=64)
    a, b = list(range(100, 112)), list(range(200, 208))      # 3 and 2 blocks
    _register(bm, 0, a + [1])                              # computes and caches a's blocks
    _register(bm, 1, b + [2])
    for i in range(3):
        _register(bm, 10 + i, a + [3 + i, 4])              # 3 hits on all of a
    _register(bm, 20, b[:4] + [9, 9, 9, 9, 9])             # 1 hit on b's first block
    _register(bm, 21, b + [5])                             # 1 hit on all of b
    assert bm.hot_prefixes(100) == [a, b]                  # b[:4] lies inside b: left out
    assert bm.hot_prefixes(12) == [a] and bm.hot_prefixes(11) == [b] and bm.hot_prefixes(0) == []
    with pytest.raises(ValueError, match="max_tokens"):
        bm.hot_prefixes(-1)
    for seq_id in (0, 1, 10, 11, 12, 20, 21):
        bm.free(seq_id)
    bm.allocate_slots(99, list(range(300, 300 + 4 * 64)), 4 * 64)   # takes every block: evicts all cached
    assert bm.hot_prefixes(100) == []
    bm.check_invariants()


def test_a_warmed_replica_hits_its_first_requests_like_the_old_one(tmp_path, default_model_path):
    from transformers import AutoTokenizer

    path = save_tiny_llama(tmp_path / "tiny")
    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    prompts = [[t % 500 for t in prompt] for prompt in workload(tokenizer, 96, seed=3)]   # tiny vocab: 512
    config = EngineConfig(model=ModelConfig(model=path, dtype="float32"),
                          cache=CacheConfig(block_size=16, num_blocks=256),
                          parallel=ParallelConfig(executor="local", threads_per_worker=1),
                          scheduler=SchedulerConfig(max_queued_requests=3))   # the warm-up keeps within it
    params = SamplingParams(max_tokens=1, temperature=0)

    async def serve(engine: ServedEngine, batch: list[list[int]], tag: str) -> float:
        """Runs ``batch`` (3 at a time); the prefix hit rate of those requests."""
        before = await engine.stats()
        async def one(i, prompt):
            async for _ in engine.generate(f"{tag}-{i}", prompt, params):
                pass

        for start in range(0, len(batch), 3):
            await asyncio.gather(*(one(start + i, p) for i, p in enumerate(batch[start:start + 3])))
        after = await engine.stats()
        return ((after.prefix_hit_tokens_total - before.prefix_hit_tokens_total)
                / (after.prefix_query_tokens_total - before.prefix_query_tokens_total))

    async def main():
        old, new, cold = ServedEngine(config), ServedEngine(config), ServedEngine(config)
        try:
            await serve(old, prompts[:100], "history")
            hot = await old.hot_prefixes(8192)
            warmed = await new.warm_up(hot)
            rates = [await serve(engine, prompts[100:120], name)
                     for engine, name in ((old, "old"), (new, "new"), (cold, "cold"))]
            return hot, warmed, rates
        finally:
            for engine in (old, new, cold):
                await engine.close()

    hot, warmed, (old_rate, new_rate, cold_rate) = asyncio.run(main())
    assert len(hot) == 8 and warmed == (sum(map(len, hot)), 0) and warmed[0] <= 8192   # the 8 system prompts
    assert new_rate >= old_rate - 0.10, (old_rate, new_rate)
    assert cold_rate < new_rate - 0.3, (cold_rate, new_rate)
