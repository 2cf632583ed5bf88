"""Migration without re-prefill (#65): a replica that Serve removes hands its running requests over with their
KV blocks (``AsyncEngine.drain(hand_over, pack)``), and the failover client's continuation on another replica
imports them: greedy and seeded streams go on token for token, and the new replica finds the prompt and the
output so far in its prefix cache instead of computing them again. Two served engines in one process."""

from __future__ import annotations

import asyncio
import random

import pytest
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


async def _collect(stream, on_token=None) -> list[int]:
    tokens = []
    async for out in stream:
        tokens += out.outputs[0].token_ids if out.outputs else []
        if on_token is not None:
            on_token(len(tokens))
    return tokens


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=200, ignore_eos=True),
                                    SamplingParams(temperature=0.8, seed=3, max_tokens=200, ignore_eos=True)],
                         ids=["greedy", "seeded"])
def test_a_removed_replicas_requests_move_with_their_blocks_and_go_on_exactly(tiny_llama_path, params):
    prompt = [random.Random(9).randrange(2, 500) for _ in range(PROMPT_LEN)]

    async def main():
        single, first, second = _engine(tiny_llama_path), _engine(tiny_llama_path), _engine(tiny_llama_path)
        try:
            expected = await _collect(single.generate("single", prompt, params))
            routing = FirstThenSecond(first, second)
            client = FailoverEngineClient(routing)
            closing = []

            def remove_first_after_four(count: int) -> None:
                if count >= 4 and not closing:   # Serve removes the replica: it hands its requests over
                    closing.append(asyncio.ensure_future(first.close(hand_over=True)))
            tokens = await _collect(client.generate("req", prompt, params), remove_first_after_four)
            await closing[0]
            return expected, tokens, routing.calls, await second.stats()
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
