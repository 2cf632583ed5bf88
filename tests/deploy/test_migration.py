"""Migration without re-prefill (#65): a replica that Serve removes hands its running requests over with their
KV blocks (``AsyncEngine.drain(hand_over, pack)``), and the failover client's continuation on another replica
imports them: greedy and seeded streams go on token for token, and the new replica finds the prompt and the
output so far in its prefix cache instead of computing them again. Two served engines in one process."""

from __future__ import annotations

import asyncio
import random

import pytest
from helpers.engine_runs import collect_tokens
from pagedray.deploy.serve.failover import FailoverEngineClient
from pagedray.deploy.serve.served_engine import ServedEngine
from pagedray.workers.contract.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from pagedray.workers.contract.sampling_params import SamplingParams

BLOCK = 8
PROMPT_LEN = 40


def _engine(path) -> ServedEngine:
    return ServedEngine(EngineConfig(model=ModelConfig(model=path, dtype="float32"),
                                     cache=CacheConfig(block_size=BLOCK, num_blocks=128),
                                     parallel=ParallelConfig(executor="local", threads_per_worker=1)))


class FirstThenSecond:
    """The handle's routing, as the failover sees it: the request on the first engine, its continuation on the
    second; what each call carried."""

    def __init__(self, first: ServedEngine, second: ServedEngine) -> None:
        self.engines, self.calls = [first, second], []

    def generate(self, request_id, prompt, params, resume_tokens=(), lora=None, session=None, tenant=None, kv=None):
        engine = self.engines[min(len(self.calls), 1)]
        self.calls.append((list(resume_tokens), kv))
        return engine.generate(request_id, prompt, params, resume_tokens, lora, session, tenant, kv)


async def _removing_first_after_four(first, second, prompt, params, collect):
    """The request through the failover client on ``first``, which Serve removes (it hands its requests over) once
    ``collect``'s count reaches 4: (what ``collect`` returns, the calls the routing saw)."""
    routing = FirstThenSecond(first, second)
    closing = []

    def remove_first_after_four(count: int) -> None:
        if count >= 4 and not closing:
            closing.append(asyncio.ensure_future(first.close(hand_over=True)))
    tokens = await collect(FailoverEngineClient(routing).generate("req", prompt, params), remove_first_after_four)
    await closing[0]
    return tokens, routing.calls


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=200, ignore_eos=True),
                                    SamplingParams(temperature=0.8, seed=3, max_tokens=200, ignore_eos=True)],
                         ids=["greedy", "seeded"])
def test_a_removed_replicas_requests_move_with_their_blocks_and_go_on_exactly(tiny_llama_path, params):
    prompt = [random.Random(9).randrange(2, 500) for _ in range(PROMPT_LEN)]

    async def main():
        single, first, second = _engine(tiny_llama_path), _engine(tiny_llama_path), _engine(tiny_llama_path)
        try:
            expected = await collect_tokens(single.generate("single", prompt, params))
            tokens, calls = await _removing_first_after_four(first, second, prompt, params, collect_tokens)
            return expected, tokens, calls, await second.stats()
        finally:
            await single.close()
            await second.close()

    expected, tokens, calls, second_stats = asyncio.run(main())
    assert tokens == expected
    (_, first_kv), (resumed, kv) = calls
    assert first_kv is None and kv is not None and len(resumed) >= 4
    assert kv.token_ids == (prompt + expected)[:kv.num_blocks * BLOCK] and kv.num_blocks >= PROMPT_LEN // BLOCK
    # the continuation found the prompt and the output so far cached: only the last partial block was computed
    assert second_stats.prefix_hit_tokens_total >= PROMPT_LEN


def test_each_sample_of_a_removed_replicas_n3_request_moves_with_its_own_blocks(tiny_llama_path):
    """n > 1: each unfinished sample goes on as a request of its own (its sibling seed), importing the blocks of
    the prompt and of its own output so far."""
    prompt = [random.Random(21).randrange(2, 500) for _ in range(PROMPT_LEN)]
    params = SamplingParams(n=3, temperature=0.9, seed=4, max_tokens=150, ignore_eos=True)

    async def samples(stream, on_token=None) -> dict[int, list[int]]:
        tokens: dict[int, list[int]] = {}
        async for out in stream:
            for completion in out.outputs:
                tokens.setdefault(completion.index, []).extend(completion.token_ids)
            if on_token is not None:
                on_token(min((len(t) for t in tokens.values()), default=0) if len(tokens) == 3 else 0)
        return tokens

    async def main():
        single, first, second = _engine(tiny_llama_path), _engine(tiny_llama_path), _engine(tiny_llama_path)
        try:
            expected = await samples(single.generate("single", prompt, params))
            tokens, calls = await _removing_first_after_four(first, second, prompt, params, samples)
            return expected, tokens, calls, await second.stats()
        finally:
            await single.close()
            await second.close()

    expected, tokens, calls, second_stats = asyncio.run(main())
    assert tokens == expected and len(set(map(tuple, expected.values()))) == 3
    assert calls[0] == ([], None) and len(calls) == 4          # the request, then one continuation per sample
    for resumed, kv in calls[1:]:
        sample = next(i for i, out in expected.items() if out[:len(resumed)] == resumed)
        assert len(resumed) >= 4 and kv is not None
        assert kv.token_ids == (prompt + expected[sample])[:kv.num_blocks * BLOCK]
    assert second_stats.prefix_hit_tokens_total >= 3 * PROMPT_LEN
