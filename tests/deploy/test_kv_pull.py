"""Pull instead of prefill (deploy/serve/kv_pull.py), with two served engines in one process: the routing
summaries and the export call a Serve replica would get from its router are the other engine's own. A prompt
whose prefix the peer holds is pulled and served from the cache with a cold run's tokens; a peer that fails the
export leaves the prompt to be prefilled with the same tokens; measured costs decide later pulls; warm scale-up
pulls the hot prefixes instead of prefilling them."""

from __future__ import annotations

import asyncio
import contextlib
import random

from helpers.hf_oracle import hf_greedy
from pagedray.deploy.serve.kv_pull import PeerPull
from pagedray.deploy.serve.served_engine import ServedEngine
from pagedray.workers.contract.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from pagedray.workers.contract.sampling_params import SamplingParams

BLOCK = 8
NEW = 6
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


def _config(path) -> EngineConfig:
    return EngineConfig(model=ModelConfig(model=path, dtype="float32"),
                        cache=CacheConfig(block_size=BLOCK, num_blocks=64),
                        parallel=ParallelConfig(executor="local", threads_per_worker=1))


@contextlib.asynccontextmanager
async def _two_engines(path):
    """(the peer that holds prefixes, the replica that pulls them): two served engines, closed after."""
    old, new = ServedEngine(_config(path)), ServedEngine(_config(path))
    try:
        yield old, new
    finally:
        await old.close()
        await new.close()


async def _run(engine: ServedEngine, request_id: str, prompt: list[int]) -> tuple[list[int], int]:
    tokens, cached = [], 0
    async for out in engine.generate(request_id, prompt, GREEDY):
        tokens += out.outputs[0].token_ids
        cached = max(cached, out.num_cached_prompt_tokens)
    return tokens, cached


def _peers(old: ServedEngine, new: ServedEngine, fail: bool = False) -> PeerPull:
    """``new``'s PeerPull, whose router would know ``old``'s last summary and send the export there."""
    summaries: list[dict] = []

    async def export(tokens, lora):
        if fail:
            raise ConnectionError("the peer replica died")
        return await old.export_prefix(tokens, lora, exclude="new")

    def refresh(peer_summary: dict, own_summary: dict | None = None) -> None:
        """The router's next poll: the peer's summary and ``new``'s (empty unless given)."""
        summaries[:] = [peer_summary, own_summary or {"replica": "new", "prefix_hashes": [], "healthy": True}]

    pull = PeerPull(new._engine, BLOCK, "new", lambda: summaries, export)
    pull.refresh = refresh
    new._pull = pull
    return pull


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 500) for _ in range(length)]


def test_a_prompt_whose_prefix_a_peer_holds_is_pulled_and_exact(tiny_llama_path, tiny_hf_model):
    shared = _prompt(1, 40)
    first, second, third = shared + _prompt(2, 5), shared + _prompt(3, 5), shared + _prompt(4, 5)

    async def main():
        async with _two_engines(tiny_llama_path) as (old, new):
            await _run(old, "history", first)
            pull = _peers(old, new)
            assert pull.gain(second, None) == 0                  # no summary of the peer yet: nothing known
            pull.refresh(await old.routing_stats("old", 8192))
            assert pull.gain(second, None) == 5                   # the 5 full blocks of the shared 40 tokens
            pulled = await _run(new, "pulled", second)
            assert pull.num_pulls == 1 and pull.num_pulled_blocks == 5 and pull.seconds_per_block > 0
            pull.refresh(await old.routing_stats("old", 8192), await new.routing_stats("new", 8192))
            assert pull.gain(third, None) == 0                   # it holds them now, as its summary says
            return pulled

    tokens, cached = asyncio.run(main())
    assert cached == 40 and tokens == hf_greedy(tiny_hf_model, second, NEW)


def test_a_failed_pull_prefills_with_the_same_tokens(tiny_llama_path, tiny_hf_model):
    shared = _prompt(5, 32)
    prompt = shared + _prompt(6, 4)

    async def main():
        async with _two_engines(tiny_llama_path) as (old, new):
            await _run(old, "history", shared + [7])
            pull = _peers(old, new, fail=True)
            pull.refresh(await old.routing_stats("old", 8192))
            result = await _run(new, "prefilled", prompt)
            assert pull.num_failures == 1 and pull.num_pulls == 0
            return result

    tokens, cached = asyncio.run(main())
    assert cached == 0 and tokens == hf_greedy(tiny_hf_model, prompt, NEW)


def test_measured_costs_decide(tiny_llama_path):
    async def main():
        engine = ServedEngine(_config(tiny_llama_path))
        try:
            pull = PeerPull(engine._engine, BLOCK, "me", lambda: [], None)
            cost = engine._engine.engine.tier_cost
            assert not pull.worth_it(0)
            assert pull.worth_it(3)                            # nothing measured: pull, and measure it
            cost.compute_s_per_token, pull.seconds_per_block = 0.001, 0.004      # a block computes in 8 ms
            assert pull.worth_it(3)
            pull.seconds_per_block = 0.01
            assert not pull.worth_it(3)
        finally:
            await engine.close()

    asyncio.run(main())


def test_warm_scale_up_pulls_the_hot_prefixes(tiny_llama_path):
    prefixes = [_prompt(10 + i, 24) for i in range(3)]

    async def main():
        async with _two_engines(tiny_llama_path) as (old, new):
            for i, prefix in enumerate(prefixes):
                for j in range(2):                                    # reused: hot
                    await _run(old, f"h{i}{j}", prefix + [3 + j])
            hot = await old.hot_prefixes(8192)
            _peers(old, new)
            warmed = await new.warm_up(hot)
            after = [await _run(new, f"a{i}", prefix + [9]) for i, prefix in enumerate(prefixes)]
            return hot, warmed, after

    hot, warmed, after = asyncio.run(main())
    assert sorted(hot) == sorted(prefixes) and warmed == (0, 72)
    assert [cached for _, cached in after] == [24, 24, 24]


def test_prompts_arriving_together_with_one_prefix_share_one_pull(tiny_llama_path, tiny_hf_model):
    shared = _prompt(20, 40)
    prompts = [shared + _prompt(21 + i, 5) for i in range(3)]

    async def main():
        async with _two_engines(tiny_llama_path) as (old, new):
            await _run(old, "history", shared + [7])
            pull = _peers(old, new)
            pull.refresh(await old.routing_stats("old", 8192))
            results = await asyncio.gather(*(_run(new, f"burst-{i}", p) for i, p in enumerate(prompts)))
            return pull, results

    pull, results = asyncio.run(main())
    assert pull.num_pulls == 1 and pull.num_pulled_blocks == 5
    for prompt, (tokens, cached) in zip(prompts, results):
        assert cached == 40 and tokens == hf_greedy(tiny_hf_model, prompt, NEW)
